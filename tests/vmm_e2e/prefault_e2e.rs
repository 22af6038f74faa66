//! End-to-end: `--prefault sync|async`, `--mem-lock`, `--hugepages` and
//! `--balloon-target` on ember's test guest (which has no balloon driver: the
//! async path's driverless fallback). The fence with a driver is in
//! crates/ember-vmm/tests/balloon_fence.rs.

use crate::common;

use common::{Scratch, ember, output, require_kvm, stderr, stdout};
use ember_vmm::events::EventFile;
use ember_vmm::prefault::{EVENT_COMMITTED, EVENT_VISIBLE};
use std::path::PathBuf;

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// Boots the test guest with `mem` and `extra` flags; returns (status, stdout, stderr, events).
fn boot(mem: &str, cmdline: &str, extra: &[&str]) -> (i32, String, String, EventFile) {
    let dir = Scratch::new("prefault");
    let events = dir.path("events.json");
    let o = output(
        ember()
            .args(["boot", "--kernel"])
            .arg(guest())
            .args(["--mem", mem, "--cmdline", cmdline, "--events"])
            .arg(&events)
            .args(extra),
    );
    let ev: EventFile = std::fs::read(&events)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    (o.status.code().unwrap_or(-1), stdout(&o), stderr(&o), ev)
}

fn at(ev: &EventFile, kind: &str) -> Option<f64> {
    ev.events.iter().find(|e| e.kind == kind).map(|e| e.t_us)
}

#[test]
fn sync_commits_everything_before_the_first_instruction() {
    if !require_kvm("prefault sync") {
        return;
    }
    let (code, out, err, ev) = boot(
        "96M",
        "print=hi",
        &["--prefault", "sync,threads=2", "--mem-lock"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("hi\n"), "{out}");
    let committed = at(&ev, EVENT_COMMITTED).expect("memory_committed");
    let entry = at(&ev, "first_guest_entry").expect("first_guest_entry");
    assert!(
        committed <= entry,
        "committed at {committed}, entered at {entry}"
    );
    let resident = ev.memory_kib("guest_resident_kib").unwrap();
    assert!(resident >= 96 << 10, "resident {resident} KiB");
    // Without --prefault, the same guest leaves most of its memory untouched.
    let (_, _, _, lazy) = boot("96M", "print=hi", &[]);
    assert!(lazy.memory_kib("guest_resident_kib").unwrap() < 32 << 10);
    assert!(at(&lazy, EVENT_COMMITTED).is_none());
}

#[test]
fn async_without_a_balloon_driver_commits_in_the_background_and_says_so_once() {
    if !require_kvm("prefault async") {
        return;
    }
    // The guest spins long enough for 128 MiB to be committed on a busy host.
    let (code, out, err, ev) = boot(
        "160M",
        "print=up spin=6000",
        &[
            "--prefault",
            "async,window=32M,chunk=32M,driver-timeout=0.5",
            "--hugepages",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("up\n"), "{out}");
    assert_eq!(
        err.matches("no balloon driver").count(),
        1,
        "said once: {err}"
    );
    let entry = at(&ev, "first_guest_entry").unwrap();
    let committed = at(&ev, EVENT_COMMITTED).expect("the background commit completed");
    assert!(
        committed > entry,
        "in the background: {committed} vs {entry}"
    );
    assert!(at(&ev, EVENT_VISIBLE).unwrap() >= committed);
    assert!(ev.memory_kib("guest_resident_kib").unwrap() >= 160 << 10);
}

#[test]
fn bad_memory_options_are_one_line_errors() {
    for (flags, says) in [
        (
            &["--prefault", "eager"][..],
            "the mode must be off, sync or async",
        ),
        (&["--prefault", "async,window=12Q"], "is not a size"),
        (
            &["--prefault", "sync,window=64M"],
            "unknown option `window`",
        ),
        (&["--prefault", "sync,threads=0"], "thread count"),
        (&["--balloon-target", "lots"], "not a memory size"),
    ] {
        let o = output(ember().args(["boot", "--kernel"]).arg(guest()).args(flags));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{flags:?}: {err}");
    }
}

#[test]
fn balloon_target_is_offered_to_the_guest() {
    if !require_kvm("balloon target") {
        return;
    }
    // The test guest has no balloon driver; the device is there with its target.
    let (code, out, err, _) = boot("64M", "print=ok", &["--balloon-target", "16M"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("virtio_mmio.device=4K@0xd0000000:5"), "{out}");
}
