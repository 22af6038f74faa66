//! containerd-shim-ember-v2: containerd's runtime v2 shim for ember
//! (`ctr run --runtime io.containerd.ember.v2`). Each container runs in an
//! ember VM: the shim mounts containerd's snapshot at the bundle's rootfs,
//! boots the VM with that directory shared over virtio-fs and the guest
//! agent as its command ([`ember::container`]), and maps the task service
//! onto the agent's requests. Events (create, start, exec, exit, delete)
//! are published to containerd.
//!
//! The `start` and `delete` subcommands and the ttrpc server come from the
//! `containerd-shim` crate (its synchronous flavour); its reaper is off,
//! because the VM's process is waited for by the thread that started it.

use containerd_shim as shim;
use containerd_shim::protos::cgroups_v2::metrics::{
    CPUStat, MemoryEvents, MemoryStat, Metrics, PidsStat,
};
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::{EnumOrUnknown, Message, MessageDyn, MessageField};
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::protos::types::task::ProcessInfo;
use ember::container::agent::{Note, Sink};
use ember::container::pod::{Pod, PodConfig, PodDir, ProcIo};
use ember::container::rootfs::{self, RootMount};
use ember::container::spec::{LinuxResources, Process, Spec};
use ember::container::{ContainerError, rootfs::is_mounted};
use ember_agent::Stats;
use shim::api::{self, Status};
use shim::publisher::RemotePublisher;
use shim::{Config, DeleteResponse, ExitSignal, Flags, TtrpcContext, TtrpcResult};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::SystemTime;

/// containerd's name for this runtime.
const RUNTIME_ID: &str = "io.containerd.ember.v2";
/// The type containerd's `ctr task metrics` decodes cgroup v2 figures as.
const METRICS_TYPE: &str = "io.containerd.cgroups.v2.Metrics";

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let flags = shim::parse(&args[1..]).ok();
    let served = match flags.as_ref().map(|f| f.action.as_str()) {
        // The crate answers `start` in the JSON that containerd 1.7 and
        // later read; 1.6 (Debian's) wants the bare address.
        Some("start") => flags.as_ref().map(|f| {
            start(f).map(|address| {
                print!("{address}");
            })
        }),
        // The crate serves only the v3 task API (containerd 2); 1.6 calls v2.
        Some("") if flags.as_ref().is_some_and(|f| !f.info && !f.version) => {
            flags.as_ref().map(serve)
        }
        _ => None,
    };
    match served {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            eprintln!("{RUNTIME_ID}: {e}");
            std::process::exit(1);
        }
        // `delete`, `-info`, `-v`: the crate's own handling.
        None => shim::run::<Service>(
            RUNTIME_ID,
            Some(Config {
                no_reaper: true,
                no_sub_reaper: true,
                ..Default::default()
            }),
        ),
    }
}

