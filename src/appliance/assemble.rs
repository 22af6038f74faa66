//! The appliance's files: the kernel and its modules, ember-init, the
//! command with everything it needs, written (or found in the cache) as an
//! initramfs; and `ember setup`, which fetches and checks the first three.

use super::cli::SetupArgs;
use super::error::ApplianceError;
use super::{builder, cache, closure, kernel, modules, rig, userland};
use crate::backend::{self, GuestSpec};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A ready-to-boot appliance and how long preparing it took.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The kernel image to boot.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// The path init executes.
    pub exec: String,
    /// Whether the initramfs came from the cache.
    pub cached: bool,
    /// How many kernel modules it carries (0: none found for this kernel).
    pub modules: usize,
    /// Time spent finding/building it.
    pub elapsed: Duration,
    /// The initramfs is this run's own (it carries `--file`s, which are not
    /// cached): delete it after the run (unless it has no name: see
    /// [`write_appliance`]).
    pub temporary: bool,
    /// The initramfs, open (and share-locked when cached: see
    /// [`builder::Appliance::held`]) while the run uses it; boot from
    /// [`Prepared::boot_path`] and pass the VMM this descriptor.
    pub held: Option<Arc<File>>,
}

impl Prepared {
    /// The path a VMM boots the initramfs from (see [`Prepared::held`]).
    pub fn boot_path(&self) -> PathBuf {
        match &self.held {
            Some(f) => crate::cleanup::fd_path(f.as_raw_fd()),
            None => self.initrd.clone(),
        }
    }
}

/// What a run adds to the appliance beyond its command.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// Carry kvm-amd and its dependencies (the `kvm` module group).
    pub nested_kvm: bool,
    /// Host files and directories to carry (`--file`).
    pub files: Vec<rig::FileSpec>,
    /// More host commands to carry with their closures (`--with`).
    pub with: Vec<String>,
    /// No busybox base layer (`--bare`).
    pub bare: bool,
    /// Carry only the modules of these groups (`modules::MODULE_GROUPS`;
    /// `None`: all of them). The kernel unpacks every byte of the initramfs
    /// whether init loads it or not: the 0.95 MB of modules a run without
    /// disks, pmem, vsock, entropy or balloon never loads cost 3.3 M guest
    /// instructions (BENCHMARKS.md §8).
    pub module_groups: Option<Vec<String>>,
}

/// Finds the kernel, modules, init and the command's files, and returns the
/// (cached) appliance for them.
pub fn prepare(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
) -> Result<Prepared, ApplianceError> {
    prepare_with(kernel_arg, rootfs, command, &Extras::default())
}

/// [`prepare`] with [`Extras`] (the nested rig's modules and files).
pub fn prepare_with(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
    extras: &Extras,
) -> Result<Prepared, ApplianceError> {
    let a = assemble(kernel_arg, rootfs, command, extras)?;
    write_appliance(a, false)
}

/// An appliance's files, found but not written.
pub struct Assembled {
    start: Instant,
    /// The kernel.
    pub kernel: kernel::Kernel,
    /// ember-init's bytes.
    pub init: Vec<u8>,
    /// The kernel modules it carries.
    pub mods: Vec<modules::GroupedModule>,
    /// Every file: init, modules, the command and its closure, busybox, `--file`s.
    pub tree: builder::Tree,
    /// The path init executes.
    pub exec: PathBuf,
    /// The kernel's version (or its path): part of the cache keys.
    pub version: String,
    /// It holds `--file`s (not cached).
    pub temporary: bool,
}

