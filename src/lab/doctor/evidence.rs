//! What the rules read ([`Inputs`]), and how they look things up in it:
//! options on the command line, the span between two console lines on
//! either clock, the first line that matches.

use crate::lab::activities::ActivityDef;
use crate::lab::analysis::{self, ConsoleCost, split_printk};
use crate::lab::config::{GuestOpts, Header};
use crate::lab::kconfig::KconfigMap;
use crate::lab::record::{BootRecord, ConsoleLine};
use crate::lab::stats;
use regex::Regex;
use std::collections::BTreeSet;

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
    /// The console's cost.
    pub console: Option<&'a ConsoleCost>,
    /// initcall → config symbol map, when the kernel source was found.
    pub kmap: Option<&'a KconfigMap>,
    /// The kernel's `CONFIG_…=y` symbols, when its config was found.
    pub builtin: Option<&'a BTreeSet<String>>,
}

/// Whether the command line has `opt` (as a word, or `opt=…`).
pub fn has_option(cmdline: &str, opt: &str) -> bool {
    cmdline
        .split_whitespace()
        .any(|w| w == opt || w.split_once('=').is_some_and(|(k, _)| k == opt))
}

/// The value of `key=` on the command line (the last one counts).
pub fn option_value<'c>(cmdline: &'c str, key: &str) -> Option<&'c str> {
    cmdline
        .split_whitespace()
        .filter_map(|w| w.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
        .next_back()
}

/// Mean length (ms) of the span `start` → `end` over the boots where it
/// occurs, and in how many it did.
pub fn span_ms(boots: &[&BootRecord], start: &str, end: &str) -> Option<(f64, usize)> {
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
pub fn span_either(i: &Inputs<'_>, start: &str, end: &str) -> Option<(f64, &'static str)> {
    span_ms(i.boots, start, end)
        .map(|(ms, _)| (ms, "measured in the analysed boots"))
        .or_else(|| {
            span_ms(i.profile, start, end).map(|(ms, _)| (ms, "measured in the profile boot"))
        })
}

/// Mean span (ms) from the first line matching `start` to the next matching
/// `end`, over the boots that have both, on the clock `at` reads off a line
/// (µs; `None` where it has no reading).
pub fn span_on(
    boots: &[&BootRecord],
    start: &str,
    end: &str,
    at: impl Fn(&ConsoleLine) -> Option<f64>,
) -> Option<f64> {
    let (start, end) = (Regex::new(start).ok()?, Regex::new(end).ok()?);
    let lens: Vec<f64> = boots
        .iter()
        .filter_map(|r| {
            let body = |l: &ConsoleLine| split_printk(&l.text).1;
            let s = r.lines.iter().position(|l| start.is_match(&body(l)))?;
            let e = r.lines[s..].iter().find(|l| end.is_match(&body(l)))?;
            let t0 = at(&r.lines[s])?;
            Some((at(e)? - t0) / 1e3)
        })
        .collect();
    (!lens.is_empty()).then(|| stats::mean(&lens))
}

/// [`span_on`] the host's clock: arrival times.
pub fn host_span(boots: &[&BootRecord], start: &str, end: &str) -> Option<f64> {
    span_on(boots, start, end, |l| Some(l.t_us))
}

/// [`span_on`] the kernel's own clock (its printk stamps), once it runs
/// (a line stamped 0 is not a reading) — the clock `--icount` makes count
/// instructions, where arrival times stretch with TCG's.
pub fn kernel_span(boots: &[&BootRecord], start: &str, end: &str) -> Option<f64> {
    span_on(boots, start, end, |l| {
        split_printk(&l.text).0.filter(|t| *t > 0.0)
    })
}

/// First console line (printk prefix stripped) matching `re` in any boot.
pub fn first_line(boots: &[&BootRecord], re: &str) -> Option<String> {
    let re = Regex::new(re).ok()?;
    boots.iter().flat_map(|r| &r.lines).find_map(|l| {
        let body = split_printk(&l.text).1;
        re.is_match(&body).then_some(body)
    })
}
