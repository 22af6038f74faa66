//! A newc ("070701") cpio writer: the format the Linux kernel unpacks as an
//! initramfs. Written directly, in memory or to a file, so building an
//! appliance never shells out to cpio.
//!
//! The format is a 110-byte ASCII header, the NUL-terminated name padded to 4
//! bytes, then the data padded to 4 bytes; the archive ends with an entry named
//! `TRAILER!!!`.

use std::io::{self, Write};
use thiserror::Error;

/// File type bits of `st_mode`.
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

/// Name of the end-of-archive entry.
const TRAILER: &str = "TRAILER!!!";

/// Initramfs writer errors.
#[derive(Debug, Error)]
pub enum InitramfsError {
    /// A path that would escape the archive root or is empty.
    #[error("invalid archive path `{0}`")]
    BadPath(String),
    /// A file larger than newc can describe (4 GiB).
    #[error("`{0}` is too large for a newc archive")]
    TooLarge(String),
    /// Writing the archive failed.
    #[error("writing the initramfs failed")]
    Io(#[from] io::Error),
}

/// Streams newc entries to a writer.
#[derive(Debug)]
pub struct NewcWriter<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> NewcWriter<W> {
    /// Starts an archive on `out`.
    pub fn new(out: W) -> Self {
        NewcWriter {
            out,
            next_ino: 1,
            written: 0,
        }
    }

    /// A directory (parents are not created implicitly: add them first).
    pub fn dir(&mut self, path: &str, perm: u32) -> Result<(), InitramfsError> {
        self.entry(path, S_IFDIR | (perm & 0o7777), 2, 0, &[])
    }

    /// A regular file.
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> Result<(), InitramfsError> {
        self.entry(path, S_IFREG | (perm & 0o7777), 1, 0, data)
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), InitramfsError> {
        self.entry(path, S_IFLNK | 0o777, 1, 0, target.as_bytes())
    }

    /// A character device node (e.g. `/dev/console`, 5:1), so early output
    /// works before devtmpfs is mounted.
    pub fn char_dev(
        &mut self,
        path: &str,
        perm: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), InitramfsError> {
        self.entry(
            path,
            S_IFCHR | (perm & 0o7777),
            1,
            (major << 8) | minor,
            &[],
        )
    }

    /// Writes the trailer and returns the sink and the archive size.
    pub fn finish(mut self) -> Result<(W, u64), InitramfsError> {
        self.raw_entry(TRAILER, 0, 0, 1, 0, &[])?;
        self.out.flush()?;
        Ok((self.out, self.written))
    }

    fn entry(
        &mut self,
        path: &str,
        mode: u32,
        nlink: u32,
        rdev: u32,
        data: &[u8],
    ) -> Result<(), InitramfsError> {
        let name = path.trim_start_matches('/');
        if name.is_empty() || name == TRAILER || name.split('/').any(|c| c == ".." || c.is_empty())
        {
            return Err(InitramfsError::BadPath(path.to_owned()));
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.raw_entry(name, ino, mode, nlink, rdev, data)
    }

    fn raw_entry(
        &mut self,
        name: &str,
        ino: u32,
        mode: u32,
        nlink: u32,
        rdev: u32,
        data: &[u8],
    ) -> Result<(), InitramfsError> {
        let size =
            u32::try_from(data.len()).map_err(|_| InitramfsError::TooLarge(name.to_owned()))?;
        let namesize = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
             {dmaj:08x}{dmin:08x}{rmaj:08x}{rmin:08x}{namesize:08x}{check:08x}",
            uid = 0,
            gid = 0,
            mtime = 0,
            dmaj = 0,
            dmin = 0,
            rmaj = rdev >> 8,
            rmin = rdev & 0xff,
            check = 0,
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> Result<(), InitramfsError> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..n])?;
        Ok(())
    }
}

/// An initramfs holding just `/init` (the given executable) and
/// `/dev/console`, so the init's output shows before devtmpfs exists.
pub fn with_init(init: &[u8]) -> Result<Vec<u8>, InitramfsError> {
    let mut w = NewcWriter::new(Vec::new());
    w.dir("/dev", 0o755)?;
    w.char_dev("/dev/console", 0o600, 5, 1)?;
    w.file("/init", 0o755, init)?;
    Ok(w.finish()?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses a newc archive back into (name, mode, data) triples.
    fn parse(mut a: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut off = 0usize;
        loop {
            assert_eq!(&a[..6], b"070701", "bad magic at {off}");
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&a[6 + i * 8..14 + i * 8]).unwrap(), 16)
                    .unwrap()
            };
            let (mode, size, namesize) = (field(1), field(6) as usize, field(11) as usize);
            let name = std::str::from_utf8(&a[110..110 + namesize - 1])
                .unwrap()
                .to_owned();
            let data_start = (110 + namesize).next_multiple_of(4);
            let data = a[data_start..data_start + size].to_vec();
            let next = (data_start + size).next_multiple_of(4);
            off += next;
            a = &a[next..];
            if name == TRAILER {
                assert!(a.is_empty());
                return out;
            }
            out.push((name, mode, data));
        }
    }

    #[test]
    fn round_trips_every_entry_kind() {
        let mut w = NewcWriter::new(Vec::new());
        w.dir("/dev", 0o755).unwrap();
        w.char_dev("/dev/console", 0o600, 5, 1).unwrap();
        w.file("/init", 0o755, b"#!/bin/sh\n").unwrap();
        w.symlink("/bin", "usr/bin").unwrap();
        w.file("/odd", 0o644, b"12345").unwrap();
        let (buf, len) = w.finish().unwrap();
        assert_eq!(len as usize, buf.len());
        assert_eq!(buf.len() % 4, 0);
        let e = parse(&buf);
        assert_eq!(e.len(), 5);
        assert_eq!(e[0], ("dev".into(), S_IFDIR | 0o755, vec![]));
        assert_eq!(e[1].1, S_IFCHR | 0o600);
        assert_eq!(
            e[2],
            ("init".into(), S_IFREG | 0o755, b"#!/bin/sh\n".to_vec())
        );
        assert_eq!(e[3], ("bin".into(), S_IFLNK | 0o777, b"usr/bin".to_vec()));
        assert_eq!(e[4].2, b"12345");
    }

    #[test]
    fn device_numbers_are_in_the_rdev_fields() {
        let mut w = NewcWriter::new(Vec::new());
        w.char_dev("/dev/ttyS0", 0o600, 4, 64).unwrap();
        let (buf, _) = w.finish().unwrap();
        let hex = std::str::from_utf8(&buf[6 + 9 * 8..6 + 11 * 8]).unwrap();
        assert_eq!(hex, "0000000400000040");
    }

    #[test]
    fn rejects_escaping_and_empty_paths() {
        let mut w = NewcWriter::new(Vec::new());
        for bad in ["", "/", "../etc", "a/../../b", "a//b", "TRAILER!!!"] {
            assert!(
                matches!(w.file(bad, 0o644, b""), Err(InitramfsError::BadPath(_))),
                "{bad}"
            );
        }
    }
}
