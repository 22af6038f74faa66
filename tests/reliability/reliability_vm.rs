//! Reliability, through the `ember` binary (`EMBER_BIN` or cargo's): what
//! issue 22 found a hostile user could do to snapshots (item 3), signals
//! (7), `--restore`'s options (8), balloon bounds (9), the control socket
//! (10) and its misleading messages (11). Each test states the behaviour
//! the issue asks for; every wait is bounded and every VM and file the
//! test makes goes away with it, whether it passes or not.

use crate::common;

use common::{Scratch, ember, require_kvm};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A guest that prints `up` and then spins for ten minutes (the tests end it).
const SPIN: &str = "print=up spin=600000 exit=6";
/// A guest that, snapshotted right after `up`, ends soon after a restore.
const SHORT: &str = "print=up spin=1500 print=resumed exit=4";

fn guest() -> String {
    ember_testing::test_guest()
        .expect("build the test guest")
        .display()
        .to_string()
}

/// ember's exit status when the guest writes `n` to the debug-exit port.
fn guest_status(n: u8) -> i32 {
    ember::exit::guest_end_status(ember_vmm::vstate::end::GuestEnd::ExitCode(n))
}

/// Collects a pipe into a buffer on its own thread; the flag says it reached EOF.
type Sink = Arc<Mutex<(Vec<u8>, bool)>>;

fn drain(pipe: Option<impl Read + Send + 'static>) -> Sink {
    let sink: Sink = Arc::default();
    let s = sink.clone();
    std::thread::spawn(move || {
        if let Some(mut pipe) = pipe {
            let mut buf = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                s.lock().unwrap().0.extend_from_slice(&buf[..n]);
            }
        }
        s.lock().unwrap().1 = true;
    });
    sink
}

fn text(sink: &Sink) -> String {
    String::from_utf8_lossy(&sink.lock().unwrap().0).into_owned()
}

/// How a bounded run ended.
struct Ran {
    /// `None`: killed by a signal, or by us at the limit (`timed_out`).
    code: Option<i32>,
    out: String,
    err: String,
    took: Duration,
    timed_out: bool,
}

impl Ran {
    /// The run in one line, for assertion messages.
    fn show(&self) -> String {
        if self.timed_out {
            return format!(
                "still running after {:.1} s (killed); stderr so far: {:?}",
                self.took.as_secs_f64(),
                self.err.trim()
            );
        }
        format!(
            "exit {:?} after {:.1} s; stderr: {:?}; stdout: {:?}",
            self.code,
            self.took.as_secs_f64(),
            self.err.trim(),
            tail(&self.out)
        )
    }

    /// The non-empty lines of stderr.
    fn err_lines(&self) -> Vec<&str> {
        self.err.lines().filter(|l| !l.trim().is_empty()).collect()
    }
}

fn tail(s: &str) -> &str {
    let s = s.trim_end();
    &s[s.len().saturating_sub(300)..]
}

