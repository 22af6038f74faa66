//! The VM's own options: the firmware a QEMU machine boots through, and
//! the memory size (the kernel's work that grows with it).

use crate::backend::qemu::QBOOT;
use crate::lab::analysis::split_printk;
use crate::lab::doctor::evidence::{Inputs, first_line, host_span, span_either};
use crate::lab::doctor::model::{Advice, Change};
use crate::lab::record::BootRecord;
use crate::lab::stats;
use regex::Regex;
use std::path::Path;
use std::sync::OnceLock;

/// QEMU machines with SeaBIOS: the firmware's own time, from its debug log.
pub fn firmware_rule(i: &Inputs<'_>) -> Option<Advice> {
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

/// Kernel work that grows with guest memory: the memory map's struct pages
/// are initialised and every free page handed to the allocator.
pub fn memory_rule(i: &Inputs<'_>) -> Option<Advice> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::doctor::testing::{header, opts, record, run};

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
            firmware_rule,
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
            firmware_rule,
            &h,
            &opts(&["--backend", "qemu", "--machine", "microvm"]),
            std::slice::from_ref(&r),
            &[],
            None,
            None,
        );
        assert!(a.iter().all(|a| a.id != "qboot"));
        let a = run(
            firmware_rule,
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
}
