//! One boot, recorded: the VMM is spawned, every console line is stamped the
//! moment its newline reaches us, the VMM's own event file is read back, and
//! the child is reaped with `wait4` so its peak RSS comes for free.
//!
//! All host times in a [`BootRecord`] are microseconds since the spawn.

use crate::backend::{Backend, GuestSpec};
use ember_vmm::events::{Event, EventFile, LineStamper};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// How often the waiting loop looks at the timeout and the Ctrl-C flag.
const POLL: Duration = Duration::from_millis(20);
/// Most stderr we keep from a VMM (enough for an error message).
const MAX_STDERR: usize = 16 * 1024;
/// Size of one read from the console pipe.
const READ_CHUNK: usize = 8192;
/// What every Linux panic prints first, its cause after the colon.
const PANIC_LINE: &str = "Kernel panic - not syncing";

/// Whether console line `text` is a kernel's panic line.
pub fn is_panic_line(text: &str) -> bool {
    text.contains(PANIC_LINE)
}

/// Errors starting a boot.
#[derive(Debug, Error)]
pub enum BootError {
    /// The backend could not build a command line.
    #[error("cannot build the VMM command line")]
    Backend(#[source] crate::backend::BackendError),
    /// The VMM binary could not be started.
    #[error("cannot start `{binary}`")]
    Spawn {
        /// The binary.
        binary: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The event file the VMM wrote is not valid.
    #[error("cannot read the VMM event file {path}")]
    Events {
        /// Its path.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

/// What to boot, and with what.
#[derive(Clone)]
pub struct BootConfig {
    /// A short label (`A`, `B`, a commit hash).
    pub label: String,
    /// The VMM.
    pub backend: Arc<dyn Backend>,
    /// The guest.
    pub spec: GuestSpec,
    /// Kill a boot that has not ended after this long.
    pub timeout: Duration,
    /// The cached initramfs (the appliance's), held open and share-locked
    /// while the lab boots it, so no run's cache eviction removes it.
    pub held: Option<Arc<std::fs::File>>,
}

impl std::fmt::Debug for BootConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootConfig")
            .field("label", &self.label)
            .field("backend", &self.backend.describe())
            .field("spec", &self.spec)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A console line and when it arrived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsoleLine {
    /// Host arrival time, µs since spawn.
    pub t_us: f64,
    /// The line (without its newline).
    pub text: String,
}

/// How a boot ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The VMM exited by itself with this status.
    Exited(i32),
    /// The VMM died of this signal.
    Signaled(i32),
    /// We killed it at the timeout.
    TimedOut,
    /// We killed it because of Ctrl-C.
    Cancelled,
    /// We killed it when its kernel printed its panic line: what it does
    /// next (wait forever with `panic=0`, reboot after N seconds) only
    /// delays the report of a boot that cannot count.
    Panicked,
}

/// Everything measured in one boot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BootRecord {
    /// Console lines in arrival order.
    pub lines: Vec<ConsoleLine>,
    /// Events the VMM reported itself, moved onto our clock (µs since spawn).
    #[serde(default)]
    pub events: Vec<Event>,
    /// First console byte, µs since spawn.
    pub first_output_us: Option<f64>,
    /// Process exit (reaped), µs since spawn.
    pub exit_us: f64,
    /// Console bytes received.
    pub console_bytes: u64,
    /// Peak RSS of the VMM process, KiB: wait4's `ru_maxrss`, or for ember the
    /// VMM's own figure from its timeline, whichever is larger.
    pub max_rss_kib: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The tail of the VMM's stderr.
    #[serde(default)]
    pub stderr: String,
}

impl BootRecord {
    /// Whether the boot ended by itself (successfully or not).
    pub fn completed(&self) -> bool {
        matches!(self.outcome, Outcome::Exited(_) | Outcome::Signaled(_))
    }

    /// A clean boot (exit status 0, 2 MiB peak) with these console lines
    /// (µs, text) that ended at `exit_us`: the analyses' unit tests build
    /// their boots from it.
    #[cfg(test)]
    pub(crate) fn from_lines(lines: &[(f64, &str)], exit_us: f64) -> BootRecord {
        BootRecord {
            lines: lines
                .iter()
                .map(|(t, s)| ConsoleLine {
                    t_us: *t,
                    text: (*s).to_owned(),
                })
                .collect(),
            events: vec![],
            first_output_us: lines.first().map(|l| l.0),
            exit_us,
            console_bytes: lines.iter().map(|l| l.1.len() as u64 + 2).sum(),
            max_rss_kib: 2048,
            outcome: Outcome::Exited(0),
            stderr: String::new(),
        }
    }
}

/// What the wait thread reports.
struct Reaped {
    at: Instant,
    status: libc::c_int,
    max_rss_kib: u64,
}

/// Boots `cfg` once. `cancel` is polled while the guest runs; when it is set
/// the VMM is killed and the record says [`Outcome::Cancelled`]. A kernel
/// panic on the console ends the boot at once, as [`Outcome::Panicked`].
pub fn run_boot(cfg: &BootConfig, cancel: &AtomicBool) -> Result<BootRecord, BootError> {
    let mut spec = cfg.spec.clone();
    let events_path = (cfg.backend.name() == "ember").then(scratch_events_path);
    spec.events = events_path.clone();
    let mut cmd = cfg.backend.command(&spec).map_err(BootError::Backend)?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: Ctrl-C reaches only us, and we decide when
        // the VMM dies (after recording what it printed).
        .process_group(0);
    let binary = cmd.get_program().to_string_lossy().into_owned();
    let t0 = Instant::now();
    let t0_ns = ember_vmm::events::monotonic_ns();
    let mut child = cmd
        .spawn()
        .map_err(|source| BootError::Spawn { binary, source })?;
    let pid = child.id() as libc::pid_t;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");

    let panicked = Arc::new(AtomicBool::new(false));
    let console = {
        let panicked = panicked.clone();
        std::thread::spawn(move || read_console(stdout, t0, &panicked))
    };
    let errors = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = (&mut stderr).take(MAX_STDERR as u64).read_to_end(&mut buf);
        // Keep draining so a chatty VMM never blocks on a full pipe.
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
        String::from_utf8_lossy(&buf).into_owned()
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(reap(pid));
    });

