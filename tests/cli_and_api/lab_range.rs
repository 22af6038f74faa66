//! `ember bench-range` on a scratch git repository whose "build" produces a
//! stand-in VMM script: one commit makes the boot slower, one changes nothing,
//! one breaks the build. Checks the marks, the error line and resuming.

use std::path::Path;
use std::process::{Command, Output};

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=lab", "-c", "user.email=lab@example.com"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Commits a `build.sh` that writes `out/vmm`, a VMM stand-in that spends
/// `delay` seconds "in the kernel".
fn commit(repo: &Path, delay: &str, message: &str, broken: bool) {
    let vmm = format!(
        "#!/bin/sh\n[ \"$1\" = --version ] && {{ echo fake; exit 0; }}\n\
         echo '[    0.000000] Linux version 6.1'\nsleep {delay}\n\
         echo '[    0.010000] Run /init as init process'\necho '[    0.020000] reboot: Power down'\n"
    );
    std::fs::write(repo.join("vmm.in"), vmm).unwrap();
    let build = if broken {
        "#!/bin/sh\necho 'cc: error: this commit does not build' >&2\nexit 2\n"
    } else {
        "#!/bin/sh\nmkdir -p out && cp vmm.in out/vmm && chmod +x out/vmm\n"
    };
    std::fs::write(repo.join("build.sh"), build).unwrap();
    git(repo, &["add", "-A"]);
    git(repo, &["commit", "-q", "--allow-empty", "-m", message]);
}

fn run(repo: &Path, cache: &Path, range: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .arg("bench-range")
        .arg(repo)
        .arg(range)
        .args([
            "--build",
            "sh build.sh",
            "--artifact",
            "out/vmm",
            "--artifact-kind",
            "vmm",
        ])
        .args(["--backend", "qemu", "--accel", "tcg", "--kernel", "/bin/sh"])
        .arg("--no-initrd")
        // alpha 0.001: identical commits must not be flagged, even on a noisy machine.
        .args([
            "-n",
            "6",
            "-w",
            "0",
            "--metric",
            "userspace",
            "--alpha",
            "0.001",
        ])
        .arg("--cache-dir")
        .arg(cache)
        .output()
        .unwrap()
}

#[test]
fn range_marks_the_regression_and_resumes() {
    let root = ember_testing::TempDir::new("lab-range");
    let (repo, cache) = (root.join("repo"), root.join("cache"));
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q"]);
    commit(&repo, "0.02", "base", false);
    commit(&repo, "0.02", "docs only", false);
    // 40x slower: one boot slowed by half a second on a loaded machine must
    // not hide the regression at alpha 0.001 (it did at 15x).
    commit(&repo, "0.80", "add a slow probe", false);
    commit(&repo, "0.80", "half-finished refactor", true);
    commit(&repo, "0.02", "remove the slow probe", false);

    let out = run(&repo, &cache, "HEAD");
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One line per commit, oldest first.
    assert_eq!(s.lines().count(), 5, "{s}");
    let line_of = |subject: &str| {
        s.lines()
            .find(|l| l.ends_with(subject))
            .unwrap_or_else(|| panic!("{subject} missing:\n{s}"))
            .to_owned()
    };
    assert!(!line_of("docs only").contains('%'), "{s}");
    assert!(
        line_of("add a slow probe").contains("↓ regresses by"),
        "{s}"
    );
    assert!(
        line_of("half-finished refactor").contains("error: build failed"),
        "{s}"
    );
    // Compared with the last commit that was measured.
    assert!(
        line_of("remove the slow probe").contains("↑ improves by"),
        "{s}"
    );

    // Everything is cached now: a rerun measures nothing and prints the same.
    let again = run(&repo, &cache, "HEAD");
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("5 cached, 0 to measure"), "{err}");
    assert_eq!(String::from_utf8_lossy(&again.stdout), s);

    let bad = run(&repo, &cache, "nosuchref..HEAD");
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("git rev-list"));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn kernel_artifacts_are_booted_as_the_guest_kernel() {
    let guest = ember_testing::test_guest().expect("the test guest builds");
    let root = ember_testing::TempDir::new("lab-range-kernel");
    let (repo, cache) = (root.join("repo"), root.join("cache"));
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q"]);
    // The "build" copies the test guest in: every commit yields a bootable kernel.
    let build = format!(
        "#!/bin/sh\nmkdir -p out && cp {} out/kernel\n",
        guest.display()
    );
    std::fs::write(repo.join("build.sh"), build).unwrap();
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "first kernel"]);
    git(
        &repo,
        &["commit", "-q", "--allow-empty", "-m", "second kernel"],
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .arg("bench-range")
        .arg(&repo)
        .arg("HEAD")
        .args(["--build", "sh build.sh", "--artifact", "out/kernel"])
        .args([
            "--backend",
            "ember",
            "--cmdline",
            "console=ttyS0",
            // The test guest is no Linux: no initramfs.
            "--no-initrd",
            "-n",
            "3",
            "-w",
            "0",
        ])
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(s.matches("ms n=3").count(), 2, "{s}");
    let state = std::fs::read_to_string(cache.join("state.json")).unwrap();
    assert!(state.contains("kind=Kernel"), "{state}");
    let _ = std::fs::remove_dir_all(&root);
}
