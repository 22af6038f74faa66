//! End-to-end: virtio-mem (`--mem SIZE --mem-boot BOOT`) driven by the test
//! guest's own driver: plugs and unplugs, what a driver may not do refused,
//! blocks not committed yet (`--prefault async`) neither requested nor
//! plugged, a resize through the control socket giving memory back to the
//! host, and a snapshot of a plugged guest restored intact.

use crate::common;
use common::booted::Booted;

use common::{Scratch, ember, output, require_kvm, stderr, stdout};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// 512 MiB of boot RAM and a 512 MiB region (256 blocks of 2 MiB at 4 GiB).
const MEM: [&str; 4] = ["--mem", "1G", "--mem-boot", "512M"];
const MIB: u64 = 1 << 20;

fn boot(cmdline: &str, extra: &[&str]) -> (i32, String, String) {
    let o = output(
        ember()
            .args(["boot", "--timeout", "60", "--kernel"])
            .arg(guest())
            .args(MEM)
            .args(["--cmdline", cmdline])
            .args(extra),
    );
    (o.status.code().unwrap_or(-1), stdout(&o), stderr(&o))
}

/// The guest's `vmem: …` lines, in order.
fn vmem_lines(out: &str) -> Vec<&str> {
    out.lines()
        .filter_map(|l| l.strip_prefix("vmem: "))
        .collect()
}

#[test]
fn plugs_unplugs_and_refuses_what_a_driver_may_not_do() {
    if !require_kvm("virtio-mem") {
        return;
    }
    let (code, out, err) = boot(
        "vmem vmemplug=0,2 vmemfill=0,2 vmemcheck=0,2 vmemstate=0,3 \
         vmemplug=256,1 vmemplug=255,2 vmemplug=1,1 vmemunplug=5,1 \
         vmemunplug=0,2 vmemstate=0,2 vmemplugreq vmemunplugall vmem",
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        vmem_lines(&out),
        [
            "addr=0x100000000 region=536870912 block=2097152 plugged=0 requested=536870912",
            "plug block=0 n=2 -> ack",
            "filled 2 blocks from 0",
            "check 2 blocks from 0: intact",
            "state block=0 n=3 -> mixed",
            // Past the region, across its end, already plugged, not plugged.
            "plug block=256 n=1 -> error",
            "plug block=255 n=2 -> error",
            "plug block=1 n=1 -> error",
            "unplug block=5 n=1 -> error",
            "unplug block=0 n=2 -> ack",
            "state block=0 n=2 -> unplugged",
            "plugged=536870912 requested=536870912",
            "unplugall block=0 n=0 -> ack",
            "addr=0x100000000 region=536870912 block=2097152 plugged=0 requested=536870912",
        ],
        "{out}"
    );
    // The guest's bad requests are warnings, never the end of the VM.
    assert!(err.contains("virtio-mem: refused"), "{err}");
}

