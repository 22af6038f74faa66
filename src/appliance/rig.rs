//! The nested rig: `ember run --backend qemu --nested-kvm -- CMD` boots the
//! appliance under QEMU/TCG with `-cpu max` (which emulates AMD SVM with
//! nested paging) and has the guest's init load `irqbypass`, `kvm` and
//! `kvm-amd` from the same kernel package before CMD starts, so CMD finds a
//! `/dev/kvm` backed by (emulated) hardware virtualization. With `--file`
//! the guest also gets host files (the ember binary, kernels, disk images,
//! a test script), so `ember run --backend qemu --nested-kvm --file … --
//! ember boot --kernel …` runs ember as on a hardware-KVM host. Nothing is
//! downloaded: the kernel and its modules are what `ember setup` fetched.
//!
//! Why TCG and not the host's KVM: this machine's KVM emulates guest kernel
//! mode in software (PVM) and exposes no SVM/VMX to its guests; QEMU's TCG
//! does. Times in the rig are TCG-inflated: compare within one rig run.

use super::builder::{BuildError, Tree};
use super::closure;
use super::modules::{self, GroupedModule, ModuleTree};
use crate::backend::BackendKind;
use crate::backend::qemu::{Accel, QemuBackend};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The module group init loads for `--nested-kvm` (`EMBER_MODULES=…,kvm`).
pub const KVM_GROUP: &str = "kvm";
/// The module that gives `/dev/kvm` on an (emulated) AMD CPU; its
/// dependencies (`kvm`, `irqbypass`) come from its `.modinfo`.
pub const KVM_MODULE: &str = "kvm_amd";

