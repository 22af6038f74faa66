//! Kernel work a command-line option skips: the crypto self-tests, the TSC
//! check on each secondary vCPU (and SMP bring-up itself, by booting one),
//! the APIC timer's calibration, ftrace's call-site check, probing UARTs
//! the VM does not have.

use crate::lab::analysis::split_printk;
use crate::lab::doctor::evidence::{
    Inputs, first_line, has_option, kernel_span, option_value, span_either,
};
use crate::lab::doctor::initcalls::{InitcallTime, initcall_line, is_crypto};
use crate::lab::doctor::model::{Advice, Change};

/// Crypto self-tests → `cryptomgr.notests`.
pub fn crypto_rule(i: &Inputs<'_>, calls: &[InitcallTime]) -> Option<Advice> {
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

/// Secondary vCPUs: the per-AP TSC check and the rest of SMP bring-up.
pub fn smp_rules(i: &Inputs<'_>) -> Vec<Advice> {
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
pub fn apic_timer_rule(i: &Inputs<'_>) -> Option<Advice> {
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
pub fn ftrace_check_rule(i: &Inputs<'_>) -> Option<Advice> {
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

/// Probing hardware the VM does not have, where a kernel option stops it.
pub fn probe_rules(i: &Inputs<'_>, calls: &[InitcallTime]) -> Vec<Advice> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::doctor::testing::{header, opts, profile_advice, record, run};

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
        let advised = |cmdline: &str, cpus: u32| {
            profile_advice(apic_timer_rule, &r, cmdline, cpus, "nolapic_timer")
        };
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
            apic_timer_rule,
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
        let find =
            |cmdline: &str| profile_advice(ftrace_check_rule, &p, cmdline, 1, "ftrace-check");
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
}
