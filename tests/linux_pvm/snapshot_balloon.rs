//! End-to-end: a VM with a virtio-balloon (Linux's own driver, built into the
//! PVM test kernel) snapshotted after inflating, and restored in a fresh ember
//! process, where the guest's view and ember's still agree and the balloon
//! keeps working: the statistics buffer the device held is taken again (fresh
//! statistics arrive), a larger target is inflated, and deflating to zero
//! returns exactly the pages ember restored as held.
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::console_vm::ConsoleVm as Vm;
use common::{Scratch, ember, output, pvm_kernel_dir, require_kvm, stderr, stdout};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

const READY: &str = "EMBER-BALLOON-READY";
const DONE: &str = "EMBER-CMD-DONE";
/// /init: mounts /proc, says it is ready, then runs console lines one by one.
const INIT: &str = "#!/bin/sh\nexport PATH=/bin\nmount -t proc proc /proc\necho EMBER-BALLOON-READY\nwhile read -r cmd; do eval \"$cmd\"; echo EMBER-CMD-DONE; done\n";

fn initramfs(path: &Path) {
    common::busybox::initramfs_with(path, INIT, &["sh", "mount", "grep", "cat"]);
}

/// The guest's MemFree, in KiB (its own view of the memory the balloon took).
fn mem_free_kib(vm: &mut Vm) -> u64 {
    writeln!(vm.stdin, "grep MemFree /proc/meminfo").unwrap();
    let lines = vm.wait_for(DONE, Duration::from_secs(120));
    lines
        .iter()
        .find_map(|l| {
            let v = l.trim().strip_prefix("MemFree:")?;
            v.trim().strip_suffix("kB")?.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("no MemFree in {lines:?}"))
}

/// Waits until the control socket at `sock` exists (it appears once the VM
/// is built and the socket accepts).
fn wait_socket(sock: &Path) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !sock.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(sock.exists(), "no control socket at {}", sock.display());
}

/// Snapshots `vm` through its socket `sock` into `snap` (which ends it), then
/// restores the snapshot in a fresh ember with its socket at `sock2`, once
/// that socket is up.
fn snapshot_and_restore(mut vm: Vm, sock: &Path, snap: &Path, sock2: &Path) -> Vm {
    let o = ember()
        .args(["snapshot", "--api-socket"])
        .arg(sock)
        .arg("--to")
        .arg(snap)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "snapshot: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let snapped = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap_or_default();
    eprintln!("snapshot: {snapped}");
    assert_eq!(
        vm.child.wait().unwrap().code(),
        Some(0),
        "the snapshot ends the VM"
    );
    let vm = Vm::spawn(&[
        std::ffi::OsStr::new("--restore"),
        snap.as_os_str(),
        std::ffi::OsStr::new("--api-socket"),
        sock2.as_os_str(),
    ]);
    wait_socket(sock2);
    vm
}

/// `ember ctl --api-socket SOCK ARGS…`'s reply as JSON.
fn ctl(sock: &Path, args: &[&str]) -> serde_json::Value {
    let o = output(ember().arg("ctl").arg("--api-socket").arg(sock).args(args));
    serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("ember ctl {args:?}: {e}: {} {}", stdout(&o), stderr(&o)))
}

