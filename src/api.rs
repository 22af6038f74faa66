//! The control socket: `ember boot … --api-socket PATH` serves requests on a
//! unix socket, one JSON object per line, one reply line each:
//!
//! ```text
//! {"op":"status"}                      {"ok":true,"state":"running","vcpus":1,"mem_bytes":...}
//! {"op":"pause"}                       {"ok":true}
//! {"op":"resume"}                      {"ok":true}
//! {"op":"snapshot","dir":"/abs/path"}  {"ok":true,"memory_bytes":...,"state_bytes":...,"ms":...}
//! {"op":"shutdown"}                    {"ok":true}
//! {"op":"balloon","target_mib":64}     {"ok":true}
//! {"op":"balloon_stats"}               {"ok":true,"target_pages":...,"actual_pages":...,"stats":{...}}
//! anything else                        {"ok":false,"error":"…"}
//! ```
//!
//! A request that is malformed or out of order (resume while running, a
//! snapshot of a running VM) gets an error reply and changes nothing. The
//! socket is made with the user's permissions only (0600) and removed when
//! ember exits, however it exits: normally, on an error, or on SIGTERM,
//! SIGINT, SIGHUP or SIGQUIT ([`crate::cleanup`]).
//!
//! `ember ctl` and `ember snapshot` are the client side.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use thiserror::Error;

use crate::cleanup::TempPath;
use ember_vmm::devices::virtio::{BalloonHandle, target_pages};
use ember_vmm::snapshot::Machine;
use ember_vmm::vstate::end::GuestEnd;

/// A request line may not be longer than this.
const MAX_REQUEST: usize = 64 * 1024;
/// At most this many clients at once; more are refused.
const MAX_CLIENTS: usize = 8;
/// A client that sends nothing for this long is dropped.
const CLIENT_IDLE: Duration = Duration::from_secs(60);
/// Bytes per MiB, for the balloon's target.
const MIB: u64 = 1 << 20;
/// The balloon counts 4 KiB pages.
const BALLOON_PAGE: u64 = 4096;

/// Control-socket errors.
#[derive(Debug, Error)]
pub enum ApiError {
    /// Something already listens on the path.
    #[error("{0} is in use by a running VM")]
    InUse(PathBuf),
    /// The path exists and is not a socket.
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    /// Binding or connecting failed.
    #[error("{path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The server's reply did not parse.
    #[error("bad reply from {0}")]
    BadReply(PathBuf),
}

/// A request. Every variant has braces, even without fields: serde
/// refuses unknown fields only in struct variants.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Running or paused, and the VM's shape.
    Status {},
    /// Stop every vCPU.
    Pause {},
    /// Let them run again.
    Resume {},
    /// Write a snapshot of the paused VM to `dir`.
    Snapshot {
        /// An absolute directory path.
        dir: PathBuf,
    },
    /// End the VM (ember exits with status 0).
    Shutdown {},
    /// Set the balloon's target size.
    Balloon {
        /// How much memory the balloon should take from the guest.
        target_mib: u64,
    },
    /// The balloon's target, size and the guest's last statistics.
    BalloonStats {},
}

