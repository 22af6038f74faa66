#![allow(dead_code)]

//! The busybox initramfs of the Linux snapshot test and benchmark: /init
//! says it is ready, then runs one command line from its console and
//! reboots. Shared by `tests/linux_pvm/snapshot_linux.rs`,
//! `tests/linux_pvm/snapshot_balloon.rs` (with an /init of its own) and
//! `examples/busybox-initrd.rs`.

use std::path::Path;

pub const READY: &str = "EMBER-SNAPSHOT-READY";
pub const DONE: &str = "EMBER-CMD-DONE";

/// /init: says it is ready, runs one command line from the console, reboots.
pub const INIT: &str = "#!/bin/sh\nexport PATH=/bin\necho EMBER-SNAPSHOT-READY\nread -r cmd\neval \"$cmd\"\necho EMBER-CMD-DONE\nreboot -f\n";

/// An initramfs with static busybox and the /init above.
pub fn busybox_initramfs(path: &Path) {
    initramfs_with(path, INIT, &["sh", "reboot", "cat", "uname"]);
}

/// An initramfs with static busybox, `applets` linked to it in /bin, and
/// `init` as /init.
pub fn initramfs_with(path: &Path, init: &str, applets: &[&str]) {
    initramfs_with_files(path, init, applets, &[]);
}

/// [`initramfs_with`], plus executables `(path, contents)`.
pub fn initramfs_with_files(path: &Path, init: &str, applets: &[&str], files: &[(&str, &[u8])]) {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("busybox-static is needed (scripts/install-deps installs it)");
    let mut w = ember::initramfs::NewcWriter::new(Vec::new());
    for d in ["/dev", "/bin", "/proc"] {
        w.dir(d, 0o755).unwrap();
    }
    w.char_dev("/dev/console", 0o600, 5, 1).unwrap();
    w.file("/bin/busybox", 0o755, &std::fs::read(busybox).unwrap())
        .unwrap();
    for applet in applets {
        w.symlink(&format!("/bin/{applet}"), "busybox").unwrap();
    }
    for (at, data) in files {
        w.file(at, 0o755, data).unwrap();
    }
    w.file("/init", 0o755, with_vector_tunables(init).as_bytes())
        .unwrap();
    std::fs::write(path, w.finish().unwrap().0).unwrap();
}

/// `init` with, when it is a shell script, the glibc tunables exported
/// first: the PVM test kernel does not switch the vector registers' upper
/// halves between processes, and busybox's glibc `memcpy` would otherwise
/// use them (a busybox segfaulted in CI: ARCHITECTURE.md on `noxsave`).
/// Every program the script starts gets them; the script's own shell is then
/// the only process that may use those registers.
fn with_vector_tunables(init: &str) -> String {
    match init.split_once('\n') {
        Some((shebang, rest)) if shebang.starts_with("#!") => format!(
            "{shebang}\nexport GLIBC_TUNABLES={}\n{rest}",
            ember_frames::GLIBC_HWCAPS
        ),
        _ => init.to_owned(),
    }
}
