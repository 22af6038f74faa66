//! Builds the appliance initramfs (newc, in Rust) and caches it by a hash of
//! everything that goes in.
//!
//! Layout:
//! ```text
//! /init                 ember-init (static, ~15 KB)
//! /dev/console, /dev/null, /proc, /sys, /tmp, /root
//! /.ember/modules       `GROUP /.ember/ko/NAME.ko` lines, in load order
//! /.ember/ko/*.ko       those modules (uncompressed, as shipped)
//! /usr/bin/…, /lib/…    the command, its interpreter and libraries at their
//!                       host paths (symlinked directories like /bin → usr/bin
//!                       are reproduced as symlinks)
//! ```
//! or, with `--rootfs DIR`, DIR's whole tree instead of the host files.

use super::cache;
use super::modules::GroupedModule;
use crate::initramfs::{InitramfsError, NewcWriter};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::BufWriter;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Bump when the layout changes, so old cached appliances are not reused.
const FORMAT_VERSION: u32 = 2;
/// Where init finds the module list (must match guests/init).
pub const MODULE_LIST: &str = ".ember/modules";
const MODULE_DIR: &str = ".ember/ko";
/// Symlink chains longer than this are treated as loops.
const MAX_SYMLINKS: usize = 40;

/// Builder errors.
#[derive(Debug, Error)]
pub enum BuildError {
    /// Reading an input failed.
    #[error("cannot read `{path}`")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The cache directory is not writable (or full).
    #[error(
        "cannot write the appliance to `{path}` (is the cache directory writable and not full?)"
    )]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The archive writer refused an entry.
    #[error("cannot write the initramfs `{path}`")]
    Archive {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: InitramfsError,
    },
    /// A symlink loop among the command's files.
    #[error("too many symlinks resolving `{0}`")]
    SymlinkLoop(PathBuf),
}

/// One entry of the appliance tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A directory.
    Dir,
    /// A symlink to the target.
    Symlink(String),
    /// A host file copied in with this mode.
    File {
        /// Where to read it.
        source: PathBuf,
        /// Permission bits.
        mode: u32,
    },
    /// Literal contents (init, the module list).
    Data(Vec<u8>, u32),
    /// A character device node (major, minor).
    CharDev(u32, u32),
}

/// The appliance's files, keyed by archive path (no leading `/`); sorted, so
/// parents always come before children.
#[derive(Debug, Default, Clone)]
pub struct Tree {
    entries: BTreeMap<String, Entry>,
}

fn key(p: &Path) -> String {
    p.to_string_lossy().trim_start_matches('/').to_owned()
}

/// `p` with `.` and `..` folded (no symlinks followed).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    out
}

impl Tree {
    /// The skeleton every appliance has, plus init and the modules.
    pub fn skeleton(init: Vec<u8>, modules: &[GroupedModule]) -> Self {
        let mut t = Tree::default();
        for d in [
            "dev",
            "proc",
            "sys",
            "tmp",
            "root",
            ".ember",
            ".ember/root",
            MODULE_DIR,
        ] {
            t.entries.insert(d.into(), Entry::Dir);
        }
        t.entries.insert("dev/console".into(), Entry::CharDev(5, 1));
        t.entries.insert("dev/null".into(), Entry::CharDev(1, 3));
        t.entries.insert("init".into(), Entry::Data(init, 0o755));
        let mut list = String::new();
        for m in modules {
            let name = m.path.file_name().unwrap_or_default().to_string_lossy();
            let at = format!("{MODULE_DIR}/{name}");
            list.push_str(&format!("{} /{at}\n", m.group));
            t.entries.insert(
                at,
                Entry::File {
                    source: m.path.clone(),
                    mode: 0o644,
                },
            );
        }
        t.entries
            .insert(MODULE_LIST.into(), Entry::Data(list.into_bytes(), 0o644));
        t
    }

    /// The entries.
    pub fn entries(&self) -> &BTreeMap<String, Entry> {
        &self.entries
    }