/// Rig errors: each is one line for the user.
#[derive(Debug, Error)]
pub enum RigError {
    /// `--nested-kvm` with a backend that cannot emulate SVM.
    #[error(
        "--nested-kvm needs the qemu backend (QEMU/TCG emulates AMD SVM), not `{0}`: \
         use --backend qemu"
    )]
    Backend(String),
    /// The kernel has no kvm-amd module.
    #[error(
        "--nested-kvm: the guest kernel has no kvm-amd module ({0}); use Debian's cloud \
         kernel (`ember setup`)"
    )]
    NoKvmModule(String),
    /// The kernel's module tree is missing entirely.
    #[error(
        "--nested-kvm: no kernel modules for the guest kernel (kvm-amd is needed); \
         run `ember setup`"
    )]
    NoModules,
    /// A bad `--file` value.
    #[error("bad --file `{spec}`: {why}")]
    BadFile {
        /// The argument.
        spec: String,
        /// What is wrong with it.
        why: String,
    },
    /// A `--file` could not be carried.
    #[error("--file")]
    Carry(#[from] BuildError),
    /// A `--file` program's libraries could not be found.
    #[error("--file")]
    Closure(#[from] closure::ClosureError),
    /// The QEMU backend is unavailable.
    #[error("--nested-kvm")]
    Qemu(#[from] crate::backend::BackendError),
}

/// One `--file HOST[:GUEST]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// The host file or directory.
    pub host: PathBuf,
    /// Where it appears in the guest (absolute).
    pub guest: PathBuf,
}

impl FileSpec {
    /// Parses `HOST[:GUEST]`; GUEST defaults to HOST made absolute.
    pub fn parse(spec: &str) -> Result<Self, RigError> {
        let bad = |why: &str| RigError::BadFile {
            spec: spec.to_owned(),
            why: why.to_owned(),
        };
        let (host, guest) = match spec.split_once(':') {
            Some((h, g)) => (h, Some(g)),
            None => (spec, None),
        };
        if host.is_empty() {
            return Err(bad("no host path"));
        }
        let host = PathBuf::from(host);
        if !host.exists() {
            return Err(bad("no such file or directory"));
        }
        let guest = match guest {
            Some(g) if g.starts_with('/') => PathBuf::from(g),
            Some(_) => return Err(bad("the guest path must be absolute")),
            None => std::path::absolute(&host).map_err(|e| bad(&e.to_string()))?,
        };
        if guest
            .components()
            .any(|c| c == std::path::Component::ParentDir)
            || guest == Path::new("/")
        {
            return Err(bad("the guest path must name a file or directory below /"));
        }
        Ok(FileSpec { host, guest })
    }
}

/// Adds every `--file` to the tree. A dynamically linked program (an
/// executable ELF) also brings its interpreter and libraries (at their host
/// paths), so a test binary built by cargo runs in the guest as on the host.
pub fn add_files(tree: &mut Tree, files: &[FileSpec]) -> Result<(), RigError> {
    for f in files {
        tree.add_at(&f.host, &f.guest)?;
        if is_elf_program(&f.host) {
            // The program itself is at its guest path already.
            for lib in closure::closure(&f.host)?
                .into_iter()
                .filter(|p| p != &f.host)
            {
                tree.add_host_path(&lib)?;
            }
        }
    }
    Ok(())
}

/// An executable ELF file (not a kernel image or module: those are not
/// executable, and their "closure" means nothing).
fn is_elf_program(p: &Path) -> bool {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let mut head = [0u8; 4];
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        && std::fs::File::open(p)
            .and_then(|mut f| f.read_exact(&mut head))
            .is_ok()
        && head == *b"\x7fELF"
}

/// The kvm-amd module and its dependencies, tagged [`KVM_GROUP`], minus
/// those the appliance already carries.
pub fn kvm_modules(
    modules_dir: Option<&Path>,
    already: &[GroupedModule],
) -> Result<Vec<GroupedModule>, RigError> {
    let dir = modules_dir.ok_or(RigError::NoModules)?;
    let tree = ModuleTree::open(dir).map_err(|_| RigError::NoModules)?;
    let found = tree
        .resolve(&[KVM_MODULE], modules::BLACKLIST)
        .map_err(|e| RigError::NoKvmModule(e.to_string()))?;
    Ok(found
        .into_iter()
        .filter(|p| !already.iter().any(|m| &m.path == p))
        .map(|path| GroupedModule {
            group: KVM_GROUP.to_owned(),
            path,
        })
        .collect())
}

/// The QEMU backend for the rig: TCG always (`-cpu max` is what emulates
/// SVM; the host's KVM, hardware or not, is not asked to nest).
pub fn backend(kind: BackendKind, machine: &str) -> Result<QemuBackend, RigError> {
    match kind {
        BackendKind::Qemu | BackendKind::Auto => Ok(QemuBackend::detect(machine, Accel::Tcg)?),
        BackendKind::Ember => Err(RigError::Backend("ember".to_owned())),
    }
}

/// Turns the guest init's "cannot load module …kvm…" report into the reason.
pub fn explain_guest_error(msg: &str) -> Option<String> {
    let module = msg.strip_prefix("cannot load module ")?;
    let name = module.rsplit('/').next().unwrap_or(module);
    ["kvm-amd.ko", "kvm.ko", "irqbypass.ko"]
        .contains(&name)
        .then(|| {
            format!(
                "--nested-kvm: the guest could not load {name}: this QEMU's `-cpu max` \
                 does not emulate AMD SVM (QEMU 7.2's TCG does)"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_specs() {
        let f = FileSpec::parse("/bin/sh:/rig/sh").unwrap();
        assert_eq!(f.host, PathBuf::from("/bin/sh"));
        assert_eq!(f.guest, PathBuf::from("/rig/sh"));
        let same = FileSpec::parse("/bin/sh").unwrap();
        assert_eq!(same.guest, PathBuf::from("/bin/sh"));
        for bad in [
            ":/x",
            "/nonexistent/file",
            "/bin/sh:relative",
            "/bin/sh:/",
            "/bin/sh:/a/../b",
        ] {
            assert!(FileSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kvm_modules_come_with_their_dependencies() {
        let dir = crate::appliance::test_dir("rig-kvm-modules");
        modules::tests::fake_tree(
            &dir,
            &[
                ("kernel/virt/lib/irqbypass.ko", ""),
                ("kernel/arch/x86/kvm/kvm.ko", "irqbypass"),
                ("kernel/arch/x86/kvm/kvm-amd.ko", "kvm"),
            ],
            &[],
        );
        let got = kvm_modules(Some(&dir), &[]).unwrap();
        let names: Vec<_> = got
            .iter()
            .map(|m| m.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["irqbypass.ko", "kvm.ko", "kvm-amd.ko"]);
        assert!(got.iter().all(|m| m.group == KVM_GROUP));
        // Already carried: not twice.
        let again = kvm_modules(Some(&dir), &got[..1]).unwrap();
        assert_eq!(again.len(), 2);

        let none = crate::appliance::test_dir("rig-no-kvm");
        modules::tests::fake_tree(&none, &[("kernel/drivers/virtio/virtio.ko", "")], &[]);
        let e = kvm_modules(Some(&none), &[]).unwrap_err();
        assert!(matches!(e, RigError::NoKvmModule(_)), "{e}");
        assert!(e.to_string().contains("kvm_amd"), "{e}");
        assert!(matches!(
            kvm_modules(None, &[]).unwrap_err(),
            RigError::NoModules
        ));
    }

    #[test]
    fn only_qemu_can_nest() {
        assert!(matches!(
            backend(BackendKind::Ember, "q35"),
            Err(RigError::Backend(_))
        ));
    }

    #[test]
    fn kvm_module_failures_are_explained() {
        let m = explain_guest_error("cannot load module /.ember/ko/kvm-amd.ko").unwrap();
        assert!(m.contains("SVM"), "{m}");
        assert_eq!(
            explain_guest_error("cannot load module /.ember/ko/virtio_blk.ko"),
            None
        );
        assert_eq!(explain_guest_error("something else"), None);
    }
}
