//! Reports: the text tables people read and the JSON machines read.

use super::analysis::{ActivityStats, ConsoleCost};
use super::config::Header;
use super::stats::{Interval, Summary};
use serde::{Deserialize, Serialize};
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

/// Boots that did not count, per configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failures {
    /// Killed at the timeout.
    pub timed_out: usize,
    /// Ended without reaching userspace.
    pub no_userspace: usize,
    /// The last console line of the first boot that did not count: usually
    /// says where it got stuck.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_line: Option<String>,
    /// That boot's first kernel oops (or warning, or RCU stall report), when
    /// it printed one: what went wrong, where (`RIP:`) and the first frames
    /// of its call trace. A panic's last line ("Fatal exception") says only
    /// that something did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub oops: Vec<String>,
}

/// Longest `last_line` we quote, in characters.
const MAX_QUOTE: usize = 100;

/// How a kernel oops starts (x86 Linux's own words), or a warning or an
/// RCU stall, whose register dumps and traces have the same shape: a boot
/// that stalls prints no oops, and its last line is only the dump's `Code:`.
const OOPS_STARTS: [&str; 9] = [
    "BUG:",
    "WARNING: CPU:",
    "detected stall",
    "Oops:",
    "general protection fault",
    "kernel BUG at",
    "invalid opcode:",
    "divide error:",
    "stack segment:",
];

/// Call-trace frames quoted after an oops's `RIP:` line.
const OOPS_FRAMES: usize = 4;

/// The first oops in a boot's console `lines` (printk stamps removed): its
/// first line, its `RIP:` line and up to [`OOPS_FRAMES`] frames of its call
/// trace; empty when there is none.
pub fn oops_excerpt<'a>(lines: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let quote = |l: &str| -> String { l.trim().chars().take(MAX_QUOTE).collect() };
    let mut out = Vec::new();
    let (mut rip, mut frames) = (false, None::<usize>);
    for line in lines {
        let body = super::analysis::split_printk(line).1;
        let body = body.trim();
        if out.is_empty() {
            if OOPS_STARTS.iter().any(|s| body.contains(s)) {
                out.push(quote(body));
            }
            continue;
        }
        if !rip && body.starts_with("RIP:") {
            rip = true;
            out.push(quote(body));
        } else if body.starts_with("Call Trace:") {
            frames = Some(0);
        } else if let Some(n) = frames.as_mut() {
            // (`<IRQ>`, `</IRQ>`, `<TASK>`: which stack, not frames.)
            if body.starts_with('<') {
                continue;
            }
            if *n == OOPS_FRAMES || body.is_empty() || body.starts_with("Kernel panic") {
                break;
            }
            *n += 1;
            out.push(quote(body));
        } else if body.starts_with("Kernel panic") {
            break;
        }
    }
    out
}