/// Polls `balloon-stats` until `done` holds for the reply; the last reply.
fn poll(sock: &Path, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let r = ctl(sock, &["balloon-stats"]);
        if done(&r) || Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn pages(r: &serde_json::Value, field: &str) -> u64 {
    r[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {r}"))
}

const MIB_PAGES: u64 = 256;

#[test]
fn a_ballooned_linux_guest_restores_with_its_balloon_agreeing_and_working() {
    let test = "snapshot_balloon";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let dir = Scratch::new(test);
    let initrd = dir.path("initrd.cpio");
    initramfs(&initrd);
    let (sock, sock2, snap) = (
        dir.path("api.sock"),
        dir.path("api2.sock"),
        dir.path("snap"),
    );
    let os = |s: &str| std::ffi::OsString::from(s);
    let mut vm = Vm::boot_pvm(
        &kdir,
        &initrd,
        &[&os("--balloon"), &os("--api-socket"), sock.as_os_str()],
    );
    vm.wait_for(READY, Duration::from_secs(600));
    let free_before = mem_free_kib(&mut vm);
    assert_eq!(ctl(&sock, &["balloon", "--target-mib", "24"])["ok"], true);
    let r = poll(&sock, |r| r["actual_pages"] == 24 * MIB_PAGES);
    assert_eq!(pages(&r, "actual_pages"), 24 * MIB_PAGES, "inflated: {r}");
    assert_eq!(pages(&r, "held_pages"), 24 * MIB_PAGES, "{r}");
    let free_inflated = mem_free_kib(&mut vm);
    assert!(
        free_before - free_inflated >= 20 << 10,
        "the guest's MemFree {free_before} -> {free_inflated} kB after a 24 MiB inflate"
    );
    // The driver keeps its statistics buffer posted: the device holds it now,
    // which a snapshot must not wait for.
    let mut vm = snapshot_and_restore(vm, &sock, &snap, &sock2);
    // ember's view, restored: target, the driver's actual and its own held pages.
    let r = ctl(&sock2, &["balloon-stats"]);
    assert_eq!(pages(&r, "target_pages"), 24 * MIB_PAGES, "{r}");
    assert_eq!(pages(&r, "actual_pages"), 24 * MIB_PAGES, "{r}");
    assert_eq!(pages(&r, "held_pages"), 24 * MIB_PAGES, "{r}");
    assert!(
        r["stats"]["4"].is_u64(),
        "the last statistics came back: {r}"
    );
    // The guest's view: what it had given up, it still has given up.
    let free_restored = mem_free_kib(&mut vm);
    assert!(
        free_restored.abs_diff(free_inflated) < 8 << 10,
        "the restored guest's MemFree {free_restored} kB, {free_inflated} kB at the snapshot"
    );
    // The balloon keeps working: a larger target is inflated, and the
    // statistics buffer the device held was taken again (the balloon-stats
    // requests return it; the driver refills it with fresh numbers, the free
    // memory 16 MiB lower).
    assert_eq!(ctl(&sock2, &["balloon", "--target-mib", "40"])["ok"], true);
    let r = poll(&sock2, |r| r["actual_pages"] == 40 * MIB_PAGES);
    assert_eq!(
        pages(&r, "actual_pages"),
        40 * MIB_PAGES,
        "inflated after restore: {r}"
    );
    assert_eq!(pages(&r, "held_pages"), 40 * MIB_PAGES, "{r}");
    let stat_free = |r: &serde_json::Value| r["stats"]["4"].as_u64().unwrap_or(u64::MAX);
    let want = (free_restored << 10) - (12 << 20);
    let r = poll(&sock2, |r| stat_free(r) < want);
    assert!(
        stat_free(&r) < want,
        "no fresh statistics after the restore (free memory {} bytes, the guest had {free_restored} kB free before inflating 16 MiB more): {r}",
        stat_free(&r)
    );
    // Deflating to zero gives back exactly the pages ember holds: those
    // restored from the snapshot and those inflated since.
    assert_eq!(ctl(&sock2, &["balloon", "--target-mib", "0"])["ok"], true);
    let r = poll(&sock2, |r| r["actual_pages"] == 0);
    assert_eq!(pages(&r, "actual_pages"), 0, "deflated: {r}");
    assert_eq!(
        pages(&r, "held_pages"),
        0,
        "the guest deflated pages ember did not hold: {r}"
    );
    let free_deflated = mem_free_kib(&mut vm);
    assert!(
        free_deflated >= free_before - (8 << 10),
        "MemFree {free_deflated} kB after deflating all, {free_before} kB before any inflate"
    );
    assert_eq!(ctl(&sock2, &["shutdown"])["ok"], true);
    assert_eq!(vm.child.wait().unwrap().code(), Some(0), "{}", vm.log);
}

/// `--prefault async` snapshotted while its background commit is still
/// running (paced to 256 KiB/s: 64 MiB take ~4 min): the guest holds the
/// committer's floor in its balloon. The restored VM (its memory the
/// snapshot's file, mapped privately) has no commit to resume: the floor comes
/// down at once and the driver deflates to the user's target (0), each
/// deflated page committed before the guest gets it (`snapshot::restore`'s
/// `restore_fence`; its unit test checks the pages are private copies). The
/// guest then sees its memory again.
#[test]
fn an_unfinished_async_prefault_restores_with_its_floor_lowered_by_deflating() {
    let test = "snapshot_balloon prefault";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let dir = Scratch::new("snapshot-balloon-prefault");
    let initrd = dir.path("initrd.cpio");
    initramfs(&initrd);
    let (sock, sock2, snap) = (
        dir.path("api.sock"),
        dir.path("api2.sock"),
        dir.path("snap"),
    );
    let os = |s: &str| std::ffi::OsString::from(s);
    let mut vm = Vm::boot_pvm(
        &kdir,
        &initrd,
        &[
            &os("--prefault"),
            &os("async,window=64M,chunk=1M,rate=256K,driver-timeout=120"),
            &os("--api-socket"),
            sock.as_os_str(),
        ],
    );
    vm.wait_for(READY, Duration::from_secs(600));
    // The driver holds the floor: memory not committed yet.
    let r = poll(&sock, |r| {
        r["actual_pages"].as_u64().unwrap_or(0) >= 16 * MIB_PAGES
    });
    let fenced = pages(&r, "actual_pages");
    assert!(
        fenced >= 16 * MIB_PAGES && pages(&r, "target_pages") >= 16 * MIB_PAGES,
        "the driver did not inflate to the committer's floor: {r}"
    );
    let free_fenced = mem_free_kib(&mut vm);
    let mut vm = snapshot_and_restore(vm, &sock, &snap, &sock2);
    let r = ctl(&sock2, &["balloon-stats"]);
    assert_eq!(pages(&r, "target_pages"), 0, "the floor stayed up: {r}");
    let r = poll(&sock2, |r| r["actual_pages"] == 0);
    assert_eq!(
        pages(&r, "actual_pages"),
        0,
        "the driver did not deflate: {r}"
    );
    assert_eq!(pages(&r, "held_pages"), 0, "{r}");
    let free_restored = mem_free_kib(&mut vm);
    assert!(
        free_restored >= free_fenced + (fenced * 4) * 3 / 4,
        "MemFree {free_fenced} kB with {fenced} pages fenced, {free_restored} kB after the deflate"
    );
    assert_eq!(ctl(&sock2, &["shutdown"])["ok"], true);
    assert_eq!(vm.child.wait().unwrap().code(), Some(0), "{}", vm.log);
}
