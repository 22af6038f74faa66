//! Shared helpers for ember's end-to-end tests.
#![allow(dead_code)]

pub mod booted;
pub mod busybox;
pub mod console_vm;
pub mod containers;
pub mod memtouch;
pub mod netns;

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

// Not every test binary that includes this module needs KVM.
#[allow(unused_imports)]
pub use ember_testing::require_kvm;

/// A test's scratch directory: ember-testing's [`TempDir`] (private, removed
/// at drop however the test ends), with the paths of the files in it.
///
/// [`TempDir`]: ember_testing::TempDir
pub struct Scratch(pub ember_testing::TempDir);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        Scratch(ember_testing::TempDir::new(&format!("test-{name}")))
    }
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

/// Writes `len` bytes of a fixed pattern to `path` (a file for a guest to
/// fetch) and returns their md5, as `md5sum` prints it.
pub fn pattern_file(path: &Path, len: u32) -> String {
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(path, &bytes).unwrap();
    let out = output(Command::new("md5sum").arg(path));
    let sum = String::from_utf8_lossy(&out.stdout);
    sum.split_whitespace().next().unwrap_or_default().to_owned()
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

/// An initramfs holding just `/init` (see [`ember_testing::tiny_init_elf`]).
pub fn tiny_initramfs(path: &Path, msg: &str) {
    let init = ember_testing::tiny_init_elf(msg);
    std::fs::write(path, ember::initramfs::with_init(&init).unwrap()).unwrap();
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
            ember_testing::skip(
                test,
                "EMBER_PVM_KERNEL is not set (scripts/test builds the kernel and sets it)",
            );
            None
        }
    }
}

/// Builds ember-init (release, as `scripts/install` installs it: the appliance
/// and the nested rig's L1 run it as their init) once; returns its path.
pub fn init_binary() -> Result<PathBuf, String> {
    static INIT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    INIT.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let status = Command::new(env!("CARGO"))
            .args(["build", "--release", "--quiet", "-p", "ember-init"])
            .current_dir(&root)
            .status()
            .map_err(|e| format!("cannot run cargo to build ember-init: {e}"))?;
        if !status.success() {
            return Err("building ember-init failed".into());
        }
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let p = target.join("release/ember-init");
        p.is_file()
            .then_some(p.clone())
            .ok_or_else(|| format!("{} missing after the build", p.display()))
    })
    .clone()
}

/// Debian's cloud kernel (the bzImage) as `ember setup` unpacked it: the
/// kernel of the lab's QEMU/TCG end-to-end tests. Panics, naming the fix,
/// when `ember setup` has not run.
pub fn debian_bzimage() -> String {
    use ember::appliance::kernel::{KernelCache, cache_dir};
    let cache = KernelCache::new(&cache_dir().expect("a cache directory"));
    let k = cache
        .current()
        .expect("this end-to-end test needs Debian's cloud kernel: run `ember setup` first");
    let version = k.version.expect("ember setup records the kernel's version");
    let image = cache
        .unpack_dir(&version)
        .join("boot")
        .join(format!("vmlinuz-{version}"));
    assert!(image.is_file(), "{} is missing", image.display());
    image.display().to_string()
}

/// The appliance snapshots in ember's cache `cache` (its `snapshots/`
/// entries but the hidden ones being written), sorted.
pub fn appliance_snapshots(cache: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(cache.join("snapshots"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
