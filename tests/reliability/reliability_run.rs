//! Black-box tests of issue 22's `ember run` and boot-lab items (1, 2, 4, 5,
//! 6 and 12): each drives the `ember` binary (`EMBER_BIN`, else cargo's) the
//! way the reproducer does and checks what the issue says ember must
//! do, not what it did.
//!
//! - 1: a write error on ember's stdout fails the run in one line; a closed
//!   pipe ends it with status 141 and no message.
//! - 2: a reader stopped for seconds loses none of 100 MB of output (on
//!   the ember backend, which the issue found sound, 1.3 MB: its channel is
//!   slow here).
//! - 4: a run ended by SIGINT, SIGTERM, SIGHUP or SIGKILL leaves no file in
//!   its temp directory and no VMM; its files are 0600 while they exist.
//! - 5: a cache bounded to one byte evicts no appliance another run boots.
//! - 6: a truncated cached snapshot is rebuilt.
//! - 12: the boot lab reaches userspace with no `--initrd`, and a panicking
//!   guest ends its boot at once, reported as a panic.
//!
//! The QEMU tests need `ember setup` (the kernel in ember's cache) and QEMU;
//! the ember backend's need EMBER_PVM_KERNEL (scripts/test sets it) and skip
//! loudly without it, as the other PVM tests do. Every child runs in its own
//! process group, killed when a bounded wait runs out, and every file a test
//! makes is in a scratch directory removed however the test ends.
//!
//! Each test failed on 4e6807d (but the ember backend's slow-reader guard)
//! and is ignored until its item's fix lands (items 1 and 2's have: ef74e9d;
//! items 4, 5 and 6's: ae8ebaf and the next; item 12's: the lab's
//! appliance initramfs and panic watch);
//! `cargo test --test reliability_run -- --include-ignored` runs them all.

use crate::common;

