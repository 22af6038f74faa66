//! The container's cgroup on the host. Docker's `docker stats` comes from
//! containerd's runc shim, which reads the host cgroup of the container's
//! process — here the supervisor. Left where the shim started it, that is
//! the shim's own cgroup (containerd's, dockerd's: on this kind of host the
//! whole session's memory and every CPU's time). So the supervisor moves
//! into a cgroup of its own, a child of the one it was in (it never leaves
//! the accounting it was under), before the VM starts: its VMM and helpers
//! follow it, and `docker stats` shows what the container costs the host —
//! the VM's memory and CPU time. The guest's own figures (its cgroup in the
//! VM) are `ember-oci events --stats`'.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The cgroup v1 controllers joined: the ones that only count (the runc
/// shim reads its figures from them). A hierarchy with any other is left
/// alone: the `cpu` controller would make the VM's threads one group that
/// competes with each of its siblings as a single task (a VM under TCG on
/// a busy host then starves), and the unified hierarchy of a hybrid host
/// counts nothing.
const COUNTING: [&str; 3] = ["memory", "cpuacct", "pids"];

/// The cgroup v1 controllers.
const V1: [&str; 14] = [
    "cpuset",
    "cpu",
    "cpuacct",
    "blkio",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "perf_event",
    "net_prio",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

/// Why the cgroup could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HostCgroupError {
    /// A cgroup directory or file refused.
    #[error("host cgroup {path}: {source}")]
    Io {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HostCgroupError + '_ {
    move |source| HostCgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The directories of the cgroups `/proc/self/cgroup` (its text `cgroups`)
/// names, in the hierarchies worth joining, as `/proc/self/mountinfo`
/// (`mounts`) places them.
fn current(cgroups: &str, mounts: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for line in cgroups.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let wanted: Vec<&str> = ctl.split(',').filter(|c| !c.is_empty()).collect();
        if !wanted.is_empty() && !wanted.iter().all(|c| COUNTING.contains(c)) {
            continue;
        }
        // cgroup v2 only when it is the one hierarchy (v1 lines name controllers).
        if wanted.is_empty() && cgroups.lines().any(|l| !l.starts_with("0::")) {
            continue;
        }
        let mount = mounts.lines().find_map(|m| {
            let (pre, post) = m.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let post: Vec<&str> = post.split(' ').collect();
            let (root, point) = (*pre.get(3)?, *pre.get(4)?);
            let (fstype, opts) = (*post.first()?, *post.get(2)?);
            let fits = if wanted.is_empty() {
                fstype == "cgroup2"
            } else {
                // The same controllers: `cpuacct` alone is not `cpu,cpuacct`.
                let mounted: Vec<&str> = opts.split(',').filter(|o| V1.contains(o)).collect();
                fstype == "cgroup"
                    && mounted.len() == wanted.len()
                    && wanted.iter().all(|c| mounted.contains(c))
            };
            fits.then_some((root, point))
        });
        let Some((root, point)) = mount else { continue };
        // A mount of a sub-tree (a cgroup namespace's) shows the path below its root.
        let rel = if root == "/" {
            path
        } else {
            path.strip_prefix(root).unwrap_or(path)
        };
        let dir = Path::new(point).join(rel.trim_start_matches('/'));
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

/// Moves this process into a new cgroup `name` below its own in each
/// hierarchy; the directories made. A hierarchy that refuses is skipped
/// (and said): the container runs all the same.
pub fn join(name: &str) -> Vec<PathBuf> {
    let (Ok(cgroups), Ok(mounts)) = (
        std::fs::read_to_string("/proc/self/cgroup"),
        std::fs::read_to_string("/proc/self/mountinfo"),
    ) else {
        return Vec::new();
    };
    let mut made = Vec::new();
    for parent in current(&cgroups, &mounts) {
        let dir = parent.join(name);
        let joined = (|| {
            match std::fs::create_dir(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(io(&dir)(e));
                }
                _ => {}
            }
            let procs = dir.join("cgroup.procs");
            std::fs::write(&procs, std::process::id().to_string()).map_err(io(&procs))
        })();
        match joined {
            Ok(()) => made.push(dir),
            Err(e) => {
                log::warn!("{e}: docker stats will show the shim's cgroup's figures");
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
    made
}

/// Moves this process back to the parents of `dirs` and removes them. What
/// is still in them after `grace` (the VM's helpers on their way out, or
/// anything they left behind) is the container's and is killed.
pub fn leave(dirs: &[PathBuf], grace: Duration) {
    let me = std::process::id();
    for d in dirs {
        if let Some(parent) = d.parent() {
            let _ = std::fs::write(parent.join("cgroup.procs"), me.to_string());
        }
    }
    clear(dirs, grace);
}

/// Removes `dirs`, killing what is still in them after `grace`.
pub fn clear(dirs: &[PathBuf], grace: Duration) {
    let me = std::process::id();
    remove(dirs, grace);
    for d in dirs.iter().filter(|d| d.exists()) {
        let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            if pid as u32 != me {
                // SAFETY: kill has no memory effects; the process is in the
                // container's own cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    remove(dirs, grace);
}

/// Removes `dirs`, waiting up to `wait` for their last processes to go.
fn remove(dirs: &[PathBuf], wait: Duration) {
    let deadline = Instant::now() + wait;
    for d in dirs {
        loop {
            match std::fs::remove_dir(d) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) if Instant::now() > deadline => {
                    log::warn!("rmdir {}: {e}", d.display());
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
39 31 0:36 /inner /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn the_hierarchies_docker_stats_reads_are_found_where_mounted() {
        // The scheduler's hierarchy (cpu), devices and the unified one of
        // a hybrid host are not joined.
        let cgroups = "\
8:pids:/inner/a
5:devices:/
4:memory:/session/x
2:cpu,cpuacct:/
0::/
";
        let dirs = current(cgroups, MOUNTS);
        let want = ["/sys/fs/cgroup/pids/a", "/sys/fs/cgroup/memory/session/x"].map(PathBuf::from);
        assert_eq!(dirs, want);
        let dirs = current("3:cpuacct:/\n1:cpu:/\n0::/\n", MOUNTS);
        assert_eq!(dirs, [PathBuf::from("/sys/fs/cgroup/cpuacct")]);
        // A cgroup v2 host: the one hierarchy.
        let v2 = "27 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            current("0::/system.slice/docker.service\n", v2),
            [PathBuf::from("/sys/fs/cgroup/system.slice/docker.service")]
        );
        assert!(current("0::/\n", "").is_empty());
    }
}
