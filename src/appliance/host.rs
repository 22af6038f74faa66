//! The host side of an appliance run: listen on the channel socket, start the
//! VMM, hand the command to the guest init, relay stdin/stdout/stderr frames,
//! and make sure the VMM is gone on every path out (a drop guard kills it,
//! and `PR_SET_PDEATHSIG` kills it even if ember itself is killed).

use super::protocol::{self, Decoder, Kind};
use crate::backend::{
    self, Backend, BackendError, ChannelKind, GuestSpec, ShareSupport, virtiofsd,
};
use crate::cleanup::{self, TempPath};
use ember_vmm::devices::virtio::VsockConfig;
use ember_vmm::error_chain;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

/// How much of the VMM's console and stderr is kept for error messages.
const CONSOLE_TAIL: usize = 8 * 1024;
/// How often to look at the VMM while waiting for it to connect.
const ACCEPT_POLL: Duration = Duration::from_millis(1);
/// Stdin is forwarded in chunks of this size.
const STDIN_CHUNK: usize = 32 * 1024;

/// Host-side errors.
#[derive(Debug, Error)]
pub enum HostError {
    /// The backend cannot build its command.
    #[error("cannot start the VMM")]
    Backend(#[source] BackendError),
    /// Socket or process plumbing failed.
    #[error("{0}")]
    Io(String, #[source] io::Error),
    /// The guest sent bytes that are not frames.
    #[error("the guest broke the channel protocol")]
    Protocol(#[source] protocol::ProtocolError),
    /// A share's daemon cannot be found or started.
    #[error(transparent)]
    Virtiofsd(#[from] virtiofsd::VirtiofsdError),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Job {
    /// argv, argv[0] first.
    pub argv: Vec<String>,
    /// The path init executes.
    pub exec: String,
    /// The environment, `NAME=value`.
    pub env: Vec<String>,
    /// The working directory, if not `/`.
    pub cwd: Option<String>,
    /// Forward our stdin (else the command's stdin is empty).
    pub forward_stdin: bool,
    /// Give up after this long.
    pub timeout: Option<Duration>,
    /// Copy the guest console to our stderr.
    pub verbose: bool,
    /// The block device holding the command's root (`ROOT`), if not the
    /// initramfs.
    pub root: Option<String>,
    /// The `NET` frame's payload (see [`ember_frames::netconf`]), if the guest has
    /// a network to configure.
    pub net: Option<Vec<u8>>,
    /// The virtio-fs tag of the host's root (`HOSTROOT`): the command runs
    /// on it, overlaid in guest memory.
    pub host_root: Option<String>,
    /// More shares for that root (`SHARE`).
    pub shares: Vec<GuestShare>,
    /// The guest is a restored appliance: it sent READY before its snapshot,
    /// so the job goes out as soon as the channel connects.
    pub restored: bool,
    /// Snapshot the appliance here (through this control socket) when it is
    /// READY, before the job goes out.
    pub snapshot_at_ready: Option<SnapshotAt>,
    /// Descriptors the VMM opens as `/proc/self/fd/N` (the spec names them
    /// so): files with no name, or held so the cache keeps them.
    pub inherit_fds: Vec<std::os::fd::RawFd>,
}

/// A share as the guest mounts it (a `SHARE` frame).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestShare {
    /// Its virtio-fs tag.
    pub tag: String,
    /// Where it is mounted in the command's root.
    pub path: String,
    /// The guest may write to it.
    pub writable: bool,
}

/// Where [`Job::snapshot_at_ready`] writes.
#[derive(Debug, Clone)]
pub struct SnapshotAt {
    /// The VMM's control socket.
    pub api: PathBuf,
    /// The snapshot directory (see [`super::warm::save`]).
    pub dir: PathBuf,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The command exited with this code.
    Exited(i32),
    /// The guest init reported a failure.
    GuestError(String),
    /// The VMM went away without a report; the console/stderr tail.
    NoReport(String),
    /// The VMM failed before the guest ever connected (a bad option, a file
    /// it cannot open): its status and the tail of its output.
    VmmFailed {
        /// The VMM's exit status.
        status: std::process::ExitStatus,
        /// The console/stderr tail.
        tail: String,
    },
    /// The timeout expired.
    TimedOut,
    /// Our own stdout or stderr refused the command's output: the run was
    /// stopped there rather than go on losing it.
    OutputFailed {
        /// `stdout` or `stderr`.
        stream: &'static str,
        /// The reader went away (EPIPE): a pipeline's `head` has what it
        /// wanted, so this is not an error to report.
        broken_pipe: bool,
        /// The write error.
        reason: String,
    },
}

/// How long a VMM that writes an events file may take to end by itself once
/// the command has exited (the guest powers off right after its EXIT frame;
/// a killed VMM writes no timeline). Other runs kill it at once.
const EVENTS_GRACE: Duration = Duration::from_secs(5);

/// Kills and reaps the VMM and removes the socket, whatever happens (a
/// fatal signal too: both are registered with [`crate::cleanup`]).
struct VmmGuard {
    child: Child,
    /// Kills the VMM on a fatal signal; dropped before it is reaped.
    kill: Option<cleanup::Entry>,
    socket: TempPath,
    /// Wait this long for the VMM to exit by itself before killing it.
    grace: Duration,
}

impl VmmGuard {
    /// Waits for the VMM to end (unregistered first: its pid is free once
    /// reaped).
    fn reap(&mut self) -> Option<std::process::ExitStatus> {
        self.kill = None;
        self.child.wait().ok()
    }
}

impl Drop for VmmGuard {
    fn drop(&mut self) {
        let until = Instant::now() + self.grace;
        while Instant::now() < until && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        self.reap();
    }
}

/// A shared ring of the last bytes a stream produced.
type Tail = Arc<Mutex<Vec<u8>>>;

fn keep_tail(tail: &Tail, bytes: &[u8]) {
    let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
    t.extend_from_slice(bytes);
    if t.len() > CONSOLE_TAIL {
        let cut = t.len() - CONSOLE_TAIL;
        t.drain(..cut);
    }
}

/// Drains a VMM pipe on a thread: always into `tail`, and to our stderr when verbose.
fn drain(mut r: impl Read + Send + 'static, tail: Tail, verbose: bool) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            keep_tail(&tail, &buf[..n]);
            if verbose {
                let _ = io::stderr().write_all(&buf[..n]);
            }
        }
    });
}

