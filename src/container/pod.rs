//! A pod: one VM running the guest agent, holding one or more containers.
//!
//! The VM is `ember run` on the host's root with the agent as its command,
//! which talks over `ember run`'s stdin and stdout (the appliance's
//! channel): on the QEMU backend a cold boot; on the ember backend the
//! appliance's snapshot (booted once per kernel, ember and share count,
//! then restored: no boot on the hot path). It is started from
//! a thread that lives as long as it does, because `PR_SET_PDEATHSIG` fires
//! when the spawning *thread* ends: so the VM goes when the shim dies
//! (SIGTERM: ember then stops its VMM and virtiofsd itself), and not before.

use super::agent::{AgentClient, Note, Sink};
use super::spec::Spec;
use super::{ContainerError, GUEST_ROOTS, companion, rootfs};
use ember_agent::{ContainerSpec, Handle, ProcessSpec, Request, Resources, Response, Stats};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// An answer that does not fit the request.
fn unexpected(answer: Response) -> ContainerError {
    ContainerError::Agent(format!("unexpected answer {answer:?}"))
}

/// How many lines of ember's stderr are kept for error messages.
const STDERR_TAIL: usize = 12;

/// A host directory the guest sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The host directory.
    pub host: PathBuf,
    /// Where the guest sees it.
    pub guest: String,
}

/// How the pod's VM is made.
#[derive(Debug, Clone, Default)]
pub struct PodConfig {
    /// `ember run --backend` (default: ember's own choice).
    pub backend: Option<String>,
    /// `ember run --kernel` (default: the one `ember setup` fetched). On
    /// the ember backend the VM is restored from the appliance's snapshot
    /// of this kernel (made by the first pod that boots it), not booted.
    pub kernel: Option<PathBuf>,
    /// `ember run --cmdline`: extra kernel arguments (a kernel that needs
    /// its own, as this workplace's PVM test kernel does).
    pub cmdline: Option<String>,
    /// `--mem`.
    pub mem: Option<String>,
    /// `--cpus`.
    pub cpus: Option<u32>,
    /// Writable shares (containers' roots).
    pub shares: Vec<Share>,
    /// How long the boot may take until the agent answers.
    pub boot_timeout: Option<Duration>,
    /// The pod's network namespace, whose interface the VM takes.
    pub netns: Option<PathBuf>,
    /// A network (`ember run --net`: passt, configured as the caller's
    /// network namespace is).
    pub net: bool,
    /// Ports forwarded from the caller's network namespace into the guest
    /// (`ember run --publish`), which imply `net`.
    pub publish: Vec<String>,
}

/// The memory a pod's VM has besides its containers' limits (the guest's
/// kernel and agent live in it): ember's default `--mem`.
pub const BASE_MEM_MIB: u64 = 256;

impl PodConfig {
    /// The VM for a pod whose first container is `spec`, sharing `dir`
    /// with the guest: its memory limit on top of `base_mem` (`--mem`
    /// syntax; [`BASE_MEM_MIB`] if none), as many vCPUs as its CPU quota
    /// asks (else `cpus`), the spec's network namespace. The caller picks
    /// the backend and any other network.
    pub fn for_spec(
        spec: &Spec,
        dir: &PodDir,
        base_mem: Option<&str>,
        cpus: Option<u32>,
    ) -> Result<PodConfig, ContainerError> {
        let res = spec.linux.resources.as_ref();
        let mem = match res.and_then(|r| r.memory_limit()) {
            Some(limit) => {
                let base = match base_mem {
                    Some(b) => crate::backend::parse_mem_mib(b).map_err(|e| {
                        ContainerError::NotImplemented(format!("a base memory of {b}: {e}"))
                    })?,
                    None => BASE_MEM_MIB,
                };
                Some(format!("{}M", base + limit.div_ceil(1 << 20)))
            }
            None => base_mem.map(str::to_owned),
        };
        Ok(PodConfig {
            mem,
            cpus: res.and_then(|r| r.vcpus()).or(cpus),
            shares: vec![Share {
                host: dir.path().to_path_buf(),
                guest: GUEST_ROOTS.into(),
            }],
            netns: spec.network_namespace(),
            ..Default::default()
        })
    }
}

