//! The VMM-side boot timeline: what happened, and when, in microseconds since
//! the process started.
//!
//! Timestamps are taken on arrival (a console line is stamped when its newline
//! reaches the VMM, not when it is written out), so the file is the raw
//! material `ember analyze` works from. The format is shared with the boot
//! lab: see [`EventFile`].

use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use std::sync::OnceLock;
use std::time::Instant;

/// Version of the on-disk event format.
pub(crate) const EVENT_FORMAT_VERSION: u32 = 1;

/// One thing that happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Microseconds since process start (see [`process_start`]).
    pub t_us: f64,
    /// What happened: `kvm_open`, `memory_ready`, `kernel_loaded`, `initrd_loaded`,
    /// `vcpus_created`, `first_guest_entry`, `console_line`, `boot_mark`,
    /// `guest_shutdown`, `guest_reset`, `process_exit`, …
    pub kind: String,
    /// A console line's text, or a human note.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// A boot-timing code (port 0x80 value, or the boot-timer magic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u32>,
}

/// The whole file written by `ember run --events FILE.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventFile {
    /// `EVENT_FORMAT_VERSION`.
    pub version: u32,
    /// Who wrote it (`ember 0.1.0`).
    pub producer: String,
    /// CLOCK_MONOTONIC (ns) at process start, so a parent that noted the clock
    /// before exec can place these events on its own time axis.
    #[serde(default)]
    pub t0_monotonic_ns: u64,
    /// Events in time order.
    pub events: Vec<Event>,
}

impl EventFile {
    /// A figure of the `memory` event (`vm_hwm_kib=N guest_resident_kib=M`),
    /// by name (`"vm_hwm_kib"`), if the VMM recorded it.
    pub fn memory_kib(&self, name: &str) -> Option<u64> {
        self.events
            .iter()
            .filter(|e| e.kind == kind::MEMORY)
            .find_map(|e| {
                e.text.as_deref()?.split_whitespace().find_map(|f| {
                    let (k, v) = f.split_once('=')?;
                    (k == name).then(|| v.parse().ok())?
                })
            })
    }
}

/// Well-known event kinds, so writers and readers agree on spelling.
pub mod kind {
    /// /dev/kvm opened and the VM created.
    pub const KVM_OPEN: &str = "kvm_open";
    /// Guest memory mapped and registered.
    pub const MEMORY_READY: &str = "memory_ready";
    /// Kernel image loaded into guest memory.
    pub const KERNEL_LOADED: &str = "kernel_loaded";
    /// Initramfs loaded.
    pub const INITRD_LOADED: &str = "initrd_loaded";
    /// All vCPUs created and configured.
    pub const VCPUS_CREATED: &str = "vcpus_created";
    /// The boot vCPU entered KVM_RUN for the first time.
    pub const FIRST_GUEST_ENTRY: &str = "first_guest_entry";
    /// A complete console line (text without the newline).
    pub const CONSOLE_LINE: &str = "console_line";
    /// A boot-timing mark (port 0x80 code or the boot-timer magic).
    pub const BOOT_MARK: &str = "boot_mark";
    /// The guest powered off.
    pub const GUEST_SHUTDOWN: &str = "guest_shutdown";
    /// The guest reset (reboot request, triple fault).
    pub const GUEST_RESET: &str = "guest_reset";
    /// Memory use at exit: `vm_hwm_kib=N guest_resident_kib=M`.
    pub const MEMORY: &str = "memory";
    /// The VMM is about to exit.
    pub const PROCESS_EXIT: &str = "process_exit";
}

static START: OnceLock<(Instant, u64)> = OnceLock::new();

/// The instant the process started, as near as we can tell: the first call to
/// this function, which `main` makes first thing. It also opens the stages
/// file (see [`stage`]) while any system call is still allowed.
pub fn process_start() -> Instant {
    let t = START.get_or_init(|| (Instant::now(), monotonic_ns())).0;
    stages_file();
    t
}

/// The environment variable naming the stages file.
pub const STAGES_ENV: &str = "EMBER_STAGES";

/// The stages file and this process's id (getpid is not allowed everywhere).
static STAGES: OnceLock<Option<(std::fs::File, u32)>> = OnceLock::new();

fn stages_file() -> Option<&'static (std::fs::File, u32)> {
    STAGES
        .get_or_init(|| {
            let path = std::env::var_os(STAGES_ENV)?;
            let f = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .ok()?;
            Some((f, std::process::id()))
        })
        .as_ref()
}

