//! From boot records to figures: one merged timeline per boot (console lines
//! on the guest's printk clock where it has one, VMM events, and the lab's own
//! spawn/first-output/exit), activities matched by their definitions, their statistics
//! across boots, and what the serial console itself cost.

use super::activities::ActivityDef;
use super::record::BootRecord;
use super::stats::Summary;
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// Which clock a time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Clock {
    /// The guest kernel's printk timestamps, shifted onto the host axis.
    Guest,
    /// Host arrival time (µs since spawn).
    Host,
    /// One end on each.
    Mixed,
}

impl Clock {
    fn of(a: Clock, b: Clock) -> Clock {
        if a == b { a } else { Clock::Mixed }
    }
}

/// One point on a boot's timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// µs since spawn (guest-stamped lines: printk time + the run's offset).
    pub t_us: f64,
    /// Where `t_us` came from.
    pub clock: Clock,
    /// Text definitions match: a console line without its printk prefix, or `@event`.
    pub text: String,
    /// Stamped `[    0.000000]`: printed before the guest clock ran. Such
    /// lines often arrive in one burst when the console comes up, so a span
    /// between two of them has no measurable length on either clock.
    pub before_clock: bool,
}

/// Splits `[    1.234567] text` into (1234567 µs, "text"), ignoring terminal
/// escape sequences and junk before the timestamp (firmware output without a
/// newline often precedes the kernel's first line).
pub fn split_printk(line: &str) -> (Option<f64>, String) {
    static ANSI: OnceLock<Regex> = OnceLock::new();
    static STAMP: OnceLock<Regex> = OnceLock::new();
    let ansi = ANSI.get_or_init(|| Regex::new(r"\x1b\[[0-9;?]*[A-Za-z]|\x1bc").unwrap());
    let stamp = STAMP.get_or_init(|| Regex::new(r"\[\s*(\d+)\.(\d{6})\] ?").unwrap());
    let clean = ansi.replace_all(line, "");
    match stamp.captures(&clean) {
        Some(c) => {
            let secs: f64 = c[1].parse().unwrap_or(0.0);
            let micros: f64 = c[2].parse().unwrap_or(0.0);
            let body = clean[c.get(0).map_or(0, |m| m.end())..].to_owned();
            (Some(secs * 1e6 + micros), body)
        }
        None => (None, clean.into_owned()),
    }
}

/// Per console line, the offset that puts its printk time on the host axis
/// (`None` for unstamped lines). A line cannot arrive before it was printed,
/// so (arrival − printk time) bounds the offset from above; each line takes
/// the smallest bound of itself and every later line. The guest clock can
/// stall against the host (a QEMU/TCG boot here loses ~200 ms once, around
/// the clocksource switch) but never runs ahead, so taking the minimum over
/// the *rest* of the boot follows such steps where one global minimum would
/// misplace everything after them; the placed times also stay in order and
/// never later than arrival.
pub fn guest_offsets(record: &BootRecord) -> Vec<Option<f64>> {
    let mut out = vec![None; record.lines.len()];
    let mut best = f64::INFINITY;
    for (i, l) in record.lines.iter().enumerate().rev() {
        if let (Some(g), _) = split_printk(&l.text) {
            best = best.min(l.t_us - g);
            out[i] = Some(best);
        }
    }
    out
}

