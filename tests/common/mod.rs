//! Shared helpers for ember's end-to-end tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The ember binary under test: cargo's, or `EMBER_BIN` (scripts/test points
/// it at the statically linked release binary that scripts/install ships).
pub fn ember() -> Command {
    match std::env::var_os("EMBER_BIN") {
        Some(bin) => Command::new(bin),
        None => Command::new(env!("CARGO_BIN_EXE_ember")),
    }
}

/// Whether this host has a usable /dev/kvm. Without one, KVM tests fail —
/// unless EMBER_ALLOW_NO_KVM=1, in which case they print a loud SKIPPED line.
pub fn require_kvm(test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        if std::env::var_os("EMBER_ALLOW_NO_KVM").is_some() {
            ember::testing::skip(test, "/dev/kvm is not usable on this host");
            return false;
        }
        panic!(
            "{test}: /dev/kvm is not usable (set EMBER_ALLOW_NO_KVM=1 to skip KVM tests loudly)"
        );
    }
    true
}

/// A scratch directory removed at drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("ember-test-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a command, returning its output; panics with context if it cannot start.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// An initramfs holding just `/init` (see [`ember::testing::tiny_initramfs`]).
pub fn tiny_initramfs(path: &Path, msg: &str) {
    std::fs::write(path, ember::testing::tiny_initramfs(msg).unwrap()).unwrap();
}

/// The command line every working boot of the PVM test kernel used (see
/// ../shared/pvm-test-kernel), plus a keyboard-controller reboot so the guest's
/// reboot ends the VM (ember reports it as status 2).
pub const PVM_CMDLINE: &str = "console=ttyS0 noxsave noint3selftest nofxsaveleak \
    clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase noinvpcid nopcid nopku \
    mitigations=off reboot=k panic=-1";

/// The directory holding the PVM test kernel (`vmlinux`, `bzImage`), from
/// EMBER_PVM_KERNEL; `None`, with a loud skip line, when it is not set.
pub fn pvm_kernel_dir(test: &str) -> Option<PathBuf> {
    match std::env::var_os("EMBER_PVM_KERNEL") {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            ember::testing::skip(
                test,
                "EMBER_PVM_KERNEL is not set (scripts/test builds the kernel and sets it)",
            );
            None
        }
    }
}
