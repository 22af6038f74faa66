//! The one rig run all tests share: staged once, then L1s until one runs the
//! suite to its end (a dead or hung L1 is replaced, up to [`L1_ATTEMPTS`]).

use crate::case::Case;
use crate::l1::{self, L1Run};
use crate::stage;
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Instant;

/// How many L1s the suite gets when the L1 kernel dies or hangs under it.
/// Five: in twelve rig runs in a row here (stop 22), 6 of the 18 L1s were
/// lost. 4 died: the L1 kernel's own stack overflowed in its exception
/// entry, on one of ember's vCPU threads, in KVM_RUN under QEMU's emulated
/// SVM. 2 hung. One run lost two L1s in a row. An L1 running QEMU as its
/// VMM instead of ember (rig_clean_boot.rs) has crashed too. At one L1 in three,
/// five would all be lost in about one rig run in 250. A passing rig takes
/// ~3 minutes, a lost L1 up to ~5 more: five L1s fit inside CI's time.
const L1_ATTEMPTS: u32 = 5;

/// The one L1 run all tests share.
#[derive(Debug)]
pub struct Rig {
    pub cases: BTreeMap<String, Case>,
    pub version: String,
    pub token: String,
    /// Debian's generic kernel (for the snapshot cases), or why it is missing.
    pub generic: Result<String, String>,
    /// The containers case's files, or why they are missing.
    pub containers: Result<(), String>,
    l1_first_line_s: f64,
    total_s: f64,
    /// Why the L1 did not finish the suite (it died, or ran out of time).
    l1_failure: Option<String>,
}

impl Rig {
    /// A case the suite finished (killed at its limit counts as finished: its
    /// test judges it). Panics, naming why, for a case the L1 never finished.
    pub fn case(&self, name: &str) -> &Case {
        match (self.cases.get(name), &self.l1_failure) {
            (Some(c), _) if c.rc.is_some() => c,
            (Some(c), Some(why)) => panic!(
                "case `{name}` was RUNNING when the L1 ended ({why}); it printed:\n{}",
                c.dump()
            ),
            (None, Some(why)) => panic!(
                "case `{name}` never ran: the L1 ended during `{}` ({why})",
                self.running().unwrap_or("its start-up")
            ),
            _ => panic!(
                "the rig ran no case `{name}` (cases run: {:?}; EMBER_RIG_CASES filters them)",
                self.cases.keys().collect::<Vec<_>>()
            ),
        }
    }

    /// The case that started last and never ended.
    fn running(&self) -> Option<&str> {
        self.cases
            .iter()
            .find(|(n, c)| c.started && c.rc.is_none() && n.as_str() != "l1")
            .map(|(n, _)| n.as_str())
    }
}

pub fn rig() -> &'static Rig {
    static RIG: OnceLock<Result<Rig, String>> = OnceLock::new();
    match RIG.get_or_init(run_rig) {
        Ok(r) => r,
        Err(why) => panic!("THE NESTED RIG COULD NOT RUN: {why}"),
    }
}

/// Stages everything, boots the L1 (another if one died or hung, up to
/// [`L1_ATTEMPTS`]) and collects every case.
fn run_rig() -> Result<Rig, String> {
    let start = Instant::now();
    for tool in ["qemu-system-x86_64", "mkfs.ext4"] {
        if ember::backend::find_binary(tool).is_none() {
            return Err(format!("`{tool}` is not installed (scripts/install-deps)"));
        }
    }
    // Its files stay until the L1s are done (the end of this function).
    let staged = stage::stage()?;
    let token = format!(
        "rigtoken{}x{}",
        std::process::id(),
        start.elapsed().as_nanos()
    );
    let scale = l1::limit_scale()?;
    let l1_timeout = l1::L1_TIMEOUT_S * scale;
    // How each earlier L1 ended, for the failure message.
    let mut earlier: Vec<String> = Vec::new();
    let mut attempt = 0;
    let run = loop {
        attempt += 1;
        let c = l1::command(&staged, &token, attempt, scale, l1_timeout)?;
        if attempt == 1 {
            eprintln!(
                "nested rig: staged in {:.1} s; booting L1",
                start.elapsed().as_secs_f64()
            );
        } else {
            eprintln!(
                "nested rig: booting L1 attempt {attempt} of {L1_ATTEMPTS}, {:.0} s after the rig began",
                start.elapsed().as_secs_f64()
            );
        }
        let run = l1::run(c)?;
        if !run.log.cases.contains_key("l1") {
            // Not one suite line: the rig itself could not run.
            return Err(format!(
                "the L1 guest never started the suite (ember exited {}): {}\n{}",
                run.status,
                run.stderr.trim(),
                run.log.other.join("\n")
            ));
        }
        match lost_l1(&run, attempt) {
            Some((how, said)) if attempt < L1_ATTEMPTS => {
                eprintln!("{said}");
                earlier.push(how);
            }
            _ => break run,
        }
    };
    let l1_failure = l1_failure(&run, attempt, &earlier, l1_timeout);
    let rig = Rig {
        cases: run.log.cases,
        version: staged.version,
        token,
        generic: staged.generic,
        containers: staged.containers,
        l1_first_line_s: run.first_line_s.unwrap_or(0.0),
        total_s: run.total_s,
        l1_failure,
    };
    log_figures(&rig);
    Ok(rig)
}

