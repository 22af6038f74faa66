//! ember-agent: runs containers' processes inside an ember VM, driven by
//! the host over one byte stream (the protocol is in `lib.rs`).
//!
//! On the QEMU backend it is the appliance's command: its stdin and stdout
//! are the stream (the appliance's init relays them over the channel), the
//! guest's root is the host's (so this binary is found where the host has
//! it) and each container's root is a virtio-fs share of the host's bundle
//! rootfs. It chroots each process into that root: the VM, not a namespace,
//! is the isolation boundary.
//!
//! It is a subreaper and reaps every child with one `waitpid(-1)` loop; a
//! process's exit is reported once its output has been sent (or after a
//! short grace, when something it left behind holds its pipes).

mod cgroup;

use ember_agent::{
    Capabilities, ContainerSpec, Event, Frame, Handle, Mount, ProcessSpec, Request,
    RequestEnvelope, Response, ResponseEnvelope, kind,
};
use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;

/// How long an exited process's output may keep flowing before its exit is
/// reported anyway (a background child holding its pipes).
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
/// The PATH a process without one searches, as runc's.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Agent errors: each is answered to the host as one line.
#[derive(Debug, Error)]
enum AgentError {
    #[error("no container `{0}`")]
    NoContainer(String),
    #[error("container `{0}` exists")]
    ContainerExists(String),
    #[error("no process {0}")]
    NoProcess(Handle),
    #[error("process handle {0} is in use")]
    HandleInUse(Handle),
    #[error("{0}: executable file not found in $PATH")]
    NotFound(String),
    #[error("empty argv")]
    NoArgs,
    #[error("not implemented: mounts of type `{fstype}` ({destination})")]
    MountType { fstype: String, destination: String },
    #[error("container `{0}` is paused")]
    Paused(String),
    #[error("container `{0}` has no cgroup (its create said why)")]
    NoCgroup(String),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> AgentError {
    let what = what.into();
    move |source| AgentError::Io { what, source }
}

/// The stream to the host: frames written whole under one lock.
#[derive(Clone)]
struct Out(Arc<Mutex<File>>);

impl Out {
    fn send(&self, kind: u8, payload: &[u8]) {
        let mut f = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // A host that went away ends the agent through its input side.
        let _ = ember_agent::write_frame(&mut *f, kind, payload);
    }

    fn send_json(&self, kind: u8, value: &impl serde::Serialize) {
        match serde_json::to_vec(value) {
            Ok(v) => self.send(kind, &v),
            Err(e) => eprintln!("ember-agent: cannot encode a message: {e}"),
        }
    }
}

struct Container {
    rootfs: PathBuf,
    /// Mount points made inside it, in order.
    mounts: Vec<PathBuf>,
    /// Its cgroup (none in a guest without cgroup v2, when it asked for no limits).
    cgroup: Option<PathBuf>,
    /// The OOM kills in it already reported.
    oom_kills: u64,
}

struct Process {
    container: String,
    pid: u32,
    /// Its stdin's writer thread: a process that does not read cannot
    /// hold up the agent (the bytes queue there instead).
    stdin: Option<mpsc::Sender<Vec<u8>>>,
    /// The terminal's master side, for resizes.
    pty: Option<File>,
}

/// Output relays of a process, and whether its exit was seen.
#[derive(Default)]
struct Pending {
    /// Relays still running for this pid (their done signals).
    relays: HashMap<u32, (Handle, Vec<mpsc::Receiver<()>>)>,
    /// Exits reaped before the pid was registered.
    early: HashMap<u32, i32>,
}

struct Agent {
    out: Out,
    containers: Mutex<HashMap<String, Container>>,
    processes: Mutex<HashMap<Handle, Process>>,
    pending: Mutex<Pending>,
    cgroups: cgroup::Hierarchy,
}

/// How often containers' OOM counts are looked at.
const OOM_POLL: Duration = Duration::from_millis(200);

fn main() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) has no memory effects.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    // SAFETY: fd 1 is ours for the process's life; nothing else writes it
    // (Rust's stdout is never used: output goes to stderr).
    let stdout = unsafe { File::from_raw_fd(libc::dup(1)) };
    let agent = Arc::new(Agent {
        out: Out(Arc::new(Mutex::new(stdout))),
        containers: Mutex::new(HashMap::new()),
        processes: Mutex::new(HashMap::new()),
        pending: Mutex::new(Pending::default()),
        cgroups: cgroup::Hierarchy::setup(),
    });
    {
        let agent = agent.clone();
        std::thread::spawn(move || agent.reap());
    }
    {
        let agent = agent.clone();
        std::thread::spawn(move || agent.watch_oom());
    }
    let mut input = io::stdin().lock();
    loop {
        match ember_agent::read_frame(&mut input) {
            Ok(Some(frame)) => {
                if agent.handle_frame(frame) {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                eprintln!("ember-agent: {e}");
                break;
            }
        }
    }
    agent.kill_everything();
}