/// Finds the kernel, modules, init and the command's files.
pub fn assemble(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
    extras: &Extras,
) -> Result<Assembled, ApplianceError> {
    let start = Instant::now();
    let cache = kernel::cache_dir()?;
    let (k, mut mods) = kernel_and_modules(kernel_arg, &cache)?;
    if let Some(groups) = &extras.module_groups {
        carry_only(&mut mods, groups);
    }
    if extras.nested_kvm {
        let kvm = rig::kvm_modules(k.modules.as_deref(), &mods)?;
        mods.extend(kvm);
    }
    let init = read_init()?;
    let mut tree = builder::Tree::skeleton(init.clone(), &mods);
    let exec = match rootfs {
        Some(root) => add_rootfs(&mut tree, root, command, extras)?,
        None => add_host_command(&mut tree, &cache, command, extras)?,
    };
    let version = kernel_version(&k);
    rig::add_files(&mut tree, &extras.files)?;
    // `--file`s change from run to run (test images, scripts): such an
    // appliance is written for this run only instead of filling the cache.
    let temporary = !extras.files.is_empty();
    Ok(Assembled {
        start,
        kernel: k,
        init,
        mods,
        tree,
        exec,
        version,
        temporary,
    })
}

/// The appliance of a run on the host's root ([`super::hostroot`]): init and
/// the modules of `groups` plus those that mount that root; `exec` is the
/// host's path of the command, which the guest sees at the same place.
pub(super) fn assemble_host_root(
    kernel_arg: Option<&Path>,
    exec: PathBuf,
    groups: &[String],
) -> Result<Assembled, ApplianceError> {
    let start = Instant::now();
    let cache = kernel::cache_dir()?;
    let (k, mut mods) = kernel_and_modules(kernel_arg, &cache)?;
    carry_only(&mut mods, groups);
    let fs = super::hostroot::fs_modules(k.modules.as_deref(), &mods)?;
    mods.extend(fs);
    let init = read_init()?;
    let tree = builder::Tree::skeleton(init.clone(), &mods);
    let version = kernel_version(&k);
    Ok(Assembled {
        start,
        kernel: k,
        init,
        mods,
        tree,
        exec,
        version,
        temporary: false,
    })
}

/// Adds the host directory `root` (`--rootfs`) to `tree`; returns the path
/// of `command` in it.
fn add_rootfs(
    tree: &mut builder::Tree,
    root: &Path,
    command: &str,
    extras: &Extras,
) -> Result<PathBuf, ApplianceError> {
    if !root.is_dir() {
        return Err(ApplianceError::BadArg(format!(
            "--rootfs `{}` is not a directory",
            root.display()
        )));
    }
    if !extras.with.is_empty() {
        return Err(ApplianceError::BadArg(
            "--with carries host commands; with --rootfs, put them in the root".into(),
        ));
    }
    tree.add_rootfs(root)?;
    Ok(closure::find_command(
        command,
        closure::GUEST_PATH,
        Some(root),
    )?)
}

/// Adds the host's `command` with its closure, the `--with` commands and
/// (unless `--bare`) busybox to `tree`; returns the path init executes.
fn add_host_command(
    tree: &mut builder::Tree,
    cache: &Path,
    command: &str,
    extras: &Extras,
) -> Result<PathBuf, ApplianceError> {
    let path_var = std::env::var("PATH").unwrap_or_else(|_| closure::GUEST_PATH.into());
    let busybox = if extras.bare {
        None
    } else {
        let bb = userland::Busybox::find_cached(&path_var, Some(&cache.join("busybox")));
        if bb.is_none() {
            eprintln!(
                "ember: no busybox on PATH: the appliance carries only the command's \
                 files (install busybox-static; --bare says this is meant)"
            );
        }
        bb
    };
    let exe = match closure::find_command(command, &path_var, None) {
        Ok(exe) => {
            for f in closure::closure(&exe)? {
                tree.add_host_path(&f)?;
            }
            exe
        }
        // Not on the host, but an applet (e.g. `ash`): run busybox's.
        Err(closure::ClosureError::NotFound(n)) => busybox
            .as_ref()
            .and_then(|bb| bb.applet(command))
            .ok_or(closure::ClosureError::NotFound(n))?,
        Err(e) => return Err(e.into()),
    };
    for w in &extras.with {
        for f in closure::closure(&closure::find_command(w, &path_var, None)?)? {
            tree.add_host_path(&f)?;
        }
    }
    // Last, so the command's own files win over an applet's.
    if let Some(bb) = &busybox {
        bb.add_to(tree)?;
    }
    Ok(exe)
}

