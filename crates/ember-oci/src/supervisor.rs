//! The container's process on the host: started by `create`, it boots
//! the VM (through [`ember::container::pod`], as the shim does), holds the
//! container's stdio, serves `ember-oci`'s other commands on the control
//! socket, and exits with the container's status — so Docker's
//! containerd-shim-runc-v2, which reaps it, sees the container end as it
//! would a runc container's init.

use crate::ctl::{self, Reply, Request};
use crate::fdpass;
use crate::hostcg;
use crate::state::State;
use ember::container::ContainerError;
use ember::container::agent::{Note, Sink};
use ember::container::pod::{Pod, PodConfig, PodDir, ProcIo, descendants};
use ember::container::spec::{Process, Spec};
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// The init's handle with the agent (execs count up from 2).
const INIT: u32 = 1;
/// Docker's per-container directory holds this (the published ports).
const DOCKER_HOSTCONFIG: &str = "hostconfig.json";
/// An annotation naming ports to forward into the guest (`80,53/udp`),
/// for callers other than Docker.
pub const PUBLISH_ANNOTATION: &str = "org.ember.publish";

/// How the supervisor was started.
pub struct Opts {
    /// `--root`.
    pub root: PathBuf,
    /// The container.
    pub id: String,
    /// Its bundle.
    pub bundle: PathBuf,
    /// `--backend`.
    pub backend: Option<String>,
    /// The control socket's listening descriptor (made by `create`).
    pub ctl_fd: RawFd,
}

/// A descriptor read until it ends or `done` is set (a process's stdin:
/// its pump must let go of the descriptor when the process has exited,
/// or a terminal's master would never see its end).
struct StopRead {
    fd: OwnedFd,
    done: Arc<AtomicBool>,
}

impl Read for StopRead {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if self.done.load(Ordering::Relaxed) {
                return Ok(0);
            }
            let mut p = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the call.
            let r = unsafe { libc::poll(&mut p, 1, 200) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                continue;
            }
            // SAFETY: buf is valid for buf.len() bytes.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            return if n < 0 {
                // A terminal whose master closed says EIO: its end.
                log::info!(
                    "the terminal's input ended: {}",
                    std::io::Error::last_os_error()
                );
                Ok(0)
            } else {
                Ok(n as usize)
            };
        }
    }
}