impl Agent {
    /// Handles one frame from the host; true when the agent is to stop.
    fn handle_frame(self: &Arc<Self>, frame: Frame) -> bool {
        match frame.kind {
            kind::REQUEST => {
                let env: RequestEnvelope = match serde_json::from_slice(&frame.payload) {
                    Ok(e) => e,
                    Err(e) => {
                        eprintln!("ember-agent: bad request: {e}");
                        return false;
                    }
                };
                let stop = env.request == Request::Shutdown;
                let response = match self.handle(env.request) {
                    Ok(r) => r,
                    Err(e) => Response::Error(e.to_string()),
                };
                self.out.send_json(
                    kind::RESPONSE,
                    &ResponseEnvelope {
                        id: env.id,
                        response,
                    },
                );
                stop
            }
            kind::STDIN | kind::STDIN_EOF => {
                let Some((handle, bytes)) = ember_agent::split_data(&frame.payload) else {
                    return false;
                };
                let mut procs = self.processes.lock().unwrap_or_else(|p| p.into_inner());
                let Some(p) = procs.get_mut(&handle) else {
                    return false;
                };
                if frame.kind == kind::STDIN_EOF {
                    // Its writer ends (closing the pipe) once the queue is written.
                    p.stdin = None;
                } else if let Some(tx) = p.stdin.as_ref() {
                    // A writer that ended (the process closed its stdin) drops the rest.
                    if tx.send(bytes.to_vec()).is_err() {
                        p.stdin = None;
                    }
                }
                false
            }
            other => {
                eprintln!("ember-agent: unexpected frame kind {other:#x}");
                false
            }
        }
    }

    fn handle(self: &Arc<Self>, request: Request) -> Result<Response, AgentError> {
        match request {
            Request::Hello => Ok(Response::Hello {
                version: env!("CARGO_PKG_VERSION").to_owned(),
                kernel_release: kernel_release(),
            }),
            Request::CreateContainer(spec) => self.create_container(spec).map(|_| Response::Ok),
            Request::Start(spec) => self.start(spec).map(|pid| Response::Started { pid }),
            Request::Signal {
                handle,
                signal,
                all,
            } => self.signal(handle, signal, all).map(|_| Response::Ok),
            Request::Resize {
                handle,
                width,
                height,
            } => self.resize(handle, width, height).map(|_| Response::Ok),
            Request::Pids { container } => {
                let rootfs = self.rootfs_of(&container)?;
                Ok(Response::Pids(pids_in(&rootfs)))
            }
            Request::Destroy { container } => self.destroy(&container).map(|_| Response::Ok),
            Request::Pause { container } => {
                cgroup::freeze(&self.cgroup_of(&container)?, true)?;
                Ok(Response::Ok)
            }
            Request::Resume { container } => {
                cgroup::freeze(&self.cgroup_of(&container)?, false)?;
                Ok(Response::Ok)
            }
            Request::Stats { container } => Ok(Response::Stats(cgroup::stats(
                &self.cgroup_of(&container)?,
            )?)),
            Request::Update {
                container,
                resources,
            } => {
                cgroup::apply(&self.cgroup_of(&container)?, &resources)?;
                Ok(Response::Ok)
            }
            Request::Shutdown => Ok(Response::Ok),
        }
    }

    fn cgroup_of(&self, container: &str) -> Result<PathBuf, AgentError> {
        let cs = self.containers.lock().unwrap_or_else(|p| p.into_inner());
        let c = cs
            .get(container)
            .ok_or_else(|| AgentError::NoContainer(container.to_owned()))?;
        c.cgroup
            .clone()
            .ok_or_else(|| AgentError::NoCgroup(container.to_owned()))
    }

    /// Reports each new OOM kill in a container's cgroup.
    fn watch_oom(self: Arc<Self>) {
        loop {
            std::thread::sleep(OOM_POLL);
            let mut news = Vec::new();
            {
                let mut cs = self.containers.lock().unwrap_or_else(|p| p.into_inner());
                for (id, c) in cs.iter_mut() {
                    let Some(dir) = &c.cgroup else { continue };
                    let n = cgroup::oom_kills(dir);
                    if n > c.oom_kills {
                        c.oom_kills = n;
                        news.push(id.clone());
                    }
                }
            }
            for container in news {
                self.out.send_json(kind::EVENT, &Event::Oom { container });
            }
        }
    }