/// The shim's server: the task service over ttrpc on `flags.socket`, under
/// both the v2 (containerd 1.x) and v3 (containerd 2) names, until
/// containerd's `Shutdown`.
fn serve(flags: &Flags) -> Result<(), shim::Error> {
    use shim::Shim as _;
    use std::os::fd::IntoRawFd;
    if flags.namespace.is_empty() || flags.socket.is_empty() {
        return Err(shim::Error::InvalidArgument(
            "a namespace and a socket are needed".into(),
        ));
    }
    let mut service = Service::new(RUNTIME_ID, flags, &mut Config::default());
    shim::logger::init(flags.debug, "info", &flags.namespace, &flags.id)?;
    let ttrpc_address = std::env::var("TTRPC_ADDRESS")
        .map_err(|_| shim::Error::InvalidArgument("no TTRPC_ADDRESS".into()))?;
    let publisher = RemotePublisher::new(&ttrpc_address)?;
    let task: Arc<dyn shim::Task + Send + Sync> = Arc::new(service.create_task_service(publisher));
    let mut methods = HashMap::new();
    for (name, handler) in containerd_shim::protos::create_task(task.clone()) {
        methods.insert(
            name.replace("/containerd.task.v3.", "/containerd.task.v2."),
            handler,
        );
    }
    methods.extend(containerd_shim::protos::create_task(task));
    let path = flags
        .socket
        .strip_prefix("unix://")
        .unwrap_or(&flags.socket);
    if let Some(dir) = Path::new(path).parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| shim::Error::Other(format!("mkdir {}: {e}", dir.display())))?;
    }
    let _ = std::fs::remove_file(path);
    let listener = std::os::unix::net::UnixListener::bind(path)
        .map_err(|e| shim::Error::Other(format!("listen on {path}: {e}")))?;
    let mut server = ttrpc::Server::new()
        .add_listener(listener.into_raw_fd())?
        .register_service(methods);
    server.start()?;
    // The `start` process reads our stdout until it closes: now.
    // SAFETY: dup2 on the process's own standard descriptors.
    unsafe { libc::dup2(2, 1) };
    log::info!("serving {} on {path}", flags.id);
    service.wait();
    server.shutdown();
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// The `start` action: starts the shim's server process (this binary
/// again, without an action) and returns its socket's address. A
/// container of a pod whose sandbox's shim serves already gets that
/// shim's address (as Kata groups a pod: by the CRI sandbox id
/// annotation in the bundle's config.json, the working directory), so
/// it is made in the same VM.
fn start(flags: &Flags) -> Result<String, shim::Error> {
    let opts = shim::StartOpts {
        id: flags.id.clone(),
        publish_binary: flags.publish_binary.clone(),
        address: flags.address.clone(),
        ttrpc_address: std::env::var("TTRPC_ADDRESS").unwrap_or_default(),
        namespace: flags.namespace.clone(),
        debug: flags.debug,
        log_level: Default::default(),
        containerd_version: String::new(),
        socket_dir: None,
        extensions: Vec::new(),
    };
    let spec = Spec::load(Path::new(".")).ok();
    let grouping = spec
        .as_ref()
        .and_then(sandbox_of)
        .unwrap_or(&flags.id)
        .to_owned();
    if grouping != flags.id {
        let address = opts.socket_address(&grouping);
        let path = address.strip_prefix("unix://").unwrap_or(&address);
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            shim::util::write_address(&address)?;
            return Ok(address);
        }
    }
    let (_pid, address) = shim::spawn(opts, &grouping, Vec::new())?;
    shim::util::write_address(&address)?;
    Ok(address)
}

fn now() -> Timestamp {
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

fn rpc(code: Code, msg: impl std::fmt::Display) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg.to_string()))
}

fn internal(e: ContainerError) -> ttrpc::Error {
    let code = match e {
        ContainerError::NotImplemented(_) => Code::UNIMPLEMENTED,
        _ => Code::INTERNAL,
    };
    rpc(code, e)
}

fn not_implemented(what: &str) -> ttrpc::Error {
    rpc(Code::UNIMPLEMENTED, format!("not implemented: {what}"))
}

fn no_container(id: &str) -> ttrpc::Error {
    rpc(Code::NOT_FOUND, format!("container {id} not found"))
}

/// The process `exec_id` of `c` ("" is its init), or containerd's NOT_FOUND.
fn proc_of<'a>(c: &'a mut Container, exec_id: &str) -> TtrpcResult<&'a mut Proc> {
    c.procs
        .get_mut(exec_id)
        .ok_or_else(|| rpc(Code::NOT_FOUND, format!("process {exec_id} not found")))
}

/// A process of the container: its init (exec id "") or an exec.
struct Proc {
    handle: u32,
    /// Guest pid once started.
    pid: u32,
    status: Status,
    exit: Option<(u32, Timestamp)>,
    stdin: String,
    stdout: String,
    stderr: String,
    terminal: bool,
    /// An exec's process spec, until it starts.
    spec: Option<Process>,
}

impl Proc {
    fn new(handle: u32, stdin: &str, stdout: &str, stderr: &str, terminal: bool) -> Proc {
        Proc {
            handle,
            pid: 0,
            status: Status::CREATED,
            exit: None,
            stdin: stdin.to_owned(),
            stdout: stdout.to_owned(),
            stderr: stderr.to_owned(),
            terminal,
            spec: None,
        }
    }
}

struct Container {
    id: String,
    bundle: PathBuf,
    /// Where the snapshot is mounted (unmounted on delete), if the shim mounted it.
    rootfs: Option<PathBuf>,
    /// The pod's shared directory, where its root and bind mounts'
    /// sources are mounted: unmounted on delete.
    dir: PodDir,
    pod: Arc<Pod>,
    init_spec: Process,
    procs: HashMap<String, Proc>,
    paused: bool,
}