use common::{PVM_CMDLINE, Scratch, pvm_kernel_dir, require_kvm};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `ember` with ember-init found (beside `EMBER_BIN`, else cargo's release
/// build), no log level from the caller, default dispositions for the
/// signals the tests send (a harness started in the background inherits
/// SIGINT ignored, and ember keeps an inherited SIG_IGN) and its own
/// process group, so a bounded wait can kill it with its VMM.
fn ember() -> Command {
    let mut c = common::ember();
    let beside = std::env::var_os("EMBER_BIN")
        .map(|b| PathBuf::from(b).with_file_name("ember-init"))
        .filter(|p| p.is_file());
    if beside.is_none() && std::env::var_os("EMBER_INIT").is_none() {
        c.env(
            "EMBER_INIT",
            common::init_binary().unwrap_or_else(|e| panic!("{e}")),
        );
    }
    c.env_remove("EMBER_LOG").stdin(Stdio::null());
    c.process_group(0);
    // SAFETY: signal() is async-signal-safe; it only changes dispositions
    // in the child between fork and exec.
    unsafe {
        c.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    c
}

/// `ember run --backend qemu --timeout T`.
fn run_qemu(timeout: u32) -> Command {
    let mut c = ember();
    c.args([
        "run",
        "--backend",
        "qemu",
        "--timeout",
        &timeout.to_string(),
    ]);
    c
}

/// The ember backend's appliance on the PVM test kernel, with `cache` as
/// ember's cache: `ember run --backend ember …` up to its options.
struct Pvm {
    kernel: PathBuf,
}

impl Pvm {
    /// `None`, with a loud skip line, when the ember backend cannot run here.
    fn find(test: &str) -> Option<Pvm> {
        if !require_kvm(test) {
            return None;
        }
        let dir = pvm_kernel_dir(test)?;
        Some(Pvm {
            kernel: dir.join("vmlinux"),
        })
    }

    fn run(&self, cache: &Path, timeout: u32) -> Command {
        let mut c = ember();
        c.env("EMBER_CACHE", cache)
            .args(["run", "--backend", "ember", "--initramfs", "--mem", "128M"])
            .arg("--kernel")
            .arg(&self.kernel)
            .args(["--cmdline", PVM_CMDLINE, "--timeout", &timeout.to_string()]);
        c
    }

    /// Makes the appliance's snapshot in `cache` (a cold boot) so later runs
    /// restore it.
    fn warm_up(&self, cache: &Path) {
        let done = finish(self.run(cache, 600).args(["--", "true"]), secs(660));
        assert_eq!(
            done.status.code(),
            Some(0),
            "the run that makes the snapshot failed: {}",
            done.err()
        );
        eprintln!("snapshot made in {:.1} s", done.elapsed.as_secs_f64());
    }

    /// A cache whose snapshot is made once for the tests that only restore
    /// it (a cold boot of the PVM kernel takes most of a minute here); it
    /// is removed when the test process exits. A test that damages its
    /// cache makes its own.
    fn shared_warm_cache(&self) -> PathBuf {
        static SHARED: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
        extern "C" fn remove_shared() {
            if let Some(dir) = SHARED.lock().ok().and_then(|mut s| s.take()) {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dir) = &*shared {
            return dir.join("cache");
        }
        // Removed at once if the warm-up fails; else at exit.
        let scratch = Scratch::new("rel-warm");
        self.warm_up(&scratch.path("cache"));
        let dir = scratch.0.to_path_buf();
        std::mem::forget(scratch);
        *shared = Some(dir.clone());
        // SAFETY: registers a plain function; it runs once, at exit.
        unsafe { libc::atexit(remove_shared) };
        dir.join("cache")
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A child process whose whole process group is killed when it is dropped
/// still running (a failed assertion, a bounded wait run out).
struct Proc {
    child: Child,
    what: String,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Proc {
        let what = format!("{cmd:?}");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
        Proc { child, what }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Kills the child's process group and every descendant (the boot lab
    /// puts its VMM in a group of its own, without a parent-death signal).
    fn kill_group(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let mut all = vec![self.pid()];
            let mut i = 0;
            while i < all.len() {
                all.extend(children_of(all[i]));
                i += 1;
            }
            // SAFETY: kill() on our own child's process group (the child
            // leads it and is not reaped yet, so the id is not reused) and
            // on its descendants, found while it still lives.
            unsafe {
                libc::kill(-self.pid(), libc::SIGKILL);
                for &p in &all[1..] {
                    libc::kill(p, libc::SIGKILL);
                }
            }
        }
        let _ = self.child.wait();
    }

    /// Waits up to `limit`; past it, kills the process group and says so.
    fn wait_within(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let until = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                return Ok(s);
            }
            if Instant::now() >= until {
                self.kill_group();
                return Err(format!(
                    "still running after {:.0} s (killed): {}",
                    limit.as_secs_f64(),
                    self.what
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// Reads `r` to its end on a thread.
fn slurp(mut r: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// A finished run.
struct Done {
    status: ExitStatus,
    out: Vec<u8>,
    err: Vec<u8>,
    elapsed: Duration,
}

impl Done {
    fn out(&self) -> String {
        String::from_utf8_lossy(&self.out).into_owned()
    }
    fn err(&self) -> String {
        String::from_utf8_lossy(&self.err).into_owned()
    }
}

/// Runs `cmd` to its end (stderr always captured; stdout captured unless
/// the caller set it), failing the test if it is still running after `limit`.
fn finish(cmd: &mut Command, limit: Duration) -> Done {
    try_finish(cmd, limit).unwrap_or_else(|e| panic!("{e}"))
}

fn try_finish(cmd: &mut Command, limit: Duration) -> Result<Done, String> {
    let start = Instant::now();
    cmd.stderr(Stdio::piped());
    let mut p = Proc::spawn(cmd);
    let out = p.child.stdout.take().map(slurp);
    let err = slurp(p.child.stderr.take().unwrap());
    let status = p.wait_within(limit);
    let elapsed = start.elapsed();
    let out = out.map(|h| h.join().unwrap()).unwrap_or_default();
    let err = err.join().unwrap();
    match status {
        Ok(status) => Ok(Done {
            status,
            out,
            err,
            elapsed,
        }),
        Err(e) => Err(format!(
            "{e}\nstderr so far:\n{}",
            String::from_utf8_lossy(&err)
        )),
    }
}

/// Asserts that a run failed because of a write error on its stdout: a
/// non-zero status and the reason (`reason`) in one line, nothing else.
fn assert_fails_in_one_line(done: &Done, reason: &str) {
    let err = done.err();
    assert!(
        !done.status.success(),
        "exited 0 (a write error on stdout must fail the run); stderr: {err:?}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        lines.len() == 1 && lines[0].contains(reason),
        "want the reason ({reason}) in one line, got status {:?} and stderr {err:?}",
        done.status
    );
}

// ---------------------------------------------------------------- item 1

#[test]
fn item1_stdout_on_dev_full_fails_the_run_in_one_line() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let done = finish(
        run_qemu(60).args(["--", "echo", "hi"]).stdout(full),
        secs(90),
    );
    assert_fails_in_one_line(&done, "No space left on device");
}

/// A tmpfs mounted for one test, unmounted when dropped (before its
/// scratch directory goes).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(at).unwrap();
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Ok(Tmpfs(at.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Busy (a child still writing): detach it so it goes when freed.
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

#[test]
fn item1_stdout_on_a_full_tmpfs_fails_the_run_in_one_line() {
    let test = "item1_stdout_on_a_full_tmpfs_fails_the_run_in_one_line";
    let scratch = Scratch::new("rel-tmpfs");
    let small = match Tmpfs::mount(&scratch.path("small"), "2m") {
        Ok(m) => m,
        Err(e) => {
            // Mounting needs root (CAP_SYS_ADMIN).
            ember_testing::skip(test, &e);
            return;
        }
    };
    let file = small.0.join("out");
    let out = std::fs::File::create(&file).unwrap();
    // The host's own `seq 1 1000000` (6.9 MB) says "No space left on device"
    // here and exits 1.
    let done = finish(
        run_qemu(60).args(["--", "seq", "1", "1000000"]).stdout(out),
        secs(90),
    );
    assert_fails_in_one_line(&done, "No space left on device");
    drop(small);
}

/// `ember run … -- yes | head -1`: the run must end promptly once `head`
/// has gone, with status 141 (as a shell reports a pipeline member killed
/// by SIGPIPE) and no message.
fn assert_a_closed_pipe_ends_the_run(mut ember_run: Command, boot_limit: Duration) {
    let mut run = Proc::spawn(
        ember_run
            .args(["--", "yes"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let err = slurp(run.child.stderr.take().unwrap());
    let pipe = run.child.stdout.take().unwrap();
    let mut head = Proc::spawn(
        Command::new("head")
            .arg("-1")
            .stdin(Stdio::from(pipe))
            .stdout(Stdio::piped())
            .process_group(0),
    );
    let head_out = slurp(head.child.stdout.take().unwrap());
    head.wait_within(boot_limit)
        .unwrap_or_else(|e| panic!("head never got a line: {e}"));
    assert_eq!(head_out.join().unwrap(), b"y\n");
    let closed = Instant::now();
    let status = run.wait_within(secs(20));
    let err = String::from_utf8_lossy(&err.join().unwrap()).into_owned();
    let status = status.unwrap_or_else(|e| {
        panic!("the run did not end after its reader went (EPIPE ignored): {e}; stderr: {err:?}")
    });
    eprintln!(
        "ended {:.2} s after head exited",
        closed.elapsed().as_secs_f64()
    );
    assert!(
        status.code() == Some(141) || status.signal() == Some(libc::SIGPIPE),
        "want status 141 (or death by SIGPIPE), got {status:?}; stderr: {err:?}"
    );
    assert!(err.is_empty(), "want no message on EPIPE, got {err:?}");
}

#[test]
fn item1_a_closed_pipe_ends_the_run_with_141_on_qemu() {
    assert_a_closed_pipe_ends_the_run(run_qemu(120), secs(90));
}

#[test]
fn item1_a_closed_pipe_ends_the_run_with_141_on_ember() {
    let Some(pvm) = Pvm::find("item1_a_closed_pipe_ends_the_run_with_141_on_ember") else {
        return;
    };
    // The reproducer is a restored run (the restored VM spins on).
    let cache = pvm.shared_warm_cache();
    assert_a_closed_pipe_ends_the_run(pvm.run(&cache, 120), secs(120));
}

// ---------------------------------------------------------------- item 2

/// `seq 1 N`'s output, produced in step with what arrives, for comparison.
struct SeqStream {
    next: u64,
    last: u64,
    buf: Vec<u8>,
    at: usize,
}

impl SeqStream {
    fn new(last: u64) -> Self {
        SeqStream {
            next: 1,
            last,
            buf: Vec::new(),
            at: 0,
        }
    }

    /// The next `n` expected bytes (fewer at the end).
    fn take(&mut self, n: usize) -> &[u8] {
        if self.at > 1 << 20 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        while self.buf.len() - self.at < n && self.next <= self.last {
            use std::io::Write;
            writeln!(self.buf, "{}", self.next).unwrap();
            self.next += 1;
        }
        let end = (self.at + n).min(self.buf.len());
        let s = &self.buf[self.at..end];
        self.at = end;
        s
    }
}

/// What arrived: its length and where it first differed from `seq 1 N`.
#[derive(Debug)]
struct Arrived {
    bytes: u64,
    expected: u64,
    first_difference: Option<u64>,
}

/// The byte count of `seq 1 last`.
fn seq_len(last: u64) -> u64 {
    let mut total = 0;
    let mut lo = 1u64;
    let mut digits = 1;
    while lo <= last {
        let hi = (lo * 10 - 1).min(last);
        total += (hi - lo + 1) * (digits + 1);
        lo *= 10;
        digits += 1;
    }
    total
}

/// `ember run -- seq 1 LAST | cat`, `cat` SIGSTOPped for 4 s once `stop_at`
/// bytes have passed: every byte must arrive, in order, and the run exit 0.
fn assert_a_stopped_reader_loses_nothing(
    mut ember_run: Command,
    last: u64,
    stop_at: u64,
    limit: Duration,
) {
    let mut run = Proc::spawn(
        ember_run
            .args(["--", "seq", "1", &last.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let err = slurp(run.child.stderr.take().unwrap());
    let mut cat = Proc::spawn(
        Command::new("cat")
            .stdin(Stdio::from(run.child.stdout.take().unwrap()))
            .stdout(Stdio::piped())
            .process_group(0),
    );
    let seen = Arc::new(AtomicU64::new(0));
    let check = {
        let mut from_cat = cat.child.stdout.take().unwrap();
        let seen = seen.clone();
        std::thread::spawn(move || {
            let mut want = SeqStream::new(last);
            let mut buf = vec![0u8; 1 << 16];
            let mut first_difference = None;
            let mut bytes = 0u64;
            loop {
                let n = match from_cat.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if first_difference.is_none() {
                    let w = want.take(n);
                    if let Some(i) = (0..n).find(|&i| w.get(i) != Some(&buf[i])) {
                        first_difference = Some(bytes + i as u64);
                    }
                }
                bytes += n as u64;
                seen.store(bytes, Ordering::Relaxed);
            }
            Arrived {
                bytes,
                expected: seq_len(last),
                first_difference,
            }
        })
    };
    let start = Instant::now();
    while seen.load(Ordering::Relaxed) < stop_at && start.elapsed() < secs(120) {
        if run.child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: signals to our own (unreaped) child.
    unsafe { libc::kill(cat.pid(), libc::SIGSTOP) };
    std::thread::sleep(secs(4));
    // SAFETY: as above.
    unsafe { libc::kill(cat.pid(), libc::SIGCONT) };
    let status = run.wait_within(limit.saturating_sub(start.elapsed()));
    let cat_status = cat.wait_within(secs(30));
    let arrived = check.join().unwrap();
    let err = String::from_utf8_lossy(&err.join().unwrap()).into_owned();
    eprintln!(
        "{} bytes in {:.1} s",
        arrived.bytes,
        start.elapsed().as_secs_f64()
    );
    let status = status.unwrap_or_else(|e| panic!("{e}; {arrived:?}; stderr: {err:?}"));
    assert!(cat_status.is_ok_and(|s| s.success()), "cat failed");
    assert!(
        arrived.bytes == arrived.expected && arrived.first_difference.is_none(),
        "output lost or changed behind a stopped reader: {arrived:?}, status {status:?}, \
         stderr: {err:?}"
    );
    assert_eq!(status.code(), Some(0), "stderr: {err:?}");
}

#[test]
fn item2_a_stopped_reader_loses_no_output_on_qemu() {
    // 105 888 897 bytes, the reader stopped after 1 MiB.
    assert_a_stopped_reader_loses_nothing(run_qemu(150), 13_000_000, 1 << 20, secs(170));
}

/// Not ignored: the issue found the ember backend sound under a stopped
/// reader (this passes on 4e6807d); it guards the fix's flow control.
#[test]
fn item2_a_stopped_reader_loses_no_output_on_ember() {
    let Some(pvm) = Pvm::find("item2_a_stopped_reader_loses_no_output_on_ember") else {
        return;
    };
    let cache = pvm.shared_warm_cache();
    // The 100 MB would take most of an hour: the guest kernel's
    // copies are slow under this host's software KVM (the ember backend's
    // vsock channel moves a few hundred KB/s). 1.3 MB still fills the
    // vsock credit and the sockets between the guest and the stopped
    // reader many times over.
    assert_a_stopped_reader_loses_nothing(pvm.run(&cache, 150), 200_000, 256 << 10, secs(170));
}

// ---------------------------------------------------------------- item 4

/// Entries of `dir` (a run's TMPDIR), with their modes.
fn entries(dir: &Path) -> Vec<(String, u32, bool)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                m.permissions().mode() & 0o7777,
                m.is_file(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Live processes whose parent is `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                // After the command's name in parentheses: state, then ppid.
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        // A zombie is dead but for its parent's wait.
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            != Some("Z")
    })
}

/// One run per signal, each with its own TMPDIR: the command (carrying a
/// 0600 `--file`, which makes the run's own appliance or image) says
/// `ready`; the run's regular files in TMPDIR must then be 0600; after the
/// signal the run's VMM must be gone and TMPDIR empty — after SIGKILL, once
/// a later run (which may sweep what a dead run left) has ended.
fn assert_signals_leave_nothing(scratch: &Scratch, mut ember_run: impl FnMut() -> Command) {
    let secret = scratch.path("secret");
    std::fs::write(&secret, "not for other users\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let file = format!("{}:/secret", secret.display());
    let mut problems = Vec::new();
    for (name, sig) in [
        ("SIGINT", libc::SIGINT),
        ("SIGTERM", libc::SIGTERM),
        ("SIGHUP", libc::SIGHUP),
        ("SIGKILL", libc::SIGKILL),
    ] {
        let tmp = scratch.path(&format!("tmp-{name}"));
        std::fs::create_dir(&tmp).unwrap();
        let mut run = Proc::spawn(
            ember_run()
                .env("TMPDIR", &tmp)
                .args([
                    "--file",
                    &file,
                    "--",
                    "sh",
                    "-c",
                    "echo ready; exec sleep 100",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        );
        let err = slurp(run.child.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let mut out = run.child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut b = [0u8; 64];
            let mut got = Vec::new();
            while let Ok(n) = out.read(&mut b) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&b[..n]);
                if got.ends_with(b"ready\n") {
                    let _ = tx.send(());
                }
            }
        });
        if rx.recv_timeout(secs(120)).is_err() {
            run.kill_group();
            panic!(
                "{name}: the command never said ready; stderr: {}",
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        let vmms = children_of(run.pid());
        for (f, mode, regular) in entries(&tmp) {
            if regular && mode != 0o600 {
                problems.push(format!("{name}: {f} is {mode:o} while the run lives"));
            }
        }
        // SAFETY: a signal to our own (unreaped) child.
        unsafe { libc::kill(run.pid(), sig) };
        let status = run
            .wait_within(secs(20))
            .unwrap_or_else(|e| panic!("{name} did not end the run: {e}"));
        drop(err);
        let until = Instant::now() + secs(5);
        while vmms.iter().any(|&p| alive(p)) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        let left: Vec<_> = vmms.iter().filter(|&&p| alive(p)).collect();
        if !left.is_empty() {
            problems.push(format!("{name}: the VMM {left:?} outlived ember"));
            for &p in left {
                // SAFETY: killing the VMM our run left behind.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        if sig == libc::SIGKILL {
            let later = finish(
                ember_run()
                    .env("TMPDIR", &tmp)
                    .args(["--", "true"])
                    .stdout(Stdio::null()),
                secs(120),
            );
            assert!(later.status.success(), "a later run: {}", later.err());
        }
        let left = entries(&tmp);
        if !left.is_empty() {
            problems.push(format!(
                "{name} (run ended {status:?}) left in its TMPDIR: {:?}",
                left.iter()
                    .map(|(f, m, _)| format!("{f} ({m:o})"))
                    .collect::<Vec<_>>()
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn item4_signals_leave_no_temp_file_or_qemu_behind() {
    let scratch = Scratch::new("rel-signals-qemu");
    assert_signals_leave_nothing(&scratch, || run_qemu(120));
}

#[test]
fn item4_signals_leave_no_per_run_image_behind_on_ember() {
    let Some(pvm) = Pvm::find("item4_signals_leave_no_per_run_image_behind_on_ember") else {
        return;
    };
    let scratch = Scratch::new("rel-signals-ember");
    let cache = pvm.shared_warm_cache();
    assert_signals_leave_nothing(&scratch, || pvm.run(&cache, 120));
}

// ---------------------------------------------------------------- item 5

/// An empty private cache holding only (a link to) the kernel `ember setup`
/// fetched, so every appliance is built by the test's runs.
fn private_cache(scratch: &Scratch) -> PathBuf {
    let real = ember::appliance::kernel::cache_dir().expect("a cache directory");
    let kernel = real.join("kernel");
    assert!(
        kernel.join("current").is_file(),
        "this test needs Debian's cloud kernel: run `ember setup` first"
    );
    let cache = scratch.path("cache");
    std::fs::create_dir(&cache).unwrap();
    std::os::unix::fs::symlink(&kernel, cache.join("kernel")).unwrap();
    cache
}

#[test]
fn item5_a_one_byte_cache_evicts_no_appliance_a_run_boots() {
    let scratch = Scratch::new("rel-cache-max");
    let cache = private_cache(&scratch);
    let commands: [&[&str]; 6] = [
        &["true"],
        &["echo", "two"],
        &["uname", "-s"],
        &["seq", "4"],
        &["printf", "five"],
        &["basename", "/a/six"],
    ];
    let runs: Vec<_> = commands
        .iter()
        .map(|argv| {
            let mut c = run_qemu(150);
            c.env("EMBER_CACHE", &cache)
                .env("EMBER_CACHE_MAX", "1")
                .arg("--")
                .args(*argv)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut p = Proc::spawn(&mut c);
            let out = slurp(p.child.stdout.take().unwrap());
            let err = slurp(p.child.stderr.take().unwrap());
            (argv, p, out, err)
        })
        .collect();
    let start = Instant::now();
    let mut failed = Vec::new();
    for (argv, mut p, out, err) in runs {
        let status = p.wait_within(secs(180).saturating_sub(start.elapsed()));
        let (out, err) = (out.join().unwrap(), err.join().unwrap());
        match status {
            Ok(s) if s.success() => {}
            s => failed.push(format!(
                "{argv:?}: {s:?}, stdout {:?}, stderr {:?}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err).trim()
            )),
        }
    }
    eprintln!("six runs in {:.1} s", start.elapsed().as_secs_f64());
    assert!(
        failed.is_empty(),
        "{} of 6 runs failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

// ---------------------------------------------------------------- item 6

#[test]
fn item6_a_truncated_snapshot_is_rebuilt() {
    let Some(pvm) = Pvm::find("item6_a_truncated_snapshot_is_rebuilt") else {
        return;
    };
    let scratch = Scratch::new("rel-truncated");
    let cache = scratch.path("cache");
    pvm.warm_up(&cache);
    let snaps = common::appliance_snapshots(&cache);
    assert_eq!(snaps.len(), 1, "one snapshot made: {snaps:?}");
    let mut problems = Vec::new();
    // The good snapshot, put back after a case the run did not repair, so
    // each case damages one file of a good snapshot.
    let pristine = scratch.path("pristine");
    std::fs::create_dir(&pristine).unwrap();
    for file in ["state", "memory"] {
        std::fs::copy(snaps[0].join(file), pristine.join(file)).unwrap();
    }
    for file in ["state", "memory"] {
        let snap = &common::appliance_snapshots(&cache)[0];
        let path = snap.join(file);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let done = finish(
            pvm.run(&cache, 600)
                .args(["--", "echo", "after-truncation"])
                .stdout(Stdio::piped()),
            secs(660),
        );
        eprintln!(
            "run after truncating {file}: {:.1} s",
            done.elapsed.as_secs_f64()
        );
        if done.status.code() != Some(0) || done.out() != "after-truncation\n" {
            problems.push(format!(
                "after truncating the snapshot's {file} to {} of {len} bytes: {:?}, \
                 stdout {:?}, stderr {:?}",
                len / 2,
                done.status,
                done.out(),
                done.err().trim()
            ));
            std::fs::copy(pristine.join(file), &path).unwrap();
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------- item 12

/// `ember LAB --backend qemu -n 2` as a newcomer types it: no `--initrd`.
fn lab_out_of_the_box(lab: &str) -> Done {
    let done = finish(
        ember()
            .args([lab, "--backend", "qemu", "-n", "2"])
            .stdout(Stdio::piped()),
        secs(240),
    );
    eprintln!("ember {lab}: {:.1} s", done.elapsed.as_secs_f64());
    done
}

#[test]
fn item12_bench_and_analyze_reach_userspace_without_an_initrd() {
    let mut problems = Vec::new();
    for lab in ["analyze", "bench"] {
        let done = lab_out_of_the_box(lab);
        let all = format!("{}{}", done.out(), done.err());
        let lower = all.to_lowercase();
        if !done.status.success()
            || lower.contains("no boot reached userspace")
            || lower.contains("not averaged in")
        {
            let last = all
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            problems.push(format!(
                "ember {lab} --backend qemu -n 2: {:?}; {last:?}\n{all}",
                done.status
            ));
        }
        if lab == "bench" {
            // The report's userspace row counts both boots.
            let row = all
                .lines()
                .find(|l| l.trim_start().starts_with("userspace "));
            if !row.is_some_and(|r| r.trim_end().ends_with(" 2")) {
                problems.push(format!("bench: no userspace row for 2 boots: {row:?}"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn item12_a_panicking_guest_ends_its_boot_at_once() {
    let scratch = Scratch::new("rel-panic");
    // An initramfs with no /init: with no root= either, the kernel panics
    // ("VFS: Unable to mount root fs"), whatever the lab's default initrd.
    let initrd = scratch.path("no-init.cpio");
    let mut w = ember::initramfs::NewcWriter::new(Vec::new());
    w.dir("/etc", 0o755).unwrap();
    std::fs::write(&initrd, w.finish().unwrap().0).unwrap();
    let start = Instant::now();
    // Without panic=-1 the kernel waits forever after its panic; the boot's
    // own timeout (60 s by default) is the lab's last resort, not its way.
    let done = try_finish(
        ember()
            .args(["bench", "--backend", "qemu", "-n", "1", "--warmup", "0"])
            .arg("--initrd")
            .arg(&initrd)
            .args(["--cmdline", "console=ttyS0"])
            .stdout(Stdio::piped()),
        secs(30),
    );
    let took = start.elapsed();
    eprintln!("the panicking boot took {:.1} s", took.as_secs_f64());
    let done = done.unwrap_or_else(|e| panic!("the panicked boot did not end: {e}"));
    let all = format!("{}{}", done.out(), done.err());
    let summary = all
        .lines()
        .find(|l| l.contains("not averaged in"))
        .unwrap_or("");
    assert!(
        took < secs(20),
        "the panicked boot took {:.1} s to end: {summary:?}",
        took.as_secs_f64()
    );
    let lower = all.to_lowercase();
    assert!(
        lower.contains("panic")
            && all.contains("Unable to mount root fs")
            && !lower.contains("timed out"),
        "want the boot reported as a panic with its cause, not a timeout:\n{all}"
    );
}

// ---------------------------------------------------------------- item 11

/// A VMM that fails to start is reported as such, with its status — not as
/// a guest that "stopped without reporting the command's status".
#[test]
fn item11_a_vmm_that_cannot_start_is_not_a_guest_that_stopped() {
    // QEMU refuses the machine type before any guest code runs.
    let done = finish(
        run_qemu(60).args(["--machine", "no-such-machine", "--", "true"]),
        secs(60),
    );
    let err = done.err();
    assert_eq!(done.status.code(), Some(125), "stderr: {err:?}");
    assert!(
        err.contains("qemu could not start the VM") && err.contains("exit status: 1"),
        "want the start failure named, with its status: {err:?}"
    );
    assert!(
        !err.contains("stopped without reporting"),
        "a start failure reported as a guest that stopped: {err:?}"
    );
}
