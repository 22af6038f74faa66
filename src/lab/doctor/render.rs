//! The doctor's advice as text.

use super::model::{
    Advice, AdviceReport, MIN_SAVING_MS, PROFILE_CMDLINE, Verification, VerifyClock, VerifyVerdict,
};
use std::fmt::Write;

impl AdviceReport {
    /// The advice as text.
    pub fn render(&self) -> String {
        let mut s = render(&self.advice, self.profile_boots);
        let _ = writeln!(
            s,
            "\n  initcall owners: {}; kernel config: {}",
            self.kconfig_source
                .as_deref()
                .unwrap_or("(no kernel source found)"),
            self.kernel_config.as_deref().unwrap_or("(not found)")
        );
        if let Some(c) = &self.combined {
            let _ = writeln!(
                s,
                "\n  All automatic changes together ({}): predicted −{:.1} ms; {}",
                c.changes.join(", "),
                c.predicted_ms,
                verification_text(&c.verified)
            );
        }
        s
    }
}

/// The advice as text.
pub fn render(advice: &[Advice], profile_boots: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nAdvice (ranked by predicted saving per boot; initcall figures from {profile_boots} profile \
         boot(s) with `{PROFILE_CMDLINE}`):"
    );
    if advice.is_empty() {
        let _ = writeln!(s, "  nothing found worth more than {MIN_SAVING_MS} ms");
    }
    for (n, a) in advice.iter().enumerate() {
        let _ = writeln!(
            s,
            "{:>3}. {}  — predicted −{:.1} ms",
            n + 1,
            a.title,
            a.predicted_ms
        );
        let _ = writeln!(s, "       change: {}", a.change.describe());
        for e in &a.evidence {
            let _ = writeln!(s, "       · {e}");
        }
        match &a.verified {
            Some(v) => {
                let _ = writeln!(s, "       verified: {}", verification_text(v));
            }
            None if a.change.automatic() => {}
            None => {
                let _ = writeln!(s, "       (not verified: a manual change)");
            }
        }
    }
    s
}

/// One line for a verification.
pub fn verification_text(v: &Verification) -> String {
    let verdict = match v.verdict {
        VerifyVerdict::Saves => "SAVES",
        VerifyVerdict::NoSaving => "NO SAVING SHOWN",
        VerifyVerdict::Slower => "SLOWER",
        VerifyVerdict::Broke => "BROKE THE BOOT",
        VerifyVerdict::Inconclusive => "INCONCLUSIVE",
    };
    let unit = match v.clock {
        VerifyClock::Wall => "ms",
        VerifyClock::Guest => "guest ms",
    };
    let mut text = match (&v.saving_ms, &v.without_ms, &v.with_ms) {
        (Some(i), Some(a), Some(b)) => format!(
            "{verdict}: −{:.1} {unit} (95% CI {:.1} … {:.1}) over {} pairs; {:.1} → {:.1} {unit}",
            i.estimate, i.low, i.high, v.pairs, a.mean, b.mean
        ),
        _ => format!("{verdict} ({} pairs)", v.pairs),
    };
    let lost = v.failures[0].count() + v.failures[1].count();
    if lost > 0 {
        text.push_str(&format!("; {lost} boot(s) did not count"));
    }
    text
}
