//! Debian's generic kernel snapshotted at /init and restored twice.

use crate::case::Case;
use crate::rig::rig;

/// The kernel's message when its vmgenid driver saw a new generation ID
/// (`add_vmfork_randomness`, drivers/char/random.c).
const VMFORK_RESEED: &str = "crng reseeded due to virtual machine fork";

/// Debian's generic kernel booted to /init (2 vCPUs, ACPI), snapshotted
/// there through the control socket; the boot case and both restores.
fn snapshot_cases() -> (&'static Case, [&'static Case; 2]) {
    let r = rig();
    if let Err(why) = &r.generic {
        panic!("the snapshot cases need Debian's generic kernel: {why}");
    }
    (
        r.case("snap-boot"),
        [r.case("snap-restore-1"), r.case("snap-restore-2")],
    )
}

#[test]
fn snapshot_at_init_then_two_restores_in_fresh_processes_run_a_command() {
    let (boot, restores) = snapshot_cases();
    assert_eq!(boot.rc, Some(0), "boot and snapshot\n{}", boot.dump());
    assert!(
        boot.out.iter().any(|l| l == "snapshot-rc=0 boot-rc=0"),
        "the snapshot ends the VM with status 0\n{}",
        boot.dump()
    );
    let release = rig().generic.as_ref().unwrap();
    for (n, c) in [6, 7].into_iter().zip(restores) {
        assert_eq!(c.rc, Some(0), "restore {n}\n{}", c.dump());
        assert!(
            c.out
                .iter()
                .any(|l| l.ends_with(&format!("answer-{}", n * 7))),
            "the command did not run\n{}",
            c.dump()
        );
        assert!(
            c.out.iter().any(|l| l.trim() == release),
            "uname -r: the generic kernel {release}\n{}",
            c.dump()
        );
        assert!(
            c.fact("snapshot-ready").is_none() && c.fact("init").is_none(),
            "the guest booted again\n{}",
            c.dump()
        );
        let ms = c
            .out
            .iter()
            .find_map(|l| l.strip_prefix("restore-ms="))
            .unwrap_or("?");
        eprintln!("nested rig: restore {n} to the command's end {ms} ms (L1 clock)");
    }
}

/// A snapshot restored twice must not hand the same randomness to both
/// guests: ember's VM generation ID device is found at boot, each restore
/// notifies it (the kernel reseeds: VMFORK_RESEED), and the two restored
/// guests then draw different bytes from /dev/urandom.
#[test]
fn each_restore_reseeds_through_vmgenid_and_the_guests_draw_different_randomness() {
    let (boot, restores) = snapshot_cases();
    assert_eq!(
        boot.fact("vmgenid-bound"),
        Some("1"),
        "Linux's vmgenid driver bound to ember's VGEN device\n{}",
        boot.dump()
    );
    let mut draws = Vec::new();
    for (i, c) in restores.into_iter().enumerate() {
        let vmfork = c.fact("vmfork").unwrap_or_default();
        assert!(
            vmfork.starts_with("1 "),
            "restore {}: `{VMFORK_RESEED}` once in dmesg (got `{vmfork}`)\n{}",
            i + 1,
            c.dump()
        );
        let bytes = c.fact("urandom").unwrap_or_default();
        assert_eq!(bytes.len(), 32, "16 bytes in hex\n{}", c.dump());
        let uuid = c.fact("uuid").unwrap_or_default();
        assert_eq!(uuid.len(), 36, "a random UUID\n{}", c.dump());
        eprintln!("nested rig: restore {}: {vmfork}, urandom {bytes}", i + 1);
        draws.push((bytes, uuid));
    }
    assert_ne!(
        draws[0].0, draws[1].0,
        "both restores drew the same /dev/urandom bytes"
    );
    assert_ne!(draws[0].1, draws[1].1, "both restores drew the same UUID");
}
