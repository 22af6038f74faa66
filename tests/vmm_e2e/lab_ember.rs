//! End to end through `--backend ember`: the boot lab driving `ember run` on
//! the test guest (built by `ember_testing::test_guest`), a few boots each.

use std::process::{Command, Output};

/// Test-guest command line: a boot mark, a marked piece of "work", then the
/// guest powers off by itself.
const CMDLINE: &str =
    "console=ttyS0 mark=0x42 print=ember-lab:_begin_work spin=5 print=ember-lab:_end_work";

fn ember(sub: &str, args: &[&str]) -> Output {
    let guest = ember_testing::test_guest().expect("the test guest builds");
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .arg(sub)
        .args([
            "--backend",
            "ember",
            "--cmdline",
            CMDLINE,
            "--no-initrd",
            "--kernel",
        ])
        .arg(guest)
        .args(args)
        .output()
        .expect("ember runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn bench_reports_boot_marks_and_rss() {
    let out = ember("bench", &["-n", "3", "-w", "1", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["counted"][0], 3);
    assert_eq!(v["header"]["backend"], "ember");
    let mean = |name: &str| {
        v["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {v}"))["a"]["mean"]
            .as_f64()
            .unwrap()
    };
    assert!(mean("mark 0x40") < mean("mark 0x42"));
    assert!(mean("mark 0x42") <= mean("userspace") + 1.0);
    assert!(mean("userspace") < mean("shutdown"));
    assert!(mean("shutdown") <= mean("exit"));
    let rss = mean("peak RSS MiB");
    assert!(rss > 1.0 && rss < 256.0, "{rss}");
}

#[test]
fn analyze_shows_vmm_phases_and_vs_compares_backends_options() {
    let out = ember("analyze", &["-n", "2", "-w", "0", "--min-ms", "0"]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}{}", text(&out.stderr));
    for needle in [
        "vmm:setup",
        "vmm:exec+kvm-open",
        "userspace:work",
        "vmm:teardown",
        "15.00 µs/char",
    ] {
        assert!(s.contains(needle), "{needle} missing:\n{s}");
    }
    // A second configuration that spins 200 ms longer is slower, pair by pair.
    // Six pairs: with three, one slow A boot (this binary's other test boots
    // beside it) widened the t-interval (2 degrees of freedom) past 1.
    let out = ember(
        "bench",
        &[
            "-n",
            "6",
            "-w",
            "0",
            "--vs",
            "cmdline+=spin=200",
            "--metric",
            "shutdown",
        ],
    );
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}{}", text(&out.stderr));
    assert!(s.contains("B is slower by"), "{s}");
}
