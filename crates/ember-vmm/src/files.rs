//! Opening the files a user names (kernel, initrd, disk and pmem images,
//! snapshot files) without waiting on one that is not a file: a plain open
//! of a FIFO with no writer never returns.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// What a path may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// A regular file.
    File,
    /// A regular file or a block device (a disk image).
    FileOrBlockDevice,
}

/// Opens `path` as `opts` says, with `flags` (e.g. `O_DIRECT`) and
/// `O_NONBLOCK`, and refuses what `want` does not allow, naming what it is
/// (a FIFO, a directory, …). The descriptor is made blocking again.
pub(crate) fn open(opts: &OpenOptions, flags: i32, path: &Path, want: Want) -> io::Result<File> {
    let file = opts
        .clone()
        .custom_flags(flags | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    let allowed = kind.is_file() || (want == Want::FileOrBlockDevice && kind.is_block_device());
    if !allowed {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else {
            "not a file"
        };
        let expected = match want {
            Want::File => "a regular file",
            Want::FileOrBlockDevice => "a regular file or a block device",
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what}, not {expected}"),
        ));
    }
    // SAFETY: F_GETFL/F_SETFL on a descriptor `file` owns.
    let rc = unsafe {
        let fl = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        if fl < 0 {
            fl
        } else {
            libc::fcntl(file.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK)
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// [`open`] read-only, for a regular file.
pub(crate) fn open_regular(path: &Path) -> io::Result<File> {
    open(OpenOptions::new().read(true), 0, path, Want::File)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_a_directory_and_a_character_device_are_refused_at_once() {
        let dir = ember_testing::TempDir::new("files");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let said = |p: &Path| open_regular(p).unwrap_err().to_string();
        let fifo_said = said(&fifo);
        let dir_said = said(&dir);
        let null_said = said(Path::new("/dev/null"));
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        let opened = open_regular(&file).map(|f| {
            // SAFETY: F_GETFL on a descriptor `f` owns.
            unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) }
        });
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(fifo_said, "a FIFO, not a regular file");
        assert_eq!(dir_said, "a directory, not a regular file");
        assert_eq!(null_said, "a character device, not a regular file");
        let flags = opened.unwrap();
        assert_eq!(flags & libc::O_NONBLOCK, 0, "made blocking again");
    }
}