/// Waits for `child` at most `limit`, killing it then; `None` on timeout.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if start.elapsed() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most 5 s: a leftover grandchild may hold a pipe) for both pipes' EOF.
fn settle(sinks: &[&Sink]) {
    let start = Instant::now();
    while sinks.iter().any(|s| !s.lock().unwrap().1) && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` (stdin /dev/null), killing it if it takes longer than `limit`.
fn run_for(cmd: &mut Command, limit: Duration) -> Ran {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let status = wait_bounded(&mut child, limit);
    let took = start.elapsed();
    settle(&[&out, &err]);
    Ran {
        code: status.and_then(|s| s.code()),
        out: text(&out),
        err: text(&err),
        took,
        timed_out: status.is_none(),
    }
}

/// `ember ARGS`, given at most `secs` seconds.
fn ember_for(args: &[&str], secs: u64) -> Ran {
    run_for(ember().args(args), Duration::from_secs(secs))
}

/// A running `ember boot … --api-socket`, killed if the test drops it.
struct Vm {
    child: Child,
    out: Sink,
    err: Sink,
    sock: PathBuf,
}

impl Vm {
    /// `ember boot ARGS --api-socket SOCK`, waiting for the socket.
    fn boot(args: &[&str], sock: &Path) -> Vm {
        let mut cmd = ember();
        cmd.arg("boot").args(args);
        Vm::spawn(cmd, sock)
    }

    /// `cmd --api-socket SOCK` (cmd is an `ember boot …`), waiting for the socket.
    fn spawn(mut cmd: Command, sock: &Path) -> Vm {
        let mut child = cmd
            .arg("--api-socket")
            .arg(sock)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ember");
        let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
        let mut vm = Vm {
            child,
            out,
            err,
            sock: sock.to_owned(),
        };
        let start = Instant::now();
        while !sock.exists() {
            if let Ok(Some(s)) = vm.child.try_wait() {
                settle(&[&vm.err]);
                panic!("ember ended ({s}) before its socket: {}", text(&vm.err));
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no control socket after 30 s: {}",
                text(&vm.err)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        vm
    }

    fn console(&self) -> String {
        text(&self.out)
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits (≤ 30 s) for `what` on the console.
    fn wait_for(&mut self, what: &str) {
        let start = Instant::now();
        while !self.console().contains(what) {
            if let Ok(Some(s)) = self.child.try_wait() {
                settle(&[&self.out, &self.err]);
                panic!(
                    "ember ended ({s}) before printing {what:?}: {}{}",
                    self.console(),
                    text(&self.err)
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no {what:?} after 30 s; console: {}",
                self.console()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether ember is still running.
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits at most `secs` for ember to end (killing it then): its exit
    /// code (`None`: by a signal or killed), with stderr.
    fn end(&mut self, secs: u64) -> (Option<i32>, String) {
        let status = wait_bounded(&mut self.child, Duration::from_secs(secs));
        settle(&[&self.out, &self.err]);
        (status.and_then(|s| s.code()), text(&self.err))
    }

    /// `ember ctl shutdown`, then the exit (killed if either does not come).
    fn shutdown(&mut self) -> (Option<i32>, String) {
        let sock = self.sock.display().to_string();
        let _ = ember_for(&["ctl", "--api-socket", &sock, "shutdown"], 15);
        self.end(15)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ember snapshot --api-socket SOCK --to TO [--resume]`, within 60 s.
fn snapshot(sock: &Path, to: &Path, resume: bool) -> Ran {
    let mut cmd = ember();
    cmd.args(["snapshot", "--api-socket"])
        .arg(sock)
        .arg("--to")
        .arg(to);
    if resume {
        cmd.arg("--resume");
    }
    run_for(&mut cmd, Duration::from_secs(60))
}

/// A snapshot of the test guest running `cmdline` with `mem`, taken after
/// `up` (the VM ends with it).
fn snapshot_of_guest(dir: &Scratch, name: &str, mem: &str, cmdline: &str) -> PathBuf {
    let sock = dir.path(&format!("{name}.sock"));
    let g = guest();
    let mut vm = Vm::boot(&["--kernel", &g, "--mem", mem, "--cmdline", cmdline], &sock);
    vm.wait_for("up\n");
    let snap = dir.path(name);
    let r = snapshot(&sock, &snap, false);
    assert_eq!(r.code, Some(0), "snapshot: {}", r.show());
    let (code, err) = vm.end(15);
    assert_eq!(
        code,
        Some(0),
        "a snapshot without --resume ends the VM: {err}"
    );
    snap
}

/// The names in a directory, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// A tmpfs of `mib` MiB mounted (as root) on a fresh directory, unmounted at drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, mib: u32) -> Tmpfs {
        std::fs::create_dir_all(&at).unwrap();
        let r = run_for(
            Command::new("mount")
                .args([
                    "-t",
                    "tmpfs",
                    "-o",
                    &format!("size={mib}m,mode=0755"),
                    "tmpfs",
                ])
                .arg(&at),
            Duration::from_secs(10),
        );
        assert_eq!(
            r.code,
            Some(0),
            "mounting a tmpfs (this test runs as root): {}",
            r.show()
        );
        Tmpfs(at)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let umount = |lazy: bool| {
            let mut c = Command::new("umount");
            if lazy {
                c.arg("-l");
            }
            run_for(c.arg(&self.0), Duration::from_secs(10)).code == Some(0)
        };
        if !umount(false) {
            umount(true);
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

// ---------------------------------------------------------------- item 3

/// A snapshot that fails (the disk fills) into a directory holding a good
/// snapshot leaves that snapshot exactly as it was, and nothing else.
#[test]
fn a_failed_snapshot_leaves_the_previous_one_whole_and_nothing_else() {
    if !require_kvm("failed_snapshot") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        ember_testing::skip(
            "failed_snapshot",
            "mounting the small tmpfs the snapshot fills needs root",
        );
        return;
    }
    let dir = Scratch::new("rel-snapfail");
    let g = guest();
    let fs = Tmpfs::mount(dir.path("small"), 40);
    let target = fs.0.join("snap");

    // The good snapshot: a 32 MiB guest that touched little (the memory
    // file is sparse), kept aside for comparison.
    let sock = dir.path("a.sock");
    let mut a = Vm::boot(&["--kernel", &g, "--mem", "32M", "--cmdline", SPIN], &sock);
    a.wait_for("up\n");
    let r = snapshot(&sock, &target, false);
    assert_eq!(r.code, Some(0), "the good snapshot: {}", r.show());
    a.end(15);
    let before: Vec<(String, Vec<u8>)> = names(&target)
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(target.join(&n)).unwrap();
            (n, bytes)
        })
        .collect();

    // A guest with 64 MiB touched cannot fit in the 40 MiB left.
    let sock = dir.path("b.sock");
    let mut b = Vm::boot(
        &[
            "--kernel",
            &g,
            "--mem",
            "128M",
            "--cmdline",
            "touch=64 print=up spin=600000",
        ],
        &sock,
    );
    b.wait_for("up\n");
    let r = snapshot(&sock, &target, false);
    assert_ne!(
        r.code,
        Some(0),
        "the big snapshot was to fail (disk full): {}",
        r.show()
    );
    b.shutdown();
    drop(b);

    assert_eq!(
        names(&fs.0),
        ["snap"],
        "beside the target after the failed snapshot ({})",
        r.show()
    );
    let after = names(&target);
    let kept: Vec<&str> = before.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(after, kept, "the target's files after the failed snapshot");
    for (n, bytes) in &before {
        let now = std::fs::read(target.join(n)).unwrap();
        assert!(
            now == *bytes,
            "{n} changed ({} → {} bytes) by the failed snapshot",
            bytes.len(),
            now.len()
        );
    }
}