    fn rootfs_of(&self, container: &str) -> Result<PathBuf, AgentError> {
        let cs = self.containers.lock().unwrap_or_else(|p| p.into_inner());
        cs.get(container)
            .map(|c| c.rootfs.clone())
            .ok_or_else(|| AgentError::NoContainer(container.to_owned()))
    }

    fn create_container(&self, spec: ContainerSpec) -> Result<(), AgentError> {
        let mut cs = self.containers.lock().unwrap_or_else(|p| p.into_inner());
        if cs.contains_key(&spec.id) {
            return Err(AgentError::ContainerExists(spec.id));
        }
        let rootfs = PathBuf::from(&spec.rootfs);
        if !rootfs.is_dir() {
            return Err(AgentError::Io {
                what: format!("container root {}", rootfs.display()),
                source: io::ErrorKind::NotFound.into(),
            });
        }
        let mut made = Vec::new();
        if spec.readonly_root {
            // Its own mount, made read-only once everything inside is mounted.
            if let Err(e) = bind(&rootfs, &rootfs, false) {
                return Err(io_err(format!("bind {}", rootfs.display()))(e));
            }
            made.push(rootfs.clone());
        }
        for m in &spec.mounts {
            match mount_in(&rootfs, m) {
                Ok(points) => made.extend(points),
                Err(e) => {
                    unmount_all(&made);
                    return Err(e);
                }
            }
        }
        if let Err(e) = harden(&rootfs, &spec, &mut made) {
            unmount_all(&made);
            return Err(e);
        }
        if spec.readonly_root
            && let Err(e) = remount_readonly(&rootfs)
        {
            unmount_all(&made);
            return Err(io_err("make the root read-only")(e));
        }
        // Limits asked for need the cgroup; without any, a guest without
        // cgroup v2 still runs the container (unpausable, without figures).
        let wants_limits = spec.resources != ember_agent::Resources::default();
        let cg = match self.cgroups.create(&spec.id) {
            Ok(dir) => match cgroup::apply(&dir, &spec.resources) {
                Ok(()) => Some(dir),
                Err(e) => {
                    cgroup::remove(&dir);
                    unmount_all(&made);
                    return Err(e.into());
                }
            },
            Err(e) if wants_limits => {
                unmount_all(&made);
                return Err(e.into());
            }
            Err(e) => {
                eprintln!("ember-agent: {e}");
                None
            }
        };
        if let Some(h) = &spec.hostname {
            // The VM's hostname is the pod's (no UTS namespace per container): the last one set wins.
            // SAFETY: the pointer and length describe `h`.
            if unsafe { libc::sethostname(h.as_ptr().cast(), h.len()) } != 0 {
                unmount_all(&made);
                return Err(io_err("sethostname")(io::Error::last_os_error()));
            }
        }
        cs.insert(
            spec.id,
            Container {
                rootfs,
                mounts: made,
                cgroup: cg,
                oom_kills: 0,
            },
        );
        Ok(())
    }

