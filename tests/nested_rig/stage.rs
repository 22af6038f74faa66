//! Staging the L1: everything the suite needs, made on the host in a scratch
//! directory the L1 gets as files (`/rig`, ember's cache, the ember binary).

use crate::common;
use ember::appliance::{kernel, modules};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Module groups the L2 init loads (`/lib/ko/GROUP.list`), each resolved
/// with its dependencies from the same kernel package.
const L2_GROUPS: &[(&str, &[&str])] = &[
    ("core", &["virtio_mmio"]),
    ("blk", &["virtio_blk"]),
    ("rng", &["virtio_rng"]),
    ("pmem", &["virtio_pmem", "nd_pmem"]),
    ("balloon", &["virtio_balloon"]),
    ("mem", &["virtio_mem"]),
    ("vsock", &["vmw_vsock_virtio_transport"]),
    ("fs", &["virtiofs"]),
    ("net", &["virtio_net"]),
];

/// Modules the L1 itself loads for a case (the appliance loads only its own):
/// `tun`, for the net case's taps; `overlay`, for containerd's snapshots.
const L1_MODULES: &[&str] = &["tun", "overlay"];
/// What the appliance on the host's root (the containers case's pod VM)
/// loads besides its groups: the root's virtio-fs and the overlay on it.
const HOSTROOT_MODULES: &[&str] = &["virtiofs", "overlay"];
/// The containers case's host programs, carried into the L1 (`--with`).
pub const CONTAINER_TOOLS: &[&str] = &["containerd", "ctr"];

/// What the L1 gets, staged.
pub struct Staged {
    /// Holds everything below: removed when the rig is done (dropped).
    _scratch: common::Scratch,
    /// The L1's `/rig`: the suite, the L2's initramfs, kernels, disk images.
    pub rigdir: PathBuf,
    /// The L1's `/root/.cache/ember`: what the L2 appliance needs.
    pub cache: PathBuf,
    /// The ember binary the L1 runs.
    pub ember: PathBuf,
    /// The cloud kernel's release.
    pub version: String,
    /// Where the PVH note's type is in its vmlinux (the suite rewrites it).
    pub note_off: usize,
    /// Debian's generic kernel's release (for the snapshot cases), or why it
    /// is missing.
    pub generic: Result<String, String>,
    /// The containers case's files are in `/rig/ctr` (the shim, the agent,
    /// the image), or why not (then the L1 carries no containerd).
    pub containers: Result<(), String>,
}

/// Debian's cloud kernel as `ember setup` cached it.
struct CloudKernel {
    cache: PathBuf,
    version: String,
    vmlinux: PathBuf,
    vmlinuz: PathBuf,
    modules: PathBuf,
    note_off: usize,
    tree: modules::ModuleTree,
}

/// Stages everything, or says what is missing.
pub fn stage() -> Result<Staged, String> {
    let k = cloud_kernel()?;
    let scratch = common::Scratch::new("nested-rig");
    let stage = scratch.0.to_path_buf();
    let rigdir = stage.join("rig");
    std::fs::create_dir_all(&rigdir).map_err(|e| e.to_string())?;
    std::fs::write(rigdir.join("suite.sh"), include_bytes!("../rig/suite.sh"))
        .map_err(|e| e.to_string())?;
    l2_initramfs(&rigdir.join("l2.cpio"), &k.tree)?;
    let path = std::env::var("PATH").unwrap_or_default();
    command_initramfs(&rigdir.join("socat.cpio"), "socat", &path)?;
    command_initramfs(&rigdir.join("ethtool.cpio"), "ethtool", "/usr/sbin:/sbin")?;
    l1_modules(&rigdir.join("ko"), &k.tree)?;
    symlink(&k.vmlinuz, &rigdir.join("vmlinuz"))?;
    symlink(&common::init_binary()?, &rigdir.join("ember-init"))?;
    let generic = match generic_kernel(&k.cache, &k.version) {
        Ok((image, release)) => {
            symlink(&image, &rigdir.join("vmlinuz-generic"))?;
            Ok(release)
        }
        Err(why) => {
            eprintln!("nested rig: *** NO GENERIC KERNEL, the snapshot cases fail: {why} ***");
            Err(why)
        }
    };
    disk_images(&stage.join("fill"), &rigdir)?;
    let cache = stage.join("cache");
    appliance_cache(&cache, &k)?;
    let ember = staged_ember(&stage);
    let containers = containers(&stage.join("image"), &rigdir.join("ctr"));
    if let Err(why) = &containers {
        eprintln!("nested rig: *** NO CONTAINERS, the containers case fails: {why} ***");
    }
    Ok(Staged {
        _scratch: scratch,
        rigdir,
        cache,
        ember,
        version: k.version,
        note_off: k.note_off,
        generic,
        containers,
    })
}

