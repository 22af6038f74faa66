//! End to end on real boots: Debian's cloud kernel under QEMU/TCG with the
//! lab's busybox initramfs or the appliance's. A few boots each, so the suite stays quick.

use crate::common;

use std::process::{Command, Output};

fn ember(args: &[&str]) -> Output {
    let kernel = common::debian_bzimage();
    // The subcommand, then the guest, then the test's own options.
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .arg(args[0])
        .args(["--backend", "qemu", "--machine", "q35", "--kernel", &kernel])
        .args(&args[1..])
        .output()
        .expect("ember runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn bench_boots_linux_to_userspace_and_back() {
    let out = ember(&["bench", "--busybox-init", "-n", "2", "-w", "0", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["counted"][0], 2);
    assert!(
        v["header"]["backend_version"]
            .as_str()
            .unwrap()
            .contains("QEMU")
    );
    let accel = v["header"]["accel"].as_str().unwrap();
    assert!(accel.contains("TCG") || accel.contains("KVM"), "{accel}");
    let metric = |name: &str| {
        v["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {v}"))["a"]["mean"]
            .as_f64()
            .unwrap()
    };
    assert!(metric("first output") < metric("kernel"));
    assert!(metric("kernel") < metric("userspace"));
    assert!(metric("userspace") < metric("shutdown"));
    assert!(metric("shutdown") <= metric("exit"));
    assert!(
        metric("peak RSS MiB") > 50.0,
        "QEMU with 256 MiB of guest RAM"
    );
}

#[test]
fn analyze_finds_initcalls_and_draws_the_timeline() {
    let dir = ember_testing::TempDir::new("lab-qemu");
    let (svg, html) = (dir.join("t.svg"), dir.join("t.html"));
    let out = ember(&[
        "analyze",
        "--busybox-init",
        "--cmdline",
        "console=ttyS0 panic=-1 initcall_debug ignore_loglevel",
        "-n",
        "1",
        "-w",
        "0",
        "--svg",
        svg.to_str().unwrap(),
        "--html",
        html.to_str().unwrap(),
    ]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}{}", text(&out.stderr));
    for needle in [
        "Longest activities:",
        "kernel:initcalls",
        "initcall:",
        "userspace:init-script",
        "Console: ",
        "serial line cost",
    ] {
        assert!(s.contains(needle), "{needle} missing:\n{s}");
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.matches("<g class=\"bar\">").count() > 400);
    let html = std::fs::read_to_string(&html).unwrap();
    assert!(html.contains("<svg") && html.contains("initcall:"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// No `--initrd`: the appliance's own initramfs, which reaches userspace
/// (ember-init loads its modules and powers off), as `ember analyze` and
/// `ember bench` boot it for a newcomer.
#[test]
fn without_an_initrd_the_appliance_reaches_userspace() {
    let out = ember(&["bench", "-n", "2", "-w", "0", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["counted"][0], 2, "{v}");
    let initrd = v["header"]["initrd"].as_str().expect("an initrd");
    assert!(initrd.contains("/appliances/"), "{initrd}");
    let out = ember(&["analyze", "-n", "1", "-w", "0"]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}{}", text(&out.stderr));
    assert!(
        s.contains("userspace") && !s.contains("not averaged in"),
        "{s}"
    );
}

/// No init (and no root= to fall back on): the kernel panics. Whether it would then reboot (`panic=-1`;
/// QEMU runs with -no-reboot, so it exits) or wait forever (`panic=0`), the
/// boot ends at the panic line, reported as a panic with its cause, and
/// never counts.
#[test]
fn a_kernel_without_init_panics_and_never_counts() {
    for panic in ["panic=-1", "panic=0"] {
        let cmdline = format!("console=ttyS0 quiet {panic} rdinit=/nonexistent init=/nonexistent");
        let start = std::time::Instant::now();
        let out = ember(&[
            "bench",
            "--busybox-init",
            "--cmdline",
            &cmdline,
            "-n",
            "1",
            "-w",
            "0",
            "--timeout",
            "300",
        ]);
        let took = start.elapsed();
        assert_eq!(out.status.code(), Some(1), "{panic}: {}", text(&out.stderr));
        let s = text(&out.stdout);
        assert!(
            s.contains("1 panicked: `Kernel panic - not syncing: VFS: Unable to mount root fs")
                && !s.contains("timed out"),
            "{panic}: {s}"
        );
        // Far from the timeout: the boot ended when the kernel panicked.
        assert!(took.as_secs() < 150, "{panic}: {took:?}");
    }
}