/// A pod's shared directory on the host, which the guest sees at
/// [`GUEST_ROOTS`]: each container's root is bound at `ID` in it, the
/// sources of its bind mounts at `ID.binds/N`, so containers join a running
/// VM (whose shares are fixed at its boot) and a bind mount shares its
/// source only, read-only if asked.
#[derive(Debug, Clone)]
pub struct PodDir(PathBuf);

impl PodDir {
    /// The directory at `path` (made by [`PodDir::add`]).
    pub fn new(path: impl Into<PathBuf>) -> PodDir {
        PodDir(path.into())
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Brings container `id` (its root at `root` on the host) into the
    /// directory; the agent's description of it, as the guest sees it.
    /// What was mounted is undone on an error.
    pub fn add(&self, spec: &Spec, id: &str, root: &Path) -> Result<ContainerSpec, ContainerError> {
        let made = (|| {
            rootfs::bind(root, &self.0.join(id), false)?;
            let mut guest_binds = Vec::new();
            for (i, b) in spec.host_binds().iter().enumerate() {
                let at = self.0.join(format!("{id}.binds")).join(i.to_string());
                rootfs::bind(&b.source, &at, b.readonly)?;
                guest_binds.push(format!("{GUEST_ROOTS}/{id}.binds/{i}"));
            }
            spec.container(id, &format!("{GUEST_ROOTS}/{id}"), &guest_binds)
        })();
        if made.is_err() {
            self.remove(id);
        }
        made
    }

    /// Undoes [`PodDir::add`] (also for a process that died after it).
    pub fn remove(&self, id: &str) {
        let binds = self.0.join(format!("{id}.binds"));
        rootfs::unmount_under(&binds);
        rootfs::unmount_under(&self.0.join(id));
        if !rootfs::is_mounted_under(&binds) {
            let _ = std::fs::remove_dir_all(&binds);
        }
        let _ = std::fs::remove_dir(self.0.join(id));
    }

    /// Unmounts everything in the directory and removes it.
    pub fn destroy(&self) {
        rootfs::unmount_under(&self.0);
        if !rootfs::is_mounted_under(&self.0) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// What a process's stdio is wired to.
#[derive(Default)]
pub struct ProcIo {
    /// Its stdin's source (pumped to the guest until EOF).
    pub stdin: Option<Box<dyn Read + Send>>,
    /// Where its stdout (or terminal) goes.
    pub stdout: Option<Sink>,
    /// Where its stderr goes.
    pub stderr: Option<Sink>,
}

struct VmExit {
    status: Mutex<Option<i32>>,
    cv: Condvar,
}

/// A running pod VM and its agent.
pub struct Pod {
    client: Arc<AgentClient>,
    /// Stdin pumps still running, by process: each signals when it is done.
    pumps: Mutex<std::collections::HashMap<Handle, std::sync::mpsc::Receiver<()>>>,
    vm_pid: u32,
    exit: Arc<VmExit>,
    kernel_release: String,
}

impl Pod {
    /// Boots the VM and waits for its agent; `notes` gets the agent's news.
    pub fn boot(
        cfg: &PodConfig,
        notes: impl Fn(Note) + Send + 'static,
    ) -> Result<Pod, ContainerError> {
        let ember = companion("ember", "EMBER_BIN")?;
        let agent = companion("ember-agent", "EMBER_AGENT")?;
        let cmd = vm_command(cfg, &ember, &agent);
        log::info!("booting the pod VM: {cmd:?}");
        let exit = Arc::new(VmExit {
            status: Mutex::new(None),
            cv: Condvar::new(),
        });
        let (vm_pid, stdin, stdout, stderr) = spawn_vm(cmd, exit.clone())?
            .map_err(ContainerError::io(format!("start {}", ember.display())))?;
        let (Some(stdin), Some(stdout), Some(stderr)) = (stdin, stdout, stderr) else {
            return Err(ContainerError::AgentGone);
        };
        let tail = stderr_tail(stderr);
        let client = Arc::new(AgentClient::new(
            Box::new(stdout),
            Box::new(stdin),
            Duration::from_secs(60),
            notes,
        ));
        let boot_timeout = cfg.boot_timeout.unwrap_or(Duration::from_secs(300));
        let started = Instant::now();
        let hello = client.request_within(Request::Hello, boot_timeout);
        let pod = Pod {
            client,
            pumps: Mutex::new(std::collections::HashMap::new()),
            vm_pid,
            exit,
            kernel_release: String::new(),
        };
        match hello {
            Ok(Response::Hello { kernel_release, .. }) => {
                super::stage("shim_agent_hello");
                log::info!(
                    "the pod VM's agent answered after {} ms (guest kernel {kernel_release})",
                    started.elapsed().as_millis()
                );
                Ok(Pod {
                    kernel_release,
                    ..pod
                })
            }
            Ok(other) => {
                pod.kill();
                Err(unexpected(other))
            }
            Err(e) => {
                pod.kill();
                // What ember said is the reason (a missing kernel, virtiofsd…).
                pod.wait_exit(Duration::from_secs(5));
                std::thread::sleep(Duration::from_millis(100));
                let t = tail.lock().unwrap_or_else(|p| p.into_inner());
                let said: Vec<&str> = t.iter().map(String::as_str).collect();
                Err(ContainerError::Agent(format!(
                    "the pod VM did not start ({e}){}{}",
                    if said.is_empty() { "" } else { ": " },
                    said.join(" | ")
                )))
            }
        }
    }

    /// The VM's process (ember) on the host.
    pub fn pid(&self) -> u32 {
        self.vm_pid
    }

    /// The guest kernel's release.
    pub fn kernel_release(&self) -> &str {
        &self.kernel_release
    }

    /// Sets a container up in the guest.
    pub fn create_container(&self, spec: ContainerSpec) -> Result<(), ContainerError> {
        self.client
            .request(Request::CreateContainer(spec))
            .map(drop)
    }

    /// Starts a process; returns its guest pid. Its stdin is pumped from
    /// `io.stdin` (until EOF) by a thread of its own.
    pub fn start(&self, spec: ProcessSpec, io: ProcIo) -> Result<u32, ContainerError> {
        let handle = spec.handle;
        self.client.attach(handle, io.stdout, io.stderr);
        let pid = match self.client.request(Request::Start(spec))? {
            Response::Started { pid } => pid,
            other => return Err(unexpected(other)),
        };
        if let Some(mut src) = io.stdin {
            let client = self.client.clone();
            let (done, pumped) = std::sync::mpsc::channel();
            self.pumps
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(handle, pumped);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; ember_agent::DATA_CHUNK];
                loop {
                    match src.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if client.stdin(handle, &buf[..n]).is_err() {
                                return;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                let _ = client.close_stdin(handle);
                let _ = done.send(());
            });
        }
        Ok(pid)
    }

    /// Ends a process's stdin. What its pump has still to copy goes
    /// first: containerd asks right after writing the last bytes into the
    /// FIFO, which the pump may not have read yet (it ends with the
    /// writer's close, and sends the end itself). A writer that never
    /// closes is given a moment only.
    pub fn close_stdin(&self, handle: Handle) -> Result<(), ContainerError> {
        let pump = self
            .pumps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&handle);
        if let Some(done) = pump {
            let _ = done.recv_timeout(Duration::from_secs(2));
        }
        self.client.close_stdin(handle)
    }

    /// Sends `signal` to a process (or all of its container's).
    pub fn signal(&self, handle: Handle, signal: i32, all: bool) -> Result<(), ContainerError> {
        self.client
            .request(Request::Signal {
                handle,
                signal,
                all,
            })
            .map(drop)
    }

    /// Sizes a process's terminal.
    pub fn resize(&self, handle: Handle, width: u16, height: u16) -> Result<(), ContainerError> {
        self.client
            .request(Request::Resize {
                handle,
                width,
                height,
            })
            .map(drop)
    }

    /// The guest pids of a container's processes.
    pub fn pids(&self, container: &str) -> Result<Vec<u32>, ContainerError> {
        match self.client.request(Request::Pids {
            container: container.to_owned(),
        })? {
            Response::Pids(p) => Ok(p),
            other => Err(unexpected(other)),
        }
    }

    /// Freezes every process of a container (its cgroup's freezer in the guest).
    pub fn pause(&self, container: &str) -> Result<(), ContainerError> {
        self.client
            .request(Request::Pause {
                container: container.to_owned(),
            })
            .map(drop)
    }

    /// Thaws a paused container.
    pub fn resume(&self, container: &str) -> Result<(), ContainerError> {
        self.client
            .request(Request::Resume {
                container: container.to_owned(),
            })
            .map(drop)
    }

    /// A container's figures, from its cgroup in the guest.
    pub fn stats(&self, container: &str) -> Result<Stats, ContainerError> {
        match self.client.request(Request::Stats {
            container: container.to_owned(),
        })? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Changes a container's cgroup limits in the guest.
    pub fn update(&self, container: &str, resources: Resources) -> Result<(), ContainerError> {
        self.client
            .request(Request::Update {
                container: container.to_owned(),
                resources,
            })
            .map(drop)
    }

    /// Kills what is left of a container and undoes its guest mounts.
    pub fn destroy(&self, container: &str) -> Result<(), ContainerError> {
        self.client
            .request(Request::Destroy {
                container: container.to_owned(),
            })
            .map(drop)
    }

    /// Whether the VM has ended.
    pub fn has_ended(&self) -> bool {
        self.exit
            .status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.exit.status.lock().unwrap_or_else(|p| p.into_inner());
        while st.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .exit
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    fn kill(&self) {
        if !self.has_ended() {
            // SAFETY: kill has no memory effects; the pid is our child's,
            // not reaped while has_ended is false.
            unsafe { libc::kill(self.vm_pid as i32, libc::SIGTERM) };
        }
    }

    /// Stops the VM: the agent is asked to end (the guest then powers off),
    /// ember is sent SIGTERM if that takes too long, SIGKILL after that.
    pub fn shutdown(&self) {
        if !self.client.is_gone() {
            let _ = self
                .client
                .request_within(Request::Shutdown, Duration::from_secs(10));
        }
        if self.wait_exit(Duration::from_secs(30)) {
            return;
        }
        self.kill();
        if !self.wait_exit(Duration::from_secs(10)) && !self.has_ended() {
            // SAFETY: as in kill.
            unsafe { libc::kill(self.vm_pid as i32, libc::SIGKILL) };
            self.wait_exit(Duration::from_secs(10));
        }
    }
}

/// `ember run … -- ember-agent` for the pod's VM, its stdio piped (the
/// agent's channel and ember's messages), ended with the shim.
fn vm_command(cfg: &PodConfig, ember: &Path, agent: &Path) -> Command {
    let mut cmd = Command::new(ember);
    cmd.arg("run");
    if let Some(b) = &cfg.backend {
        cmd.args(["--backend", b]);
    }
    if let Some(k) = &cfg.kernel {
        cmd.arg("--kernel").arg(k);
    }
    if let Some(c) = &cfg.cmdline {
        cmd.args(["--cmdline", c]);
    }
    if let Some(m) = &cfg.mem {
        cmd.args(["--mem", m]);
    }
    if let Some(c) = cfg.cpus {
        cmd.args(["--cpus", &c.to_string()]);
    }
    if let Some(ns) = &cfg.netns {
        cmd.arg("--netns").arg(ns);
    }
    if cfg.net && cfg.publish.is_empty() {
        cmd.arg("--net");
    }
    for p in &cfg.publish {
        cmd.args(["--publish", p]);
    }
    for s in &cfg.shares {
        cmd.arg("--share")
            .arg(format!("{}:{},rw", s.host.display(), s.guest));
    }
    cmd.args(["--workdir", "/", "--"]).arg(agent);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: prctl in the forked child touches no memory.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// The VM's pid and its stdin, stdout and stderr.
type VmIo = (
    u32,
    Option<std::process::ChildStdin>,
    Option<std::process::ChildStdout>,
    Option<std::process::ChildStderr>,
);

/// Spawns the VM on a thread of its own, which waits for it and posts its
/// status in `exit`; the spawn's result once it is known.
fn spawn_vm(mut cmd: Command, exit: Arc<VmExit>) -> Result<std::io::Result<VmIo>, ContainerError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("ember-vm".into())
        .spawn(move || {
            super::stage("shim_spawn_vm");
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let io = (
                child.id(),
                child.stdin.take(),
                child.stdout.take(),
                child.stderr.take(),
            );
            let _ = tx.send(Ok(io));
            let code = match child.wait() {
                Ok(s) => s.code().unwrap_or(-1),
                Err(_) => -1,
            };
            log::info!("the pod VM ended with status {code}");
            *exit.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
            exit.cv.notify_all();
        })
        .map_err(ContainerError::io("a thread for the VM"))?;
    rx.recv().map_err(|_| ContainerError::AgentGone)
}

/// Logs ember's stderr on a thread, keeping its last lines for the error
/// of a boot that fails.
fn stderr_tail(stderr: std::process::ChildStderr) -> Arc<Mutex<VecDeque<String>>> {
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let kept = tail.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            log::info!("vm: {line}");
            let mut t = kept.lock().unwrap_or_else(|p| p.into_inner());
            if t.len() == STDERR_TAIL {
                t.pop_front();
            }
            t.push_back(line);
        }
    });
    tail
}

