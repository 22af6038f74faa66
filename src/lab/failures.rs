//! Boots that did not count: how many timed out, panicked or never reached
//! userspace, and what the first of them printed (its panic line or last
//! console line, its first oops).

use super::analysis::{Milestones, split_printk};
use super::record::{BootRecord, is_panic_line};
use super::runner::{Verdict, verdict};
use serde::{Deserialize, Serialize};

/// Boots that did not count, per configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failures {
    /// Killed at the timeout.
    pub timed_out: usize,
    /// Their kernel panicked.
    #[serde(default)]
    pub panicked: usize,
    /// Ended without reaching userspace.
    pub no_userspace: usize,
    /// The first panicked boot's panic line (`Kernel panic - not syncing:
    /// CAUSE`): why it panicked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub panic: Option<String>,
    /// The last console line of the first boot that did not count, unless
    /// it panicked (its panic line says more): usually says where it got
    /// stuck.
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
/// Longest panic line we quote: the cause is all of it ("IO-APIC + timer
/// doesn't work!  Boot with apic=debug and send a report.  Then try booting
/// with the 'noapic' option.").
const MAX_PANIC_QUOTE: usize = 240;

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
    let mut out = Vec::new();
    let (mut rip, mut frames) = (false, None::<usize>);
    for line in lines {
        let body = split_printk(line).1;
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
    pub fn of(records: &[BootRecord], m: &Milestones) -> Failures {
        let failed = |v| records.iter().filter(|r| verdict(r, m) == v).count();
        let first_bad = records.iter().find(|r| {
            matches!(
                verdict(r, m),
                Verdict::TimedOut | Verdict::Panicked | Verdict::NoUserspace
            )
        });
        let panic_line = |r: &BootRecord| {
            let line = r.lines.iter().find(|l| is_panic_line(&l.text))?;
            let body = split_printk(&line.text).1;
            Some(
                body.trim()
                    .chars()
                    .take(MAX_PANIC_QUOTE)
                    .collect::<String>()
                    .trim_end()
                    .to_owned(),
            )
        };
        Failures {
            timed_out: failed(Verdict::TimedOut),
            panicked: failed(Verdict::Panicked),
            no_userspace: failed(Verdict::NoUserspace),
            panic: records
                .iter()
                .filter(|r| verdict(r, m) == Verdict::Panicked)
                .find_map(panic_line),
            last_line: first_bad.filter(|r| panic_line(r).is_none()).and_then(|r| {
                let line = r.lines.iter().rev().find(|l| !l.text.trim().is_empty())?;
                Some(split_printk(&line.text).1.chars().take(MAX_QUOTE).collect())
            }),
            oops: first_bad
                .map(|r| oops_excerpt(r.lines.iter().map(|l| l.text.as_str())))
                .unwrap_or_default(),
        }
    }

    /// How many boots did not count (Ctrl-C's aside).
    pub fn count(&self) -> usize {
        self.timed_out + self.panicked + self.no_userspace
    }
}

/// `line` trimmed to at most [`MAX_QUOTE`] characters.
fn quote(line: &str) -> String {
    line.trim().chars().take(MAX_QUOTE).collect()
}

/// The report's line about `f` (`None` when every boot counted), after
/// `label`. `timeout_s`: the timeout the boots ran under, when known (not
/// for a recording loaded from a file, which does not keep it).
pub fn failures_line(label: &str, f: &Failures, timeout_s: Option<f64>) -> Option<String> {
    let mut parts = Vec::new();
    match (f.timed_out, timeout_s) {
        (0, _) => {}
        (n, Some(t)) => parts.push(format!("{n} timed out after {t} s")),
        (n, None) => parts.push(format!("{n} timed out")),
    }
    match (f.panicked, &f.panic) {
        (0, _) => {}
        (1, Some(line)) => parts.push(format!("1 panicked: `{line}`")),
        (n, Some(line)) => parts.push(format!("{n} panicked (the first: `{line}`)")),
        (n, None) => parts.push(format!("{n} panicked")),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_spelled_out() {
        let f = Failures {
            timed_out: 2,
            no_userspace: 1,
            ..Failures::default()
        };
        assert_eq!(
            failures_line("A", &f, Some(5.0)).unwrap(),
            "A: boot(s) not averaged in: 2 timed out after 5 s, 1 ended without reaching userspace"
        );
        let f = Failures {
            panicked: 2,
            panic: Some("Kernel panic - not syncing: No working init found.".into()),
            ..Failures::default()
        };
        assert_eq!(
            failures_line("", &f, Some(5.0)).unwrap(),
            "boot(s) not averaged in: 2 panicked (the first: \
             `Kernel panic - not syncing: No working init found.`)"
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

    /// A panic is told by its panic line, whether the lab ended the boot at
    /// it or the kernel's reboot (`panic=-1`) ended the VMM first, and even
    /// after userspace; a boot that merely timed out keeps its last line.
    #[test]
    fn panics_are_counted_with_their_cause() {
        use crate::lab::record::Outcome;
        let m = Milestones::default();
        let after_init = BootRecord::from_lines(
            &[
                (1.0, "[    0.100000] Run /init as init process"),
                (
                    2.0,
                    "[    0.200000] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100",
                ),
                (
                    3.0,
                    "[    0.200001] CPU: 0 PID: 1 Comm: init Not tainted 6.1.0 #1",
                ),
            ],
            4.0,
        );
        let mut ended_by_us = BootRecord::from_lines(
            &[(
                1.0,
                "[    0.300000] Kernel panic - not syncing: VFS: Unable to mount root fs",
            )],
            2.0,
        );
        ended_by_us.outcome = Outcome::Panicked;
        let mut hung = BootRecord::from_lines(&[(1.0, "[    0.100000] Linux version 6.1")], 2.0);
        hung.outcome = Outcome::TimedOut;
        let f = Failures::of(&[hung.clone(), after_init, ended_by_us], &m);
        assert_eq!((f.timed_out, f.panicked, f.no_userspace), (1, 2, 0));
        assert_eq!(f.count(), 3);
        assert_eq!(
            f.panic.as_deref(),
            Some("Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100")
        );
        assert_eq!(f.last_line.as_deref(), Some("Linux version 6.1"));
        let f = Failures::of(&[hung.clone()], &m);
        assert_eq!((f.panicked, f.panic.as_deref()), (0, None));
        let mut panicked_first = BootRecord::from_lines(
            &[(
                1.0,
                "[    0.300000] Kernel panic - not syncing: VFS: Unable to mount root fs",
            )],
            2.0,
        );
        panicked_first.outcome = Outcome::Panicked;
        let f = Failures::of(&[panicked_first, hung], &m);
        assert_eq!(f.last_line, None, "its panic line says more");
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
