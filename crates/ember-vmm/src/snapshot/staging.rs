//! A snapshot directory written whole or not at all.
//!
//! A snapshot is written into a fresh private directory beside its target
//! (0700, its files created 0600 with `O_EXCL | O_NOFOLLOW`, so no planted
//! file or symlink is followed), then swapped into place in one step: a new
//! target is renamed there (`RENAME_NOREPLACE`), an existing one exchanged
//! with it (`RENAME_EXCHANGE`) and the old one removed. So:
//! - a snapshot that fails leaves the previous one whole and nothing else
//!   (the staging directory goes with [`Staging`]'s drop);
//! - two snapshots into one target cannot mix: each is whole in its own
//!   directory, and the target ends up as one of them;
//! - a VM restored from the old snapshot keeps running: its private mapping
//!   holds the old `memory` file's inode, unlinked or not.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{HOTPLUG_FILE, MEMORY_FILE, STATE_FILE};

/// What a snapshot directory may hold: its two files, and the fixed temp
/// names earlier versions wrote into it. Anything else means the target is
/// not a snapshot directory, and swapping it out would delete someone's
/// files.
const OWN_FILES: [&str; 5] = [
    STATE_FILE,
    MEMORY_FILE,
    HOTPLUG_FILE,
    "state.tmp",
    "memory.tmp",
];

/// A staging directory for one snapshot of `target`.
#[derive(Debug)]
pub(crate) struct Staging {
    dir: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl Staging {
    /// Checks `target` (absent, or a directory holding only a snapshot's
    /// files) and makes the staging directory beside it.
    pub(crate) fn new(target: &Path) -> io::Result<Self> {
        check_target(target)?;
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::other("the snapshot target has no file name"))?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        // A fresh name: mkdir fails on any existing entry, symlinks included.
        for attempt in 0u32..100 {
            let mut staged = std::ffi::OsString::from(".");
            staged.push(name);
            staged.push(format!(
                ".snapshot-{}-{stamp:x}-{attempt}",
                std::process::id()
            ));
            let dir = parent.join(staged);
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    return Ok(Staging {
                        dir,
                        target: target.to_owned(),
                        committed: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::other("no free name for a staging directory"))
    }

    /// Where a file of the snapshot is written while staged.
    pub(crate) fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// Creates one of the snapshot's files: new (never an existing file or a
    /// symlink's target), readable by its owner only.
    pub(crate) fn create(&self, file: &str) -> io::Result<File> {
        create_private(&self.path(file))
    }

    /// Makes the staged snapshot the target's, in one step.
    pub(crate) fn commit(mut self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()?;
        // A target made between the check and now is exchanged like any
        // other, so try both ways.
        let swapped = match rename(&self.dir, &self.target, libc::RENAME_NOREPLACE) {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                check_target(&self.target)?;
                rename(&self.dir, &self.target, libc::RENAME_EXCHANGE)?;
                true
            }
            Err(e) => return Err(e),
        };
        self.committed = true;
        if let Some(parent) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            File::open(parent)?.sync_all()?;
        }
        if swapped {
            // The old snapshot now sits at the staging path.
            remove_snapshot_dir(&self.dir);
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            remove_snapshot_dir(&self.dir);
        }
    }
}

/// Creates `path` new, 0600, not following a symlink.
pub(crate) fn create_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .read(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Refuses a target that is not a directory holding only a snapshot's files.
fn check_target(target: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(target) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return Err(io::Error::other(
            "exists and is not a directory (a snapshot is a directory)",
        ));
    }
    for entry in std::fs::read_dir(target)? {
        let name = entry?.file_name();
        if !OWN_FILES.iter().any(|f| f.as_bytes() == name.as_bytes()) {
            return Err(io::Error::other(format!(
                "is not a snapshot directory (it holds {}): refusing to replace it",
                Path::new(&name).display()
            )));
        }
    }
    Ok(())
}

/// Removes a snapshot directory's own files and the directory, nothing else
/// (best effort: it is either a failed staging or a replaced snapshot).
fn remove_snapshot_dir(dir: &Path) {
    for f in OWN_FILES {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let _ = std::fs::remove_dir(dir);
}

/// `renameat2(from, to, flags)`: std has no way to ask for an exchange or
/// for no replacement.
fn rename(from: &Path, to: &Path, flags: libc::c_uint) -> io::Result<()> {
    let from = std::ffi::CString::new(from.as_os_str().as_bytes())?;
    let to = std::ffi::CString::new(to.as_os_str().as_bytes())?;
    // SAFETY: both paths are NUL-terminated strings that live across the
    // call; renameat2 reads them and touches no memory of ours besides.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            flags,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use ember_testing::TempDir;

    fn stage(target: &Path, memory: &str) -> Staging {
        let s = Staging::new(target).unwrap();
        s.create(MEMORY_FILE)
            .unwrap()
            .write_all(memory.as_bytes())
            .unwrap();
        s.create(STATE_FILE).unwrap().write_all(b"state").unwrap();
        s
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_new_target_is_private_and_whole() {
        let t = TempDir::new("staging-new");
        let target = t.path().join("snap");
        stage(&target, "one").commit().unwrap();
        assert_eq!(entries(t.path()), ["snap"]);
        assert_eq!(entries(&target), ["memory", "state"]);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&target), 0o700);
        assert_eq!(mode(&target.join(MEMORY_FILE)), 0o600);
        assert_eq!(mode(&target.join(STATE_FILE)), 0o600);
    }

    #[test]
    fn an_existing_snapshot_is_replaced_and_kept_when_staging_fails() {
        let t = TempDir::new("staging-replace");
        let target = t.path().join("snap");
        stage(&target, "one").commit().unwrap();
        // A staging dropped before its commit (a failed snapshot): the old
        // one is untouched and nothing is left beside it.
        drop(stage(&target, "two"));
        assert_eq!(entries(t.path()), ["snap"]);
        assert_eq!(std::fs::read(target.join(MEMORY_FILE)).unwrap(), b"one");
        stage(&target, "three").commit().unwrap();
        assert_eq!(entries(t.path()), ["snap"]);
        assert_eq!(std::fs::read(target.join(MEMORY_FILE)).unwrap(), b"three");
    }

    #[test]
    fn planted_symlinks_and_foreign_directories_are_refused() {
        let t = TempDir::new("staging-refuse");
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        // A symlink at the target: not a directory of ours.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(Staging::new(&link).is_err());
        // A directory holding someone's files.
        let home = t.path().join("home");
        std::fs::create_dir(&home).unwrap();
        std::fs::write(home.join("notes.txt"), b"mine").unwrap();
        let e = Staging::new(&home).unwrap_err();
        assert!(e.to_string().contains("notes.txt"), "{e}");
        // create_private never follows a symlink.
        let planted = t.path().join("planted");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        assert!(create_private(&planted).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn two_stagings_of_one_target_leave_one_whole_snapshot() {
        let t = TempDir::new("staging-race");
        let target = t.path().join("snap");
        let a = stage(&target, "a");
        let b = stage(&target, "b");
        a.commit().unwrap();
        b.commit().unwrap();
        assert_eq!(entries(t.path()), ["snap"]);
        assert_eq!(std::fs::read(target.join(MEMORY_FILE)).unwrap(), b"b");
    }
}
