//! End-to-end: the PVM test kernel mounts ember's virtio-fs shares (`--fs`):
//! reads a host tree byte for byte, writes, a `ro` share refuses writes,
//! symlinks and `..` pointing out of a share stay inside the guest; a
//! snapshot with a share mounted restores and still reads it; and the
//! device's thread leaves nothing behind however ember ends.
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::busybox::initramfs_with;
use common::console_vm::ConsoleVm as Vm;
use common::{Scratch, ember, pvm_kernel_dir, require_kvm};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SECRET: &str = "HOST-SECRET-7f3a";

/// The host side: `tree/` (shared read-only, as `ro`), `share/` (shared
/// read-write, as `share`, with links pointing out) and `outside/secret`.
struct Host {
    dir: Scratch,
}

impl Host {
    fn new(test: &str) -> Self {
        let dir = Scratch::new(test);
        let tree = dir.path("tree");
        std::fs::create_dir_all(tree.join("a/b/c")).unwrap();
        std::fs::create_dir_all(dir.path("share")).unwrap();
        std::fs::create_dir_all(dir.path("outside")).unwrap();
        std::fs::write(dir.path("outside/secret"), SECRET).unwrap();
        // Sizes around the 1 MiB request limit and the page size, and many
        // small files.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect()
        };
        for (name, len) in [
            ("big", 1 << 20 | 123),
            ("a/text", 0),
            ("a/page", 4096),
            ("a/b/odd", 4097),
            ("a/b/c/empty", 0),
        ] {
            std::fs::write(tree.join(name), bytes(len)).unwrap();
        }
        std::fs::write(tree.join("a/text"), "held across the snapshot\n").unwrap();
        for i in 0..20 {
            std::fs::write(tree.join(format!("a/small{i}")), bytes(i * 7)).unwrap();
        }
        let share = dir.path("share");
        std::os::unix::fs::symlink("/", share.join("abs")).unwrap();
        std::os::unix::fs::symlink("../outside/secret", share.join("rel")).unwrap();
        std::os::unix::fs::symlink(dir.path("outside/secret"), share.join("abs_secret")).unwrap();
        std::fs::write(share.join("before"), "from the host\n").unwrap();
        // root's, 0644: not the guest's user's to write.
        std::fs::write(share.join("roots"), "root's own\n").unwrap();
        Host { dir }
    }

    fn fs_args(&self) -> Vec<OsString> {
        let mut v = Vec::new();
        for (tag, dir, ro) in [("share", "share", ""), ("ro", "tree", ",ro")] {
            v.push("--fs".into());
            v.push(format!("tag={tag},dir={}{ro}", self.dir.path(dir).display()).into());
        }
        v
    }

    fn initrd(&self, init: &str) -> PathBuf {
        let path = self.dir.path("initrd.cpio");
        initramfs_with(&path, init, &[]);
        path
    }
}