/// Symlinks planted where a snapshot used to write its temporary files
/// (`memory.tmp`, `state.tmp`) are not followed: their victims stay as they were.
#[test]
fn a_snapshot_does_not_follow_symlinks_planted_in_its_target() {
    if !require_kvm("snapshot_symlinks") {
        return;
    }
    let dir = Scratch::new("rel-snaplink");
    let g = guest();
    let target = dir.path("snap");
    std::fs::create_dir(&target).unwrap();
    let victims = [dir.path("victim-memory"), dir.path("victim-state")];
    for (v, tmp) in victims.iter().zip(["memory.tmp", "state.tmp"]) {
        std::fs::write(v, b"precious\n").unwrap();
        std::os::unix::fs::symlink(v, target.join(tmp)).unwrap();
    }
    let sock = dir.path("vm.sock");
    let mut vm = Vm::boot(&["--kernel", &g, "--mem", "32M", "--cmdline", SPIN], &sock);
    vm.wait_for("up\n");
    let r = snapshot(&sock, &target, false);
    vm.shutdown();
    for v in &victims {
        let now = std::fs::read(v).unwrap();
        assert!(
            now == b"precious\n",
            "{} was written through a symlink in the target ({} bytes now); snapshot: {}",
            v.display(),
            now.len(),
            r.show()
        );
    }
}

