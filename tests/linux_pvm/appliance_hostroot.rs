//! End-to-end: `ember run --backend ember` on the host's own root, served by
//! ember's own virtio-fs device (no virtiofsd), on the PVM test kernel.
//!
//! The first run boots and snapshots the appliance with the host's root and
//! one `--share` mounted, then runs its command; the second restores that
//! snapshot with the share on another directory, read-only this time, and
//! reads the host's root as it is now. Commands are busybox's shell
//! builtins: each exec from the host's root costs this host's emulated
//! guest kernel seconds.
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::{PVM_CMDLINE, Scratch, ember, init_binary, pvm_kernel_dir, require_kvm};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Instant;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `ember -v run --backend ember` in `cwd`, sharing `share` (`DIR:/data[,rw]`).
fn run(
    scratch: &Scratch,
    kernel: &Path,
    init: &Path,
    cwd: &Path,
    share: &str,
    script: &str,
) -> Output {
    let start = Instant::now();
    let out = ember()
        .env("EMBER_CACHE", scratch.path("cache"))
        .env("EMBER_INIT", init)
        .env_remove("EMBER_LOG")
        .current_dir(cwd)
        .args(["-v", "run", "--backend", "ember", "--mem", "256M"])
        .arg("--kernel")
        .arg(kernel)
        .args([
            "--cmdline",
            PVM_CMDLINE,
            "--timeout",
            "600",
            "--share",
            share,
        ])
        .args(["--", "busybox", "sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .expect("start ember");
    eprintln!("appliance_hostroot: `{script}` in {:?}", start.elapsed());
    out
}

fn snapshots(scratch: &Scratch) -> Vec<PathBuf> {
    std::fs::read_dir(scratch.path("cache/snapshots"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_host_root_and_a_share_restore_from_the_snapshot_on_this_runs_directories() {
    let test = "appliance_hostroot";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let init = init_binary().unwrap_or_else(|e| panic!("{test}: {e}"));
    let scratch = Scratch::new(test);
    let kernel = kdir.join("vmlinux");
    let (a, b, home) = (scratch.path("a"), scratch.path("b"), scratch.path("home"));
    for d in [&a, &b, &home] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(a.join("in"), "from-a\n").unwrap();
    std::fs::write(b.join("in"), "from-b\n").unwrap();

    // 1. Boots, snapshots with the root and the share mounted, runs: reads
    //    and writes the share, whose writes the host sees, the caller's.
    let first = run(
        &scratch,
        &kernel,
        &init,
        &home,
        &format!("{}:/data,rw", a.display()),
        "read x < /data/in; echo \"got $x\"; echo written > /data/out",
    );
    let err = text(&first.stderr);
    assert_eq!(first.status.code(), Some(0), "stderr:\n{err}");
    assert_eq!(text(&first.stdout), "got from-a\n", "stderr:\n{err}");
    assert!(err.contains("making snapshot"), "{err}");
    assert_eq!(std::fs::read_to_string(a.join("out")).unwrap(), "written\n");
    let owner = std::fs::metadata(a.join("out")).unwrap();
    // SAFETY: getuid/getgid cannot fail.
    let me = unsafe { (libc::getuid(), libc::getgid()) };
    assert_eq!((owner.uid(), owner.gid()), me);
    assert_eq!(snapshots(&scratch).len(), 1);

    // 2. Restores it with the share on another directory, read-only: the
    //    device opens this run's directory; the root shows a file made after
    //    the snapshot, in the caller's working directory.
    std::fs::write(home.join("late"), "made-after-the-snapshot\n").unwrap();
    let second = run(
        &scratch,
        &kernel,
        &init,
        &home,
        &format!("{}:/data", b.display()),
        "read x < /data/in; echo \"got $x\"; read y < late; echo \"$y\"; \
         (echo no > /data/out) 2>/dev/null || echo refused",
    );
    let err = text(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "stderr:\n{err}");
    assert!(err.contains("from snapshot"), "{err}");
    assert_eq!(
        text(&second.stdout),
        "got from-b\nmade-after-the-snapshot\nrefused\n",
        "stderr:\n{err}"
    );
    assert!(!b.join("out").exists());
    assert_eq!(std::fs::read_to_string(a.join("out")).unwrap(), "written\n");
    assert_eq!(snapshots(&scratch).len(), 1, "the restore made another");
}
