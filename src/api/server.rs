//! The control socket's server (see [`super`] for what it answers).
//!
//! A request that is malformed or out of order (resume while running, a
//! snapshot of a running VM) gets an error reply and changes nothing. The
//! socket is made with the user's permissions only (0600) and removed when
//! ember exits, however it exits: normally, on an error, or on SIGTERM,
//! SIGINT, SIGHUP or SIGQUIT ([`crate::cleanup`]). At most [`MAX_CLIENTS`]
//! at once; each has [`request_limit`] to send a whole request line, counted
//! from when the server starts waiting for it, so a client that trickles
//! bytes cannot hold its place.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use thiserror::Error;

use super::{
    BalloonReport, MemReport, Reply, Request, Response, SnapshotWritten, Status, VmState, encode,
};

use crate::cleanup::TempPath;
use ember_vmm::devices::virtio::target_pages;
use ember_vmm::machine::Machine;
use ember_vmm::vstate::control::RunState;

/// A request line may not be longer than this.
const MAX_REQUEST: usize = 64 * 1024;
/// At most this many clients at once; more are refused.
const MAX_CLIENTS: usize = 8;
/// A client that has not sent a whole request this long after the server
/// began waiting for it is dropped, unless `EMBER_API_REQUEST_TIMEOUT` says
/// otherwise.
const REQUEST_LIMIT: Duration = Duration::from_secs(60);
/// The environment variable that sets it, in seconds.
const REQUEST_LIMIT_ENV: &str = "EMBER_API_REQUEST_TIMEOUT";
/// Bytes per MiB, for the balloon's target.
const MIB: u64 = 1 << 20;
/// The balloon counts 4 KiB pages.
const BALLOON_PAGE: u64 = 4096;