/// Two VMs snapshotting into one directory at once leave a snapshot wholly
/// of one of them: its memory file is that VM's own (as a snapshot of it
/// alone shows: the spinning guest does not write memory), and it restores.
#[test]
fn two_snapshots_into_one_directory_at_once_do_not_mix() {
    if !require_kvm("snapshot_race") {
        return;
    }
    let dir = Scratch::new("rel-snaprace");
    let g = guest();
    // Different sizes: a state of one with the memory of the other is refused on restore.
    let mut vms: Vec<(Vm, PathBuf, Vec<u8>)> = Vec::new();
    for (name, mem) in [("a", "32M"), ("b", "48M")] {
        let sock = dir.path(&format!("{name}.sock"));
        let mut vm = Vm::boot(&["--kernel", &g, "--mem", mem, "--cmdline", SPIN], &sock);
        vm.wait_for("up\n");
        let own = dir.path(&format!("own-{name}"));
        let r = snapshot(&sock, &own, true);
        assert_eq!(r.code, Some(0), "{name}'s own snapshot: {}", r.show());
        let memory = std::fs::read(own.join("memory")).unwrap();
        vms.push((vm, sock, memory));
    }
    for round in 0..8 {
        let target = dir.path(&format!("shared{round}"));
        let replies: Vec<Ran> = std::thread::scope(|s| {
            let hs: Vec<_> = vms
                .iter()
                .map(|(_, sock, _)| {
                    let target = &target;
                    s.spawn(move || snapshot(sock, target, true))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let said = format!("a: {}; b: {}", replies[0].show(), replies[1].show());
        assert!(
            replies.iter().any(|r| r.code == Some(0)),
            "round {round}: neither snapshot was written: {said}"
        );
        let memory = std::fs::read(target.join("memory"))
            .unwrap_or_else(|e| panic!("round {round}: no memory file ({e}): {said}"));
        let whose = vms.iter().position(|(_, _, m)| *m == memory);
        assert!(
            whose.is_some(),
            "round {round}: the memory file ({} bytes) is neither VM's own: {said}",
            memory.len()
        );
        // The state goes with that memory: a restore accepts the pair.
        let t = target.display().to_string();
        let r = ember_for(&["boot", "--timeout", "0.5", "--restore", &t], 30);
        assert_eq!(
            r.code,
            Some(ember::exit::EXIT_TIMEOUT),
            "round {round}: restoring the shared snapshot (memory of {}): {}; snapshots: {said}",
            ["a", "b"][whose.unwrap()],
            r.show()
        );
    }
    for (vm, _, _) in &mut vms {
        vm.shutdown();
    }
}

/// A snapshot holds guest RAM: its directory is 0700 and its files 0600,
/// whether the directory is new or was already there with wider permissions.
#[test]
fn snapshots_are_private() {
    if !require_kvm("snapshot_private") {
        return;
    }
    let dir = Scratch::new("rel-snapmode");
    let g = guest();
    let sock = dir.path("vm.sock");
    let mut vm = Vm::boot(&["--kernel", &g, "--mem", "32M", "--cmdline", SPIN], &sock);
    vm.wait_for("up\n");
    let fresh = dir.path("fresh");
    let old = dir.path("old");
    std::fs::create_dir(&old).unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut wrong = Vec::new();
    for (target, resume) in [(&fresh, true), (&old, false)] {
        let r = snapshot(&sock, target, resume);
        assert_eq!(r.code, Some(0), "snapshot: {}", r.show());
        if mode(target) != 0o700 {
            wrong.push(format!("{} {:o}", target.display(), mode(target)));
        }
        for n in names(target) {
            let p = target.join(&n);
            if mode(&p) != 0o600 {
                wrong.push(format!("{} {:o}", p.display(), mode(&p)));
            }
        }
    }
    vm.end(15);
    assert!(
        wrong.is_empty(),
        "not private (want dir 700, files 600): {}",
        wrong.join(", ")
    );
}

// ---------------------------------------------------------------- item 7

/// Has the child start with SIGHUP and SIGINT ignored, as `nohup CMD &` does.
fn ignoring_hup_and_int(cmd: &mut Command) {
    // SAFETY: between fork and exec only `signal`, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            Ok(())
        });
    }
}

/// `nohup ember boot … --api-socket P &`: the ignored SIGHUP (and SIGINT)
/// stays ignored, so the VM survives both.
#[test]
fn boot_started_with_sighup_ignored_survives_sighup() {
    if !require_kvm("nohup_boot") {
        return;
    }
    let dir = Scratch::new("rel-nohup-boot");
    let g = guest();
    let sock = dir.path("vm.sock");
    let mut cmd = ember();
    cmd.args(["boot", "--kernel", &g, "--mem", "32M", "--cmdline", SPIN]);
    ignoring_hup_and_int(&mut cmd);
    let mut vm = Vm::spawn(cmd, &sock);
    vm.wait_for("up\n");
    for (sig, name) in [(libc::SIGHUP, "SIGHUP"), (libc::SIGINT, "SIGINT")] {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(vm.pid(), sig) };
        std::thread::sleep(Duration::from_millis(700));
        if let Ok(Some(status)) = vm.child.try_wait() {
            settle(&[&vm.err]);
            panic!(
                "ember boot died on {name}, which it inherited as ignored: {status}, stderr {:?}",
                text(&vm.err)
            );
        }
    }
    let (code, err) = vm.shutdown();
    assert_eq!(code, Some(0), "{err}");
}

