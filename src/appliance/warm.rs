//! The appliance from a snapshot (ember backend): the first `ember run` for a
//! given kernel, ember-init, ember build and VM shape boots the appliance
//! once and snapshots it where ember-init waits for its job; later runs
//! restore that snapshot and hand the job over at once.
//!
//! A snapshot's devices are fixed when it is taken, so the command's files
//! cannot be in its initramfs. The snapshotted appliance has one virtio-pmem
//! *slot* of [`SLOT_BYTES`] instead, never mounted before the snapshot. Each
//! run writes the command's tree (its closure, busybox, `--file`s) into an
//! ext4 image of exactly that size, restores the snapshot with the slot
//! backed by that image (`ember boot --restore DIR --pmem IMAGE`), and sends
//! a `ROOT` frame with the job: ember-init drops whatever the guest cached
//! of the slot, mounts it with DAX (files are mapped, not copied: copies in
//! the guest kernel are slow under a software KVM) and runs the command
//! chrooted there.
//!
//! The snapshot lives in `<cache>/snapshots/<key>/`, `key` hashing the
//! kernel's and ember's identity (device, inode, size, mtime), ember-init's
//! bytes (in the base initramfs' key), memory, vCPUs and the command line:
//! a changed input is a new key, and the oldest snapshots beyond [`KEEP`]
//! are removed. Its files are read-only (0400) and a restore maps memory
//! privately (copy-on-write), so no run writes to it, and any number of runs
//! restore it at once. It is written to a temp directory and renamed into
//! place: a crashed or concurrent first run never leaves a partial one.

use super::builder::{Entry, Tree};
use super::cache::KeyHasher;
use crate::cleanup::Nameless;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// The per-run root slot's size: the most a command's tree may take (a
/// bigger one boots cold).
pub const SLOT_BYTES: u64 = 128 << 20;
/// The slot as the guest sees it (the appliance's only pmem device).
pub const SLOT_DEVICE: &str = "/dev/pmem0";
/// Snapshots kept in the cache (a new ember build or kernel makes a new one).
pub const KEEP: usize = 4;
/// Bumped when what a snapshot must contain changes.
const FORMAT: u32 = 1;

