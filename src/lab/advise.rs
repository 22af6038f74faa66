//! The boot doctor (`ember analyze --advise`): Jones's method — measure the
//! boot, find what costs most, change one thing, measure again — turned
//! into rules over the lab's timeline. Each rule reads the analysed boots
//! (and a *profile* boot with `initcall_debug ignore_loglevel`, whose
//! initcall durations the kernel measures itself), and proposes a concrete
//! change with its evidence and a saving predicted from those figures.
//! `--verify` then boots with each change applied, A/B interleaved
//! ([`verify`]), and reports the measured saving with its interval.

use super::activities::ActivityDef;
use super::analysis::{self, ActivityStats, ConsoleCost, split_printk};
use super::config::{GuestOpts, Header};
use super::kconfig::KconfigMap;
use super::record::BootRecord;
use super::stats::{self, Interval, Summary};
use crate::backend::qemu::QBOOT;
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What `--advise` appends to the command line of its profile boots: every
/// initcall reports its own duration, every message reaches the console,
/// the APIC code says when it calibrates its timer, and every work item
/// the kernel runs in the background says when it starts and ends (about a
/// hundred lines: boot work an initcall queues is invisible to
/// `initcall_debug`).
pub const PROFILE_CMDLINE: &str = "initcall_debug ignore_loglevel apic=verbose \
     trace_event=workqueue:workqueue_execute_start,workqueue:workqueue_execute_end tp_printk";

/// Suggestions predicted to save less than this are not listed.
const MIN_SAVING_MS: f64 = 0.5;
/// Initcall owners listed as Kconfig advice, at most.
const MAX_KCONFIG: usize = 8;
/// An owner's initcalls must take at least this share of all initcall time
/// to be worth a custom kernel (Jones cut everything above 1 ms of ~700 ms).
const KCONFIG_MIN_SHARE: f64 = 0.01;

/// One concrete change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Change {
    /// Add this option to the kernel command line.
    CmdlineAdd {
        /// The option.
        option: String,
    },
    /// Boot with this many vCPUs (`--cpus`).
    Cpus {
        /// vCPUs.
        cpus: u32,
    },
    /// Boot with this much memory (`--mem`, MiB).
    Mem {
        /// MiB.
        mib: u64,
    },
    /// QEMU backend: boot through this firmware (`--bios`).
    Bios {
        /// The firmware image.
        path: String,
    },
    /// Build the kernel without this config symbol.
    KconfigOff {
        /// `CONFIG_…`.
        symbol: String,
    },
    /// Change the guest's init or initramfs (by hand).
    Guest {
        /// What to do.
        what: String,
    },
}

impl Change {
    /// Whether `--verify` can apply it by itself.
    pub fn automatic(&self) -> bool {
        matches!(
            self,
            Change::CmdlineAdd { .. }
                | Change::Cpus { .. }
                | Change::Mem { .. }
                | Change::Bios { .. }
        )
    }

    /// The change as the user would make it.
    pub fn describe(&self) -> String {
        match self {
            Change::CmdlineAdd { option } => format!("kernel command line += {option}"),
            Change::Cpus { cpus } => format!("--cpus {cpus}"),
            Change::Mem { mib } => format!("--mem {mib}M"),
            Change::Bios { path } => format!("--bios {path} (QEMU -bios)"),
            Change::KconfigOff { symbol } => format!("kernel config: {symbol}=n"),
            Change::Guest { what } => what.clone(),
        }
    }

    /// Applies an automatic change to `opts`; false for a manual one.
    pub fn apply(&self, opts: &mut GuestOpts) -> bool {
        match self {
            Change::CmdlineAdd { option } => {
                opts.cmdline.push(' ');
                opts.cmdline.push_str(option);
            }
            Change::Cpus { cpus } => opts.cpus = *cpus,
            Change::Mem { mib } => opts.mem = *mib,
            Change::Bios { path } => opts.bios = Some(PathBuf::from(path)),
            _ => return false,
        }
        true
    }
}

/// One suggestion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advice {
    /// Stable identifier (`quiet`, `cryptomgr.notests`, `kconfig:CONFIG_X`…).
    pub id: String,
    /// What and why, in one line.
    pub title: String,
    /// The activities and console lines behind it.
    pub evidence: Vec<String>,
    /// Saving predicted from this analysis, ms per boot.
    pub predicted_ms: f64,
    /// The change to make.
    pub change: Change,
    /// `--verify`'s measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<Verification>,
}

/// What `--verify` times of each boot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyClock {
    /// Spawn to exit, on the host's clock.
    #[default]
    Wall,
    /// The guest kernel's clock at its last console line: under `--icount`
    /// it counts the guest's instructions (1 ns each), whatever the host's
    /// load. Not for a firmware change (the firmware runs before the
    /// kernel's clock starts).
    Guest,
}

impl VerifyClock {
    /// The clock for `change`: the guest's where it counts instructions
    /// (`icount`) and sees the change.
    pub fn for_change(icount: bool, change: &Change) -> Self {
        if icount && !matches!(change, Change::Bios { .. }) {
            VerifyClock::Guest
        } else {
            VerifyClock::Wall
        }
    }

    /// This clock's reading of a boot, ms.
    pub fn of(self, r: &BootRecord) -> Option<f64> {
        match self {
            VerifyClock::Wall => Some(r.exit_us / 1e3),
            VerifyClock::Guest => guest_end_ms(r),
        }
    }
}

/// The guest kernel's clock at its last timestamped console line, ms.
pub fn guest_end_ms(r: &BootRecord) -> Option<f64> {
    r.lines
        .iter()
        .filter_map(|l| split_printk(&l.text).0)
        .reduce(f64::max)
        .map(|us| us / 1e3)
}

/// What `--verify` measured for one suggestion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    /// Pairs booted (A without, B with the change), interleaved.
    pub pairs: usize,
    /// What was timed.
    #[serde(default)]
    pub clock: VerifyClock,
    /// A's time, ms (spawn to exit, or the guest's clock).
    pub without_ms: Option<Summary>,
    /// B's time, ms.
    pub with_ms: Option<Summary>,
    /// Saving A − B per pair, mean with its 95 % t-interval, ms.
    pub saving_ms: Option<Interval>,
    /// The outcome.
    pub verdict: VerifyVerdict,
    /// Boots that did not count, without and with the change (a pair
    /// counts only when both of its boots do).
    #[serde(default)]
    pub failures: [super::failures::Failures; 2],
}

/// Whether a suggestion paid off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyVerdict {
    /// The interval lies above zero.
    Saves,
    /// The interval contains zero: no saving shown.
    NoSaving,
    /// The interval lies below zero: it made the boot slower.
    Slower,
    /// Boots with the change did not reach userspace.
    Broke,
    /// Too few pairs counted for an interval.
    Inconclusive,
}

impl VerifyVerdict {
    /// From the paired savings.
    pub fn of(saving: Option<&Interval>) -> Self {
        match saving {
            None => VerifyVerdict::Inconclusive,
            Some(i) if i.low > 0.0 => VerifyVerdict::Saves,
            Some(i) if i.high < 0.0 => VerifyVerdict::Slower,
            Some(_) => VerifyVerdict::NoSaving,
        }
    }
}

/// An initcall's duration as the kernel measured it (`initcall_debug`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitcallTime {
    /// The function.
    pub name: String,
    /// Its module, for a module's init.
    pub module: Option<String>,
    /// Mean over the profile boots, ms.
    pub ms: f64,
}

