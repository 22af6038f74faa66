//! The host's root as the command's root: the virtio-fs share the host
//! names in `HOSTROOT`, mounted read-only, under an overlay whose upper
//! layer is a tmpfs (the command's writes stay in guest memory and vanish
//! with it), with /dev, /proc and /sys of the guest's own; and the `SHARE`s
//! mounted into it. The command is then run chrooted there (main.rs), as
//! with a `ROOT` device.

use crate::sys;

/// Where the host's root is mounted, read-only: the overlay's lower layer.
const HOST_DIR: &[u8] = b"/.ember/host\0";
/// The tmpfs holding the overlay's upper and work directories.
const RW_DIR: &[u8] = b"/.ember/rw\0";
const UPPER_DIR: &[u8] = b"/.ember/rw/upper\0";
const WORK_DIR: &[u8] = b"/.ember/rw/work\0";
const OVERLAY_OPTIONS: &[u8] =
    b"lowerdir=/.ember/host,upperdir=/.ember/rw/upper,workdir=/.ember/rw/work\0";
/// A file system the guest mounts inside the root: the path below it, the
/// source, the type, flags and options (NUL-terminated but the path).
type Mount = (
    &'static [u8],
    &'static [u8],
    &'static [u8],
    usize,
    &'static [u8],
);
/// Longest path built here (a share's mount point inside the root).
const PATH_LEN: usize = 4096;
/// Where shares mounted before READY wait for their `SHARE` frame (one
/// directory per tag): the appliance's snapshot holds them mounted, so a
/// restored guest only binds each to its path.
const STAGING_DIR: &[u8] = b"/.ember/shares\0";

/// Mounts the host's root (virtio-fs tag `tag`, NUL-terminated) at `root`
/// (NUL-terminated), overlaid, with the guest's own /dev (and /dev/pts,
/// /dev/shm), /proc and /sys.
pub fn mount(tag: &[u8], root: &[u8]) -> Result<(), &'static [u8]> {
    for dir in [HOST_DIR, RW_DIR] {
        let _ = sys::mkdir(dir, 0o755);
    }
    sys::mount_with(tag, HOST_DIR, b"virtiofs\0", sys::MS_RDONLY, b"\0").map_err(|_| {
        &b"cannot mount the host's root over virtio-fs (no virtiofs module? \
           `ember run --initramfs` runs without it)"[..]
    })?;
    sys::mount_with(b"tmpfs\0", RW_DIR, b"tmpfs\0", 0, b"mode=0755\0")
        .map_err(|_| &b"cannot mount the tmpfs for the root's writable layer"[..])?;
    for dir in [UPPER_DIR, WORK_DIR] {
        let _ = sys::mkdir(dir, 0o755);
    }
    sys::mount_with(b"overlay\0", root, b"overlay\0", 0, OVERLAY_OPTIONS)
        .map_err(|_| &b"cannot overlay the host's root (no overlay module?)"[..])?;
    // The host's own would show the host's devices and processes: the
    // guest's are mounted over them. A missing mount point only means the
    // command lacks those files.
    let mut path = [0u8; PATH_LEN];
    let sub = |path: &mut [u8; PATH_LEN], rel: &[u8]| join(path, root, rel).is_some();
    let mounts: [Mount; 5] = [
        (b"/dev", b"devtmpfs\0", b"devtmpfs\0", 0, b"\0"),
        (
            b"/dev/pts",
            b"devpts\0",
            b"devpts\0",
            sys::MS_NOSUID,
            b"ptmxmode=0666\0",
        ),
        (
            b"/dev/shm",
            b"tmpfs\0",
            b"tmpfs\0",
            sys::MS_NOSUID | sys::MS_NODEV,
            b"mode=1777\0",
        ),
        (b"/proc", b"proc\0", b"proc\0", 0, b"\0"),
        (b"/sys", b"sysfs\0", b"sysfs\0", 0, b"\0"),
    ];
    for (rel, source, fstype, flags, data) in mounts {
        if sub(&mut path, rel) {
            let _ = sys::mkdir(&path, 0o755);
            let _ = sys::mount_with(source, &path, fstype, flags, data);
        }
    }
    Ok(())
}