/// `nohup ember run … &`: the same for the appliance.
#[test]
fn run_started_with_sighup_ignored_survives_sighup() {
    let mut cmd = ember();
    cmd.args([
        "run",
        "--",
        "sh",
        "-c",
        "echo started; sleep 5; echo finished",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    ignoring_hup_and_int(&mut cmd);
    let mut child = cmd.spawn().expect("start ember run");
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let start = Instant::now();
    while !text(&out).contains("started") {
        if let Ok(Some(s)) = child.try_wait() {
            settle(&[&out, &err]);
            panic!(
                "ember run ended ({s}) before the command started: {}",
                text(&err)
            );
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the command did not start within 120 s: {}", text(&err));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for sig in [libc::SIGHUP, libc::SIGINT] {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, sig) };
        std::thread::sleep(Duration::from_millis(300));
    }
    let status = wait_bounded(&mut child, Duration::from_secs(60));
    settle(&[&out, &err]);
    let (out, err) = (text(&out), text(&err));
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("finished"),
        "ember run with SIGHUP and SIGINT ignored, after both: {}, stdout {out:?}, stderr {:?}",
        status.map_or("still running after 60 s (killed)".into(), |s| s
            .to_string()),
        err.trim()
    );
}

// ---------------------------------------------------------------- item 8

/// Whether `r` is a refusal before anything ran: a non-zero status that is
/// not the guest's, no console output, and one message (clap's usage
/// lines aside) naming `option`.
fn refused_naming(r: &Ran, option: &str) -> Result<(), String> {
    let messages: Vec<&str> = r
        .err_lines()
        .into_iter()
        .filter(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .collect();
    let ok = !r.timed_out
        && matches!(r.code, Some(1) | Some(2))
        && r.out.is_empty()
        && messages.len() == 1
        && messages[0].contains(option);
    if ok {
        Ok(())
    } else {
        Err(format!("{option}: {}", r.show()))
    }
}

/// `--restore` refuses, in one line naming it, each option it cannot honour.
/// (`--prefault` it honours: the restored memory is committed,
/// `vmm_e2e mem_e2e`; `--mem-lock` too, below.)
#[test]
fn restore_refuses_the_options_it_cannot_honour() {
    if !require_kvm("restore_options") {
        return;
    }
    let dir = Scratch::new("rel-restore-opts");
    let snap = snapshot_of_guest(&dir, "snap", "32M", SHORT);
    let s = snap.display().to_string();
    let mut failures = Vec::new();
    for (option, value) in [
        ("--cpus", Some("2")),
        ("--mem", Some("64M")),
        ("--hugepages", None),
        ("--no-acpi", None),
        ("--balloon-target", Some("4M")),
    ] {
        let mut args = vec!["boot", "--restore", &s, option];
        args.extend(value);
        if let Err(e) = refused_naming(&ember_for(&args, 30), option) {
            failures.push(e);
        }
    }
    assert!(
        failures.is_empty(),
        "--restore accepted options it ignores:\n{}",
        failures.join("\n")
    );
}

/// The VmLck line of /proc/PID/status, in kB.
fn vm_lck_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// `--restore … --mem-lock` locks the restored VM's memory.
#[test]
fn restore_honours_mem_lock() {
    if !require_kvm("restore_mem_lock") {
        return;
    }
    let dir = Scratch::new("rel-restore-lock");
    let snap = snapshot_of_guest(&dir, "snap", "32M", SPIN);
    let s = snap.display().to_string();
    let sock = dir.path("restored.sock");
    let mut vm = Vm::boot(&["--restore", &s, "--mem-lock"], &sock);
    // Locking may follow the restore's first instruction by a little.
    let start = Instant::now();
    let mut locked = 0;
    while start.elapsed() < Duration::from_secs(3) {
        locked = vm_lck_kib(vm.pid());
        if locked > 0 || !vm.alive() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let alive = vm.alive();
    let (code, err) = vm.shutdown();
    assert!(
        alive && locked > 0,
        "restored with --mem-lock: VmLck {locked} kB (alive: {alive}, exit {code:?}, stderr {:?})",
        err.trim()
    );
}

// ---------------------------------------------------------------- item 9

/// A balloon target beyond the guest's memory is refused at start, in one
/// line, as the control socket refuses it.
#[test]
fn a_balloon_target_beyond_memory_is_refused_at_start() {
    if !require_kvm("balloon_target_bound") {
        return;
    }
    let g = guest();
    let mut failures = Vec::new();
    for target in ["1T", "16T"] {
        let r = ember_for(
            &[
                "boot",
                "--kernel",
                &g,
                "--mem",
                "64M",
                "--balloon-target",
                target,
                "--cmdline",
                "print=ran exit=3",
            ],
            30,
        );
        if let Err(e) = refused_naming(&r, "balloon") {
            failures.push(format!("--balloon-target {target}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------- item 10

/// Eight clients trickling a request a byte a second (never finishing it)
/// hold every slot; with a 2 s request limit `ember ctl shutdown` still gets
/// through within 15 s.
#[test]
fn trickling_clients_do_not_lock_out_shutdown() {
    if !require_kvm("api_trickle") {
        return;
    }
    let dir = Scratch::new("rel-trickle");
    let g = guest();
    let sock = dir.path("vm.sock");
    let mut cmd = ember();
    cmd.args(["boot", "--kernel", &g, "--mem", "32M", "--cmdline", SPIN])
        .env("EMBER_API_REQUEST_TIMEOUT", "2");
    let mut vm = Vm::spawn(cmd, &sock);
    vm.wait_for("up\n");
    let stop = Arc::new(AtomicBool::new(false));
    let trickles: Vec<_> = (0..8)
        .map(|_| {
            let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut sent = 0;
                while !stop.load(Ordering::SeqCst) && sent < 60 {
                    if s.write_all(b" ").is_err() {
                        break;
                    }
                    sent += 1;
                    for _ in 0..10 {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let s = sock.display().to_string();
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < Duration::from_secs(15) {
        let r = ember_for(&["ctl", "--api-socket", &s, "shutdown"], 10);
        if r.code == Some(0) {
            last = None;
            break;
        }
        last = Some(r);
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, Ordering::SeqCst);
    for t in trickles {
        t.join().unwrap();
    }
    if let Some(r) = last {
        panic!(
            "ember ctl shutdown refused for {:.0} s by 8 trickling clients; last: {}",
            start.elapsed().as_secs_f64(),
            r.show()
        );
    }
    let (code, err) = vm.end(15);
    assert_eq!(code, Some(0), "{err}");
}

/// A socket that accepts and never answers (held until dropped).
struct Silent {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Silent {
    fn listen(path: PathBuf) -> Silent {
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((c, _)) => held.push(c),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Silent {
            path,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `ember ctl` and `ember snapshot` give up on a socket that never answers
/// (EMBER_CTL_TIMEOUT=2: well within 10 s), saying so in one line.
#[test]
fn ctl_and_snapshot_time_out_on_a_silent_socket() {
    let dir = Scratch::new("rel-silent");
    let silent = Silent::listen(dir.path("silent.sock"));
    let s = silent.path.display().to_string();
    let to = dir.path("snap").display().to_string();
    let mut failures = Vec::new();
    for args in [
        vec!["ctl", "--api-socket", &s, "status"],
        vec!["snapshot", "--api-socket", &s, "--to", &to],
    ] {
        let r = run_for(
            ember().args(&args).env("EMBER_CTL_TIMEOUT", "2"),
            Duration::from_secs(10),
        );
        let lines = r.err_lines();
        let says = lines.len() == 1 && {
            let l = lines[0].to_lowercase();
            l.contains("timed out") || l.contains("timeout") || l.contains("no reply")
        };
        if r.timed_out || r.code == Some(0) || !says {
            failures.push(format!("ember {}: {}", args[0], r.show()));
        }
    }
    drop(silent);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------- item 11

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// A FIFO given as a kernel, initrd, read-only disk or snapshot state is
/// refused at once (opening it would wait for a writer), in one line.
#[test]
fn fifos_are_refused_without_blocking() {
    let dir = Scratch::new("rel-fifo");
    let g = guest();
    let fifo = dir.path("fifo");
    mkfifo(&fifo);
    let snap = dir.path("snap");
    std::fs::create_dir(&snap).unwrap();
    std::fs::write(snap.join("memory"), vec![0u8; 1 << 20]).unwrap();
    mkfifo(&snap.join("state"));
    let f = fifo.display().to_string();
    let ro = format!("{f},ro");
    let s = snap.display().to_string();
    let cases: [(&str, Vec<&str>); 4] = [
        (
            "--kernel FIFO",
            vec!["boot", "--kernel", &f, "--mem", "32M"],
        ),
        (
            "--initrd FIFO",
            vec!["boot", "--kernel", &g, "--initrd", &f, "--mem", "32M"],
        ),
        (
            "--disk FIFO,ro",
            vec!["boot", "--kernel", &g, "--disk", &ro, "--mem", "32M"],
        ),
        ("snapshot state a FIFO", vec!["boot", "--restore", &s]),
    ];
    let mut failures = Vec::new();
    for (what, args) in cases {
        let mut args = args;
        if args[1] != "--restore" {
            args.extend(["--cmdline", "print=ran exit=3"]);
        }
        let r = ember_for(&args, 5);
        if r.timed_out || r.code != Some(1) || r.err_lines().len() != 1 || !r.out.is_empty() {
            failures.push(format!("{what}: {}", r.show()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A relative `--disk` path is recorded absolute: the snapshot restores
/// from another working directory.
#[test]
fn a_relative_disk_path_is_recorded_absolute() {
    if !require_kvm("relative_disk") {
        return;
    }
    let dir = Scratch::new("rel-reldisk");
    let g = guest();
    let here = dir.path("here");
    let elsewhere = dir.path("elsewhere");
    std::fs::create_dir(&here).unwrap();
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::write(here.join("d.img"), vec![0u8; 1 << 20]).unwrap();
    let sock = dir.path("vm.sock");
    let mut cmd = ember();
    cmd.current_dir(&here).args([
        "boot",
        "--kernel",
        &g,
        "--mem",
        "32M",
        "--disk",
        "d.img",
        "--cmdline",
        SHORT,
    ]);
    let mut vm = Vm::spawn(cmd, &sock);
    vm.wait_for("up\n");
    let snap = dir.path("snap");
    let r = snapshot(&sock, &snap, false);
    assert_eq!(r.code, Some(0), "snapshot: {}", r.show());
    vm.end(15);
    let r = run_for(
        ember()
            .current_dir(&elsewhere)
            .args(["boot", "--timeout", "20", "--restore"])
            .arg(&snap),
        Duration::from_secs(30),
    );
    assert!(
        r.code == Some(guest_status(4)) && r.out.contains("resumed"),
        "restoring from another directory: {}",
        r.show()
    );
}

/// A snapshot whose memory file was altered (same size) is not blamed on
/// the guest as a triple fault: the message says the memory is damaged.
#[test]
fn damaged_snapshot_memory_is_not_reported_as_a_triple_fault() {
    if !require_kvm("damaged_memory") {
        return;
    }
    let dir = Scratch::new("rel-badmem");
    let snap = snapshot_of_guest(&dir, "snap", "32M", SHORT);
    // Every byte of the low 4 MiB (page tables, descriptor tables, the
    // guest's code) inverted.
    let path = snap.join("memory");
    let mut memory = std::fs::read(&path).unwrap();
    for b in &mut memory[..4 << 20] {
        *b ^= 0xff;
    }
    // A new inode: the damage is to the file, not a file the VM still maps.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, memory).unwrap();
    let s = snap.display().to_string();
    let r = ember_for(&["boot", "--timeout", "10", "--restore", &s], 30);
    let said = r.err.to_lowercase();
    assert!(
        r.code != Some(0)
            && !said.contains("triple fault")
            && said.contains("memory")
            && r.err_lines().len() == 1,
        "restoring a snapshot with damaged memory: {}",
        r.show()
    );
}

/// An io error names its cause once (not "(os error 21): Is a directory
/// (os error 21)"), in one line.
#[test]
fn io_errors_state_their_cause_once() {
    let dir = Scratch::new("rel-ioerr");
    let g = guest();
    let state_dir = dir.path("state-is-dir");
    std::fs::create_dir_all(state_dir.join("state")).unwrap();
    std::fs::write(state_dir.join("memory"), vec![0u8; 1 << 20]).unwrap();
    let sd = state_dir.display().to_string();
    let missing = dir.path("missing").display().to_string();
    let cases: [(&str, Vec<&str>); 6] = [
        ("--kernel /", vec!["boot", "--kernel", "/"]),
        ("--initrd /", vec!["boot", "--kernel", &g, "--initrd", "/"]),
        ("--disk /", vec!["boot", "--kernel", &g, "--disk", "/"]),
        ("--pmem /", vec!["boot", "--kernel", &g, "--pmem", "/"]),
        (
            "--restore (state a directory)",
            vec!["boot", "--restore", &sd],
        ),
        ("--restore (missing)", vec!["boot", "--restore", &missing]),
    ];
    let mut failures = Vec::new();
    for (what, mut args) in cases {
        if args[1] != "--restore" {
            args.extend(["--mem", "32M", "--cmdline", "print=ran exit=3"]);
        }
        let r = ember_for(&args, 20);
        let doubled = r.err.matches("(os error").count() > 1
            || ["Is a directory", "No such file"]
                .iter()
                .any(|cause| r.err.matches(cause).count() > 1);
        if r.code != Some(1) || r.err_lines().len() != 1 || doubled {
            failures.push(format!("{what}: {}", r.show()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `ember ARGS` fails in one line that lacks `wrong` and has one of `right`.
fn says_the_cause(r: &Ran, wrong: &str, right: &[&str]) -> bool {
    let said = r.err.to_lowercase();
    !r.timed_out
        && r.code.is_some_and(|c| c != 0)
        && r.err_lines().len() == 1
        && !said.contains(&wrong.to_lowercase())
        && right.iter().any(|w| said.contains(w))
}

/// `--mem 1` is a size (one byte): too small, not a multiple of a page.
#[test]
fn mem_1_is_not_called_not_a_memory_size() {
    let g = guest();
    let r = ember_for(&["boot", "--kernel", &g, "--mem", "1"], 20);
    assert!(
        says_the_cause(
            &r,
            "not a memory size",
            &["small", "multiple", "4096", "4k", "page"]
        ),
        "--mem 1: {}",
        r.show()
    );
}

/// `--timeout 1e9` is positive: the problem is its size.
#[test]
fn timeout_1e9_is_not_called_not_positive() {
    let g = guest();
    let r = ember_for(
        &["boot", "--kernel", &g, "--mem", "32M", "--timeout", "1e9"],
        20,
    );
    assert!(
        says_the_cause(
            &r,
            "positive",
            &["large", "long", "at most", "less than", "below", "maximum"]
        ),
        "--timeout 1e9: {}",
        r.show()
    );
}

/// `EMBER_CACHE` naming a regular file: the message says so, rather than
/// sending the user to `ember setup` (which cannot fix it).
#[test]
fn ember_cache_naming_a_file_says_so() {
    let dir = Scratch::new("rel-cachefile");
    let file = dir.path("cache");
    std::fs::write(&file, b"not a directory\n").unwrap();
    let r = run_for(
        ember()
            .args(["run", "--", "true"])
            .env("EMBER_CACHE", &file),
        Duration::from_secs(60),
    );
    assert!(
        says_the_cause(&r, "ember setup", &["not a directory"]),
        "EMBER_CACHE={}: {}",
        file.display(),
        r.show()
    );
}

/// `ember snapshot --to FILE` (a regular file): "not a directory", not a bare "File exists".
#[test]
fn snapshot_to_a_file_says_it_is_not_a_directory() {
    if !require_kvm("snapshot_to_file") {
        return;
    }
    let dir = Scratch::new("rel-snapfile");
    let g = guest();
    let file = dir.path("file");
    std::fs::write(&file, b"keep\n").unwrap();
    let sock = dir.path("vm.sock");
    let mut vm = Vm::boot(&["--kernel", &g, "--mem", "32M", "--cmdline", SPIN], &sock);
    vm.wait_for("up\n");
    let r = snapshot(&sock, &file, true);
    vm.shutdown();
    assert!(
        says_the_cause(&r, "file exists", &["not a directory"]),
        "--to a regular file: {}",
        r.show()
    );
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"keep\n",
        "the file is left alone"
    );
}

/// One image given twice to one VM is not "in use by another VM".
#[test]
fn one_image_twice_in_one_vm_is_not_another_vm() {
    if !require_kvm("same_image_twice") {
        return;
    }
    let dir = Scratch::new("rel-twice");
    let g = guest();
    let img = dir.path("d.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let i = img.display().to_string();
    let mut failures = Vec::new();
    for (what, flag) in [("--disk twice", "--disk"), ("--pmem twice", "--pmem")] {
        let r = ember_for(
            &[
                "boot",
                "--kernel",
                &g,
                "--mem",
                "32M",
                flag,
                &i,
                flag,
                &i,
                "--cmdline",
                "print=ran exit=3",
            ],
            20,
        );
        let said = r.err.to_lowercase();
        if r.code != Some(1) || r.err_lines().len() != 1 || said.contains("another vm") {
            failures.push(format!("{what}: {}", r.show()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A disk given `,ro` while another VM writes it: the refusal does not tell
/// the user to add the `,ro` they gave.
#[test]
fn no_ro_hint_when_ro_was_given() {
    if !require_kvm("ro_hint") {
        return;
    }
    let dir = Scratch::new("rel-rohint");
    let g = guest();
    let img = dir.path("d.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let i = img.display().to_string();
    let sock = dir.path("writer.sock");
    let mut writer = Vm::boot(
        &[
            "--kernel",
            &g,
            "--mem",
            "32M",
            "--disk",
            &i,
            "--cmdline",
            SPIN,
        ],
        &sock,
    );
    writer.wait_for("up\n");
    let ro = format!("{i},ro");
    let r = ember_for(
        &[
            "boot",
            "--kernel",
            &g,
            "--mem",
            "32M",
            "--disk",
            &ro,
            "--cmdline",
            "print=ran exit=3",
        ],
        20,
    );
    writer.shutdown();
    let said = r.err.to_lowercase();
    assert!(
        r.code == Some(1)
            && r.err_lines().len() == 1
            && said.contains("in use")
            && !said.contains("give it `,ro`")
            && !said.contains("to share it read-only"),
        "{i},ro while another VM writes it: {}",
        r.show()
    );
}
