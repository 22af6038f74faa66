//! ember's logger: `log` records to stderr as `ember: LEVEL: message`, filtered by one
//! level, with a rate limit for messages a guest can trigger.
//!
//! The level is `info` unless `EMBER_LOG` (`off`, `error`, `warn`, `info`, `debug`,
//! `trace`) says otherwise; each `-v` raises it one step. Our own ~60 lines rather than a
//! crate: ember is a static binary that cares about its start-up time, and all it needs is
//! one level and one sink (env_logger would bring regex-based filters and colour handling).
//!
//! A guest can make a device log as often as it likes (a broken ring per kick, an
//! out-of-memory descriptor per request), so device messages go through [`guest_warn!`] and
//! [`guest_error!`]: at most `BURST` lines per call site per second, and a count of what
//! was held back when the next one goes out.

use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use log::{Level, LevelFilter, Log, Metadata, Record};

/// The environment variable that sets the level.
pub(crate) const ENV: &str = "EMBER_LOG";
/// Lines a single guest-triggered call site may print per second.
pub(crate) const BURST: u64 = 10;

struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            Level::Error => "error",
            Level::Warn => "warning",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        };
        // One write per line, so lines from several threads do not interleave.
        let line = format!("ember: {level}: {}\n", record.args());
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

static LOGGER: StderrLogger = StderrLogger;

/// An `EMBER_LOG` value that names no level.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{ENV}={0}: expected off, error, warn, info, debug or trace")]
pub(crate) struct LevelError(String);

/// The level `EMBER_LOG` and `verbose` (the count of `-v`) ask for.
pub(crate) fn level_from(env: Option<&str>, verbose: u8) -> Result<LevelFilter, LevelError> {
    let base = match env.map(str::trim) {
        None | Some("") => LevelFilter::Info,
        Some(v) => v
            .parse::<LevelFilter>()
            .map_err(|_| LevelError(v.to_owned()))?,
    };
    let raised = (0..verbose).fold(base, |l, _| match l {
        LevelFilter::Off => LevelFilter::Error,
        LevelFilter::Error => LevelFilter::Warn,
        LevelFilter::Warn => LevelFilter::Info,
        LevelFilter::Info => LevelFilter::Debug,
        LevelFilter::Debug | LevelFilter::Trace => LevelFilter::Trace,
    });
    Ok(raised)
}

/// Installs the logger at the level `EMBER_LOG` and `verbose` give. An unreadable
/// `EMBER_LOG` is reported and the default kept: a typo must not stop a VM.
pub fn init(verbose: u8) {
    let env = std::env::var(ENV).ok();
    let level = level_from(env.as_deref(), verbose).unwrap_or_else(|e| {
        eprintln!("ember: warning: {e}; using info");
        level_from(None, verbose).unwrap_or(LevelFilter::Info)
    });
    // Fails only if a logger is already installed (a second call): keep the first.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(level);
}

/// Per-call-site state of a rate-limited message: a one-second window, the lines printed
/// in it, and the lines held back since the last one printed.
#[derive(Debug, Default)]
pub struct RateLimit {
    window: AtomicU64,
    printed: AtomicU64,
    held: AtomicU64,
}

impl RateLimit {
    /// A limiter with nothing printed yet.
    pub const fn new() -> Self {
        Self {
            window: AtomicU64::new(0),
            printed: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Whether a line may go out now (`Some(lines held back before it)`) or must be held
    /// back (`None`).
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(seconds())
    }

    fn admit_at(&self, now: u64) -> Option<u64> {
        // Races between threads at a window's edge may let a line or two more through;
        // the bound is what matters, not its exact value.
        if self.window.swap(now, Ordering::Relaxed) != now {
            self.printed.store(0, Ordering::Relaxed);
        }
        if self.printed.fetch_add(1, Ordering::Relaxed) < BURST {
            Some(self.held.swap(0, Ordering::Relaxed))
        } else {
            self.held.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Whole seconds since the first call (1-based, so the first window differs from the
/// limiter's initial 0).
fn seconds() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs() + 1
}

/// `log::warn!` for messages a guest can trigger: rate-limited per call site.
#[macro_export]
macro_rules! guest_warn {
    ($($arg:tt)+) => { $crate::guest_log!($crate::logger::__log::Level::Warn, $($arg)+) };
}

/// `log::error!` for messages a guest can trigger: rate-limited per call site.
#[macro_export]
macro_rules! guest_error {
    ($($arg:tt)+) => { $crate::guest_log!($crate::logger::__log::Level::Error, $($arg)+) };
}

/// The body of [`guest_warn!`] and [`guest_error!`].
#[doc(hidden)]
#[macro_export]
macro_rules! guest_log {
    ($level:expr, $($arg:tt)+) => {{
        static LIMIT: $crate::logger::RateLimit = $crate::logger::RateLimit::new();
        if $crate::logger::__log::log_enabled!($level) {
            match LIMIT.admit() {
                Some(0) => $crate::logger::__log::log!($level, $($arg)+),
                Some(held) => $crate::logger::__log::log!(
                    $level,
                    "{} ({held} similar messages suppressed)",
                    format_args!($($arg)+)
                ),
                None => {}
            }
        }
    }};
}

pub use crate::{guest_error, guest_warn};
/// `log`, for the macros above to name from any crate.
#[doc(hidden)]
pub use log as __log;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_from_env_and_verbosity() {
        assert_eq!(level_from(None, 0), Ok(LevelFilter::Info));
        assert_eq!(level_from(Some("warn"), 0), Ok(LevelFilter::Warn));
        assert_eq!(level_from(Some("WARN"), 0), Ok(LevelFilter::Warn));
        assert_eq!(level_from(None, 1), Ok(LevelFilter::Debug));
        assert_eq!(level_from(None, 5), Ok(LevelFilter::Trace));
        assert_eq!(level_from(Some("off"), 1), Ok(LevelFilter::Error));
        assert_eq!(
            level_from(Some("loud"), 0).unwrap_err().to_string(),
            "EMBER_LOG=loud: expected off, error, warn, info, debug or trace"
        );
    }

    #[test]
    fn rate_limit_holds_back_a_flood_and_counts_it() {
        let limit = RateLimit::new();
        let passed = (0..1000).filter(|_| limit.admit_at(7).is_some()).count();
        assert_eq!(passed as u64, BURST);
        // The next window lets lines through again and reports what was held back.
        assert_eq!(limit.admit_at(8), Some(1000 - BURST));
        assert_eq!(limit.admit_at(8), Some(0));
    }
}