/// Control-socket errors: binding it, and a request's refusals (whose
/// text is the reply's `error`).
#[derive(Debug, Error)]
pub enum ApiError {
    /// The request line does not parse as a [`Request`].
    #[error("malformed request: {0}")]
    Malformed(serde_json::Error),
    /// The request line is longer than [`MAX_REQUEST`].
    #[error("request too long")]
    TooLong,
    /// [`MAX_CLIENTS`] are connected.
    #[error("too many clients")]
    TooManyClients,
    /// The VM has ended; nothing more is done.
    #[error("the VM has ended")]
    Ended,
    /// A pause or resume out of order.
    #[error(transparent)]
    Control(#[from] ember_vmm::vstate::control::ControlError),
    /// A snapshot directory given relative to who knows what.
    #[error("the snapshot directory must be an absolute path")]
    RelativeSnapshotDir,
    /// The snapshot failed.
    #[error(transparent)]
    Snapshot(#[from] ember_vmm::snapshot::SnapshotError),
    /// A virtio-mem request to a VM without the device.
    #[error("the VM has no virtio-mem region (--mem-boot)")]
    NoHotplug,
    /// A size the region cannot take.
    #[error("{0} MiB is not between the boot RAM ({1} MiB) and the whole memory ({2} MiB)")]
    MemSize(u64, u64, u64),
    /// A balloon request to a VM without one.
    #[error("the VM has no balloon (--balloon)")]
    NoBalloon,
    /// A balloon target the guest or the device cannot take.
    #[error(transparent)]
    BalloonTarget(#[from] ember_vmm::devices::virtio::BalloonError),
    /// Something already listens on the path.
    #[error("{0} is in use by a running VM")]
    InUse(PathBuf),
    /// The path exists and is not a socket.
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    /// Binding failed.
    #[error("{path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// What the server acts on.
pub struct ApiContext {
    /// The VM, its pause control, devices and balloon.
    pub machine: Arc<Machine>,
}

/// The bound socket. Dropping it (or [`ApiSocket::remove`]) removes the path.
#[derive(Debug)]
pub struct ApiSocket {
    listener: UnixListener,
    /// Removed on drop, on a fatal signal and by `cleanup::run_all`.
    path: TempPath,
}

impl ApiSocket {
    /// Binds `path` with permissions 0600. A stale socket left by a killed
    /// ember is replaced; a live one is refused. Call before any thread that
    /// creates files starts (the umask is process-wide while binding).
    ///
    /// The path appears only once the socket accepts connections, so a
    /// client that waits for it to exist never sees it refuse: binding and
    /// listening are two steps, so the socket is made under a temporary name
    /// beside it and renamed into place. Both names are registered with
    /// [`crate::cleanup`] before either exists.
    pub fn bind(path: &Path) -> Result<ApiSocket, ApiError> {
        let io = |source| ApiError::Io {
            path: path.to_owned(),
            source,
        };
        if let Ok(m) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if !m.file_type().is_socket() {
                return Err(ApiError::NotASocket(path.to_owned()));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(ApiError::InUse(path.to_owned()));
            }
            std::fs::remove_file(path).map_err(io)?;
        }
        let binding = path.with_file_name(format!(".ember-api-{}", std::process::id()));
        let _ = std::fs::remove_file(&binding);
        let binding = TempPath::new(binding);
        let socket = TempPath::new(path);
        let bind_private = |p: &Path| {
            // SAFETY: umask only swaps the process's file-creation mask.
            let old = unsafe { libc::umask(0o177) };
            let bound = UnixListener::bind(p);
            // SAFETY: as above, restoring the caller's mask.
            unsafe { libc::umask(old) };
            bound
        };
        let bound = match bind_private(binding.path()) {
            Ok(listener) => std::fs::rename(binding.path(), path).map(|()| listener),
            // The temporary name does not fit a socket address (108 bytes)
            // where `path` does: bound directly, it may refuse for an instant.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => bind_private(path),
            Err(e) => Err(e),
        };
        // Dropped, `binding` goes if it is still there.
        drop(binding);
        match bound {
            Ok(listener) => Ok(ApiSocket {
                listener,
                path: socket,
            }),
            Err(e) => {
                // Not ours: nothing was bound at `path`.
                socket.keep();
                Err(io(e))
            }
        }
    }

    /// Removes the socket's path now (before an `_exit`, which runs no drops).
    pub fn remove(&self) {
        let _ = std::fs::remove_file(self.path.path());
    }

    /// Serves requests on a thread of its own until the process ends.
    pub fn serve(&self, ctx: ApiContext) -> Result<(), ApiError> {
        let listener = self.listener.try_clone().map_err(|source| ApiError::Io {
            path: self.path.path().to_owned(),
            source,
        })?;
        let ctx = Arc::new(ctx);
        // One request acts on the VM at a time.
        let busy = Arc::new(Mutex::new(()));
        let clients = Arc::new(AtomicUsize::new(0));
        let limit = request_limit();
        let spawned = std::thread::Builder::new()
            .name("ember-api".into())
            .spawn(move || {
                // Its client threads run under this filter too.
                ember_vmm::seccomp::confine_or_exit(ember_vmm::seccomp::Thread::Api);
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { continue };
                    if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                        clients.fetch_sub(1, Ordering::SeqCst);
                        let _ = writeln!(stream, "{}", refused(ApiError::TooManyClients));
                        continue;
                    }
                    let (ctx, busy, clients) = (ctx.clone(), busy.clone(), clients.clone());
                    let spawned = std::thread::Builder::new()
                        .name("ember-api-client".into())
                        .spawn(move || {
                            serve_client(stream, &ctx, &busy, limit);
                            clients.fetch_sub(1, Ordering::SeqCst);
                        });
                    if spawned.is_err() {
                        log::warn!("control socket: cannot start a client thread");
                    }
                }
            });
        spawned.map(|_| ()).map_err(|source| ApiError::Io {
            path: self.path.path().to_owned(),
            source,
        })
    }
}

/// How long a client may take to send a whole request: `EMBER_API_REQUEST_TIMEOUT`
/// seconds, else [`REQUEST_LIMIT`].
pub fn request_limit() -> Duration {
    std::env::var(REQUEST_LIMIT_ENV)
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map_or(REQUEST_LIMIT, Duration::from_secs_f64)
}

fn serve_client(stream: UnixStream, ctx: &ApiContext, busy: &Mutex<()>, limit: Duration) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match read_request(&mut reader, &mut line, Instant::now() + limit) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.len() > MAX_REQUEST {
            let _ = writeln!(out, "{}", refused(ApiError::TooLong));
            return;
        }
        // The reply's first byte goes out now: the client waits for it with
        // a short limit, and for the rest as long as the request takes.
        if out.write_all(b"{").is_err() {
            return;
        }
        let reply = match serde_json::from_slice::<Request>(&line) {
            Ok(req) => {
                let _guard = busy.lock().unwrap_or_else(|p| p.into_inner());
                handle(req, ctx)
            }
            Err(e) => Err(ApiError::Malformed(e)),
        };
        let shut_down = matches!(reply, Ok(Response::ShutDown));
        let encoded = match reply {
            Ok(answer) => encode(&Reply::Answer(answer)),
            Err(e) => refused(e),
        };
        if writeln!(out, "{}", encoded.strip_prefix('{').unwrap_or(&encoded)).is_err() {
            return;
        }
        // A shutdown is carried out once its reply is on its way.
        if shut_down {
            ctx.machine.power_off();
        }
    }
}

