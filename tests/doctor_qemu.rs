//! The boot doctor end to end: Debian's cloud kernel under QEMU/TCG with the
//! lab's busybox initramfs, booted with the serial console on and the crypto
//! self-tests running — two costs whose fixes are known (`quiet`,
//! `cryptomgr.notests`). The advice must name them with their evidence, and
//! `--verify` must measure the self-tests' saving. Eighteen boots.

mod common;

use std::process::Command;

/// The tests take turns: each keeps a CPU busy with TCG for minutes, and a
/// wall-clock A/B measurement beside an `-icount` boot loop measured the
/// self-tests' 0.4 s saving as −0.35 s (−1.8 … 1.1; it had run after the
/// shorter `-icount` test had ended until that test grew).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The doctor's advice `id` in `ember analyze --advise --json`'s output `v`.
fn advice_with_id<'a>(v: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    let list = v["advice"]["advice"].as_array().expect("an advice list");
    list.iter()
        .find(|a| a["id"] == id)
        .unwrap_or_else(|| panic!("no `{id}` advice in {list:#?}"))
}

#[test]
fn advise_names_the_known_costs_and_verify_measures_them() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        ember::lab::kconfig::find_source().is_some(),
        "the initcall → config symbol map needs the kernel source: \
         scripts/install-deps installs linux-source-6.1"
    );
    let dir = ember_testing::TempDir::new("doctor");
    let html = dir.join("t.html");
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "analyze",
            "--backend",
            "qemu",
            "--machine",
            "q35",
            "--accel",
            "tcg",
        ])
        .args(["--kernel", &common::debian_bzimage(), "--busybox-init"])
        .args(["--cmdline", "console=ttyS0 panic=-1"])
        .args(["-n", "1", "-w", "0", "--advise", "--verify"])
        .args([
            "--verify-only",
            "quiet,cryptomgr.notests",
            "--verify-pairs",
            "4",
        ])
        // A loaded machine stretches TCG boots a lot; a timed-out boot would
        // not count.
        .args(["--timeout", "600"])
        .arg("--html")
        .arg(&html)
        .arg("--json")
        .output()
        .expect("ember runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{}: {stderr}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let find = |id: &str| advice_with_id(&v, id);
    let advice = v["advice"]["advice"].as_array().expect("an advice list");
    assert_eq!(v["advice"]["profile_boots"], 1);

    // The console: its volume and the per-character cost of this boot.
    let quiet = find("quiet");
    assert_eq!(quiet["change"]["option"], "quiet");
    assert!(quiet["predicted_ms"].as_f64().unwrap() > 10.0, "{quiet}");
    let evidence = quiet["evidence"].to_string();
    assert!(evidence.contains("bytes per boot") && evidence.contains("µs per character"));

    // The crypto self-tests: from the kernel's own initcall durations,
    // attributed to crypto/ through the source's Makefiles.
    let crypto = find("cryptomgr.notests");
    assert!(crypto["predicted_ms"].as_f64().unwrap() > 50.0, "{crypto}");
    assert!(
        crypto["evidence"].to_string().contains("crypto/algapi.c"),
        "{crypto}"
    );
    let verified = &crypto["verified"];
    // Four pairs, all counted on a quiet host. The self-tests cost ~0.6 s of
    // a ~2 s TCG boot there; on a host so loaded that boots vary by more
    // than 10 % the saving drowns in the noise, and the test says so loudly
    // instead of asserting on noise.
    let pairs = verified["pairs"].as_u64().unwrap();
    assert!(pairs >= 3, "{verified}");
    assert_ne!(verified["verdict"], "broke", "{verified}");
    let noise = verified["without_ms"]["sd"].as_f64().unwrap()
        / verified["without_ms"]["mean"].as_f64().unwrap();
    if noise <= 0.10 {
        assert!(
            verified["saving_ms"]["estimate"].as_f64().unwrap() > 50.0,
            "{verified}"
        );
        assert_ne!(verified["verdict"], "slower", "{verified}");
    } else {
        eprintln!(
            "WARNING: host too noisy (boots vary by {:.0} %) to assert the measured \
             saving of cryptomgr.notests: {verified}",
            noise * 100.0
        );
    }
    // `quiet` was verified too (whatever the verdict, it is reported).
    assert!(quiet["verified"]["pairs"].as_u64().unwrap() >= 1, "{quiet}");
    assert!(quiet["verified"]["verdict"].is_string());

    // The APIC timer's calibration (TCG has no TSC-deadline timer) and
    // ftrace's background check of its call sites, from the profile boot.
    let apic = find("nolapic_timer");
    assert!(apic["predicted_ms"].as_f64().unwrap() > 10.0, "{apic}");
    assert!(
        apic["evidence"]
            .to_string()
            .contains("calibrating APIC timer"),
        "{apic}"
    );
    let ftrace = find("ftrace-check");
    assert!(ftrace["predicted_ms"].as_f64().unwrap() > 10.0, "{ftrace}");
    assert_eq!(
        ftrace["change"]["option"],
        "initcall_blacklist=ftrace_check_for_weak_functions"
    );

    // SeaBIOS's own log, and the slow initcalls' config symbols.
    let qboot = find("qboot");
    assert!(qboot["evidence"].to_string().contains("SeaBIOS"));
    assert!(
        advice
            .iter()
            .any(|a| a["id"].as_str().unwrap().starts_with("kconfig:CONFIG_")),
        "{advice:#?}"
    );
    // Ranked by predicted saving.
    let predicted: Vec<f64> = advice
        .iter()
        .map(|a| a["predicted_ms"].as_f64().unwrap())
        .collect();
    assert!(predicted.windows(2).all(|w| w[0] >= w[1]), "{predicted:?}");
    // The HTML page shows the advice beside the timeline.
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("id=\"advice\"") && page.contains("cryptomgr.notests"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--icount`: the guest's clock counts its instructions, so `--verify`
/// measures a kernel-side change on the guest's clock, deterministically,
/// on a loaded host as on a quiet one: here `--mem 128M` (memmap set-up and
/// page freeing, a few ms of the boot), which wall time cannot resolve (a
/// firmware change is timed on the wall clock: a unit test covers that);
/// and skipping ftrace's background check, whose prediction must be within
/// 25 %. Twenty-six boots.
#[test]
fn icount_verifies_kernel_side_advice_on_the_guests_clock() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["analyze", "--backend", "qemu", "--machine", "q35"])
        .args(["--accel", "tcg", "--icount"])
        .args(["--kernel", &common::debian_bzimage(), "--busybox-init"])
        .args([
            "--cmdline",
            "console=ttyS0 quiet panic=-1 cryptomgr.notests",
        ])
        .args(["-n", "1", "-w", "0", "--advise", "--verify"])
        .args(["--verify-only", "mem,ftrace-check", "--verify-pairs", "6"])
        .args(["--timeout", "600", "--json"])
        .output()
        .expect("ember runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let find = |id: &str| advice_with_id(&v, id);
    let mem = find("mem");
    let verified = &mem["verified"];
    assert_eq!(verified["clock"], "guest", "{verified}");
    assert_eq!(verified["pairs"], 6, "{verified}");
    assert_eq!(verified["verdict"], "saves", "{verified}");
    // Nearly the same instructions every time: the boots agree to ~1 ms of
    // a ~700 ms guest clock (timer interrupts land a little differently),
    // where wall-clock boots vary by tens of ms.
    let spread = verified["without_ms"]["max"].as_f64().unwrap()
        - verified["without_ms"]["min"].as_f64().unwrap();
    assert!(spread < 2.0, "guest clock not deterministic: {verified}");
    // Predicted from the profile boot, on the kernel's clock too: the page
    // structures' set-up and the page freeing, halved with the memory. The
    // prediction is ~3.8 ms against 2.4-3.3 measured (BENCHMARKS.md §8;
    // 2.4 in one CI run: a ~3 ms saving measured from pairs that each vary
    // by up to 2 ms). It must be within a factor of 1.5 of the measured
    // saving, or inside the measurement's 95 % interval and within a factor
    // of 2: a prediction off by more than that fails either way.
    let predicted = mem["predicted_ms"].as_f64().unwrap();
    let saving = &verified["saving_ms"];
    let measured = saving["estimate"].as_f64().unwrap();
    let (low, high) = (
        saving["low"].as_f64().unwrap(),
        saving["high"].as_f64().unwrap(),
    );
    eprintln!(
        "--mem 128M: predicted {predicted:.1} ms, measured {measured:.1} guest ms \
         (95 %: {low:.1}-{high:.1})"
    );
    let ratio = predicted / measured;
    assert!(
        measured > 0.0
            && ((ratio - 1.0).abs() < 0.5
                || ((low..=high).contains(&predicted) && (0.5..2.0).contains(&ratio))),
        "predicted {predicted} ms, measured {measured} guest ms (95 %: {low}-{high})"
    );

    // ftrace's background check: ~75 ms of guest work, predicted from its
    // work item's span in the profile boot (BENCHMARKS.md §8: 75.0
    // predicted, 79.7 measured on the appliance). Within 25 %.
    let ftrace = find("ftrace-check");
    let verified = &ftrace["verified"];
    assert_eq!(verified["clock"], "guest", "{verified}");
    assert_eq!(verified["verdict"], "saves", "{verified}");
    let predicted = ftrace["predicted_ms"].as_f64().unwrap();
    let measured = verified["saving_ms"]["estimate"].as_f64().unwrap();
    eprintln!("ftrace-check: predicted {predicted:.1} ms, measured {measured:.1} guest ms");
    assert!(
        measured > 20.0 && (predicted / measured - 1.0).abs() < 0.25,
        "predicted {predicted} ms, measured {measured} guest ms"
    );
}