/// A unique socket path in the temp directory.
fn socket_path() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "ember-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A unique path in the temp directory for a vsock channel's device socket
/// (its port's socket is this path and `_<port>`).
fn vsock_socket_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "ember-vsock-{}-{}.sock",
        std::process::id(),
        socket_serial()
    ))
}

/// Boots `spec` (its `channel`, or for a vsock channel its vsock device, is filled in here) with `backend` and runs `job`.
pub fn run(
    backend: &dyn Backend,
    mut spec: GuestSpec,
    job: &Job,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, HostError> {
    let start = Instant::now();
    let deadline = job.timeout.map(|t| start + t);
    let (vsock_uds, socket, listener) = listen(backend)?;
    match &vsock_uds {
        Some(uds) => {
            spec.devices.vsock = Some(VsockConfig {
                cid: backend::VSOCK_CHANNEL_CID,
                uds: uds.path().to_owned(),
            });
        }
        None => spec.channel = Some(socket.path().to_owned()),
    }
    // Declared before the VMM's guard, so dropped after it: a daemon
    // outlives the VMM that uses it.
    let daemons = start_daemons(backend, &mut spec)?;
    let (mut guard, tail) = spawn_vmm(backend, &spec, job, socket)?;
    let stream = match accept(&listener, &mut guard, deadline)? {
        Some(s) => {
            // The path was only the rendezvous: once connected, it goes
            // (a vsock channel's stays: the command's stdio connections
            // come to it too). So do the daemons': the VMM connects to
            // them before it connects the channel (see the qemu backend).
            if vsock_uds.is_none() {
                let _ = std::fs::remove_file(guard.socket.path());
            }
            daemons.iter().for_each(virtiofsd::Daemon::forget_socket);
            s
        }
        None if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(Outcome::TimedOut),
        None => return Ok(no_report(&mut guard, &tail, false)),
    };
    let conversed = match &vsock_uds {
        Some(_) => converse_vsock(stream, &listener, job, deadline, out, err)?,
        None => converse(stream, job, deadline, out, err)?,
    };
    match conversed {
        Some(outcome) => {
            // The guest is powering off: let ember finish its timeline.
            if spec.events.is_some() && matches!(outcome, Outcome::Exited(_)) {
                guard.grace = EVENTS_GRACE;
            }
            Ok(outcome)
        }
        None => Ok(no_report(&mut guard, &tail, true)),
    }
}

/// The socket the VMM connects the channel to, listened on: for a vsock
/// channel also the vsock device's own socket, which the VMM serves.
fn listen(backend: &dyn Backend) -> Result<(Option<TempPath>, TempPath, UnixListener), HostError> {
    // A vsock channel: the VMM's device serves `uds` (removed with the
    // run, as the VMM may be killed before it can), and hands the guest's
    // connection to the host's port to `uds_<port>`, where this run
    // listens; otherwise the VMM connects its channel device here.
    let vsock_uds = (backend.channel_kind() == ChannelKind::Vsock).then(|| {
        let uds = vsock_socket_path();
        let _ = std::fs::remove_file(&uds);
        TempPath::new(uds)
    });
    let path = match &vsock_uds {
        Some(uds) => {
            let mut p = uds.path().as_os_str().to_owned();
            p.push(format!("_{}", backend::VSOCK_CHANNEL_PORT));
            PathBuf::from(p)
        }
        None => socket_path(),
    };
    let _ = std::fs::remove_file(&path);
    // Registered before it exists: a signal while the guest boots removes it.
    let socket = TempPath::new(path);
    let listener = UnixListener::bind(socket.path())
        .map_err(|e| HostError::Io(format!("cannot listen on {}", socket.path().display()), e))?;
    Ok((vsock_uds, socket, listener))
}

/// Starts the VMM for `spec`, guarded, with its stdout and stderr drained
/// into the returned tail.
fn spawn_vmm(
    backend: &dyn Backend,
    spec: &GuestSpec,
    job: &Job,
    socket: TempPath,
) -> Result<(VmmGuard, Tail), HostError> {
    let mut cmd = backend.command(spec).map_err(HostError::Backend)?;
    ember_vmm::events::stage("run_spawn_vmm");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cleanup::dies_with_ember(&mut cmd);
    cleanup::inherit(&mut cmd, job.inherit_fds.clone());
    let child = cmd.spawn().map_err(|e| {
        HostError::Io(
            format!("cannot run {}", cmd.get_program().to_string_lossy()),
            e,
        )
    })?;
    // PR_SET_PDEATHSIG covers SIGKILL; this kills it before the socket goes.
    let kill = libc::pid_t::try_from(child.id())
        .ok()
        .and_then(|pid| cleanup::register(cleanup::Undo::Kill(pid)).ok());
    let mut guard = VmmGuard {
        child,
        kill,
        socket,
        grace: Duration::ZERO,
    };
    let tail: Tail = Arc::default();
    if let Some(o) = guard.child.stdout.take() {
        drain(o, tail.clone(), job.verbose);
    }
    if let Some(e) = guard.child.stderr.take() {
        drain(e, tail.clone(), true);
    }
    Ok((guard, tail))
}

/// How a run that got no report ended: the VMM reaped, with the tail of
/// its output.
fn no_report(guard: &mut VmmGuard, tail: &Tail, connected: bool) -> Outcome {
    // Give the drain threads a moment to collect the VMM's last words.
    let status = guard.reap();
    std::thread::sleep(Duration::from_millis(20));
    let t = tail.lock().unwrap_or_else(|e| e.into_inner());
    let tail = String::from_utf8_lossy(&t).into_owned();
    match status {
        // The guest's init connects first thing: a VMM that failed
        // before that never ran it.
        Some(status) if !connected && !status.success() => Outcome::VmmFailed { status, tail },
        _ => Outcome::NoReport(tail),
    }
}

/// Starts a `virtiofsd` for each share of `spec` that has no socket yet,
/// where `backend` needs one, and names its socket in the share.
fn start_daemons(
    backend: &dyn Backend,
    spec: &mut GuestSpec,
) -> Result<Vec<virtiofsd::Daemon>, HostError> {
    if spec.shares.is_empty() || backend.share_support() != ShareSupport::Virtiofsd {
        return Ok(Vec::new());
    }
    let daemon = virtiofsd::Virtiofsd::find()?;
    let mut daemons = Vec::new();
    for (i, share) in spec.shares.iter_mut().enumerate() {
        if share.socket.is_some() {
            continue;
        }
        let path = std::env::temp_dir().join(format!(
            "ember-{}-fs{i}-{}.sock",
            std::process::id(),
            socket_serial()
        ));
        let d = virtiofsd::start(&daemon, share, path)?;
        share.socket = Some(d.socket().to_owned());
        daemons.push(d);
    }
    Ok(daemons)
}

/// A number no other socket of this process had.
fn socket_serial() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Waits for the VMM to connect; `None` if it exited or time ran out.
fn accept(
    listener: &UnixListener,
    guard: &mut VmmGuard,
    deadline: Option<Instant>,
) -> Result<Option<UnixStream>, HostError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| HostError::Io("socket".into(), e))?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)
                    .map_err(|e| HostError::Io("socket".into(), e))?;
                return Ok(Some(s));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(HostError::Io("accept on the channel socket".into(), e)),
        }
        if matches!(guard.child.try_wait(), Ok(Some(_))) {
            return Ok(None);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        std::thread::sleep(ACCEPT_POLL);
    }
}