/// The containers case's files in `dir` (the L1's `/rig/ctr`): ember's
/// shim and guest agent without their debug info, and a busybox image
/// built with umoci (`work` is its scratch). Or why they cannot be made.
fn containers(work: &Path, dir: &Path) -> Result<(), String> {
    for tool in CONTAINER_TOOLS.iter().chain(&["umoci", "tar"]) {
        if ember::backend::find_binary(tool).is_none() {
            return Err(format!(
                "`{tool}` is not installed (scripts/install-deps --test)"
            ));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let built = std::panic::catch_unwind(|| {
        let bin =
            common::containers::build_companions(&["containerd-shim-ember-v2", "ember-agent"]);
        let tar = common::containers::image_tar(work, &["sh", "cat", "uname"]);
        (bin, tar)
    })
    .map_err(|_| "building the shim, the agent or the image failed (above)".to_owned())?;
    let (bin, tar) = built;
    for b in ["containerd-shim-ember-v2", "ember-agent"] {
        strip_debug(&bin.join(b), &dir.join(b))?;
    }
    std::fs::rename(&tar, dir.join("image.tar")).map_err(|e| format!("{}: {e}", tar.display()))
}

/// `objcopy --strip-debug FROM TO` (a debug build is mostly DWARF, which the
/// L1 would unpack under TCG), or a copy where objcopy fails.
fn strip_debug(from: &Path, to: &Path) -> Result<(), String> {
    let stripped = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(from)
        .arg(to)
        .status()
        .is_ok_and(|s| s.success());
    if stripped {
        return Ok(());
    }
    std::fs::copy(from, to)
        .map(drop)
        .map_err(|e| format!("{}: {e}", from.display()))
}

fn cloud_kernel() -> Result<CloudKernel, String> {
    let cache = kernel::cache_dir().map_err(|e| e.to_string())?;
    let k = kernel::KernelCache::new(&cache).current().ok_or_else(|| {
        format!(
            "no Debian kernel in {} (run `ember setup`)",
            cache.join("kernel").display()
        )
    })?;
    let version = k.version.clone().unwrap_or_default();
    let kdir = k.image.parent().unwrap().to_path_buf();
    let vmlinuz = kdir.join("boot").join(format!("vmlinuz-{version}"));
    let mdir = k
        .modules
        .clone()
        .ok_or_else(|| format!("no modules for kernel {version} (run `ember setup`)"))?;
    if !vmlinuz.is_file() {
        return Err(format!("{} missing (run `ember setup`)", vmlinuz.display()));
    }
    let elf = std::fs::read(&k.image).map_err(|e| format!("{}: {e}", k.image.display()))?;
    let note_off = ember_testing::pvh_note_type_offset(&elf)
        .ok_or_else(|| format!("{} has no PVH note", k.image.display()))?;
    drop(elf);
    let tree = modules::ModuleTree::open(&mdir).map_err(|e| e.to_string())?;
    Ok(CloudKernel {
        cache,
        version,
        vmlinux: k.image,
        vmlinuz,
        modules: mdir,
        note_off,
        tree,
    })
}

/// Disk images, made on the host (files staged in `fill`): an empty data
/// disk, a read-only disk with a marker, and a root with busybox for
/// virtio-pmem (2 MiB multiple).
fn disk_images(fill: &Path, rigdir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(fill.join("ro")).map_err(|e| e.to_string())?;
    std::fs::write(fill.join("ro/marker"), "rig-ro-marker\n").map_err(|e| e.to_string())?;
    std::fs::create_dir_all(fill.join("root/bin")).map_err(|e| e.to_string())?;
    std::fs::copy("/bin/busybox", fill.join("root/bin/busybox")).map_err(|e| e.to_string())?;
    std::fs::write(fill.join("root/marker"), "rig-pmem-root\n").map_err(|e| e.to_string())?;
    mkfs_ext4(&rigdir.join("data.img"), 8 << 20, None)?;
    mkfs_ext4(&rigdir.join("ro.img"), 8 << 20, Some(&fill.join("ro")))?;
    mkfs_ext4(&rigdir.join("root.img"), 16 << 20, Some(&fill.join("root")))
}

/// ember's cache as the L2 appliance needs it, in `cache`: the vmlinux and
/// the appliance's modules, with those that mount the host's root (the
/// containers case's pod VM runs on the L1's root), not the whole 90 MB
/// module tree.
fn appliance_cache(cache: &Path, k: &CloudKernel) -> Result<(), String> {
    let cdir = cache.join("kernel");
    std::fs::create_dir_all(&cdir).map_err(|e| e.to_string())?;
    std::fs::write(cdir.join("current"), format!("{}\n", k.version)).map_err(|e| e.to_string())?;
    let ck = cdir.join(&k.version);
    symlink(&k.vmlinux, &ck.join("vmlinux"))?;
    let cm = ck.join("lib/modules").join(&k.version);
    for f in ["modules.order", "modules.builtin"] {
        symlink(&k.modules.join(f), &cm.join(f))?;
    }
    let mut all: Vec<PathBuf> = k
        .tree
        .resolve_groups(modules::BLACKLIST)
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|m| m.path)
        .collect();
    let hostroot = k
        .tree
        .resolve(HOSTROOT_MODULES, modules::BLACKLIST)
        .map_err(|e| e.to_string())?;
    for p in hostroot {
        if !all.contains(&p) {
            all.push(p);
        }
    }
    for p in all {
        let rel = p.strip_prefix(&k.modules).map_err(|e| e.to_string())?;
        symlink(&p, &cm.join(rel))?;
    }
    Ok(())
}

/// The ember binary under test (what `common::ember()` runs).
fn ember_binary() -> PathBuf {
    std::env::var_os("EMBER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ember")))
}

