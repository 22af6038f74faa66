//! The protocol between ember's host side (a containerd shim, `ember-oci`)
//! and the guest agent that runs containers' processes inside a VM.
//!
//! One byte stream carries everything: on the QEMU backend the appliance's
//! command channel (the agent is the appliance's command, and its stdin and
//! stdout are the stream), on the ember backend a vsock connection. Every
//! message is a frame, `kind u8 | length u32 le | payload`, as the appliance
//! protocol's:
//!
//! - `REQUEST` (host → guest): JSON [`RequestEnvelope`], answered by exactly
//!   one `RESPONSE` (guest → host, JSON [`ResponseEnvelope`]) with its id.
//!   Requests may be in flight concurrently; responses come in any order.
//! - `EVENT` (guest → host): JSON [`Event`], unasked (a process exited).
//! - `STDIN`/`STDIN_EOF` (host → guest), `STDOUT`/`STDERR` (guest → host):
//!   a process's stdio, the payload a [`Handle`] (u32 le) then the bytes.
//!   A process's `Exited` event comes after all of its output.
//!
//! Processes are named by handles the host picks, so data frames need no
//! lookup by name and an exec and a container's init are alike.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Frame kinds.
pub mod kind {
    /// A request (JSON).
    pub const REQUEST: u8 = 0x41;
    /// A response (JSON).
    pub const RESPONSE: u8 = 0x42;
    /// An event (JSON).
    pub const EVENT: u8 = 0x43;
    /// Bytes for a process's stdin.
    pub const STDIN: u8 = 0x44;
    /// A process's stdin ends.
    pub const STDIN_EOF: u8 = 0x45;
    /// Bytes a process wrote to stdout (or its terminal).
    pub const STDOUT: u8 = 0x46;
    /// Bytes a process wrote to stderr.
    pub const STDERR: u8 = 0x47;
}

/// Frame header: kind + length.
pub const HEADER_LEN: usize = 5;
/// Largest payload either side sends or accepts.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Largest chunk of stdio data in one frame.
pub const DATA_CHUNK: usize = 32 * 1024;

/// A process, as the host names it.
pub type Handle = u32;

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its kind (see [`kind`]).
    pub kind: u8,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// Encodes one frame; `Err` if the payload is too long.
pub fn encode(kind: u8, payload: &[u8]) -> io::Result<Vec<u8>> {
    if payload.len() > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "agent frame of {} bytes exceeds {MAX_PAYLOAD}",
                payload.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.push(kind);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// A data frame's payload: the handle, then the bytes.
pub fn data_payload(handle: Handle, bytes: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + bytes.len());
    p.extend_from_slice(&handle.to_le_bytes());
    p.extend_from_slice(bytes);
    p
}

/// Splits a data frame's payload into its handle and bytes.
pub fn split_data(payload: &[u8]) -> Option<(Handle, &[u8])> {
    let (h, rest) = payload.split_at_checked(4)?;
    Some((Handle::from_le_bytes(h.try_into().ok()?), rest))
}

/// Writes one frame with a single `write_all`, so frames written by
/// several threads under one lock never interleave.
pub fn write_frame(w: &mut dyn Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    w.write_all(&encode(kind, payload)?)?;
    w.flush()
}

/// Reads the next frame; `Ok(None)` at a clean end of stream (between frames).
pub fn read_frame(r: &mut dyn Read) -> io::Result<Option<Frame>> {
    let mut header = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("agent frame of {len} bytes exceeds {MAX_PAYLOAD}"),
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(Some(Frame {
        kind: header[0],
        payload,
    }))
}

/// A mount the agent makes inside a container's root (OCI `mounts`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Mount {
    /// Where, inside the container.
    pub destination: String,
    /// File system type (`proc`, `sysfs`, `tmpfs`, `devpts`, `mqueue`, …).
    pub fstype: String,
    /// Its source.
    pub source: String,
    /// Its options, as in `mount -o`.
    pub options: Vec<String>,
}

