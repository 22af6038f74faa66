//! Small statistics for boot times: summaries, Welch's t-test, and a
//! t-interval for ratios of paired samples.
//!
//! Everything is written from the textbook definitions (the Student t
//! distribution through the regularized incomplete beta function), because a
//! boot lab needs three functions, not a statistics crate.

use serde::{Deserialize, Serialize};

/// Mean ± sd, median and range of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Number of values.
    pub n: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Sample standard deviation (n − 1 in the denominator; 0 for n < 2).
    pub sd: f64,
    /// Median.
    pub median: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Summary {
    /// Summarizes `xs`; `None` when it is empty.
    pub fn of(xs: &[f64]) -> Option<Summary> {
        if xs.is_empty() {
            return None;
        }
        let mut sorted = xs.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Summary {
            n,
            mean: mean(xs),
            sd: sd(xs),
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// Arithmetic mean (0 for an empty slice).
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Sample variance (n − 1 denominator; 0 for fewer than two values).
pub fn variance(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64
}

/// Sample standard deviation.
pub fn sd(xs: &[f64]) -> f64 {
    variance(xs).sqrt()
}

/// The result of a two-sample test.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TestResult {
    /// The t statistic (positive when the second sample's mean is larger).
    pub t: f64,
    /// Welch–Satterthwaite degrees of freedom.
    pub df: f64,
    /// Two-sided p-value.
    pub p: f64,
}

/// Welch's unequal-variance t-test of `b` against `a`. `None` when either
/// sample has fewer than two values. Two samples without any spread are equal
/// (p = 1) or certainly different (p = 0).
pub fn welch(a: &[f64], b: &[f64]) -> Option<TestResult> {
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    let (va, vb) = (variance(a) / a.len() as f64, variance(b) / b.len() as f64);
    let diff = mean(b) - mean(a);
    let se2 = va + vb;
    if se2 == 0.0 {
        let p = if diff == 0.0 { 1.0 } else { 0.0 };
        return Some(TestResult {
            t: diff.signum() * f64::INFINITY,
            df: (a.len() + b.len() - 2) as f64,
            p,
        });
    }
    let t = diff / se2.sqrt();
    let df = se2 * se2 / (va * va / (a.len() - 1) as f64 + vb * vb / (b.len() - 1) as f64);
    Some(TestResult {
        t,
        df,
        p: t_two_sided_p(t, df),
    })
}

/// A confidence interval around a point estimate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// Point estimate.
    pub estimate: f64,
    /// Lower bound.
    pub low: f64,
    /// Upper bound.
    pub high: f64,
    /// Confidence level (0.95 for 95 %).
    pub level: f64,
}

/// Geometric-mean ratio of paired samples `b[i] / a[i]` with a t-interval
/// computed on the log ratios (so the interval is symmetric in log space and
/// A/B and B/A agree). `None` with fewer than two pairs or non-positive values.
pub fn paired_ratio(a: &[f64], b: &[f64], level: f64) -> Option<Interval> {
    let logs: Vec<f64> = a
        .iter()
        .zip(b)
        .filter(|(x, y)| **x > 0.0 && **y > 0.0)
        .map(|(x, y)| (y / x).ln())
        .collect();
    if logs.len() < 2 {
        return None;
    }
    let n = logs.len() as f64;
    let m = mean(&logs);
    let half = t_quantile(1.0 - (1.0 - level) / 2.0, n - 1.0) * sd(&logs) / n.sqrt();
    Some(Interval {
        estimate: m.exp(),
        low: (m - half).exp(),
        high: (m + half).exp(),
        level,
    })
}

/// Two-sided p-value of a t statistic with `df` degrees of freedom:
/// P(|T| ≥ |t|) = I_{df/(df+t²)}(df/2, 1/2).
pub fn t_two_sided_p(t: f64, df: f64) -> f64 {
    if !t.is_finite() {
        return 0.0;
    }
    let x = df / (df + t * t);
    incomplete_beta(x, df / 2.0, 0.5).clamp(0.0, 1.0)
}

/// The `q` quantile (0.5 < q < 1) of Student's t with `df` degrees of freedom,
/// by bisection on the CDF (plenty fast for one interval per report).
pub fn t_quantile(q: f64, df: f64) -> f64 {
    let upper_tail = 1.0 - q;
    let (mut lo, mut hi) = (0.0_f64, 1000.0_f64);
    for _ in 0..200 {
        let mid = (lo + hi) / 2.0;
        if t_two_sided_p(mid, df) / 2.0 > upper_tail {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (lo + hi) / 2.0
}

/// ln Γ(x) for x > 0 (Lanczos approximation, g = 7, nine coefficients).
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const COEF: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection keeps the series in its accurate range.
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + G + 0.5;
    let sum = COEF[1..]
        .iter()
        .enumerate()
        .fold(COEF[0], |acc, (i, c)| acc + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// Regularized incomplete beta I_x(a, b), by its continued fraction
/// (evaluated with the modified Lentz method), using the symmetry
/// I_x(a,b) = 1 − I_{1−x}(b,a) where the fraction converges slowly.
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_fraction(x, a, b) / a
    } else {
        1.0 - ln_front.exp() * beta_fraction(1.0 - x, b, a) / b
    }
}

fn beta_fraction(x: f64, a: f64, b: f64) -> f64 {
    const TINY: f64 = 1e-300;
    const EPS: f64 = 1e-14;
    let guard = |v: f64| if v.abs() < TINY { TINY } else { v };
    let mut c = 1.0;
    let mut d = 1.0 / guard(1.0 - (a + b) * x / (a + 1.0));
    let mut h = d;
    for m in 1..500 {
        let m = m as f64;
        // Even step: d_{2m} = m(b−m)x / ((a+2m−1)(a+2m)).
        let even = m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m));
        d = 1.0 / guard(1.0 + even * d);
        c = guard(1.0 + even / c);
        h *= d * c;
        // Odd step: d_{2m+1} = −(a+m)(a+b+m)x / ((a+2m)(a+2m+1)).
        let odd = -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0));
        d = 1.0 / guard(1.0 + odd * d);
        c = guard(1.0 + odd / c);
        let step = d * c;
        h *= step;
        if (step - 1.0).abs() < EPS {
            break;
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn summary_of_a_sample() {
        let s = Summary::of(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.n, s.min, s.max, s.median), (4, 1.0, 10.0, 2.5));
        assert!(close(s.mean, 4.0, 1e-12));
        // Sample variance of [1,2,3,10] = (9+4+1+36)/3 = 50/3.
        assert!(close(s.sd, (50.0f64 / 3.0).sqrt(), 1e-12));
        assert!(Summary::of(&[]).is_none());
        assert_eq!(Summary::of(&[5.0]).unwrap().sd, 0.0);
    }

    #[test]
    fn t_distribution_matches_tables() {
        // Two-sided critical values from standard t tables.
        assert!(close(t_two_sided_p(2.228, 10.0), 0.05, 1e-3));
        assert!(close(t_two_sided_p(3.169, 10.0), 0.01, 1e-3));
        assert!(close(t_two_sided_p(1.96, 1e6), 0.05, 1e-3));
        assert!(close(t_two_sided_p(0.0, 5.0), 1.0, 1e-12));
        assert!(close(t_quantile(0.975, 9.0), 2.262, 1e-3));
        assert!(close(t_quantile(0.995, 4.0), 4.604, 1e-3));
        assert!(close(ln_gamma(5.0), 24.0f64.ln(), 1e-10));
    }

    #[test]
    fn welch_sees_a_shift_but_not_noise() {
        let a = [100.0, 102.0, 98.0, 101.0, 99.0, 100.5, 99.5, 101.5];
        let same = [99.0, 101.0, 100.0, 98.5, 101.5, 100.0, 99.0, 102.0];
        let slower: Vec<f64> = a.iter().map(|x| x + 10.0).collect();
        assert!(welch(&a, &same).unwrap().p > 0.05);
        let r = welch(&a, &slower).unwrap();
        assert!(r.p < 0.01 && r.t > 0.0, "{r:?}");
        assert!(welch(&a, &[1.0]).is_none());
        assert_eq!(welch(&[1.0, 1.0], &[1.0, 1.0]).unwrap().p, 1.0);
        assert_eq!(welch(&[1.0, 1.0], &[2.0, 2.0]).unwrap().p, 0.0);
    }

    #[test]
    fn paired_ratio_interval_brackets_the_ratio() {
        let a = [100.0, 110.0, 90.0, 105.0, 95.0];
        let b = [80.0, 89.0, 71.0, 85.0, 75.0];
        let r = paired_ratio(&a, &b, 0.95).unwrap();
        assert!(r.low < r.estimate && r.estimate < r.high);
        assert!(r.low > 0.78 && r.high < 0.82, "{r:?}");
        assert!(paired_ratio(&[1.0], &[2.0], 0.95).is_none());
    }
}