/// What is left of the run's time: `None` without a timeout, zero once it
/// has run out.
fn time_left(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// Copies the command's output to `w`, ours; the run's end when it cannot:
/// output that cannot be delivered stops the run (the caller's guard ends
/// the VM, and the command with it), as carrying on would lose it and
/// still report success. The channel is read no faster than this writes,
/// so a slow reader holds the guest back instead.
fn deliver(w: &mut dyn Write, stream: &'static str, bytes: &[u8]) -> Option<Outcome> {
    let e = w.write_all(bytes).and_then(|_| w.flush()).err()?;
    Some(Outcome::OutputFailed {
        stream,
        broken_pipe: e.kind() == io::ErrorKind::BrokenPipe,
        reason: e.to_string(),
    })
}

/// The command's status in a frame: its EXIT, or the appliance's ERROR.
fn status(frame: &protocol::Frame) -> Option<Outcome> {
    match frame.kind {
        Kind::Exit => Some(Outcome::Exited(
            protocol::exit_code(&frame.payload).unwrap_or(-1),
        )),
        Kind::Error => Some(Outcome::GuestError(
            String::from_utf8_lossy(&frame.payload).into_owned(),
        )),
        _ => None,
    }
}

/// How the job goes out on the channel (with its stdin as frames or not).
type SendJob = fn(&UnixStream, &Job, &Arc<ToGuest>) -> io::Result<()>;

/// The channel's frames, as both conversations read them: the job goes out
/// on the guest's first READY (at once for a restored guest), the rest is
/// the caller's.
struct Channel<'j> {
    stream: UnixStream,
    job: &'j Job,
    dec: Decoder,
    /// The job (and the stdin thread it starts) goes out on the first READY only: a guest
    /// repeating READY must not start a host thread per frame.
    job_sent: bool,
    to_guest: Arc<ToGuest>,
    send: SendJob,
}