fn dup(fd: RawFd) -> Result<OwnedFd, ContainerError> {
    // SAFETY: fcntl on a descriptor this process holds.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if n < 0 {
        return Err(ContainerError::Io {
            what: format!("dup fd {fd}"),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: a new descriptor, ours.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

fn sink(fd: RawFd) -> Result<Sink, ContainerError> {
    Ok(Box::new(File::from(dup(fd)?)))
}

struct Sup {
    root: PathBuf,
    id: String,
    spec: Spec,
    pod: Arc<Pod>,
    /// The VM's memory, MiB: no limit in it can be more.
    vm_mib: u64,
    /// The cgroups it made on the host (for `docker stats`).
    host_cgroups: Vec<PathBuf>,
    /// The VM's shared directory (the root, bind mounts' sources).
    dir: PodDir,
    state: Mutex<State>,
    /// The init's terminal (the pty's slave), with `-t`.
    tty: Option<OwnedFd>,
    /// Waiting execs, by handle.
    execs: Mutex<HashMap<u32, mpsc::Sender<i32>>>,
    next: AtomicU32,
    init_done: Arc<AtomicBool>,
    ending: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the supervisor; never returns.
pub fn run(o: Opts) -> ! {
    // SAFETY: `create` passed this descriptor, listening, for us to own.
    let listener = unsafe { UnixListener::from_raw_fd(o.ctl_fd) };
    // SAFETY: fcntl on our own descriptor.
    unsafe { libc::fcntl(o.ctl_fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // Before the VM starts, so that its processes follow.
    let host_cgroups = hostcg::join(&format!("ember-oci-{}", o.id));
    let listed: String = host_cgroups
        .iter()
        .map(|d| format!("{}\n", d.display()))
        .collect();
    if let Err(e) = std::fs::write(crate::state::host_cgroups(&o.root, &o.id), listed) {
        log::warn!("recording the host cgroups: {e}");
    }
    let fail = |conn: Option<&UnixStream>, e: &dyn std::fmt::Display| -> ! {
        if let Some(c) = conn {
            let _ = ctl::write_reply(c, &Reply::error(e));
        }
        hostcg::leave(&host_cgroups, Duration::from_secs(2));
        std::process::exit(1);
    };
    let first = listener.accept().map(|(s, _)| s);
    let conn = match first {
        Ok(c) => c,
        Err(e) => fail(None, &e),
    };
    let console = match ctl::read_request(&conn) {
        Ok((Request::Boot { console_socket }, _)) => console_socket,
        _ => fail(Some(&conn), &"the first request must be boot"),
    };
    let (tx, rx) = mpsc::channel();
    let sup = match boot(&o, console, tx, host_cgroups.clone()) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            log::error!("{e}");
            fail(Some(&conn), &e)
        }
    };
    {
        let mut st = lock(&sup.state);
        st.status = "created".into();
        st.pid = std::process::id();
        if let Err(e) = st.save(&sup.root) {
            log::warn!("saving the state: {e}");
        }
    }
    let _ = ctl::write_reply(&conn, &Reply::default());
    drop(conn);
    {
        let sup = sup.clone();
        std::thread::spawn(move || {
            for note in rx {
                sup.note(note);
            }
        });
    }
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let sup = sup.clone();
        std::thread::spawn(move || sup.serve(conn));
    }
    std::process::exit(1);
}

fn boot(
    o: &Opts,
    console: Option<String>,
    tx: mpsc::Sender<Note>,
    host_cgroups: Vec<PathBuf>,
) -> Result<Sup, ContainerError> {
    let mut spec = Spec::load(&o.bundle)?;
    if spec.linux.seccomp.take().is_some() {
        // As Kata's default (disable_guest_seccomp): the VM is the boundary.
        log::warn!(
            "{}: the spec's seccomp filter is not applied in the guest",
            o.id
        );
    }
    let process = spec.process_in(&o.bundle)?;
    let root = spec.root_dir(&o.bundle);
    let dir = PodDir::new(crate::state::pod_dir(&o.root, &o.id));
    let agent_spec = dir.add(&spec, &o.id, &root)?;
    let cfg = match pod_config(o, &spec, &dir) {
        Ok(c) => c,
        Err(e) => {
            dir.destroy();
            return Err(e);
        }
    };
    let vm_mib = cfg
        .mem
        .as_deref()
        .and_then(|m| ember::backend::parse_mem_mib(m).ok())
        .unwrap_or(ember::container::pod::BASE_MEM_MIB);
    log::info!(
        "{}: booting its VM (mem {:?}, cpus {:?}, net {}, publish {:?})",
        o.id,
        cfg.mem,
        cfg.cpus,
        cfg.net,
        cfg.publish
    );
    let tx = Mutex::new(tx);
    let pod = match Pod::boot(&cfg, move |n| {
        let _ = lock(&tx).send(n);
    }) {
        Ok(p) => p,
        Err(e) => {
            dir.destroy();
            return Err(e);
        }
    };
    if let Err(e) = pod.create_container(agent_spec) {
        pod.shutdown();
        dir.destroy();
        return Err(e);
    }
    let tty = if process.terminal {
        match terminal(console) {
            Ok(s) => Some(s),
            Err(e) => {
                pod.shutdown();
                dir.destroy();
                return Err(e);
            }
        }
    } else {
        None
    };
    let state = State::load(&o.root, &o.id).ok_or_else(|| ContainerError::Spec {
        bundle: o.bundle.display().to_string(),
        why: format!("no state for {} under {}", o.id, o.root.display()),
    })?;
    Ok(Sup {
        root: o.root.clone(),
        id: o.id.clone(),
        spec,
        pod: Arc::new(pod),
        vm_mib,
        host_cgroups,
        dir,
        state: Mutex::new(state),
        tty,
        execs: Mutex::new(HashMap::new()),
        next: AtomicU32::new(INIT + 1),
        init_done: Arc::new(AtomicBool::new(false)),
        ending: AtomicBool::new(false),
    })
}

/// The pod VM's configuration for `spec`, with this supervisor's backend
/// and network.
fn pod_config(o: &Opts, spec: &Spec, dir: &PodDir) -> Result<PodConfig, ContainerError> {
    let net = ember::passt::GuestNet::from_host().is_ok();
    let publish = if net {
        published_ports(spec)
    } else {
        Vec::new()
    };
    Ok(PodConfig {
        backend: o.backend.clone(),
        // The supervisor lives in the container's namespace already:
        // passt there gives the guest its address and forwards its ports.
        netns: None,
        net,
        publish,
        ..PodConfig::for_spec(spec, dir, None, None)?
    })
}

/// The container's terminal: a pty whose master goes to the caller's
/// console socket; its slave is the container's stdio.
fn terminal(console: Option<String>) -> Result<OwnedFd, ContainerError> {
    let socket =
        console.ok_or_else(|| ContainerError::Agent("a terminal needs --console-socket".into()))?;
    let (master, slave) = fdpass::pty().map_err(ContainerError::io("openpty"))?;
    fdpass::send_console(&socket, &master)
        .map_err(ContainerError::io(format!("console socket {socket}")))?;
    Ok(slave)
}

/// The ports to forward from the container's network namespace into the
/// guest: Docker's published ones (its `hostconfig.json`, beside the
/// `/etc/hosts` it binds in) and the annotation's.
fn published_ports(spec: &Spec) -> Vec<String> {
    let mut ports: Vec<String> = Vec::new();
    let mut add = |p: &str| {
        let (port, proto) = p.split_once('/').unwrap_or((p, "tcp"));
        if port.parse::<u16>().is_ok_and(|n| n > 0) && matches!(proto, "tcp" | "udp") {
            let s = format!("{port}:{port}/{proto}");
            if !ports.contains(&s) {
                ports.push(s);
            }
        }
    };
    if let Some(a) = spec.annotations.get(PUBLISH_ANNOTATION) {
        a.split(',').map(str::trim).for_each(&mut add);
    }
    let hostconfig = spec
        .mounts
        .iter()
        .find(|m| m.destination == "/etc/hosts")
        .and_then(|m| {
            Path::new(&m.source)
                .parent()
                .map(|d| d.join(DOCKER_HOSTCONFIG))
        });
    if let Some(v) = hostconfig
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        && let Some(bindings) = v.get("PortBindings").and_then(|b| b.as_object())
    {
        bindings.keys().for_each(|k| add(k));
    }
    ports
}

impl Sup {
    fn save(&self, status: &str) {
        let mut st = lock(&self.state);
        st.status = status.into();
        if let Err(e) = st.save(&self.root) {
            log::warn!("saving the state: {e}");
        }
    }

    fn note(&self, note: Note) {
        match note {
            Note::Exited {
                handle: INIT,
                status,
            } => self.finish(status),
            Note::Exited { handle, status } => {
                if let Some(tx) = lock(&self.execs).remove(&handle) {
                    let _ = tx.send(status);
                }
            }
            Note::Oom { container } => {
                log::warn!("{container}: a process was killed for want of memory");
            }
            Note::Gone => {
                log::warn!("{}: the VM ended", self.id);
                self.finish(255)
            }
        }
    }

    /// The container ended: the VM goes, and so does this process, with
    /// the container's status.
    fn finish(&self, status: i32) {
        if self.ending.swap(true, Ordering::SeqCst) {
            return;
        }
        log::info!("{}: exited with {status}", self.id);
        self.init_done.store(true, Ordering::Relaxed);
        let _ = self.pod.destroy(&self.id);
        self.pod.shutdown();
        self.dir.destroy();
        hostcg::leave(&self.host_cgroups, Duration::from_secs(2));
        self.save("stopped");
        std::process::exit(status);
    }

    fn serve(&self, conn: UnixStream) {
        let (req, fds) = match ctl::read_request(&conn) {
            Ok(r) => r,
            Err(e) => {
                let _ = ctl::write_reply(&conn, &Reply::error(e));
                return;
            }
        };
        let reply = match req {
            Request::Boot { .. } => Err("booted already".to_owned()),
            Request::Start => match self.start() {
                Ok(pid) => Ok(Reply {
                    pid: Some(pid),
                    ..Default::default()
                }),
                Err((e, started)) => {
                    let _ = ctl::write_reply(&conn, &Reply::error(&e));
                    if started {
                        // Its process could not start: it "exits" as a
                        // runc init whose exec failed.
                        self.finish(127);
                    }
                    return;
                }
            },
            Request::Kill { signal, all } => {
                let created = lock(&self.state).status == "created";
                if created {
                    // Not started: its process "dies" of the signal.
                    let _ = ctl::write_reply(&conn, &Reply::default());
                    self.finish(128 + signal);
                    return;
                }
                if lock(&self.state).status == "paused" {
                    let _ = self.pod.resume(&self.id);
                    self.save("running");
                }
                self.pod
                    .signal(INIT, signal, all)
                    .map(|_| Reply::default())
                    .map_err(|e| e.to_string())
            }
            Request::Pids => Ok(Reply {
                pids: descendants(std::process::id()).into_iter().rev().collect(),
                ..Default::default()
            }),
            Request::Pause | Request::Resume => {
                let pause = matches!(req, Request::Pause);
                let want = if pause { "running" } else { "paused" };
                let status = lock(&self.state).status.clone();
                if status != want {
                    Err(format!("container {} is {status}, not {want}", self.id))
                } else {
                    let done = if pause {
                        self.pod.pause(&self.id)
                    } else {
                        self.pod.resume(&self.id)
                    };
                    done.map(|_| {
                        self.save(if pause { "paused" } else { "running" });
                        Reply::default()
                    })
                    .map_err(|e| e.to_string())
                }
            }
            Request::Exec { process } => {
                self.exec(&conn, &process, fds);
                return;
            }
            Request::Update { resources } => crate::resources::fits_vm(&resources, self.vm_mib)
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    log::info!("{}: update {resources:?}", self.id);
                    self.pod
                        .update(&self.id, resources)
                        .map_err(|e| e.to_string())
                })
                .map(|()| Reply::default()),
            Request::Stats => self
                .pod
                .stats(&self.id)
                .map(|s| Reply {
                    stats: Some(s),
                    ..Default::default()
                })
                .map_err(|e| e.to_string()),
        };
        let _ = ctl::write_reply(&conn, &reply.unwrap_or_else(Reply::error));
    }

    /// Starts the init; an error says whether the container was touched
    /// (then it is over).
    fn start(&self) -> Result<u32, (String, bool)> {
        let status = lock(&self.state).status.clone();
        if status != "created" {
            return Err((format!("cannot start a container that is {status}"), false));
        }
        let process = self.spec.process.clone().unwrap_or_default();
        let agent = process
            .to_agent(INIT, &self.id, true)
            .map_err(|e| (e.to_string(), false))?;
        let io = match &self.tty {
            Some(slave) => self.terminal_io(INIT, slave.as_raw_fd(), self.init_done.clone()),
            None => stdio_io([0, 1, 2], self.init_done.clone()),
        }
        .map_err(|e| (e.to_string(), false))?;
        // Running before the agent answers: the exit may come first.
        self.save("running");
        self.pod.start(agent, io).map_err(|e| {
            log::error!("{}: start: {e}", self.id);
            (e.to_string(), true)
        })
    }

    /// A terminal's io: the pty's slave both ways, and its size followed
    /// (the shim sizes the master) until `done`.
    fn terminal_io(
        &self,
        handle: u32,
        slave: RawFd,
        done: Arc<AtomicBool>,
    ) -> Result<ProcIo, ContainerError> {
        let watch = dup(slave)?;
        let pod = self.pod.clone();
        let stop = done.clone();
        std::thread::spawn(move || {
            let mut last = None;
            while !stop.load(Ordering::Relaxed) {
                let now = fdpass::window_size(watch.as_raw_fd());
                if now != last
                    && let Some((w, h)) = now
                    && pod.resize(handle, w, h).is_ok()
                {
                    last = now;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Ok(ProcIo {
            stdin: Some(Box::new(StopRead {
                fd: dup(slave)?,
                done,
            })),
            stdout: Some(sink(slave)?),
            stderr: None,
        })
    }

    fn exec(&self, conn: &UnixStream, process: &str, fds: Vec<OwnedFd>) {
        let fail = |e: String| {
            let _ = ctl::write_reply(conn, &Reply::error(e));
        };
        let process = match Process::parse(process.as_bytes()) {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        let done = Arc::new(AtomicBool::new(false));
        let io = match (process.terminal, fds.as_slice()) {
            (true, [slave]) => self.terminal_io(handle, slave.as_raw_fd(), done.clone()),
            (false, [i, o, e]) => {
                stdio_io([i.as_raw_fd(), o.as_raw_fd(), e.as_raw_fd()], done.clone())
            }
            _ => return fail(format!("exec: {} descriptors do not fit", fds.len())),
        };
        let io = match io {
            Ok(io) => io,
            Err(e) => return fail(e.to_string()),
        };
        drop(fds);
        let agent = match process.to_agent(handle, &self.id, true) {
            Ok(a) => a,
            Err(e) => return fail(e.to_string()),
        };
        let (tx, rx) = mpsc::channel();
        lock(&self.execs).insert(handle, tx);
        match self.pod.start(agent, io) {
            Ok(pid) => {
                let _ = ctl::write_reply(
                    conn,
                    &Reply {
                        pid: Some(pid),
                        ..Default::default()
                    },
                );
            }
            Err(e) => {
                lock(&self.execs).remove(&handle);
                done.store(true, Ordering::Relaxed);
                return fail(e.to_string());
            }
        }
        let status = rx.recv().unwrap_or(255);
        done.store(true, Ordering::Relaxed);
        let _ = ctl::write_reply(
            conn,
            &Reply {
                status: Some(status),
                ..Default::default()
            },
        );
    }
}

fn stdio_io(fds: [RawFd; 3], done: Arc<AtomicBool>) -> Result<ProcIo, ContainerError> {
    Ok(ProcIo {
        stdin: Some(Box::new(StopRead {
            fd: dup(fds[0])?,
            done,
        })),
        stdout: Some(sink(fds[1])?),
        stderr: Some(sink(fds[2])?),
    })
}