/// Everything the rules read.
pub struct Inputs<'a> {
    /// What was booted.
    pub header: &'a Header,
    /// The options it was booted with (machine, firmware…).
    pub opts: &'a GuestOpts,
    /// The counted boots of the configuration as given.
    pub boots: &'a [&'a BootRecord],
    /// Counted profile boots (`PROFILE_CMDLINE` added), if any.
    pub profile: &'a [&'a BootRecord],
    /// The activities of `boots`.
    pub activities: &'a [ActivityStats],
    /// The console's cost.
    pub console: Option<&'a ConsoleCost>,
    /// Mean spawn-to-exit of `boots`, ms.
    pub total_ms: f64,
    /// initcall → config symbol map, when the kernel source was found.
    pub kmap: Option<&'a KconfigMap>,
    /// The kernel's `CONFIG_…=y` symbols, when its config was found.
    pub builtin: Option<&'a BTreeSet<String>>,
}

/// Whether the command line has `opt` (as a word, or `opt=…`).
fn has_option(cmdline: &str, opt: &str) -> bool {
    cmdline
        .split_whitespace()
        .any(|w| w == opt || w.split_once('=').is_some_and(|(k, _)| k == opt))
}

/// The value of `key=` on the command line (the last one counts).
fn option_value<'c>(cmdline: &'c str, key: &str) -> Option<&'c str> {
    cmdline
        .split_whitespace()
        .filter_map(|w| w.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
        .next_back()
}

/// Kernel-measured initcall durations, mean over `boots` (each boot's
/// repeats of one name summed), longest first.
pub fn initcalls(boots: &[&BootRecord]) -> Vec<InitcallTime> {
    static RET: OnceLock<Regex> = OnceLock::new();
    let ret = RET.get_or_init(|| {
        Regex::new(
            r"^initcall (?P<name>[^+ ]+)\+0x[0-9a-f]+/0x[0-9a-f]+(?: \[(?P<module>[^\]]+)\])? returned -?\d+ after (?P<us>\d+) usecs",
        )
        .unwrap()
    });
    let mut sums: BTreeMap<(String, Option<String>), f64> = BTreeMap::new();
    for r in boots {
        for l in &r.lines {
            let (_, body) = split_printk(&l.text);
            if let Some(c) = ret.captures(&body) {
                let us: f64 = c["us"].parse().unwrap_or(0.0);
                let key = (
                    c["name"].to_owned(),
                    c.name("module").map(|m| m.as_str().to_owned()),
                );
                *sums.entry(key).or_default() += us / 1e3;
            }
        }
    }
    let n = boots.len().max(1) as f64;
    let mut out: Vec<InitcallTime> = sums
        .into_iter()
        .map(|((name, module), ms)| InitcallTime {
            name,
            module,
            ms: ms / n,
        })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    out
}

/// Mean length (ms) of the span `start` → `end` over the boots where it
/// occurs, and in how many it did.
fn span_ms(boots: &[&BootRecord], start: &str, end: &str) -> Option<(f64, usize)> {
    let def = ActivityDef::new("span", start, end, None).expect("span regexes compile");
    let lens: Vec<f64> = boots
        .iter()
        .filter_map(|r| {
            analysis::activities(&analysis::timeline(r), std::slice::from_ref(&def))
                .first()
                .map(|a| (a.end_us - a.start_us) / 1e3)
        })
        .collect();
    (!lens.is_empty()).then(|| (stats::mean(&lens), lens.len()))
}

/// The span measured in the boots as given, else in the profile boots.
fn span_either(i: &Inputs<'_>, start: &str, end: &str) -> Option<(f64, &'static str)> {
    span_ms(i.boots, start, end)
        .map(|(ms, _)| (ms, "measured in the analysed boots"))
        .or_else(|| {
            span_ms(i.profile, start, end).map(|(ms, _)| (ms, "measured in the profile boot"))
        })
}

/// Mean span (ms) from the first line matching `start` to the next matching
/// `end`, over the boots that have both, on the clock `at` reads off a line
/// (µs; `None` where it has no reading).
fn span_on(
    boots: &[&BootRecord],
    start: &str,
    end: &str,
    at: impl Fn(&super::record::ConsoleLine) -> Option<f64>,
) -> Option<f64> {
    let (start, end) = (Regex::new(start).ok()?, Regex::new(end).ok()?);
    let lens: Vec<f64> = boots
        .iter()
        .filter_map(|r| {
            let body = |l: &super::record::ConsoleLine| split_printk(&l.text).1;
            let s = r.lines.iter().position(|l| start.is_match(&body(l)))?;
            let e = r.lines[s..].iter().find(|l| end.is_match(&body(l)))?;
            let t0 = at(&r.lines[s])?;
            Some((at(e)? - t0) / 1e3)
        })
        .collect();
    (!lens.is_empty()).then(|| stats::mean(&lens))
}

/// [`span_on`] the host's clock: arrival times.
fn host_span(boots: &[&BootRecord], start: &str, end: &str) -> Option<f64> {
    span_on(boots, start, end, |l| Some(l.t_us))
}

/// [`span_on`] the kernel's own clock (its printk stamps), once it runs
/// (a line stamped 0 is not a reading) — the clock `--icount` makes count
/// instructions, where arrival times stretch with TCG's.
fn kernel_span(boots: &[&BootRecord], start: &str, end: &str) -> Option<f64> {
    span_on(boots, start, end, |l| {
        split_printk(&l.text).0.filter(|t| *t > 0.0)
    })
}

/// First console line (printk prefix stripped) matching `re` in any boot.
fn first_line(boots: &[&BootRecord], re: &str) -> Option<String> {
    let re = Regex::new(re).ok()?;
    boots.iter().flat_map(|r| &r.lines).find_map(|l| {
        let body = split_printk(&l.text).1;
        re.is_match(&body).then_some(body)
    })
}

/// Runs every rule; the suggestions, largest predicted saving first.
pub fn advise(i: &Inputs<'_>) -> Vec<Advice> {
    let calls = initcalls(i.profile);
    let mut out = Vec::new();
    out.extend(console_rule(i));
    out.extend(crypto_rule(i, &calls));
    out.extend(smp_rules(i));
    out.extend(apic_timer_rule(i));
    out.extend(ftrace_check_rule(i));
    out.extend(firmware_rule(i));
    out.extend(probe_rules(i, &calls));
    out.extend(initramfs_rule(i, &calls));
    out.extend(userspace_rule(i));
    out.extend(memory_rule(i));
    out.extend(kconfig_rules(i, &calls));
    out.retain(|a| a.predicted_ms >= MIN_SAVING_MS);
    out.sort_by(|a, b| b.predicted_ms.total_cmp(&a.predicted_ms));
    out
}