/// Mounts the shares tagged in `tags` (a comma list, NUL-terminated) in
/// their staging directories, read-write (the device refuses writes to a
/// read-only one; the bind in [`mount_share`] says `ro` too), each with its
/// root's attributes fetched, so no request of the mount is in flight when
/// the snapshot is taken.
pub fn premount_shares(tags: &[u8]) -> Result<(), &'static [u8]> {
    let _ = sys::mkdir(STAGING_DIR, 0o755);
    for tag in tags[..tags.len() - 1].split(|&b| b == b',') {
        if tag.is_empty() {
            continue;
        }
        let mut tag_z = [0u8; 256];
        if tag.len() >= tag_z.len() {
            return Err(b"a share's tag is too long");
        }
        tag_z[..tag.len()].copy_from_slice(tag);
        let mut path = [0u8; PATH_LEN];
        let len = staging(&mut path, tag).ok_or(&b"a share's tag is too long"[..])?;
        let _ = sys::mkdir(&path[..=len], 0o755);
        sys::mount_with(&tag_z[..=tag.len()], &path[..=len], b"virtiofs\0", 0, b"\0")
            .map_err(|_| &b"cannot mount a --share over virtio-fs"[..])?;
        sys::stat(&path[..=len]).map_err(|_| &b"cannot reach a --share's directory"[..])?;
    }
    Ok(())
}

/// Mounts the share a `SHARE` payload names (`ro|rw TAG PATH`, no NUL) at
/// PATH inside `root` (NUL-terminated), making PATH's directories in the
/// overlay where the host has none: a bind of its staging mount when
/// `premounted` (the tags [`premount_shares`] mounted) has its tag.
pub fn mount_share(
    share: &[u8],
    root: &[u8],
    premounted: Option<&[u8]>,
) -> Result<(), &'static [u8]> {
    const BAD: &[u8] = b"bad SHARE frame";
    let mut words = share.splitn(3, |&b| b == b' ');
    let flags = match words.next() {
        Some(b"ro") => sys::MS_RDONLY,
        Some(b"rw") => 0,
        _ => return Err(BAD),
    };
    let tag = words.next().filter(|t| !t.is_empty()).ok_or(BAD)?;
    let rel = words.next().filter(|p| p.starts_with(b"/")).ok_or(BAD)?;
    let mut tag_z = [0u8; 256];
    if tag.len() >= tag_z.len() {
        return Err(BAD);
    }
    tag_z[..tag.len()].copy_from_slice(tag);
    let mut path = [0u8; PATH_LEN];
    let len = join(&mut path, root, rel).ok_or(&b"a share's path is too long"[..])?;
    // Each directory on the way, from the top (EEXIST is fine).
    for i in root.len()..len {
        if path[i] == b'/' {
            path[i] = 0;
            let _ = sys::mkdir(&path[..=i], 0o755);
            path[i] = b'/';
        }
    }
    let _ = sys::mkdir(&path[..=len], 0o755);
    let staged =
        premounted.is_some_and(|p| p[..p.len() - 1].split(|&b| b == b',').any(|t| t == tag));
    if staged {
        let mut from = [0u8; PATH_LEN];
        let n = staging(&mut from, tag).ok_or(BAD)?;
        let failed = &b"cannot mount a --share in the command's root"[..];
        sys::mount_with(&from[..=n], &path[..=len], b"\0", sys::MS_BIND, b"\0")
            .map_err(|_| failed)?;
        if flags & sys::MS_RDONLY != 0 {
            sys::mount_with(
                b"\0",
                &path[..=len],
                b"\0",
                sys::MS_REMOUNT | sys::MS_BIND | sys::MS_RDONLY,
                b"\0",
            )
            .map_err(|_| failed)?;
        }
        return Ok(());
    }
    sys::mount_with(
        &tag_z[..=tag.len()],
        &path[..=len],
        b"virtiofs\0",
        flags,
        b"\0",
    )
    .map_err(|_| &b"cannot mount a --share over virtio-fs"[..])?;
    Ok(())
}

/// Writes the staging directory of share `tag` (no NUL), NUL-terminated,
/// into `out`; returns its length without the NUL.
fn staging(out: &mut [u8; PATH_LEN], tag: &[u8]) -> Option<usize> {
    let len = join(out, STAGING_DIR, b"/")?;
    let end = len + tag.len();
    if end >= out.len() || tag.contains(&0) || tag.contains(&b'/') {
        return None;
    }
    out[len..end].copy_from_slice(tag);
    out[end] = 0;
    Some(end)
}

/// Writes `root` (NUL-terminated) without its NUL, then `rel`, then a NUL
/// into `out`; returns the length without the NUL, `None` if it does not fit.
fn join(out: &mut [u8; PATH_LEN], root: &[u8], rel: &[u8]) -> Option<usize> {
    let root = &root[..root.len() - 1];
    let len = root.len() + rel.len();
    if len >= out.len() || rel.contains(&0) {
        return None;
    }
    out[..root.len()].copy_from_slice(root);
    out[root.len()..len].copy_from_slice(rel);
    out[len] = 0;
    Some(len)
}