impl<'j> Channel<'j> {
    fn open(stream: UnixStream, job: &'j Job, send: SendJob) -> Result<Self, HostError> {
        let mut ch = Channel {
            stream,
            job,
            dec: Decoder::new(),
            job_sent: false,
            to_guest: Arc::new(ToGuest::default()),
            send,
        };
        if job.restored {
            ch.send_job()?;
        }
        Ok(ch)
    }

    fn send_job(&mut self) -> Result<(), HostError> {
        self.job_sent = true;
        (self.send)(&self.stream, self.job, &self.to_guest)
            .map_err(|e| HostError::Io("writing the channel".into(), e))
    }

    /// Reads what the guest sent into the decoder; `false` once the
    /// channel has closed.
    fn fill(&mut self, buf: &mut [u8]) -> Result<bool, HostError> {
        let n = match self.stream.read(buf) {
            Ok(0) => return Ok(false),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                return Ok(true);
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(false),
            Err(e) => return Err(HostError::Io("reading the channel".into(), e)),
        };
        self.dec.feed(&buf[..n]);
        Ok(true)
    }

    /// The next frame read, READY aside: that one this answers with the
    /// job.
    fn next(&mut self) -> Result<Option<protocol::Frame>, HostError> {
        while let Some(frame) = self.dec.next_frame().map_err(HostError::Protocol)? {
            match frame.kind {
                Kind::Ready if self.job_sent => {
                    ember_vmm::guest_warn!("appliance: the guest sent READY again; ignored");
                }
                Kind::Ready => {
                    snapshot_at_ready(self.job);
                    self.send_job()?;
                }
                _ => return Ok(Some(frame)),
            }
        }
        Ok(None)
    }

