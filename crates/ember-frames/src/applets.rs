//! The busybox applet links, made by ember-init at boot rather than carried
//! in the initramfs.
//!
//! The kernel unpacks each symlink of the initramfs with three path walks
//! (create, chown, set the time): measured with `-icount` (BENCHMARKS.md §8),
//! the 269 applet symlinks were 11.2 M guest instructions, the largest item
//! of the appliance's boot beyond a bare busybox initramfs. One `symlink`
//! call each from init does the same for about half (5.9 M, measured with
//! `busybox --install -s`); carried as hard links instead they cost more
//! (+3 M). So the builder writes one small list, [`LIST`], and init makes
//! the links before it loads modules or reports READY.
//!
//! The list is text: the directory line, the link target line, then one
//! applet name per line, each line ending in `\n`. A line without its `\n`
//! (a list cut short by init's fixed buffer) is not used.
//!
//! ember writes the list (`src/appliance/userland.rs`); the guest init
//! (`guests/init`), which is `no_std` (no allocation, no std), reads it.

/// Where the builder writes the list in the guest (NUL-terminated for init).
pub const LIST: &[u8] = b"/.ember/applets\0";

/// The list's directory, link target and an iterator over its applet names
/// (complete lines only); `None` when the first two lines are not there.
#[inline]
pub fn parse(list: &[u8]) -> Option<(&[u8], &[u8], impl Iterator<Item = &[u8]>)> {
    let mut lines = list.split_inclusive(|&b| b == b'\n');
    let mut line = || -> Option<&[u8]> {
        let l = lines.next()?;
        l.strip_suffix(b"\n")
    };
    let dir = line()?;
    let target = line()?;
    if dir.is_empty() || target.is_empty() {
        return None;
    }
    let names = lines.filter_map(|l| l.strip_suffix(b"\n"));
    Some((dir, target, names))
}

/// `dir/name` NUL-terminated in `out` (including the NUL), or `None` when
/// `name` is not a plain file name (empty, `.`, `..`, a `/` or a NUL in it)
/// or the path does not fit.
#[inline]
pub fn link_path<'a>(dir: &[u8], name: &[u8], out: &'a mut [u8]) -> Option<&'a [u8]> {
    let plain = !name.is_empty()
        && name != b"."
        && name != b".."
        && !name.iter().any(|&b| b == b'/' || b == 0);
    let len = dir.len() + 1 + name.len() + 1;
    if !plain || dir.contains(&0) || len > out.len() {
        return None;
    }
    out[..dir.len()].copy_from_slice(dir);
    out[dir.len()] = b'/';
    out[dir.len() + 1..len - 1].copy_from_slice(name);
    out[len - 1] = 0;
    Some(&out[..len])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    #[test]
    fn parses_complete_lines_only() {
        let (dir, target, names) = parse(b"/d\n/usr/bin/busybox\nls\ncat\nhea").unwrap();
        assert_eq!(dir, b"/d");
        assert_eq!(target, b"/usr/bin/busybox");
        // `hea` has no `\n`: a list cut short, not an applet.
        assert_eq!(names.collect::<Vec<_>>(), [&b"ls"[..], b"cat"]);
        assert!(parse(b"/d\n/usr/bin/busybox").is_none());
        assert!(parse(b"\n/usr/bin/busybox\nls\n").is_none());
        assert!(parse(b"").is_none());
    }

    #[test]
    fn link_paths_are_plain_names_in_the_directory() {
        let mut buf = [0u8; 32];
        assert_eq!(link_path(b"/d", b"ls", &mut buf), Some(&b"/d/ls\0"[..]));
        for bad in [&b""[..], b".", b"..", b"a/b", b"a\0"] {
            assert_eq!(link_path(b"/d", bad, &mut buf), None, "{bad:?}");
        }
        // Exactly full fits; one more byte does not.
        let mut small = [0u8; 6];
        assert_eq!(link_path(b"/d", b"ls", &mut small), Some(&b"/d/ls\0"[..]));
        assert_eq!(link_path(b"/d", b"cat", &mut small), None);
    }
}