/// `pid` and every process below it, deepest first.
pub fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|p| {
                    let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
                    let ppid = stat
                        .rsplit(')')
                        .next()?
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()?;
                    Some((p, ppid))
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_vm_is_sized_by_its_first_containers_limits() {
        let dir = PodDir::new("/b/pod");
        let spec = Spec::parse(
            br#"{"linux": {"resources": {"memory": {"limit": 314572800}, "cpu": {"quota": 150000, "period": 100000}},
                           "namespaces": [{"type": "network", "path": "/var/run/netns/x"}]}}"#,
        )
        .unwrap();
        let cfg = PodConfig::for_spec(&spec, &dir, None, Some(4)).unwrap();
        // The limit on top of the base, the quota's vCPUs rounded up.
        assert_eq!(cfg.mem.as_deref(), Some("556M"));
        assert_eq!(cfg.cpus, Some(2));
        assert_eq!(
            cfg.shares,
            [Share {
                host: "/b/pod".into(),
                guest: GUEST_ROOTS.into()
            }]
        );
        assert_eq!(cfg.netns, Some(PathBuf::from("/var/run/netns/x")));
        let cfg = PodConfig::for_spec(&spec, &dir, Some("1G"), None).unwrap();
        assert_eq!(cfg.mem.as_deref(), Some("1324M"));
        // No limits: the base as given (ember's default if none), the
        // caller's vCPUs.
        let none = Spec::default();
        let cfg = PodConfig::for_spec(&none, &dir, Some("512M"), Some(3)).unwrap();
        assert_eq!((cfg.mem.as_deref(), cfg.cpus), (Some("512M"), Some(3)));
        let cfg = PodConfig::for_spec(&none, &dir, None, None).unwrap();
        assert_eq!((cfg.mem, cfg.cpus, cfg.netns), (None, None, None));
        assert!(PodConfig::for_spec(&spec, &dir, Some("lots"), None).is_err());
    }
}
