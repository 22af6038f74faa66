//! The kernel log on the serial console: its volume times what a character
//! and a line cost, as fitted from this very boot.

use crate::lab::analysis::{self, split_printk};
use crate::lab::doctor::evidence::{Inputs, has_option, option_value};
use crate::lab::doctor::model::{Advice, Change};
use crate::lab::record::BootRecord;
use crate::lab::stats;

/// Console output volume × the per-character cost seen in this very boot.
pub fn console_rule(i: &Inputs<'_>) -> Option<Advice> {
    let cmd = &i.header.cmdline;
    let quiet = has_option(cmd, "quiet")
        || option_value(cmd, "loglevel").is_some_and(|v| v.parse::<u32>().is_ok_and(|l| l <= 4));
    if quiet || i.boots.is_empty() {
        return None;
    }
    let console = i.console?;
    // Kernel lines only: userspace output stays whatever the kernel's level.
    let per_boot: Vec<(f64, f64)> = i
        .boots
        .iter()
        .map(|r| {
            let stamped: Vec<&str> = r
                .lines
                .iter()
                .map(|l| l.text.as_str())
                .filter(|t| split_printk(t).0.is_some())
                .collect();
            (
                stamped.len() as f64,
                stamped.iter().map(|t| t.len() as f64 + 2.0).sum(),
            )
        })
        .collect();
    let lines = stats::mean(&per_boot.iter().map(|p| p.0).collect::<Vec<_>>());
    let bytes = stats::mean(&per_boot.iter().map(|p| p.1).collect::<Vec<_>>());
    // The host's clock first: it is what a user waits on, and the guest's
    // can stand still while the console prints (in the nested rig a WARN
    // splat's hundred lines, stamped before the clock ran, took 17 s to
    // print), which left the guest-clock slope at a quarter of the cost.
    let fit = console_fit(i.boots, true)
        .map(|f| (f, "arrival at the VMM"))
        .or_else(|| console_fit(i.boots, false).map(|f| (f, "Δprintk")));
    let (per_char, per_line, source) = match fit {
        Some((f, clock)) => (
            f.per_char_us,
            f.per_line_us,
            format!(
                "slope and intercept of {clock} against line length over {} back-to-back \
                 kernel lines in these boots",
                f.pairs
            ),
        ),
        _ => (
            console.per_char_us,
            0.0,
            "the backend's cost model (--char-cost-us): this boot's own timestamps do not \
             separate the console's cost from printk's per-line work"
                .to_owned(),
        ),
    };
    Some(Advice {
        id: "quiet".into(),
        title:
            "Keep the kernel log off the serial console: every character crosses an emulated UART"
                .into(),
        evidence: vec![
            format!(
                "{lines:.0} kernel lines, {bytes:.0} bytes per boot on the serial console"
            ),
            format!("{per_char:.2} µs per character and {per_line:.0} µs per line ({source})"),
            "the per-line part is the console's own work for each line together with \
             printk's, which `quiet` keeps: where printk's share is large, an upper bound"
                .into(),
            "or keep the log on a virtio console (console=hvc0), which takes whole buffers per exit"
                .into(),
        ],
        predicted_ms: (bytes * per_char + lines * per_line) / 1e3,
        change: Change::CmdlineAdd {
            option: "quiet".into(),
        },
        verified: None,
    })
}

/// The console's cost of a line, fitted over back-to-back stamped kernel
/// lines as the gap to the next line against the line's length.
struct ConsoleFit {
    /// The slope, µs per character.
    per_char_us: f64,
    /// The intercept, µs per line (0 when negative): the console's per-line
    /// work and printk's own. Left out once, it made the rig's prediction
    /// 1.0 s where `quiet` saved 5.3 s: there the console spends ~15 ms a
    /// line (282 lines) beside 52 µs a character.
    per_line_us: f64,
    /// How many pairs the fit is over.
    pairs: usize,
}