    let (reaped, outcome) = wait(&rx, pid, t0, cfg.timeout, [cancel, &panicked]);
    // Reaped by wait4 above; dropping a Child neither waits nor kills.
    drop(child);
    // Anything the VMM left behind in its group (a helper still holding the
    // console pipe) would keep the reader below waiting: end it too.
    kill_group(pid);
    let outcome = outcome.unwrap_or_else(|| decode_status(reaped.status));
    let (lines, console_bytes, first_output) = console.join().unwrap_or_default();
    let stderr = errors.join().unwrap_or_default();
    let exit_us = reaped.at.duration_since(t0).as_secs_f64() * 1e6;

    let mut events = Vec::new();
    let mut max_rss_kib = reaped.max_rss_kib;
    if let Some(path) = &events_path {
        if let Ok(text) = std::fs::read_to_string(path) {
            let _ = std::fs::remove_file(path);
            match serde_json::from_str::<EventFile>(&text) {
                Ok(file) => {
                    // ember measures its own peak at the end of its
                    // timeline too; the larger of the two stands.
                    max_rss_kib = max_rss_kib.max(file.memory_kib("vm_hwm_kib").unwrap_or(0));
                    events = align_events(&file, t0_ns, &lines);
                }
                // A VMM we killed may have left half a file: its events are lost.
                Err(_) if !matches!(outcome, Outcome::Exited(_) | Outcome::Signaled(_)) => {}
                Err(source) => {
                    return Err(BootError::Events {
                        path: path.clone(),
                        source,
                    });
                }
            }
        }
    }
    Ok(BootRecord {
        lines,
        events,
        first_output_us: first_output,
        exit_us,
        console_bytes,
        max_rss_kib,
        outcome,
        stderr,
    })
}