/// Console output volume × the per-character cost seen in this very boot.
fn console_rule(i: &Inputs<'_>) -> Option<Advice> {
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

/// Is this initcall part of the crypto subsystem? By its source file when
/// the map knows it, else by its name.
fn is_crypto(c: &InitcallTime, kmap: Option<&KconfigMap>) -> bool {
    match kmap.and_then(|m| m.owner(&c.name)) {
        Some(o) => o.file.starts_with("crypto/") || o.file.starts_with("arch/x86/crypto/"),
        None => c.name.contains("crypto") || c.name.starts_with("alg"),
    }
}

/// Crypto self-tests → `cryptomgr.notests`.
fn crypto_rule(i: &Inputs<'_>, calls: &[InitcallTime]) -> Option<Advice> {
    if has_option(&i.header.cmdline, "cryptomgr.notests") {
        return None;
    }
    let crypto: Vec<&InitcallTime> = calls.iter().filter(|c| is_crypto(c, i.kmap)).collect();
    if crypto.is_empty() {
        return None;
    }
    let total: f64 = crypto.iter().map(|c| c.ms).sum();
    let mut evidence = vec![format!(
        "{} crypto initcalls take {total:.1} ms in the profile boot (kernel-measured, initcall_debug); \
         the algorithm self-tests run in them, and crypto_algapi_init waits for the ones run by cryptomgr",
        crypto.len()
    )];
    evidence.extend(crypto.iter().take(5).map(|c| initcall_line(c, i.kmap)));
    Some(Advice {
        id: "cryptomgr.notests".into(),
        title: "Skip the crypto algorithm self-tests at boot".into(),
        evidence,
        predicted_ms: total,
        change: Change::CmdlineAdd {
            option: "cryptomgr.notests".into(),
        },
        verified: None,
    })
}

fn initcall_line(c: &InitcallTime, kmap: Option<&KconfigMap>) -> String {
    let module = c
        .module
        .as_ref()
        .map_or(String::new(), |m| format!(" [{m}]"));
    match kmap.and_then(|m| m.owner(&c.name)) {
        Some(o) => format!(
            "initcall {}{module}: {:.2} ms ({}{}{})",
            c.name,
            c.ms,
            o.file,
            if o.symbols.is_empty() { "" } else { ", " },
            o.symbols.first().map_or("", String::as_str)
        ),
        None => format!("initcall {}{module}: {:.2} ms", c.name, c.ms),
    }
}

/// Secondary vCPUs: the per-AP TSC check and the rest of SMP bring-up.
fn smp_rules(i: &Inputs<'_>) -> Vec<Advice> {
    let cpus = i.header.cpus;
    if cpus <= 1 {
        return Vec::new();
    }
    let Some((smp_ms, source)) = span_either(
        i,
        r"^smp: Bringing up secondary CPUs",
        r"^smp: Brought up \d+ node",
    ) else {
        return Vec::new();
    };
    let brought = first_line(i.boots, r"^smp: Brought up")
        .or_else(|| first_line(i.profile, r"^smp: Brought up"))
        .unwrap_or_default();
    let tsc_line = first_line(i.profile, r"[Tt][Ss][Cc].*([Ss]ync|unstable|skipped)")
        .or_else(|| first_line(i.boots, r"[Tt][Ss][Cc].*([Ss]ync|unstable|skipped)"));
    let mut evidence = vec![format!(
        "SMP bring-up of {} secondary vCPU(s): {smp_ms:.1} ms ({source}): `{brought}`",
        cpus - 1
    )];
    evidence.extend(tsc_line.map(|l| format!("`{l}`")));
    let mut out = Vec::new();
    if !has_option(&i.header.cmdline, "tsc.reliable")
        && option_value(&i.header.cmdline, "tsc") != Some("reliable")
    {
        out.push(Advice {
            id: "tsc.reliable".into(),
            title:
                "Skip the TSC synchronisation check on each secondary vCPU (check_tsc_sync_target)"
                    .into(),
            evidence: evidence.clone(),
            // An upper bound: the check is part of each AP's bring-up.
            predicted_ms: smp_ms / 2.0,
            change: Change::CmdlineAdd {
                option: "tsc.reliable=1".into(),
            },
            verified: None,
        });
    }
    let mut e = evidence;
    e.push(
        "more vCPUs also slow what runs between them (locks, IPIs, RCU) — Jones: 1 → 4 vCPUs cost > 200 ms"
            .into(),
    );
    out.push(Advice {
        id: "cpus-1".into(),
        title: "Boot with one vCPU unless the workload needs more".into(),
        evidence: e,
        predicted_ms: smp_ms,
        change: Change::Cpus { cpus: 1 },
        verified: None,
    });
    out
}

/// The local APIC timer's calibration. Without a TSC-deadline timer (TCG
/// has none) and without its frequency from the hypervisor, Linux counts the
/// APIC timer against HZ/10 ticks of the PIT or HPET before it starts the
/// first CPU's tick: a fixed wait of the guest's clock, whatever the VM
/// does. With one vCPU the HPET or PIT can drive the tick alone; with more,
/// every CPU's timer would become a broadcast from one device, so the rule
/// says nothing there.
fn apic_timer_rule(i: &Inputs<'_>) -> Option<Advice> {
    let cmdline = &i.header.cmdline;
    if i.header.cpus != 1
        || ["nolapic_timer", "noapictimer", "nolapic", "disableapic"]
            .iter()
            .any(|o| has_option(cmdline, o))
    {
        return None;
    }
    let (start, end) = (r"^calibrating APIC timer", r"^\.\.\. lapic delta");
    let (ms, source) = kernel_span(i.boots, start, end)
        .map(|ms| (ms, "the kernel's clock, in the analysed boots"))
        .or_else(|| {
            kernel_span(i.profile, start, end)
                .map(|ms| (ms, "the kernel's clock, in the profile boot"))
        })
        .or_else(|| span_either(i, start, end))?;
    Some(Advice {
        id: "nolapic_timer".into(),
        title: "Do not calibrate the local APIC timer: one vCPU can take its tick from the HPET"
            .into(),
        evidence: vec![format!(
            "`calibrating APIC timer ...` to `... lapic delta`: {ms:.1} ms ({source}, `apic=verbose`); \
             the VM offers no TSC-deadline timer and no APIC timer frequency"
        )],
        predicted_ms: ms,
        change: Change::CmdlineAdd {
            option: "nolapic_timer".into(),
        },
        verified: None,
    })
}

/// The initcall that queues ftrace's call-site check, as
/// `initcall_blacklist=` names it.
const FTRACE_CHECK_INITCALL: &str = "ftrace_check_for_weak_functions";

/// ftrace's check of its call sites (Linux 6.1 on x86 with fentry, as
/// Debian builds it): a subsys initcall
/// queues work that looks up the symbol of every traceable function (the
/// `ftrace: allocating N entries` line) to disable the sites of overridden
/// weak functions. Nothing waits for it until late in the boot, so
/// `initcall_debug` cannot see it; with one vCPU it competes with every
/// initcall after it. Skipping it loses nothing unless the guest enables
/// function tracing, and then ftrace verifies each site before patching it
/// and stops with a warning on one that is not a call. (Any
/// `initcall_blacklist=` makes the kernel look up every initcall's name, 3.4
/// ms under `-icount`: inside the measured saving, not the prediction.)
fn ftrace_check_rule(i: &Inputs<'_>) -> Option<Advice> {
    // Every `initcall_blacklist=` word counts: the kernel takes them all.
    if i.header
        .cmdline
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("initcall_blacklist="))
        .any(|v| v.split(',').any(|f| f == FTRACE_CHECK_INITCALL))
    {
        return None;
    }
    let (start, end) = (
        r"^workqueue_execute_start: .*function ftrace_check_work_func",
        r"^workqueue_execute_end: .*function ftrace_check_work_func",
    );
    let ms = kernel_span(i.profile, start, end).filter(|ms| *ms > 0.0)?;
    let mut evidence = vec![format!(
        "its work item ran {ms:.1} ms (the kernel's clock, profile boot, `tp_printk` workqueue events)"
    )];
    evidence.extend(
        first_line(i.profile, r"^ftrace: allocating \d+ entries")
            .map(|l| format!("`{l}`: one symbol lookup each")),
    );
    Some(Advice {
        id: "ftrace-check".into(),
        title:
            "Skip ftrace's boot-time check of every call site (it only matters to function tracing)"
                .into(),
        evidence,
        predicted_ms: ms,
        change: Change::CmdlineAdd {
            option: format!("initcall_blacklist={FTRACE_CHECK_INITCALL}"),
        },
        verified: None,
    })
}

