//! A container's record under `--root`: `ROOT/ID/state.json` (what
//! `state` prints) and `ROOT/ID/ctl.sock`, where its supervisor — the
//! container's process on the host — answers.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// What ember-oci keeps of a container.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    /// Its id.
    pub id: String,
    /// The supervisor's pid (0 until it runs).
    pub pid: u32,
    /// `creating`, `created`, `running`, `paused` (`stopped` is derived:
    /// the supervisor is gone).
    pub status: String,
    /// The bundle.
    pub bundle: String,
    /// Its root.
    pub rootfs: String,
    /// When it was created, RFC 3339.
    pub created: String,
    /// The spec's annotations.
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// The container's directory.
pub fn dir(root: &Path, id: &str) -> PathBuf {
    root.join(id)
}

/// The directory its VM shares with the guest (`PodDir`): its root and
/// bind mounts' sources are mounted there while it runs.
pub fn pod_dir(root: &Path, id: &str) -> PathBuf {
    dir(root, id).join("pod")
}

/// The host cgroups its supervisor made for itself (one path a line).
pub fn host_cgroups(root: &Path, id: &str) -> PathBuf {
    dir(root, id).join("host-cgroups")
}

/// Its control socket.
pub fn ctl(root: &Path, id: &str) -> PathBuf {
    dir(root, id).join("ctl.sock")
}

/// A Unix socket's path short enough for `sun_path` (108 bytes: Docker's
/// state directories plus a 64-digit id are not): through its directory
/// opened here, `/proc/self/fd/N/NAME`. The directory's handle must be
/// kept while the path is used.
pub fn socket_path(path: &Path) -> std::io::Result<(Option<std::fs::File>, PathBuf)> {
    if path.as_os_str().len() < 100 {
        return Ok((None, path.to_path_buf()));
    }
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok((None, path.to_path_buf()));
    };
    let d = std::fs::File::open(parent)?;
    let short = PathBuf::from(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&d)
    ))
    .join(name);
    Ok((Some(d), short))
}

impl State {
    /// Reads it; `None` if there is no such container.
    pub fn load(root: &Path, id: &str) -> Option<State> {
        let text = std::fs::read(dir(root, id).join("state.json")).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Writes it (whole, by a rename).
    pub fn save(&self, root: &Path) -> std::io::Result<()> {
        let d = dir(root, &self.id);
        let tmp = d.join(format!("state.json.{}", std::process::id()));
        std::fs::write(
            &tmp,
            serde_json::to_vec(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(tmp, d.join("state.json"))
    }

    /// Whether its supervisor still runs (a zombie, or another program that
    /// took its pid, does not count).
    pub fn alive(&self) -> bool {
        self.pid != 0 && supervisor_alive(self.pid, &self.id)
    }

    /// Its status as runc names it.
    pub fn status(&self) -> &str {
        if self.alive() {
            &self.status
        } else {
            "stopped"
        }
    }
}

fn supervisor_alive(pid: u32, id: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    if stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .trim_start()
        .starts_with('Z')
    {
        return false;
    }
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
        let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
        args.contains(&&b"supervise"[..]) && args.contains(&id.as_bytes())
    })
}

/// `t` as RFC 3339 (UTC, nanoseconds), as runc's `created`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60,
        d.subsec_nanos()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times_are_rfc3339() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_795_959_444, 5);
        assert_eq!(rfc3339(t), "2026-11-29T13:37:24.000000005Z");
        assert_eq!(
            rfc3339(SystemTime::UNIX_EPOCH),
            "1970-01-01T00:00:00.000000000Z"
        );
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000000000Z");
    }
}