    /// Adds host file `path` at the same path, reproducing every symlink on
    /// the way (e.g. `/lib64/ld-linux-x86-64.so.2` → `/lib/x86_64-linux-gnu/…`
    /// with `/lib` → `usr/lib`).
    pub fn add_host_path(&mut self, path: &Path) -> Result<(), BuildError> {
        self.add_resolving(&normalize(path), 0).map(|_| ())
    }

    /// Adds `path` and returns its fully resolved form.
    fn add_resolving(&mut self, path: &Path, depth: usize) -> Result<PathBuf, BuildError> {
        if depth > MAX_SYMLINKS {
            return Err(BuildError::SymlinkLoop(path.to_path_buf()));
        }
        let mut cur = PathBuf::from("/");
        let comps: Vec<_> = path.components().skip(1).collect();
        for (i, c) in comps.iter().enumerate() {
            let next = cur.join(c);
            let meta = fs::symlink_metadata(&next).map_err(|source| BuildError::Read {
                path: next.clone(),
                source,
            })?;
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&next).map_err(|source| BuildError::Read {
                    path: next.clone(),
                    source,
                })?;
                self.entries.insert(
                    key(&next),
                    Entry::Symlink(target.to_string_lossy().into_owned()),
                );
                let resolved = normalize(&cur.join(&target));
                cur = self.add_resolving(&resolved, depth + 1)?;
            } else if meta.is_dir() {
                self.entries.entry(key(&next)).or_insert(Entry::Dir);
                cur = next;
            } else if i + 1 == comps.len() {
                self.entries.insert(
                    key(&next),
                    Entry::File {
                        source: next.clone(),
                        mode: meta.permissions().mode() & 0o7777,
                    },
                );
                cur = next;
            } else {
                return Err(BuildError::Read {
                    path: next,
                    source: std::io::Error::from(std::io::ErrorKind::NotADirectory),
                });
            }
        }
        Ok(cur)
    }

    /// Adds the directories above tree key `at` (`usr/bin/x`: `usr`,
    /// `usr/bin`) that are not there yet.
    fn add_parents(&mut self, at: &str) {
        for (slash, _) in at.match_indices('/') {
            self.entries
                .entry(at[..slash].to_owned())
                .or_insert(Entry::Dir);
        }
    }

    /// Adds a symlink at guest path `at` (absolute) pointing to `target`,
    /// creating the directories above it; an existing entry wins (the
    /// command's own files come before a base layer's).
    pub fn add_symlink(&mut self, at: &Path, target: &str) {
        let at = key(&normalize(at));
        self.add_parents(&at);
        self.entries
            .entry(at)
            .or_insert_with(|| Entry::Symlink(target.to_owned()));
    }

    /// Adds directory `at` (absolute) and those above it.
    pub fn add_dir(&mut self, at: &Path) {
        let at = key(&normalize(at));
        self.add_parents(&at);
        self.entries.entry(at).or_insert(Entry::Dir);
    }

    /// Adds a file holding `data` with permission bits `mode` at guest path
    /// `at` (absolute), creating the directories above it; an existing entry
    /// wins, as with [`Tree::add_symlink`].
    pub fn add_data(&mut self, at: &Path, data: Vec<u8>, mode: u32) {
        let at = key(&normalize(at));
        self.add_parents(&at);
        self.entries
            .entry(at)
            .or_insert_with(|| Entry::Data(data, mode));
    }

    /// Adds host file or directory `host` at guest path `guest` (absolute),
    /// creating the directories above it. Symlinks are followed: what the
    /// guest gets is their targets' contents (a directory of symlinks stages
    /// files from anywhere). Devices, sockets and FIFOs are skipped.
    pub fn add_at(&mut self, host: &Path, guest: &Path) -> Result<(), BuildError> {
        let at = key(&normalize(guest));
        self.add_parents(&at);
        let mut stack = vec![(host.to_path_buf(), at)];
        let mut depth_guard = 0usize;
        while let Some((src, dst)) = stack.pop() {
            let read = |source| BuildError::Read {
                path: src.clone(),
                source,
            };
            let meta = fs::metadata(&src).map_err(read)?;
            if meta.is_dir() {
                // Symlinks to directories could loop: bound the walk.
                depth_guard += 1;
                if depth_guard > 100_000 {
                    return Err(BuildError::SymlinkLoop(src));
                }
                self.entries.insert(dst.clone(), Entry::Dir);
                for e in fs::read_dir(&src).map_err(read)? {
                    let e = e.map_err(read)?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    stack.push((e.path(), format!("{dst}/{name}")));
                }
            } else if meta.is_file() {
                self.entries.insert(
                    dst,
                    Entry::File {
                        source: src.clone(),
                        mode: meta.permissions().mode() & 0o7777,
                    },
                );
            }
        }
        Ok(())
    }

    /// Adds the whole tree under host directory `root` at `/` (devices,
    /// sockets and FIFOs are skipped; existing entries such as /init win).
    pub fn add_rootfs(&mut self, root: &Path) -> Result<(), BuildError> {
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let read = |source| BuildError::Read {
                path: dir.clone(),
                source,
            };
            for e in fs::read_dir(&dir).map_err(read)? {
                let e = e.map_err(read)?;
                let path = e.path();
                let rel = key(path.strip_prefix(root).unwrap_or(&path));
                let meta = fs::symlink_metadata(&path).map_err(|source| BuildError::Read {
                    path: path.clone(),
                    source,
                })?;
                let entry = if meta.file_type().is_symlink() {
                    let t = fs::read_link(&path).map_err(|source| BuildError::Read {
                        path: path.clone(),
                        source,
                    })?;
                    Entry::Symlink(t.to_string_lossy().into_owned())
                } else if meta.is_dir() {
                    stack.push(path.clone());
                    Entry::Dir
                } else if meta.is_file() {
                    Entry::File {
                        source: path.clone(),
                        mode: meta.permissions().mode() & 0o7777,
                    }
                } else {
                    continue;
                };
                self.entries.entry(rel).or_insert(entry);
            }
        }
        Ok(())
    }

    /// A hash of the tree's inputs: names, kinds, and each host file's size,
    /// mtime and inode (not contents: stat is cheap, reading is not).
    pub fn cache_key(&self, kernel_version: &str) -> String {
        let mut h = cache::KeyHasher::new();
        h.put(&FORMAT_VERSION.to_le_bytes());
        h.put(kernel_version.as_bytes());
        for (path, entry) in &self.entries {
            h.put(path.as_bytes());
            match entry {
                Entry::Dir => h.put(b"d"),
                Entry::Symlink(t) => {
                    h.put(b"l");
                    h.put(t.as_bytes());
                }
                Entry::File { source, mode } => {
                    h.put(b"f");
                    h.put(&mode.to_le_bytes());
                    if let Ok(m) = fs::metadata(source) {
                        for v in [m.size(), m.mtime() as u64, m.mtime_nsec() as u64, m.ino()] {
                            h.put(&v.to_le_bytes());
                        }
                    }
                }
                Entry::Data(d, mode) => {
                    h.put(b"D");
                    h.put(&mode.to_le_bytes());
                    h.put(d);
                }
                Entry::CharDev(a, b) => {
                    h.put(b"c");
                    h.put(&a.to_le_bytes());
                    h.put(&b.to_le_bytes());
                }
            }
        }
        h.hex()
    }

    /// Writes the newc archive to `out`, 0600 (it may hold a `--rootfs`'s
    /// private files), via a temp file that is fsynced and renamed, so a
    /// crash never leaves a half-written appliance under the real name.
    pub fn write(&self, out: &Path) -> Result<u64, BuildError> {
        self.write_held(out).map(|(_, size)| size)
    }

    /// [`Tree::write`], returning the file too, [held](cache::hold) from
    /// before it has its name: no eviction can remove it in between.
    pub fn write_held(&self, out: &Path) -> Result<(File, u64), BuildError> {
        let (file, tmp) = cache::temp_beside(out).map_err(|source| BuildError::Write {
            path: out.to_path_buf(),
            source,
        })?;
        // Whatever fails below, the temp file goes.
        struct Cleanup<'a>(&'a Path, bool);
        impl Drop for Cleanup<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    let _ = fs::remove_file(self.0);
                }
            }
        }
        let mut cleanup = Cleanup(&tmp, false);
        let (file, size) = self.write_into(file, &tmp, out)?;
        cache::share_lock(&file)
            .and_then(|()| cache::commit(&file, &tmp, out))
            .map_err(|source| BuildError::Write {
                path: out.to_path_buf(),
                source,
            })?;
        cleanup.1 = true;
        Ok((file, size))
    }

    /// Writes the newc archive into `file` (named `shown` in errors about
    /// it, `out` in those about the archive); returns it and the size.
    pub fn write_into(
        &self,
        file: File,
        shown: &Path,
        out: &Path,
    ) -> Result<(File, u64), BuildError> {
        let werr = |source| BuildError::Write {
            path: shown.to_path_buf(),
            source,
        };
        let mut w = NewcWriter::new(BufWriter::with_capacity(1 << 20, file));
        let arch = |source| BuildError::Archive {
            path: out.to_path_buf(),
            source,
        };
        for (path, entry) in &self.entries {
            match entry {
                Entry::Dir => w.dir(path, 0o755),
                Entry::Symlink(t) => w.symlink(path, t),
                Entry::CharDev(a, b) => w.char_dev(path, 0o600, *a, *b),
                Entry::Data(d, mode) => w.file(path, *mode, d),
                Entry::File { source, mode } => {
                    let data = fs::read(source).map_err(|e| BuildError::Read {
                        path: source.clone(),
                        source: e,
                    })?;
                    w.file(path, *mode, &data)
                }
            }
            .map_err(|e| match e {
                InitramfsError::Io(io) => BuildError::Write {
                    path: shown.to_path_buf(),
                    source: io,
                },
                other => arch(other),
            })?;
        }
        let (buf, size) = w.finish().map_err(arch)?;
        let file = buf.into_inner().map_err(|e| werr(e.into_error()))?;
        Ok((file, size))
    }
}