/// Errors of the snapshot path.
#[derive(Debug, Error)]
pub enum WarmError {
    /// File system trouble.
    #[error("{0}")]
    Io(PathBuf, #[source] io::Error),
    /// mkfs.ext4 failed or is missing.
    #[error("cannot make the command's root image: {0}")]
    Mkfs(String),
    /// The control socket refused a step of the snapshot.
    #[error("cannot snapshot the appliance")]
    Snapshot(#[source] crate::api::ClientError),
    /// A cached snapshot is damaged or of another format.
    #[error("the appliance's cached snapshot cannot be restored")]
    Unsound(#[source] ember_vmm::snapshot::SnapshotError),
}

fn io_err(p: &Path) -> impl Fn(io::Error) -> WarmError + '_ {
    move |e| WarmError::Io(p.to_owned(), e)
}

/// What a snapshot depends on.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    /// The kernel image.
    pub kernel: &'a Path,
    /// The base initramfs (its name is the hash of ember-init and the modules).
    pub initrd: &'a Path,
    /// The ember binary that boots and restores it.
    pub ember: &'a Path,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// vCPUs.
    pub cpus: u32,
    /// The kernel command line.
    pub cmdline: &'a str,
}

/// The snapshot's cache key.
pub fn key(i: &Inputs) -> String {
    let mut h = KeyHasher::new();
    h.put(&FORMAT.to_le_bytes());
    // A snapshot another state format wrote is not restorable: a new format
    // is a new key, so the snapshot is taken again.
    h.put(&ember_vmm::snapshot::FORMAT_VERSION.to_le_bytes());
    h.put(&SLOT_BYTES.to_le_bytes());
    h.put_identity(i.kernel);
    h.put(i.initrd.as_os_str().as_encoded_bytes());
    h.put_identity(i.ember);
    h.put(&i.mem_mib.to_le_bytes());
    h.put(&i.cpus.to_le_bytes());
    h.put(i.cmdline.as_bytes());
    h.hex()
}

/// Where the snapshot for `key` lives.
pub fn snapshot_dir(cache: &Path, key: &str) -> PathBuf {
    cache.join("snapshots").join(key)
}

/// Whether `dir` holds a whole snapshot (renamed into place complete).
pub fn is_complete(dir: &Path) -> bool {
    use ember_vmm::snapshot::{MEMORY_FILE, STATE_FILE};
    dir.join(STATE_FILE).is_file() && dir.join(MEMORY_FILE).is_file()
}

/// Whether the whole snapshot in `dir` can be restored by this ember: its
/// state decodes (magic, format version, its checksum, the values it holds)
/// and its memory file has the size the state records. Cheap enough for
/// every run: the state is a few KiB and the memory file is only stat'ed
/// (its checksum is checked by [`check_memory`] when a restore fails).
pub fn check(dir: &Path) -> Result<(), WarmError> {
    ember_vmm::snapshot::read(dir).map_err(WarmError::Unsound)?;
    Ok(())
}

/// Whether the snapshot's memory still matches the checksum taken with it
/// (reads the whole file: for a restore that failed).
pub fn check_memory(dir: &Path) -> Result<(), WarmError> {
    ember_vmm::snapshot::check_memory(dir).map_err(WarmError::Unsound)
}

/// Removes the damaged snapshot `dir` so that the next run makes it again:
/// renamed aside first (a concurrent run then finds no snapshot rather than
/// half of one), then removed. A run restoring it meanwhile keeps its
/// mapping.
pub fn discard(dir: &Path) -> Result<(), WarmError> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let aside = parent.join(format!(
        ".{}.damaged.{}",
        dir.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    match fs::rename(dir, &aside) {
        Ok(()) => fs::remove_dir_all(&aside).map_err(io_err(&aside)),
        // Another run discarded it first.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(WarmError::Io(dir.to_owned(), e)),
    }
}

/// Writes `tree` as files under `dir` (device nodes are left out: the
/// guest's devtmpfs is mounted over /dev).
pub fn materialize(tree: &Tree, dir: &Path) -> Result<(), WarmError> {
    for (rel, entry) in tree.entries() {
        let at = dir.join(rel);
        if let Some(parent) = at.parent() {
            fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let mode = match entry {
            Entry::Dir => {
                fs::create_dir_all(&at).map_err(io_err(&at))?;
                continue;
            }
            Entry::Symlink(t) => {
                std::os::unix::fs::symlink(t, &at).map_err(io_err(&at))?;
                continue;
            }
            Entry::CharDev(..) => continue,
            Entry::File { source, mode } => {
                fs::copy(source, &at).map_err(io_err(source))?;
                *mode
            }
            Entry::Data(d, mode) => {
                fs::write(&at, d).map_err(io_err(&at))?;
                *mode
            }
        };
        fs::set_permissions(&at, fs::Permissions::from_mode(mode)).map_err(io_err(&at))?;
    }
    Ok(())
}

/// Makes `image`, a [`SLOT_BYTES`] ext4 file system holding `tree`: 4 KiB
/// blocks (DAX maps pages), no journal and inode tables zeroed here, so the
/// guest kernel neither replays nor zeroes anything. The image has no name
/// (mkfs.ext4 writes it through its descriptor); the tree is laid out in
/// `staging` first, a private directory made and removed here (should ember
/// be killed meanwhile, [`crate::cleanup::sweep_dead`] removes it later).
pub fn root_image(tree: &Tree, image: &Nameless, staging: &Path) -> Result<(), WarmError> {
    use std::os::unix::fs::DirBuilderExt;
    let shown = staging.with_extension("img");
    let _guard = StagingDir(staging);
    fs::DirBuilder::new()
        .mode(0o700)
        .create(staging)
        .map_err(io_err(staging))?;
    materialize(tree, staging)?;
    image.file().set_len(SLOT_BYTES).map_err(io_err(&shown))?;
    let mut mkfs = Command::new("mkfs.ext4");
    mkfs.args(["-q", "-F", "-b", "4096", "-m", "0", "-O", "^has_journal"])
        .args(["-E", "lazy_itable_init=0", "-d"])
        .arg(staging)
        .arg(image.path());
    crate::cleanup::dies_with_ember(&mut mkfs);
    crate::cleanup::inherit(&mut mkfs, vec![image.fd()]);
    crate::tool::run(&mut mkfs)
        .map_err(|e| WarmError::Mkfs(format!("{e} (is e2fsprogs installed?)")))?;
    Ok(())
}

/// Removes the staging directory of [`root_image`] however it returns.
struct StagingDir<'a>(&'a Path);

impl Drop for StagingDir<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(self.0);
    }
}