/// What the server acts on.
pub struct ApiContext {
    /// The VM, its pause control and devices.
    pub machine: Arc<Machine>,
    /// The balloon, if the VM has one.
    pub balloon: Option<BalloonHandle>,
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
        let spawned = std::thread::Builder::new()
            .name("ember-api".into())
            .spawn(move || {
                // Its client threads run under this filter too.
                ember_vmm::seccomp::confine_or_exit(ember_vmm::seccomp::Thread::Api);
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { continue };
                    if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                        clients.fetch_sub(1, Ordering::SeqCst);
                        let _ = writeln!(stream, "{}", error_reply("too many clients"));
                        continue;
                    }
                    let (ctx, busy, clients) = (ctx.clone(), busy.clone(), clients.clone());
                    let spawned = std::thread::Builder::new()
                        .name("ember-api-client".into())
                        .spawn(move || {
                            serve_client(stream, &ctx, &busy);
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

fn error_reply(why: impl std::fmt::Display) -> Value {
    json!({"ok": false, "error": why.to_string()})
}

fn serve_client(stream: UnixStream, ctx: &ApiContext, busy: &Mutex<()>) {
    let _ = stream.set_read_timeout(Some(CLIENT_IDLE));
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        // Read at most MAX_REQUEST + 1 bytes of one line.
        match (&mut reader)
            .take(MAX_REQUEST as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.len() > MAX_REQUEST {
            let _ = writeln!(out, "{}", error_reply("request too long"));
            return;
        }
        let reply = match serde_json::from_slice::<Request>(&line) {
            Ok(req) => {
                let _guard = busy.lock().unwrap_or_else(|p| p.into_inner());
                handle(req, ctx)
            }
            Err(e) => error_reply(format!("malformed request: {e}")),
        };
        if writeln!(out, "{reply}").is_err() {
            return;
        }
        // A shutdown is carried out once its reply is on its way.
        if reply.get("shutdown").is_some() {
            ctx.machine.end.report(GuestEnd::PowerOff);
        }
    }
}

/// Carries out one request; the reply says how it went.
pub fn handle(req: Request, ctx: &ApiContext) -> Value {
    let control = &ctx.machine.control;
    if ctx.machine.end.is_over() {
        return error_reply("the VM has ended");
    }
    let done = |r: Result<(), ember_vmm::vstate::control::ControlError>| match r {
        Ok(()) => json!({"ok": true}),
        Err(e) => error_reply(ember_vmm::error_chain(&e)),
    };
    match req {
        Request::Status {} => json!({
            "ok": true,
            "state": control.state(),
            "vcpus": ctx.machine.vcpus,
            "mem_bytes": ctx.machine.mem_size,
            "devices": ctx.machine.devices.len(),
            "balloon": ctx.balloon.is_some(),
        }),
        Request::Pause {} => done(control.pause(&ctx.machine.end)),
        Request::Resume {} => done(control.resume()),
        Request::Shutdown {} => json!({"ok": true, "shutdown": true}),
        Request::Snapshot { dir } => {
            if !dir.is_absolute() {
                return error_reply("the snapshot directory must be an absolute path");
            }
            match ember_vmm::snapshot::create(&ctx.machine, &dir) {
                Ok(stats) => json!({
                    "ok": true,
                    "memory_bytes": stats.memory_bytes,
                    "state_bytes": stats.state_bytes,
                    "in_flight": stats.in_flight,
                    "ms": stats.ms,
                }),
                Err(e) => error_reply(ember_vmm::error_chain(&e)),
            }
        }
        Request::Balloon { target_mib } => {
            let Some(b) = &ctx.balloon else {
                return error_reply("the VM has no balloon (--balloon)");
            };
            // Saturated, a target beyond u64 is still larger than any guest.
            match target_pages(target_mib.saturating_mul(MIB), ctx.machine.mem_size) {
                Ok(p) => {
                    b.set_target_pages(p);
                    json!({"ok": true})
                }
                Err(e) => error_reply(e.to_string()),
            }
        }
        Request::BalloonStats {} => {
            let Some(b) = &ctx.balloon else {
                return error_reply("the VM has no balloon (--balloon)");
            };
            b.request_stats();
            // Tag number -> value, as the guest reported them.
            let stats: Option<serde_json::Map<String, Value>> = b.stats().map(|s| {
                s.entries
                    .iter()
                    .map(|(tag, v)| (tag.to_string(), json!(v)))
                    .collect()
            });
            json!({
                "ok": true,
                "target_pages": b.target_pages(),
                "actual_pages": b.actual_pages(),
                "discarded_pages": b.discarded_pages(),
                // ember's own count of what the balloon holds (the driver's is `actual`).
                "held_pages": b.held_bytes() / BALLOON_PAGE,
                "stats": stats,
            })
        }
    }
}

/// Sends one request line to the socket at `path`; returns the reply.
pub fn call(path: &Path, request: &Value) -> Result<Value, ApiError> {
    let io = |source| ApiError::Io {
        path: path.to_owned(),
        source,
    };
    let mut stream = UnixStream::connect(path).map_err(io)?;
    writeln!(stream, "{request}").map_err(io)?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(io)?;
    serde_json::from_str(&line).map_err(|_| ApiError::BadReply(path.to_owned()))
}

/// Arguments of `ember ctl`.
#[derive(Debug, clap::Args)]
pub struct CtlArgs {
    /// The VM's control socket (`ember boot … --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// What to ask.
    #[arg(value_enum)]
    pub op: CtlOp,
    /// For `balloon`: the balloon's target size in MiB.
    #[arg(long, required_if_eq("op", "balloon"))]
    pub target_mib: Option<u64>,
}

/// `ember ctl` requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CtlOp {
    /// Running or paused, and the VM's shape.
    Status,
    /// Stop the vCPUs.
    Pause,
    /// Let them run again.
    Resume,
    /// End the VM.
    Shutdown,
    /// Set the balloon's target (--target-mib).
    Balloon,
    /// The balloon's size and the guest's memory statistics.
    BalloonStats,
}

/// `ember ctl`: one request, its reply printed as JSON; exit status 1 when
/// the VM refused it.
pub fn ctl(args: CtlArgs) -> anyhow::Result<i32> {
    let request = match args.op {
        CtlOp::Status => json!({"op": "status"}),
        CtlOp::Pause => json!({"op": "pause"}),
        CtlOp::Resume => json!({"op": "resume"}),
        CtlOp::Shutdown => json!({"op": "shutdown"}),
        CtlOp::Balloon => json!({"op": "balloon", "target_mib": args.target_mib.unwrap_or(0)}),
        CtlOp::BalloonStats => json!({"op": "balloon_stats"}),
    };
    let reply = call(&args.api_socket, &request)?;
    println!("{reply}");
    Ok(if reply["ok"] == true { 0 } else { 1 })
}

/// Arguments of `ember snapshot`.
#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// The VM's control socket (`ember boot … --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// Write the snapshot into this directory (created if needed).
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    /// Let the VM run on afterwards (by default it ends once saved).
    #[arg(long)]
    pub resume: bool,
}

/// `ember snapshot`: pauses the VM (if it runs), writes the snapshot, then
/// ends the VM or, with `--resume`, lets it run on. If the snapshot fails,
/// a VM this command paused runs on as before.
pub fn snapshot(args: SnapshotArgs) -> anyhow::Result<i32> {
    let sock = &args.api_socket;
    let dir = std::path::absolute(&args.to)?;
    let ok = |r: &Value| r["ok"] == true;
    let status = call(sock, &json!({"op": "status"}))?;
    if !ok(&status) {
        anyhow::bail!("{}", status["error"].as_str().unwrap_or("status failed"));
    }
    let paused_here = status["state"] == "running";
    if paused_here {
        let r = call(sock, &json!({"op": "pause"}))?;
        if !ok(&r) {
            anyhow::bail!("cannot pause: {}", r["error"].as_str().unwrap_or("?"));
        }
    }
    let r = call(sock, &json!({"op": "snapshot", "dir": dir}))?;
    if !ok(&r) {
        if paused_here {
            let _ = call(sock, &json!({"op": "resume"}));
        }
        anyhow::bail!("{}", r["error"].as_str().unwrap_or("snapshot failed"));
    }
    let after = if args.resume {
        if paused_here {
            json!({"op": "resume"})
        } else {
            Value::Null
        }
    } else {
        json!({"op": "shutdown"})
    };
    if !after.is_null() {
        let a = call(sock, &after)?;
        if !ok(&a) {
            anyhow::bail!(
                "snapshot written, but: {}",
                a["error"].as_str().unwrap_or("?")
            );
        }
    }
    println!("{r}");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ember-api-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
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
        let mut dir = scratch("long");
        let base = dir.clone();
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
        std::fs::remove_dir_all(&base).unwrap();
    }
}