/// The ember binary under test without its debug info (a debug build is
/// ~60 MB, most of it DWARF, which the L1 would otherwise unpack under TCG);
/// the binary itself if objcopy is missing.
fn staged_ember(stage: &Path) -> PathBuf {
    let bin = ember_binary();
    let out = stage.join("ember");
    let stripped = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(&bin)
        .arg(&out)
        .status()
        .is_ok_and(|s| s.success());
    if stripped { out } else { bin }
}

fn mkfs_ext4(image: &Path, size: u64, from: Option<&Path>) -> Result<(), String> {
    std::fs::File::create(image)
        .and_then(|f| f.set_len(size))
        .map_err(|e| format!("cannot create {}: {e}", image.display()))?;
    let mut c = Command::new("mkfs.ext4");
    // 4 KiB blocks (DAX needs the page size); no lazy init in the guest.
    c.args([
        "-q",
        "-F",
        "-b",
        "4096",
        "-E",
        "lazy_itable_init=0,lazy_journal_init=0",
    ]);
    if let Some(d) = from {
        c.arg("-d").arg(d);
    }
    let o = c
        .arg(image)
        .output()
        .map_err(|e| format!("cannot run mkfs.ext4 (e2fsprogs; scripts/install-deps): {e}"))?;
    o.status
        .success()
        .then_some(())
        .ok_or_else(|| format!("mkfs.ext4: {}", String::from_utf8_lossy(&o.stderr)))
}