    /// Ends the conversation with `outcome`, letting the guest power off.
    fn end(&self, outcome: Outcome) -> Option<Outcome> {
        release(&self.stream, &self.to_guest);
        Some(outcome)
    }
}

/// Runs the protocol; `None` if the channel closed without a report.
fn converse(
    stream: UnixStream,
    job: &Job,
    deadline: Option<Instant>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Option<Outcome>, HostError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut ch = Channel::open(stream, job, send_job)?;
    loop {
        if let Some(left) = time_left(deadline) {
            if left.is_zero() {
                return Ok(Some(Outcome::TimedOut));
            }
            ch.stream
                .set_read_timeout(Some(left))
                .map_err(|e| HostError::Io("socket".into(), e))?;
        }
        if !ch.fill(&mut buf)? {
            return Ok(None);
        }
        while let Some(frame) = ch.next()? {
            let failed = match frame.kind {
                Kind::Stdout => deliver(out, "stdout", &frame.payload),
                Kind::Stderr => deliver(err, "stderr", &frame.payload),
                // Host-bound kinds are never sent by the guest; ignore them.
                _ => match status(&frame) {
                    Some(outcome) => return Ok(ch.end(outcome)),
                    None => None,
                },
            };
            if failed.is_some() {
                return Ok(failed);
            }
        }
    }
}

/// The command's stdin, stdout and stderr connections on a vsock channel.
struct VsockStdio {
    /// Accepted in the guest's order: stdin, stdout, stderr.
    conns: Vec<UnixStream>,
    /// stdout and stderr not at their end yet.
    open: [bool; 2],
}

impl VsockStdio {
    /// All three came, and both outputs ended.
    fn ended(&self) -> bool {
        self.conns.len() == 3 && self.open == [false, false]
    }

    /// What to poll: the channel, the listener until all three came, and
    /// the outputs not at their end.
    fn poll_set(&self, control: i32, listener: i32) -> Vec<libc::pollfd> {
        let fd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = vec![fd(control)];
        if self.conns.len() < 3 {
            fds.push(fd(listener));
        }
        for (i, s) in self.conns.iter().enumerate().skip(1) {
            if self.open[i - 1] {
                fds.push(fd(s.as_raw_fd()));
            }
        }
        fds
    }

    /// Copies what the ready outputs have to `out` and `err`; the run's end
    /// when one cannot take it.
    fn copy_out(
        &mut self,
        ready: impl Fn(i32) -> bool,
        buf: &mut [u8],
        out: &mut dyn Write,
        err: &mut dyn Write,
    ) -> Option<Outcome> {
        for i in [1, 2] {
            let Some(s) = self.conns.get(i) else { continue };
            if !self.open[i - 1] || !ready(s.as_raw_fd()) {
                continue;
            }
            let got = match (&*s).read(buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // A guest that goes away mid-output ends that output.
                Err(_) => 0,
            };
            if got == 0 {
                self.open[i - 1] = false;
                continue;
            }
            // As in `converse`, and a slow reader holds the guest back
            // through vsock's credit.
            let failed = match i {
                1 => deliver(out, "stdout", &buf[..got]),
                _ => deliver(err, "stderr", &buf[..got]),
            };
            if failed.is_some() {
                return failed;
            }
        }
        None
    }

    /// Takes the next connection the guest made; the first, stdin, gets
    /// our stdin.
    fn accept(&mut self, listener: &UnixListener, job: &Job) -> Result<(), HostError> {
        let sock = |e| HostError::Io("socket".into(), e);
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(sock)?;
                if self.conns.is_empty() {
                    forward_stdin_raw(&s, job).map_err(sock)?;
                }
                self.conns.push(s);
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(HostError::Io("accept on the channel socket".into(), e)),
        }
    }
}

