//! Containers' cgroups in the guest (cgroup v2): each container's processes
//! join `/sys/fs/cgroup/ember/ID`, whose freezer pauses them, whose files
//! give its figures and whose limits `linux.resources` sets.
//!
//! Pausing uses the cgroup freezer rather than SIGSTOP to a process group:
//! a container's processes need not share one group (a `setsid` in the
//! container leaves it), SIGSTOP is seen by their parents (wait status,
//! SIGCHLD) and undone by any SIGCONT the container sends itself, and
//! children forked while it spreads escape it. The freezer takes the
//! whole cgroup, new members included, and says when it is done.

use ember_agent::{Resources, Stats};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Where cgroup v2 is mounted in the guest.
const ROOT: &str = "/sys/fs/cgroup";
/// The controllers containers get.
const CONTROLLERS: &str = "+cpu +memory +pids";
/// How long a freeze may take to settle.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

/// Cgroup errors: each is answered to the host as one line.
#[derive(Debug, Error)]
pub enum CgroupError {
    /// The guest kernel offers no cgroup v2 (or its mount failed).
    #[error("cgroup v2 is not available in the guest: {0}")]
    Unavailable(String),
    /// A cgroup file could not be read or written.
    #[error("cgroup {what}: {source}")]
    Io {
        /// Which file, doing what.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The freezer did not settle.
    #[error("the container's processes did not freeze within {0:?}")]
    FreezeTimeout(Duration),
}

fn io_err(what: String) -> impl FnOnce(io::Error) -> CgroupError {
    move |source| CgroupError::Io { what, source }
}

/// The parent of every container's cgroup, once set up.
pub struct Hierarchy {
    base: Result<PathBuf, String>,
}

impl Hierarchy {
    /// Mounts cgroup v2 at /sys/fs/cgroup (unless it is there) and makes
    /// `ember/` with the controllers delegated to its children. A kernel
    /// without it leaves every later call failing in one line.
    pub fn setup() -> Hierarchy {
        Hierarchy {
            // Kept as the reason alone: `create` says "not available" once.
            base: setup().map_err(|e| match e {
                CgroupError::Unavailable(why) => why,
                e => e.to_string(),
            }),
        }
    }

    /// A container's cgroup, made.
    pub fn create(&self, id: &str) -> Result<PathBuf, CgroupError> {
        let base = self
            .base
            .as_ref()
            .map_err(|e| CgroupError::Unavailable(e.clone()))?;
        let dir = base.join(id);
        match std::fs::create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(dir),
            Err(e) => Err(io_err(format!("mkdir {}", dir.display()))(e)),
        }
    }
}

fn setup() -> Result<PathBuf, CgroupError> {
    let root = Path::new(ROOT);
    if !root.join("cgroup.controllers").exists() {
        let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
        let (src, target) = (c("cgroup2"), c(ROOT));
        // SAFETY: NUL-terminated strings alive for the call; no data.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                src.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(CgroupError::Unavailable(format!(
                "mount cgroup2 on {ROOT}: {}",
                io::Error::last_os_error()
            )));
        }
    }
    // The root may hold processes and still delegate (it is exempt from
    // the no-internal-processes rule); `ember/` holds none.
    write(&root.join("cgroup.subtree_control"), CONTROLLERS)?;
    let base = root.join("ember");
    if let Err(e) = std::fs::create_dir(&base)
        && e.kind() != io::ErrorKind::AlreadyExists
    {
        return Err(io_err(format!("mkdir {}", base.display()))(e));
    }
    write(&base.join("cgroup.subtree_control"), CONTROLLERS)?;
    Ok(base)
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(io_err(format!("write {value:?} to {}", path.display())))
}

fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(io_err(format!("read {}", path.display())))
}

/// `KEY VALUE` lines (cpu.stat, memory.stat, memory.events, cgroup.events).
fn keyed(text: &str) -> impl Iterator<Item = (&str, u64)> {
    text.lines().filter_map(|l| {
        let (k, v) = l.split_once(' ')?;
        Some((k, v.trim().parse().ok()?))
    })
}

fn field(text: &str, key: &str) -> u64 {
    keyed(text).find(|(k, _)| *k == key).map_or(0, |(_, v)| v)
}

/// A limit file's value: a number, or `max`.
fn limit(text: &str) -> u64 {
    text.trim().parse().unwrap_or(u64::MAX)
}

