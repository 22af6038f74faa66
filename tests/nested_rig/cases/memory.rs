//! Guest memory: the balloon through the control socket, and `--prefault
//! async` fenced by Debian's balloon driver (`ember boot` and the appliance).

use crate::case::Case;
use crate::rig::rig;

/// The balloon's size the socket case asks for (tests/rig/suite.sh BALLOON_MIB).
const BALLOON_MIB: u64 = 160;
/// What the guest writes after a deflate (tests/rig/l2-init.sh touch_memory).
const TOUCH_KIB: u64 = 150 << 10;

/// A fact's number (`@KEY N`, or the value of `name=` in it).
fn number(c: &Case, key: &str, name: Option<&str>) -> u64 {
    let v = c.fact(key).unwrap_or_default();
    let v = match name {
        Some(n) => v
            .split_whitespace()
            .find_map(|f| f.strip_prefix(n)?.strip_prefix('='))
            .unwrap_or_default(),
        None => v.trim(),
    };
    v.parse()
        .unwrap_or_else(|_| panic!("no number in @{key} ({name:?})\n{}", c.dump()))
}

/// Each MemTotal (KiB) the guest printed as `@memtotal N`, in order.
fn memtotals(c: &Case) -> Vec<u64> {
    c.facts("memtotal")
        .iter()
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// The fields of the `memory_visible` event (the background commit's end) in
/// an events file the rig printed: driver, inflated, deflated and held pages.
fn visible_fields(events_case: &Case) -> (u64, u64, u64, u64, u64) {
    let json = events_case.out.join("\n");
    let ev: ember_vmm::events::EventFile = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("the events file is not JSON ({e}): {json:.800}"));
    let kinds: Vec<&str> = ev.events.iter().map(|e| e.kind.as_str()).collect();
    assert!(
        kinds.contains(&ember_vmm::prefault::EVENT_COMMITTED),
        "the background commit did not complete: {kinds:?}"
    );
    let text = ev
        .events
        .iter()
        .find(|e| e.kind == ember_vmm::prefault::EVENT_VISIBLE)
        .and_then(|e| e.text.clone())
        .unwrap_or_else(|| panic!("no memory_visible event: {kinds:?}"));
    let field = |name: &str| -> u64 {
        text.split_whitespace()
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {text}"))
    };
    let resident = ev.memory_kib("guest_resident_kib").unwrap_or(0);
    (
        field("driver"),
        field("inflated_pages"),
        field("deflated_pages"),
        field("held_pages"),
        resident,
    )
}