/// Reads one request line into `line` (at most [`MAX_REQUEST`] + 1 bytes;
/// its newline, if any, included), giving up at `deadline` however the
/// bytes trickle in. `Ok(0)`: the client has gone.
fn read_request(
    reader: &mut BufReader<UnixStream>,
    line: &mut Vec<u8>,
    deadline: Instant,
) -> std::io::Result<usize> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        reader.get_ref().set_read_timeout(Some(left))?;
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // The read timeout fired: the deadline has passed.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(line.len());
        }
        let room = buf.len().min(MAX_REQUEST + 1 - line.len());
        let (n, end) = match buf[..room].iter().position(|&b| b == b'\n') {
            Some(at) => (at + 1, true),
            None => (room, line.len() + room > MAX_REQUEST),
        };
        line.extend_from_slice(&buf[..n]);
        reader.consume(n);
        if end {
            return Ok(line.len());
        }
    }
}

/// Carries out one request: its answer, or why it was refused.
pub fn handle(req: Request, ctx: &ApiContext) -> Result<Response, ApiError> {
    let machine = &ctx.machine;
    if machine.has_ended() {
        return Err(ApiError::Ended);
    }
    let done =
        |r: Result<(), ember_vmm::vstate::control::ControlError>| Ok(r.map(|()| Response::Done)?);
    match req {
        Request::Status {} => Ok(Response::Status(Status {
            state: match machine.run_state() {
                RunState::Running => VmState::Running,
                RunState::Paused => VmState::Paused,
            },
            vcpus: machine.vcpus(),
            mem_bytes: machine.mem_size(),
            devices: machine.devices().len(),
            balloon: machine.balloon().is_some(),
        })),
        Request::Pause {} => done(machine.pause()),
        Request::Resume {} => done(machine.resume()),
        Request::Shutdown {} => Ok(Response::ShutDown),
        Request::Snapshot { dir } => {
            if !dir.is_absolute() {
                return Err(ApiError::RelativeSnapshotDir);
            }
            let stats = ember_vmm::snapshot::create(&ctx.machine, &dir)?;
            Ok(Response::Snapshot(SnapshotWritten {
                memory_bytes: stats.memory_bytes,
                state_bytes: stats.state_bytes,
                in_flight: stats.in_flight,
                ms: stats.ms,
            }))
        }
        Request::Balloon { target_mib } => {
            let b = machine.balloon().ok_or(ApiError::NoBalloon)?;
            // Saturated, a target beyond u64 is still larger than any guest.
            let pages = target_pages(target_mib.saturating_mul(MIB), machine.mem_size())?;
            b.set_target_pages(pages);
            Ok(Response::Done)
        }
        Request::Mem { size_mib } => {
            let m = machine.hotplug().ok_or(ApiError::NoHotplug)?;
            let boot = machine.mem_size();
            if let Some(mib) = size_mib {
                let bytes = mib.saturating_mul(MIB);
                let region = bytes
                    .checked_sub(boot)
                    .filter(|&r| r <= m.region_size())
                    .ok_or(ApiError::MemSize(
                        mib,
                        boot / MIB,
                        (boot + m.region_size()) / MIB,
                    ))?;
                m.set_requested(region).map_err(|_| {
                    ApiError::MemSize(mib, boot / MIB, (boot + m.region_size()) / MIB)
                })?;
            }
            Ok(Response::Mem(MemReport {
                boot_bytes: boot,
                region_bytes: m.region_size(),
                user_requested_bytes: m.user_requested_bytes(),
                requested_bytes: m.requested_bytes(),
                plugged_bytes: m.plugged_bytes(),
                discarded_bytes: m.discarded_bytes(),
            }))
        }
        Request::BalloonStats {} => {
            let b = machine.balloon().ok_or(ApiError::NoBalloon)?;
            b.request_stats();
            Ok(Response::Balloon(BalloonReport {
                target_pages: b.target_pages(),
                actual_pages: b.actual_pages(),
                discarded_pages: b.discarded_pages(),
                // ember's own count of what the balloon holds (the driver's is `actual`).
                held_pages: b.held_bytes() / BALLOON_PAGE,
                // Tag number -> value, as the guest reported them.
                stats: b.stats().map(|s| {
                    s.entries
                        .iter()
                        .map(|(tag, v)| (tag.to_string(), *v))
                        .collect()
                }),
            }))
        }
    }
}