/// The merged timeline of one boot, in time order.
pub fn timeline(record: &BootRecord) -> Vec<Entry> {
    let offsets = guest_offsets(record);
    let mut lines: Vec<Entry> = record
        .lines
        .iter()
        .zip(offsets)
        .map(|(l, offset)| match (split_printk(&l.text), offset) {
            ((Some(g), body), Some(off)) => Entry {
                t_us: g + off,
                clock: Clock::Guest,
                text: body,
                before_clock: g == 0.0,
            },
            ((_, body), _) => Entry {
                t_us: l.t_us,
                clock: Clock::Host,
                text: body,
                before_clock: false,
            },
        })
        .collect();
    // An unstamped line (userspace output) was printed before the stamped
    // lines that arrive after it: never place it later than those.
    let mut bound = f64::INFINITY;
    for e in lines.iter_mut().rev() {
        if e.clock == Clock::Guest {
            bound = bound.min(e.t_us);
        } else {
            e.t_us = e.t_us.min(bound);
        }
    }
    let mut events = vec![Entry {
        t_us: 0.0,
        clock: Clock::Host,
        text: "@spawn".into(),
        before_clock: false,
    }];
    if let Some(t) = record.first_output_us {
        events.push(Entry {
            t_us: t,
            clock: Clock::Host,
            text: "@first_output".into(),
            before_clock: false,
        });
    }
    for e in &record.events {
        if e.kind == ember_vmm::events::kind::CONSOLE_LINE {
            continue;
        }
        let mut text = format!("@{}", e.kind);
        if let Some(code) = e.code {
            text.push_str(&format!(" code={code:#x}"));
        }
        if let Some(t) = &e.text {
            text.push(' ');
            text.push_str(t);
        }
        events.push(Entry {
            t_us: e.t_us,
            clock: Clock::Host,
            text,
            before_clock: false,
        });
    }
    events.push(Entry {
        t_us: record.exit_us,
        clock: Clock::Host,
        text: "@exit".into(),
        before_clock: false,
    });
    events.sort_by(|a, b| a.t_us.total_cmp(&b.t_us));
    // Merge, keeping console lines in arrival order.
    let mut out = Vec::with_capacity(lines.len() + events.len());
    let mut ev = events.into_iter().peekable();
    for l in lines {
        while ev.peek().is_some_and(|e| e.t_us <= l.t_us) {
            out.extend(ev.next());
        }
        out.push(l);
    }
    out.extend(ev);
    out
}

/// One activity in one boot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Activity {
    /// Expanded name.
    pub name: String,
    /// Enclosing activity.
    pub parent: Option<String>,
    /// Start, µs since spawn.
    pub start_us: f64,
    /// End, µs since spawn.
    pub end_us: f64,
    /// Which clock the duration is on.
    pub clock: Clock,
}

/// Matches `defs` against a timeline. An activity opens at the first start
/// match (further starts while it is open are ignored) and closes at the next
/// end match; activities still open at the end are dropped. Repeats of a
/// closed activity in one boot add up under one name. A span whose both ends
/// were printed before the guest clock ran is dropped: it cannot be measured.
pub fn activities(entries: &[Entry], defs: &[ActivityDef]) -> Vec<Activity> {
    struct Open {
        def: usize,
        name: String,
        start: f64,
        clock: Clock,
        before_clock: bool,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut done: Vec<Activity> = Vec::new();
    for e in entries {
        for (di, def) in defs.iter().enumerate() {
            if let Some(caps) = def.end.captures(&e.text) {
                let target = def.is_template().then(|| def.expand(&caps));
                let pos = open
                    .iter()
                    .rposition(|o| o.def == di && target.as_ref().is_none_or(|n| *n == o.name));
                if let Some(o) = pos.map(|p| open.remove(p))
                    && !(o.before_clock && e.before_clock)
                {
                    add(
                        &mut done,
                        &o.name,
                        def,
                        o.start,
                        e.t_us,
                        Clock::of(o.clock, e.clock),
                    );
                }
            }
            if let Some(caps) = def.start.captures(&e.text) {
                let name = def.expand(&caps);
                if !open.iter().any(|o| o.name == name) {
                    open.push(Open {
                        def: di,
                        name,
                        start: e.t_us,
                        clock: e.clock,
                        before_clock: e.before_clock,
                    });
                }
            }
        }
    }
    done
}

fn add(
    done: &mut Vec<Activity>,
    name: &str,
    def: &ActivityDef,
    start: f64,
    end: f64,
    clock: Clock,
) {
    let length = (end - start).max(0.0);
    if let Some(a) = done.iter_mut().find(|a| a.name == name) {
        a.end_us += length;
        return;
    }
    done.push(Activity {
        name: name.to_owned(),
        parent: def.parent.clone(),
        start_us: start,
        end_us: start + length,
        clock,
    });
}

/// One activity across boots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivityStats {
    /// Name.
    pub name: String,
    /// Enclosing activity.
    pub parent: Option<String>,
    /// Nesting depth (0 for no parent).
    pub depth: usize,
    /// Start times, ms since spawn.
    pub start_ms: Summary,
    /// Durations, ms.
    pub duration_ms: Summary,
    /// Mean duration as a percentage of the mean run (spawn to exit).
    pub pct_of_total: f64,
    /// Which clock the durations come from (in most boots).
    pub clock: Clock,
}