/// A built (or found) appliance.
#[derive(Debug, Clone)]
pub struct Appliance {
    /// The initramfs.
    pub path: PathBuf,
    /// Whether it came from the cache.
    pub cached: bool,
    /// The cached file, open and share-locked for as long as a run uses it:
    /// eviction skips it, and even a file removed meanwhile (by an older
    /// ember) still boots through [`cleanup::fd_path`] of this descriptor.
    pub held: Option<Arc<File>>,
}

impl Appliance {
    /// The path a VMM boots it from: its descriptor's while it is held
    /// (pass that descriptor to the VMM), else its name.
    pub fn boot_path(&self) -> PathBuf {
        match &self.held {
            Some(f) => crate::cleanup::fd_path(f.as_raw_fd()),
            None => self.path.clone(),
        }
    }
}

/// Returns the cached appliance for `tree`, building it first if needed (or
/// if the cached one is incomplete), then evicts the least recently used
/// appliances past `max_bytes` (never one a live run holds).
pub fn build_cached(
    tree: &Tree,
    kernel_version: &str,
    cache_dir: &Path,
    max_bytes: u64,
) -> Result<Appliance, BuildError> {
    let dir = cache_dir.join("appliances");
    let path = dir.join(format!("{}.cpio", tree.cache_key(kernel_version)));
    if path.is_file() && cache::cpio_complete(&path) {
        cache::touch(&path);
        // Gone between the check and the open (evicted by another run):
        // built again below.
        if let Ok(held) = cache::hold(&path) {
            return Ok(Appliance {
                path,
                cached: true,
                held: Some(Arc::new(held)),
            });
        }
    }
    for d in [cache_dir, &dir] {
        cache::private_dir(d).map_err(|source| BuildError::Write {
            path: d.to_path_buf(),
            source,
        })?;
    }
    // Held from before it has its name: another run's eviction cannot
    // remove it before this run boots it.
    let (held, _) = tree.write_held(&path)?;
    cache::evict(&dir, "cpio", max_bytes, &path);
    Ok(Appliance {
        path,
        cached: false,
        held: Some(Arc::new(held)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, mode, data) of each newc entry.
    fn parse_newc(mut a: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        loop {
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&a[6 + i * 8..14 + i * 8]).unwrap(), 16)
                    .unwrap()
            };
            assert_eq!(&a[..6], b"070701");
            let (mode, size, namesize) = (field(1), field(6) as usize, field(11) as usize);
            let name = String::from_utf8(a[110..110 + namesize - 1].to_vec()).unwrap();
            let start = (110 + namesize).next_multiple_of(4);
            let data = a[start..start + size].to_vec();
            a = &a[(start + size).next_multiple_of(4)..];
            if name == "TRAILER!!!" {
                return out;
            }
            out.push((name, mode, data));
        }
    }

    #[test]
    fn host_paths_keep_their_symlinks_and_newc_has_everything() {
        let dir = crate::appliance::test_dir("builder-tree");
        let modules = dir.join("mods");
        fs::create_dir_all(&modules).unwrap();
        let ko = modules.join("virtio.ko");
        fs::write(&ko, b"ko bytes").unwrap();
        let ko = GroupedModule {
            group: "core".into(),
            path: ko,
        };
        let mut t = Tree::skeleton(b"INIT".to_vec(), &[ko]);
        // A private merged-/usr layout: lnk → real, real/tool.
        fs::create_dir_all(dir.join("real")).unwrap();
        fs::write(dir.join("real/tool"), b"tool").unwrap();
        let _ = fs::remove_file(dir.join("lnk"));
        std::os::unix::fs::symlink("real", dir.join("lnk")).unwrap();
        t.add_host_path(&dir.join("lnk/tool")).unwrap();

        let out = dir.join("a.cpio");
        let size = t.write(&out).unwrap();
        let bytes = fs::read(&out).unwrap();
        assert_eq!(size as usize, bytes.len());
        let entries = parse_newc(&bytes);
        let get = |n: &str| {
            entries
                .iter()
                .find(|e| e.0 == n)
                .unwrap_or_else(|| panic!("{n} missing"))
        };
        assert_eq!(get("init").2, b"INIT");
        assert_eq!(get("init").1 & 0o777, 0o755);
        assert_eq!(get(MODULE_LIST).2, b"core /.ember/ko/virtio.ko\n");
        assert_eq!(get(".ember/ko/virtio.ko").2, b"ko bytes");
        let rel = key(&dir);
        assert_eq!(get(&format!("{rel}/lnk")).2, b"real");
        assert_eq!(get(&format!("{rel}/real/tool")).2, b"tool");
        // Every parent precedes its children.
        for (i, (name, _, _)) in entries.iter().enumerate() {
            if let Some((parent, _)) = name.rsplit_once('/') {
                assert!(
                    entries[..i].iter().any(|e| e.0 == parent),
                    "{name} before {parent}"
                );
            }
        }
    }

    #[test]
    fn files_land_at_their_guest_paths_with_parents() {
        let dir = crate::appliance::test_dir("builder-add-at");
        fs::create_dir_all(dir.join("stage/sub")).unwrap();
        fs::write(dir.join("real"), b"data").unwrap();
        fs::write(dir.join("stage/sub/f"), b"f").unwrap();
        let _ = fs::remove_file(dir.join("stage/link"));
        std::os::unix::fs::symlink(dir.join("real"), dir.join("stage/link")).unwrap();
        let mut t = Tree::default();
        t.add_at(&dir.join("real"), Path::new("/a/b/file")).unwrap();
        t.add_at(&dir.join("stage"), Path::new("/s")).unwrap();
        let e = t.entries();
        assert_eq!(e.get("a"), Some(&Entry::Dir));
        assert_eq!(e.get("a/b"), Some(&Entry::Dir));
        assert!(
            matches!(e.get("a/b/file"), Some(Entry::File { source, .. }) if source == &dir.join("real"))
        );
        assert_eq!(e.get("s/sub"), Some(&Entry::Dir));
        assert!(matches!(e.get("s/sub/f"), Some(Entry::File { .. })));
        // A symlink is carried as its target's contents.
        assert!(
            matches!(e.get("s/link"), Some(Entry::File { source, .. }) if source == &dir.join("stage/link"))
        );
        assert!(t.add_at(&dir.join("missing"), Path::new("/m")).is_err());
    }

    #[test]
    fn cache_hits_and_invalidation() {
        let dir = crate::appliance::test_dir("builder-cache");
        let input = dir.join("input");
        fs::write(&input, b"v1").unwrap();
        let mut t = Tree::skeleton(b"INIT".to_vec(), &[]);
        t.add_host_path(&input).unwrap();
        let a = build_cached(&t, "6.1", &dir, u64::MAX).unwrap();
        assert!(!a.cached);
        let b = build_cached(&t, "6.1", &dir, u64::MAX).unwrap();
        assert!(b.cached);
        assert_eq!(a.path, b.path);
        // Private: the input may be a --rootfs's 0600 file.
        use std::os::unix::fs::MetadataExt;
        assert_eq!(fs::metadata(&a.path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(
            fs::metadata(dir.join("appliances")).unwrap().mode() & 0o777,
            0o700
        );
        // A truncated appliance (a full disk, a crash) is rebuilt whole.
        let whole = fs::read(&a.path).unwrap();
        fs::write(&a.path, &whole[..whole.len() / 2]).unwrap();
        let c = build_cached(&t, "6.1", &dir, u64::MAX).unwrap();
        assert!(!c.cached);
        assert_eq!(fs::read(&c.path).unwrap(), whole);
        // Another kernel version or a changed input file is another appliance.
        assert_ne!(t.cache_key("6.2"), t.cache_key("6.1"));
        let before = t.cache_key("6.1");
        fs::write(&input, b"version 2").unwrap();
        assert_ne!(t.cache_key("6.1"), before);
        let t2 = Tree::skeleton(b"INIT2".to_vec(), &[]);
        assert_ne!(
            t2.cache_key("6.1"),
            Tree::skeleton(b"INIT".to_vec(), &[]).cache_key("6.1")
        );
    }

    #[test]
    fn old_appliances_are_evicted_past_the_bound() {
        let dir = crate::appliance::test_dir("builder-evict");
        let one = Tree::skeleton(b"ONE".to_vec(), &[]);
        let two = Tree::skeleton(b"TWO".to_vec(), &[]);
        let mut a = build_cached(&one, "6.1", &dir, u64::MAX).unwrap();
        let size = fs::metadata(&a.path).unwrap().len();
        std::thread::sleep(std::time::Duration::from_millis(20));
        // Room for one, but a run still holds the first: both stay.
        let b = build_cached(&two, "6.1", &dir, size).unwrap();
        assert!(a.path.exists(), "evicted while held");
        assert!(b.path.exists());
        // Let go, the first is evicted by the next build; the second is
        // still held; the new one, never.
        a.held = None;
        let three = Tree::skeleton(b"THREE".to_vec(), &[]);
        let c = build_cached(&three, "6.1", &dir, size).unwrap();
        assert!(!a.path.exists());
        assert!(b.path.exists());
        assert!(c.path.exists());
    }

    #[test]
    fn unwritable_cache_is_a_clear_error() {
        let t = Tree::skeleton(b"INIT".to_vec(), &[]);
        let e = build_cached(&t, "x", Path::new("/proc/ember-cannot-write"), u64::MAX).unwrap_err();
        assert!(e.to_string().contains("writable"), "{e}");
    }

    #[test]
    fn rootfs_is_copied_whole() {
        let dir = crate::appliance::test_dir("builder-rootfs");
        fs::create_dir_all(dir.join("etc")).unwrap();
        fs::write(dir.join("etc/hostname"), b"box").unwrap();
        let mut t = Tree::skeleton(b"INIT".to_vec(), &[]);
        t.add_rootfs(&dir).unwrap();
        assert!(matches!(t.entries()["etc"], Entry::Dir));
        assert!(matches!(&t.entries()["etc/hostname"], Entry::File { .. }));
        assert_eq!(t.entries()["init"], Entry::Data(b"INIT".to_vec(), 0o755));
    }
}