/// QEMU machines with SeaBIOS: the firmware's own time, from its debug log.
fn firmware_rule(i: &Inputs<'_>) -> Option<Advice> {
    if i.header.backend != "qemu" || i.opts.machine.starts_with("microvm") || i.opts.bios.is_some()
    {
        return None;
    }
    let (ms, source) = span_either(i, r"^SeaBIOS \(version", r"^Booting from ")?;
    let mut evidence = vec![format!(
        "SeaBIOS from its first line to `Booting from …`: {ms:.1} ms ({source}, its debug port on the console)"
    )];
    if let Some(l) = first_line(i.boots, r"^Found \d+ PCI devices") {
        evidence.push(format!(
            "it probes PCI for boot devices it will not use: `{l}`"
        ));
    }
    if let Some(l) = first_line(i.boots, r"^sercon: using") {
        evidence.push(format!(
            "and mirrors its screen to the serial port (Jones's SGABIOS finding): `{l}`"
        ));
    }
    let path = if Path::new(QBOOT).is_file() {
        QBOOT.to_owned()
    } else {
        evidence.push(format!("{QBOOT} is not installed: use -M microvm instead"));
        QBOOT.to_owned()
    };
    Some(Advice {
        id: "qboot".into(),
        title: "Boot through qboot instead of SeaBIOS: -kernel needs no boot-device search".into(),
        evidence,
        predicted_ms: ms,
        change: Change::Bios { path },
        verified: None,
    })
}

/// Probing hardware the VM does not have, where a kernel option stops it.
fn probe_rules(i: &Inputs<'_>, calls: &[InitcallTime]) -> Vec<Advice> {
    let mut out = Vec::new();
    // The 8250 driver registers CONFIG_SERIAL_8250_RUNTIME_UARTS ports
    // (Debian: 4) and probes each; the VM has one.
    if !has_option(&i.header.cmdline, "8250.nr_uarts")
        && let Some(c) = calls.iter().find(|c| c.name == "serial8250_init")
    {
        let ports = i
            .profile
            .iter()
            .flat_map(|r| &r.lines)
            .filter(|l| {
                let body = split_printk(&l.text).1;
                body.contains("ttyS") && body.contains(" at I/O ")
            })
            .count()
            / i.profile.len().max(1);
        let mut evidence = vec![initcall_line(c, i.kmap)];
        evidence.push(format!(
            "{ports} UART(s) found; the driver probes every port it is configured for (Jones: 25 ms)"
        ));
        out.push(Advice {
            id: "8250.nr_uarts".into(),
            title: "Register only the UARTs the VM has".into(),
            evidence,
            // Probing the missing ports, not the driver's registration.
            predicted_ms: c.ms * 0.5,
            change: Change::CmdlineAdd {
                option: format!("8250.nr_uarts={}", ports.max(1)),
            },
            verified: None,
        });
    }
    out
}

/// The initramfs: its size, compression, and the modules in it.
fn initramfs_rule(i: &Inputs<'_>, calls: &[InitcallTime]) -> Vec<Advice> {
    let Some(path) = i.header.initrd.as_deref() else {
        return Vec::new();
    };
    let Ok(data) = std::fs::read(path) else {
        return Vec::new();
    };
    let unpack = span_either(
        i,
        r"^Trying to unpack rootfs image",
        r"^Freeing initrd memory",
    )
    .map(|(ms, _)| ms)
    .or_else(|| {
        calls
            .iter()
            .find(|c| c.name == "populate_rootfs")
            .map(|c| c.ms)
    })
    .unwrap_or(0.0);
    let info = inspect_initramfs(&data);
    let mut out = Vec::new();
    let mb = data.len() as f64 / (1 << 20) as f64;
    if let Some(comp) = info.compression {
        out.push(Advice {
            id: "initramfs-uncompressed".into(),
            title: "Ship the initramfs uncompressed: the VMM copies it in at memory speed, the guest decompresses it at CPU speed".into(),
            evidence: vec![
                format!("{path}: {mb:.1} MiB, {comp}-compressed"),
                format!("unpacking it: {unpack:.1} ms"),
            ],
            // Decompression dominates the unpack of a compressed archive.
            predicted_ms: unpack * 0.5,
            change: Change::Guest {
                what: format!("build the initramfs without compression (cpio only) instead of {comp}"),
            },
            verified: None,
        });
    }
    if info.compressed_modules > 0 {
        out.push(Advice {
            id: "modules-uncompressed".into(),
            title: "Carry kernel modules uncompressed (.ko, not .ko.xz/.ko.zst)".into(),
            evidence: vec![format!(
                "{} compressed module(s) in {path}: the kernel decompresses each as it loads",
                info.compressed_modules
            )],
            predicted_ms: calls
                .iter()
                .filter(|c| c.module.is_some())
                .map(|c| c.ms)
                .sum::<f64>()
                * 0.1,
            change: Change::Guest {
                what: "decompress the modules when building the initramfs".into(),
            },
            verified: None,
        });
    }
    if info.debug_module_bytes > 0 {
        let share = info.debug_module_bytes as f64 / data.len().max(1) as f64;
        out.push(Advice {
            id: "modules-strip".into(),
            title: "Strip debug info from the modules (strip -g)".into(),
            evidence: vec![format!(
                "{} KiB of modules with debug info ({:.0}% of the initramfs)",
                info.debug_module_bytes / 1024,
                share * 100.0
            )],
            predicted_ms: unpack * share * 0.5,
            change: Change::Guest {
                what: "strip -g the .ko files in the initramfs".into(),
            },
            verified: None,
        });
    }
    out
}

/// What an initramfs holds.
#[derive(Debug, Default, PartialEq)]
pub struct InitramfsInfo {
    /// `gzip`, `xz`, `zstd`, `lz4`, `bzip2` or `lzma` for a compressed archive.
    pub compression: Option<&'static str>,
    /// `.ko.xz`/`.ko.zst`/`.ko.gz` members.
    pub compressed_modules: usize,
    /// Bytes of `.ko` members that carry `.debug_info`.
    pub debug_module_bytes: u64,
}