/// With `--prefault async` the driver is asked for the committed part only,
/// and a plug past it is refused though the requested size allows it.
#[test]
fn blocks_not_committed_yet_are_neither_requested_nor_plugged() {
    if !require_kvm("virtio-mem prefault") {
        return;
    }
    let (code, out, err) = boot(
        "vmemwait=128m vmemplug=100,1 vmemplug=0,1 vmemplug=63,1 vmemplug=64,1 vmem",
        // The first 128 MiB at once, the next 128 MiB no sooner than 32 s later.
        &["--prefault", "async,chunk=128M,rate=4M"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        vmem_lines(&out),
        [
            "requested=134217728",
            "plug block=100 n=1 -> nack",
            "plug block=0 n=1 -> ack",
            "plug block=63 n=1 -> ack",
            "plug block=64 n=1 -> nack",
            "addr=0x100000000 region=536870912 block=2097152 plugged=4194304 requested=134217728",
        ],
        "{out}"
    );
}

/// The test guest with virtio-mem and a control socket.
fn start(args: &[&str], cmdline: &str, sock: &Path) -> Booted {
    Booted::with_socket(
        ember()
            .args(["boot", "--timeout", "120", "--kernel"])
            .arg(guest())
            .args(MEM)
            .args(["--cmdline", cmdline])
            .args(args),
        sock,
    )
}

/// `ember ctl … mem --size` shrinks the region (the guest unplugs, the host
/// gets the memory back) and grows it again (the guest plugs again, and
/// what it kept is intact).
#[test]
fn a_resize_through_the_socket_gives_memory_back_and_takes_it_again() {
    if !require_kvm("virtio-mem resize") {
        return;
    }
    let dir = Scratch::new("vmem-resize");
    let sock = dir.path("api.sock");
    let vm = start(
        &[],
        "vmemplugreq vmemfill=0,256 print=filled vmemwait=256m vmemunplugreq print=shrunk \
         vmemwait=512m vmemplugreq vmemcheck=0,128 vmem",
        &sock,
    );
    vm.wait_for_line("filled");
    let before = vm.rss();
    let r = vm.call(json!({"op": "mem"}));
    assert_eq!(r["plugged_bytes"], 512 * MIB, "{r}");
    let o = output(
        ember()
            .args(["ctl", "--api-socket"])
            .arg(&sock)
            .args(["mem", "--size", "768M"]),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let reply: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(reply["requested_bytes"], 256 * MIB, "{reply}");
    vm.wait_for_line("shrunk");
    let r = vm.call(json!({"op": "mem"}));
    assert_eq!(r["plugged_bytes"], 256 * MIB, "{r}");
    assert_eq!(r["discarded_bytes"], 256 * MIB, "{r}");
    let after = vm.rss();
    assert!(
        before - after.min(before) >= 200 * MIB,
        "host RSS {} MiB before the unplug, {} MiB after",
        before / MIB,
        after / MIB
    );
    // Past the region, below the boot RAM: refused.
    for bad in [2048, 256] {
        let r = vm.call(json!({"op": "mem", "size_mib": bad}));
        assert_eq!(r["ok"], false, "{bad}: {r}");
    }
    let r = vm.call(json!({"op": "mem", "size_mib": 1024}));
    assert_eq!(r["requested_bytes"], 512 * MIB, "{r}");
    let (code, out, err) = vm.finish();
    assert_eq!(code, 0, "{err}");
    let lines = vmem_lines(&out);
    assert!(lines.contains(&"check 128 blocks from 0: intact"), "{out}");
    assert_eq!(
        lines.last(),
        Some(
            &"addr=0x100000000 region=536870912 block=2097152 plugged=536870912 requested=536870912"
        ),
        "{out}"
    );
}

/// A guest snapshotted with blocks plugged and written is restored with
/// them plugged (the bitmap) and their contents intact (the region's file),
/// and plugs more; so too with `--prefault sync|async`, which commit the
/// restored memory (the plugged blocks, and the new plug before its ack).
#[test]
fn a_plugged_guest_is_restored_plugged_and_intact() {
    if !require_kvm("virtio-mem snapshot") {
        return;
    }
    let dir = Scratch::new("vmem-snap");
    let sock = dir.path("api.sock");
    let snap = dir.path("snap");
    let vm = start(
        &[],
        "vmemplug=0,4 vmemplug=200,1 vmemfill=0,4 vmemfill=200,1 print=filled spin=8000 \
         vmemcheck=0,4 vmemcheck=200,1 vmemstate=0,5 vmemstate=199,2 \
         vmemplug=10,1 vmemfill=10,1 vmemcheck=10,1 vmem",
        &sock,
    );
    vm.wait_for_line("filled");
    let o = output(
        ember()
            .args(["snapshot", "--api-socket"])
            .arg(&sock)
            .arg("--to")
            .arg(&snap),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    vm.finish();
    assert!(snap.join("hotplug").exists());
    let events = dir.path("events.json");
    for prefault in [None, Some("sync"), Some("async")] {
        let mut cmd = ember();
        cmd.args(["boot", "--timeout", "30", "--restore"])
            .arg(&snap);
        if let Some(p) = prefault {
            cmd.args(["--prefault", p, "--events"]).arg(&events);
        }
        let o = output(&mut cmd);
        assert_eq!(o.status.code(), Some(0), "{prefault:?}: {}", stderr(&o));
        let out = stdout(&o);
        assert_eq!(
            vmem_lines(&out),
            [
                "check 4 blocks from 0: intact",
                "check 1 blocks from 200: intact",
                "state block=0 n=5 -> mixed",
                "state block=199 n=2 -> mixed",
                "plug block=10 n=1 -> ack",
                "filled 1 blocks from 10",
                "check 1 blocks from 10: intact",
                "addr=0x100000000 region=536870912 block=2097152 plugged=12582912 requested=536870912",
            ],
            "{prefault:?}: {out}"
        );
        if prefault == Some("sync") {
            // Committed before the guest ran: its RAM and the 5 plugged blocks.
            let ev = std::fs::read_to_string(&events).unwrap();
            assert!(ev.contains("restored_memory_committed"), "{ev}");
            assert!(ev.contains("plugged_bytes=10485760"), "{ev}");
        }
    }
}