/// Aggregates per-boot activities; `total_ms` is the mean run length. Sorted
/// by mean start time, then depth.
pub fn aggregate(per_boot: &[Vec<Activity>], total_ms: f64) -> Vec<ActivityStats> {
    let mut by_name: BTreeMap<&str, Vec<&Activity>> = BTreeMap::new();
    for a in per_boot.iter().flatten() {
        by_name.entry(&a.name).or_default().push(a);
    }
    let parents: BTreeMap<String, Option<String>> = by_name
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v[0].parent.clone()))
        .collect();
    let mut out: Vec<ActivityStats> = by_name
        .iter()
        .map(|(name, v)| {
            let starts: Vec<f64> = v.iter().map(|a| a.start_us / 1e3).collect();
            let lens: Vec<f64> = v.iter().map(|a| (a.end_us - a.start_us) / 1e3).collect();
            let duration = Summary::of(&lens).expect("at least one");
            let guest = v.iter().filter(|a| a.clock == Clock::Guest).count();
            let host = v.iter().filter(|a| a.clock == Clock::Host).count();
            let clock = if guest * 2 > v.len() {
                Clock::Guest
            } else if host * 2 > v.len() {
                Clock::Host
            } else {
                Clock::Mixed
            };
            ActivityStats {
                name: (*name).to_owned(),
                parent: v[0].parent.clone(),
                depth: depth(&parents, name),
                start_ms: Summary::of(&starts).expect("at least one"),
                duration_ms: duration,
                pct_of_total: if total_ms > 0.0 {
                    100.0 * duration.mean / total_ms
                } else {
                    0.0
                },
                clock,
            }
        })
        .collect();
    // Parents before children when they start together.
    out.sort_by(|a, b| {
        a.start_ms
            .mean
            .total_cmp(&b.start_ms.mean)
            .then(a.depth.cmp(&b.depth))
    });
    tree_order(out)
}

/// Reorders start-sorted activities depth first: each one followed by its
/// children (in start order), so a printed table reads as a tree.
fn tree_order(sorted: Vec<ActivityStats>) -> Vec<ActivityStats> {
    let names: Vec<&str> = sorted.iter().map(|a| a.name.as_str()).collect();
    let is_root = |a: &ActivityStats| a.parent.as_deref().is_none_or(|p| !names.contains(&p));
    let mut order = Vec::with_capacity(sorted.len());
    let mut stack: Vec<usize> = (0..sorted.len())
        .filter(|&i| is_root(&sorted[i]))
        .rev()
        .collect();
    let mut placed = vec![false; sorted.len()];
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut placed[i], true) {
            continue;
        }
        order.push(i);
        let children = (0..sorted.len()).filter(|&c| {
            !placed[c] && sorted[c].parent.as_deref() == Some(sorted[i].name.as_str())
        });
        let children: Vec<usize> = children.collect();
        stack.extend(children.into_iter().rev());
    }
    // A parent cycle in a user's definition file leaves some unplaced: keep them at the end.
    order.extend((0..sorted.len()).filter(|&i| !placed[i]));
    let mut slots: Vec<Option<ActivityStats>> = sorted.into_iter().map(Some).collect();
    order.into_iter().filter_map(|i| slots[i].take()).collect()
}

/// Nesting depth of `name`: the length of its parent chain among the
/// activities that matched (bounded, so a parent cycle in a user's definition file
/// cannot hang us).
fn depth(parents: &BTreeMap<String, Option<String>>, name: &str) -> usize {
    let mut d = 0;
    let mut cur = name;
    while let Some(Some(p)) = parents.get(cur) {
        d += 1;
        cur = p;
        if d > parents.len() {
            break;
        }
    }
    d
}