/// [`converse`] on a vsock channel: the frames carry the job and the
/// command's status, while the command's stdin, stdout and stderr are
/// vsock connections of their own, which the guest makes before it starts
/// the command, in that order, and the VMM hands to `listener` as it made
/// the channel's. Output is read as it comes, no faster than `out` and
/// `err` take it; the status is taken once both outputs ended. `None` if
/// the channel closed without a report.
fn converse_vsock(
    control: UnixStream,
    listener: &UnixListener,
    job: &Job,
    deadline: Option<Instant>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Option<Outcome>, HostError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut ch = Channel::open(control, job, |s, job, _| send_frames(s, job))?;
    let mut stdio = VsockStdio {
        conns: Vec::new(),
        open: [true, true],
    };
    let mut status_frame: Option<Outcome> = None;
    loop {
        if let Some(outcome) = &status_frame
            && stdio.ended()
        {
            return Ok(ch.end(outcome.clone()));
        }
        let wait_ms = match time_left(deadline) {
            Some(left) if left.is_zero() => return Ok(Some(Outcome::TimedOut)),
            Some(left) => i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX),
            None => -1,
        };
        let control_fd = ch.stream.as_raw_fd();
        let mut fds = stdio.poll_set(control_fd, listener.as_raw_fd());
        let nfds = libc::nfds_t::try_from(fds.len()).unwrap_or(0);
        // SAFETY: `fds` is a live array of `nfds` pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), nfds, wait_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(HostError::Io("poll on the channel".into(), e));
        }
        let ready = |fd: i32| fds.iter().any(|p| p.fd == fd && p.revents != 0);
        // The command's output first: its status waits for its end anyway.
        if let Some(failed) = stdio.copy_out(ready, &mut buf, out, err) {
            return Ok(Some(failed));
        }
        if stdio.conns.len() < 3 && ready(listener.as_raw_fd()) {
            stdio.accept(listener, job)?;
        }
        if !ready(control_fd) {
            continue;
        }
        if !ch.fill(&mut buf)? {
            return Ok(None);
        }
        // Output comes on its own connections; nothing else is sent by the
        // guest.
        while let Some(frame) = ch.next()? {
            match status(&frame) {
                Some(Outcome::GuestError(msg)) => return Ok(ch.end(Outcome::GuestError(msg))),
                Some(exited) if status_frame.is_none() => status_frame = Some(exited),
                _ => {}
            }
        }
    }
}

/// Copies our stdin to the command's stdin connection `s` on a thread, and
/// ends it (a half-close: the guest reads its end) at our stdin's end, or
/// at once when the job forwards none.
fn forward_stdin_raw(s: &UnixStream, job: &Job) -> io::Result<()> {
    let mut w = s.try_clone()?;
    if !job.forward_stdin {
        return w.shutdown(std::net::Shutdown::Write);
    }
    std::thread::spawn(move || {
        let mut stdin = io::stdin().lock();
        let mut buf = vec![0u8; STDIN_CHUNK];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if w.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = w.shutdown(std::net::Shutdown::Write);
    });
    Ok(())
}

/// Takes the appliance's snapshot at READY when the job asks for one (a
/// failed snapshot costs only the next run's speed).
fn snapshot_at_ready(job: &Job) {
    if let Some(at) = &job.snapshot_at_ready {
        match super::warm::save(&at.api, &at.dir) {
            Ok(()) if job.verbose => eprintln!("ember: appliance snapshot {}", at.dir.display()),
            Ok(()) => {}
            Err(e) => eprintln!("ember: warning: {}", error_chain(&e)),
        }
    }
}

/// One run's writers to the guest: the stdin thread and [`release`] write the
/// same stream.
#[derive(Debug, Default)]
struct ToGuest {
    /// Held while a frame is written: a frame must not be cut in two.
    frames: Mutex<()>,
    /// Set once the guest's last frame is in: the stdin thread sends no more.
    done: std::sync::atomic::AtomicBool,
}

/// Tells the guest it may power off: its last frame, and so everything it
/// sent before, is here (protocol step 5). Best effort, and bounded: a
/// guest that does not hear it is killed with its VMM anyway (only a VMM
/// given time to write its timeline waits for the guest to power off).
fn release(stream: &UnixStream, to_guest: &ToGuest) {
    let mut frame = Vec::new();
    protocol::encode(&mut frame, Kind::Done, &[]);
    to_guest
        .done
        .store(true, std::sync::atomic::Ordering::SeqCst);
    // The stdin thread may be mid-frame; the guest reads (and drops) stdin
    // until DONE, so it finishes soon, and sends no other.
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        match to_guest.frames.try_lock() {
            Ok(_held) => {
                let _ = (&*stream).write_all(&frame);
                return;
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                let _held = p.into_inner();
                let _ = (&*stream).write_all(&frame);
                return;
            }
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => return,
        }
    }
}