/// Looks into a (newc) initramfs.
pub fn inspect_initramfs(data: &[u8]) -> InitramfsInfo {
    const MAGICS: &[(&[u8], &str)] = &[
        (&[0x1f, 0x8b], "gzip"),
        (&[0xfd, b'7', b'z', b'X', b'Z'], "xz"),
        (&[0x28, 0xb5, 0x2f, 0xfd], "zstd"),
        (&[0x02, 0x21, 0x4c, 0x18], "lz4"),
        (b"BZh", "bzip2"),
        (&[0x5d, 0x00, 0x00], "lzma"),
    ];
    let mut info = InitramfsInfo {
        compression: MAGICS
            .iter()
            .find(|(m, _)| data.starts_with(m))
            .map(|(_, n)| *n),
        ..Default::default()
    };
    if info.compression.is_some() {
        return info;
    }
    // newc: "070701", 13 8-digit hex fields, name, padding to 4, data, padding.
    let mut off = 0usize;
    let hex = |b: &[u8]| {
        std::str::from_utf8(b)
            .ok()
            .and_then(|s| usize::from_str_radix(s, 16).ok())
    };
    while off + 110 <= data.len() && &data[off..off + 6] == b"070701" {
        let h = &data[off..off + 110];
        let (Some(size), Some(namesize)) = (hex(&h[54..62]), hex(&h[94..102])) else {
            break;
        };
        let name_start = off + 110;
        let Some(name) = data.get(name_start..name_start + namesize.saturating_sub(1)) else {
            break;
        };
        let body_start = (name_start + namesize + 3) & !3;
        let Some(body) = data.get(body_start..body_start + size) else {
            break;
        };
        let name = String::from_utf8_lossy(name);
        if name == "TRAILER!!!" {
            break;
        }
        if [".ko.xz", ".ko.zst", ".ko.gz"]
            .iter()
            .any(|s| name.ends_with(s))
        {
            info.compressed_modules += 1;
        } else if name.ends_with(".ko") && body.windows(12).any(|w| w == b".debug_info\0") {
            info.debug_module_bytes += size as u64;
        }
        off = (body_start + size + 3) & !3;
    }
    info
}

/// Userspace steps Jones found slow: udev settle, hwclock, ldconfig.
fn userspace_rule(i: &Inputs<'_>) -> Vec<Advice> {
    const STEPS: &[(&str, &str, &str)] = &[
        (
            "udev",
            r"udevadm settle|systemd-udevd|[Ss]tarting udev",
            "do not wait for udev: create the few device nodes the appliance needs (devtmpfs has them)",
        ),
        (
            "hwclock",
            r"\bhwclock\b",
            "do not run hwclock: the kernel reads the RTC itself",
        ),
        (
            "ldconfig",
            r"\bldconfig\b",
            "do not run ldconfig at boot: ship /etc/ld.so.cache in the image",
        ),
    ];
    let mut out = Vec::new();
    for (name, re, fix) in STEPS {
        // The step runs from its line to the next line (any kind).
        let Ok(re) = Regex::new(re) else { continue };
        let lens: Vec<f64> = i
            .boots
            .iter()
            .filter_map(|r| {
                let tl = analysis::timeline(r);
                let pos = tl.iter().position(|e| re.is_match(&e.text))?;
                let next = tl.get(pos + 1)?;
                Some((next.t_us - tl[pos].t_us) / 1e3)
            })
            .collect();
        if lens.is_empty() {
            continue;
        }
        let line = first_line(i.boots, re.as_str()).unwrap_or_default();
        out.push(Advice {
            id: format!("userspace:{name}"),
            title: format!("Drop {name} from the guest's start-up"),
            evidence: vec![format!(
                "`{line}` until the next line: {:.1} ms",
                stats::mean(&lens)
            )],
            predicted_ms: stats::mean(&lens),
            change: Change::Guest {
                what: (*fix).to_owned(),
            },
            verified: None,
        });
    }
    out
}

/// Kernel work that grows with guest memory: the memory map's struct pages
/// are initialised and every free page handed to the allocator.
fn memory_rule(i: &Inputs<'_>) -> Option<Advice> {
    let mem = i.header.mem_mib;
    if mem < 256 {
        return None;
    }
    static MEM: OnceLock<Regex> = OnceLock::new();
    let re = MEM.get_or_init(|| Regex::new(r"^Memory: (\d+)K/(\d+)K available").unwrap());
    // On the kernel's clock where it runs by then (a TSC it can read early:
    // TCG, or KVM with kvm-clock): only the work that grows with memory.
    // Else on arrival (the host's clock), zones → `Memory:`, which is real
    // only where the console is already up (lines buffered until it is
    // arrive together) and holds fixed work too.
    let (zones, memory) = (r"^Zone ranges:", r"^Memory: \d+K/\d+K available");
    let guest = |boots: &[&BootRecord]| {
        let spans: Vec<f64> = boots.iter().filter_map(|r| memory_work_ms(r)).collect();
        (!spans.is_empty()).then(|| stats::mean(&spans))
    };
    let (ms, source) = guest(i.boots)
        .map(|ms| (ms, "the kernel's clock, in the analysed boots"))
        .or_else(|| guest(i.profile).map(|ms| (ms, "the kernel's clock, in the profile boot")))
        .map(|(ms, s)| {
            (
                ms,
                format!("page structures set up, then every page freed to the allocator: {s}"),
            )
        })
        .or_else(|| {
            host_span(i.boots, zones, memory).map(|ms| {
                (
                    ms,
                    "zones → `Memory:`, arrival times in the analysed boots".to_owned(),
                )
            })
        })
        .or_else(|| {
            host_span(i.profile, zones, memory).map(|ms| {
                (
                    ms,
                    "zones → `Memory:`, arrival times in the profile boot".to_owned(),
                )
            })
        })
        .filter(|(ms, _)| *ms > 0.0)?;
    let line = first_line(i.boots, re.as_str()).or_else(|| first_line(i.profile, re.as_str()))?;
    let to = (mem / 2).max(128);
    let deferred = first_line(i.profile, r"deferred pages initialised in \d+ms");
    let mut evidence = vec![
        format!("memory-size-dependent kernel work: {ms:.1} ms for {mem} MiB ({source})"),
        format!("`{line}`"),
    ];
    evidence.extend(deferred.map(|l| format!("`{l}`")));
    Some(Advice {
        id: "mem".into(),
        title: format!("Give the guest {to} MiB instead of {mem} MiB if its workload fits"),
        evidence,
        // That span grows with memory; the share it loses scales with it.
        predicted_ms: ms * (1.0 - to as f64 / mem as f64),
        change: Change::Mem { mib: to },
        verified: None,
    })
}

/// The kernel's work that grows with guest memory, on its own clock (ms):
/// initialising the page structures (`Initmem setup node` to the first line
/// after its `… pages in unavailable ranges` reports) and freeing every page
/// to the allocator (the gap just before `Memory: …K/…K available`). `None`
/// where those lines are missing or not yet timestamped.
fn memory_work_ms(r: &BootRecord) -> Option<f64> {
    let lines: Vec<(f64, String)> = r
        .lines
        .iter()
        .filter_map(|l| {
            let (t, body) = split_printk(&l.text);
            Some((t?, body))
        })
        .collect();
    let init = lines
        .iter()
        .position(|(_, b)| b.starts_with("Initmem setup node"))?;
    let holes = lines[init..]
        .iter()
        .rposition(|(_, b)| b.contains("pages in unavailable ranges"))
        .map_or(init, |k| init + k);
    let memmap = lines.get(holes + 1)?.0 - lines[init].0;
    let freed = lines
        .iter()
        .position(|(_, b)| b.starts_with("Memory: ") && b.contains("K available"))?;
    let freeing = lines[freed].0 - lines.get(freed.checked_sub(1)?)?.0;
    let total = (memmap + freeing) / 1e3;
    (lines[init].0 > 0.0 && total > 0.0).then_some(total)
}