/// The cgroup v1 shares → v2 weight mapping runc uses (2..262144 onto 1..10000).
pub fn shares_to_weight(shares: u64) -> u64 {
    if shares == 0 {
        return 100;
    }
    1 + (shares.clamp(2, 262_144) - 2) * 9999 / 262_142
}

/// Applies `r` to the cgroup at `dir`.
pub fn apply(dir: &Path, r: &Resources) -> Result<(), CgroupError> {
    let num_or_max = |v: i64| {
        if v < 0 {
            "max".to_owned()
        } else {
            v.to_string()
        }
    };
    if let Some(m) = r.memory_limit {
        write(&dir.join("memory.max"), &num_or_max(m))?;
    }
    if let Some(s) = r.memory_swap {
        // OCI's swap is memory + swap; v2's swap.max is the swap alone.
        let swap = match (s, r.memory_limit) {
            (s, _) if s < 0 => -1,
            (s, Some(m)) if m >= 0 => (s - m).max(0),
            (s, _) => s,
        };
        // A guest without swap has no such file: nothing to limit.
        let path = dir.join("memory.swap.max");
        if path.exists() {
            write(&path, &num_or_max(swap))?;
        }
    }
    if r.cpu_quota.is_some() || r.cpu_period.is_some() {
        let quota = r.cpu_quota.map_or("max".to_owned(), num_or_max);
        let period = r.cpu_period.unwrap_or(100_000);
        write(&dir.join("cpu.max"), &format!("{quota} {period}"))?;
    }
    if let Some(s) = r.cpu_shares {
        write(&dir.join("cpu.weight"), &shares_to_weight(s).to_string())?;
    }
    if let Some(p) = r.pids_limit {
        write(
            &dir.join("pids.max"),
            &if p <= 0 {
                "max".to_owned()
            } else {
                p.to_string()
            },
        )?;
    }
    Ok(())
}

/// Freezes (or thaws) the cgroup and waits until the kernel says so.
pub fn freeze(dir: &Path, frozen: bool) -> Result<(), CgroupError> {
    write(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
    let deadline = Instant::now() + FREEZE_TIMEOUT;
    let want = u64::from(frozen);
    loop {
        if field(&read(&dir.join("cgroup.events"))?, "frozen") == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(CgroupError::FreezeTimeout(FREEZE_TIMEOUT));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether the cgroup is frozen (or freezing).
pub fn is_frozen(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1")
}

/// The OOM killer's count for the cgroup.
pub fn oom_kills(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("memory.events")).map_or(0, |t| field(&t, "oom_kill"))
}

/// The cgroup's figures.
pub fn stats(dir: &Path) -> Result<Stats, CgroupError> {
    let cpu = read(&dir.join("cpu.stat"))?;
    let events = read(&dir.join("memory.events"))?;
    let memory_stat = read(&dir.join("memory.stat"))?;
    Ok(Stats {
        cpu: [
            "usage_usec",
            "user_usec",
            "system_usec",
            "nr_periods",
            "nr_throttled",
            "throttled_usec",
        ]
        .map(|k| field(&cpu, k)),
        memory_usage: read(&dir.join("memory.current"))?
            .trim()
            .parse()
            .unwrap_or(0),
        memory_limit: limit(&read(&dir.join("memory.max"))?),
        memory_stat: keyed(&memory_stat)
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        memory_events: ["low", "high", "max", "oom", "oom_kill"].map(|k| field(&events, k)),
        pids_current: read(&dir.join("pids.current"))?.trim().parse().unwrap_or(0),
        pids_limit: match limit(&read(&dir.join("pids.max"))?) {
            u64::MAX => 0,
            n => n,
        },
    })
}

/// Removes the cgroup once its processes are gone (killed just before:
/// they may take a moment to leave).
pub fn remove(dir: &Path) {
    // Killed processes in a frozen cgroup still die; thawing lets them go at once.
    let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
    let deadline = Instant::now() + Duration::from_secs(2);
    while std::fs::remove_dir(dir).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files_and_limits_parse() {
        let t = "usage_usec 120\nuser_usec 100\nsystem_usec 20\n";
        assert_eq!(field(t, "user_usec"), 100);
        assert_eq!(field(t, "nr_periods"), 0);
        assert_eq!(limit("max\n"), u64::MAX);
        assert_eq!(limit("33554432\n"), 33_554_432);
        assert_eq!(shares_to_weight(1024), 39);
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(262_144), 10_000);
    }
}