/// `a` and `b` hold the same files with the same bytes.
fn same_tree(a: &Path, b: &Path) {
    let mut names: Vec<_> = std::fs::read_dir(a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    let mut theirs: Vec<_> = std::fs::read_dir(b)
        .unwrap_or_else(|e| panic!("{}: {e}", b.display()))
        .map(|e| e.unwrap().file_name())
        .collect();
    theirs.sort();
    assert_eq!(names, theirs, "{} vs {}", a.display(), b.display());
    for n in names {
        let (x, y) = (a.join(&n), b.join(&n));
        if x.is_dir() {
            same_tree(&x, &y);
        } else {
            assert!(
                std::fs::read(&x).unwrap() == std::fs::read(&y).unwrap(),
                "{} differs",
                y.display()
            );
        }
    }
}

/// Processes still holding a descriptor of `dir` or beneath it once ember
/// has ended (its teardown keeper closes its copies as it starts: a moment).
fn left_holding(dir: &Path) -> Vec<String> {
    let start = Instant::now();
    loop {
        let h = holders(dir);
        if h.is_empty() || start.elapsed() > Duration::from_secs(10) {
            return h
                .into_iter()
                .map(|p| {
                    let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                    format!("{p}: {}", String::from_utf8_lossy(&cmd).replace('\0', " "))
                })
                .collect();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Processes holding a descriptor of `dir` or anything beneath it.
fn holders(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| t.starts_with(dir)) {
                found.push(p.file_name().to_string_lossy().into_owned());
                break;
            }
        }
    }
    found
}

const B: &str = "#!/bin/busybox sh\nB=/bin/busybox\n$B mkdir -p /proc /sys /mnt /ro\n\
    $B mount -t proc proc /proc\n\
    $B mount -t virtiofs share /mnt || echo MOUNT-FAILED\n\
    $B mount -t virtiofs ro /ro || echo MOUNT-FAILED\n";

#[test]
fn linux_reads_writes_and_stays_inside_its_shares() {
    let test = "linux_fs";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let host = Host::new(test);
    let init = format!(
        "{B}\
        $B cp -a /ro /mnt/copy\n\
        echo \"CMP=$($B cmp /ro/big /mnt/copy/big && echo same)\"\n\
        echo \"REL=$($B cat /mnt/rel 2>&1)\"\n\
        echo \"ABS=$($B cat /mnt/abs_secret 2>&1)\"\n\
        echo \"ABSROOT=$($B ls /mnt/abs/ 2>&1 | $B tr '\\n' ' ')\"\n\
        for t in 1 2 3; do a=$($B ls /mnt/abs/ 2>&1); r=$($B ls / 2>&1);\
          if [ \"$a\" = \"$r\" ]; then echo ABS-IS-ROOT-$t; break; fi;\
          echo \"ABS-TRY-$t=$(echo $a)|$(echo $r)\"; $B sleep 1; done\n\
        echo \"DOTDOT=$($B ls /mnt/.. | $B tr '\\n' ' ')\"\n\
        echo \"BEFORE=$($B cat /mnt/before)\"\n\
        echo \"ROTOUCH=$($B touch /ro/new 2>&1)\"\n\
        echo \"ROAPPEND=$( (echo x >> /ro/a/page) 2>&1)\"\n\
        echo \"RORM=$($B rm /ro/big 2>&1)\"\n\
        $B mkdir /mnt/d && echo guest-data > /mnt/d/f && $B mv /mnt/d /mnt/e\n\
        $B mkdir -p /etc && echo u:x:1000:1000::/:/bin/sh > /etc/passwd && $B ln -s busybox /bin/sh\n\
        $B mkdir /mnt/pub && $B chmod 777 /mnt/pub\n\
        echo \"USERMADE=$($B su u -c '/bin/busybox touch /mnt/pub/mine && /bin/busybox stat -c %u:%g /mnt/pub/mine' 2>&1)\"\n\
        echo \"USERWRITE=$($B su u -c 'echo x >> /mnt/roots' 2>&1)\"\n\
        $B ln -s target /mnt/link && $B rm /mnt/before\n\
        echo \"STAT=$($B stat -c %s /mnt/copy/big)\"\n\
        $B sync\n\
        echo FS-DONE\n\
        $B reboot -f\n"
    );
    let initrd = host.initrd(&init);
    let args = host.fs_args();
    let extra: Vec<_> = args.iter().map(|a| a.as_os_str()).collect();
    let mut vm = Vm::boot_pvm(&kdir, &initrd, &extra);
    vm.wait_for("FS-DONE", Duration::from_secs(900));
    let status = vm.child.wait().unwrap();
    let log = vm.log.clone();
    assert!(!log.contains("MOUNT-FAILED"), "{log}");
    assert_eq!(status.code(), Some(ember::exit::EXIT_GUEST_RESET), "{log}");
    assert!(log.contains("CMP=same"), "{log}");
    assert!(log.contains("BEFORE=from the host"), "{log}");
    // Links out of the share lead into the guest's own tree, never the host's.
    assert!(!log.contains(SECRET), "a host file leaked:\n{log}");
    assert!(log.contains("REL=cat: can't open '/mnt/rel'"), "{log}");
    assert!(
        log.contains("ABS=cat: can't open '/mnt/abs_secret'"),
        "{log}"
    );
    let line = |what: &str| log.lines().find(|l| l.starts_with(what)).unwrap_or("");
    eprintln!(
        "{test}: {}\n{test}: {}\n{test}: {}",
        line("ABSROOT="),
        line("ABS-IS-ROOT"),
        line("DOTDOT=")
    );
    // An absolute link is resolved by the guest: `/` is the guest's own
    // root (its initramfs: `init`, `mnt`, `ro`), as `..` is, never the host's.
    // Compared in the guest (`ls /mnt/abs/` against `ls /`): a line of the
    // console can be cut by the kernel's own messages on a loaded host. One
    // run in five here once saw ABSROOT= empty (not reproduced since, not
    // explained): the guest tries three times, 1 s apart, and says so.
    assert!(
        !line("ABSROOT=").contains(" usr ") && !line("ABSROOT=").contains(" etc "),
        "the host's root leaked:\n{log}"
    );
    assert!(
        line("ABS-IS-ROOT").starts_with("ABS-IS-ROOT-"),
        "the guest's own /:\n{log}"
    );
    if !line("ABS-TRY-").is_empty() {
        eprintln!(
            "\n!!!!!!!! {test}: /mnt/abs/ was not / at once: {} !!!!!!!!\n",
            line("ABS-TRY-")
        );
    }
    assert!(
        line("DOTDOT=").contains(" mnt "),
        "the guest's own /:\n{log}"
    );
    for what in ["ROTOUCH=", "ROAPPEND=", "RORM="] {
        assert!(line(what).contains("Read-only file system"), "{log}");
    }
    assert!(log.contains(&format!("STAT={}", 1 << 20 | 123)), "{log}");
    // Byte for byte, both ways: the guest read the tree and wrote its copy.
    let share = host.dir.path("share");
    same_tree(&host.dir.path("tree"), &share.join("copy"));
    assert_eq!(
        std::fs::read_to_string(share.join("e/f")).unwrap(),
        "guest-data\n"
    );
    assert_eq!(
        std::fs::read_link(share.join("link")).unwrap(),
        Path::new("target")
    );
    assert!(!share.join("before").exists());
    // A guest process as uid 1000: what it makes is 1000's on the host too,
    // and root's 0644 file refuses it.
    use std::os::unix::fs::MetadataExt;
    assert!(line("USERMADE=").ends_with("=1000:1000"), "{log}");
    let mine = std::fs::metadata(share.join("pub/mine")).unwrap();
    // SAFETY: geteuid has no preconditions.
    let expect = if unsafe { libc::geteuid() } == 0 {
        (1000, 1000)
    } else {
        // SAFETY: as above.
        unsafe { (libc::geteuid(), libc::getegid()) }
    };
    assert_eq!(
        (mine.uid(), mine.gid()),
        expect,
        "the host's owner of pub/mine"
    );
    assert!(line("USERWRITE=").contains("Permission denied"), "{log}");
    assert_eq!(
        std::fs::read_to_string(share.join("roots")).unwrap(),
        "root's own\n"
    );
    let left = left_holding(&share);
    assert!(
        left.is_empty(),
        "after the guest's reboot: {left:?} still hold the share"
    );
    assert!(!host.dir.path("tree/new").exists());
    assert_eq!(
        std::fs::read(host.dir.path("outside/secret")).unwrap(),
        SECRET.as_bytes()
    );
}

#[test]
fn the_share_is_let_go_however_ember_ends() {
    let test = "linux_fs_end";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let host = Host::new(test);
    let share = host.dir.path("share");
    // The guest holds a file open and says so, then panics (init exits) or
    // waits to be killed (a normal end: the first test).
    for end in ["exit 1", "sleep 600"] {
        let init = format!("{B}exec 3</mnt/before\necho HOLDING\n$B sleep 1\n{end}\n");
        let initrd = host.initrd(&init);
        let args = host.fs_args();
        let extra: Vec<_> = args.iter().map(|a| a.as_os_str()).collect();
        let mut vm = Vm::boot_pvm(&kdir, &initrd, &extra);
        vm.wait_for("HOLDING", Duration::from_secs(900));
        let pid = vm.child.id().to_string();
        if end.starts_with("sleep") {
            assert!(holders(&share).contains(&pid), "the check sees ember's own");
            vm.child.kill().unwrap();
        }
        let status = vm.child.wait().unwrap();
        eprintln!("{test}: `{end}` ended ember with {status}");
        let left = holders(&share);
        assert!(
            left.is_empty(),
            "after `{end}`: {left:?} still hold the share"
        );
    }
}

#[test]
fn a_snapshot_with_a_share_mounted_restores_and_still_reads_it() {
    let test = "linux_fs_snapshot";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let host = Host::new(test);
    let init = format!(
        "{B}export PATH=/bin\n$B --install -s /bin\n\
        exec 3</ro/a/text\n\
        echo \"FIRST=$(cat /mnt/before)\"\n\
        echo EMBER-SNAPSHOT-READY\nread -r cmd\neval \"$cmd\"\necho EMBER-CMD-DONE\nreboot -f\n"
    );
    let initrd = host.initrd(&init);
    let sock = host.dir.path("api.sock");
    let snap = host.dir.path("snap");
    let mut args = host.fs_args();
    args.push("--api-socket".into());
    args.push(sock.clone().into());
    let extra: Vec<_> = args.iter().map(|a| a.as_os_str()).collect();
    let mut vm = Vm::boot_pvm(&kdir, &initrd, &extra);
    vm.wait_for("EMBER-SNAPSHOT-READY", Duration::from_secs(900));
    assert!(vm.log.contains("FIRST=from the host"), "{}", vm.log);
    let o = ember()
        .args(["snapshot", "--api-socket"])
        .arg(&sock)
        .arg("--to")
        .arg(&snap)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "snapshot: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    vm.child.wait().unwrap();
    // The host changes the share while the guest is saved.
    std::fs::write(host.dir.path("share/after"), "written while saved\n").unwrap();

    let events = host.dir.path("events.json");
    let mut vm = Vm::spawn(&[
        "--restore".as_ref(),
        snap.as_os_str(),
        "--events".as_ref(),
        events.as_os_str(),
    ]);
    writeln!(
        vm.stdin,
        "echo \"AGAIN=$(cat /mnt/before)\"; echo \"AFTER=$(cat /mnt/after)\"; \
         echo \"HELD=$(cat <&3)\"; echo \"SIZE=$(stat -c %s /ro/big)\"; \
         echo restored > /mnt/restored"
    )
    .unwrap();
    let start = Instant::now();
    vm.wait_for("EMBER-CMD-DONE", Duration::from_secs(300));
    let took = start.elapsed();
    let status = vm.child.wait().unwrap();
    let log = vm.log.clone();
    assert_eq!(status.code(), Some(ember::exit::EXIT_GUEST_RESET), "{log}");
    assert!(log.contains("AGAIN=from the host"), "{log}");
    assert!(log.contains("AFTER=written while saved"), "{log}");
    assert!(
        log.contains("HELD=held across the snapshot"),
        "a file open across the snapshot:\n{log}"
    );
    assert!(log.contains(&format!("SIZE={}", 1 << 20 | 123)), "{log}");
    assert_eq!(
        std::fs::read_to_string(host.dir.path("share/restored")).unwrap(),
        "restored\n"
    );
    let ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&events).unwrap()).unwrap();
    let first = ev["events"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["kind"] == "first_guest_entry"))
        .and_then(|e| e["t_us"].as_f64());
    eprintln!("{test}: restore -> first guest entry {first:?} us; to the command's end {took:?}");
}
