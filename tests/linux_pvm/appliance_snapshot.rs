//! End-to-end: `ember run --backend ember -- CMD` on the PVM test kernel
//! starts from a snapshot of the booted appliance (src/appliance/warm.rs).
//!
//! One cold boot makes the snapshot (the first run); later runs restore it,
//! get their own files through the per-run root slot, and report the
//! command's output and status; two restore it at once; the snapshot is
//! never written; a changed kernel or ember-init makes a new one. The
//! channel is a vsock connection, cold and restored (init holds no tty).
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::{PVM_CMDLINE, Scratch, ember, init_binary, pvm_kernel_dir, require_kvm};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Env {
    scratch: Scratch,
    kernel: PathBuf,
    init: PathBuf,
}

impl Env {
    fn cache(&self) -> PathBuf {
        self.scratch.path("cache")
    }

    /// `ember run --backend ember` with this test's cache, kernel and init.
    fn command(&self, extra: &[&str], cmd: &[&str]) -> Command {
        let mut c = ember();
        c.env("EMBER_CACHE", self.cache())
            .env("EMBER_INIT", &self.init)
            .env_remove("EMBER_LOG")
            // Debug log: says whether the run restores or makes a snapshot.
            .args([
                "-v",
                "run",
                "--backend",
                "ember",
                "--initramfs",
                "--mem",
                "128M",
                "--kernel",
            ])
            .arg(&self.kernel)
            .arg("--cmdline")
            .arg(PVM_CMDLINE)
            .args(extra)
            .arg("--")
            .args(cmd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn run(&self, extra: &[&str], cmd: &[&str], stdin: &[u8]) -> (Output, Duration) {
        let start = Instant::now();
        let mut child = self.command(extra, cmd).spawn().expect("start ember");
        child.stdin.take().unwrap().write_all(stdin).unwrap();
        let out = child.wait_with_output().unwrap();
        (out, start.elapsed())
    }

    /// The snapshot directories in the cache.
    fn snapshots(&self) -> Vec<PathBuf> {
        common::appliance_snapshots(&self.cache())
    }
}

/// Shell words that print how the appliance's init holds its channel: the
/// sockets (a vsock connection) and character devices (a console port, a
/// UART) among its descriptors past stdio. Shell builtins only: an exec
/// in the guest costs seconds here.
const CHANNEL_CHECK: &str = "s=0; t=0; for f in /proc/1/fd/*; do case ${f##*/} in 0|1|2) continue;; esac; \
     [ -S $f ] && s=$((s+1)); [ -c $f ] && t=$((t+1)); done; echo channel sockets $s ttys $t";
/// What [`CHANNEL_CHECK`] prints when the channel is a vsock connection
/// (made again after a restore, the snapshot's one gone), not a tty: init
/// holds it and the command's stdout and stderr connections (until the
/// host has read them to their end).
const ON_VSOCK: &str = "channel sockets 3 ttys 0\n";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// (mode, size, mtime) of a snapshot's files: none may change by a run.
fn fingerprint(dir: &Path) -> Vec<(u32, u64, i64, i64)> {
    ["state", "memory"]
        .iter()
        .map(|f| {
            let m = std::fs::metadata(dir.join(f)).unwrap();
            (
                m.permissions().mode() & 0o777,
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
            )
        })
        .collect()
}

#[test]
fn the_appliance_restores_its_snapshot_and_runs_each_command_with_its_own_files() {
    let test = "appliance_snapshot";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let init = init_binary().unwrap_or_else(|e| panic!("{test}: {e}"));
    let scratch = Scratch::new(test);
    // Copies, so the test can change them and see the snapshot replaced.
    let kernel = scratch.path("vmlinux");
    std::fs::copy(kdir.join("vmlinux"), &kernel).unwrap();
    let init_copy = scratch.path("ember-init");
    std::fs::copy(&init, &init_copy).unwrap();
    let env = Env {
        scratch,
        kernel,
        init: init_copy,
    };

    // 1. The first run boots, snapshots at READY, then runs the command.
    let (first, cold) = env.run(
        &["--timeout", "600"],
        &[
            "sh",
            "-c",
            &format!("echo first-$((6*7)); {CHANNEL_CHECK}; echo to-stderr >&2; exit 3"),
        ],
        b"",
    );
    eprintln!("{test}: first run (cold boot + snapshot) {cold:?}");
    assert_eq!(
        first.status.code(),
        Some(3),
        "stderr:\n{}",
        text(&first.stderr)
    );
    assert_eq!(text(&first.stdout), format!("first-42\n{ON_VSOCK}"));
    assert!(text(&first.stderr).contains("to-stderr"));
    let snaps = env.snapshots();
    assert_eq!(snaps.len(), 1, "one snapshot made: {snaps:?}");
    let snap = snaps[0].clone();
    assert!(text(&first.stderr).contains("making snapshot"));
    let print = fingerprint(&snap);
    assert!(print.iter().all(|f| f.0 == 0o400), "read-only: {print:?}");

    // 2. A restore runs a command whose files are this run's own (a script
    //    carried with --file), with stdin, and reports its status.
    let token = format!("token-{}-{}", std::process::id(), cold.as_nanos());
    let script = env.scratch.path("job.sh");
    std::fs::write(
        &script,
        // `basename` is not carried from the host: it is busybox's applet
        // link, which the per-run root must hold (init links only in the
        // initramfs).
        format!(
            "read line\necho \"{token} got $line $(basename /x/applet)\"\n{CHANNEL_CHECK}\nexit 5\n"
        ),
    )
    .unwrap();
    let file_arg = format!("{}:/job.sh", script.display());
    let (second, warm) = env.run(
        &["--timeout", "300", "--file", &file_arg],
        &["sh", "/job.sh"],
        b"from-stdin\n",
    );
    eprintln!("{test}: restored run {warm:?}");
    assert_eq!(
        second.status.code(),
        Some(5),
        "stderr:\n{}",
        text(&second.stderr)
    );
    assert_eq!(
        text(&second.stdout),
        format!("{token} got from-stdin applet\n{ON_VSOCK}")
    );
    assert_eq!(
        env.snapshots(),
        std::slice::from_ref(&snap),
        "restored, not remade"
    );
    assert!(
        text(&second.stderr).contains(&format!("from snapshot {}", snap.display())),
        "{}",
        text(&second.stderr)
    );
    assert!(
        warm * 3 < cold,
        "a restore ({warm:?}) should be far quicker than the first run ({cold:?})"
    );

    // 3. Two runs restore the same snapshot at once.
    let children: Vec<_> = [1, 2]
        .iter()
        .map(|n| {
            let mut c = env
                .command(
                    &["--timeout", "300"],
                    &["sh", "-c", &format!("echo concurrent-{n}; exit 1{n}")],
                )
                .spawn()
                .unwrap();
            drop(c.stdin.take());
            (n, c)
        })
        .collect();
    for (n, c) in children {
        let out = c.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(10 + n),
            "run {n}: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stdout), format!("concurrent-{n}\n"));
    }
    assert_eq!(env.snapshots(), std::slice::from_ref(&snap));
    assert_eq!(fingerprint(&snap), print, "no run wrote to the snapshot");

    // 4. A changed kernel or ember-init is a new snapshot: the run boots
    //    again to make it (cut short: the VM is killed at the timeout).
    let making = |what: &str| {
        let (o, _) = env.run(&["--timeout", "3"], &["true"], b"");
        let err = text(&o.stderr);
        assert!(
            err.contains("making snapshot") && !err.contains(&*snap.to_string_lossy()),
            "after changing {what}, the run must make a new snapshot:\n{err}"
        );
    };
    std::thread::sleep(Duration::from_millis(20));
    std::fs::copy(kdir.join("vmlinux"), env.scratch.path("vmlinux.new")).unwrap();
    std::fs::rename(env.scratch.path("vmlinux.new"), &env.kernel).unwrap();
    making("the kernel");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&env.init)
        .unwrap();
    f.write_all(b"\0changed").unwrap();
    drop(f);
    making("ember-init");
}
