//! End-to-end: Linux's own virtio_mem driver (built into the PVM test
//! kernel) on ember's virtio-mem region (`--mem 256M --mem-boot 128M`: one
//! 128 MiB memory block), in one boot: the driver plugs the region and the
//! kernel onlines it by a kernel parameter (`memhp_default_state`, not the
//! test); a balloon beside it inflates and deflates, then a program writes
//! memory the guest allocates afresh (the pages the balloon gave back among
//! it) and reads every word back; a shrink through the control socket
//! unplugs half the block (MemTotal falls, ember discards it, the guest's
//! data moved out of it stays intact); a snapshot of that partly plugged
//! guest restores with its plugged state and data, and a grow after the
//! restore plugs the block whole again.
//!
//! Sizes are small on purpose: under the software KVM every page the guest
//! kernel hands out costs it milliseconds (a 16 MiB populate took 36 s on a
//! loaded host), so the guest-side work is a few MiB and lives in user
//! space where it can.
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::console_vm::ConsoleVm as Vm;
use common::memtouch::memtouch;
use common::{PVM_CMDLINE, Scratch, ember, output, pvm_kernel_dir, require_kvm, stderr, stdout};
use serde_json::Value;
use std::ffi::OsStr;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const BOOT: u64 = 128 * MIB;
/// One of Linux's 128 MiB memory blocks.
const REGION: u64 = 128 * MIB;
/// What the shrink leaves plugged: half the block (the driver unplugs it in
/// 4 MiB sub-blocks, so the block stays online, partly plugged).
const HALF: u64 = REGION / 2;
/// The balloon's inflation, and what the program writes after the deflate.
const BALLOON_MIB: u64 = 4;
const TOUCH_MIB: u32 = 8;
const READY: &str = "EMBER-MEM-READY";
const END: &str = "EMBER-CMD-END";
/// /init: mounts what it needs, says how much memory it booted with, then
/// runs console lines one by one (the end marker is built at run time so
/// that the console's echo of a typed line never matches it). `mt` reads
/// MemTotal (the first line of /proc/meminfo) with shell builtins only.
const INIT: &str = "#!/bin/sh\nexport PATH=/bin\n\
    mount -t proc proc /proc\nmkdir -p /t\nmount -t tmpfs -o size=100% t /t\n\
    mt() { read -r k v u < /proc/meminfo; echo \"$v\"; }\n\
    echo \"BOOT=$(mt)\"\necho EMBER-MEM-READY\n\
    while read -r cmd; do eval \"$cmd\"; echo EMBER-CMD-E\"ND\"; done\n";

/// `ember ctl --api-socket SOCK ARGS…`'s reply as JSON.
fn ctl(sock: &Path, args: &[&str]) -> Value {
    let o = output(ember().arg("ctl").arg("--api-socket").arg(sock).args(args));
    serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("ember ctl {args:?}: {e}: {} {}", stdout(&o), stderr(&o)))
}

