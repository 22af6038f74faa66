//! Public-API tests of the appliance pieces: protocol, closure, builder.

use ember::appliance::builder::{Entry, Tree, build_cached};
use ember::appliance::closure::{GUEST_PATH, closure, find_command};
use ember::appliance::protocol::{Decoder, Kind, encode, exit_code};

/// A scratch directory, removed when the test ends (passed or not).
fn scratch(name: &str) -> ember_testing::TempDir {
    ember_testing::TempDir::new(&format!("api-{name}"))
}

#[test]
fn a_whole_conversation_decodes_byte_by_byte() {
    let mut wire = Vec::new();
    encode(&mut wire, Kind::Ready, b"");
    encode(&mut wire, Kind::Stdout, b"out\x00\xff");
    encode(&mut wire, Kind::Stderr, b"err");
    encode(&mut wire, Kind::Exit, &(-1i32).to_le_bytes());
    let mut d = Decoder::new();
    let mut got = Vec::new();
    for b in &wire {
        d.feed(std::slice::from_ref(b));
        while let Some(f) = d.next_frame().unwrap() {
            got.push(f);
        }
    }
    d.finish().unwrap();
    let kinds: Vec<_> = got.iter().map(|f| f.kind).collect();
    assert_eq!(kinds, [Kind::Ready, Kind::Stdout, Kind::Stderr, Kind::Exit]);
    assert_eq!(got[1].payload, b"out\x00\xff");
    assert_eq!(exit_code(&got[3].payload), Some(-1));
}

#[test]
fn appliance_for_sh_holds_its_loader_and_libc_and_is_cached() {
    let sh = find_command("sh", GUEST_PATH, None).unwrap();
    let mut tree = Tree::skeleton(b"\x7fELF fake init".to_vec(), &[]);
    for f in closure(&sh).unwrap() {
        tree.add_host_path(&f).unwrap();
    }
    let names: Vec<&String> = tree.entries().keys().collect();
    assert!(names.iter().any(|n| n.ends_with("libc.so.6")), "{names:?}");
    assert!(
        names.iter().any(|n| n.contains("ld-linux-x86-64.so.2")),
        "{names:?}"
    );
    // The PT_INTERP path itself resolves inside the appliance: every symlink
    // on it is there and its final target is a file.
    assert!(
        tree.entries()
            .values()
            .any(|e| matches!(e, Entry::File { .. }))
    );

    let cache = scratch("cache");
    let first = build_cached(&tree, "test-kernel", &cache, u64::MAX).unwrap();
    assert!(!first.cached);
    let bytes = std::fs::read(&first.path).unwrap();
    assert!(bytes.starts_with(b"070701"));
    assert!(bytes.windows(4).any(|w| w == b"init"));
    let again = build_cached(&tree, "test-kernel", &cache, u64::MAX).unwrap();
    assert!(again.cached);
    assert_eq!(first.path, again.path);
}