/// Writes (or finds in the cache) the initramfs of `a`. A temporary one
/// (see [`Prepared::temporary`]) is `nameless` for a run that boots it
/// itself: a file with no name (it holds `--file`s' contents), reached
/// through its descriptor, that nothing has to remove.
pub(super) fn write_appliance(a: Assembled, nameless: bool) -> Result<Prepared, ApplianceError> {
    let Assembled {
        start,
        kernel: k,
        mods,
        tree,
        exec,
        version,
        temporary,
        ..
    } = a;
    let cache = kernel::cache_dir()?;
    let app = if temporary && nameless {
        let tmp = std::env::temp_dir();
        let werr = |source| builder::BuildError::Write {
            path: tmp.clone(),
            source,
        };
        let file = crate::cleanup::Nameless::new(&tmp).map_err(werr)?;
        let path = file.path();
        let (file, _) = tree.write_into(file.into_file(), &tmp, &tmp)?;
        builder::Appliance {
            path,
            cached: false,
            held: Some(Arc::new(file)),
        }
    } else if temporary {
        let path = std::env::temp_dir().join(format!(
            "ember-appliance-{}-{}.cpio",
            std::process::id(),
            tree.cache_key(&version)
        ));
        tree.write(&path)?;
        builder::Appliance {
            path,
            cached: false,
            held: None,
        }
    } else {
        builder::build_cached(&tree, &version, &cache, cache::max_bytes())?
    };
    Ok(Prepared {
        kernel: k.image,
        initrd: app.path,
        exec: exec.to_string_lossy().into_owned(),
        cached: app.cached,
        modules: mods.len(),
        elapsed: start.elapsed(),
        temporary: temporary && !nameless,
        held: app.held,
    })
}

/// The appliance with no command, cached as [`prepare`]'s are: ember-init
/// and the modules of `kernel_arg` a cold `ember run` with no devices of its
/// own carries on `backend` (virtio-console and the transports its devices
/// sit on). The boot lab boots it when it is given no initramfs, as
/// libguestfs's boot-benchmark boots its appliance: without `EMBER_CHANNEL=`
/// on the command line, init mounts /dev, /proc and /sys, loads the modules,
/// says it has no channel to take a command from and powers off. `exec` is
/// empty: there is no command.
pub fn prepare_boot_only(
    kernel_arg: Option<&Path>,
    backend: &dyn backend::Backend,
) -> Result<Prepared, ApplianceError> {
    let start = Instant::now();
    let cache = kernel::cache_dir()?;
    let (k, mut mods) = kernel_and_modules(kernel_arg, &cache)?;
    let groups = module_groups(&GuestSpec::new(&k.image), backend, false);
    mods.retain(|m| groups.contains(&m.group.as_str()));
    let tree = builder::Tree::skeleton(read_init()?, &mods);
    let app = builder::build_cached(&tree, &kernel_version(&k), &cache, cache::max_bytes())?;
    Ok(Prepared {
        kernel: k.image,
        initrd: app.path,
        exec: String::new(),
        cached: app.cached,
        modules: mods.len(),
        elapsed: start.elapsed(),
        temporary: false,
        held: app.held,
    })
}

/// ember-init's bytes.
fn read_init() -> Result<Vec<u8>, ApplianceError> {
    let path = find_init()?;
    std::fs::read(&path).map_err(|source| builder::BuildError::Read { path, source }.into())
}

/// The kernel's version (or its path): part of the appliance's cache keys.
fn kernel_version(k: &kernel::Kernel) -> String {
    k.version
        .clone()
        .unwrap_or_else(|| k.image.display().to_string())
}

/// The module group of a vsock channel ([`backend::ChannelKind::Vsock`]).
pub(super) const CHANNEL_VSOCK_GROUP: &str = "vsock";