/// The pod's VM: made by the first container's create, joined by the
/// others of its sandbox, stopped when the last one is deleted.
struct PodVm {
    pod: Arc<Pod>,
    /// The host directory shared into the guest.
    dir: PodDir,
}

#[derive(Default)]
struct State {
    containers: HashMap<String, Container>,
    vm: Option<PodVm>,
    next_handle: u32,
}

struct Inner {
    exit: Arc<ExitSignal>,
    namespace: String,
    publisher: Mutex<Option<RemotePublisher>>,
    state: Mutex<State>,
    changed: Condvar,
    /// Creates one at a time: a pod's VM is booted once.
    creating: Mutex<()>,
}

#[derive(Clone)]
struct Service(Arc<Inner>);

impl Inner {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let p = self.publisher.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = p.as_ref()
            && let Err(e) = p.publish(shim::Context::default(), topic, &self.namespace, event)
        {
            log::warn!("publish {topic}: {e}");
        }
    }

    /// The agent's news: a process exited, an OOM kill, or the VM is gone.
    fn note(&self, note: Note) {
        if let Note::Oom { container } = &note {
            log::info!("{container}: the guest's OOM killer struck");
            self.publish(
                topics::TASK_OOM_EVENT_TOPIC,
                Box::new(TaskOOM {
                    container_id: container.clone(),
                    ..Default::default()
                }),
            );
            return;
        }
        let mut exits = Vec::new();
        {
            let mut st = self.state();
            for c in st.containers.values_mut() {
                for (exec_id, p) in c.procs.iter_mut() {
                    let status = match note {
                        Note::Exited { handle, status } if handle == p.handle => status as u32,
                        // A VM that ended took its processes with it.
                        Note::Gone if p.status == Status::RUNNING => 255,
                        _ => continue,
                    };
                    if p.status == Status::STOPPED {
                        continue;
                    }
                    let at = now();
                    p.status = Status::STOPPED;
                    p.exit = Some((status, at.clone()));
                    exits.push(TaskExit {
                        container_id: c.id.clone(),
                        id: if exec_id.is_empty() {
                            c.id.clone()
                        } else {
                            exec_id.clone()
                        },
                        pid: p.pid,
                        exit_status: status,
                        exited_at: MessageField::some(at),
                        ..Default::default()
                    });
                }
            }
        }
        self.changed.notify_all();
        for e in exits {
            log::info!("{} exited with {}", e.id, e.exit_status);
            self.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(e));
        }
    }
}

impl shim::Shim for Service {
    type T = Service;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Service(Arc::new(Inner {
            exit: Arc::new(ExitSignal::default()),
            namespace: args.namespace.clone(),
            publisher: Mutex::new(None),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            creating: Mutex::new(()),
        }))
    }

    fn start_shim(&mut self, opts: shim::StartOpts) -> Result<String, shim::Error> {
        let grouping = opts.id.clone();
        let (_pid, address) = shim::spawn(opts, &grouping, Vec::new())?;
        shim::util::write_address(&address)?;
        Ok(address)
    }

    /// containerd's cleanup after a shim that died: the VM went with it
    /// (its parent-death signal); the snapshot mount in the bundle (the
    /// working directory) and what was mounted for the container in its
    /// pod's shared directory are all that is left.
    fn delete_shim(&mut self) -> Result<DeleteResponse, shim::Error> {
        let cwd = std::env::current_dir().unwrap_or_default();
        let rootfs = cwd.join("rootfs");
        if rootfs::unmount_all(&rootfs) {
            log::info!("unmounted {}", rootfs.display());
        }
        let id = cwd
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let sandbox = Spec::load(&cwd)
            .ok()
            .and_then(|s| sandbox_of(&s).map(str::to_owned))
            .unwrap_or_else(|| id.clone());
        let dir = PodDir::new(pod_dir(&cwd, &sandbox));
        if sandbox == id {
            dir.destroy();
        } else {
            dir.remove(&id);
        }
        // The dead server's socket.
        if let Ok(address) = std::fs::read_to_string(cwd.join("address"))
            && let Some(path) = address.trim().strip_prefix("unix://")
        {
            let _ = std::fs::remove_file(path);
        }
        Ok(DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(now()),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.0.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        *self.0.publisher.lock().unwrap_or_else(|p| p.into_inner()) = Some(publisher);
        self.clone()
    }
}

