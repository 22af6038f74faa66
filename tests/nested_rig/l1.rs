//! One L1: `ember run --backend qemu --nested-kvm` running the suite, its
//! output read case by case as it comes, and a watchdog that ends it when a
//! case overruns its limit (the L1 itself stopped answering).

use crate::case::{Progress, SuiteLog};
use crate::common;
use crate::stage::Staged;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The L1's time limit. The whole suite took 655 s on a loaded machine
/// (load ~20) before the boot doctor's cases (~2-5 min more); each case has
/// its own limit inside (30-360 s, tests/rig/suite.sh), so a hung case is
/// killed there, named, and the rest still fit. (`EMBER_RIG_LIMIT_SCALE`
/// multiplies both, for a slower machine.)
pub const L1_TIMEOUT_S: u32 = 1500;
/// L1 memory: the staged files live in its RAM, and each L2 gets 256 MiB.
const L1_MEM: &str = "2G";

/// The running case and when it must have ended by, for the watchdog.
type Deadline = Arc<Mutex<Option<(String, Instant)>>>;

/// `EMBER_RIG_LIMIT_SCALE`: what the L1's and every case's limit is
/// multiplied by (1 when unset).
pub fn limit_scale() -> Result<u32, String> {
    match std::env::var("EMBER_RIG_LIMIT_SCALE") {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("EMBER_RIG_LIMIT_SCALE={v}: not a whole number >= 1")),
        Err(_) => Ok(1),
    }
}

/// How one L1 ended.
pub struct L1Run {
    pub log: SuiteLog,
    pub status: ExitStatus,
    pub stderr: String,
    /// Seconds from starting ember to the suite's first line.
    pub first_line_s: Option<f64>,
    /// Seconds from starting ember to its exit.
    pub total_s: f64,
    /// The case the L1 stopped answering in (the watchdog ended it).
    pub hung_case: Option<String>,
}

/// The L1's command: the suite in ember's appliance under QEMU with nested
/// KVM, the staged files given to it, its limit `timeout_s`.
pub fn command(
    staged: &Staged,
    token: &str,
    attempt: u32,
    scale: u32,
    timeout_s: u32,
) -> Result<Command, String> {
    let mut c = common::ember();
    c.env("EMBER_INIT", common::init_binary()?);
    c.args([
        "run",
        "--backend",
        "qemu",
        "--nested-kvm",
        "--mem",
        L1_MEM,
        "--cpus",
        "2",
    ]);
    c.args(["--timeout", &timeout_s.to_string()]);
    // The vsock and net cases' host side (socat), and the net case's taps
    // (iproute2's ip: busybox's makes none).
    c.args(["--with", "socat", "--with", "ip"]);
    // The containers case's containerd and ctr, when it could be staged
    // (a machine without them fails that case alone, saying why).
    if staged.containers.is_ok() {
        for tool in crate::stage::CONTAINER_TOOLS {
            c.args(["--with", tool]);
        }
    }
    for (k, v) in [
        ("EMBER_INIT", "/rig/ember-init".to_owned()),
        ("RIG_VERSION", staged.version.clone()),
        ("RIG_NOTE_OFF", staged.note_off.to_string()),
        ("RIG_TOKEN", token.to_owned()),
        (
            "RIG_L2_ARGS",
            std::env::var("EMBER_RIG_L2_ARGS").unwrap_or_default(),
        ),
        (
            "RIG_CASES",
            std::env::var("EMBER_RIG_CASES").unwrap_or("all".into()),
        ),
        ("RIG_LIMIT_SCALE", scale.to_string()),
        ("RIG_ATTEMPT", attempt.to_string()),
    ] {
        c.arg("--env").arg(format!("{k}={v}"));
    }
    c.arg("--file")
        .arg(format!("{}:/rig", staged.rigdir.display()));
    c.arg("--file")
        .arg(format!("{}:/root/.cache/ember", staged.cache.display()));
    c.arg("--file")
        .arg(format!("{}:/usr/local/bin/ember", staged.ember.display()));
    c.args(["--", "/bin/busybox", "sh", "/rig/suite.sh"]);
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Ok(c)
}

/// Runs one L1 to its end (or until the watchdog ends it), echoing its
/// output to stderr as it comes.
pub fn run(mut c: Command) -> Result<L1Run, String> {
    let _turn = crate::one_l1();
    let deadline = Deadline::default();
    // Its own process group: the hang watchdog ends ember and its QEMU together.
    c.process_group(0);
    let spawned = Instant::now();
    let mut child = c.spawn().map_err(|e| format!("cannot start ember: {e}"))?;
    let l1_hung = hang_watchdog(child.id(), &deadline);
    let stderr = child.stderr.take().unwrap();
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("rig(stderr)| {l}");
            s.push_str(&l);
            s.push('\n');
        }
        s
    });
    let mut log = SuiteLog::default();
    let mut first_line_s = None;
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        first_line_s.get_or_insert_with(|| spawned.elapsed().as_secs_f64());
        // Streamed, so a CI log shows progress (cargo test shows it on failure
        // or with --nocapture).
        // (Long lines — the analyze recording — are cut in the echo only.)
        match line.char_indices().nth(300) {
            Some((cut, _)) => eprintln!("rig| {}…", &line[..cut]),
            None => eprintln!("rig| {line}"),
        }
        match log.take(line.trim_end_matches('\r')) {
            Some(Progress::Started { case, limit_s }) => {
                // The suite kills a case at its limit, 5 s later for good,
                // and reports it: past that (and a minute's slack), the L1
                // itself has stopped.
                let limit = limit_s.unwrap_or(u64::from(L1_TIMEOUT_S));
                *deadline.lock().unwrap() =
                    Some((case, Instant::now() + Duration::from_secs(limit + 65)));
            }
            Some(Progress::Ended) => *deadline.lock().unwrap() = None,
            None => {}
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let stderr = err_thread.join().unwrap_or_default();
    // The watchdog returns once it holds the only handle.
    drop(deadline);
    let hung_case = l1_hung.join().unwrap_or_default();
    Ok(L1Run {
        log,
        status,
        stderr,
        first_line_s,
        total_s: spawned.elapsed().as_secs_f64(),
        hung_case,
    })
}

/// Watches the L1 (ember, process group `pid`) while `deadline` names a
/// running case and when it must have ended by; past it, ends the whole group
/// (TERM, then KILL 10 s later) and returns that case's name. Returns `None`
/// once the caller has dropped its `deadline` (after ember exited).
fn hang_watchdog(pid: u32, deadline: &Deadline) -> std::thread::JoinHandle<Option<String>> {
    let deadline = deadline.clone();
    let pgid = -(pid as libc::pid_t);
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
            // The reader drops its handle once ember has exited.
            if Arc::strong_count(&deadline) == 1 {
                return None;
            }
            let late = match &*deadline.lock().unwrap() {
                Some((case, by)) if Instant::now() > *by => case.clone(),
                _ => continue,
            };
            eprintln!(
                "nested rig: case `{late}` overran its limit by a minute: the L1 is not answering; killing it"
            );
            // SAFETY: kill(2) on a process group this test created; no memory involved.
            unsafe { libc::kill(pgid, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(10));
            // SAFETY: as above.
            unsafe { libc::kill(pgid, libc::SIGKILL) };
            return Some(late);
        }
    })
}
