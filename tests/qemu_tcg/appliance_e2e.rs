//! End-to-end: `ember run --backend qemu -- CMD` boots the real appliance
//! (Debian's cloud kernel under QEMU/TCG) and checks what comes back.
//!
//! Needs `ember setup` to have run (the kernel in ember's cache) and QEMU;
//! fails loudly otherwise. The ember backend needs hardware KVM: its test
//! is in the nested rig (tests/nested_rig/).

use crate::common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// ember-init (release, as installed), built once.
fn init_binary() -> PathBuf {
    common::init_binary().unwrap_or_else(|e| panic!("{e}"))
}

fn ember(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ember"));
    c.env("EMBER_INIT", init_binary());
    c.arg("run").args(["--backend", "qemu"]);
    c.args(args);
    c
}

/// Runs `ember run --backend qemu ARGS`, feeding `stdin`.
fn run(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut c = ember(&["--timeout", "60"]);
    c.args(args);
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn ember");
    if let Some(data) = stdin {
        let mut w = child.stdin.take().unwrap();
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = w.write_all(&data);
        });
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("no appliance kernel"),
        "run `ember setup` before the e2e tests: {err}"
    );
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// PIDs of live processes whose command line mentions ember's channel
/// socket for ember process `pid` (i.e. VMMs it started).
fn leftover_vmms(pid: u32) -> Vec<u32> {
    let needle = format!("ember-{pid}-");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .collect()
}