/// The CRI annotations that group a pod's containers into one shim and VM.
const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// The sandbox a container joins: its sandbox id annotation, unless it is
/// the sandbox itself.
fn sandbox_of(spec: &Spec) -> Option<&str> {
    let id = spec.annotation(SANDBOX_ID).filter(|s| !s.is_empty())?;
    (spec.annotation(CONTAINER_TYPE) != Some("sandbox")).then_some(id)
}

/// A pod's shared directory, in its sandbox's bundle (a sibling of every
/// one of its containers' bundles).
fn pod_dir(bundle: &Path, sandbox: &str) -> PathBuf {
    bundle.with_file_name(sandbox).join("pod")
}

/// Opens a FIFO containerd made for output. Read-write, so the open does
/// not wait for a reader (containerd's may not be open yet) and never fails
/// for want of one.
fn open_output(path: &str) -> Result<Option<Sink>, ContainerError> {
    if path.is_empty() {
        return Ok(None);
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(ContainerError::io(format!("open {path}")))?;
    Ok(Some(Box::new(f)))
}

/// containerd's stdin FIFO, opened on the first read: the open waits for
/// its writer, which must not hold up the start.
struct LazyFifo {
    path: String,
    file: Option<File>,
}

impl Read for LazyFifo {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.file.is_none() {
            self.file = Some(File::open(&self.path)?);
        }
        match self.file.as_mut() {
            Some(f) => f.read(buf),
            None => Ok(0),
        }
    }
}

impl Service {
    fn with_container<R>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Container) -> TtrpcResult<R>,
    ) -> TtrpcResult<R> {
        let mut st = self.0.state();
        match st.containers.get_mut(id) {
            Some(c) => f(c),
            None => Err(no_container(id)),
        }
    }

    /// A process's pod and handle.
    fn target(&self, id: &str, exec_id: &str) -> TtrpcResult<(Arc<Pod>, u32)> {
        self.with_container(id, |c| {
            let pod = c.pod.clone();
            proc_of(c, exec_id).map(|p| (pod, p.handle))
        })
    }

    /// A container's pod.
    fn pod_of(&self, id: &str) -> TtrpcResult<Arc<Pod>> {
        self.with_container(id, |c| Ok(c.pod.clone()))
    }

    fn do_create(&self, req: &api::CreateTaskRequest) -> Result<(Container, u32), ContainerError> {
        if !req.checkpoint.is_empty() {
            return Err(ContainerError::NotImplemented(
                "restoring a checkpoint".into(),
            ));
        }
        let bundle = PathBuf::from(&req.bundle);
        let spec = Spec::load(&bundle)?;
        let process = spec.process_in(&bundle)?;
        let root = spec.root_dir(&bundle);
        let mounted = mount_rootfs(req, &root)?;
        let existing = {
            let st = self.0.state();
            st.vm.as_ref().map(|v| (v.pod.clone(), v.dir.clone()))
        };
        let dir = match &existing {
            Some((_, dir)) => dir.clone(),
            None => PodDir::new(bundle.join("pod")),
        };
        let made = (|| {
            if let Some((pod, _)) = &existing
                && pod.has_ended()
            {
                return Err(ContainerError::AgentGone);
            }
            let agent_spec = dir.add(&spec, &req.id, &root)?;
            ember::container::stage("shim_pod_dir");
            let pod = match &existing {
                Some((pod, _)) => pod.clone(),
                None => {
                    let cfg = pod_config(&spec, &dir)?;
                    let weak: Weak<Inner> = Arc::downgrade(&self.0);
                    Arc::new(Pod::boot(&cfg, move |n| {
                        if let Some(inner) = weak.upgrade() {
                            inner.note(n);
                        }
                    })?)
                }
            };
            if let Err(e) = pod.create_container(agent_spec) {
                if existing.is_none() {
                    pod.shutdown();
                }
                return Err(e);
            }
            Ok(pod)
        })();
        let pod = match made {
            Ok(p) => p,
            Err(e) => {
                dir.remove(&req.id);
                if existing.is_none() {
                    dir.destroy();
                }
                if let Some(r) = &mounted {
                    rootfs::unmount_all(r);
                }
                return Err(e);
            }
        };
        if existing.is_none() {
            self.0.state().vm = Some(PodVm {
                pod: pod.clone(),
                dir: dir.clone(),
            });
        } else {
            log::info!("{} joins the pod's VM", req.id);
        }
        let pid = pod.pid();
        Ok((
            Container {
                id: req.id.clone(),
                bundle,
                rootfs: mounted,
                dir,
                pod,
                init_spec: process,
                procs: HashMap::new(),
                paused: false,
            },
            pid,
        ))
    }

    /// Marks the container paused or running, and says so to containerd.
    fn set_paused(&self, id: &str, paused: bool) -> TtrpcResult<()> {
        self.with_container(id, |c| {
            c.paused = paused;
            for p in c.procs.values_mut() {
                match (paused, p.status) {
                    (true, Status::RUNNING) => p.status = Status::PAUSED,
                    (false, Status::PAUSED) => p.status = Status::RUNNING,
                    _ => {}
                }
            }
            Ok(())
        })?;
        if paused {
            self.0.publish(
                topics::TASK_PAUSED_EVENT_TOPIC,
                Box::new(TaskPaused {
                    container_id: id.to_owned(),
                    ..Default::default()
                }),
            );
        } else {
            self.0.publish(
                topics::TASK_RESUMED_EVENT_TOPIC,
                Box::new(TaskResumed {
                    container_id: id.to_owned(),
                    ..Default::default()
                }),
            );
        }
        Ok(())
    }
}