fn symlink(target: &Path, link: &Path) -> Result<(), String> {
    if let Some(p) = link.parent() {
        std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    std::os::unix::fs::symlink(target, link).map_err(|e| format!("{}: {e}", link.display()))
}

/// The L2 initramfs: busybox, the /init script, and the module groups.
fn l2_initramfs(out: &Path, tree: &modules::ModuleTree) -> Result<(), String> {
    let busybox = std::fs::read("/bin/busybox")
        .map_err(|e| format!("no /bin/busybox (busybox-static; scripts/install-deps): {e}"))?;
    let f = std::fs::File::create(out).map_err(|e| e.to_string())?;
    let mut w = ember::initramfs::NewcWriter::new(std::io::BufWriter::new(f));
    let e = |e: ember::initramfs::InitramfsError| e.to_string();
    for d in ["bin", "dev", "proc", "sys", "mnt", "lib", "lib/ko"] {
        w.dir(d, 0o755).map_err(e)?;
    }
    w.char_dev("dev/console", 0o600, 5, 1).map_err(e)?;
    w.file("bin/busybox", 0o755, &busybox).map_err(e)?;
    // The balloon case writes and verifies 64 MiB after each deflate.
    w.file(
        "bin/memtouch",
        0o755,
        &crate::common::memtouch::memtouch(64),
    )
    .map_err(e)?;
    w.file("init", 0o755, include_bytes!("../rig/l2-init.sh"))
        .map_err(e)?;
    let mut wanted: Vec<&str> = Vec::new();
    let mut have = 0;
    for (group, mods) in L2_GROUPS {
        wanted.extend_from_slice(mods);
        let all = tree
            .resolve(&wanted, &[])
            .map_err(|err| format!("the kernel's modules: {err}"))?;
        let mut list = String::new();
        for p in &all[have..] {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let data = std::fs::read(p).map_err(|err| format!("{}: {err}", p.display()))?;
            w.file(&format!("lib/ko/{name}"), 0o644, &data).map_err(e)?;
            list.push_str(&format!("/lib/ko/{name}\n"));
        }
        have = all.len();
        w.file(&format!("lib/ko/{group}.list"), 0o644, list.as_bytes())
            .map_err(e)?;
    }
    w.finish().map_err(e)?;
    Ok(())
}

/// [`L1_MODULES`] with their dependencies in `dir`, and `dir/order`: their
/// file names in load order.
fn l1_modules(dir: &Path, tree: &modules::ModuleTree) -> Result<(), String> {
    let all = tree
        .resolve(L1_MODULES, &[])
        .map_err(|err| format!("the kernel's modules: {err}"))?;
    let mut order = String::new();
    for p in &all {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        symlink(p, &dir.join(&name))?;
        order.push_str(&name);
        order.push('\n');
    }
    std::fs::write(dir.join("order"), order).map_err(|e| e.to_string())
}

/// The host's command `cmd` (found on `path`) and every library it needs, at
/// their host paths: the vsock and net cases append socat (and the net case
/// ethtool) to the L2's initramfs (the kernel unpacks them all), so the
/// other L2 boots do not carry their ~8 MB.
fn command_initramfs(out: &Path, cmd: &str, path: &str) -> Result<(), String> {
    let exe = ember::appliance::closure::find_command(cmd, path, None)
        .map_err(|e| format!("{cmd} (scripts/install-deps --test): {e}"))?;
    let files = ember::appliance::closure::closure(&exe).map_err(|e| format!("{cmd}: {e}"))?;
    let f = std::fs::File::create(out).map_err(|e| e.to_string())?;
    let mut w = ember::initramfs::NewcWriter::new(std::io::BufWriter::new(f));
    let e = |e: ember::initramfs::InitramfsError| e.to_string();
    let mut dirs = std::collections::BTreeSet::new();
    for path in &files {
        let rel = path.strip_prefix("/").unwrap_or(path);
        for d in rel.ancestors().skip(1) {
            if !d.as_os_str().is_empty() && dirs.insert(d.to_path_buf()) {
                // Parents before children: ancestors() goes upwards, so collect first.
            }
        }
    }
    for d in &dirs {
        w.dir(&d.to_string_lossy(), 0o755).map_err(e)?;
    }
    for path in &files {
        let rel = path.strip_prefix("/").unwrap_or(path);
        let data = std::fs::read(path).map_err(|err| format!("{}: {err}", path.display()))?;
        w.file(&rel.to_string_lossy(), 0o755, &data).map_err(e)?;
    }
    w.finish().map_err(e)?;
    Ok(())
}

/// Debian's generic kernel of the cloud kernel's release, for the snapshot
/// cases: the cloud flavour is built without `CONFIG_VIRT_DRIVERS`, so
/// without the vmgenid driver; the generic flavour has `CONFIG_VMGENID=y`.
/// `scripts/rig-kernel` (run by `scripts/test` after `ember setup`) fetches
/// its bzImage and config into `<cache>/rig/`; a test never fetches
/// anything. Returns the bzImage and its release, or why there is none (the
/// snapshot cases then fail with that reason).
fn generic_kernel(cache: &Path, cloud: &str) -> Result<(PathBuf, String), String> {
    let release = cloud
        .strip_suffix("-cloud-amd64")
        .map(|r| format!("{r}-amd64"))
        .ok_or_else(|| format!("kernel {cloud} is not a Debian cloud kernel"))?;
    let dir = cache.join("rig");
    let image = dir.join(format!("vmlinuz-{release}"));
    let config = dir.join(format!("config-{release}"));
    for f in [&image, &config] {
        if !f.is_file() {
            return Err(format!(
                "{} is missing: run scripts/rig-kernel (scripts/test does, after `ember setup`)",
                f.display()
            ));
        }
    }
    let cfg = std::fs::read_to_string(&config).map_err(|e| format!("{}: {e}", config.display()))?;
    if !cfg.lines().any(|l| l == "CONFIG_VMGENID=y") {
        return Err(format!(
            "{} is not built with CONFIG_VMGENID=y",
            image.display()
        ));
    }
    Ok((image, release))
}