/// The module groups (see [`modules::MODULE_GROUPS`]) a boot with `spec`'s
/// devices on `backend` loads: `core` (virtio itself, and the console
/// channel), the transports the backend's devices sit on, vsock where the
/// channel is a vsock stream, and one group per kind of device it has.
pub(super) fn module_groups(
    spec: &GuestSpec,
    backend: &dyn backend::Backend,
    nested_kvm: bool,
) -> Vec<&'static str> {
    let mut groups = vec!["core"];
    groups.extend(backend.virtio_transports());
    if backend.channel_kind() == backend::ChannelKind::Vsock {
        groups.push(CHANNEL_VSOCK_GROUP);
    }
    for (wanted, group) in [
        (!spec.devices.disks.is_empty(), "blk"),
        (!spec.devices.pmem.is_empty(), "pmem"),
        (spec.devices.rng.is_some(), "rng"),
        (spec.devices.mem.is_some(), modules::MEM_GROUP),
        (spec.devices.balloon.is_some(), "balloon"),
        (spec.net_fd.is_some() || !spec.devices.net.is_empty(), "net"),
    ] {
        if wanted {
            groups.push(group);
        }
    }
    if nested_kvm {
        groups.push(rig::KVM_GROUP);
    }
    groups
}

/// Keeps the modules of `groups` only.
/// The kernel to boot and the appliance modules found for it (none when it
/// has no module tree: then what it needs must be built in).
fn kernel_and_modules(
    kernel_arg: Option<&Path>,
    cache: &Path,
) -> Result<(kernel::Kernel, Vec<modules::GroupedModule>), ApplianceError> {
    let k = kernel::find_kernel(kernel_arg, cache)?;
    let mods = match &k.modules {
        Some(dir) => modules::resolve_cached(dir, cache)?,
        None => Vec::new(),
    };
    Ok((k, mods))
}

fn carry_only(mods: &mut Vec<modules::GroupedModule>, groups: &[String]) {
    mods.retain(|m| groups.contains(&m.group));
}

/// Runs `ember setup`; returns the exit status.
pub fn setup(args: SetupArgs) -> anyhow::Result<i32> {
    let cache = kernel::cache_dir()?;
    let k = kernel::setup(&cache, args.kernel.as_deref())?;
    if let Some(dir) = &k.modules {
        let mods = modules::ModuleTree::open(dir)?
            .resolve(modules::APPLIANCE_MODULES, modules::BLACKLIST)?;
        eprintln!("ember setup: {} appliance modules available", mods.len());
    }
    match find_init() {
        Ok(p) => eprintln!("ember setup: guest init {}", p.display()),
        Err(e) => eprintln!("ember setup: warning: {e}"),
    }
    Ok(0)
}

/// Where ember-init is: `$EMBER_INIT`, else next to the running ember (or in
/// the cargo target directory it was built in).
pub fn find_init() -> Result<PathBuf, ApplianceError> {
    if let Some(p) = std::env::var_os("EMBER_INIT") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|_| ApplianceError::NoInit)?;
    let dir = exe.parent().ok_or(ApplianceError::NoInit)?;
    [
        "ember-init",
        "../ember-init",
        "../release/ember-init",
        "../../release/ember-init",
    ]
    .iter()
    .map(|c| dir.join(c))
    .find(|p| p.is_file())
    .ok_or(ApplianceError::NoInit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Fake;

    #[test]
    fn a_boot_loads_and_carries_only_its_devices_module_groups() {
        let mut spec = GuestSpec::new("/k");
        let pci = Fake::with_transports(&["pci"]);
        assert_eq!(module_groups(&spec, &pci, false), ["core", "pci"]);
        spec.devices.rng = Some(Default::default());
        spec.devices.balloon = Some(Default::default());
        assert_eq!(
            module_groups(&spec, &Fake::with_transports(&["pci", "mmio"]), true),
            ["core", "pci", "mmio", "rng", "balloon", rig::KVM_GROUP]
        );
        let m = |group: &str, name: &str| modules::GroupedModule {
            group: group.into(),
            path: PathBuf::from(format!("/m/{name}.ko")),
        };
        let mut mods = vec![
            m("core", "virtio_console"),
            m("pci", "virtio_pci"),
            m("mmio", "virtio_mmio"),
            m("blk", "virtio_blk"),
            m("pmem", "nd_pmem"),
        ];
        carry_only(&mut mods, &["core".into(), "pci".into(), "pmem".into()]);
        assert_eq!(
            mods,
            [
                m("core", "virtio_console"),
                m("pci", "virtio_pci"),
                m("pmem", "nd_pmem")
            ]
        );
    }
}