/// Mounts the rootfs containerd gave with the task (none: the bundle's
/// own) at `root`; the mounted root, to unmount on failure.
fn mount_rootfs(
    req: &api::CreateTaskRequest,
    root: &Path,
) -> Result<Option<PathBuf>, ContainerError> {
    if req.rootfs.is_empty() {
        return Ok(None);
    }
    let mounts: Vec<RootMount> = req
        .rootfs
        .iter()
        .map(|m| RootMount {
            fstype: m.type_.clone(),
            source: m.source.clone(),
            options: m.options.clone(),
        })
        .collect();
    rootfs::mount_all(&mounts, root)?;
    ember::container::stage("shim_rootfs_mounted");
    Ok(Some(root.to_owned()))
}

/// The pod VM's configuration for `spec`, with what the shim's
/// environment (`EMBER_SHIM_*`) sets.
fn pod_config(spec: &Spec, dir: &PodDir) -> Result<PodConfig, ContainerError> {
    let base_mem = std::env::var("EMBER_SHIM_MEM").ok();
    let cpus = std::env::var("EMBER_SHIM_CPUS")
        .ok()
        .and_then(|c| c.parse().ok());
    Ok(PodConfig {
        backend: std::env::var("EMBER_SHIM_BACKEND").ok(),
        kernel: std::env::var_os("EMBER_SHIM_KERNEL").map(Into::into),
        cmdline: std::env::var("EMBER_SHIM_CMDLINE").ok(),
        // A cold boot of an emulated guest kernel on a loaded
        // host can outlast the default.
        boot_timeout: std::env::var("EMBER_SHIM_BOOT_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .map(std::time::Duration::from_secs),
        ..PodConfig::for_spec(spec, dir, base_mem.as_deref(), cpus)?
    })
}

/// The guest's cgroup figures as containerd's cgroup v2 metrics.
fn metrics(s: &Stats) -> Metrics {
    let stat = |k: &str| {
        s.memory_stat
            .iter()
            .find(|(n, _)| n == k)
            .map_or(0, |(_, v)| *v)
    };
    let [
        usage_usec,
        user_usec,
        system_usec,
        nr_periods,
        nr_throttled,
        throttled_usec,
    ] = s.cpu;
    let [low, high, max, oom, oom_kill] = s.memory_events;
    Metrics {
        pids: MessageField::some(PidsStat {
            current: s.pids_current,
            limit: s.pids_limit,
            ..Default::default()
        }),
        cpu: MessageField::some(CPUStat {
            usage_usec,
            user_usec,
            system_usec,
            nr_periods,
            nr_throttled,
            throttled_usec,
            ..Default::default()
        }),
        memory: MessageField::some(MemoryStat {
            anon: stat("anon"),
            file: stat("file"),
            kernel_stack: stat("kernel_stack"),
            slab: stat("slab"),
            sock: stat("sock"),
            shmem: stat("shmem"),
            file_mapped: stat("file_mapped"),
            file_dirty: stat("file_dirty"),
            file_writeback: stat("file_writeback"),
            inactive_anon: stat("inactive_anon"),
            active_anon: stat("active_anon"),
            inactive_file: stat("inactive_file"),
            active_file: stat("active_file"),
            unevictable: stat("unevictable"),
            pgfault: stat("pgfault"),
            pgmajfault: stat("pgmajfault"),
            usage: s.memory_usage,
            usage_limit: s.memory_limit,
            ..Default::default()
        }),
        memory_events: MessageField::some(MemoryEvents {
            low,
            high,
            max,
            oom,
            oom_kill,
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl shim::Task for Service {
    fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        ember::container::stage("shim_create");
        log::info!("create {} (bundle {})", req.id, req.bundle);
        let _one_at_a_time = self.0.creating.lock().unwrap_or_else(|p| p.into_inner());
        if self.0.state().containers.contains_key(&req.id) {
            return Err(rpc(
                Code::ALREADY_EXISTS,
                format!("container {} exists", req.id),
            ));
        }
        let (mut container, pid) = self.do_create(&req).map_err(internal)?;
        ember::container::stage("shim_created");
        {
            let mut st = self.0.state();
            let handle = st.next_handle;
            st.next_handle += 1;
            container.procs.insert(
                String::new(),
                Proc::new(handle, &req.stdin, &req.stdout, &req.stderr, req.terminal),
            );
            st.containers.insert(req.id.clone(), container);
        }
        self.0.publish(
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                }),
                pid,
                ..Default::default()
            }),
        );
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        log::info!("start {} {:?}", req.id, req.exec_id);
        // What to start, taken under the lock; started without it (the
        // agent's exit note takes the lock).
        let (pod, spec, handle, terminal, io) = self.with_container(&req.id, |c| {
            let init = c.init_spec.clone();
            let pod = c.pod.clone();
            let p = proc_of(c, &req.exec_id)?;
            if p.status != Status::CREATED {
                return Err(rpc(
                    Code::FAILED_PRECONDITION,
                    format!("process {} was started already", req.exec_id),
                ));
            }
            let spec = if req.exec_id.is_empty() {
                init
            } else {
                p.spec.clone().unwrap_or_default()
            };
            let stdout = open_output(&p.stdout).map_err(internal)?;
            let stderr = if p.terminal {
                None
            } else {
                open_output(&p.stderr).map_err(internal)?
            };
            let stdin: Option<Box<dyn Read + Send>> = (!p.stdin.is_empty()).then(|| {
                Box::new(LazyFifo {
                    path: p.stdin.clone(),
                    file: None,
                }) as Box<dyn Read + Send>
            });
            // Running before the agent answers: an exit note may come first.
            p.status = Status::RUNNING;
            Ok((
                pod,
                spec,
                p.handle,
                p.terminal,
                ProcIo {
                    stdin,
                    stdout,
                    stderr,
                },
            ))
        })?;
        let stdin_given = io.stdin.is_some();
        let started = spec
            .to_agent(handle, &req.id, stdin_given)
            .and_then(|mut agent_spec| {
                agent_spec.terminal = terminal;
                pod.start(agent_spec, io)
            });
        let pid = match started {
            Ok(pid) => pid,
            Err(e) => {
                self.with_container(&req.id, |c| {
                    let p = proc_of(c, &req.exec_id)?;
                    p.status = Status::STOPPED;
                    p.exit = Some((127, now()));
                    Ok(())
                })?;
                self.0.changed.notify_all();
                return Err(internal(e));
            }
        };
        self.with_container(&req.id, |c| {
            proc_of(c, &req.exec_id)?.pid = pid;
            Ok(())
        })?;
        if req.exec_id.is_empty() {
            self.0.publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
        } else {
            self.0.publish(
                topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
        }
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        log::info!("exec {} {}", req.id, req.exec_id);
        let spec = req
            .spec
            .as_ref()
            .ok_or_else(|| rpc(Code::INVALID_ARGUMENT, "exec without a process spec"))?;
        let process = Process::parse(&spec.value).map_err(|e| rpc(Code::INVALID_ARGUMENT, e))?;
        {
            let mut st = self.0.state();
            let handle = st.next_handle;
            st.next_handle += 1;
            let c = st
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| no_container(&req.id))?;
            if c.procs.contains_key(&req.exec_id) {
                return Err(rpc(
                    Code::ALREADY_EXISTS,
                    format!("exec {} exists", req.exec_id),
                ));
            }
            let mut p = Proc::new(handle, &req.stdin, &req.stdout, &req.stderr, req.terminal);
            p.spec = Some(process);
            c.procs.insert(req.exec_id.clone(), p);
        }
        self.0.publish(
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            }),
        );
        Ok(api::Empty::default())
    }

    fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        self.with_container(&req.id, |c| {
            let id = c.id.clone();
            let bundle = c.bundle.display().to_string();
            let p = proc_of(c, &req.exec_id)?;
            let (exit_status, exited_at) = match &p.exit {
                Some((s, t)) => (*s, MessageField::some(t.clone())),
                None => (0, MessageField::none()),
            };
            Ok(api::StateResponse {
                id: if req.exec_id.is_empty() {
                    id
                } else {
                    req.exec_id.clone()
                },
                bundle,
                pid: p.pid,
                status: EnumOrUnknown::new(p.status),
                stdin: p.stdin.clone(),
                stdout: p.stdout.clone(),
                stderr: p.stderr.clone(),
                terminal: p.terminal,
                exit_status,
                exited_at,
                exec_id: req.exec_id.clone(),
                ..Default::default()
            })
        })
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let mut st = self.0.state();
        loop {
            let c = st
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| no_container(&req.id))?;
            let p = proc_of(c, &req.exec_id)?;
            if let Some((s, t)) = &p.exit {
                return Ok(api::WaitResponse {
                    exit_status: *s,
                    exited_at: MessageField::some(t.clone()),
                    ..Default::default()
                });
            }
            st = self.0.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        log::info!(
            "kill {} {:?} signal {} all {}",
            req.id,
            req.exec_id,
            req.signal,
            req.all
        );
        let (pod, handle) = self.with_container(&req.id, |c| {
            let pod = c.pod.clone();
            let p = proc_of(c, &req.exec_id)?;
            if p.status != Status::RUNNING && p.status != Status::PAUSED {
                return Err(rpc(
                    Code::NOT_FOUND,
                    format!("process {} is not running", req.exec_id),
                ));
            }
            Ok((pod, p.handle))
        })?;
        pod.signal(handle, req.signal as i32, req.all)
            .map_err(internal)?;
        Ok(api::Empty::default())
    }

    fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        log::info!("delete {} {:?}", req.id, req.exec_id);
        if !req.exec_id.is_empty() {
            return self.with_container(&req.id, |c| {
                if proc_of(c, &req.exec_id)?.status == Status::RUNNING {
                    return Err(rpc(
                        Code::FAILED_PRECONDITION,
                        format!("exec {} is running", req.exec_id),
                    ));
                }
                let p = c.procs.remove(&req.exec_id).expect("checked above");
                let (s, t) = p.exit.unwrap_or((0, now()));
                Ok(api::DeleteResponse {
                    pid: p.pid,
                    exit_status: s,
                    exited_at: MessageField::some(t),
                    ..Default::default()
                })
            });
        }
        let (c, last_vm) = {
            let mut st = self.0.state();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| no_container(&req.id))?;
            if c.procs
                .get("")
                .is_some_and(|p| p.status == Status::RUNNING || p.status == Status::PAUSED)
            {
                return Err(rpc(
                    Code::FAILED_PRECONDITION,
                    format!("container {} is running: kill it first", req.id),
                ));
            }
            // The pod's directory is in its first container's bundle,
            // which containerd removes after this delete: that one goes last.
            let holds_vm = st
                .vm
                .as_ref()
                .is_some_and(|v| v.dir.path().parent() == Some(c.bundle.as_path()));
            if holds_vm && st.containers.len() > 1 {
                return Err(rpc(
                    Code::FAILED_PRECONDITION,
                    format!(
                        "container {} holds its pod's VM: delete the pod's other containers first",
                        req.id
                    ),
                ));
            }
            let c = st.containers.remove(&req.id).expect("checked above");
            let last_vm = if st.containers.is_empty() {
                st.vm.take()
            } else {
                None
            };
            (c, last_vm)
        };
        let _ = c.pod.destroy(&c.id);
        c.dir.remove(&c.id);
        if let Some(vm) = last_vm {
            vm.pod.shutdown();
            vm.dir.destroy();
        }
        if let Some(r) = &c.rootfs
            && is_mounted(r)
        {
            rootfs::unmount_all(r);
        }
        let init = c.procs.get("");
        let (pid, (s, t)) = match init {
            Some(p) => (p.pid, p.exit.clone().unwrap_or((0, now()))),
            None => (0, (0, now())),
        };
        self.0.publish(
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: c.id.clone(),
                pid,
                exit_status: s,
                exited_at: MessageField::some(t.clone()),
                ..Default::default()
            }),
        );
        Ok(api::DeleteResponse {
            pid,
            exit_status: s,
            exited_at: MessageField::some(t),
            ..Default::default()
        })
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let pids = self.pod_of(&req.id)?.pids(&req.id).map_err(internal)?;
        Ok(api::PidsResponse {
            processes: pids
                .into_iter()
                .map(|pid| ProcessInfo {
                    pid,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let (pod, handle) = self.target(&req.id, &req.exec_id)?;
        pod.resize(handle, req.width as u16, req.height as u16)
            .map_err(internal)?;
        Ok(api::Empty::default())
    }

    fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        let (pod, handle) = self.target(&req.id, &req.exec_id)?;
        if req.stdin {
            pod.close_stdin(handle).map_err(internal)?;
        }
        Ok(api::Empty::default())
    }

    fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let task_pid =
            self.with_container(&req.id, |c| Ok(c.procs.get("").map(|p| p.pid).unwrap_or(0)))?;
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Default::default()
        })
    }

    fn shutdown(&self, _ctx: &TtrpcContext, _req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        // containerd asks after each delete; a shim with containers keeps serving them.
        if !self.0.state().containers.is_empty() {
            return Ok(api::Empty::default());
        }
        self.0.exit.signal();
        Ok(api::Empty::default())
    }

    fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        log::info!("pause {}", req.id);
        self.pod_of(&req.id)?.pause(&req.id).map_err(internal)?;
        self.set_paused(&req.id, true)?;
        Ok(api::Empty::default())
    }

    fn resume(&self, _ctx: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        log::info!("resume {}", req.id);
        self.pod_of(&req.id)?.resume(&req.id).map_err(internal)?;
        self.set_paused(&req.id, false)?;
        Ok(api::Empty::default())
    }

    fn checkpoint(
        &self,
        _ctx: &TtrpcContext,
        _req: api::CheckpointTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        Err(not_implemented("checkpoint"))
    }

    /// New limits for the container's cgroup in the guest. The VM keeps
    /// its size (the QEMU backend cannot grow it): a memory limit above
    /// it only means the VM's own memory is the bound.
    fn update(&self, _ctx: &TtrpcContext, req: api::UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        log::info!("update {}", req.id);
        let pod = self.pod_of(&req.id)?;
        let any = req
            .resources
            .as_ref()
            .ok_or_else(|| rpc(Code::INVALID_ARGUMENT, "update without resources"))?;
        let resources = LinuxResources::parse(&any.value)
            .map_err(|e| rpc(Code::INVALID_ARGUMENT, e))?
            .to_agent()
            .map_err(internal)?;
        pod.update(&req.id, resources).map_err(internal)?;
        Ok(api::Empty::default())
    }

    fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let s = self.pod_of(&req.id)?.stats(&req.id).map_err(internal)?;
        let value = metrics(&s)
            .write_to_bytes()
            .map_err(|e| rpc(Code::INTERNAL, format!("encode metrics: {e}")))?;
        Ok(api::StatsResponse {
            stats: MessageField::some(Any {
                type_url: METRICS_TYPE.to_owned(),
                value,
                ..Default::default()
            }),
            ..Default::default()
        })
    }
}
