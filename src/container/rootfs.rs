//! The container's root file system on the host: containerd's snapshot
//! mounts (an overlay of the image's layers and the container's upper
//! layer, or a bind of a single layer) mounted at the bundle's `rootfs`,
//! from where a virtio-fs share carries it into the VM without a copy.

use super::ContainerError;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// One mount of a create request (containerd's `types.Mount`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootMount {
    /// File system type (`overlay`, `bind`).
    pub fstype: String,
    /// Source.
    pub source: String,
    /// Options, as in `mount -o`.
    pub options: Vec<String>,
}

/// Splits `mount -o` options into mount(2) flags and the data string.
pub fn split_options(options: &[String]) -> (libc::c_ulong, String) {
    let mut flags = 0;
    let mut data = Vec::new();
    for o in options {
        match o.as_str() {
            "ro" => flags |= libc::MS_RDONLY,
            "rw" => flags &= !libc::MS_RDONLY,
            "nosuid" => flags |= libc::MS_NOSUID,
            "nodev" => flags |= libc::MS_NODEV,
            "noexec" => flags |= libc::MS_NOEXEC,
            "bind" => flags |= libc::MS_BIND,
            "rbind" => flags |= libc::MS_BIND | libc::MS_REC,
            "relatime" => flags |= libc::MS_RELATIME,
            "noatime" => flags |= libc::MS_NOATIME,
            other => data.push(other),
        }
    }
    (flags, data.join(","))
}

fn cstring(p: &Path) -> Result<CString, ContainerError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| ContainerError::Mount {
        what: p.display().to_string(),
        source: std::io::ErrorKind::InvalidInput.into(),
    })
}

/// Mounts `mounts` one over the other at `target` (made if missing).
pub fn mount_all(mounts: &[RootMount], target: &Path) -> Result<(), ContainerError> {
    std::fs::create_dir_all(target)
        .map_err(ContainerError::io(format!("mkdir {}", target.display())))?;
    for m in mounts {
        let (mut flags, data) = split_options(&m.options);
        if m.fstype == "bind" {
            flags |= libc::MS_BIND;
        }
        let what = format!("{} {} on {}", m.fstype, m.source, target.display());
        let fail = |source| ContainerError::Mount {
            what: what.clone(),
            source,
        };
        let src = CString::new(m.source.as_bytes())
            .map_err(|_| fail(std::io::ErrorKind::InvalidInput.into()))?;
        let ty = CString::new(m.fstype.as_bytes())
            .map_err(|_| fail(std::io::ErrorKind::InvalidInput.into()))?;
        let dt = CString::new(data.as_bytes())
            .map_err(|_| fail(std::io::ErrorKind::InvalidInput.into()))?;
        let tgt = cstring(target)?;
        // A bind is made read-only by a remount after it.
        let first = if flags & libc::MS_BIND != 0 {
            flags & !libc::MS_RDONLY
        } else {
            flags
        };
        // SAFETY: every pointer is a NUL-terminated string alive for the call.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                tgt.as_ptr(),
                ty.as_ptr(),
                first,
                dt.as_ptr().cast(),
            )
        };
        if r != 0 {
            return Err(fail(std::io::Error::last_os_error()));
        }
        if flags & libc::MS_BIND != 0 && flags & libc::MS_RDONLY != 0 {
            // SAFETY: as above; source and type are ignored by a remount.
            let r = unsafe {
                libc::mount(
                    std::ptr::null(),
                    tgt.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
                    std::ptr::null(),
                )
            };
            if r != 0 {
                return Err(fail(std::io::Error::last_os_error()));
            }
        }
    }
    Ok(())
}

/// Unmounts everything at `target` (lazily, so a busy one still goes);
/// true if anything was mounted there.
pub fn unmount_all(target: &Path) -> bool {
    let Ok(c) = cstring(target) else {
        return false;
    };
    let mut any = false;
    // Stacked mounts come off one at a time.
    for _ in 0..16 {
        // SAFETY: c is a NUL-terminated path alive for the call.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
            break;
        }
        any = true;
    }
    any
}

/// Bind-mounts `source` (recursively) at `target`, made for it (a
/// directory, or an empty file for a file), read-only if asked.
pub fn bind(source: &Path, target: &Path, readonly: bool) -> Result<(), ContainerError> {
    let meta = std::fs::metadata(source).map_err(ContainerError::io(format!(
        "bind source {}",
        source.display()
    )))?;
    if meta.is_dir() {
        return mount_all(
            &[RootMount {
                fstype: "bind".into(),
                source: source.display().to_string(),
                options: if readonly {
                    vec!["rbind".into(), "ro".into()]
                } else {
                    vec!["rbind".into()]
                },
            }],
            target,
        );
    }
    if let Some(d) = target.parent() {
        std::fs::create_dir_all(d).map_err(ContainerError::io(format!("mkdir {}", d.display())))?;
    }
    std::fs::File::create(target)
        .map_err(ContainerError::io(format!("create {}", target.display())))?;
    let what = format!("bind {} on {}", source.display(), target.display());
    let fail = |source| ContainerError::Mount {
        what: what.clone(),
        source,
    };
    let (src, tgt) = (cstring(source)?, cstring(target)?);
    // SAFETY: NUL-terminated paths alive for the calls; no type or data.
    unsafe {
        if libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) != 0
        {
            return Err(fail(std::io::Error::last_os_error()));
        }
        if readonly
            && libc::mount(
                std::ptr::null(),
                tgt.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
                std::ptr::null(),
            ) != 0
        {
            return Err(fail(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// The mount points at `dir` or below it, deepest first.
fn mount_points_under(dir: &Path) -> Vec<String> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let top = dir.to_string_lossy();
    let below = format!("{}/", top.trim_end_matches('/'));
    let mut points: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| *p == top || p.starts_with(&below))
        .map(str::to_owned)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    points.dedup();
    points
}

/// Unmounts everything mounted at `dir` or below it, deepest first
/// (lazily); how many mounts went.
pub fn unmount_under(dir: &Path) -> usize {
    let mut n = 0;
    for p in mount_points_under(dir) {
        if let Ok(c) = CString::new(p) {
            // SAFETY: c is a NUL-terminated path alive for the call.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
                n += 1;
            }
        }
    }
    n
}

/// Whether anything is mounted at `dir` or below it (then removing the
/// directory would remove what is mounted there).
pub fn is_mounted_under(dir: &Path) -> bool {
    !mount_points_under(dir).is_empty()
}

/// Whether something is mounted at `target` (per /proc/self/mountinfo).
pub fn is_mounted(target: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = target.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|p| p == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_split_into_flags_and_data() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (f, d) = split_options(&o(&[
            "workdir=/w",
            "upperdir=/u",
            "lowerdir=/a:/b",
            "index=off",
        ]));
        assert_eq!(f, 0);
        assert_eq!(d, "workdir=/w,upperdir=/u,lowerdir=/a:/b,index=off");
        let (f, d) = split_options(&o(&["ro", "rbind"]));
        assert_eq!(f, libc::MS_RDONLY | libc::MS_BIND | libc::MS_REC);
        assert_eq!(d, "");
    }
}
