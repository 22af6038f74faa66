//! `ember bench` / `ember analyze` through the binary, driven by stand-in VMMs
//! (shell scripts passed as `--vmm`, printing what a Linux boot prints) so the
//! plumbing, the statistics and the error paths are tested in seconds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A scratch directory, removed when the test ends (passed or not).
fn scratch(name: &str) -> ember_testing::TempDir {
    ember_testing::TempDir::new(&format!("lab-cli-{name}"))
}

/// A stand-in VMM: prints a short Linux-like boot, sleeping `delay` seconds in
/// the kernel phase.
fn fake_vmm(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    let version = "[ \"$1\" = --version ] && { echo 'fake-vmm 1.0'; exit 0; }";
    std::fs::write(&p, format!("#!/bin/sh\n{version}\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn linux_like(delay: &str) -> String {
    format!(
        "echo '[    0.000000] Linux version 6.1.0-fake'\nsleep {delay}\n\
         echo '[    0.010000] Run /init as init process'\necho 'ember-lab: poweroff'\n\
         echo '[    0.020000] reboot: Power down'"
    )
}

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("ember runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A stand-in VMM booting a stand-in kernel, with no initramfs: the
/// appliance's (the default) is for real kernels.
fn base(vmm: &str) -> Vec<&str> {
    vec![
        "--backend",
        "qemu",
        "--accel",
        "tcg",
        "--vmm",
        vmm,
        "--kernel",
        "/bin/sh",
        "--no-initrd",
    ]
}

/// With no `--kernel` and no `--initrd`, the kernel `ember setup` chose and
/// the appliance's initramfs (ember-init, here a stand-in, in ember's cache),
/// as a newcomer's first `ember bench` boots them.
#[test]
fn without_kernel_the_lab_boots_the_one_setup_chose() {
    let d = scratch("setup-kernel");
    let vmm = fake_vmm(&d, "vmm", &linux_like("0.01"));
    let kernel = fake_vmm(&d, "vmlinuz", "");
    let with_cache = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(args)
            .env("EMBER_CACHE", d.join("cache"))
            .env("EMBER_INIT", "/bin/true")
            .output()
            .unwrap()
    };
    let out = with_cache(&["setup", "--kernel", kernel.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for sub in ["bench", "analyze"] {
        let mut args = vec![sub];
        args.extend(&base(vmm.to_str().unwrap())[..6]);
        args.extend(["-n", "1", "-w", "0", "--json"]);
        let out = with_cache(&args);
        assert!(out.status.success(), "{sub}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["header"]["kernel"], kernel.to_str().unwrap(), "{sub}");
        let initrd = Path::new(v["header"]["initrd"].as_str().expect("an initrd"));
        assert!(
            initrd.starts_with(d.join("cache/appliances")),
            "{sub}: {}",
            initrd.display()
        );
        let cpio = std::fs::read(initrd).unwrap();
        let init = std::fs::read("/bin/true").unwrap();
        assert!(
            cpio.starts_with(b"070701") && cpio.windows(init.len()).any(|w| w == init),
            "{sub}: the appliance does not carry ember-init"
        );
    }
    // --no-initrd: none.
    let mut args = vec!["bench"];
    args.extend(&base(vmm.to_str().unwrap())[..6]);
    args.extend(["--no-initrd", "-n", "1", "-w", "0", "--json"]);
    let out = with_cache(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["header"]["initrd"].is_null(), "{}", v["header"]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bench_json_reports_every_milestone() {
    let d = scratch("json");
    let vmm = fake_vmm(&d, "vmm", &linux_like("0.05"));
    let mut args = vec!["bench"];
    args.extend(base(vmm.to_str().unwrap()));
    args.extend(["-n", "3", "-w", "1", "--json"]);
    let out = ember(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["counted"][0], 3);
    assert_eq!(v["header"]["backend"], "qemu");
    assert!(v["header"]["accel"].as_str().unwrap().contains("TCG"));
    let metrics: Vec<&str> = v["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        metrics,
        [
            "first output",
            "kernel",
            "userspace",
            "shutdown",
            "exit",
            "peak RSS MiB"
        ]
    );
    let userspace = &v["metrics"][2]["a"];
    assert_eq!(userspace["n"], 3);
    // The script sleeps 50 ms between the kernel line and userspace.
    assert!(userspace["min"].as_f64().unwrap() >= 50.0, "{userspace}");
}

#[test]
fn vs_compares_pair_by_pair() {
    let d = scratch("vs");
    let fast = fake_vmm(&d, "fast", &linux_like("0.02"));
    let slow = fake_vmm(&d, "slow", &linux_like("0.25"));
    let vs = format!("vmm={}", slow.display());
    let mut args = vec!["bench"];
    args.extend(base(fast.to_str().unwrap()));
    args.extend(["-n", "4", "-w", "0", "--vs", &vs, "--metric", "userspace"]);
    let out = ember(&args);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}{}", text(&out.stderr));
    assert!(s.contains("config: A") && s.contains("config: B"), "{s}");
    let pairs = s
        .lines()
        .find_map(|l| l.strip_prefix("B/A of `userspace`, pair by pair: "))
        .unwrap_or_else(|| panic!("no pair line:\n{s}"));
    assert_eq!(pairs.split_whitespace().count(), 4, "{pairs}");
    assert!(s.contains("geometric mean"), "{s}");
    assert!(s.contains("B is slower by"), "{s}");

    let mut args = vec!["bench"];
    args.extend(base(fast.to_str().unwrap()));
    args.extend(["-n", "2", "-w", "0", "--vs", &vs, "--metric", "nonsense"]);
    let s = text(&ember(&args).stdout);
    assert!(s.contains("B/A of `nonsense`: not available"), "{s}");
    assert!(
        s.contains("figures: first output, kernel, userspace"),
        "{s}"
    );
}

#[test]
fn a_hung_boot_times_out_and_is_not_averaged() {
    let d = scratch("hang");
    let vmm = fake_vmm(
        &d,
        "vmm",
        "echo '[    0.000000] Linux version 6.1'\nexec sleep 30",
    );
    let mut args = vec!["bench"];
    args.extend(base(vmm.to_str().unwrap()));
    args.extend(["-n", "2", "-w", "0", "--timeout", "0.5"]);
    let start = Instant::now();
    let out = ember(&args);
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    assert!(s.contains("2 timed out after 0.5 s"), "{s}");
    assert!(s.contains("last console line: `Linux version 6.1`"), "{s}");
    assert!(text(&out.stderr).contains("no boot counted (see above)"));

    // analyze says the same, with the timeout it ran under.
    let mut args = vec!["analyze"];
    args.extend(base(vmm.to_str().unwrap()));
    args.extend(["-n", "1", "-w", "0", "--timeout", "0.5"]);
    let out = ember(&args);
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    assert!(s.contains("1 timed out after 0.5 s"), "{s}");
}

#[test]
fn a_kernel_that_never_reaches_userspace_is_reported() {
    let d = scratch("panic");
    let vmm = fake_vmm(
        &d,
        "vmm",
        "echo '[    0.500000] Kernel panic - not syncing: No working init found.'",
    );
    let mut args = vec!["analyze"];
    args.extend(base(vmm.to_str().unwrap()));
    args.extend(["-n", "2", "-w", "0"]);
    let out = ember(&args);
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    assert!(
        s.contains("2 panicked (the first: `Kernel panic - not syncing: No working init found.`)"),
        "{s}"
    );
    assert!(s.contains("nothing to analyse"), "{s}");

    // A kernel that waits after its panic (`panic=0`) ends its boot at once,
    // reported as a panic with its cause, not a timeout.
    let waits = fake_vmm(
        &d,
        "waits",
        "echo '[    0.000000] Linux version 6.1'\n\
         echo '[    0.400000] Kernel panic - not syncing: VFS: Unable to mount root fs'\n\
         exec sleep 60",
    );
    let mut args = vec!["bench"];
    args.extend(base(waits.to_str().unwrap()));
    args.extend(["-n", "1", "-w", "0", "--timeout", "30"]);
    let start = Instant::now();
    let out = ember(&args);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    assert!(
        s.contains("1 panicked: `Kernel panic - not syncing: VFS: Unable to mount root fs`")
            && !s.contains("timed out")
            && !s.contains("last console line"),
        "{s}"
    );
}

#[test]
fn bad_input_gives_one_clear_line() {
    let d = scratch("bad");
    let out = ember(&[
        "bench",
        "--backend",
        "qemu",
        "--vmm",
        "/nonexistent/qemu",
        "--kernel",
        "/bin/sh",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert!(
        e.contains("`/nonexistent/qemu` not found or not executable"),
        "{e}"
    );

    let out = ember(&["bench", "-n", "0", "--kernel", "/bin/sh"]);
    assert!(text(&out.stderr).contains("-n/--runs must be at least 1"));

    let out = ember(&["bench", "--backend", "bochs", "--kernel", "/bin/sh"]);
    assert!(text(&out.stderr).contains("invalid value 'bochs' for '--backend <BACKEND>'"));

    let out = ember(&[
        "bench",
        "--backend",
        "qemu",
        "--kernel",
        "/nonexistent/vmlinuz",
    ]);
    assert!(text(&out.stderr).contains("kernel /nonexistent/vmlinuz does not exist"));

    let rules = d.join("bad.rules");
    std::fs::write(&rules, "[x]\nstart = (unclosed\nend = y\n").unwrap();
    let vmm = fake_vmm(&d, "vmm", &linux_like("0"));
    let mut args = vec!["analyze", "--rules", rules.to_str().unwrap()];
    args.extend(base(vmm.to_str().unwrap()));
    let out = ember(&args);
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert!(e.contains("bad.rules:2: bad regex in `start`"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");

    let broken = fake_vmm(
        &d,
        "broken",
        "echo 'qemu: could not load kernel' >&2; exit 1",
    );
    let mut args = vec!["bench"];
    args.extend(base(broken.to_str().unwrap()));
    let out = ember(&args);
    let e = text(&out.stderr);
    assert!(e.contains("failed at once (exit status 1)"), "{e}");
    assert!(e.contains("could not load kernel"), "{e}");
}

#[test]
fn ctrl_c_stops_and_reports_what_was_measured() {
    let d = scratch("sigint");
    let vmm = fake_vmm(&d, "vmm", &linux_like("0.1"));
    // Ctrl-C at a terminal: SIGINT at its default in ember, whatever this
    // test inherited. A suite started in the background by a script (`cmd &`
    // without job control) has it ignored, and ember rightly leaves an
    // ignored SIGINT ignored, so without this the series ran all 500 boots.
    let child = Command::new("env")
        .arg("--default-signal=INT")
        .arg(env!("CARGO_BIN_EXE_ember"))
        .args([
            "bench",
            "--backend",
            "qemu",
            "--accel",
            "tcg",
            "--kernel",
            "/bin/sh",
            "--no-initrd",
        ])
        .arg("--vmm")
        .arg(&vmm)
        .args(["-n", "500", "-w", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    // SAFETY: kill() on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("INTERRUPTED, partial results"), "{s}");
    assert!(s.contains("Result: "), "{s}");
}

#[test]
fn analyze_loads_a_recording_with_extra_rules() {
    let d = scratch("load");
    let rules = d.join("pci.rules");
    std::fs::write(
        &rules,
        "[kernel:pci]\nstart = ^PCI: Using configuration type\nend = ^pci_bus 0000:00: resource\nparent = kernel\n",
    )
    .unwrap();
    let rec = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/lab/qemu-q35-tcg-initcall-debug.json"
    );
    let svg = d.join("t.svg");
    let out = ember(&[
        "analyze",
        "--load",
        rec,
        "--rules",
        rules.to_str().unwrap(),
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let acts = v["activities"].as_array().unwrap();
    let pci = acts
        .iter()
        .find(|a| a["name"] == "kernel:pci")
        .expect("the user rule matched");
    assert_eq!(pci["depth"], 2);
    assert!(pci["duration_ms"]["mean"].as_f64().unwrap() > 0.0);
    assert!(acts.iter().any(|a| a["name"] == "initcall:acpi_init"));
    assert_eq!(v["header"]["backend"], "qemu");
    assert!(
        std::fs::read_to_string(&svg)
            .unwrap()
            .contains("kernel:pci")
    );
}