/// Appends `MONOTONIC_NS PID NAME` to the file `EMBER_STAGES` names, if it
/// does: the processes of one start (a container's shim, `ember run`, the
/// VMM) each append their stages to one file, on one clock, so a benchmark
/// splits the start into its parts. One `write` of a short line to a file
/// opened for appending: lines of several processes do not interleave, and
/// a seccomp-confined thread may write (the file is opened by
/// [`process_start`], before any filter).
pub fn stage(name: &str) {
    if let Some((f, pid)) = stages_file() {
        use std::io::Write;
        let line = format!("{} {pid} {name}\n", monotonic_ns());
        let _ = (&*f).write_all(line.as_bytes());
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the clock `Instant` uses on Linux).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Microseconds since [`process_start`].
pub(crate) fn now_us() -> f64 {
    process_start().elapsed().as_secs_f64() * 1e6
}

/// A thread-safe event sink. Disabled recorders cost one branch per event.
#[derive(Debug, Default)]
pub struct Recorder {
    enabled: bool,
    events: Mutex<Vec<Event>>,
}

impl Recorder {
    /// A recorder that keeps events (`enabled`) or drops them.
    pub fn new(enabled: bool) -> Self {
        Recorder {
            enabled,
            events: Mutex::new(Vec::new()),
        }
    }

    /// Whether events are being kept.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records `kind` now.
    pub fn mark(&self, kind: &str) {
        self.push(kind, None, None);
    }

    /// Records `kind` now with a text.
    pub fn mark_text(&self, kind: &str, text: &str) {
        self.push(kind, Some(text.to_owned()), None);
    }

    /// Records `kind` now with a code.
    pub(crate) fn mark_code(&self, kind: &str, code: u32) {
        self.push(kind, None, Some(code));
    }

    fn push(&self, kind: &str, text: Option<String>, code: Option<u32>) {
        if kind != kind::CONSOLE_LINE && kind != kind::BOOT_MARK {
            stage(kind);
        }
        if !self.enabled {
            return;
        }
        let t_us = now_us();
        let event = Event {
            t_us,
            kind: kind.to_owned(),
            text,
            code,
        };
        // A poisoned lock only means another thread panicked mid-push; the
        // vector itself is still valid, so keep recording.
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(event);
    }

    /// A snapshot of the events so far, sorted by time.
    pub fn snapshot(&self) -> EventFile {
        let mut events = self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        events.sort_by(|a, b| a.t_us.total_cmp(&b.t_us));
        process_start();
        EventFile {
            version: EVENT_FORMAT_VERSION,
            producer: format!("ember {}", env!("CARGO_PKG_VERSION")),
            t0_monotonic_ns: START.get().map_or(0, |s| s.1),
            events,
        }
    }
}

/// Splits a byte stream into lines and stamps each one as its newline arrives.
#[derive(Debug, Default)]
pub struct LineStamper {
    partial: Vec<u8>,
}

/// Longest console line we buffer before stamping it anyway (a guest that never
/// prints a newline must not grow our memory without bound).
const MAX_LINE: usize = 4096;

impl LineStamper {
    /// Feeds output bytes; calls `on_line` for every completed line (without
    /// the newline or a trailing carriage return).
    pub fn feed(&mut self, bytes: &[u8], mut on_line: impl FnMut(&str)) {
        for &b in bytes {
            if b == b'\n' || self.partial.len() >= MAX_LINE {
                if self.partial.last() == Some(&b'\r') {
                    self.partial.pop();
                }
                on_line(&String::from_utf8_lossy(&self.partial));
                self.partial.clear();
                if b == b'\n' {
                    continue;
                }
            }
            self.partial.push(b);
        }
    }

    /// Returns any unterminated tail (used at exit).
    pub fn flush(&mut self, mut on_line: impl FnMut(&str)) {
        if !self.partial.is_empty() {
            on_line(&String::from_utf8_lossy(&self.partial));
            self.partial.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_figures_are_read_by_name() {
        let ev = |kind: &str, text: Option<&str>| Event {
            t_us: 1.0,
            kind: kind.into(),
            text: text.map(Into::into),
            code: None,
        };
        let file = |events| EventFile {
            version: 1,
            producer: "test".into(),
            t0_monotonic_ns: 0,
            events,
        };
        let with = file(vec![
            ev("kvm_open", None),
            ev("memory", Some("vm_hwm_kib=2300 guest_resident_kib=140")),
        ]);
        assert_eq!(with.memory_kib("vm_hwm_kib"), Some(2300));
        assert_eq!(with.memory_kib("guest_resident_kib"), Some(140));
        assert_eq!(with.memory_kib("vm_hwm"), None, "names match whole");
        assert_eq!(
            file(vec![ev("memory", Some("x=1"))]).memory_kib("vm_hwm_kib"),
            None
        );
        assert_eq!(file(vec![]).memory_kib("vm_hwm_kib"), None);
    }

    #[test]
    fn disabled_recorder_keeps_nothing() {
        let r = Recorder::new(false);
        r.mark(kind::KVM_OPEN);
        assert!(r.snapshot().events.is_empty());
    }

    #[test]
    fn events_are_sorted_and_round_trip() {
        let r = Recorder::new(true);
        r.mark(kind::KVM_OPEN);
        r.mark_code(kind::BOOT_MARK, 0x40);
        r.mark_text(kind::CONSOLE_LINE, "hello");
        let f = r.snapshot();
        assert_eq!(f.events.len(), 3);
        assert!(f.events.windows(2).all(|w| w[0].t_us <= w[1].t_us));
        let json = serde_json::to_string(&f).unwrap();
        let back: EventFile = serde_json::from_str(&json).unwrap();
        assert_eq!(back, f);
        assert_eq!(back.events[1].code, Some(0x40));
    }

    #[test]
    fn stamper_splits_lines_across_feeds() {
        let mut s = LineStamper::default();
        let mut lines = Vec::new();
        s.feed(b"hel", |l| lines.push(l.to_owned()));
        s.feed(b"lo\r\nwor", |l| lines.push(l.to_owned()));
        s.feed(b"ld\n\n", |l| lines.push(l.to_owned()));
        s.feed(b"tail", |l| lines.push(l.to_owned()));
        s.flush(|l| lines.push(l.to_owned()));
        assert_eq!(lines, ["hello", "world", "", "tail"]);
    }

    #[test]
    fn stamper_bounds_long_lines() {
        let mut s = LineStamper::default();
        let mut n = 0;
        s.feed(&vec![b'x'; MAX_LINE * 2 + 1], |_| n += 1);
        assert_eq!(n, 2);
    }
}