/// The reply line refusing a request for `why`, with its causes.
fn refused(why: ApiError) -> String {
    encode(&Reply::Refused(ember_vmm::error_chain(&why)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(name: &str) -> ember_testing::TempDir {
        ember_testing::TempDir::new(&format!("api-{name}"))
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Once bound, the path is there, private, accepting, and alone (the
    /// temporary name is gone); a second bind is refused while it lives, and
    /// dropping it removes the path.
    #[test]
    fn the_socket_appears_accepting_private_and_alone() {
        let dir = scratch("bind");
        let path = dir.join("api.sock");
        let s = ApiSocket::bind(&path).unwrap();
        assert_eq!(entries(&dir), ["api.sock"]);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        UnixStream::connect(&path).expect("accepting as soon as it exists");
        assert!(matches!(ApiSocket::bind(&path), Err(ApiError::InUse(_))));
        drop(s);
        assert!(entries(&dir).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A path that fits a socket address where the temporary name beside it
    /// would not is still bound (directly).
    #[test]
    fn a_path_too_long_for_the_temporary_name_is_bound_directly() {
        let base = scratch("long");
        let mut dir = base.to_path_buf();
        // 107 bytes is the longest path a socket address holds.
        while dir.as_os_str().len() + "/a".len() < 100 {
            dir.push("d");
        }
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a");
        assert!(path.as_os_str().len() <= 107);
        let s = ApiSocket::bind(&path).unwrap();
        UnixStream::connect(&path).unwrap();
        assert_eq!(entries(&dir), ["a"]);
        drop(s);
    }

    /// The request limit counts from the start: a client that trickles a
    /// byte at a time is dropped at the deadline, however lively it is.
    #[test]
    fn a_trickling_request_is_dropped_at_its_deadline() {
        let (server, mut client) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            for _ in 0..40 {
                if client.write_all(b" ").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let mut reader = BufReader::new(server);
        let mut line = Vec::new();
        let start = Instant::now();
        let r = read_request(&mut reader, &mut line, start + Duration::from_millis(200));
        let took = start.elapsed();
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        assert!(took < Duration::from_millis(600), "{took:?}");
        assert!(!line.is_empty(), "bytes did arrive");
        drop(reader);
        writer.join().unwrap();

        // A whole line in time is read up to its newline.
        let (server, mut client) = UnixStream::pair().unwrap();
        client.write_all(b"{\"op\":\"status\"}\nrest").unwrap();
        let mut reader = BufReader::new(server);
        let mut line = Vec::new();
        let n = read_request(
            &mut reader,
            &mut line,
            Instant::now() + Duration::from_secs(5),
        );
        assert_eq!(n.unwrap(), 16);
        assert_eq!(line, b"{\"op\":\"status\"}\n");
    }
}
