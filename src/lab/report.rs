//! Reports: the text tables people read and the JSON machines read.

use super::analysis::{ActivityStats, ConsoleCost};
use super::config::Header;
use super::failures::{Failures, failures_line};
use super::stats::{Interval, Summary};
use serde::Serialize;
use std::fmt::Write;

/// One reported figure across boots.
#[derive(Debug, Clone, Serialize)]
pub struct MetricRow {
    /// Name (`first output`, `userspace`, `exit`, `peak RSS MiB`, …).
    pub name: String,
    /// `ms` or `MiB`.
    pub unit: &'static str,
    /// Configuration A (or the only one).
    pub a: Option<Summary>,
    /// Configuration B of `--vs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b: Option<Summary>,
}

/// A full `ember bench` report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Configuration A.
    pub header: Header,
    /// Configuration B, with `--vs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_b: Option<Header>,
    /// Measured boots requested per configuration.
    pub runs: usize,
    /// Discarded warm-up boots per configuration.
    pub warmup: usize,
    /// Boots that counted, per configuration.
    pub counted: Vec<usize>,
    /// Boots that did not count, per configuration.
    pub failures: Vec<Failures>,
    /// Timeout per boot, s.
    pub timeout_s: f64,
    /// Ctrl-C cut the run short.
    pub interrupted: bool,
    /// The figures.
    pub metrics: Vec<MetricRow>,
    /// With `--vs`: the metric compared pair by pair.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_metric: Option<String>,
    /// With `--vs`: B/A of that metric, geometric mean of per-pair ratios, 95 % t-interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<Interval>,
    /// With `--vs`: B/A of that metric for each pair, in boot order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pair_ratios: Vec<f64>,
    /// Raw per-boot samples of each metric, per configuration.
    pub samples: Vec<Vec<(String, Vec<f64>)>>,
}

/// `12.3` with a precision that suits the magnitude.
pub fn num(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

fn mean_sd(s: &Summary, unit: &str) -> String {
    format!("{}{unit} ±{}{unit}", num(s.mean), num(s.sd))
}

impl BenchReport {
    /// The human report.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let two = self.header_b.is_some();
        let _ = writeln!(
            s,
            "ember bench: {} boot(s){} after {} warm-up boot(s){}\n",
            self.runs,
            if two {
                " of each configuration, interleaved A B A B …,"
            } else {
                ""
            },
            self.warmup,
            if self.interrupted {
                " — INTERRUPTED, partial results"
            } else {
                ""
            }
        );
        s.push_str(&self.header.render(two.then_some("A")));
        if let Some(b) = &self.header_b {
            s.push('\n');
            s.push_str(&b.render(Some("B")));
        }
        let _ = writeln!(
            s,
            "{:>13}: host clock, from VMM spawn to arrival of the console line\n",
            "times"
        );
        self.render_metrics(&mut s, two);
        s.push('\n');
        let labels = if two { ["A", "B"] } else { ["", ""] };
        for (i, f) in self.failures.iter().enumerate() {
            if let Some(l) = failures_line(labels[i], f, Some(self.timeout_s)) {
                let _ = writeln!(s, "{l}");
            }
        }
        self.render_ratio(&mut s);
        self.render_result(&mut s, two, labels);
        s
    }

    /// The table of metrics: A and B side by side, or one configuration's spread.
    fn render_metrics(&self, s: &mut String, two: bool) {
        if two {
            let _ = writeln!(
                s,
                "  {:<16} {:>24} {:>24} {:>7}",
                "metric", "A mean ± sd", "B mean ± sd", "B/A"
            );
            for m in &self.metrics {
                let cell = |x: &Option<Summary>| x.map_or("-".into(), |v| mean_sd(&v, m.unit));
                let ratio = match (m.a, m.b) {
                    (Some(a), Some(b)) if a.mean > 0.0 => format!("{:.3}", b.mean / a.mean),
                    _ => "-".into(),
                };
                let _ = writeln!(
                    s,
                    "  {:<16} {:>24} {:>24} {:>7}",
                    m.name,
                    cell(&m.a),
                    cell(&m.b),
                    ratio
                );
            }
        } else {
            let _ = writeln!(
                s,
                "  {:<16} {:>24} {:>10} {:>21} {:>3}",
                "metric", "mean ± sd", "median", "min – max", "n"
            );
            for m in &self.metrics {
                if let Some(a) = m.a {
                    let _ = writeln!(
                        s,
                        "  {:<16} {:>24} {:>10} {:>21} {:>3}",
                        m.name,
                        mean_sd(&a, m.unit),
                        format!("{}{}", num(a.median), m.unit),
                        format!("{} – {}{}", num(a.min), num(a.max), m.unit),
                        a.n
                    );
                }
            }
        }
    }

    /// `--vs`: B/A of the compared metric, pair by pair, and the verdict.
    fn render_ratio(&self, s: &mut String) {
        if let (Some(r), Some(metric)) = (&self.ratio, &self.ratio_metric) {
            let change = (1.0 - r.estimate) * 100.0;
            let verdict = if r.high < 1.0 {
                format!("B is faster by {change:.1}%")
            } else if r.low > 1.0 {
                format!("B is slower by {:.1}%", -change)
            } else {
                "no difference beyond noise (the interval contains 1)".into()
            };
            let _ = writeln!(
                s,
                "B/A of `{metric}`, pair by pair: {}\n  geometric mean {:.3} [{:.0}% CI {:.3} – {:.3}, \
                 t-interval on the log ratios] → {verdict}",
                self.pair_ratios
                    .iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                r.estimate,
                r.level * 100.0,
                r.low,
                r.high
            );
        }
        if let (None, Some(metric)) = (&self.ratio, &self.ratio_metric) {
            let known: Vec<&str> = self.metrics.iter().map(|m| m.name.as_str()).collect();
            let _ = writeln!(
                s,
                "B/A of `{metric}`: not available (it needs two or more pairs in which both \
                 boots counted and reported it; figures: {})",
                known.join(", ")
            );
        }
    }

    /// The `Result` line(s): the exit time of each configuration.
    fn render_result(&self, s: &mut String, two: bool, labels: [&str; 2]) {
        if let Some(exit) = self.metrics.iter().find(|m| m.name == "exit") {
            for (i, x) in [exit.a, exit.b].iter().enumerate() {
                if let Some(x) = x {
                    let _ = writeln!(
                        s,
                        "Result{}: {}ms ±{}ms",
                        if two {
                            format!(" {}", labels[i])
                        } else {
                            String::new()
                        },
                        num(x.mean),
                        num(x.sd)
                    );
                }
            }
        }
    }
}