/// What printing to the console cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsoleCost {
    /// Bytes per boot.
    pub bytes: Summary,
    /// Lines per boot.
    pub lines: Summary,
    /// The per-character cost used for the estimate, µs.
    pub per_char_us: f64,
    /// Estimated time the serial line itself cost per boot, ms.
    pub estimated_ms: f64,
    /// That, as a percentage of the mean run.
    pub pct_of_total: f64,
    /// Per-character cost seen in the guest's own timestamps (median of
    /// Δprintk ÷ bytes over back-to-back stamped lines), µs; `None` without
    /// printk times.
    pub observed_per_char_us: Option<f64>,
}

/// Lines printed within this much of each other count as back-to-back: the
/// gap is then mostly the console writing the earlier line.
const BACK_TO_BACK_US: f64 = 2000.0;

/// Consecutive printk-stamped lines printed back to back, as (bytes of the
/// earlier line with its CR LF, µs to the next line's stamp): the gap is then
/// mostly the console writing the earlier line (printk writes it before the
/// next line is stamped). Back to back means a gap under [`BACK_TO_BACK_US`],
/// or under 3× what the boots' median cost per byte makes of that line: a
/// console slow enough — ~2 ms per character for a nested guest's UART in
/// the rig — spaces every line by more than any fixed bound, which left no
/// pairs and the 15 µs cost model predicting 297 ms where `quiet` saved 41 s.
///
/// `host_clock`: time the lines by their arrival at the VMM instead of by
/// their printk stamps (the same kernel lines either way).
pub fn back_to_back_lines(records: &[&BootRecord], host_clock: bool) -> Vec<(f64, f64)> {
    let mut pairs = Vec::new();
    for r in records {
        let stamped: Vec<(f64, f64)> = r
            .lines
            .iter()
            .filter_map(|l| {
                split_printk(&l.text).0.filter(|g| *g > 0.0).map(|g| {
                    (
                        if host_clock { l.t_us } else { g },
                        l.text.len() as f64 + 2.0,
                    )
                })
            })
            .collect();
        for w in stamped.windows(2) {
            let gap = w[1].0 - w[0].0;
            if gap > 0.0 {
                pairs.push((w[0].1, gap));
            }
        }
    }
    let mut rates: Vec<f64> = pairs.iter().map(|(len, gap)| gap / len).collect();
    rates.sort_by(f64::total_cmp);
    let median = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
    pairs.retain(|&(len, gap)| gap < BACK_TO_BACK_US.max(3.0 * median * len));
    pairs
}

/// Console cost over `records`, with `per_char_us` as the cost model.
pub fn console_cost(
    records: &[&BootRecord],
    per_char_us: f64,
    total_ms: f64,
) -> Option<ConsoleCost> {
    let bytes: Vec<f64> = records.iter().map(|r| r.console_bytes as f64).collect();
    let lines: Vec<f64> = records.iter().map(|r| r.lines.len() as f64).collect();
    let bytes_s = Summary::of(&bytes)?;
    let per_char: Vec<f64> = back_to_back_lines(records, false)
        .iter()
        .map(|(len, gap)| gap / len)
        .collect();
    let estimated_ms = bytes_s.mean * per_char_us / 1e3;
    Some(ConsoleCost {
        bytes: bytes_s,
        lines: Summary::of(&lines)?,
        per_char_us,
        estimated_ms,
        pct_of_total: if total_ms > 0.0 {
            100.0 * estimated_ms / total_ms
        } else {
            0.0
        },
        observed_per_char_us: Summary::of(&per_char).map(|s| s.median),
    })
}

/// Named points a benchmark reports per boot, in µs since spawn (host clock:
/// what a user waiting for the guest sees).
#[derive(Debug, Clone)]
pub struct Milestones {
    /// `(name, regex)` console patterns, reported in this order.
    pub marks: Vec<(String, Regex)>,
    /// The line that means userspace is running.
    pub userspace: Regex,
    /// The line (or event) that means the guest is shutting down.
    pub shutdown: Regex,
}