    fn start(self: &Arc<Self>, spec: ProcessSpec) -> Result<u32, AgentError> {
        if spec.args.is_empty() {
            return Err(AgentError::NoArgs);
        }
        let rootfs = self.rootfs_of(&spec.container)?;
        let cg = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&spec.container)
            .and_then(|c| c.cgroup.clone());
        // A process joining a frozen cgroup would freeze before its exec,
        // and the spawn waiting for that exec would stall the agent.
        if cg.as_deref().is_some_and(cgroup::is_frozen) {
            return Err(AgentError::Paused(spec.container));
        }
        // Joined from the child before exec: writing "0" moves the writer.
        let cg_procs = match &cg {
            Some(dir) => Some(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(dir.join("cgroup.procs"))
                    .map_err(io_err("open the container's cgroup.procs"))?,
            ),
            None => None,
        };
        let cg_fd = cg_procs.as_ref().map(|f| f.as_raw_fd());
        if self
            .processes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&spec.handle)
        {
            return Err(AgentError::HandleInUse(spec.handle));
        }
        let program = resolve(&rootfs, &spec.args[0], &spec.env)?;
        let mut cmd = Command::new(&program);
        cmd.arg0(&spec.args[0]).args(&spec.args[1..]).env_clear();
        for e in &spec.env {
            match e.split_once('=') {
                Some((k, v)) => cmd.env(k, v),
                None => cmd.env(e, ""),
            };
        }
        if !spec.env.iter().any(|e| e.starts_with("HOME=")) {
            // As runc without a passwd entry for the user.
            cmd.env("HOME", "/");
        }
        // Output sources: (frame kind, reader).
        let mut outputs: Vec<(u8, File)> = Vec::new();
        let mut stdin_w = None;
        let mut pty = None;
        if spec.terminal {
            let (master, slave) =
                open_pty(&rootfs.join("dev/pts/ptmx")).map_err(io_err("a terminal"))?;
            cmd.stdin(Stdio::from(slave.try_clone().map_err(io_err("dup"))?))
                .stdout(Stdio::from(slave.try_clone().map_err(io_err("dup"))?))
                .stderr(Stdio::from(slave));
            let m2 = master.try_clone().map_err(io_err("dup"))?;
            if spec.stdin {
                stdin_w = Some(master.try_clone().map_err(io_err("dup"))?);
            }
            outputs.push((kind::STDOUT, m2));
            pty = Some(master);
        } else {
            if spec.stdin {
                let (r, w) = pipe().map_err(io_err("pipe"))?;
                cmd.stdin(Stdio::from(r));
                stdin_w = Some(w);
            } else {
                cmd.stdin(Stdio::null());
            }
            let (r, w) = pipe().map_err(io_err("pipe"))?;
            cmd.stdout(Stdio::from(w));
            outputs.push((kind::STDOUT, r));
            let (r, w) = pipe().map_err(io_err("pipe"))?;
            cmd.stderr(Stdio::from(w));
            outputs.push((kind::STDERR, r));
        }
        let root_c = CString::new(rootfs.as_os_str().as_bytes()).map_err(|_| AgentError::NoArgs)?;
        let cwd_c = CString::new(if spec.cwd.is_empty() { "/" } else { &spec.cwd })
            .map_err(|_| AgentError::NoArgs)?;
        let (uid, gid, groups, terminal) = (
            spec.uid,
            spec.gid,
            spec.additional_gids.clone(),
            spec.terminal,
        );
        let (no_new_privs, rlimits, caps) = (
            spec.no_new_privileges,
            spec.rlimits.clone(),
            spec.capabilities,
        );
        let last_cap = last_cap();
        // SAFETY: the closure runs in the forked child before exec and
        // calls only async-signal-safe functions on memory made before fork.
        unsafe {
            cmd.pre_exec(move || {
                let check = |r: libc::c_int| {
                    if r < 0 {
                        Err(io::Error::last_os_error())
                    } else {
                        Ok(())
                    }
                };
                if let Some(fd) = cg_fd
                    && libc::write(fd, b"0".as_ptr().cast(), 1) != 1
                {
                    return Err(io::Error::last_os_error());
                }
                check(libc::setsid())?;
                if terminal {
                    check(libc::ioctl(0, libc::TIOCSCTTY, 0))?;
                }
                check(libc::chroot(root_c.as_ptr()))?;
                check(libc::chdir(cwd_c.as_ptr()))?;
                for r in &rlimits {
                    let l = libc::rlimit {
                        rlim_cur: r.soft,
                        rlim_max: r.hard,
                    };
                    check(libc::setrlimit(r.resource as _, &l))?;
                }
                if let Some(c) = caps {
                    for cap in 0..=last_cap {
                        if c.bounding & (1 << cap) == 0 {
                            check(libc::prctl(
                                libc::PR_CAPBSET_DROP,
                                cap as libc::c_ulong,
                                0,
                                0,
                                0,
                            ))?;
                        }
                    }
                    // Keep the permitted set across the uid change, set below.
                    check(libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0))?;
                }
                check(libc::setgroups(groups.len(), groups.as_ptr()))?;
                check(libc::setgid(gid))?;
                check(libc::setuid(uid))?;
                if let Some(c) = caps {
                    set_capabilities(&c, last_cap)?;
                }
                if no_new_privs {
                    check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
                }
                Ok(())
            });
        }
        // The pending lock is held across the spawn: the reaper cannot
        // report this pid before its relays are registered.
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let child = cmd
            .spawn()
            .map_err(io_err(format!("start {}", spec.args[0])))?;
        // The Child is dropped without waiting: the reaper collects it.
        let pid = child.id();
        drop(cmd);
        drop(cg_procs);
        let stdin_tx = stdin_w.map(|w| {
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            std::thread::spawn(move || pump_stdin(w, rx));
            tx
        });
        let mut dones = Vec::new();
        for (k, r) in outputs {
            let (tx, rx) = mpsc::channel();
            dones.push(rx);
            let out = self.out.clone();
            let handle = spec.handle;
            std::thread::spawn(move || relay(out, k, handle, r, tx));
        }
        self.processes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                spec.handle,
                Process {
                    container: spec.container.clone(),
                    pid,
                    stdin: stdin_tx,
                    pty,
                },
            );
        if let Some(status) = pending.early.remove(&pid) {
            self.report_exit(spec.handle, status, dones);
        } else {
            pending.relays.insert(pid, (spec.handle, dones));
        }
        Ok(pid)
    }

    fn signal(&self, handle: Handle, signal: i32, all: bool) -> Result<(), AgentError> {
        let (container, pid) = {
            let procs = self.processes.lock().unwrap_or_else(|p| p.into_inner());
            let p = procs.get(&handle).ok_or(AgentError::NoProcess(handle))?;
            (p.container.clone(), p.pid)
        };
        if all {
            let rootfs = self.rootfs_of(&container)?;
            for p in pids_in(&rootfs) {
                // SAFETY: kill has no memory effects.
                unsafe { libc::kill(p as i32, signal) };
            }
            return Ok(());
        }
        // SAFETY: kill has no memory effects.
        if unsafe { libc::kill(pid as i32, signal) } != 0 {
            return Err(io_err(format!("kill {pid}"))(io::Error::last_os_error()));
        }
        Ok(())
    }

    fn resize(&self, handle: Handle, width: u16, height: u16) -> Result<(), AgentError> {
        let procs = self.processes.lock().unwrap_or_else(|p| p.into_inner());
        let p = procs.get(&handle).ok_or(AgentError::NoProcess(handle))?;
        let Some(pty) = &p.pty else {
            // No terminal: nothing to size (runc's shim ignores it too).
            return Ok(());
        };
        let ws = libc::winsize {
            ws_row: height,
            ws_col: width,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize from the pointer, which is valid.
        if unsafe { libc::ioctl(pty.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
            return Err(io_err("resize")(io::Error::last_os_error()));
        }
        Ok(())
    }

    fn destroy(&self, container: &str) -> Result<(), AgentError> {
        let c = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(container)
            .ok_or_else(|| AgentError::NoContainer(container.to_owned()))?;
        kill_in(&c.rootfs);
        unmount_all(&c.mounts);
        if let Some(dir) = &c.cgroup {
            cgroup::remove(dir);
        }
        self.processes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, p| p.container != container);
        Ok(())
    }

    fn kill_everything(&self) {
        let cs = self.containers.lock().unwrap_or_else(|p| p.into_inner());
        for c in cs.values() {
            kill_in(&c.rootfs);
            unmount_all(&c.mounts);
        }
    }

    /// Reaps every child; reports the exits of the host's processes.
    fn reap(self: Arc<Self>) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes the status to a valid pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
            if pid < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                continue;
            }
            let code = if libc::WIFSIGNALED(status) {
                128 + libc::WTERMSIG(status)
            } else {
                libc::WEXITSTATUS(status)
            };
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((handle, dones)) = pending.relays.remove(&(pid as u32)) {
                drop(pending);
                self.report_exit(handle, code, dones);
            } else {
                let known = self
                    .processes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .any(|p| p.pid == pid as u32);
                // An orphan reparented here is no one's; an exit before its
                // registration is kept for `start`.
                if !known {
                    pending.early.insert(pid as u32, code);
                    // Bounded: orphans' pids would pile up otherwise.
                    if pending.early.len() > 4096 {
                        pending.early.clear();
                    }
                }
            }
        }
    }

    /// Sends `Exited` once the process's output is all sent (or the grace is over).
    fn report_exit(self: &Arc<Self>, handle: Handle, status: i32, dones: Vec<mpsc::Receiver<()>>) {
        let agent = self.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + OUTPUT_GRACE;
            for d in dones {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let _ = d.recv_timeout(left);
            }
            if let Some(p) = agent
                .processes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(&handle)
            {
                p.stdin = None;
                p.pty = None;
            }
            agent
                .out
                .send_json(kind::EVENT, &Event::Exited { handle, status });
        });
    }
}