/// A container to set up in the guest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ContainerSpec {
    /// Its id.
    pub id: String,
    /// Its root, a guest path (a share of the host's bundle rootfs).
    pub rootfs: String,
    /// The hostname its processes see, if set.
    pub hostname: Option<String>,
    /// Mounts inside its root, in order.
    pub mounts: Vec<Mount>,
    /// Paths hidden from it (OCI `linux.maskedPaths`).
    #[serde(default)]
    pub masked_paths: Vec<String>,
    /// Paths it sees read-only (OCI `linux.readonlyPaths`).
    #[serde(default)]
    pub readonly_paths: Vec<String>,
    /// Kernel parameters to set (OCI `linux.sysctl`): the VM's, which is the pod's.
    #[serde(default)]
    pub sysctl: Vec<(String, String)>,
    /// The root is read-only (OCI `root.readonly`); the mounts inside it are not.
    #[serde(default)]
    pub readonly_root: bool,
    /// Limits of its cgroup in the guest (OCI `linux.resources`).
    #[serde(default)]
    pub resources: Resources,
}

/// The cgroup limits the agent applies to a container (cgroup v2 in the
/// guest); `None` leaves one as it is.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Resources {
    /// `memory.max`, bytes (negative: no limit).
    pub memory_limit: Option<i64>,
    /// `memory.swap.max` as OCI's memory+swap, bytes (negative: no limit).
    pub memory_swap: Option<i64>,
    /// `cpu.max`'s quota, microseconds per period (negative: no limit).
    pub cpu_quota: Option<i64>,
    /// `cpu.max`'s period, microseconds.
    pub cpu_period: Option<u64>,
    /// Cgroup v1 CPU shares, mapped to `cpu.weight` as runc maps them.
    pub cpu_shares: Option<u64>,
    /// `pids.max` (zero or negative: no limit).
    pub pids_limit: Option<i64>,
}

/// A container's figures, from its cgroup in the guest.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    /// `cpu.stat`: usage_usec, user_usec, system_usec, nr_periods,
    /// nr_throttled, throttled_usec.
    pub cpu: [u64; 6],
    /// `memory.current`.
    pub memory_usage: u64,
    /// `memory.max` (u64::MAX for `max`).
    pub memory_limit: u64,
    /// `memory.stat`, the fields by name.
    pub memory_stat: Vec<(String, u64)>,
    /// `memory.events`: low, high, max, oom, oom_kill.
    pub memory_events: [u64; 5],
    /// `pids.current`.
    pub pids_current: u64,
    /// `pids.max` (0 for `max`).
    pub pids_limit: u64,
}

/// A resource limit: the `RLIMIT_*` number, soft and hard.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Rlimit {
    /// Which (`RLIMIT_NOFILE` is 7).
    pub resource: u32,
    /// Soft limit.
    pub soft: u64,
    /// Hard limit.
    pub hard: u64,
}

/// Capability sets as bit masks (bit N is capability N).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Capabilities {
    /// Bounding set.
    pub bounding: u64,
    /// Effective set.
    pub effective: u64,
    /// Permitted set.
    pub permitted: u64,
    /// Inheritable set.
    pub inheritable: u64,
    /// Ambient set.
    pub ambient: u64,
}

/// A process to start in a container.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessSpec {
    /// The host's name for it.
    pub handle: Handle,
    /// The container it runs in.
    pub container: String,
    /// argv (argv[0] is looked up in the container's PATH unless it has a `/`).
    pub args: Vec<String>,
    /// Its environment, `NAME=value`.
    pub env: Vec<String>,
    /// Its working directory inside the container.
    pub cwd: String,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Supplementary groups.
    pub additional_gids: Vec<u32>,
    /// Run on a terminal (stdout carries it; stderr is empty).
    pub terminal: bool,
    /// The host sends stdin (else it is /dev/null).
    pub stdin: bool,
    /// Set no_new_privs.
    #[serde(default)]
    pub no_new_privileges: bool,
    /// Resource limits.
    #[serde(default)]
    pub rlimits: Vec<Rlimit>,
    /// Its capabilities; `None` keeps root's full sets.
    #[serde(default)]
    pub capabilities: Option<Capabilities>,
}

