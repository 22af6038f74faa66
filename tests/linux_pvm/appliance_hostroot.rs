//! End-to-end: `ember run --backend ember` on the host's own root, served by
//! ember's own virtio-fs device (no virtiofsd), on the PVM test kernel.
//!
//! The first run boots and snapshots the appliance with the host's root and
//! one `--share` mounted, then runs its command; the second restores that
//! snapshot with the share on another directory, read-only this time, and
//! reads the host's root as it is now, and runs the host's python3 and gcc
//! (compiling and running a program) from it. Otherwise commands are
//! busybox's shell builtins: each exec from the host's root costs this
//! host's emulated guest kernel seconds (python3 and gcc take minutes here;
//! hence the generous timeout). Steps 3 and 4 run as an unprivileged user:
//! what works, and what is refused in one line.
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::{PVM_CMDLINE, Scratch, ember, init_binary, pvm_kernel_dir, require_kvm};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Instant;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `ember -v run --backend ember` in `cwd`, sharing `share` (`DIR:/data[,rw]`),
/// as the user `setpriv` makes of `user` when it is not empty.
fn run(
    scratch: &Scratch,
    kernel: &Path,
    init: &Path,
    cwd: &Path,
    share: &str,
    script: &str,
    user: &[String],
) -> Output {
    let start = Instant::now();
    let mut cmd = if user.is_empty() {
        ember()
    } else {
        let mut c = Command::new("setpriv");
        c.args(user).arg(ember().get_program());
        c
    };
    let out = cmd
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
            "1500",
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
    // Step 3 runs as an unprivileged user: the kernel (copied out of a
    // home the user cannot enter), the cache and the scratch directory are
    // where it can reach them, from the first run on (the snapshot's key
    // holds the kernel's path).
    std::fs::set_permissions(&*scratch.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let kernel = scratch.path("vmlinux");
    std::fs::copy(kdir.join("vmlinux"), &kernel).unwrap();
    std::fs::set_permissions(&kernel, std::fs::Permissions::from_mode(0o644)).unwrap();
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
        &[],
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
    assert_eq!(common::appliance_snapshots(&scratch.path("cache")).len(), 1);

    // 2. Restores it with the share on another directory, read-only: the
    //    device opens this run's directory; the root shows a file made after
    //    the snapshot, in the caller's working directory; the host's python3
    //    runs, and its gcc compiles a program (in the guest's own /tmp) that
    //    then runs.
    std::fs::write(home.join("late"), "made-after-the-snapshot\n").unwrap();
    let second = run(
        &scratch,
        &kernel,
        &init,
        &home,
        &format!("{}:/data", b.display()),
        "read x < /data/in; echo \"got $x\"; read y < late; echo \"$y\"; \
         (echo no > /data/out) 2>/dev/null || echo refused; \
         python3 -c 'import sys; print(\"python\", sys.version_info[0] * 6 * 7 // 3)'; \
         printf '#include <stdio.h>\\nint main(void) { printf(\"gcc %%d\\\\n\", 6 * 7); return 0; }\\n' \
         > /tmp/t.c && gcc -o /tmp/t /tmp/t.c && /tmp/t",
        &[],
    );
    let err = text(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "stderr:\n{err}");
    assert!(err.contains("from snapshot"), "{err}");
    assert_eq!(
        text(&second.stdout),
        "got from-b\nmade-after-the-snapshot\nrefused\npython 42\ngcc 42\n",
        "stderr:\n{err}"
    );
    assert!(!b.join("out").exists());
    assert_eq!(std::fs::read_to_string(a.join("out")).unwrap(), "written\n");
    assert_eq!(
        common::appliance_snapshots(&scratch.path("cache")).len(),
        1,
        "the restore made another"
    );

    // 3. An unprivileged caller (nobody, in /dev/kvm's group) restores the
    //    same snapshot (the cache made its own, as root's) and shares a
    //    directory it owns: ember cannot switch to the guest's users, so
    //    every request is served as the caller's own, and the host's
    //    permissions are the caller's. The guest sees the caller as its root
    //    (its files 0:0, root's the overflow id), as virtiofsd shows them on
    //    the QEMU backend: the map is this run's, not the snapshot's maker's.
    //    Its writes reach the host as the caller's files; a chown within the
    //    map works, one outside it, and a host file only root may read, are
    //    refused in the guest.
    let Some(nobody) = unprivileged(test) else {
        return;
    };
    let (c, secret) = (scratch.path("c"), scratch.path("secret"));
    std::fs::create_dir_all(&c).unwrap();
    std::fs::write(c.join("in"), "from-c\n").unwrap();
    std::fs::write(&secret, "root-only\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    for p in [&c, &home, &scratch.path("cache")] {
        chown(p, NOBODY);
    }
    let third = run(
        &scratch,
        &kernel,
        &init,
        &home,
        &format!("{}:/data,rw", c.display()),
        &format!(
            "read x < /data/in; echo \"got $x\"; echo mine > /data/mine; \
             chown 0:0 /data/mine && echo chown-in-map; \
             chown 5 /data/mine 2>/dev/null || echo chown-refused; \
             busybox stat -c %u:%g /data/in /data/mine {s}; \
             (read y < {s}) 2>/dev/null || echo secret-refused",
            s = secret.display()
        ),
        &nobody,
    );
    let err = text(&third.stderr);
    assert_eq!(third.status.code(), Some(0), "stderr:\n{err}");
    assert!(err.contains("from snapshot"), "{err}");
    assert_eq!(
        text(&third.stdout),
        "got from-c\nchown-in-map\nchown-refused\n0:0\n0:0\n65534:65534\nsecret-refused\n",
        "stderr:\n{err}"
    );
    let m = std::fs::metadata(c.join("mine")).unwrap();
    assert_eq!((m.uid(), m.gid()), (NOBODY, kvm_gid()));
    assert_eq!(std::fs::read_to_string(c.join("mine")).unwrap(), "mine\n");

    // 4. What the caller cannot do is one line, before any boot: share a
    //    directory it cannot read; run without access to /dev/kvm.
    let closed = scratch.path("closed");
    std::fs::create_dir_all(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let no_kvm = [
        format!("--reuid={NOBODY}"),
        format!("--regid={NOBODY}"),
        "--clear-groups".to_owned(),
    ];
    for (share, user, want) in [
        (&closed, &nobody[..], "Permission denied"),
        (&c, &no_kvm[..], "no permission to open /dev/kvm"),
    ] {
        let out = run(
            &scratch,
            &kernel,
            &init,
            &home,
            &share.display().to_string(),
            "true",
            user,
        );
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{err}");
        // (`-v`'s debug lines aside.)
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("ember: debug:"))
            .collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        assert!(lines[0].contains(want), "{err}");
    }
}

/// The unprivileged user step 3 runs as.
const NOBODY: u32 = 65534;

fn kvm_gid() -> u32 {
    std::fs::metadata("/dev/kvm").unwrap().gid()
}

/// `setpriv` arguments making `nobody` with /dev/kvm's group, or `None`
/// (said) when this test is not root and so cannot change user.
fn unprivileged(test: &str) -> Option<Vec<String>> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        ember_testing::skip(test, "step 3 changes user (setpriv): run as root");
        return None;
    }
    Some(vec![
        format!("--reuid={NOBODY}"),
        format!("--regid={}", kvm_gid()),
        "--clear-groups".to_owned(),
    ])
}

/// `chown -R NOBODY:/dev/kvm's group PATH`.
fn chown(path: &Path, uid: u32) {
    let st = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{}", kvm_gid()))
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success(), "chown -R {}", path.display());
}