/// Waits for the reaper's report on `rx`, killing the VMM's group once
/// `cancel` or `panicked` is set or `timeout` has passed since `t0`; the
/// outcome when it was killed.
fn wait(
    rx: &mpsc::Receiver<Reaped>,
    pid: libc::pid_t,
    t0: Instant,
    timeout: Duration,
    [cancel, panicked]: [&AtomicBool; 2],
) -> (Reaped, Option<Outcome>) {
    let mut outcome = None;
    let reaped = loop {
        match rx.recv_timeout(POLL) {
            Ok(r) => break r,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break Reaped {
                    at: Instant::now(),
                    status: 0,
                    max_rss_kib: 0,
                };
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if outcome.is_none() {
            if cancel.load(Ordering::SeqCst) {
                outcome = Some(Outcome::Cancelled);
            } else if panicked.load(Ordering::SeqCst) {
                outcome = Some(Outcome::Panicked);
            } else if t0.elapsed() > timeout {
                outcome = Some(Outcome::TimedOut);
            }
            if outcome.is_some() {
                kill_group(pid);
            }
        }
    };
    (reaped, outcome)
}

/// Reads the console until EOF, stamping each line as its newline arrives;
/// sets `panicked` at a kernel's panic line.
fn read_console(
    mut out: impl Read,
    t0: Instant,
    panicked: &AtomicBool,
) -> (Vec<ConsoleLine>, u64, Option<f64>) {
    let mut stamper = LineStamper::default();
    let mut lines = Vec::new();
    let mut bytes = 0u64;
    let mut first = None;
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let n = match out.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let t_us = t0.elapsed().as_secs_f64() * 1e6;
        first.get_or_insert(t_us);
        bytes += n as u64;
        stamper.feed(&buf[..n], |text| {
            if is_panic_line(text) {
                panicked.store(true, Ordering::SeqCst);
            }
            lines.push(ConsoleLine {
                t_us,
                text: text.to_owned(),
            })
        });
    }
    let t_us = t0.elapsed().as_secs_f64() * 1e6;
    stamper.flush(|text| {
        lines.push(ConsoleLine {
            t_us,
            text: text.to_owned(),
        })
    });
    (lines, bytes, first)
}

/// Blocks in wait4 for `pid`, recording the moment it returns.
fn reap(pid: libc::pid_t) -> Reaped {
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain old data; zeroed is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: status and usage are valid, writable locals; pid is our child.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r == pid || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    Reaped {
        at: Instant::now(),
        status,
        // Linux reports ru_maxrss in KiB.
        max_rss_kib: usage.ru_maxrss.max(0) as u64,
    }
}

fn kill_group(pid: libc::pid_t) {
    // SAFETY: kill() has no memory effects; the child leads its own group, so
    // -pid reaches it and anything it started.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
    }
}

fn decode_status(status: libc::c_int) -> Outcome {
    if libc::WIFSIGNALED(status) {
        Outcome::Signaled(libc::WTERMSIG(status))
    } else {
        Outcome::Exited(libc::WEXITSTATUS(status))
    }
}

fn scratch_events_path() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("ember-lab-{}-{n}.events.json", std::process::id()))
}

