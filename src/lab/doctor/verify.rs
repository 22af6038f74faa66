//! `--verify`: boots without and with a change, A/B interleaved, and
//! measures the saving per pair with its interval.

use super::model::{Advice, Combined, Verification, VerifyClock, VerifyVerdict};
use crate::lab::analysis::Milestones;
use crate::lab::config::{self, ConfigError, GuestOpts};
use crate::lab::failures::Failures;
use crate::lab::runner::{self, RunError, Verdict};
use crate::lab::signal;
use crate::lab::stats::{self, Interval, Summary};
use thiserror::Error;

/// Errors that stop a verification.
#[derive(Debug, Error)]
pub enum VerifyError {
    /// A configuration could not be built.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A series of boots could not run.
    #[error(transparent)]
    Run(#[from] RunError),
}

/// Verifies each automatic suggestion of `advice` that `only` names (all
/// when empty) with `pairs` A/B pairs over `base`, and — when more than one
/// and `only` is empty — all of them together.
pub fn verify_all(
    advice: &mut [Advice],
    base: &GuestOpts,
    only: &[String],
    pairs: usize,
    m: &Milestones,
) -> Result<Option<Combined>, VerifyError> {
    let chosen = |a: &Advice| a.change.automatic() && (only.is_empty() || only.contains(&a.id));
    for a in advice.iter_mut().filter(|a| chosen(a)) {
        let mut b = base.clone();
        a.change.apply(&mut b);
        eprintln!("ember: --verify: {} ({pairs} pairs)", a.change.describe());
        let clock = VerifyClock::for_change(base.icount, &a.change);
        a.verified = Some(verify_one(base, &b, pairs, m, clock)?);
    }
    let auto: Vec<&Advice> = advice.iter().filter(|a| chosen(a)).collect();
    if auto.len() <= 1 || !only.is_empty() {
        return Ok(None);
    }
    let mut b = base.clone();
    for a in &auto {
        a.change.apply(&mut b);
    }
    eprintln!(
        "ember: --verify: all {} automatic changes together",
        auto.len()
    );
    // The guest's clock only if it sees every change.
    let guest = VerifyClock::Guest;
    let clock = if auto
        .iter()
        .all(|a| VerifyClock::for_change(base.icount, &a.change) == guest)
    {
        guest
    } else {
        VerifyClock::Wall
    };
    Ok(Some(Combined {
        changes: auto.iter().map(|a| a.change.describe()).collect(),
        predicted_ms: auto.iter().map(|a| a.predicted_ms).sum(),
        verified: verify_one(base, &b, pairs, m, clock)?,
    }))
}

/// Boots `a` and `b` interleaved, `pairs` times each, and measures the
/// per-pair saving of `b` on `clock` (spawn to exit, or the guest's own).
fn verify_one(
    a: &GuestOpts,
    b: &GuestOpts,
    pairs: usize,
    m: &Milestones,
    clock: VerifyClock,
) -> Result<Verification, VerifyError> {
    let configs = [config::build(a, "A")?, config::build(b, "B")?];
    let series = runner::run_series(&configs, 0, pairs, signal::flag())?;
    let (xa, xb): (Vec<f64>, Vec<f64>) = series.records[0]
        .iter()
        .zip(&series.records[1])
        .filter(|(x, y)| {
            runner::verdict(x, m) == Verdict::Ok && runner::verdict(y, m) == Verdict::Ok
        })
        .filter_map(|(x, y)| Some((clock.of(x)?, clock.of(y)?)))
        .unzip();
    let b_ok = series.records[1]
        .iter()
        .any(|r| runner::verdict(r, m) == Verdict::Ok);
    let saving = paired_saving(&xa, &xb, 0.95);
    Ok(Verification {
        pairs: xa.len(),
        clock,
        without_ms: Summary::of(&xa),
        with_ms: Summary::of(&xb),
        verdict: if b_ok || series.records[1].is_empty() {
            VerifyVerdict::of(saving.as_ref())
        } else {
            VerifyVerdict::Broke
        },
        saving_ms: saving,
        failures: [
            Failures::of(&series.records[0], m),
            Failures::of(&series.records[1], m),
        ],
    })
}

/// Paired saving `a[i] − b[i]`: mean and t-interval at `level`.
pub fn paired_saving(a: &[f64], b: &[f64], level: f64) -> Option<Interval> {
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    if d.len() < 2 {
        return None;
    }
    let n = d.len() as f64;
    let m = stats::mean(&d);
    let half = stats::t_quantile(1.0 - (1.0 - level) / 2.0, n - 1.0) * stats::sd(&d) / n.sqrt();
    Some(Interval {
        estimate: m,
        low: m - half,
        high: m + half,
        level,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_from_intervals() {
        let i = paired_saving(&[100.0, 102.0, 101.0], &[90.0, 91.0, 92.0], 0.95).unwrap();
        assert!((i.estimate - 10.0).abs() < 1e-9 && i.low > 0.0);
        assert_eq!(VerifyVerdict::of(Some(&i)), VerifyVerdict::Saves);
        let i = paired_saving(&[100.0, 90.0, 101.0], &[95.0, 96.0, 97.0], 0.95).unwrap();
        assert_eq!(VerifyVerdict::of(Some(&i)), VerifyVerdict::NoSaving);
        let i = paired_saving(&[90.0, 91.0, 92.0], &[100.0, 102.0, 101.0], 0.95).unwrap();
        assert_eq!(VerifyVerdict::of(Some(&i)), VerifyVerdict::Slower);
        assert_eq!(VerifyVerdict::of(None), VerifyVerdict::Inconclusive);
    }
}