/// Sends the command, then starts forwarding stdin (or sends its end).
fn send_job(stream: &UnixStream, job: &Job, to_guest: &Arc<ToGuest>) -> io::Result<()> {
    let mut frames = job_frames(job);
    if !job.forward_stdin {
        protocol::encode(&mut frames, Kind::StdinEof, &[]);
    }
    (&*stream).write_all(&frames)?;
    if job.forward_stdin {
        let mut w = stream.try_clone()?;
        let to_guest = to_guest.clone();
        std::thread::spawn(move || {
            let mut stdin = io::stdin().lock();
            let mut buf = vec![0u8; STDIN_CHUNK];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let _held = to_guest.frames.lock().unwrap_or_else(|p| p.into_inner());
                        if to_guest.done.load(std::sync::atomic::Ordering::SeqCst)
                            || protocol::write_frame(&mut w, Kind::Stdin, &buf[..n]).is_err()
                        {
                            return;
                        }
                    }
                }
            }
            let _held = to_guest.frames.lock().unwrap_or_else(|p| p.into_inner());
            if !to_guest.done.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = protocol::write_frame(&mut w, Kind::StdinEof, &[]);
            }
        });
    }
    Ok(())
}

/// Sends the command's frames alone (a vsock channel's stdin is a
/// connection of its own: see [`converse_vsock`]).
fn send_frames(stream: &UnixStream, job: &Job) -> io::Result<()> {
    (&*stream).write_all(&job_frames(job))
}

/// The frames of the command, up to `EXEC`.
fn job_frames(job: &Job) -> Vec<u8> {
    let mut frames = Vec::new();
    for a in &job.argv {
        protocol::encode(&mut frames, Kind::Arg, a.as_bytes());
    }
    for e in &job.env {
        protocol::encode(&mut frames, Kind::Env, e.as_bytes());
    }
    if let Some(cwd) = &job.cwd {
        protocol::encode(&mut frames, Kind::Cwd, cwd.as_bytes());
    }
    if let Some(root) = &job.root {
        protocol::encode(&mut frames, Kind::Root, root.as_bytes());
    }
    if let Some(tag) = &job.host_root {
        protocol::encode(&mut frames, Kind::HostRoot, tag.as_bytes());
    }
    for s in &job.shares {
        let mode = if s.writable { "rw" } else { "ro" };
        let share = format!("{mode} {} {}", s.tag, s.path);
        protocol::encode(&mut frames, Kind::Share, share.as_bytes());
    }
    if let Some(net) = &job.net {
        protocol::encode(&mut frames, Kind::Net, net);
    }
    protocol::encode(&mut frames, Kind::Exec, job.exec.as_bytes());
    frames
}

