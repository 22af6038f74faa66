//! End-to-end: `ember boot` runs every thread under its seccomp allow-list
//! (`crates/ember-vmm/src/seccomp/`), and a forbidden system call from a
//! device I/O thread ends ember with a line naming the thread and the call.
//!
//! The forbidden call comes from a debug-build-only hook: with
//! `EMBER_TEST_SECCOMP_VIOLATION=block`, the virtio-blk I/O thread calls
//! `socket(2)` on its first pass over the queue.

use crate::common;

use common::{Scratch, ember, output, require_kvm, stderr, stdout};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// ember's exit status for a forbidden call (`src/exit.rs`).
const EXIT_SECCOMP: i32 = 4;

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// The violation hook exists only in debug builds of ember, which is what
/// `cargo test` builds unless asked for `--release`.
fn require_debug_build() {
    if !cfg!(debug_assertions) {
        panic!(
            "seccomp_e2e needs a debug build of ember (the violation hook is compiled only \
             there); run it without --release"
        );
    }
}

/// Boots the test guest with a disk the guest writes and verifies, with the
/// violation hook armed for `hook` (`block`, `vcpu-ioctl`); returns (status,
/// stdout, stderr).
fn boot_with_violation(hook: &str, mode: Option<&str>) -> (i32, String, String) {
    let dir = Scratch::new("seccomp");
    let disk = dir.path("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    // This test build's own ember, not EMBER_BIN: the hook is in debug builds only.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ember"));
    cmd.args(["boot", "--kernel"])
        .arg(guest())
        .args([
            "--mem",
            "64M",
            "--cmdline",
            "bs=4k blkmib=1 blkverify exit=0",
            "--timeout",
            "60",
            "--disk",
        ])
        .arg(&disk)
        .env("EMBER_TEST_SECCOMP_VIOLATION", hook);
    if let Some(m) = mode {
        cmd.args(["--seccomp", m]);
    }
    let o = output(&mut cmd);
    (o.status.code().unwrap_or(-1), stdout(&o), stderr(&o))
}

#[test]
fn a_forbidden_syscall_from_a_device_thread_ends_ember_naming_it() {
    if !require_kvm("seccomp violation") {
        return;
    }
    require_debug_build();
    // The default is trap.
    let (code, out, err) = boot_with_violation("block", None);
    assert_eq!(code, EXIT_SECCOMP, "stdout: {out}\nstderr: {err}");
    assert!(
        err.lines()
            .any(|l| l == "ember: seccomp: thread ember-blk0 made forbidden syscall socket (41)"),
        "stderr: {err}"
    );
    // It stopped there: the guest never finished its disk check.
    assert!(!out.contains("blkverify: ok"), "{out}");
}

/// The vCPU thread may make KVM's requests only: a terminal's (TIOCSTI,
/// which would type into ember's terminal) ends ember, the message naming
/// the request, before the guest runs.
#[test]
fn a_forbidden_ioctl_from_a_vcpu_thread_ends_ember_naming_its_request() {
    if !require_kvm("seccomp ioctl violation") {
        return;
    }
    require_debug_build();
    let (code, out, err) = boot_with_violation("vcpu-ioctl", None);
    assert_eq!(code, EXIT_SECCOMP, "stdout: {out}\nstderr: {err}");
    assert!(
        err.lines().any(|l| l
            == "ember: seccomp: thread ember-vcpu0 made forbidden syscall ioctl (16) request 0x5412"),
        "stderr: {err}"
    );
    assert!(!out.contains("blkverify: ok"), "{out}");
}

#[test]
fn off_and_log_let_the_same_call_through() {
    if !require_kvm("seccomp off/log") {
        return;
    }
    require_debug_build();
    // Each hook is armed in every mode: the same calls are made, fail
    // harmlessly (the socket is closed; the ioctl gets EBADF), and the guest
    // runs on.
    for (hook, mode) in [
        ("block", "off"),
        ("block", "log"),
        ("vcpu-ioctl", "off"),
        ("vcpu-ioctl", "log"),
    ] {
        let (code, out, err) = boot_with_violation(hook, Some(mode));
        assert_eq!(
            code, 0,
            "{hook} --seccomp {mode}: stdout: {out}\nstderr: {err}"
        );
        assert!(
            out.contains("blkverify: ok"),
            "{hook} --seccomp {mode}: {out}"
        );
        assert!(!err.contains("seccomp"), "{hook} --seccomp {mode}: {err}");
    }
}

/// `Name:`, `Seccomp:`, `NoNewPrivs:` and `Seccomp_filters:` of every thread
/// of process `pid`.
fn thread_states(pid: u32) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
        out.push((
            field("Name:"),
            field("Seccomp:"),
            field("NoNewPrivs:"),
            field("Seccomp_filters:"),
        ));
    }
    out
}

#[test]
fn every_thread_runs_filtered_with_no_new_privs_while_the_guest_runs() {
    if !require_kvm("seccomp threads") {
        return;
    }
    let dir = Scratch::new("seccomp-threads");
    let disk = dir.path("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let api = dir.path("api.sock");
    let mut child = ember()
        .args(["boot", "--kernel"])
        .arg(guest())
        .args([
            "--mem",
            "64M",
            "--cpus",
            "2",
            "--cmdline",
            "bs=4k blkmib=1 blkverify print=running spin=3000 exit=0",
            "--timeout",
            "60",
            "--rng",
            "--balloon",
            "--disk",
        ])
        .arg(&disk)
        .arg("--api-socket")
        .arg(&api)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ember");
    let pid = child.id();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let started = Instant::now();
    let mut seen = Vec::new();
    loop {
        let line = lines.next().expect("the guest said running").unwrap();
        if line == "running" {
            break;
        }
        seen.push(line);
        assert!(started.elapsed() < Duration::from_secs(60), "{seen:?}");
    }
    let states = thread_states(pid);
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    let names: Vec<&str> = states.iter().map(|s| s.0.as_str()).collect();
    // The threads ember has by now, and how many filters each runs under:
    // its own list, plus the clone3-ENOSYS filter where it starts threads.
    // None inherited one: every thread was started before the main thread
    // took its filter. So each count shows that thread installed its own,
    // and no more than it needs. (The test guest resets its disk after
    // `blkverify`, which ends the blk thread: that one's filter is shown by
    // the violation test above.)
    for (want, filters) in [
        ("ember", "1"),
        ("ember-vcpu0", "1"),
        ("ember-vcpu1", "1"),
        ("ember-spawner", "2"),
        ("ember-api", "2"),
        ("ember-stdin", "1"),
    ] {
        let Some(s) = states.iter().find(|s| s.0 == want) else {
            panic!("no {want} thread in {names:?}");
        };
        assert_eq!(s.3, filters, "{want}'s filters: {states:?}");
    }
    // KVM's own kernel workers (kvm-nx-lpage-recovery, Linux 6.13+) are
    // tasks of the process but run only kernel code.
    for (name, seccomp, nnp, _) in states.iter().filter(|s| !s.0.starts_with("kvm-")) {
        // 2: SECCOMP_MODE_FILTER.
        assert_eq!(
            seccomp, "2",
            "thread {name} runs without a filter: {states:?}"
        );
        assert_eq!(nnp, "1", "thread {name} without no_new_privs: {states:?}");
    }
    assert_eq!(status.code(), Some(0), "{seen:?}");
}
