//! The analysis on boots recorded from real QEMU/TCG runs of Debian's cloud
//! kernel (tests/fixtures/lab/*.json, written by `ember analyze --save`).

use ember::lab::analysis::{self, Clock, Milestones};
use ember::lab::record::Outcome;
use ember::lab::{activities, analyze_records, load, metric_samples, timeline};
use std::path::PathBuf;

fn fixture(name: &str) -> ember::lab::Recording {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lab")
        .join(name);
    load(&p).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()))
}

#[test]
fn initcall_debug_boot_is_taken_apart() {
    let rec = fixture("qemu-q35-tcg-initcall-debug.json");
    assert_eq!(rec.header.backend, "qemu");
    let r = analyze_records(
        rec.header.clone(),
        &rec.records,
        &Milestones::default(),
        &activities::builtin_linux(),
        4.0,
        false,
    );
    let get = |n: &str| {
        r.activities
            .iter()
            .find(|a| a.name == n)
            .unwrap_or_else(|| panic!("no activity {n}"))
    };
    let total = r.total.unwrap().mean;
    let kernel = get("kernel");
    let initcalls = get("kernel:initcalls");
    let userspace = get("userspace");
    // Phases nest and follow each other on one axis.
    assert!(kernel.duration_ms.mean > initcalls.duration_ms.mean);
    assert!(initcalls.start_ms.mean > kernel.start_ms.mean);
    assert!(userspace.start_ms.mean >= kernel.start_ms.mean + kernel.duration_ms.mean - 0.01);
    assert!(userspace.start_ms.mean < total);
    assert_eq!(kernel.clock, Clock::Guest);
    assert_eq!(get("run").depth, 0);
    assert_eq!(kernel.depth, 1);
    assert_eq!(get("initcall:acpi_init").depth, 3);
    // Hundreds of initcalls, each a guest-clock activity; their sum fits in the kernel phase.
    let calls: Vec<_> = r
        .activities
        .iter()
        .filter(|a| a.name.starts_with("initcall:"))
        .collect();
    assert!(calls.len() > 400, "{}", calls.len());
    let sum: f64 = calls.iter().map(|a| a.duration_ms.mean).sum();
    assert!(sum > 0.0 && sum < kernel.duration_ms.mean, "{sum}");
    assert!((get("run").pct_of_total - 100.0).abs() < 1e-6);
    // ~100 KB of console: the 4 µs/char model says ~0.4 s.
    let c = r.console.unwrap();
    assert!(c.bytes.mean > 50_000.0);
    assert!((c.estimated_ms - c.bytes.mean * 4.0 / 1e3).abs() < 1e-6);
    let seen = c.observed_per_char_us.unwrap();
    assert!(seen > 0.1 && seen < 50.0, "{seen}");
    // The picture has a bar per activity.
    let svg = timeline::svg(&r.activities, total, "t");
    assert_eq!(svg.matches("<g class=\"bar\">").count(), r.activities.len());
}

#[test]
fn quiet_boot_reaches_userspace_by_its_marker() {
    let rec = fixture("qemu-q35-tcg-quiet.json");
    let m = Milestones::default();
    let good: Vec<_> = rec.records.iter().collect();
    assert!(good.iter().all(|r| r.outcome == Outcome::Exited(0)));
    let samples = metric_samples(&good, &m);
    let names: Vec<&str> = samples.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "first output",
            "userspace",
            "shutdown",
            "exit",
            "peak RSS MiB"
        ]
    );
    for (name, xs) in &samples {
        assert_eq!(xs.len(), rec.records.len(), "{name}");
    }
    let get = |n: &str| &samples.iter().find(|(x, _)| x == n).unwrap().1;
    for i in 0..rec.records.len() {
        assert!(get("first output")[i] < get("userspace")[i]);
        assert!(get("userspace")[i] < get("shutdown")[i]);
        assert!(get("shutdown")[i] <= get("exit")[i]);
        assert!(get("peak RSS MiB")[i] > 10.0);
    }
}

#[test]
fn a_user_rule_file_adds_activities() {
    let rec = fixture("qemu-q35-tcg-initcall-debug.json");
    let extra = activities::parse(
        "[pci]\nstart = ^PCI: Using configuration type\nend = ^pci_bus 0000:00: resource\nparent = kernel\n\n\
         [acpi-tables]\nstart = ^ACPI: Early table checksum\nend = ^ACPI: Reserving FACP\n",
        "extra.rules",
    )
    .unwrap();
    let tl = analysis::timeline(&rec.records[0]);
    let acts = analysis::activities(&tl, &extra);
    let names: Vec<&str> = acts.iter().map(|a| a.name.as_str()).collect();
    assert!(names.contains(&"pci"), "{names:?}");
    let pci = acts.iter().find(|a| a.name == "pci").unwrap();
    assert!(pci.end_us > pci.start_us);
    assert_eq!(pci.parent.as_deref(), Some("kernel"));
}

#[test]
fn ember_boot_places_vmm_events_on_the_same_axis() {
    let rec = fixture("ember-test-guest.json");
    assert_eq!(rec.header.backend, "ember");
    let m = Milestones::default();
    let good: Vec<_> = rec.records.iter().collect();
    let samples = metric_samples(&good, &m);
    let names: Vec<&str> = samples.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "first output",
        "mark 0x40",
        "mark 0x41",
        "mark 0x42",
        "userspace",
        "shutdown",
        "exit",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for r in &rec.records {
        let t = |kind: &str| r.events.iter().find(|e| e.kind == kind).unwrap().t_us;
        // Aligned by the VMM's CLOCK_MONOTONIC start: after our spawn, in order,
        // and the first guest entry precedes the first console byte we saw.
        assert!(t("kvm_open") > 0.0);
        assert!(t("kvm_open") < t("first_guest_entry"));
        assert!(t("first_guest_entry") < r.first_output_us.unwrap());
        assert!(t("guest_shutdown") <= r.exit_us);
    }
    let report = analyze_records(
        rec.header.clone(),
        &rec.records,
        &m,
        &activities::builtin_linux(),
        15.0,
        false,
    );
    let names: Vec<&str> = report.activities.iter().map(|a| a.name.as_str()).collect();
    for want in [
        "run",
        "vmm:setup",
        "vmm:exec+kvm-open",
        "guest:until-userspace",
        "userspace:work",
        "vmm:teardown",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("kernel")), "{names:?}");
}
