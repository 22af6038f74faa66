//! Runs series of boots: warm-ups first, then measured boots, configurations
//! interleaved (A B A B …) so slow drift on a shared machine hits both alike.
//! Shows a progress bar on a terminal and stops cleanly on Ctrl-C.

use super::analysis::Milestones;
use super::record::{BootConfig, BootError, BootRecord, Outcome, is_panic_line, run_boot};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use thiserror::Error;

/// Exit status after Ctrl-C (128 + SIGINT), as shells report it.
pub const EXIT_INTERRUPTED: i32 = 130;

/// Errors that stop a series.
#[derive(Debug, Error)]
pub enum RunError {
    /// A boot could not be started.
    #[error("boot {index} of {label}")]
    Boot {
        /// Configuration label.
        label: String,
        /// 1-based boot number.
        index: usize,
        /// Why.
        #[source]
        source: BootError,
    },
    /// The VMM failed before printing anything (bad kernel, bad option…).
    #[error("{backend} failed at once (exit status {status}) without guest output: {stderr}")]
    VmmFailed {
        /// Backend name.
        backend: String,
        /// Its exit status.
        status: i32,
        /// The last lines of its stderr.
        stderr: String,
    },
}

/// Whether a boot counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Reached userspace and ended by itself.
    Ok,
    /// Killed at the timeout.
    TimedOut,
    /// Its kernel panicked (before or after userspace).
    Panicked,
    /// Ended without ever reaching userspace.
    NoUserspace,
    /// Stopped by Ctrl-C.
    Cancelled,
}

/// Classifies one boot. A panic never counts, even after userspace (an init
/// that died) and even when the kernel's own reboot (`panic=-1`) ended the
/// VMM before the lab did.
pub fn verdict(r: &BootRecord, m: &Milestones) -> Verdict {
    match r.outcome {
        Outcome::TimedOut => Verdict::TimedOut,
        Outcome::Cancelled => Verdict::Cancelled,
        Outcome::Panicked => Verdict::Panicked,
        _ if r.lines.iter().any(|l| is_panic_line(&l.text)) => Verdict::Panicked,
        _ if r.lines.iter().any(|l| {
            m.userspace
                .is_match(&super::analysis::split_printk(&l.text).1)
        }) =>
        {
            Verdict::Ok
        }
        _ => Verdict::NoUserspace,
    }
}

/// The measured boots of each configuration.
#[derive(Debug)]
pub struct Series {
    /// Per configuration, the measured (non-warm-up) boots, failed ones included.
    pub records: Vec<Vec<BootRecord>>,
    /// Ctrl-C stopped the series early.
    pub interrupted: bool,
}

impl Series {
    /// The boots of configuration `i` that count.
    pub fn good<'a>(&'a self, i: usize, m: &Milestones) -> Vec<&'a BootRecord> {
        self.records[i]
            .iter()
            .filter(|r| verdict(r, m) == Verdict::Ok)
            .collect()
    }

    /// How many boots of configuration `i` ended with verdict `v`.
    pub fn count(&self, i: usize, m: &Milestones, v: Verdict) -> usize {
        self.records[i]
            .iter()
            .filter(|r| verdict(r, m) == v)
            .count()
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress(len: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("valid template"),
    );
    bar
}

/// The order the configurations boot in, in round `round`: rotated by one
/// each round (A B, B A, … for a pair; each position equally often for more).
pub fn round_order(round: usize, configs: usize) -> impl Iterator<Item = usize> {
    (0..configs).map(move |k| (k + round) % configs)
}

/// Runs `warmup` discarded and `n` measured boots of every configuration,
/// interleaved. Stops early (keeping what it measured) when `cancel` is set.
///
/// Each round starts one configuration later than the last ([`round_order`]),
/// so no configuration always boots first: on a quiet machine the second
/// boot of a pair ran 50–90 ms slower than the first whatever it was, which
/// `--verify` had reported as three changes "slower", none of which could be.
pub fn run_series(
    configs: &[(BootConfig, Milestones)],
    warmup: usize,
    n: usize,
    cancel: &AtomicBool,
) -> Result<Series, RunError> {
    let bar = progress(((warmup + n) * configs.len()) as u64);
    let series = run_series_with(configs, warmup, n, cancel, &bar);
    bar.finish_and_clear();
    series
}

/// [`run_series`] advancing a caller's progress bar (for outer loops).
pub fn run_series_with(
    configs: &[(BootConfig, Milestones)],
    warmup: usize,
    n: usize,
    cancel: &AtomicBool,
    bar: &ProgressBar,
) -> Result<Series, RunError> {
    let mut records: Vec<Vec<BootRecord>> = vec![Vec::new(); configs.len()];
    let mut interrupted = false;
    'outer: for round in 0..warmup + n {
        for ci in round_order(round, configs.len()) {
            let (cfg, _) = &configs[ci];
            if cancel.load(Ordering::SeqCst) {
                interrupted = true;
                break 'outer;
            }
            let phase = if round < warmup {
                format!("warm-up {}/{warmup}", round + 1)
            } else {
                format!("boot {}/{n}", round - warmup + 1)
            };
            bar.set_message(if configs.len() > 1 {
                format!("{phase} [{}]", cfg.label)
            } else {
                phase
            });
            let r = run_boot(cfg, cancel).map_err(|source| RunError::Boot {
                label: cfg.label.clone(),
                index: round + 1,
                source,
            })?;
            bar.inc(1);
            if round == 0 {
                fail_fast(cfg, &r)?;
            }
            if r.outcome == Outcome::Cancelled {
                interrupted = true;
                break 'outer;
            }
            if round >= warmup {
                records[ci].push(r);
            }
        }
    }
    Ok(Series {
        records,
        interrupted,
    })
}

/// A first boot that exits with an error before any guest output means the
/// VMM was misconfigured: repeating it N times would only hide the message.
fn fail_fast(cfg: &BootConfig, r: &BootRecord) -> Result<(), RunError> {
    match r.outcome {
        Outcome::Exited(status) if status != 0 && r.console_bytes == 0 => {
            let tail: Vec<&str> = r.stderr.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(RunError::VmmFailed {
                backend: cfg.backend.name().to_owned(),
                status,
                stderr: if tail.is_empty() {
                    "(no stderr)".into()
                } else {
                    tail.join(" / ")
                },
            })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::round_order;

    #[test]
    fn every_configuration_boots_in_every_position_equally_often() {
        assert_eq!(round_order(0, 2).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(round_order(1, 2).collect::<Vec<_>>(), [1, 0]);
        for n in 1..=4 {
            let mut seen = vec![vec![0; n]; n];
            for round in 0..3 * n {
                let order: Vec<usize> = round_order(round, n).collect();
                let mut sorted = order.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "each once a round");
                for (position, config) in order.into_iter().enumerate() {
                    seen[config][position] += 1;
                }
            }
            assert!(seen.iter().flatten().all(|&c| c == 3), "{n}: {seen:?}");
        }
    }
}
