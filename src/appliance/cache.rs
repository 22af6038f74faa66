//! The on-disk rules of ember's cache (`EMBER_CACHE`): private, atomic,
//! self-healing and bounded.
//!
//! - Directories are 0700 and files 0600: an appliance built from a
//!   `--rootfs` holding a 0600 file must not become readable by other users
//!   through the cache.
//! - Every file is written to a temp file in the same directory, fsynced and
//!   renamed over the target, so a crash or a full disk never leaves a
//!   half-written entry under the real name.
//! - Readers validate what they find (an empty module list, a cpio without
//!   its trailer) and rebuild instead of failing every later run.
//! - Built appliances are evicted least recently used once the directory
//!   exceeds [`max_bytes`] (`EMBER_CACHE_MAX`, default [`DEFAULT_MAX_BYTES`]).

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The cache's one key hasher (appliances, resolved module lists): 128-bit
/// FNV-1a over length-prefixed fields. Tiny, dependency-free, stable across
/// Rust releases (std's `DefaultHasher` promises no such thing), and plenty
/// for a cache key: a collision only means a rebuild is missed between two
/// inputs that a 2^-128 chance made equal.
pub struct KeyHasher(u128);

impl KeyHasher {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;

    /// An empty key.
    pub fn new() -> Self {
        KeyHasher(Self::OFFSET)
    }

    /// Adds one field.
    pub fn put(&mut self, bytes: &[u8]) {
        // Length-prefix each field so ("ab","c") and ("a","bc") differ.
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= u128::from(*b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    /// The key as 32 hex digits (a file name).
    /// Adds a file's path and identity (device, inode, size, mtime) — not
    /// its bytes: stat is cheap, reading a 12 MB kernel or ember binary is
    /// not. Returns whether the file could be stat'ed (its path is added
    /// either way).
    pub fn put_identity(&mut self, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        self.put(path.as_os_str().as_encoded_bytes());
        let Ok(m) = fs::metadata(path) else {
            return false;
        };
        for v in [
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime() as u64,
            m.mtime_nsec() as u64,
        ] {
            self.put(&v.to_le_bytes());
        }
        true
    }

    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }
}

impl Default for KeyHasher {
    fn default() -> Self {
        Self::new()
    }
}

/// The appliance cache's size bound when `EMBER_CACHE_MAX` is unset: 1 GiB
/// (a typical appliance is 5-40 MB, so dozens fit).
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

/// The environment variable that overrides [`DEFAULT_MAX_BYTES`].
pub const MAX_ENV: &str = "EMBER_CACHE_MAX";

/// The appliance cache's size bound: `EMBER_CACHE_MAX` (bytes, or with a
/// K/M/G suffix, powers of 1024), else [`DEFAULT_MAX_BYTES`]. An unparsable
/// value falls back to the default rather than failing the run.
pub fn max_bytes() -> u64 {
    std::env::var(MAX_ENV)
        .ok()
        .and_then(|v| parse_size(&v))
        .unwrap_or(DEFAULT_MAX_BYTES)
}

fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, shift) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 10),
        (i, 'm' | 'M') => (&s[..i], 20),
        (i, 'g' | 'G') => (&s[..i], 30),
        _ => (s, 0),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// Creates `dir` (and its parents) and makes `dir` itself 0700, tightening
/// an existing one: a cache made by an older ember was 0755.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
}

/// A 0600 temp file beside `path`, for [`commit`].
pub fn temp_beside(path: &Path) -> io::Result<(File, PathBuf)> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(
        ".{name}.tmp{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    Ok((f, tmp))
}

/// Fsyncs `file` (the temp file from [`temp_beside`]) and renames it to
/// `path`; removes the temp file if either fails.
pub fn commit(file: &File, tmp: &Path, path: &Path) -> io::Result<()> {
    let r = file.sync_all().and_then(|()| fs::rename(tmp, path));
    if r.is_err() {
        let _ = fs::remove_file(tmp);
    }
    r
}

