//! End-to-end: `ember run --backend qemu -- CMD` on the host's own root
//! (read-only over virtio-fs, a tmpfs overlay for writes; QEMU's
//! vhost-user-fs device served by a virtiofsd ember starts), with Debian's
//! cloud kernel under QEMU/TCG. Needs `ember setup`, QEMU and a virtiofsd
//! (`scripts/install-deps --test` installs the Rust one).

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn ember(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ember"));
    c.env(
        "EMBER_INIT",
        common::init_binary().unwrap_or_else(|e| panic!("{e}")),
    );
    c.args(["run", "--backend", "qemu", "--timeout", "240"]);
    c.args(args);
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Runs `ember run --backend qemu ARGS`, checking the virtiofsd it started
/// while it ran and that none is left once it ended.
fn run(args: &[&str]) -> Output {
    let child = ember(args).spawn().expect("spawn ember");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(
        !err.contains("no appliance kernel"),
        "run `ember setup` before the e2e tests: {err}"
    );
    assert_eq!(daemons(pid), Vec::<u32>::new(), "virtiofsd outlived ember");
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Live virtiofsd processes that ember process `pid` started (their argv[0]
/// names it).
fn daemons(pid: u32) -> Vec<u32> {
    let marker = format!("ember-{pid}-virtiofsd\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.starts_with(marker.as_bytes()))
                && !zombie(*p)
        })
        .collect()
}

/// A dead process not yet reaped by its (new) parent.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

/// The host's own answer to `cmd`.
fn on_host(cmd: &[&str]) -> Output {
    Command::new(cmd[0]).args(&cmd[1..]).output().unwrap()
}

fn ok(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn python3_runs_with_its_standard_library() {
    let cmd = [
        "python3",
        "-c",
        "import sys, json; print(sys.version); print(json.dumps([1]))",
    ];
    let mut args = vec!["--"];
    args.extend(cmd);
    let out = run(&args);
    assert_eq!(ok(&out), ok(&on_host(&cmd)));
    // Nothing but the command's own output on stderr (no fallback notice).
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

#[test]
fn gcc_compiles_a_program_that_then_runs() {
    let dir = ember_testing::TempDir::new("hostroot-gcc");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("hello.c");
    std::fs::write(
        &src,
        "#include <stdio.h>\nint main(int c, char **v) { printf(\"hello %s from %d args\\n\", v[1], c); return 3; }\n",
    )
    .unwrap();
    let exe = dir.join("hello");
    let script = format!(
        "gcc -O2 -o {0} {1} && {0} guest",
        exe.display(),
        src.display()
    );
    let out = run(&["--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello guest from 2 args\n");
    // The program was written in the guest's overlay, not on the host.
    assert!(!exe.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn git_reads_a_host_repository_and_commits_in_the_guest() {
    let dir = ember_testing::TempDir::new("hostroot-git");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let git = |args: &[&str]| {
        let o = Command::new("git")
            .args(["-C", d, "-c", "user.name=t", "-c", "user.email=t@e"])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "git {args:?}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    git(&["init", "-q"]);
    std::fs::write(dir.join("a.txt"), "one\n").unwrap();
    git(&["add", "a.txt"]);
    git(&["commit", "-qm", "first"]);
    let head = git(&["rev-parse", "HEAD"]);
    // In the guest: the host's history, then a commit of its own (in the
    // overlay), from the caller's working directory.
    let script = "git rev-parse HEAD && git log --format=%s && echo two > a.txt && \
                  git -c user.name=g -c user.email=g@e commit -qam second && git log --format=%s";
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", common::init_binary().unwrap())
        .current_dir(&dir)
        .args([
            "run",
            "--backend",
            "qemu",
            "--timeout",
            "240",
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(ok(&out), format!("{head}first\nsecond\nfirst\n"));
    // The guest's commit and edit stayed in the guest.
    assert_eq!(git(&["rev-parse", "HEAD"]), head);
    assert_eq!(std::fs::read_to_string(dir.join("a.txt")).unwrap(), "one\n");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hashbang_script_runs_by_its_path_with_the_callers_environment() {
    let dir = ember_testing::TempDir::new("hostroot-script");
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("greet");
    std::fs::write(
        &script,
        "#!/usr/bin/env python3\nimport os, sys\nprint(os.environ['EMBER_TEST_GREETING'], sys.argv[1], os.getcwd())\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", common::init_binary().unwrap())
        .env("EMBER_TEST_GREETING", "hello")
        .current_dir(&dir)
        .args([
            "run",
            "--backend",
            "qemu",
            "--timeout",
            "240",
            "--",
            "./greet",
            "world",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let cwd = std::fs::canonicalize(&dir).unwrap();
    assert_eq!(ok(&out), format!("hello world {}\n", cwd.display()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A host tree of files of many sizes, binary bytes, a symlink and an
/// empty directory.
fn make_tree(root: &Path) {
    std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
    std::fs::create_dir_all(root.join("empty")).unwrap();
    let mut x: u32 = 0x1234_5678;
    for (i, size) in [0usize, 1, 4095, 4096, 4097, 65_536, 1 << 20, 3_000_001]
        .iter()
        .enumerate()
    {
        let bytes: Vec<u8> = (0..*size)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        let dir = if i % 2 == 0 { "sub" } else { "sub/deeper" };
        std::fs::write(root.join(dir).join(format!("f{i}.bin")), bytes).unwrap();
    }
    std::os::unix::fs::symlink("sub/f2.bin", root.join("link")).unwrap();
}

#[test]
fn a_host_tree_reads_back_byte_for_byte() {
    let dir = ember_testing::TempDir::new("hostroot-tree");
    make_tree(&dir);
    let d = std::fs::canonicalize(&dir).unwrap();
    let script =
        "find . -printf '%y %p %s %l\\n' | sort && find . -type f | sort | xargs sha256sum";
    let guest = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", common::init_binary().unwrap())
        .current_dir(&d)
        .args([
            "run",
            "--backend",
            "qemu",
            "--timeout",
            "240",
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let host = Command::new("sh")
        .args(["-c", script])
        .current_dir(&d)
        .output()
        .unwrap();
    let want = ok(&host);
    assert!(
        want.contains("3000001") && want.lines().count() > 20,
        "{want}"
    );
    assert_eq!(ok(&guest), want);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rw_share_writes_reach_the_host_with_the_callers_owner() {
    let dir = ember_testing::TempDir::new("hostroot-rw");
    std::fs::create_dir_all(&dir).unwrap();
    let share = format!("{}:/mnt/out,rw", dir.display());
    let out = run(&[
        "--share",
        &share,
        "--",
        "sh",
        "-c",
        "echo written > /mnt/out/new && mkdir /mnt/out/d && cat /mnt/out/new",
    ]);
    assert_eq!(ok(&out), "written\n");
    let new = dir.join("new");
    assert_eq!(std::fs::read_to_string(&new).unwrap(), "written\n");
    let m = std::fs::metadata(&new).unwrap();
    // SAFETY: getuid and getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    assert_eq!((m.uid(), m.gid()), (uid, gid));
    assert!(dir.join("d").is_dir());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_read_only_share_and_the_root_keep_the_host_unchanged() {
    let dir = ember_testing::TempDir::new("hostroot-ro");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keep"), "host\n").unwrap();
    let d = std::fs::canonicalize(&dir).unwrap();
    let share = format!("{}:/mnt/in", d.display());
    // The share refuses writes; the root takes them (in guest memory) and
    // the host never sees them.
    let script = format!(
        "cat /mnt/in/keep; echo x > /mnt/in/keep || echo refused; \
         echo guest > {0}/keep && cat {0}/keep; touch {0}/made-in-guest && echo made",
        d.display()
    );
    let out = run(&["--share", &share, "--", "sh", "-c", &script]);
    let stdout = ok(&out);
    assert_eq!(stdout, "host\nrefused\nguest\nmade\n");
    assert!(
        text(&out.stderr).contains("Read-only file system"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(d.join("keep")).unwrap(), "host\n");
    assert!(!d.join("made-in-guest").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_share_confines_symlinks_and_dot_dot_to_its_directory() {
    // outer/ holds the shared directory inner/ and a file beside it; inner
    // has symlinks out (absolute and relative). Every write through them,
    // and through `..`, lands in the guest's overlay, never in outer/.
    let outer = ember_testing::TempDir::new("hostroot-escape");
    let inner = outer.join("inner");
    std::fs::create_dir_all(&inner).unwrap();
    let outer_abs = std::fs::canonicalize(&*outer).unwrap();
    std::fs::write(outer_abs.join("beside"), "outside\n").unwrap();
    std::os::unix::fs::symlink(&outer_abs, inner.join("abs")).unwrap();
    std::os::unix::fs::symlink("..", inner.join("rel")).unwrap();
    let share = format!("{}:/mnt/s,rw", inner.display());
    let script = "echo 1 > /mnt/s/abs/escaped-abs; echo 2 > /mnt/s/rel/escaped-rel; \
                  echo 3 > /mnt/s/../escaped-dotdot; echo 4 > /mnt/s/abs/beside; \
                  ls /mnt/s/rel/ | grep -c . ; echo done";
    let out = run(&["--share", &share, "--", "sh", "-c", script]);
    assert!(ok(&out).ends_with("done\n"), "{}", text(&out.stdout));
    for name in ["escaped-abs", "escaped-rel", "escaped-dotdot"] {
        assert!(!outer_abs.join(name).exists(), "{name} reached the host");
        assert!(!inner.join(name).exists(), "{name} in the share");
    }
    assert_eq!(
        std::fs::read_to_string(outer_abs.join("beside")).unwrap(),
        "outside\n"
    );
    let _ = std::fs::remove_dir_all(&*outer);
}

#[test]
fn bad_shares_are_one_line_errors_before_any_boot() {
    let dir = ember_testing::TempDir::new("hostroot-bad");
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::create_dir_all(dir.join("b")).unwrap();
    let a = format!("{}:/mnt/x", dir.join("a").display());
    let b = format!("{}:/mnt/x,rw", dir.join("b").display());
    for (args, why) in [
        (vec!["--share", "/nonexistent/ember-share"], "No such file"),
        (
            vec!["--share", a.as_str(), "--share", b.as_str()],
            "shared twice",
        ),
        (vec!["--share", a.as_str(), "--initramfs"], "--initramfs"),
        (vec!["--share", "/etc/hostname"], "not a directory"),
    ] {
        let mut all = args.clone();
        all.extend(["--", "true"]);
        let start = Instant::now();
        let out = run(&all);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{all:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{all:?}: {err}");
        assert!(err.contains(why), "{all:?}: {err}");
        assert!(start.elapsed() < Duration::from_secs(10), "{all:?} booted");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_a_virtiofsd_the_initramfs_appliance_runs_and_says_why() {
    let out = ember(&["--", "sh", "-c", "echo ran"])
        .env("EMBER_VIRTIOFSD", "/nonexistent/virtiofsd")
        .output()
        .unwrap();
    assert_eq!(ok(&out), "ran\n");
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("initramfs appliance") && err.contains("virtiofsd"),
        "{err}"
    );
}

/// Starts `ember run ARGS` and waits until its virtiofsd runs; returns the
/// child and the daemons' pids.
fn started(args: &[&str]) -> (std::process::Child, Vec<u32>) {
    let mut child = ember(args).spawn().unwrap();
    let pid = child.id();
    let start = Instant::now();
    let mut d = daemons(pid);
    while d.is_empty() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("virtiofsd never started");
        }
        std::thread::sleep(Duration::from_millis(20));
        d = daemons(pid);
    }
    (child, d)
}

/// Waits until none of `pids` is a live process.
fn gone(pids: &[u32], how: &str) {
    let start = Instant::now();
    while pids
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists() && !zombie(*p))
    {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "virtiofsd {pids:?} outlived ember ({how})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// After each way ember can end, its virtiofsd is gone, and its socket.
#[test]
fn virtiofsd_is_gone_however_ember_ends() {
    let sockets = |pid: u32| -> Vec<PathBuf> {
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("ember-{pid}-fs")))
            })
            .collect()
    };
    // A normal end.
    let (child, pids) = started(&["--", "sh", "-c", "sleep 1; echo ok"]);
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(ok(&out), "ok\n");
    gone(&pids, "normal end");
    assert_eq!(sockets(pid), Vec::<PathBuf>::new());

    // A guest crash: the kernel panics, QEMU ends, then ember.
    let (child, pids) = started(&["--", "sh", "-c", "sleep 1; echo c > /proc/sysrq-trigger"]);
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    gone(&pids, "guest crash");
    assert_eq!(sockets(pid), Vec::<PathBuf>::new());

    // SIGKILL of ember: only the kernel's parent-death signal runs. (Once
    // the guest runs: a socket of a run killed before QEMU connected stays
    // for the next run to sweep.)
    let (mut child, pids) = started(&["--", "sleep", "100"]);
    let pid = child.id();
    let start = Instant::now();
    while !sockets(pid).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the guest never connected"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    gone(&pids, "SIGKILL");
    assert_eq!(sockets(pid), Vec::<PathBuf>::new());
}

/// ember's cache directory as ember finds it (`EMBER_CACHE`, else
/// `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`).
fn cache_dir() -> PathBuf {
    std::env::var_os("EMBER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("ember")))
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ember"))
}

/// The Rust virtiofsd ember would start (`scripts/install-deps` puts it in
/// ~/.cargo/bin).
fn rust_virtiofsd() -> PathBuf {
    let cargo = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    std::env::var_os("EMBER_VIRTIOFSD")
        .map(PathBuf::from)
        .or_else(|| Some(cargo.join("bin/virtiofsd")).filter(|p| p.exists()))
        .expect("no Rust virtiofsd (scripts/install-deps --test installs it)")
}

/// `ember run` by an unprivileged user (nobody; no /dev/kvm needed under
/// TCG) on the host's root, sharing a directory it owns: the virtiofsd runs
/// as the caller in a user namespace, the guest's root mapped to it. The
/// guest's writes reach the host as the caller's files and the guest sees
/// them as its root's; a chown to a user outside the map, and a host file
/// only root may read, are refused in the guest; a directory the caller
/// cannot read is refused in one line before any boot.
#[test]
fn an_unprivileged_caller_shares_a_directory_it_owns() {
    const NOBODY: u32 = 65534;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        ember_testing::skip("hostroot nobody", "changes user (setpriv): run as root");
        return;
    }
    let dir = ember_testing::TempDir::new("hostroot-nobody");
    std::fs::set_permissions(&*dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    // What the caller runs and reads, where it can reach them: its own
    // cache (the kernel and its modules, from this user's), a virtiofsd.
    let cache = dir.join("cache");
    let version = std::fs::read_to_string(cache_dir().join("kernel/current")).unwrap();
    let version = version.trim();
    std::fs::create_dir_all(cache.join("kernel")).unwrap();
    std::fs::write(cache.join("kernel/current"), format!("{version}\n")).unwrap();
    let cp = Command::new("cp")
        .arg("-r")
        .arg(cache_dir().join("kernel").join(version))
        .arg(cache.join("kernel"))
        .status()
        .unwrap();
    assert!(cp.success());
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::copy(rust_virtiofsd(), dir.join("bin/virtiofsd")).unwrap();
    let (share, home, closed) = (dir.join("share"), dir.join("home"), dir.join("closed"));
    for d in [&share, &home, &closed] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(share.join("in"), "theirs\n").unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "root-only\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    for p in [&cache, &share, &home] {
        let st = Command::new("chown")
            .args(["-R", &format!("{NOBODY}:{NOBODY}")])
            .arg(p)
            .status()
            .unwrap();
        assert!(st.success());
    }
    let as_nobody = |share_arg: &str, script: &str| -> Output {
        Command::new("setpriv")
            .args([
                &format!("--reuid={NOBODY}"),
                &format!("--regid={NOBODY}"),
                "--clear-groups",
            ])
            .arg(env!("CARGO_BIN_EXE_ember"))
            .args([
                "run",
                "--backend",
                "qemu",
                "--timeout",
                "240",
                "--share",
                share_arg,
            ])
            .args(["--", "sh", "-c", script])
            .env("HOME", "/nonexistent")
            .env("EMBER_CACHE", &cache)
            .env("EMBER_VIRTIOFSD", dir.join("bin/virtiofsd"))
            .env(
                "EMBER_INIT",
                common::init_binary().unwrap_or_else(|e| panic!("{e}")),
            )
            .current_dir(&home)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let script = format!(
        "cat /data/in; echo mine > /data/mine; stat -c '%u:%g' /data/mine; \
         chown 5 /data/mine 2>/dev/null || echo chown-refused; \
         cat {} 2>/dev/null || echo secret-refused",
        secret.display()
    );
    let out = as_nobody(&format!("{}:/data,rw", share.display()), &script);
    assert_eq!(
        ok(&out),
        "theirs\n0:0\nchown-refused\nsecret-refused\n",
        "{}",
        text(&out.stderr)
    );
    let m = std::fs::metadata(share.join("mine")).unwrap();
    assert_eq!((m.uid(), m.gid()), (NOBODY, NOBODY));
    assert_eq!(
        std::fs::read_to_string(share.join("mine")).unwrap(),
        "mine\n"
    );

    let out = as_nobody(&closed.display().to_string(), "true");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("Permission denied"), "{err}");
}
