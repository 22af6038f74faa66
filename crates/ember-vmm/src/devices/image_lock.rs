//! Locks on disk and pmem images, so two VMs cannot write one image at once.
//!
//! Open-file-description locks (`F_OFD_SETLK`), as QEMU takes: they belong to the open
//! file, not the process, so they are released when the image's last descriptor closes
//! (ember exiting, or a keeper process closing its copy) and threads cannot drop them by
//! accident as they could POSIX record locks. A read-write image takes an exclusive lock,
//! a read-only one a shared lock: any number of readers, or one writer. They are advisory:
//! they stop other ember or QEMU processes, not an unrelated program that ignores locks.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Whether an image is locked for writing (exclusive) or reading (shared).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockKind {
    /// Read-only use: shared with other readers.
    Shared,
    /// Read-write use: no one else may hold any lock.
    Exclusive,
}

/// Locks the whole of `file` without waiting. `Err` of kind `WouldBlock` means another
/// open file (another VM) holds a conflicting lock.
pub(crate) fn lock(file: &File, kind: LockKind) -> io::Result<()> {
    // SAFETY: `flock` is plain data; all-zero is a valid value we then fill in.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match kind {
        LockKind::Shared => libc::F_RDLCK,
        LockKind::Exclusive => libc::F_WRLCK,
    } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // l_start = 0, l_len = 0: the whole file, however it grows. l_pid must be 0 for OFD locks.
    // SAFETY: fcntl on a descriptor `file` owns, with a pointer to a live `flock`.
    let ret = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if ret == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Err(io::ErrorKind::WouldBlock.into()),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &std::path::Path, write: bool) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .unwrap()
    }

    #[test]
    fn one_writer_or_many_readers() {
        let tmp = ember_testing::TempDir::new("lock");
        let path = tmp.join("image");
        std::fs::write(&path, [0u8; 512]).unwrap();
        // Two opens in one process: OFD locks conflict between open files, not processes.
        let w = open(&path, true);
        lock(&w, LockKind::Exclusive).unwrap();
        let r = open(&path, false);
        let busy = lock(&r, LockKind::Shared).unwrap_err();
        assert_eq!(busy.kind(), io::ErrorKind::WouldBlock);
        let w2 = open(&path, true);
        assert!(lock(&w2, LockKind::Exclusive).is_err());
        // Closing the writer releases its lock.
        drop(w);
        lock(&r, LockKind::Shared).unwrap();
        let r2 = open(&path, false);
        lock(&r2, LockKind::Shared).unwrap();
        assert!(lock(&w2, LockKind::Exclusive).is_err());
        let _ = std::fs::remove_file(&path);
    }
}