/// A full `ember analyze` report.
#[derive(Debug, Clone, Serialize)]
pub struct AnalyzeReport {
    /// The configuration.
    pub header: Header,
    /// Boots analysed.
    pub boots: usize,
    /// Boots that did not count.
    pub failures: Failures,
    /// The timeout the boots ran under, s (`None` for a loaded recording).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Mean run (spawn to exit), ms.
    pub total: Option<Summary>,
    /// Every activity, in start order.
    pub activities: Vec<ActivityStats>,
    /// Console cost.
    pub console: Option<ConsoleCost>,
    /// Ctrl-C cut the run short.
    pub interrupted: bool,
    /// `--advise`: the doctor's suggestions, ranked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advice: Option<super::doctor::AdviceReport>,
}

/// What `render` shows.
#[derive(Debug, Clone, Copy)]
pub struct AnalyzeView {
    /// How many of the longest activities to list.
    pub top: usize,
    /// Hide activities shorter than this (ms) from the full table.
    pub min_ms: f64,
}

impl AnalyzeReport {
    /// The human report.
    pub fn render(&self, view: AnalyzeView) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "ember analyze: {} boot(s){}\n",
            self.boots,
            if self.interrupted {
                " — INTERRUPTED, partial results"
            } else {
                ""
            }
        );
        s.push_str(&self.header.render(None));
        let _ = writeln!(
            s,
            "{:>13}: guest = printk timestamps, moved onto the host axis by the smallest \
             (arrival − printk) of the boot;\n{:>15}host = arrival at the VMM's console pipe \
             or VMM event, both in ms since spawn\n",
            "clocks", ""
        );
        if let Some(l) = failures_line("", &self.failures, self.timeout_s) {
            let _ = writeln!(s, "{l}\n");
        }
        let Some(total) = self.total else {
            s.push_str("No boot counted (see above): nothing to analyse.\n");
            return s;
        };
        let _ = writeln!(
            s,
            "Whole run (spawn to exit): {}ms ±{}ms\n",
            num(total.mean),
            num(total.sd)
        );
        self.render_activities(&mut s, view);
        self.render_initcalls(&mut s);
        self.render_console(&mut s);
        if let Some(a) = &self.advice {
            s.push_str(&a.render());
        }
        s
    }

    /// The activities: all of them, nested, then the longest.
    fn render_activities(&self, s: &mut String, view: AnalyzeView) {
        let _ = writeln!(
            s,
            "Activities (ms; hidden if shorter than {} ms):",
            view.min_ms
        );
        activity_head(s);
        let mut hidden = 0;
        for a in &self.activities {
            if a.duration_ms.mean >= view.min_ms {
                activity_row(s, a, true);
            } else {
                hidden += 1;
            }
        }
        if hidden > 0 {
            let _ = writeln!(
                s,
                "  … and {hidden} shorter activities (--min-ms 0 shows them)"
            );
        }
        let mut longest: Vec<&ActivityStats> =
            self.activities.iter().filter(|a| a.depth > 0).collect();
        longest.sort_by(|a, b| b.duration_ms.mean.total_cmp(&a.duration_ms.mean));
        let _ = writeln!(s, "\nLongest activities:");
        activity_head(s);
        for a in longest.iter().take(view.top) {
            activity_row(s, a, false);
        }
    }

    /// The initcalls, in all and the longest.
    fn render_initcalls(&self, s: &mut String) {
        let mut initcalls: Vec<&ActivityStats> = self
            .activities
            .iter()
            .filter(|a| a.name.starts_with("initcall:"))
            .collect();
        if !initcalls.is_empty() {
            initcalls.sort_by(|a, b| b.duration_ms.mean.total_cmp(&a.duration_ms.mean));
            let sum: f64 = initcalls.iter().map(|a| a.duration_ms.mean).sum();
            let _ = writeln!(
                s,
                "\n{} initcalls, {}ms in all; the longest: {}",
                initcalls.len(),
                num(sum),
                initcalls
                    .iter()
                    .take(5)
                    .map(|a| format!(
                        "{} {}ms",
                        &a.name["initcall:".len()..],
                        num(a.duration_ms.mean)
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }

    /// What the serial console cost.
    fn render_console(&self, s: &mut String) {
        if let Some(c) = &self.console {
            let _ = writeln!(
                s,
                "\nConsole: {} bytes in {} lines per boot. At {} µs/char (--char-cost-us) the \
                 serial line cost ≈ {}ms per boot ({:.1}% of the run).",
                num(c.bytes.mean),
                num(c.lines.mean),
                num(c.per_char_us),
                num(c.estimated_ms),
                c.pct_of_total
            );
            if let Some(o) = c.observed_per_char_us {
                let _ = writeln!(
                    s,
                    "         Guest timestamps of back-to-back lines show ≈ {} µs/char here \
                     (≈ {}ms per boot) — an upper bound: it includes printk's own work.\n         \
                     For the real cost, bench this command line against a quiet one: ember bench --vs 'cmdline=…'.",
                    num(o),
                    num(o * c.bytes.mean / 1e3)
                );
            }
        }
    }
}

/// One row of an activity table, its name indented by depth if `indent`.
fn activity_row(s: &mut String, a: &ActivityStats, indent: bool) {
    let pad = if indent { a.depth * 2 } else { 0 };
    let name = format!("{:pad$}{}", "", a.name);
    let _ = writeln!(
        s,
        "  {:<50} {:>9} {:>9} ±{:>8} {:>6.1}% {:<6} {:>2}",
        name,
        num(a.start_ms.mean),
        num(a.duration_ms.mean),
        num(a.duration_ms.sd),
        a.pct_of_total,
        format!("{:?}", a.clock).to_lowercase(),
        a.duration_ms.n
    );
}

/// The heading of an activity table.
fn activity_head(s: &mut String) {
    let _ = writeln!(
        s,
        "  {:<50} {:>9} {:>9}  {:>8} {:>7} {:<6} {:>2}",
        "activity", "start ms", "mean ms", "sd", "% run", "clock", "n"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_three_significant_digits_or_more() {
        assert_eq!(num(2131.24), "2131.2");
        assert_eq!(num(12.345), "12.35");
        assert_eq!(num(0.1234), "0.123");
    }
}