/// Slow initcalls → the config symbols that own them (a custom kernel).
fn kconfig_rules(i: &Inputs<'_>, calls: &[InitcallTime]) -> Vec<Advice> {
    let total: f64 = calls.iter().map(|c| c.ms).sum();
    if total <= 0.0 {
        return Vec::new();
    }
    let Some(kmap) = i.kmap else {
        let slow: Vec<String> = calls
            .iter()
            .take(8)
            .map(|c| initcall_line(c, None))
            .collect();
        if slow.is_empty() {
            return Vec::new();
        }
        let mut evidence = vec![
            "the kernel source was not found (install linux-source or set EMBER_KERNEL_SOURCE) — \
             the slowest initcalls, unattributed:"
                .to_owned(),
        ];
        evidence.extend(slow);
        return vec![Advice {
            id: "kconfig".into(),
            title: "Build a kernel without the subsystems behind the slowest initcalls".into(),
            evidence,
            predicted_ms: calls.iter().take(8).map(|c| c.ms).sum(),
            change: Change::Guest {
                what: "a cut-down kernel config".into(),
            },
            verified: None,
        }];
    };
    let crypto_handled = !has_option(&i.header.cmdline, "cryptomgr.notests");
    // Group by the innermost symbol that is built in (=y): setting it to n
    // removes the initcall. Modules (=m) cost only when loaded.
    let mut by_symbol: BTreeMap<String, Vec<&InitcallTime>> = BTreeMap::new();
    for c in calls {
        if crypto_handled && is_crypto(c, Some(kmap)) {
            continue;
        }
        let Some(owner) = kmap.owner(&c.name) else {
            continue;
        };
        let symbol = owner
            .symbols
            .iter()
            .find(|s| i.builtin.is_none_or(|b| b.contains(*s)) && c.module.is_none());
        // The initramfs is how this guest boots: never advise removing it.
        if let Some(s) = symbol
            && !(s == "CONFIG_BLK_DEV_INITRD" && i.header.initrd.is_some())
            // Nor the driver of the console it is told to use.
            && !(s == "CONFIG_SERIAL_8250" && i.header.cmdline.contains("console=ttyS"))
        {
            by_symbol.entry(s.clone()).or_default().push(c);
        }
    }
    let mut groups: Vec<(String, Vec<&InitcallTime>, f64)> = by_symbol
        .into_iter()
        .map(|(s, v)| {
            let ms = v.iter().map(|c| c.ms).sum();
            (s, v, ms)
        })
        .filter(|(_, _, ms)| *ms >= total * KCONFIG_MIN_SHARE)
        .collect();
    groups.sort_by(|a, b| b.2.total_cmp(&a.2));
    groups
        .into_iter()
        .take(MAX_KCONFIG)
        .map(|(symbol, v, ms)| {
            let mut evidence = vec![format!(
                "{} initcall(s), {ms:.1} ms of {total:.0} ms of all initcalls (profile boot, kernel-measured)",
                v.len()
            )];
            evidence.extend(v.iter().take(4).map(|c| initcall_line(c, Some(kmap))));
            Advice {
                id: format!("kconfig:{symbol}"),
                title: format!("A cut-down kernel without {symbol} (if the guest does not need it)"),
                evidence,
                predicted_ms: ms,
                change: Change::KconfigOff { symbol },
                verified: None,
            }
        })
        .collect()
}

/// The doctor's part of an `ember analyze` report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdviceReport {
    /// Profile boots (with [`PROFILE_CMDLINE`]) the initcall figures come from.
    pub profile_boots: usize,
    /// Where the initcall → config symbol map came from.
    pub kconfig_source: Option<String>,
    /// The kernel config consulted for built-in symbols.
    pub kernel_config: Option<String>,
    /// The suggestions, largest predicted saving first.
    pub advice: Vec<Advice>,
    /// `--verify`: every automatic change at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combined: Option<Combined>,
}