#[test]
fn uname_prints_the_guest_kernel() {
    let out = run(&["--", "uname", "-a"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.starts_with("Linux "), "{s}");
    assert!(
        s.contains("cloud-amd64"),
        "guest kernel, not the host's: {s}"
    );
    // Kernel messages stay off stdout and stderr.
    assert!(!s.contains("] "), "{s}");
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

/// `--prepare-only` tells the command line the guest then boots with, and
/// under TCG with one vCPU that line follows the doctor's `nolapic_timer`
/// advice (the APIC timer's calibration is a fixed wait there).
#[test]
fn the_guest_boots_with_the_command_line_prepare_only_reports() {
    let args = ["--cmdline", "ember.test=1", "--", "cat", "/proc/cmdline"];
    let prep = ember(&["--prepare-only"]).args(args).output().unwrap();
    assert!(prep.status.success(), "{}", text(&prep.stderr));
    let v: serde_json::Value = serde_json::from_slice(&prep.stdout).unwrap();
    let cmdline = v["cmdline"].as_str().expect("a cmdline");
    let backend = v["backend"].as_str().expect("a backend");
    assert!(cmdline.ends_with(" ember.test=1"), "{cmdline}");
    assert_eq!(
        cmdline.contains("nolapic_timer"),
        backend.contains("TCG"),
        "{v}"
    );
    let out = run(&args, None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim_end(), cmdline);
}

/// ember-init loads Debian's signed modules without their signatures (the
/// kernel's check is most of what module loading costs: crates/ember-frames/
/// src/module_sig.rs), which taints the kernel `E`; a kernel that enforces
/// signatures gets the signed files and loads them untainted.
#[test]
fn modules_load_without_their_signature_unless_the_kernel_enforces_them() {
    const TAINT_UNSIGNED_MODULE: u64 = 1 << 13;
    let script = "cat /proc/sys/kernel/tainted; ls /sys/module | grep -c '^virtio_console$'";
    let tainted = |extra: &[&str]| {
        let mut args = extra.to_vec();
        args.extend(["--", "sh", "-c", script]);
        let out = run(&args, None);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let s = text(&out.stdout);
        let mut lines = s.lines();
        let taint: u64 = lines.next().and_then(|l| l.parse().ok()).expect(&s);
        assert_eq!(lines.next(), Some("1"), "virtio_console loaded: {s}");
        taint & TAINT_UNSIGNED_MODULE != 0
    };
    assert!(
        tainted(&[]),
        "the modules were loaded with their signatures"
    );
    assert!(
        !tainted(&["--cmdline", "module.sig_enforce=1"]),
        "an enforcing kernel got unsigned modules"
    );
}

#[test]
fn exit_statuses_and_stderr_are_separate() {
    let out = run(&["--", "false"], None);
    assert_eq!(out.status.code(), Some(1));
    let out = run(
        &["--", "sh", "-c", "echo to-out; echo to-err >&2; exit 7"],
        None,
    );
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "to-out\n");
    assert_eq!(text(&out.stderr), "to-err\n");
}

#[test]
fn stdin_passes_through_binary_safe() {
    let data: Vec<u8> = (0..=255u8).cycle().take(20_000).collect();
    let out = run(&["--", "cat"], Some(&data));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(out.stdout.len(), data.len());
    assert!(out.stdout == data, "stdin came back altered");
}

#[test]
fn env_and_workdir() {
    let out = run(
        &[
            "--env",
            "GREETING=hello world",
            "--workdir",
            "/proc",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING\"; pwd",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello world\n/proc\n");
}

#[test]
fn timeout_kills_the_vm_and_leaves_nothing_behind() {
    let mut c = ember(&["--timeout", "3", "--", "sleep", "100"]);
    let start = Instant::now();
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("timed out"));
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(leftover_vmms(pid), Vec::<u32>::new(), "VMM left running");
}

#[test]
fn bad_commands_get_distinct_statuses() {
    let out = run(&["--", "no-such-command-ember"], None);
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out.stderr).contains("command not found"));

    // The initramfs appliance finds out on the host; on the host's root
    // the guest's execve does.
    let out = run(&["--initramfs", "--", "/etc/hostname"], None);
    assert_eq!(out.status.code(), Some(126));
    assert!(
        text(&out.stderr).contains("cannot carry"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&["--", "/etc/hostname"], None);
    assert_eq!(out.status.code(), Some(126), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("cannot execute /etc/hostname"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_vmm_that_dies_is_reported_not_waited_for() {
    // QEMU refuses a "kernel" that is not one and exits at once. (The clock
    // starts after `ember()`, which may first have to build ember-init.)
    let mut c = ember(&["--kernel", "/etc/hostname", "--", "true"]);
    let start = Instant::now();
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("without reporting"),
        "{}",
        text(&out.stderr)
    );
    assert!(start.elapsed() < Duration::from_secs(20));
    assert!(leftover_vmms(pid).is_empty());
}

#[test]
fn unwritable_cache_is_a_clear_error() {
    let kernel = dirs_kernel();
    let out = ember(&["--kernel", kernel.to_str().unwrap(), "--", "true"])
        .env("EMBER_CACHE", "/proc/ember-no-such-dir")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        text(&out.stderr).contains("writable"),
        "{}",
        text(&out.stderr)
    );
}

/// The kernel `ember setup` installed in the default cache.
fn dirs_kernel() -> PathBuf {
    let cache = std::env::var_os("EMBER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("ember")))
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/ember"));
    let ver = std::fs::read_to_string(cache.join("kernel/current"))
        .expect("run `ember setup` before the e2e tests");
    cache.join("kernel").join(ver.trim()).join("vmlinux")
}

// The ember backend (Debian's kernel under ember itself) needs hardware KVM:
// it runs in the nested rig, tests/nested_rig/
// (`appliance_on_the_ember_backend_keeps_streams_and_status`).

/// `--nested-kvm` that cannot work ends with one line and status 125.
fn nested_refusal(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", init_binary())
        .arg("run")
        .args(args)
        .args(["--nested-kvm", "--timeout", "60", "--", "true"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    err
}

#[test]
fn nested_kvm_refuses_the_ember_backend_in_one_line() {
    let err = nested_refusal(&["--backend", "ember"]);
    assert!(err.contains("--backend qemu"), "{err}");
}

#[test]
fn nested_kvm_refuses_a_kernel_without_kvm_amd_in_one_line() {
    // A kernel whose modules cannot be found (no kvm-amd to load).
    let dir = ember_testing::TempDir::new("nested-nomod");
    let k = dir.join("vmlinux-0.0.0-nomodules");
    let _ = std::fs::remove_file(&k);
    std::os::unix::fs::symlink(dirs_kernel(), &k).unwrap();
    let err = nested_refusal(&["--backend", "qemu", "--kernel", k.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(err.contains("kvm-amd"), "{err}");
}

#[test]
fn setup_is_idempotent() {
    let setup = || {
        Command::new(env!("CARGO_BIN_EXE_ember"))
            .env("EMBER_INIT", init_binary())
            .arg("setup")
            .output()
            .unwrap()
    };
    let first = setup();
    assert!(first.status.success(), "{}", text(&first.stderr));
    // What the second run must leave alone: every file of the installed
    // kernel, as it is (its modification time), and nothing added. (Not a
    // time bound: a loaded CI machine made a 10 s one fail.)
    let kernel_dir = dirs_kernel().parent().unwrap().to_owned();
    let files = || {
        let mut v: Vec<(PathBuf, std::time::SystemTime)> = Vec::new();
        let mut todo = vec![kernel_dir.clone()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let m = e.metadata().unwrap();
                if m.is_dir() {
                    todo.push(e.path());
                } else {
                    v.push((e.path(), m.modified().unwrap()));
                }
            }
        }
        v.sort();
        v
    };
    let before = files();
    assert!(!before.is_empty(), "{}", kernel_dir.display());
    let again = setup();
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(
        text(&again.stderr).contains("already set up"),
        "{}",
        text(&again.stderr)
    );
    assert_eq!(files(), before, "the second setup rewrote the kernel");
}

#[test]
fn rootfs_runs_the_command_from_that_tree() {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("busybox-static is needed for the --rootfs test");
    let root = ember_testing::TempDir::new("e2e-rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy(&busybox, root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    std::fs::write(root.join("marker"), "from the rootfs\n").unwrap();
    let out = run(
        &[
            "--rootfs",
            root.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "read l < /marker; echo \"$l\"; exit 3",
        ],
        None,
    );
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "from the rootfs\n");
}

#[test]
fn killing_ember_kills_its_vmm() {
    let mut child = ember(&["--timeout", "60", "--", "sleep", "100"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let start = Instant::now();
    while leftover_vmms(pid).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the VMM never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGKILL: no destructor runs, only the kernel's parent-death signal.
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    while !leftover_vmms(pid).is_empty() {
        assert!(
            // (Headroom for a loaded machine: the kernel kills it at once.)
            start.elapsed() < Duration::from_secs(15),
            "VMM outlived ember: {:?}",
            leftover_vmms(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_kernel_without_the_needed_modules_is_refused() {
    // A private cache whose kernel "9.9.9-nomods" has a modules tree that
    // lacks every virtio driver.
    let cache = ember_testing::TempDir::new("e2e-nomods");
    let ver = "9.9.9-nomods";
    let mods = cache.join("kernel").join(ver).join("lib/modules").join(ver);
    std::fs::create_dir_all(&mods).unwrap();
    std::fs::write(mods.join("modules.order"), "kernel/fs/unrelated.ko\n").unwrap();
    std::fs::write(mods.join("modules.builtin"), "").unwrap();
    let image = cache.join(format!("vmlinux-{ver}"));
    std::fs::copy("/bin/true", &image).unwrap();
    let out = ember(&["--kernel", image.to_str().unwrap(), "--", "true"])
        .env("EMBER_CACHE", &cache)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&cache);
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    // The first module of the first group (`core`: the console channel).
    assert!(err.contains("lack `virtio_console`"), "{err}");
    assert_eq!(err.lines().count(), 1, "one clear line: {err}");
}

#[test]
fn the_vmm_devices_reach_the_command() {
    // --disk with serial=, --rng and --balloon are honoured, not dropped:
    // the guest sees the serial, the virtio-rng and the balloon's driver.
    let img = ember_testing::TempFile::new("e2e-dev", "e2e-dev.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let disk = format!("{},serial=embertest,direct", img.display());
    let out = run(
        &[
            "--rng",
            "--balloon",
            "--disk",
            &disk,
            "--",
            "cat",
            "/sys/block/vda/serial",
            "/sys/devices/virtual/misc/hw_random/rng_current",
            "/sys/bus/virtio/drivers/virtio_balloon/module/initstate",
        ],
        None,
    );
    let _ = std::fs::remove_file(&img);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "embertestvirtio_rng.0\nlive\n");
}

#[test]
fn a_shell_script_finds_the_busybox_userland() {
    let out = run(
        &["--", "sh", "-c", "ls / && cat /proc/cpuinfo | head -1"],
        None,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    assert!(o.contains("proc\n") && o.contains("usr\n"), "{o}");
    assert!(
        o.ends_with("\n") && o.lines().last().unwrap().starts_with("processor"),
        "{o}"
    );
    // --bare carries only the command's files: no `ls` then.
    let out = run(&["--bare", "--", "sh", "-c", "ls /"], None);
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    // --with carries another host command (and its libraries).
    let out = run(
        &[
            "--bare",
            "--with",
            "ls",
            "--",
            "sh",
            "-c",
            "ls /proc/self/exe",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

#[test]
fn pmem_on_q35_is_the_file() {
    // --pmem is a virtio-pmem-pci memory device on QEMU: the command reads
    // the file's bytes through /dev/pmem0 and its write reaches the file.
    let img = ember_testing::TempFile::new("e2e-pmem", "e2e-pmem.img");
    let mut data = vec![0u8; 4 << 20];
    data[..12].copy_from_slice(b"EMBER-PMEM-1");
    std::fs::write(&img, &data).unwrap();
    let out = run(
        &[
            "--pmem",
            img.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "head -c 12 /dev/pmem0; echo; \
             printf written | dd of=/dev/pmem0 bs=1 seek=4096 conv=notrunc,fsync 2>/dev/null",
        ],
        None,
    );
    let back = std::fs::read(&img).unwrap();
    let _ = std::fs::remove_file(&img);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "EMBER-PMEM-1\n");
    assert_eq!(&back[4096..4103], b"written");
}

#[test]
fn no_acpi_is_refused_where_the_guest_cannot_find_devices() {
    // q35 without ACPI (its firmware), and Debian's kernel without ACPI (it
    // cannot read virtio-mmio devices off the command line): one line each,
    // before any boot.
    for (args, why) in [
        (&["--no-acpi"][..], "--machine microvm"),
        (
            &["--machine", "microvm", "--no-acpi"][..],
            "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES",
        ),
    ] {
        let mut all = args.to_vec();
        all.extend(["--", "true"]);
        let out = run(&all, None);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{all:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{all:?}: {err}");
        assert!(err.contains(why), "{all:?}: {err}");
    }
}

#[test]
fn no_acpi_on_microvm_with_a_kernel_that_reads_devices_off_the_command_line() {
    // The PVM test kernel has CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES: microvm
    // without ACPI names the channel on the command line and the command
    // runs in a guest that has no ACPI tables.
    let Some(dir) = common::pvm_kernel_dir("no_acpi_on_microvm") else {
        return;
    };
    let kernel = dir.join("vmlinux");
    let out = run(
        &[
            "--machine",
            "microvm",
            "--no-acpi",
            "--kernel",
            kernel.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "test -e /sys/firmware/acpi/tables || echo no ACPI tables",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "no ACPI tables\n");
}