/// Writes what the host sends for a process's stdin, in order, until the
/// host ends it (the sender dropped) or the process closes its end.
fn pump_stdin(mut w: File, rx: mpsc::Receiver<Vec<u8>>) {
    for bytes in rx {
        if w.write_all(&bytes).is_err() {
            return;
        }
    }
}

/// Copies a process's output to the host until EOF (or EIO: a terminal
/// whose last user closed it).
fn relay(out: Out, k: u8, handle: Handle, mut r: File, done: mpsc::Sender<()>) {
    let mut buf = vec![0u8; ember_agent::DATA_CHUNK];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.send(k, &ember_agent::data_payload(handle, &buf[..n])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = done.send(());
}

/// The path (inside the container) of `arg0`, looked up in the process's
/// PATH within the container's root when it has no `/`.
fn resolve(rootfs: &Path, arg0: &str, env: &[String]) -> Result<String, AgentError> {
    if arg0.contains('/') {
        return Ok(arg0.to_owned());
    }
    let path = env
        .iter()
        .rev()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(DEFAULT_PATH);
    for dir in path.split(':').filter(|d| d.starts_with('/')) {
        let candidate = format!("{}/{arg0}", dir.trim_end_matches('/'));
        let host = rootfs.join(candidate.trim_start_matches('/'));
        // Symlinks (busybox's applets) resolve inside the root, not here:
        // an absolute link target is taken relative to it.
        if exists_in(rootfs, &host, 0) {
            return Ok(candidate);
        }
    }
    Err(AgentError::NotFound(arg0.to_owned()))
}

/// Whether `p` (a path under `rootfs`) names a regular file, following
/// symlinks as the container would see them.
fn exists_in(rootfs: &Path, p: &Path, depth: u32) -> bool {
    if depth > 16 {
        return false;
    }
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => match std::fs::read_link(p) {
            Ok(t) if t.is_absolute() => exists_in(
                rootfs,
                &rootfs.join(t.strip_prefix("/").unwrap_or(&t)),
                depth + 1,
            ),
            Ok(t) => match p.parent() {
                Some(d) => exists_in(rootfs, &d.join(t), depth + 1),
                None => false,
            },
            Err(_) => false,
        },
        Ok(m) => m.is_file(),
        Err(_) => false,
    }
}