impl Default for Milestones {
    fn default() -> Self {
        Milestones {
            marks: vec![(
                "kernel".into(),
                Regex::new(r"Linux version \d").expect("valid"),
            )],
            userspace: Regex::new(
                r"^Run /init as init process|^ember-lab: |^ember-test-guest: ring 3",
            )
            .expect("valid"),
            shutdown: Regex::new(r"^reboot: (Power down|Restarting system)|^@guest_shutdown")
                .expect("valid"),
        }
    }
}

/// The per-boot figures `ember bench` reports, in order: name → value (ms,
/// or MiB for peak RSS). Missing milestones are left out.
pub fn boot_metrics(record: &BootRecord, m: &Milestones) -> Vec<(String, f64)> {
    let host_time = |re: &Regex| {
        let line = record
            .lines
            .iter()
            .find(|l| re.is_match(&split_printk(&l.text).1))
            .map(|l| l.t_us);
        let event = record
            .events
            .iter()
            .find(|e| re.is_match(&format!("@{}", e.kind)))
            .map(|e| e.t_us);
        match (line, event) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    };
    let mut out = Vec::new();
    if let Some(t) = record.first_output_us {
        out.push(("first output".to_owned(), t / 1e3));
    }
    for (name, re) in &m.marks {
        if let Some(t) = host_time(re) {
            out.push((name.clone(), t / 1e3));
        }
    }
    // ember's boot-timing marks (port 0x80 codes, boot-timer writes).
    let mut seen = Vec::new();
    for e in &record.events {
        if e.kind == ember_vmm::events::kind::BOOT_MARK {
            let name = match e.code {
                Some(c) => format!("mark {c:#x}"),
                None => "mark".to_owned(),
            };
            if !seen.contains(&name) {
                out.push((name.clone(), e.t_us / 1e3));
                seen.push(name);
            }
        }
    }
    if let Some(t) = host_time(&m.userspace) {
        out.push(("userspace".to_owned(), t / 1e3));
    }
    if let Some(t) = host_time(&m.shutdown) {
        out.push(("shutdown".to_owned(), t / 1e3));
    }
    out.push(("exit".to_owned(), record.exit_us / 1e3));
    out.push((
        "peak RSS MiB".to_owned(),
        record.max_rss_kib as f64 / 1024.0,
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::activities::builtin_linux;

    fn record(lines: &[(f64, &str)], exit: f64) -> BootRecord {
        BootRecord::from_lines(lines, exit)
    }

    #[test]
    fn printk_prefix_is_split_even_after_escapes() {
        let (t, body) = split_printk("oc\x1b[?7l\x1b[2J[    1.533174] Run /init as init process");
        assert_eq!(t, Some(1_533_174.0));
        assert_eq!(body, "Run /init as init process");
        assert_eq!(split_printk("hello"), (None, "hello".to_owned()));
    }

    #[test]
    fn guest_times_are_aligned_and_userspace_lines_kept_in_order() {
        let r = record(
            &[
                (1000.0, "SeaBIOS (version 1)"),
                (9000.0, "[    0.000000] Linux version 6.1"),
                (10_500.0, "[    0.001000] Memory: 1K/2K available"),
                (12_000.0, "[    0.002000] Run /init as init process"),
                (20_000.0, "hello from init"),
                (20_100.0, "[    0.003000] reboot: Power down"),
            ],
            25_000.0,
        );
        // Smallest arrival − printk over the rest of the boot.
        let offs = guest_offsets(&r);
        assert_eq!(offs[0], None);
        assert_eq!(offs[1], Some(9000.0));
        assert_eq!(offs[5], Some(17_100.0));
        let tl = timeline(&r);
        let texts: Vec<_> = tl.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(texts.first(), Some(&"@spawn"));
        assert_eq!(texts.last(), Some(&"@exit"));
        let hello = tl.iter().find(|e| e.text == "hello from init").unwrap();
        // Arrived before the next stamped line's placed time (3000 + 17100).
        assert_eq!(hello.t_us, 20_000.0);
        let acts = activities(&tl, &builtin_linux());
        let get = |n: &str| acts.iter().find(|a| a.name == n).unwrap();
        assert_eq!(get("kernel").end_us - get("kernel").start_us, 3000.0);
        assert_eq!(get("kernel").clock, Clock::Guest);
        assert_eq!(get("run").end_us, 25_000.0);
        assert_eq!(get("firmware+decompress").clock, Clock::Mixed);
        assert_eq!(get("vmm:teardown").start_us, 20_100.0);
    }

    #[test]
    fn initcalls_become_one_activity_each() {
        let r = record(
            &[
                (10.0, "[    0.000100] calling  a_init+0x0/0x10 @ 1"),
                (20.0, "[    0.000150] calling  b_init+0x0/0x10 @ 1"),
                (
                    30.0,
                    "[    0.000400] initcall b_init+0x0/0x10 returned 0 after 250 usecs",
                ),
                (
                    40.0,
                    "[    0.000500] initcall a_init+0x0/0x10 returned 0 after 400 usecs",
                ),
                (50.0, "[    0.000600] Freeing unused kernel image"),
            ],
            100.0,
        );
        let acts = activities(&timeline(&r), &builtin_linux());
        let len = |n: &str| {
            let a = acts.iter().find(|a| a.name == n).unwrap();
            a.end_us - a.start_us
        };
        assert_eq!(len("initcall:a_init"), 400.0);
        assert_eq!(len("initcall:b_init"), 250.0);
        assert_eq!(len("kernel:initcalls"), 500.0);
        let stats = aggregate(&[acts.clone(), acts], 0.1);
        let b = stats.iter().find(|s| s.name == "initcall:b_init").unwrap();
        // initcall → kernel:initcalls → kernel (which never matched here).
        assert_eq!(b.depth, 2);
        assert_eq!(b.duration_ms.n, 2);
        assert!((b.pct_of_total - 250.0).abs() < 1e-9);
    }

    #[test]
    fn spans_printed_before_the_guest_clock_ran_are_dropped() {
        let r = record(
            &[
                (900.0, "[    0.000000] Memory: 1K/2K available"),
                (900.0, "[    0.000000] ftrace: allocating 10 entries"),
                (900.0, "[    0.000000] ftrace: allocated 1 pages"),
                (950.0, "[    0.000050] calling  a_init+0x0/0x10 @ 1"),
            ],
            1000.0,
        );
        let acts = activities(&timeline(&r), &builtin_linux());
        let names: Vec<&str> = acts.iter().map(|a| a.name.as_str()).collect();
        assert!(!names.contains(&"kernel:ftrace-init"), "{names:?}");
        assert!(names.contains(&"kernel:early-init"), "{names:?}");
    }

    #[test]
    fn metrics_and_console_cost() {
        let r = record(
            &[
                (500.0, "[    0.000000] Linux version 6.1"),
                (700.0, "[    0.000100] e820: a"),
                (900.0, "[    0.000200] e820: b"),
                (3000.0, "[    0.002000] Run /init as init process"),
                (4000.0, "[    0.003000] reboot: Power down"),
            ],
            5000.0,
        );
        let m = boot_metrics(&r, &Milestones::default());
        let names: Vec<_> = m.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "first output",
                "kernel",
                "userspace",
                "shutdown",
                "exit",
                "peak RSS MiB"
            ]
        );
        assert_eq!(m[2].1, 3.0);
        assert_eq!(m[5].1, 2.0);
        let c = console_cost(&[&r], 4.0, 5.0).unwrap();
        assert_eq!(c.bytes.mean, r.console_bytes as f64);
        assert!((c.estimated_ms - r.console_bytes as f64 * 4.0 / 1e3).abs() < 1e-9);
        // Back-to-back pairs: 100 µs over 34 and 22 bytes; 1800 µs over 22.
        assert!(c.observed_per_char_us.unwrap() > 1.0);
    }
}