/// Polls `ctl ARGS` until `key` is `want`; the last reply (the caller
/// checks it).
fn wait_ctl(sock: &Path, args: &[&str], key: &str, want: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(400);
    loop {
        let r = ctl(sock, args);
        if r[key].as_u64() == Some(want) || Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Runs `cmd` in the guest; the console lines it printed. Run again (at
/// most twice more) when one of its processes segfaulted: static busybox
/// now and then faults reading its TLS right after starting under this
/// host's PVM, with or without virtio-mem or a balloon (seen in a plain
/// boot too; see the ember-backend network refusal in
/// src/appliance/run.rs). A wrong word in memory shows as the
/// libc-free `memtouch`'s TOUCH-BAD, never retried.
fn run(vm: &mut Vm, cmd: &str) -> Vec<String> {
    for _ in 0..3 {
        writeln!(vm.stdin, "{cmd}").unwrap();
        let lines = vm.wait_for(END, Duration::from_secs(900));
        if !lines.iter().any(|l| l.contains("segfault at")) {
            return lines;
        }
        eprintln!("a guest process segfaulted; again: {cmd}");
    }
    panic!("`{cmd}` segfaulted three times:\n{}", vm.log)
}

/// The value of the guest's `NAME=value` line in `lines`.
fn field(lines: &[String], name: &str) -> String {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| panic!("no {name}= in {lines:?}"))
        .to_string()
}

/// The guest's MemTotal in bytes, once `done` says it is what the test
/// waits for (the driver onlines or offlines a block a moment after the
/// device acknowledged the request); the last value after 120 s.
fn mem_total_until(vm: &mut Vm, done: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let kib: u64 = field(&run(vm, "echo \"MT=$(mt)\""), "MT").parse().unwrap();
        if done(kib << 10) || Instant::now() > deadline {
            return kib << 10;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// ember's resident memory (the guest memory it has committed), bytes.
fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    kib << 10
}

/// The program's verdict: it wrote and read back every word.
fn touched(vm: &mut Vm) {
    let lines = run(vm, "/bin/memtouch");
    assert!(lines.iter().any(|l| l == "TOUCH-OK"), "memtouch: {lines:?}");
}

#[test]
fn linux_plugs_the_region_resizes_through_the_socket_and_restores_plugged() {
    let test = "linux virtio-mem";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let scratch = Scratch::new("linux-mem");
    let initrd = scratch.path("initrd.cpio");
    let toucher = memtouch(TOUCH_MIB);
    common::busybox::initramfs_with_files(
        &initrd,
        INIT,
        &["sh", "mount", "mkdir", "md5sum", "seq", "cut"],
        &[("/bin/memtouch", &toucher)],
    );
    let sock = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let kernel = kdir.join("vmlinux");
    // Blocks the driver adds are onlined by the kernel itself, movable so
    // that they can be offlined again for an unplug.
    let cmdline = format!("{PVM_CMDLINE} memhp_default_state=online_movable");
    let mut vm = Vm::spawn(&[
        OsStr::new("--kernel"),
        kernel.as_os_str(),
        OsStr::new("--initrd"),
        initrd.as_os_str(),
        OsStr::new("--mem"),
        OsStr::new("256M"),
        OsStr::new("--mem-boot"),
        OsStr::new("128M"),
        OsStr::new("--cmdline"),
        OsStr::new(&cmdline),
        OsStr::new("--balloon"),
        OsStr::new("--balloon-no-reporting"),
        OsStr::new("--api-socket"),
        sock.as_os_str(),
        OsStr::new("--timeout"),
        OsStr::new("1800"),
    ]);
    let start = Instant::now();
    let booted = vm.wait_for(READY, Duration::from_secs(600));
    let at_init: u64 = field(&booted, "BOOT").parse().unwrap();
    eprintln!(
        "{test}: /init after {:?} with MemTotal {at_init} kB",
        start.elapsed()
    );
    // Without prefault the whole region is requested at once; the driver
    // plugs it all (here before /init) and the kernel onlines it.
    let r = wait_ctl(&sock, &["mem"], "plugged_bytes", REGION);
    assert_eq!(r["plugged_bytes"].as_u64(), Some(REGION), "{r}");
    assert_eq!(r["boot_bytes"].as_u64(), Some(BOOT), "{r}");
    let floor = BOOT + REGION - 32 * MIB;
    let full = mem_total_until(&mut vm, |t| t > floor);
    assert!(full > floor, "MemTotal {full} with the region plugged");

    // Data the guest keeps throughout: movable allocations such as tmpfs
    // pages land in the plugged (movable) memory first, so the unplug
    // below may migrate them and the snapshot carries them.
    let kept = field(
        &run(
            &mut vm,
            "seq 1 20000 > /t/keep; echo \"SUM=$(md5sum /t/keep | cut -c1-32)\"",
        ),
        "SUM",
    );
    let pid = vm.child.id();
    eprintln!("{test}: all plugged after {:?}", start.elapsed());

    // The balloon beside the region: Linux inflates it (ember discards what
    // it takes) and deflates it again; then memory the guest allocates
    // afresh (the deflated pages among it: the allocator hands out what it
    // was just given back) is written and read back word by word.
    let pages = BALLOON_MIB * 256;
    let r = ctl(
        &sock,
        &["balloon", "--target-mib", &BALLOON_MIB.to_string()],
    );
    assert_eq!(r["ok"], true, "{r}");
    let r = wait_ctl(&sock, &["balloon-stats"], "actual_pages", pages);
    assert_eq!(r["actual_pages"].as_u64(), Some(pages), "inflated: {r}");
    assert!(r["discarded_pages"].as_u64().unwrap_or(0) >= pages, "{r}");
    let r = ctl(&sock, &["balloon", "--target-mib", "0"]);
    assert_eq!(r["ok"], true, "{r}");
    let r = wait_ctl(&sock, &["balloon-stats"], "actual_pages", 0);
    assert_eq!(r["actual_pages"].as_u64(), Some(0), "deflated: {r}");
    touched(&mut vm);
    eprintln!("{test}: ballooned and touched after {:?}", start.elapsed());

    // Shrink through the socket to half the block.
    let before = rss(pid);
    let size = format!("{}M", (BOOT + HALF) / MIB);
    let r = ctl(&sock, &["mem", "--size", &size]);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["requested_bytes"].as_u64(), Some(HALF), "{r}");
    let r = wait_ctl(&sock, &["mem"], "plugged_bytes", HALF);
    assert_eq!(r["plugged_bytes"].as_u64(), Some(HALF), "{r}");
    assert!(
        r["discarded_bytes"].as_u64().unwrap() >= REGION - HALF,
        "{r}"
    );
    let shrunk = mem_total_until(&mut vm, |t| t <= full - (REGION - HALF));
    assert_eq!(
        shrunk,
        full - (REGION - HALF),
        "MemTotal {full} -> {shrunk}"
    );
    let after = rss(pid);
    eprintln!(
        "{test}: shrunk after {:?}; ember's RSS {} -> {} MiB",
        start.elapsed(),
        before / MIB,
        after / MIB
    );
    // Linux hands out a hot-added block's memory from its low end first
    // (and unplugs from the high end), so the half given back was mostly
    // never touched: the fall itself is tests/vmm_e2e/mem_e2e.rs's. Here:
    // the unplug committed nothing new on the host.
    assert!(after <= before + MIB, "ember's RSS {before} -> {after}");
    let lines = run(&mut vm, "echo \"SUM=$(md5sum /t/keep | cut -c1-32)\"");
    assert_eq!(field(&lines, "SUM"), kept, "the data after the unplug");

    // A snapshot of the partly plugged guest restores partly plugged.
    let o = output(
        ember()
            .args(["snapshot", "--api-socket"])
            .arg(&sock)
            .arg("--to")
            .arg(&snap),
    );
    assert!(o.status.success(), "snapshot: {}{}", stdout(&o), stderr(&o));
    assert_eq!(
        vm.child.wait().unwrap().code(),
        Some(0),
        "the snapshot ends the VM"
    );
    drop(vm);
    let sock2 = scratch.path("api2.sock");
    let mut vm = Vm::spawn(&[
        OsStr::new("--restore"),
        snap.as_os_str(),
        OsStr::new("--api-socket"),
        sock2.as_os_str(),
    ]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !sock2.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = ctl(&sock2, &["mem"]);
    assert_eq!(r["plugged_bytes"].as_u64(), Some(HALF), "restored: {r}");
    assert_eq!(r["requested_bytes"].as_u64(), Some(HALF), "restored: {r}");
    eprintln!("{test}: restored after {:?}", start.elapsed());

    // The restored device still works: grow the block whole again.
    let r = ctl(&sock2, &["mem", "--size", "256M"]);
    assert_eq!(r["ok"], true, "{r}");
    let r = wait_ctl(&sock2, &["mem"], "plugged_bytes", REGION);
    assert_eq!(r["plugged_bytes"].as_u64(), Some(REGION), "grown: {r}");
    let grown = mem_total_until(&mut vm, |t| t >= full);
    assert_eq!(grown, full, "MemTotal {full} -> {shrunk} -> {grown}");
    let lines = run(&mut vm, "echo \"SUM=$(md5sum /t/keep | cut -c1-32)\"");
    assert_eq!(field(&lines, "SUM"), kept, "the data after the restore");
    let _ = ctl(&sock2, &["shutdown"]);
    vm.child.wait().unwrap();
    eprintln!("{test}: done after {:?}", start.elapsed());
}

/// The program itself, on the host: it writes, reads back and says so.
#[test]
fn memtouch_runs_on_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let scratch = Scratch::new("memtouch");
    let path = scratch.path("memtouch");
    std::fs::write(&path, memtouch(2)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let o = output(&mut std::process::Command::new(&path));
    assert_eq!(stdout(&o), "TOUCH-OK\n", "{o:?}");
    assert_eq!(o.status.code(), Some(0));
}