/// The highest capability number this kernel knows.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Sets the calling process's capability sets (capset) and its ambient
/// set. Called between fork and exec: no allocation.
fn set_capabilities(c: &Capabilities, last_cap: u32) -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let half = |m: u64, hi: bool| if hi { (m >> 32) as u32 } else { m as u32 };
    let data = [false, true].map(|hi| Data {
        effective: half(c.effective, hi),
        permitted: half(c.permitted, hi),
        inheritable: half(c.inheritable, hi),
    });
    // SAFETY: capset reads a header and two data structs from valid pointers.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    for cap in 0..=last_cap {
        if c.ambient & (1 << cap) != 0 {
            // SAFETY: prctl has no memory effects here.
            let r = unsafe {
                libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                    cap as libc::c_ulong,
                    0,
                    0,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

fn c_path(p: &Path) -> Result<CString, AgentError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| AgentError::NoArgs)
}

/// Masked and read-only paths, and sysctls; mount points go into `made`.
fn harden(rootfs: &Path, spec: &ContainerSpec, made: &mut Vec<PathBuf>) -> Result<(), AgentError> {
    let null = CString::new("/dev/null").map_err(|_| AgentError::NoArgs)?;
    let tmpfs = CString::new("tmpfs").map_err(|_| AgentError::NoArgs)?;
    for p in &spec.masked_paths {
        let target = rootfs.join(p.trim_start_matches('/'));
        let Ok(meta) = std::fs::metadata(&target) else {
            continue; // nothing to hide
        };
        let t = c_path(&target)?;
        // SAFETY: all pointers are NUL-terminated strings or null, alive for the call.
        let r = unsafe {
            if meta.is_dir() {
                libc::mount(
                    tmpfs.as_ptr(),
                    t.as_ptr(),
                    tmpfs.as_ptr(),
                    libc::MS_RDONLY,
                    std::ptr::null(),
                )
            } else {
                libc::mount(
                    null.as_ptr(),
                    t.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                )
            }
        };
        if r != 0 {
            return Err(io_err(format!("mask {p}"))(io::Error::last_os_error()));
        }
        made.push(target);
    }
    for p in &spec.readonly_paths {
        let target = rootfs.join(p.trim_start_matches('/'));
        if std::fs::symlink_metadata(&target).is_err() {
            continue;
        }
        let t = c_path(&target)?;
        // SAFETY: as above.
        let r = unsafe {
            libc::mount(
                t.as_ptr(),
                t.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(io_err(format!("bind {p}"))(io::Error::last_os_error()));
        }
        made.push(target.clone());
        // SAFETY: as above.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                t.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_REC,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(io_err(format!("make {p} read-only"))(
                io::Error::last_os_error(),
            ));
        }
    }
    for (key, value) in &spec.sysctl {
        if key.contains("..") || key.contains('/') {
            return Err(io_err(format!("sysctl {key}"))(
                io::ErrorKind::InvalidInput.into(),
            ));
        }
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        std::fs::write(&path, value).map_err(io_err(format!("sysctl {key}")))?;
    }
    Ok(())
}

fn pipe() -> io::Result<(File, File)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors to a valid array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made and are owned here.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