/// What the host asks.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Request {
    /// Who are you: the agent's version and the guest kernel's release.
    Hello,
    /// Set a container's root up (its mounts, hostname).
    CreateContainer(ContainerSpec),
    /// Start a process; answered with its guest pid.
    Start(ProcessSpec),
    /// Send a signal to a process, or with `all` to every process in its container.
    Signal {
        /// The process.
        handle: Handle,
        /// The signal number.
        signal: i32,
        /// To all of its container's processes.
        all: bool,
    },
    /// Set a process's terminal size.
    Resize {
        /// The process.
        handle: Handle,
        /// Columns.
        width: u16,
        /// Rows.
        height: u16,
    },
    /// The guest pids of a container's processes.
    Pids {
        /// The container.
        container: String,
    },
    /// Kill what is left of a container and undo its mounts.
    Destroy {
        /// The container.
        container: String,
    },
    /// Freeze every process of a container (its cgroup's freezer).
    Pause {
        /// The container.
        container: String,
    },
    /// Thaw a paused container.
    Resume {
        /// The container.
        container: String,
    },
    /// A container's figures; answered with `Stats`.
    Stats {
        /// The container.
        container: String,
    },
    /// Change a container's cgroup limits.
    Update {
        /// The container.
        container: String,
        /// The new limits.
        resources: Resources,
    },
    /// Stop: the agent exits after answering (and the VM powers off).
    Shutdown,
}

/// What the agent answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Response {
    /// Done.
    Ok,
    /// To `Hello`.
    Hello {
        /// The agent's version.
        version: String,
        /// `uname -r` of the guest.
        kernel_release: String,
    },
    /// To `Start`: the process's guest pid.
    Started {
        /// Its pid.
        pid: u32,
    },
    /// To `Pids`.
    Pids(Vec<u32>),
    /// To `Stats`.
    Stats(Stats),
    /// The request failed: a one-line reason.
    Error(String),
}

/// Unasked news from the agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Event {
    /// A process exited (after all of its output was sent).
    Exited {
        /// The process.
        handle: Handle,
        /// Its exit code, or 128 + the signal that killed it.
        status: i32,
    },
    /// The kernel's OOM killer killed a process of a container (its
    /// cgroup's `oom_kill` count went up).
    Oom {
        /// The container.
        container: String,
    },
}

/// A request and its id.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RequestEnvelope {
    /// Matches the response.
    pub id: u64,
    /// The request.
    pub request: Request,
}

/// A response and the id of its request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResponseEnvelope {
    /// The request's id.
    pub id: u64,
    /// The response.
    pub response: Response,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_lengths_are_refused() {
        let mut wire = Vec::new();
        write_frame(&mut wire, kind::STDOUT, &data_payload(7, b"hi\0\xff")).unwrap();
        write_frame(&mut wire, kind::STDIN_EOF, &data_payload(9, b"")).unwrap();
        let mut r = &wire[..];
        let f = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(f.kind, kind::STDOUT);
        assert_eq!(split_data(&f.payload), Some((7, &b"hi\0\xff"[..])));
        let f = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(split_data(&f.payload), Some((9, &b""[..])));
        assert!(read_frame(&mut r).unwrap().is_none());
        // Cut inside a frame: an error, not a clean end.
        let mut cut = &wire[..3];
        assert!(read_frame(&mut cut).is_err());
        let big = [kind::EVENT, 0xff, 0xff, 0xff, 0x7f];
        assert!(read_frame(&mut &big[..]).is_err());
        assert_eq!(split_data(b"abc"), None);
    }

    #[test]
    fn requests_round_trip_as_json() {
        let r = RequestEnvelope {
            id: 3,
            request: Request::Signal {
                handle: 1,
                signal: 15,
                all: true,
            },
        };
        let j = serde_json::to_vec(&r).unwrap();
        assert_eq!(serde_json::from_slice::<RequestEnvelope>(&j).unwrap(), r);
    }
}