#[test]
fn balloon_through_the_socket_moves_embers_resident_memory() {
    let c = rig().case("balloon-socket");
    assert_eq!(c.rc, Some(0), "ember's exit status\n{}", c.dump());
    for op in ["ctl-inflate", "ctl-deflate"] {
        assert!(
            c.fact(op).is_some_and(|r| r.contains(r#""ok":true"#)),
            "`ember ctl … balloon` ({op})\n{}",
            c.dump()
        );
    }
    assert!(
        c.fact("timeout").is_none(),
        "the balloon never reached its target\n{}",
        c.dump()
    );
    let (filled, inflated) = (
        number(c, "rss-filled", None),
        number(c, "rss-inflated", None),
    );
    let (deflated, touched) = (
        number(c, "rss-deflated", None),
        number(c, "rss-touched", None),
    );
    eprintln!(
        "balloon-socket: ember VmRSS filled {filled} KiB, inflated {inflated} KiB, \
         deflated {deflated} KiB, touched {touched} KiB"
    );
    // Most of the 160 MiB the balloon took were resident (the page cache the
    // guest filled): ember gave them back to the host.
    assert!(
        filled >= inflated + (96 << 10),
        "inflating {BALLOON_MIB} MiB: VmRSS {filled} -> {inflated} KiB\n{}",
        c.dump()
    );
    // The guest's 150 MiB after the deflate (more than it had while the
    // balloon held 160 of its 256 MiB) became resident memory of ember's.
    assert!(
        touched >= deflated + (96 << 10),
        "touching {TOUCH_KIB} KiB after the deflate: VmRSS {deflated} -> {touched} KiB\n{}",
        c.dump()
    );
    // The guest's own view: the driver inflated the target and deflated it all.
    let (gi, gd) = (
        number(c, "balloon-vmstat", Some("inflate")),
        number(c, "balloon-vmstat", Some("deflate")),
    );
    assert!(gi >= BALLOON_MIB * 256 && gd == gi, "{}", c.dump());
    assert_eq!(number(c, "touched", None), TOUCH_KIB, "{}", c.dump());
    // Three more cycles of 64 MiB (issue 26): after each deflate the guest
    // wrote every word of 64 MiB from its refilled free lists and read it
    // back intact.
    let cycles = c.facts("deflate-touch");
    assert_eq!(cycles.len(), 3, "inflate/deflate cycles\n{}", c.dump());
    for (n, line) in cycles.iter().enumerate() {
        assert!(
            line.starts_with(&format!("{} TOUCH-OK ", n + 1)),
            "cycle {}: {line}\n{}",
            n + 1,
            c.dump()
        );
    }
    // The driver's statistics arrived (tag 5: total memory, 4: free memory).
    let stats: serde_json::Value =
        serde_json::from_str(c.fact("stats").unwrap_or_default()).unwrap_or_default();
    let total = stats["stats"]["5"].as_u64().unwrap_or(0);
    assert!(
        (128 << 20..=384 << 20).contains(&total) && stats["stats"]["4"].is_u64(),
        "balloon statistics: {stats}\n{}",
        c.dump()
    );
    assert_eq!(
        stats["actual_pages"].as_u64(),
        Some(BALLOON_MIB * 256),
        "{stats}"
    );
}

/// The same boot's virtio-mem region (`--mem 384M --mem-boot 256M`: one
/// 128 MiB block beside the balloon): Debian's `virtio_mem` plugs it and the
/// kernel onlines it (a kernel parameter, not the test), the guest uses it
/// (the balloon case's 150 MiB), and the socket unplugs and plugs it again,
/// MemTotal following.
#[test]
fn debians_virtio_mem_plugs_the_region_and_follows_the_socket() {
    let c = rig().case("balloon-socket");
    assert_eq!(c.rc, Some(0), "ember's exit status\n{}", c.dump());
    let boot_kib = 256 << 10;
    let plugged = number(c, "mem-plugged", None);
    assert!(
        plugged > boot_kib + (64 << 10),
        "MemTotal {plugged} KiB once the region was plugged\n{}",
        c.dump()
    );
    for op in ["ctl-mem-shrink", "ctl-mem-grow"] {
        assert!(
            c.fact(op).is_some_and(|r| r.contains(r#""ok":true"#)),
            "`ember ctl … mem --size` ({op})\n{}",
            c.dump()
        );
    }
    // MemTotal as the guest saw it change: full, a block less, full again.
    let totals = memtotals(c);
    let shrunk = totals.iter().position(|&t| t < boot_kib);
    let regrown = shrunk.and_then(|i| totals[i..].iter().position(|&t| t == plugged));
    assert!(
        totals.first() == Some(&plugged) && regrown.is_some(),
        "MemTotal over the resize: {totals:?} (plugged {plugged})\n{}",
        c.dump()
    );
    eprintln!(
        "balloon-socket virtio-mem: MemTotal {totals:?} KiB; ember VmRSS after the unplug {} KiB",
        number(c, "rss-unplugged", None)
    );
}

#[test]
fn prefault_async_is_fenced_by_debians_balloon_driver() {
    let r = rig();
    let c = r.case("prefault-async");
    assert_eq!(c.rc, Some(0), "ember's exit status\n{}", c.dump());
    assert!(
        !c.err.iter().any(|l| l.contains("no balloon driver")),
        "{}",
        c.dump()
    );
    let (driver, inflated, deflated, held, resident) =
        visible_fields(r.case("prefault-async-events"));
    eprintln!(
        "prefault-async: driver={driver} inflated={inflated} deflated={deflated} held={held} resident={resident} KiB"
    );
    // The driver came up while memory was still being committed, took what was
    // not committed yet, and gave it all back only as it was committed.
    assert_eq!(driver, 1, "{}", c.dump());
    assert!(inflated > 0, "the driver never inflated\n{}", c.dump());
    assert_eq!(deflated, inflated, "{}", c.dump());
    assert_eq!(held, 0);
    assert!(resident >= 256 << 10, "resident {resident} KiB");
    // The device sees the guest's inflates and, for each page the driver
    // migrated (compaction), one inflate more (CI saw 45057 against 45056).
    let gi = number(c, "balloon-vmstat", Some("inflate"));
    let migrated = number(c, "balloon-vmstat", Some("migrate"));
    assert_eq!(gi + migrated, inflated, "the guest's count\n{}", c.dump());
    assert_eq!(number(c, "touched", None), TOUCH_KIB, "{}", c.dump());
    assert!(c.fact("done").is_some(), "{}", c.dump());
}

/// The prefault-async boot's virtio-mem region (`--mem 384M --mem-boot
/// 256M`, one 128 MiB block): its commit starts once Debian's `virtio_mem`
/// has the device, the driver plugs it all as it is committed (MemTotal
/// full), the socket unplugs it (MemTotal short) and plugs it again: the
/// block is committed again before the plug is acknowledged (ember's RSS is
/// back up before the guest touches it), and MemTotal is full again.
#[test]
fn prefault_async_commits_debians_virtio_mem_region_and_each_plug_again() {
    let r = rig();
    let c = r.case("prefault-async");
    assert_eq!(c.rc, Some(0), "ember's exit status\n{}", c.dump());
    let json = r.case("prefault-async-events").out.join("\n");
    let ev: ember_vmm::events::EventFile = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("the events file is not JSON ({e}): {json:.800}"));
    let at = |kind: &str| ev.events.iter().find(|e| e.kind == kind).map(|e| e.t_us);
    let (started, committed) = (
        at(ember_vmm::prefault::EVENT_HOTPLUG_COMMIT_STARTED),
        at(ember_vmm::prefault::EVENT_HOTPLUG_COMMITTED),
    );
    let entry = at("first_guest_entry");
    assert!(
        matches!((entry, started, committed), (Some(e), Some(s), Some(d)) if e < s && s < d),
        "first entry {entry:?}, region commit started {started:?}, ended {committed:?}"
    );
    for op in ["ctl-mem-shrink", "ctl-mem-grow"] {
        assert!(
            c.fact(op).is_some_and(|r| r.contains(r#""ok":true"#)),
            "`ember ctl … mem --size` ({op})\n{}",
            c.dump()
        );
    }
    let plugged = number(c, "mem-plugged", None);
    assert!(
        plugged > (256 + 64) << 10,
        "MemTotal {plugged} KiB once the region was plugged\n{}",
        c.dump()
    );
    let totals = memtotals(c);
    let shrunk = totals.iter().position(|&t| t < 256 << 10);
    assert!(
        totals.first() == Some(&plugged) && shrunk.is_some() && totals.last() == Some(&plugged),
        "MemTotal over the resize: {totals:?} (plugged {plugged})\n{}",
        c.dump()
    );
    let (unplugged, replugged) = (
        number(c, "rss-unplugged", None),
        number(c, "rss-replugged", None),
    );
    eprintln!(
        "prefault-async virtio-mem: MemTotal {totals:?} KiB; ember VmRSS {unplugged} KiB unplugged, {replugged} KiB plugged again"
    );
    assert!(
        replugged >= unplugged + (96 << 10),
        "the block plugged again was not committed: VmRSS {unplugged} -> {replugged} KiB\n{}",
        c.dump()
    );
}

#[test]
fn appliance_with_prefault_async_loads_the_balloon_first() {
    let r = rig();
    let c = r.case("appliance-prefault");
    assert_eq!(c.rc, Some(0), "exit status\n{}", c.dump());
    let vmstat = c
        .out
        .iter()
        .find_map(|l| l.strip_prefix("vmstat "))
        .unwrap_or_else(|| panic!("no vmstat line\n{}", c.dump()));
    let count = |k: &str| -> u64 {
        vmstat
            .split_whitespace()
            .find_map(|f| f.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        count("inflate") > 0 && count("inflate") == count("deflate"),
        "{vmstat}"
    );
    // /proc/modules lists the most recently loaded module first.
    let modules: Vec<&str> = c
        .out
        .iter()
        .find(|l| l.contains("virtio_balloon"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let at = |m: &str| modules.iter().position(|x| *x == m);
    assert!(
        at("virtio_balloon").is_some()
            && at("virtio_rng").is_some()
            && at("virtio_balloon") > at("virtio_rng"),
        "virtio_balloon must load before virtio_rng: {modules:?}\n{}",
        c.dump()
    );
    // The fence's end, from `run --events` (the VMM ends by itself then).
    let (driver, inflated, deflated, held, _) = visible_fields(r.case("appliance-prefault-events"));
    assert_eq!((driver, held), (1, 0));
    assert!(
        inflated > 0 && deflated == inflated,
        "{inflated} {deflated}"
    );
    assert!(
        c.err
            .iter()
            .any(|l| l.contains("guest memory committed in the background: 512 MiB")),
        "{}",
        c.dump()
    );
    assert!(
        !c.err.iter().any(|l| l.contains("no balloon driver")),
        "{}",
        c.dump()
    );
}