/// A new terminal from the container's own devpts (`ptmx`, when it has
/// one, so its processes find their terminal under their /dev/pts):
/// (master, slave). The slave is opened from the master (TIOCGPTPEER), not
/// by a name that means another devpts here.
fn open_pty(ptmx: &Path) -> io::Result<(File, File)> {
    let path = if ptmx.exists() {
        ptmx
    } else {
        Path::new("/dev/ptmx")
    };
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: c is a NUL-terminated path alive for the call.
    let m = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: m was just made and is owned here.
    let master = unsafe { File::from_raw_fd(m) };
    // SAFETY: unlockpt acts on a valid master descriptor.
    if unsafe { libc::unlockpt(m) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: TIOCGPTPEER takes open flags and returns a new descriptor.
    let s = unsafe {
        libc::ioctl(
            m,
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: s was just made and is owned here.
    Ok((master, unsafe { File::from_raw_fd(s) }))
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Pids whose root is `rootfs`: the container's processes.
fn pids_in(rootfs: &Path) -> Vec<u32> {
    let Ok(want) = std::fs::canonicalize(rootfs) else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid: &u32| {
            std::fs::read_link(format!("/proc/{pid}/root")).is_ok_and(|r| r == want)
        })
        .collect();
    pids.sort_unstable();
    pids
}

fn kill_in(rootfs: &Path) {
    for p in pids_in(rootfs) {
        // SAFETY: kill has no memory effects.
        unsafe { libc::kill(p as i32, libc::SIGKILL) };
    }
}

/// Splits OCI mount options into mount(2) flags and the data string.
fn mount_options(options: &[String]) -> (libc::c_ulong, String) {
    let mut flags = 0;
    let mut data = Vec::new();
    for o in options {
        match o.as_str() {
            "ro" => flags |= libc::MS_RDONLY,
            "rw" => flags &= !libc::MS_RDONLY,
            "nosuid" => flags |= libc::MS_NOSUID,
            "nodev" => flags |= libc::MS_NODEV,
            "noexec" => flags |= libc::MS_NOEXEC,
            "relatime" => flags |= libc::MS_RELATIME,
            "strictatime" => flags |= libc::MS_STRICTATIME,
            "bind" | "rbind" | "rprivate" | "private" | "rslave" | "slave" => {}
            other => data.push(other),
        }
    }
    (flags, data.join(","))
}

/// The device nodes a container's /dev gets (as runc makes them): name,
/// major, minor.
const DEVICES: &[(&str, u32, u32)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];
/// And its symlinks: name, target.
const DEV_LINKS: &[(&str, &str)] = &[
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("core", "/proc/kcore"),
    ("ptmx", "pts/ptmx"),
];

/// Fills a container's fresh /dev tmpfs: only the usual devices, never the
/// VM's own (its channel to the host among them).
fn populate_dev(dev: &Path) -> Result<(), AgentError> {
    for &(name, major, minor) in DEVICES {
        let p = dev.join(name);
        let c = CString::new(p.as_os_str().as_bytes()).map_err(|_| AgentError::NoArgs)?;
        // SAFETY: c is a NUL-terminated path alive for the call.
        let r = unsafe {
            libc::mknod(
                c.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(major, minor),
            )
        };
        if r != 0 {
            return Err(io_err(format!("mknod {}", p.display()))(
                io::Error::last_os_error(),
            ));
        }
        // The umask took some bits away.
        // SAFETY: as above.
        unsafe { libc::chmod(c.as_ptr(), 0o666) };
    }
    for &(name, target) in DEV_LINKS {
        std::os::unix::fs::symlink(target, dev.join(name))
            .map_err(io_err(format!("symlink /dev/{name}")))?;
    }
    Ok(())
}

/// Makes one OCI mount inside `rootfs`; returns the mount points made
/// (none for cgroups on a kernel without cgroup2).
fn mount_in(rootfs: &Path, m: &Mount) -> Result<Vec<PathBuf>, AgentError> {
    let target = rootfs.join(m.destination.trim_start_matches('/'));
    if m.fstype == "bind" || m.options.iter().any(|o| o == "bind" || o == "rbind") {
        return bind_in(&target, m).map(|()| vec![target]);
    }
    let (mut flags, mut data) = mount_options(&m.options);
    let (source, fstype) = match m.fstype.as_str() {
        // The VM's own devices: a fresh devtmpfs is what a container's
        // /dev tmpfs plus runc's device nodes would give, and only the
        // VM's devices are in it.
        "proc" | "sysfs" | "tmpfs" | "devpts" | "mqueue" => (m.source.as_str(), m.fstype.as_str()),
        "cgroup" | "cgroup2" => ("cgroup2", "cgroup2"),
        _ => {
            return Err(AgentError::MountType {
                fstype: m.fstype.clone(),
                destination: m.destination.clone(),
            });
        }
    };
    if fstype == "devpts" {
        // The container's own pty instance, usable by its processes.
        data = "newinstance,ptmxmode=0666,mode=0620".to_owned();
        flags |= libc::MS_NOSUID | libc::MS_NOEXEC;
    }
    std::fs::create_dir_all(&target).map_err(io_err(format!("mkdir {}", target.display())))?;
    let c = |s: &str| CString::new(s).map_err(|_| AgentError::NoArgs);
    let (src, ty, dt) = (c(source)?, c(fstype)?, c(&data)?);
    let tgt = CString::new(target.as_os_str().as_bytes()).map_err(|_| AgentError::NoArgs)?;
    // SAFETY: all pointers are NUL-terminated strings alive for the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            ty.as_ptr(),
            flags,
            dt.as_ptr().cast(),
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        if fstype == "cgroup2" {
            // A guest kernel without cgroup2 leaves it empty, as a
            // container without cgroup access sees it.
            return Ok(Vec::new());
        }
        if matches!(fstype, "devpts" | "mqueue") && e.raw_os_error() == Some(libc::ENODEV) {
            // So does one without ptys or POSIX message queues (a minimal
            // kernel such as the PVM test kernel): a container that asks
            // for a terminal is then refused at its ptmx.
            eprintln!(
                "ember-agent: no {fstype} in this guest kernel: {} left empty",
                m.destination
            );
            return Ok(Vec::new());
        }
        return Err(io_err(format!("mount {} on {}", m.fstype, m.destination))(
            e,
        ));
    }
    if fstype == "tmpfs" && m.destination == "/dev" {
        populate_dev(&target)?;
    }
    if fstype == "devpts" && !rootfs.join("dev/ptmx").is_symlink() {
        // /dev/ptmx of the container's devpts, not the VM's: bound over
        // the node (devtmpfs is one instance VM-wide, so it is not edited).
        let ptmx = rootfs.join("dev/ptmx");
        let from = target.join("ptmx");
        if let (Ok(f), Ok(t)) = (
            CString::new(from.as_os_str().as_bytes()),
            CString::new(ptmx.as_os_str().as_bytes()),
        ) {
            // SAFETY: both are NUL-terminated paths alive for the call.
            let r = unsafe {
                libc::mount(
                    f.as_ptr(),
                    t.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                )
            };
            if r == 0 {
                // Unmounted before the devpts (unmount_all goes backwards).
                return Ok(vec![target, ptmx]);
            }
        }
    }
    Ok(vec![target])
}

/// A bind mount: its source is a guest path (the host's side reached the
/// guest through the pod's share); a file's mount point is a file. Its
/// options (`ro`, `nosuid`, `nodev`, `noexec`) apply to this mount only,
/// by a remount.
fn bind_in(target: &Path, m: &Mount) -> Result<(), AgentError> {
    let source = Path::new(&m.source);
    let meta = std::fs::metadata(source).map_err(io_err(format!("bind source {}", m.source)))?;
    let mk = || -> io::Result<()> {
        if meta.is_dir() {
            std::fs::create_dir_all(target)
        } else {
            if let Some(d) = target.parent() {
                std::fs::create_dir_all(d)?;
            }
            if std::fs::symlink_metadata(target).is_err() {
                File::create(target)?;
            }
            Ok(())
        }
    };
    mk().map_err(io_err(format!("mount point {}", m.destination)))?;
    let recursive = m.options.iter().any(|o| o == "rbind");
    bind(source, target, recursive)
        .map_err(io_err(format!("bind {} on {}", m.source, m.destination)))?;
    let (flags, _) = mount_options(&m.options);
    let extra = flags & (libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC);
    if extra != 0 {
        remount_bind(target, extra)
            .map_err(io_err(format!("remount {} {extra:#x}", m.destination)))?;
    }
    Ok(())
}

fn bind(source: &Path, target: &Path, recursive: bool) -> io::Result<()> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let (s, t) = (c(source)?, c(target)?);
    let flags = libc::MS_BIND | if recursive { libc::MS_REC } else { 0 };
    // SAFETY: NUL-terminated paths alive for the call; no type or data.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the bind mount at `target` read-only (that mount only).
fn remount_readonly(target: &Path) -> io::Result<()> {
    remount_bind(target, libc::MS_RDONLY)
}

/// Remounts the bind mount at `target` with `flags` (`MS_RDONLY`,
/// `MS_NOSUID`, ...), that mount only.
fn remount_bind(target: &Path, flags: libc::c_ulong) -> io::Result<()> {
    let t = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: as in bind; a remount ignores the source and type.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REMOUNT | flags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn unmount_all(points: &[PathBuf]) {
    for p in points.iter().rev() {
        if let Ok(c) = CString::new(p.as_os_str().as_bytes()) {
            // SAFETY: c is a NUL-terminated path alive for the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}