impl Failures {
    /// Counts the boots of `records` that did not count under `m`.
    pub fn of(records: &[super::boot::BootRecord], m: &super::analysis::Milestones) -> Failures {
        use super::runner::{Verdict, verdict};
        let failed = |v| records.iter().filter(|r| verdict(r, m) == v).count();
        let first_bad = records
            .iter()
            .find(|r| matches!(verdict(r, m), Verdict::TimedOut | Verdict::NoUserspace));
        Failures {
            timed_out: failed(Verdict::TimedOut),
            no_userspace: failed(Verdict::NoUserspace),
            last_line: first_bad.and_then(|r| {
                let line = r.lines.iter().rev().find(|l| !l.text.trim().is_empty())?;
                Some(
                    super::analysis::split_printk(&line.text)
                        .1
                        .chars()
                        .take(MAX_QUOTE)
                        .collect(),
                )
            }),
            oops: first_bad
                .map(|r| oops_excerpt(r.lines.iter().map(|l| l.text.as_str())))
                .unwrap_or_default(),
        }
    }
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

/// `timeout_s`: the timeout the boots ran under, when known (not for a
/// recording loaded from a file, which does not keep it).
fn failures_line(label: &str, f: &Failures, timeout_s: Option<f64>) -> Option<String> {
    let mut parts = Vec::new();
    match (f.timed_out, timeout_s) {
        (0, _) => {}
        (n, Some(t)) => parts.push(format!("{n} timed out after {t} s")),
        (n, None) => parts.push(format!("{n} timed out")),
    }
    if f.no_userspace > 0 {
        parts.push(format!(
            "{} ended without reaching userspace",
            f.no_userspace
        ));
    }
    (!parts.is_empty()).then(|| {
        let prefix = if label.is_empty() {
            String::new()
        } else {
            format!("{label}: ")
        };
        let mut line = format!("{prefix}boot(s) not averaged in: {}", parts.join(", "));
        if let Some(last) = &f.last_line {
            line.push_str(&format!("; the first one's last console line: `{last}`"));
        }
        for (i, l) in f.oops.iter().enumerate() {
            let lead = if i == 0 { "its oops:" } else { "" };
            line.push_str(&format!("\n  {lead:<9} {l}"));
        }
        line
    })
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
        s.push('\n');
        let labels = if two { ["A", "B"] } else { ["", ""] };
        for (i, f) in self.failures.iter().enumerate() {
            if let Some(l) = failures_line(labels[i], f, Some(self.timeout_s)) {
                let _ = writeln!(s, "{l}");
            }
        }
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
        s
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
    pub advice: Option<super::advise::AdviceReport>,
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
            s.push_str("No boot reached userspace: nothing to analyse.\n");
            return s;
        };
        let _ = writeln!(
            s,
            "Whole run (spawn to exit): {}ms ±{}ms\n",
            num(total.mean),
            num(total.sd)
        );
        let row = |s: &mut String, a: &ActivityStats, indent: bool| {
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
        };
        let head = |s: &mut String| {
            let _ = writeln!(
                s,
                "  {:<50} {:>9} {:>9}  {:>8} {:>7} {:<6} {:>2}",
                "activity", "start ms", "mean ms", "sd", "% run", "clock", "n"
            );
        };
        let _ = writeln!(
            s,
            "Activities (ms; hidden if shorter than {} ms):",
            view.min_ms
        );
        head(&mut s);
        let mut hidden = 0;
        for a in &self.activities {
            if a.duration_ms.mean >= view.min_ms {
                row(&mut s, a, true);
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
        head(&mut s);
        for a in longest.iter().take(view.top) {
            row(&mut s, a, false);
        }
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
        if let Some(a) = &self.advice {
            s.push_str(&a.render());
        }
        s
    }
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

    #[test]
    fn failures_are_spelled_out() {
        let f = Failures {
            timed_out: 2,
            no_userspace: 1,
            last_line: None,
            oops: Vec::new(),
        };
        assert_eq!(
            failures_line("A", &f, Some(5.0)).unwrap(),
            "A: boot(s) not averaged in: 2 timed out after 5 s, 1 ended without reaching userspace"
        );
        assert!(failures_line("", &Failures::default(), Some(5.0)).is_none());
        // A loaded recording does not know its timeout: no made-up figure.
        let f = Failures {
            timed_out: 1,
            ..Failures::default()
        };
        assert_eq!(
            failures_line("", &f, None).unwrap(),
            "boot(s) not averaged in: 1 timed out"
        );
    }

    /// The shape of an x86 oops on a serial console, cut from a real one.
    const OOPS: &str = "[    1.100000] serial8250: too much work for irq4
[    1.200000] BUG: kernel NULL pointer dereference, address: 0000000000000008
[    1.200001] #PF: supervisor read access in kernel mode
[    1.200002] Oops: 0000 [#1] PREEMPT SMP NOPTI
[    1.200003] CPU: 1 PID: 0 Comm: swapper/1 Not tainted 6.1.0-56-cloud-amd64 #1
[    1.200004] RIP: 0010:hrtimer_interrupt+0x3c/0x230
[    1.200005] Code: 41 56 41 55 41 54 55 53 48 83 ec 18
[    1.200006] RSP: 0018:ffffb2c0000f8f48 EFLAGS: 00010046
[    1.200007] Call Trace:
[    1.200008]  <IRQ>
[    1.200009]  __sysvec_apic_timer_interrupt+0x5e/0x110
[    1.200010]  sysvec_apic_timer_interrupt+0x6d/0x90
[    1.200011]  </IRQ>
[    1.200012]  <TASK>
[    1.200013]  asm_sysvec_apic_timer_interrupt+0x16/0x20
[    1.200014] Kernel panic - not syncing: Fatal exception in interrupt";

    #[test]
    fn an_oops_is_quoted_by_its_cause_place_and_first_frames() {
        assert_eq!(
            oops_excerpt(OOPS.lines()),
            [
                "BUG: kernel NULL pointer dereference, address: 0000000000000008",
                "RIP: 0010:hrtimer_interrupt+0x3c/0x230",
                "__sysvec_apic_timer_interrupt+0x5e/0x110",
                "sysvec_apic_timer_interrupt+0x6d/0x90",
                "asm_sysvec_apic_timer_interrupt+0x16/0x20",
            ]
        );
        let f = Failures {
            no_userspace: 1,
            last_line: Some("Kernel panic - not syncing: Fatal exception in interrupt".into()),
            oops: oops_excerpt(OOPS.lines()),
            ..Failures::default()
        };
        let text = failures_line("", &f, None).unwrap();
        assert!(
            text.contains("\n  its oops: BUG: kernel NULL")
                && text.contains("\n            RIP: 0010:hrtimer_interrupt"),
            "{text}"
        );
        assert!(oops_excerpt(OOPS.lines().take(1)).is_empty());
        // An RCU stall's report starts without any oops's words.
        let stall = "[   40.100000] rcu: INFO: rcu_preempt self-detected stall on CPU
[   40.100001] rcu: \t1-....: (2099 ticks this GP) idle=d1c/1/0x4000000000000000
[   40.100002] RIP: 0010:native_safe_halt+0xb/0x10
[   40.100003] Code: 7a 0a fe fd 89 c6 41 39 c5 74 26";
        assert_eq!(
            oops_excerpt(stall.lines()),
            [
                "rcu: INFO: rcu_preempt self-detected stall on CPU",
                "RIP: 0010:native_safe_halt+0xb/0x10",
            ]
        );
        assert!(oops_excerpt(["[ 0.1] Run /init as init process"]).is_empty());
    }
}