/// Moves VMM events (µs since the VMM process started) onto our clock (µs
/// since spawn, `spawn_ns` on CLOCK_MONOTONIC). A VMM that wrote its start on
/// CLOCK_MONOTONIC gives the offset exactly. Otherwise its console-line
/// events help: it stamps each line just before writing it, so the smallest
/// gap between our arrival stamp and its stamp of the same line is the
/// offset plus one pipe hop. Failing both, offset 0 (the VMM starts within an
/// exec of our spawn).
pub fn align_events(file: &EventFile, spawn_ns: u64, lines: &[ConsoleLine]) -> Vec<Event> {
    let offset = if file.t0_monotonic_ns != 0 && spawn_ns != 0 {
        (file.t0_monotonic_ns as f64 - spawn_ns as f64) / 1e3
    } else {
        let by_lines = file
            .events
            .iter()
            .filter(|e| e.kind == ember_vmm::events::kind::CONSOLE_LINE)
            .zip(lines)
            .map(|(e, l)| l.t_us - e.t_us)
            .fold(f64::INFINITY, f64::min);
        if by_lines.is_finite() { by_lines } else { 0.0 }
    };
    let mut events = file.events.clone();
    for e in &mut events {
        e.t_us += offset;
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendError, ChannelKind};
    use std::process::Command;

    /// A "VMM" that is a shell script: enough to test the plumbing.
    struct Script(&'static str);

    impl Backend for Script {
        fn name(&self) -> &str {
            "script"
        }
        fn version(&self) -> Result<String, BackendError> {
            Ok("sh".into())
        }
        fn describe(&self) -> String {
            "sh -c".into()
        }
        fn channel_kind(&self) -> ChannelKind {
            ChannelKind::Serial
        }
        fn command(&self, _spec: &GuestSpec) -> Result<Command, BackendError> {
            let mut c = Command::new("/bin/sh");
            c.args(["-c", self.0]);
            Ok(c)
        }
    }

    fn cfg(script: &'static str, timeout_ms: u64) -> BootConfig {
        BootConfig {
            label: "t".into(),
            backend: Arc::new(Script(script)),
            spec: GuestSpec::new("/k"),
            timeout: Duration::from_millis(timeout_ms),
            held: None,
        }
    }

    #[test]
    fn lines_are_stamped_in_order_and_exit_is_reaped() {
        let never = AtomicBool::new(false);
        let r = run_boot(
            &cfg("echo one; sleep 0.1; printf 'two\\r\\nthree'; exit 3", 5000),
            &never,
        )
        .unwrap();
        let texts: Vec<_> = r.lines.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts, ["one", "two", "three"]);
        assert!(
            r.lines[1].t_us - r.lines[0].t_us > 50_000.0,
            "{:?}",
            r.lines
        );
        assert_eq!(r.outcome, Outcome::Exited(3));
        assert_eq!(r.console_bytes, 4 + 5 + 5);
        assert!(r.exit_us >= r.lines[2].t_us - 1000.0);
        assert!(r.max_rss_kib > 0);
        assert!(r.first_output_us.unwrap() <= r.lines[0].t_us);
    }

    #[test]
    fn a_hung_guest_is_killed_at_the_timeout() {
        let never = AtomicBool::new(false);
        let start = Instant::now();
        let r = run_boot(&cfg("echo booting; exec sleep 30", 300), &never).unwrap();
        assert_eq!(r.outcome, Outcome::TimedOut);
        assert!(!r.completed());
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(r.lines[0].text, "booting");
    }

    #[test]
    fn a_helper_left_holding_the_console_is_ended() {
        let never = AtomicBool::new(false);
        let start = Instant::now();
        let r = run_boot(&cfg("sleep 30 & echo done; exit 0", 60_000), &never).unwrap();
        assert_eq!(r.outcome, Outcome::Exited(0));
        assert_eq!(r.lines.len(), 1);
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_panicked_kernel_ends_its_boot_at_once() {
        let never = AtomicBool::new(false);
        let start = Instant::now();
        // panic=0: the kernel waits forever after its panic line.
        let r = run_boot(
            &cfg(
                "echo '[    0.500000] Kernel panic - not syncing: No working init found.'; \
                 exec sleep 30",
                60_000,
            ),
            &never,
        )
        .unwrap();
        assert_eq!(r.outcome, Outcome::Panicked);
        assert!(!r.completed());
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(is_panic_line(&r.lines[0].text));
        assert!(!is_panic_line("[    0.1] Run /init as init process"));
    }

    #[test]
    fn cancel_kills_the_boot() {
        let cancel = AtomicBool::new(true);
        let r = run_boot(&cfg("exec sleep 30", 60_000), &cancel).unwrap();
        assert_eq!(r.outcome, Outcome::Cancelled);
    }

    #[test]
    fn a_missing_binary_is_a_clear_error() {
        struct Missing;
        impl Backend for Missing {
            fn name(&self) -> &str {
                "missing"
            }
            fn version(&self) -> Result<String, BackendError> {
                Ok(String::new())
            }
            fn describe(&self) -> String {
                String::new()
            }
            fn channel_kind(&self) -> ChannelKind {
                ChannelKind::Serial
            }
            fn command(&self, _: &GuestSpec) -> Result<Command, BackendError> {
                Ok(Command::new("/nonexistent/vmm"))
            }
        }
        let c = BootConfig {
            backend: Arc::new(Missing),
            ..cfg("", 100)
        };
        let e = run_boot(&c, &AtomicBool::new(false)).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/vmm"), "{e}");
    }

    #[test]
    fn events_are_aligned_by_console_lines() {
        let ev = |t: f64, kind: &str| Event {
            t_us: t,
            kind: kind.into(),
            text: None,
            code: None,
        };
        let events = vec![
            ev(100.0, "kvm_open"),
            ev(500.0, "console_line"),
            ev(900.0, "console_line"),
        ];
        let lines = [
            ConsoleLine {
                t_us: 1600.0,
                text: "a".into(),
            },
            ConsoleLine {
                t_us: 1950.0,
                text: "b".into(),
            },
        ];
        let file = |events: Vec<Event>, t0: u64| EventFile {
            version: 1,
            producer: "test".into(),
            t0_monotonic_ns: t0,
            events,
        };
        let out = align_events(&file(events.clone(), 0), 5_000_000, &lines);
        // Smallest gap: 1950 - 900 = 1050.
        assert_eq!(out[0].t_us, 1150.0);
        // The VMM started 2 ms after our spawn: exact.
        let out = align_events(&file(events, 7_000_000), 5_000_000, &lines);
        assert_eq!(out[0].t_us, 2100.0);
        assert_eq!(
            align_events(&file(vec![ev(5.0, "x")], 0), 0, &[])[0].t_us,
            5.0
        );
    }
}