/// [`ConsoleFit`] from the host's clock (the lines' arrival) or the guest's
/// own (their printk stamps). `None` with fewer than 20 back-to-back pairs
/// or a slope they do not support (t < 2: a noisy boot falls back on the
/// backend's cost model rather than on noise).
fn console_fit(boots: &[&BootRecord], host_clock: bool) -> Option<ConsoleFit> {
    let xy = analysis::back_to_back_lines(boots, host_clock);
    if xy.len() < 20 {
        return None;
    }
    let mx = xy.iter().map(|p| p.0).sum::<f64>() / xy.len() as f64;
    let my = xy.iter().map(|p| p.1).sum::<f64>() / xy.len() as f64;
    let sxx: f64 = xy.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = xy.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let rss: f64 = xy
        .iter()
        .map(|p| (p.1 - intercept - slope * p.0).powi(2))
        .sum();
    let se = (rss / (xy.len() - 2) as f64 / sxx).sqrt();
    (slope > 0.0 && (se == 0.0 || slope / se >= 2.0)).then_some(ConsoleFit {
        per_char_us: slope,
        per_line_us: intercept.max(0.0),
        pairs: xy.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::analysis::ConsoleCost;
    use crate::lab::doctor::testing::{header, opts, record, run};

    /// A chatty boot: 200 back-to-back stamped lines of 40 to 80 bytes (60
    /// on average, newline included), each followed by 50 µs of printk's own
    /// work plus 4 µs per character.
    fn chatty() -> BootRecord {
        chatty_at(4.0, 0.0)
    }

    /// [`chatty`] with `per_char` µs per character, and `other_us` of other
    /// work (an initcall, say) after every 10th line.
    fn chatty_at(per_char: f64, other_us: f64) -> BootRecord {
        let mut text = Vec::new();
        let mut t = 1000.0;
        for k in 0..200 {
            let len = 40 + (k % 41); // 40..=80 bytes with "\r\n"
            text.push((
                t,
                format!("[{:>12.6}] {}", t / 1e6, "x".repeat(len - 2 - 15)),
            ));
            t += 50.0 + per_char * len as f64;
            if k % 10 == 9 {
                t += other_us;
            }
        }
        let lines: Vec<(f64, &str)> = text
            .iter()
            .map(|(t, s)| (*t + 1000.0, s.as_str()))
            .collect();
        record(&lines, 60_000.0)
    }

    fn cost_of(r: &BootRecord) -> ConsoleCost {
        analysis::console_cost(&[r], 4.0, 60.0).unwrap()
    }

    #[test]
    fn console_volume_times_measured_cost_suggests_quiet() {
        let r = chatty();
        let c = cost_of(&r);
        let o = opts(&[]);
        let a = run(
            console_rule,
            &header("console=ttyS0", 1, 256, "qemu"),
            &o,
            std::slice::from_ref(&r),
            &[],
            None,
            Some(&c),
        );
        let q = a.iter().find(|a| a.id == "quiet").expect("quiet advised");
        // The slope (4 µs per character) times the bytes, and the intercept
        // (the 50 µs per line the record spends besides) times the lines.
        let bytes: f64 = r.lines.iter().map(|l| l.text.len() as f64 + 2.0).sum();
        let lines = r.lines.len() as f64;
        assert!(
            (q.predicted_ms - (bytes * 4.0 + lines * 50.0) / 1e3).abs() < 0.5,
            "{q:?} {bytes}"
        );
        assert_eq!(
            q.change,
            Change::CmdlineAdd {
                option: "quiet".into()
            }
        );
        // Already quiet (or loglevel ≤ 4): nothing to say.
        let a = run(
            console_rule,
            &header("console=ttyS0 quiet", 1, 256, "qemu"),
            &o,
            std::slice::from_ref(&r),
            &[],
            None,
            Some(&c),
        );
        assert!(a.iter().all(|a| a.id != "quiet"));
        let a = run(
            console_rule,
            &header("console=ttyS0 loglevel=3", 1, 256, "qemu"),
            &o,
            &[r],
            &[],
            None,
            Some(&c),
        );
        assert!(a.iter().all(|a| a.id != "quiet"));
    }

    /// A console as slow as a nested guest's UART in the rig (2 ms per
    /// character): no two lines are within 2 ms of each other, yet the slope
    /// is found — and the initcalls' gaps between some lines stay out of it.
    #[test]
    fn a_very_slow_console_is_measured_not_modelled() {
        let r = chatty_at(2000.0, 3e6);
        let (q, c) = quiet_advice_at_2ms_per_char(&r);
        assert!(q.evidence.iter().any(|e| e.contains("slope")), "{q:?}");
        let seen = c.observed_per_char_us.unwrap();
        assert!((seen / 2000.0 - 1.0).abs() < 0.05, "{seen}");
    }

    /// The guest's clock standing still while the console prints (lines
    /// stamped before it ran, as a WARN splat early in a nested boot): the
    /// host's arrival times still show the cost.
    #[test]
    fn the_host_clock_measures_a_console_the_guest_clock_cannot_see() {
        let mut r = chatty_at(2000.0, 0.0);
        for l in &mut r.lines {
            let (_, rest) = l.text.split_once("] ").unwrap();
            l.text = format!("[    1.000000] {rest}");
        }
        let (q, _) = quiet_advice_at_2ms_per_char(&r);
        assert!(q.evidence.iter().any(|e| e.contains("arrival")), "{q:?}");
    }

    /// The `quiet` advice for a console measured from `r`, checked to predict
    /// 2 ms for every character printed (each line's text and its CR LF).
    fn quiet_advice_at_2ms_per_char(r: &BootRecord) -> (Advice, analysis::ConsoleCost) {
        let c = analysis::console_cost(&[r], 15.0, 60_000.0).unwrap();
        let a = run(
            console_rule,
            &header("console=ttyS0", 1, 256, "ember"),
            &opts(&[]),
            std::slice::from_ref(r),
            &[],
            None,
            Some(&c),
        );
        let q = a
            .into_iter()
            .find(|a| a.id == "quiet")
            .expect("quiet advised");
        let bytes: f64 = r.lines.iter().map(|l| l.text.len() as f64 + 2.0).sum();
        assert!(
            (q.predicted_ms / (bytes * 2.0) - 1.0).abs() < 0.01,
            "{q:?} {bytes}"
        );
        (q, c)
    }
}