/// For the fuzz target `appliance_frames` (fuzz/, built by scripts/fuzz with `--cfg
/// fuzzing`): runs the host's side of the protocol on `from_guest` as everything the guest
/// sent, then end of stream. Returns how the run would have ended.
#[cfg(fuzzing)]
pub fn fuzz_converse(from_guest: &[u8]) -> Result<Option<Outcome>, HostError> {
    let (host, mut guest) =
        UnixStream::pair().map_err(|e| HostError::Io("socketpair".into(), e))?;
    // The reply (the job) must have room: a second thread drains it.
    let reader = guest
        .try_clone()
        .map_err(|e| HostError::Io("socket".into(), e))?;
    let drain = std::thread::spawn(move || io::copy(&mut &reader, &mut io::sink()));
    guest
        .write_all(from_guest)
        .and_then(|()| guest.shutdown(std::net::Shutdown::Write))
        .map_err(|e| HostError::Io("socket".into(), e))?;
    let job = Job {
        argv: vec!["true".into()],
        exec: "/bin/true".into(),
        env: vec!["A=b".into()],
        cwd: Some("/".into()),
        forward_stdin: false,
        timeout: None,
        verbose: false,
        root: None,
        net: None,
        host_root: None,
        shares: Vec::new(),
        restored: false,
        snapshot_at_ready: None,
        inherit_fds: Vec::new(),
    };
    let outcome = converse(host, &job, None, &mut io::sink(), &mut io::sink());
    let _ = drain.join();
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a vsock channel the command's stdio are connections of their own:
    /// its output is all delivered, even what comes after its status, before
    /// the status is taken and DONE sent; its stdin ends at once when none is
    /// forwarded.
    #[test]
    fn a_vsock_channels_status_waits_for_the_end_of_its_output() {
        let dir = crate::appliance::test_dir("host-vsock-converse");
        let path = dir.path().join("v.sock_1024");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let (host, mut control) = UnixStream::pair().unwrap();
        let guest_path = path.clone();
        let guest = std::thread::spawn(move || {
            let mut stdin = UnixStream::connect(&guest_path).unwrap();
            let mut stdout = UnixStream::connect(&guest_path).unwrap();
            let mut stderr = UnixStream::connect(&guest_path).unwrap();
            let mut input = Vec::new();
            stdin.read_to_end(&mut input).unwrap();
            stdout.write_all(b"out-1 ").unwrap();
            stderr.write_all(b"err").unwrap();
            drop(stderr);
            let mut exit = Vec::new();
            protocol::encode(&mut exit, Kind::Exit, &7i32.to_le_bytes());
            control.write_all(&exit).unwrap();
            // Output after the status still counts.
            std::thread::sleep(Duration::from_millis(50));
            stdout.write_all(b"out-2").unwrap();
            drop(stdout);
            let mut done = Vec::new();
            control.read_to_end(&mut done).unwrap();
            (input, done)
        });
        let mut job = fuzzless_job();
        job.restored = true;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let outcome = converse_vsock(host, &listener, &job, None, &mut out, &mut err).unwrap();
        assert_eq!(outcome, Some(Outcome::Exited(7)));
        assert_eq!(out, b"out-1 out-2");
        assert_eq!(err, b"err");
        drop(listener);
        let (input, done) = guest.join().unwrap();
        assert!(input.is_empty());
        let mut dec = Decoder::new();
        dec.feed(&done);
        let kinds: Vec<Kind> = std::iter::from_fn(|| dec.next_frame().unwrap())
            .map(|f| f.kind)
            .collect();
        assert_eq!(kinds.last(), Some(&Kind::Done), "{kinds:?}");
        assert!(kinds.contains(&Kind::Exec) && !kinds.contains(&Kind::StdinEof));
    }

    fn fuzzless_job() -> Job {
        Job {
            argv: vec!["true".into()],
            exec: "/bin/true".into(),
            env: vec![],
            cwd: None,
            forward_stdin: false,
            timeout: None,
            verbose: false,
            root: None,
            net: None,
            host_root: None,
            shares: Vec::new(),
            restored: false,
            snapshot_at_ready: None,
            inherit_fds: Vec::new(),
        }
    }

    /// A guest that repeats READY gets the job (and, with stdin forwarded, a stdin thread)
    /// once, not once per frame.
    #[test]
    fn a_repeated_ready_sends_the_job_once() {
        let (host, mut guest) = UnixStream::pair().unwrap();
        let mut frames = Vec::new();
        for _ in 0..5 {
            protocol::encode(&mut frames, Kind::Ready, &[]);
        }
        protocol::encode(&mut frames, Kind::Exit, &3i32.to_le_bytes());
        guest.write_all(&frames).unwrap();
        let job = Job {
            argv: vec!["true".into()],
            exec: "/bin/true".into(),
            env: vec![],
            cwd: None,
            forward_stdin: false,
            timeout: None,
            verbose: false,
            root: None,
            net: None,
            host_root: None,
            shares: Vec::new(),
            restored: false,
            snapshot_at_ready: None,
            inherit_fds: Vec::new(),
        };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let outcome = converse(host, &job, None, &mut out, &mut err).unwrap();
        assert_eq!(outcome, Some(Outcome::Exited(3)));
        let mut sent = Vec::new();
        guest.read_to_end(&mut sent).unwrap();
        let mut dec = Decoder::new();
        dec.feed(&sent);
        let mut execs = 0;
        while let Some(f) = dec.next_frame().unwrap() {
            execs += usize::from(f.kind == Kind::Exec);
        }
        assert_eq!(execs, 1);
    }
}