/// Writes `data` to `path` atomically, 0600.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let (mut f, tmp) = temp_beside(path)?;
    if let Err(e) = f.write_all(data) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    commit(&f, &tmp, path)
}

/// Whether `path` looks like a whole newc archive: it ends with the
/// `TRAILER!!!` entry our writer always puts last. A truncated or empty
/// file (a full disk, a crash before the rename on a filesystem that
/// reorders, a hand edit) fails this and is rebuilt.
pub fn cpio_complete(path: &Path) -> bool {
    let Ok(mut f) = File::open(path) else {
        return false;
    };
    let Ok(len) = f.metadata().map(|m| m.len()) else {
        return false;
    };
    // Header (110) + "TRAILER!!!\0" + padding to 4.
    let tail = len.min(128);
    let mut buf = vec![0u8; tail as usize];
    if f.seek(SeekFrom::Start(len - tail)).is_err() || f.read_exact(&mut buf).is_err() {
        return false;
    }
    let Some(at) = buf.windows(10).rposition(|w| w == b"TRAILER!!!") else {
        return false;
    };
    buf[at + 10..].iter().all(|&b| b == 0)
}

/// Marks `path` as just used (its mtime), for [`evict`]. atime would do
/// but is unreliable under `noatime`/`relatime`.
pub fn touch(path: &Path) {
    if let Ok(f) = File::options().write(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// Removes the least recently used files (by mtime, see [`touch`]) of `dir`
/// ending in `.ext` until their total is at most `max`, never `keep` (the
/// entry this run uses). Stale temp files of crashed runs go too. Returns
/// the number of bytes freed.
pub fn evict(dir: &Path, ext: &str, max: u64, keep: &Path) -> u64 {
    let Ok(rd) = fs::read_dir(dir) else {
        return 0;
    };
    let mut entries = Vec::new();
    let mut total = 0u64;
    let mut freed = 0u64;
    for e in rd.flatten() {
        let path = e.path();
        let Ok(m) = e.metadata() else { continue };
        if !m.is_file() {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        let age = m.modified().ok().and_then(|t| t.elapsed().ok());
        // A temp file an hour old belongs to no live writer.
        if name.starts_with('.') && name.contains(".tmp") && age.is_some_and(|a| a.as_secs() > 3600)
        {
            if fs::remove_file(&path).is_ok() {
                freed += m.len();
            }
            continue;
        }
        if path.extension().is_some_and(|x| x == ext) {
            total += m.len();
            entries.push((
                m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                m.len(),
                path,
            ));
        }
    }
    entries.sort();
    for (_, len, path) in entries {
        if total <= max {
            break;
        }
        if path == keep {
            continue;
        }
        if remove_unless_held(&path) {
            total -= len;
            freed += len;
        }
    }
    freed
}

/// Opens the cache entry `path` for a run and takes a shared lock on it,
/// held as long as the file is open: [`evict`] leaves it alone meanwhile.
/// An entry evicted between the open and the lock is still whole (entries
/// are renamed into place complete, never rewritten): the run boots from
/// the descriptor, not the name.
pub fn hold(path: &Path) -> io::Result<File> {
    let f = File::open(path)?;
    share_lock(&f)?;
    Ok(f)
}

/// Takes the shared lock of [`hold`] on `f` (a new entry's temp file, so
/// that it is held from the moment it has its name).
pub fn share_lock(f: &File) -> io::Result<()> {
    // SAFETY: flock on a descriptor `f` owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes the cache entry `path` unless a run [holds](hold) it; whether it
/// was removed.
fn remove_unless_held(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(f) = File::open(path) else {
        return false;
    };
    // SAFETY: flock on a descriptor `f` owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return false;
    }
    // The name may have been given to a new entry between the open and the
    // lock: only the inode locked here is removed.
    let same = match (f.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    same && fs::remove_file(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_hasher_is_fixed_and_separates_fields() {
        let key = |fields: &[&[u8]]| {
            let mut h = KeyHasher::new();
            fields.iter().for_each(|f| h.put(f));
            h.hex()
        };
        // A fixed value: cache file names must not change with the toolchain.
        assert_eq!(
            key(&[b"ember", b"cache"]),
            "474fedbd9ad19e11df3e00bd5a5cdc44"
        );
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        assert_ne!(key(&[]), key(&[b""]));
    }
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    fn scratch(name: &str) -> ember_testing::TempDir {
        ember_testing::TempDir::new(&format!("cache-{name}"))
    }

    #[test]
    fn dirs_are_0700_and_files_0600_even_under_a_permissive_umask() {
        let d = scratch("perm");
        let sub = d.join("a/b");
        private_dir(&sub).unwrap();
        fs::set_permissions(&sub, fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&sub).unwrap();
        assert_eq!(fs::metadata(&sub).unwrap().mode() & 0o777, 0o700);
        let f = sub.join("x.list");
        write_atomic(&f, b"data").unwrap();
        assert_eq!(fs::metadata(&f).unwrap().mode() & 0o777, 0o600);
        assert_eq!(fs::read(&f).unwrap(), b"data");
        // Nothing but the target is left behind.
        assert_eq!(fs::read_dir(&sub).unwrap().count(), 1);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_truncated_or_empty_cpio_is_incomplete() {
        let d = scratch("cpio");
        let mut w = crate::initramfs::NewcWriter::new(Vec::new());
        w.file("init", 0o755, &[7u8; 300]).unwrap();
        let (whole, _) = w.finish().unwrap();
        let p = d.join("a.cpio");
        fs::write(&p, &whole).unwrap();
        assert!(cpio_complete(&p));
        fs::write(&p, &whole[..whole.len() - 20]).unwrap();
        assert!(!cpio_complete(&p));
        fs::write(&p, &whole[..200]).unwrap();
        assert!(!cpio_complete(&p));
        fs::write(&p, b"").unwrap();
        assert!(!cpio_complete(&p));
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn eviction_drops_the_least_recently_used_first_and_keeps_the_current() {
        let d = scratch("evict");
        let now = SystemTime::now();
        for (i, name) in ["old", "mid", "new"].iter().enumerate() {
            let p = d.join(format!("{name}.cpio"));
            fs::write(&p, vec![0u8; 100]).unwrap();
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(now - Duration::from_secs(100 - 10 * i as u64))
                .unwrap();
        }
        // "old" was used most recently of all: it survives, "mid" goes.
        touch(&d.join("old.cpio"));
        fs::write(d.join("other.list"), vec![0u8; 1000]).unwrap();
        let freed = evict(&d, "cpio", 200, &d.join("new.cpio"));
        assert_eq!(freed, 100);
        assert!(d.join("old.cpio").exists());
        assert!(!d.join("mid.cpio").exists());
        assert!(d.join("new.cpio").exists());
        assert!(d.join("other.list").exists(), "other kinds are not counted");
        // The current entry is never evicted, even alone over the bound.
        evict(&d, "cpio", 0, &d.join("new.cpio"));
        assert!(d.join("new.cpio").exists());
        assert!(!d.join("old.cpio").exists());
        fs::remove_dir_all(&d).unwrap();
    }

    /// An entry a run holds is never evicted; once let go, it is.
    #[test]
    fn eviction_skips_an_entry_a_run_holds() {
        let d = scratch("evict-held");
        let (used, current) = (d.join("used.cpio"), d.join("current.cpio"));
        fs::write(&used, vec![0u8; 100]).unwrap();
        fs::write(&current, vec![0u8; 100]).unwrap();
        let held = hold(&used).unwrap();
        assert_eq!(evict(&d, "cpio", 0, &current), 0);
        assert!(used.exists(), "a held entry was evicted");
        drop(held);
        assert_eq!(evict(&d, "cpio", 0, &current), 100);
        assert!(!used.exists());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("512M"), Some(512 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }
}