/// All automatic suggestions applied together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Combined {
    /// The changes.
    pub changes: Vec<String>,
    /// The sum of their predictions, ms.
    pub predicted_ms: f64,
    /// What was measured.
    pub verified: Verification,
}

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
    let lost = v.failures[0].timed_out
        + v.failures[0].no_userspace
        + v.failures[1].timed_out
        + v.failures[1].no_userspace;
    if lost > 0 {
        text.push_str(&format!("; {lost} boot(s) did not count"));
    }
    text
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
    use crate::lab::kconfig::Owner;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        g: GuestOpts,
    }

    fn opts(args: &[&str]) -> GuestOpts {
        Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).g
    }

    fn record(lines: &[(f64, &str)], exit: f64) -> BootRecord {
        BootRecord::from_lines(lines, exit)
    }

    fn header(cmdline: &str, cpus: u32, mem: u64, backend: &str) -> Header {
        Header {
            host: "h".into(),
            host_kernel: "k".into(),
            host_cpu: "c".into(),
            backend: backend.into(),
            backend_version: "v".into(),
            accel: "a".into(),
            kernel: "/k".into(),
            initrd: None,
            cmdline: cmdline.into(),
            cpus,
            mem_mib: mem,
        }
    }

    fn run(
        h: &Header,
        o: &GuestOpts,
        boots: &[BootRecord],
        profile: &[BootRecord],
        kmap: Option<&KconfigMap>,
        console: Option<&ConsoleCost>,
    ) -> Vec<Advice> {
        let b: Vec<&BootRecord> = boots.iter().collect();
        let p: Vec<&BootRecord> = profile.iter().collect();
        advise(&Inputs {
            header: h,
            opts: o,
            boots: &b,
            profile: &p,
            activities: &[],
            console,
            total_ms: 100.0,
            kmap,
            builtin: None,
        })
    }

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
            &header("console=ttyS0 quiet", 1, 256, "qemu"),
            &o,
            std::slice::from_ref(&r),
            &[],
            None,
            Some(&c),
        );
        assert!(a.iter().all(|a| a.id != "quiet"));
        let a = run(
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

    fn profile() -> BootRecord {
        record(
            &[
                (
                    1000.0,
                    "[    0.100000] calling  crypto_algapi_init+0x0/0x1a @ 1",
                ),
                (
                    900_000.0,
                    "[    0.900000] initcall crypto_algapi_init+0x0/0x1a returned 0 after 800000 usecs",
                ),
                (
                    900_100.0,
                    "[    0.900100] initcall aes_init+0x0/0x1a returned 0 after 20000 usecs",
                ),
                (
                    900_200.0,
                    "[    0.900200] initcall serial8250_init+0x0/0x1a returned 0 after 30000 usecs",
                ),
                (
                    900_300.0,
                    "[    0.900300] serial8250: ttyS0 at I/O 0x3f8 (irq = 4, base_baud = 115200) is a 16550A",
                ),
                (
                    900_400.0,
                    "[    0.900400] initcall audit_init+0x0/0x1a returned 0 after 9000 usecs",
                ),
                (
                    900_500.0,
                    "[    0.900500] initcall audit_watch_init+0x0/0x1a returned 0 after 3000 usecs",
                ),
                (
                    900_600.0,
                    "[    0.900600] initcall tiny_init+0x0/0x1a returned 0 after 10 usecs",
                ),
                (
                    900_700.0,
                    "[    0.900700] initcall virtio_console_init+0x0/0x1a [virtio_console] returned 0 after 5000 usecs",
                ),
                (
                    900_800.0,
                    "[    0.900800] smp: Bringing up secondary CPUs ...",
                ),
                (940_800.0, "[    0.940800] smp: Brought up 1 node, 2 CPUs"),
            ],
            1_000_000.0,
        )
    }

    fn kmap() -> KconfigMap {
        let own = |file: &str, syms: &[&str]| Owner {
            file: file.into(),
            symbols: syms.iter().map(|s| s.to_string()).collect(),
        };
        let mut m = KconfigMap::default();
        m.owners.insert(
            "crypto_algapi_init".into(),
            own("crypto/algapi.c", &["CONFIG_CRYPTO_ALGAPI2"]),
        );
        m.owners.insert(
            "aes_init".into(),
            own(
                "arch/x86/crypto/aesni-intel_glue.c",
                &["CONFIG_CRYPTO_AES_NI_INTEL"],
            ),
        );
        m.owners.insert(
            "serial8250_init".into(),
            own(
                "drivers/tty/serial/8250/8250_core.c",
                &["CONFIG_SERIAL_8250", "CONFIG_TTY"],
            ),
        );
        m.owners.insert(
            "audit_init".into(),
            own("kernel/audit.c", &["CONFIG_AUDIT"]),
        );
        m.owners.insert(
            "audit_watch_init".into(),
            own(
                "kernel/audit_watch.c",
                &["CONFIG_AUDIT_WATCH", "CONFIG_AUDIT"],
            ),
        );
        m.owners
            .insert("tiny_init".into(), own("kernel/tiny.c", &["CONFIG_TINY"]));
        m
    }

    #[test]
    fn initcalls_are_the_kernels_own_durations() {
        let p = profile();
        let c = initcalls(&[&p, &p]);
        assert_eq!(c[0].name, "crypto_algapi_init");
        assert_eq!(c[0].ms, 800.0);
        let m = c.iter().find(|c| c.name == "virtio_console_init").unwrap();
        assert_eq!(m.module.as_deref(), Some("virtio_console"));
    }

    #[test]
    fn crypto_tests_smp_uarts_and_kconfig_symbols() {
        let p = profile();
        let m = kmap();
        let h = header("console=ttyS0 quiet", 2, 256, "ember");
        let a = run(
            &h,
            &opts(&[]),
            std::slice::from_ref(&p),
            std::slice::from_ref(&p),
            Some(&m),
            None,
        );
        let ids: Vec<&str> = a.iter().map(|a| a.id.as_str()).collect();
        // Ranked by predicted saving.
        assert_eq!(ids[0], "cryptomgr.notests", "{ids:?}");
        assert_eq!(a[0].predicted_ms, 820.0);
        assert!(
            a[0].evidence.iter().any(|e| e.contains("crypto/algapi.c")),
            "{:?}",
            a[0].evidence
        );
        let smp = a.iter().find(|a| a.id == "cpus-1").unwrap();
        assert!((smp.predicted_ms - 40.0).abs() < 1e-6, "{smp:?}");
        assert!(ids.contains(&"tsc.reliable"));
        let uarts = a.iter().find(|a| a.id == "8250.nr_uarts").unwrap();
        assert_eq!(
            uarts.change,
            Change::CmdlineAdd {
                option: "8250.nr_uarts=1".into()
            }
        );
        // audit_init and audit_watch_init: one owner each (innermost symbol,
        // here all taken as built in); crypto is left to cryptomgr.notests;
        // tiny_init is below the bar;
        // a module's init is not a built-in symbol.
        let syms: Vec<&str> = a
            .iter()
            .filter_map(|a| a.id.strip_prefix("kconfig:"))
            .collect();
        // audit_watch_init's 3 ms is under 1 % of all initcall time.
        // CONFIG_SERIAL_8250 drives the console=ttyS0 of this boot: kept.
        assert_eq!(syms, ["CONFIG_AUDIT"]);
        // With cryptomgr.notests already given and the symbol map saying
        // CONFIG_AUDIT_WATCH is not built in, audit_watch_init goes to CONFIG_AUDIT.
        let h = header("console=ttyS0 quiet cryptomgr.notests", 1, 256, "ember");
        let builtin: BTreeSet<String> = [
            "CONFIG_AUDIT",
            "CONFIG_SERIAL_8250",
            "CONFIG_CRYPTO_ALGAPI2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let b: Vec<&BootRecord> = vec![&p];
        let o = opts(&[]);
        let a = advise(&Inputs {
            header: &h,
            opts: &o,
            boots: &b,
            profile: &b,
            activities: &[],
            console: None,
            total_ms: 1000.0,
            kmap: Some(&m),
            builtin: Some(&builtin),
        });
        let ids: Vec<&str> = a.iter().map(|a| a.id.as_str()).collect();
        assert!(
            !ids.contains(&"cryptomgr.notests") && !ids.contains(&"cpus-1"),
            "{ids:?}"
        );
        let audit = a.iter().find(|a| a.id == "kconfig:CONFIG_AUDIT").unwrap();
        assert_eq!(audit.predicted_ms, 12.0);
        assert_eq!(ids[0], "kconfig:CONFIG_CRYPTO_ALGAPI2");
    }

    #[test]
    fn seabios_time_suggests_qboot_on_qemu_only() {
        let r = record(
            &[
                (50_000.0, "SeaBIOS (version 1.16.2-debian-1.16.2-1)"),
                (60_000.0, "Found 4 PCI devices (max PCI bus is 00)"),
                (70_000.0, "sercon: using ioport 0x3f8"),
                (250_000.0, "Booting from c000:003c"),
                (900_000.0, "ember-lab: poweroff"),
            ],
            1_000_000.0,
        );
        let h = header("console=ttyS0 quiet", 1, 256, "qemu");
        let a = run(
            &h,
            &opts(&["--backend", "qemu"]),
            std::slice::from_ref(&r),
            &[],
            None,
            None,
        );
        let q = a.iter().find(|a| a.id == "qboot").expect("qboot advised");
        assert!((q.predicted_ms - 200.0).abs() < 1e-6);
        assert_eq!(q.evidence.len(), 3);
        // microvm has no SeaBIOS; a --bios given is already followed.
        let a = run(
            &h,
            &opts(&["--backend", "qemu", "--machine", "microvm"]),
            std::slice::from_ref(&r),
            &[],
            None,
            None,
        );
        assert!(a.iter().all(|a| a.id != "qboot"));
        let a = run(
            &h,
            &opts(&["--backend", "qemu", "--bios", QBOOT]),
            &[r],
            &[],
            None,
            None,
        );
        assert!(a.iter().all(|a| a.id != "qboot"));
    }

    #[test]
    fn userspace_steps_and_memory() {
        let r = record(
            &[
                (1000.0, "[    0.001000] Zone ranges:"),
                (
                    41_000.0,
                    "[    0.041000] Memory: 900000K/1048576K available (12288K kernel code)",
                ),
                (100_000.0, "Starting udev: udevadm settle"),
                (230_000.0, "done"),
                (300_000.0, "hwclock --hctosys"),
                (600_000.0, "ember-lab: poweroff"),
            ],
            700_000.0,
        );
        let h = header("console=ttyS0 quiet", 1, 1024, "ember");
        let a = run(&h, &opts(&[]), &[r], &[], None, None);
        let udev = a
            .iter()
            .find(|a| a.id == "userspace:udev")
            .unwrap_or_else(|| panic!("{a:#?}"));
        assert!((udev.predicted_ms - 130.0).abs() < 1e-6);
        let hw = a.iter().find(|a| a.id == "userspace:hwclock").unwrap();
        assert!((hw.predicted_ms - 300.0).abs() < 1e-6);
        let mem = a.iter().find(|a| a.id == "mem").unwrap();
        assert_eq!(mem.change, Change::Mem { mib: 512 });
        assert!((mem.predicted_ms - 20.0).abs() < 1e-6);
    }

    #[test]
    fn initramfs_compression_and_module_debug_info() {
        assert_eq!(
            inspect_initramfs(&[0x1f, 0x8b, 8, 0]).compression,
            Some("gzip")
        );
        let mut w = crate::initramfs::NewcWriter::new(Vec::new());
        w.file("a.ko", 0o644, b"\x7fELF....debug_info\0.debug_info\0rest")
            .unwrap();
        w.file("b.ko.xz", 0o644, b"xz").unwrap();
        w.file("c.ko", 0o644, b"\x7fELF stripped").unwrap();
        let (data, _) = w.finish().unwrap();
        let info = inspect_initramfs(&data);
        assert_eq!(info.compression, None);
        assert_eq!(info.compressed_modules, 1);
        assert_eq!(info.debug_module_bytes, 35);
    }

    #[test]
    fn memory_work_is_the_memmap_set_up_and_the_page_freeing() {
        let r = record(
            &[
                (1.0, "[    0.003700] Zone ranges:"),
                (
                    2.0,
                    "[    0.003744] Initmem setup node 0 [mem 0x1000-0xfffffff]",
                ),
                (
                    3.0,
                    "[    0.003760] On node 0, zone DMA: 1 pages in unavailable ranges",
                ),
                (
                    4.0,
                    "[    0.003984] On node 0, zone DMA: 97 pages in unavailable ranges",
                ),
                (5.0, "[    0.007865] ACPI: PM-Timer IO Port: 0x608"),
                (6.0, "[    0.026883] setup_percpu: NR_CPUS:8192"),
                (7.0, "[    0.029893] mem auto-init: stack:all(zero)"),
                (
                    8.0,
                    "[    0.033316] Memory: 212948K/261752K available (14343K kernel code)",
                ),
            ],
            10.0,
        );
        // 7.865 − 3.744 ms of memmap, 33.316 − 29.893 ms of freeing: not
        // the per-CPU set-up between them, which does not grow with memory.
        let ms = memory_work_ms(&r).unwrap();
        assert!((ms - (4.121 + 3.423)).abs() < 1e-6, "{ms}");
        // Lines printed before the kernel's clock runs do not count.
        let early = record(
            &[
                (1.0, "[    0.000000] Initmem setup node 0"),
                (2.0, "[    0.000000] Foo"),
                (3.0, "[    0.000000] Memory: 1K/2K available"),
            ],
            4.0,
        );
        assert_eq!(memory_work_ms(&early), None);
    }

    /// The advice `id` a qemu boot with `cmdline` and `cpus` vCPUs gets
    /// from the profile boot `profile` alone.
    fn profile_advice(profile: &BootRecord, cmdline: &str, cpus: u32, id: &str) -> Option<Advice> {
        run(
            &header(cmdline, cpus, 256, "qemu"),
            &opts(&[]),
            &[],
            std::slice::from_ref(profile),
            None,
            None,
        )
        .into_iter()
        .find(|a| a.id == id)
    }

    /// A TCG boot's APIC timer calibration (the lines `apic=verbose`
    /// prints, as a 6.1 kernel under QEMU/TCG printed them): one vCPU is
    /// advised `nolapic_timer`; two are not, nor is a boot that has it.
    #[test]
    fn an_apic_timer_calibration_is_advised_away_on_one_vcpu() {
        let r = record(
            &[
                // Arrival times ten times the kernel's, as under `-icount`.
                (
                    1_570_000.0,
                    "[    0.157092] Mountpoint-cache hash table entries: 512",
                ),
                (
                    1_620_000.0,
                    "[    0.161995] Using local APIC timer interrupts.",
                ),
                (1_620_000.0, "[    0.161995] calibrating APIC timer ..."),
                (3_780_000.0, "[    0.378006] ... lapic delta = 6249956"),
                (
                    3_781_000.0,
                    "[    0.378078] smpboot: CPU0: AMD QEMU TCG CPU",
                ),
            ],
            4_000_000.0,
        );
        let advised = |cmdline: &str, cpus: u32| profile_advice(&r, cmdline, cpus, "nolapic_timer");
        let a = advised("console=ttyS0 quiet", 1).expect("nolapic_timer advised");
        // On the kernel's clock, not the arrivals'.
        assert!((a.predicted_ms - 216.0).abs() < 0.1, "{a:?}");
        assert_eq!(
            a.change,
            Change::CmdlineAdd {
                option: "nolapic_timer".into()
            }
        );
        assert!(advised("console=ttyS0 quiet", 2).is_none());
        assert!(advised("console=ttyS0 quiet nolapic_timer", 1).is_none());
        // No calibration (a TSC-deadline timer, as under KVM): no advice.
        let kvm = record(&[(1.0, "[    0.1] smpboot: CPU0: AMD EPYC")], 2.0);
        let a = run(
            &header("console=ttyS0", 1, 256, "ember"),
            &opts(&[]),
            &[],
            &[kvm],
            None,
            None,
        );
        assert!(a.iter().all(|a| a.id != "nolapic_timer"), "{a:?}");
    }

    /// ftrace's background check, seen through the workqueue events the
    /// profile boot prints (as a 6.1 kernel under TCG printed them).
    #[test]
    fn ftraces_background_check_is_measured_from_its_work_item() {
        let p = record(
            &[
                (
                    1.0,
                    "[    0.020000] ftrace: allocating 37697 entries in 148 pages",
                ),
                (
                    2.0,
                    "[    0.933718] workqueue_execute_start: work struct (____ptrval____): function ftrace_check_work_func",
                ),
                (
                    3.0,
                    "[    0.950000] workqueue_execute_start: work struct (____ptrval____): function other_func",
                ),
                (
                    4.0,
                    "[    0.991517] workqueue_execute_end: work struct (____ptrval____): function ftrace_check_work_func",
                ),
            ],
            5.0,
        );
        let find = |cmdline: &str| profile_advice(&p, cmdline, 1, "ftrace-check");
        let a = find("console=ttyS0").expect("advised");
        assert!((a.predicted_ms - 57.799).abs() < 1e-6, "{a:?}");
        assert!(
            a.evidence.iter().any(|e| e.contains("37697 entries")),
            "{a:?}"
        );
        assert_eq!(
            a.change,
            Change::CmdlineAdd {
                option: "initcall_blacklist=ftrace_check_for_weak_functions".into()
            }
        );
        assert!(
            find("console=ttyS0 initcall_blacklist=foo,ftrace_check_for_weak_functions").is_none()
        );
        assert!(
            find("initcall_blacklist=ftrace_check_for_weak_functions initcall_blacklist=x")
                .is_none()
        );
        assert!(find("console=ttyS0 initcall_blacklist=foo").is_some());
    }

    #[test]
    fn icount_verifies_on_the_guests_clock_but_a_firmware_change() {
        let mem = Change::Mem { mib: 128 };
        let bios = Change::Bios {
            path: QBOOT.to_owned(),
        };
        assert_eq!(VerifyClock::for_change(true, &mem), VerifyClock::Guest);
        assert_eq!(VerifyClock::for_change(true, &bios), VerifyClock::Wall);
        assert_eq!(VerifyClock::for_change(false, &mem), VerifyClock::Wall);
        // The guest's clock: the last kernel timestamp, whatever arrives after it.
        let r = record(
            &[
                (1000.0, "[    0.500000] a"),
                (2000.0, "[    0.712345] reboot: Power down"),
                (2100.0, "no stamp"),
            ],
            9000.0,
        );
        assert_eq!(VerifyClock::Guest.of(&r), Some(712.345));
        assert_eq!(VerifyClock::Wall.of(&r), Some(9.0));
        assert_eq!(guest_end_ms(&record(&[(1.0, "plain")], 5.0)), None);
    }

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