/// Snapshots the VM behind control socket `api` into `dir` (which must not
/// exist yet) and lets it run on. Written beside `dir` and renamed into
/// place, read-only; if another run got there first, its snapshot stays.
pub fn save(api: &Path, dir: &Path) -> Result<(), WarmError> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    super::cache::private_dir(parent).map_err(io_err(parent))?;
    let tmp = parent.join(format!(
        ".{}.{}.tmp",
        dir.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&tmp);
    let vm = crate::api::Client::new(api);
    vm.pause().map_err(WarmError::Snapshot)?;
    let taken = vm.snapshot(&tmp).map_err(WarmError::Snapshot);
    // The run goes on whether or not the snapshot was written.
    let resumed = vm.resume().map_err(WarmError::Snapshot);
    let sealed = taken.and_then(|_| {
        for f in [
            ember_vmm::snapshot::STATE_FILE,
            ember_vmm::snapshot::MEMORY_FILE,
        ] {
            let p = tmp.join(f);
            fs::set_permissions(&p, fs::Permissions::from_mode(0o400)).map_err(io_err(&p))?;
        }
        match fs::rename(&tmp, dir) {
            Ok(()) => Ok(()),
            // A concurrent first run renamed its own first: keep that one.
            Err(_) if check(dir).is_ok() => Ok(()),
            Err(e) => Err(WarmError::Io(dir.to_owned(), e)),
        }
    });
    let _ = fs::remove_dir_all(&tmp);
    resumed?;
    sealed?;
    evict(parent, dir);
    Ok(())
}

/// Removes the oldest snapshot directories of `parent` beyond [`KEEP`],
/// never `keep`. A run restoring one being removed keeps its mapping (the
/// files are unlinked, not truncated).
fn evict(parent: &Path, keep: &Path) {
    let Ok(rd) = fs::read_dir(parent) else {
        return;
    };
    let mut dirs: Vec<_> = rd
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .filter(|(_, p)| p != keep)
        .collect();
    dirs.sort();
    let excess = (dirs.len() + 1).saturating_sub(KEEP);
    for (_, d) in dirs.into_iter().take(excess) {
        let _ = fs::remove_dir_all(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs<'a>(kernel: &'a Path, ember: &'a Path) -> Inputs<'a> {
        Inputs {
            kernel,
            initrd: Path::new("/cache/appliances/abc.cpio"),
            ember,
            mem_mib: 128,
            cpus: 1,
            cmdline: "console=ttyS0",
        }
    }

    /// Each input of the snapshot is in its key: a changed kernel, init (the
    /// base initramfs' name), ember binary, memory, vCPUs or command line is
    /// a different snapshot.
    #[test]
    fn the_key_changes_with_every_input() {
        let dir = crate::appliance::test_dir("warm-key");
        let (k, e) = (dir.join("vmlinux"), dir.join("ember"));
        fs::write(&k, b"kernel").unwrap();
        fs::write(&e, b"ember").unwrap();
        let base = key(&inputs(&k, &e));
        assert_eq!(base, key(&inputs(&k, &e)), "stable");
        let mut i = inputs(&k, &e);
        i.initrd = Path::new("/cache/appliances/def.cpio");
        assert_ne!(key(&i), base, "init");
        let mut i = inputs(&k, &e);
        i.mem_mib = 256;
        assert_ne!(key(&i), base, "memory");
        let mut i = inputs(&k, &e);
        i.cpus = 2;
        assert_ne!(key(&i), base, "cpus");
        let mut i = inputs(&k, &e);
        i.cmdline = "console=ttyS0 quiet";
        assert_ne!(key(&i), base, "cmdline");
        // Rewritten files are other files (new size or mtime).
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&k, b"kernel 2").unwrap();
        let after_kernel = key(&inputs(&k, &e));
        assert_ne!(after_kernel, base, "kernel");
        fs::write(&e, b"ember 2").unwrap();
        assert_ne!(key(&inputs(&k, &e)), after_kernel, "ember");
        let _ = fs::remove_dir_all(dir);
    }

    /// A snapshot whose state does not decode is unsound, and discarding
    /// it leaves nothing behind (its files are read-only).
    #[test]
    fn a_damaged_snapshot_is_unsound_and_discarded_whole() {
        let parent = crate::appliance::test_dir("warm-damaged");
        let dir = parent.join("key");
        fs::create_dir(&dir).unwrap();
        for (f, data) in [
            ("state", &b"EMBERSNP truncated"[..]),
            ("memory", &[0u8; 4096]),
        ] {
            fs::write(dir.join(f), data).unwrap();
            fs::set_permissions(dir.join(f), fs::Permissions::from_mode(0o400)).unwrap();
        }
        assert!(is_complete(&dir));
        assert!(matches!(check(&dir), Err(WarmError::Unsound(_))));
        discard(&dir).unwrap();
        assert_eq!(fs::read_dir(&parent).unwrap().count(), 0);
        // Gone already (another run discarded it): not an error.
        discard(&dir).unwrap();
        let _ = fs::remove_dir_all(parent);
    }

    #[test]
    fn eviction_keeps_the_newest_and_the_current() {
        let dir = crate::appliance::test_dir("warm-evict");
        for n in 0..6 {
            fs::create_dir(dir.join(format!("k{n}"))).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(15));
        }
        evict(&dir, &dir.join("k0"));
        let mut left: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["k0", "k3", "k4", "k5"]);
        let _ = fs::remove_dir_all(dir);
    }
}