/// Whether the L1 was lost under the suite, so that a fresh one should run
/// it again: how (for the failure message) and what to say in the log.
fn lost_l1(run: &L1Run, attempt: u32) -> Option<(String, String)> {
    let total_s = run.total_s;
    // The L1 kernel itself died (ember's "stopped without reporting", 125):
    // seen on Debian's L1 under TCG's emulated SVM, in KVM_RUN, both on CI and
    // here. The whole suite runs again in a fresh L1 (cases depend on each
    // other's files, so none is kept), up to [`L1_ATTEMPTS`] L1s in all; the
    // crash stays in the log.
    if run.status.code() == Some(125) && !run.log.done() {
        let last = run.log.order.last().map(String::as_str).unwrap_or("-");
        return Some((
            format!("attempt {attempt}: the L1 died after {total_s:.0} s, in case `{last}`"),
            format!(
                "nested rig: THE L1 DIED (attempt {attempt} of {L1_ATTEMPTS}); the whole suite runs again in a fresh L1:\n{}",
                run.stderr.trim()
            ),
        ));
    }
    // The L1 stopped answering in the middle of a case (its kernel, or
    // QEMU's emulation of SVM under it, hung; seen once in a fresh-clone
    // run, in the `virtio` case; in another, in `doctor-verbose`): killed,
    // and the suite runs again in a fresh L1, as above.
    let case = run.hung_case.as_ref()?;
    Some((
        format!("attempt {attempt}: the L1 hung after {total_s:.0} s, in case `{case}`"),
        format!(
            "nested rig: THE L1 HUNG in case `{case}` (attempt {attempt} of {L1_ATTEMPTS}); \
             the whole suite runs again in a fresh L1"
        ),
    ))
}

/// Why the last L1 did not finish the suite, if it did not.
fn l1_failure(run: &L1Run, attempt: u32, earlier: &[String], l1_timeout: u32) -> Option<String> {
    if run.status.success() && run.log.done() {
        return None;
    }
    let hung = run
        .hung_case
        .as_ref()
        .map(|c| format!(" (killed: the L1 stopped answering in case `{c}`)"))
        .unwrap_or_default();
    let history = if earlier.is_empty() {
        String::new()
    } else {
        format!(
            " [L1 attempt {attempt} of {L1_ATTEMPTS}; {}]",
            earlier.join("; ")
        )
    };
    Some(format!(
        "ember exited {}{hung} after {:.0} s (its --timeout is {l1_timeout} s){}{history}: {}\n{}",
        run.status,
        run.total_s,
        run.log
            .unfinished()
            .map(|n| format!(", while case `{n}` ran"))
            .unwrap_or_default(),
        run.stderr.trim(),
        run.log.other.join("\n")
    ))
}

/// The figures, for the log and BENCHMARKS-style reporting; the cases that
/// ran twice; why the L1 did not finish.
fn log_figures(rig: &Rig) {
    // The L1 kernel's own uptime when the suite started (its boot, module
    // loads and the unpacking of the staged files, without QEMU's start).
    let l1_uptime_s = rig.cases["l1"]
        .out
        .first()
        .and_then(|l| {
            l.split_whitespace()
                .find_map(|kv| kv.strip_prefix("uptime_ms="))
        })
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(f64::NAN, |ms| ms / 1e3);
    eprintln!(
        "nested rig: L1 exec -> first suite line {:.1} s (L1 uptime then {l1_uptime_s:.1} s); \
         whole L1 run {:.1} s",
        rig.l1_first_line_s, rig.total_s
    );
    for (name, c) in &rig.cases {
        if let Some(ms) = c.ms {
            eprintln!(
                "nested rig: {name:<18} {:>7.1} s  rc={:?}{}",
                ms as f64 / 1e3,
                c.rc,
                if c.hung.is_some() {
                    "  HUNG (killed)"
                } else {
                    ""
                }
            );
        }
    }
    for (name, c) in rig.cases.iter().filter(|(_, c)| c.retried) {
        eprintln!(
            "nested rig: *** CASE `{name}` RAN TWICE: its first attempt failed after a kernel \
             panic, oops, stall or triple fault of its L2 guest; the first attempt's last lines:\n{}",
            c.panic.join("\n")
        );
    }
    if let Some(why) = &rig.l1_failure {
        eprintln!("nested rig: THE L1 DID NOT FINISH: {why}");
    }
}

/// The L1 ran every case to its end within its time limit, and no case hung
/// (a hung case fails its own test too; this names them all at once).
#[test]
fn the_l1_runs_the_whole_suite() {
    let r = rig();
    if let Some(why) = &r.l1_failure {
        panic!("the L1 did not finish the suite: {why}");
    }
    let hung: Vec<String> = r
        .cases
        .iter()
        .filter_map(|(n, c)| c.hung.map(|s| format!("{n} (limit {s} s)")))
        .collect();
    assert!(hung.is_empty(), "cases killed at their limit: {hung:?}");
}
