//! End-to-end: `ember run --backend qemu -- CMD` boots the real appliance
//! (Debian's cloud kernel under QEMU/TCG) and checks what comes back.
//!
//! Needs `ember setup` to have run (the kernel in ember's cache) and QEMU;
//! fails loudly otherwise. The ember backend test is opt-in
//! (ignored by default: it needs hardware KVM; `cargo test -- --ignored`).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Builds ember-init (release, as installed) once; returns its path.
fn init_binary() -> &'static PathBuf {
    static INIT: OnceLock<PathBuf> = OnceLock::new();
    INIT.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let status = Command::new(env!("CARGO"))
            .args(["build", "--release", "-p", "ember-init"])
            .current_dir(&root)
            .status()
            .expect("run cargo to build ember-init");
        assert!(status.success(), "building ember-init failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let p = target.join("release/ember-init");
        assert!(p.is_file(), "{} missing", p.display());
        p
    })
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

    let out = run(&["--", "/etc/hostname"], None);
    assert_eq!(out.status.code(), Some(126));
    assert!(
        text(&out.stderr).contains("cannot carry"),
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

#[test]
#[ignore = "needs hardware KVM (Debian's kernel under ember); run with `cargo test -- --ignored`"]
fn ember_backend_runs_a_command_on_hardware_kvm() {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", init_binary())
        .args([
            "run",
            "--backend",
            "ember",
            "--timeout",
            "120",
            "--",
            "sh",
            "-c",
            "uname -r; exit 3",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("cloud-amd64"));
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
    let start = Instant::now();
    let again = setup();
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(
        text(&again.stderr).contains("already set up"),
        "{}",
        text(&again.stderr)
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn rootfs_runs_the_command_from_that_tree() {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("busybox-static is needed for the --rootfs test");
    let root = std::env::temp_dir().join(format!("ember-e2e-rootfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
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
            start.elapsed() < Duration::from_secs(5),
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
    let cache = std::env::temp_dir().join(format!("ember-e2e-nomods-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
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
    assert!(err.contains("lack `virtio_mmio`"), "{err}");
    assert_eq!(err.lines().count(), 1, "one clear line: {err}");
}
