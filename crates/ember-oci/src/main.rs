//! ember-oci: a runc-compatible OCI runtime whose containers run in ember
//! microVMs, for Docker (`daemon.json` `runtimes`) and anything else that
//! drives runc's command line (containerd's runc shim with `BinaryName`).
//!
//! `create` starts the container's process on the host — a supervisor
//! (this program again) that boots the VM with the guest agent
//! ([`ember::container`], shared with `containerd-shim-ember-v2`), holds
//! the container's stdio, and exits with the container's status — as crun's
//! krun mode makes the VMM the container's process. The other commands talk
//! to it over `ROOT/ID/ctl.sock`.

mod ctl;
mod fdpass;
mod hostcg;
mod resources;
mod state;
mod supervisor;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand};
use ctl::{Conn, Request};
use state::State;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// The OCI runtime spec version ember-oci speaks.
const OCI_VERSION: &str = "1.0.2";
/// How long a VM's boot may take (TCG on a loaded host is slow).
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Parser)]
#[command(
    name = "ember-oci",
    version,
    about = "A runc-compatible OCI runtime: each container in an ember microVM",
    after_help = "Docker: register it in /etc/docker/daemon.json:\n  \
                  {\"runtimes\": {\"ember\": {\"path\": \"ember-oci\"}}}\n\
                  then `docker run --runtime ember IMAGE …`."
)]
struct Cli {
    /// Where containers' state is kept.
    #[arg(long, global = true, default_value = "/run/ember-oci")]
    root: PathBuf,
    /// Append errors (and the supervisor's log) to this file.
    #[arg(long, global = true)]
    log: Option<PathBuf>,
    /// The log's format: `text` or `json`.
    #[arg(long = "log-format", global = true, default_value = "text")]
    log_format: String,
    /// Log more.
    #[arg(long, global = true)]
    debug: bool,
    /// Accepted for runc compatibility (the VM is the container's cgroup).
    #[arg(long = "systemd-cgroup", global = true)]
    systemd_cgroup: bool,
    /// Accepted for runc compatibility.
    #[arg(long, global = true)]
    rootless: Option<String>,
    /// Which VMM boots containers' VMs (`ember run --backend`: auto, ember,
    /// qemu) [default: $EMBER_OCI_BACKEND, else ember's choice].
    #[arg(long, global = true)]
    backend: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a container (its VM boots; its process waits for `start`).
    Create {
        /// The bundle (config.json and the root).
        #[arg(short, long, default_value = ".")]
        bundle: PathBuf,
        /// Write the container's host process's pid here.
        #[arg(long = "pid-file")]
        pid_file: Option<PathBuf>,
        /// Send the terminal's master here (with `process.terminal`).
        #[arg(long = "console-socket")]
        console_socket: Option<String>,
        /// Accepted for runc compatibility.
        #[arg(long = "no-pivot")]
        no_pivot: bool,
        /// Accepted for runc compatibility.
        #[arg(long = "no-new-keyring")]
        no_new_keyring: bool,
        /// Extra descriptors to pass (none can reach a VM: only 0 is accepted).
        #[arg(long = "preserve-fds", default_value_t = 0)]
        preserve_fds: u32,
        /// The container's id.
        id: String,
    },
    /// Start a created container's process.
    Start {
        /// The container.
        id: String,
    },
    /// Print a container's state (JSON).
    State {
        /// The container.
        id: String,
    },
    /// Send a signal to a container's process.
    Kill {
        /// Every process in the container.
        #[arg(short, long)]
        all: bool,
        /// The container.
        id: String,
        /// The signal (name or number).
        #[arg(default_value = "SIGTERM")]
        signal: String,
    },
    /// Delete a container's state (and with --force, the container).
    Delete {
        /// Kill it first if it runs.
        #[arg(short, long)]
        force: bool,
        /// The container.
        id: String,
    },
    /// Run another process in a running container.
    Exec {
        /// The process, as OCI JSON (else ARGS).
        #[arg(short, long)]
        process: Option<PathBuf>,
        /// Return once it started (its host process, the relay, stays).
        #[arg(short, long)]
        detach: bool,
        /// Write its host process's pid here.
        #[arg(long = "pid-file")]
        pid_file: Option<PathBuf>,
        /// Send its terminal's master here.
        #[arg(long = "console-socket")]
        console_socket: Option<String>,
        /// A terminal (with ARGS).
        #[arg(short, long)]
        tty: bool,
        /// Working directory (with ARGS).
        #[arg(long)]
        cwd: Option<String>,
        /// NAME=VALUE (with ARGS).
        #[arg(short, long)]
        env: Vec<String>,
        /// The container.
        id: String,
        /// The command.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// List a container's host processes (its supervisor and VM).
    Ps {
        /// `table` or `json`.
        #[arg(short, long, default_value = "table")]
        format: String,
        /// The container.
        id: String,
        /// ps(1) options (ignored).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        ps_args: Vec<String>,
    },
    /// Freeze a container's VM.
    Pause {
        /// The container.
        id: String,
    },
    /// Thaw it.
    Resume {
        /// The container.
        id: String,
    },
    /// Change the limits of a container's cgroup in its VM (the VM keeps
    /// its size: a memory limit above it is refused).
    Update {
        /// linux.resources as JSON, `-` for stdin (the flags are then ignored).
        #[arg(short, long)]
        resources: Option<String>,
        /// Memory limit (bytes, or 200m, 1g; -1 for none).
        #[arg(short, long, allow_hyphen_values = true)]
        memory: Option<String>,
        /// Memory plus swap (as --memory; -1 for unlimited swap).
        #[arg(long = "memory-swap", allow_hyphen_values = true)]
        memory_swap: Option<String>,
        /// CFS quota, microseconds per period (-1 for none).
        #[arg(long = "cpu-quota", allow_hyphen_values = true)]
        cpu_quota: Option<String>,
        /// CFS period, microseconds.
        #[arg(long = "cpu-period", allow_hyphen_values = true)]
        cpu_period: Option<String>,
        /// CPU shares (a relative weight).
        #[arg(long = "cpu-share", alias = "cpu-shares", allow_hyphen_values = true)]
        cpu_share: Option<String>,
        /// Most processes (-1 for no limit).
        #[arg(long = "pids-limit", allow_hyphen_values = true)]
        pids_limit: Option<String>,
        /// The container.
        id: String,
    },
    /// Print a container's resource use (JSON), once (`--stats`) or every interval.
    Events {
        /// Once.
        #[arg(long)]
        stats: bool,
        /// Between reports.
        #[arg(long, default_value = "5s")]
        interval: String,
        /// The container.
        id: String,
    },
    /// (internal) The container's host process, started by `create`.
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        bundle: PathBuf,
        #[arg(long = "ctl-fd")]
        ctl_fd: i32,
        id: String,
    },
    /// (internal) An exec's host process: exits with its status.
    #[command(hide = true)]
    Relay {
        #[arg(long)]
        fd: i32,
        id: String,
    },
}

/// Writes log records to `--log` (runc's JSON lines with `--log-format json`).
struct FileLog {
    file: Mutex<std::fs::File>,
    json: bool,
    level: log::LevelFilter,
}

impl log::Log for FileLog {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= self.level
    }

    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let time = state::rfc3339(SystemTime::now());
        let level = r.level().as_str().to_lowercase();
        let msg = r.args().to_string();
        let line = if self.json {
            serde_json::json!({"level": level, "msg": msg, "time": time}).to_string()
        } else {
            format!("time=\"{time}\" level={level} msg={msg:?}")
        };
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(f, "{line}");
    }

    fn flush(&self) {}
}

fn main() {
    let mut cli = Cli::parse();
    if cli.backend.is_none() {
        cli.backend = std::env::var("EMBER_OCI_BACKEND")
            .ok()
            .filter(|b| !b.is_empty());
    }
    let logged = match &cli.log {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .ok()
            .map(|f| {
                let level = if cli.debug {
                    log::LevelFilter::Debug
                } else {
                    log::LevelFilter::Info
                };
                let _ = log::set_boxed_logger(Box::new(FileLog {
                    file: Mutex::new(f),
                    json: cli.log_format == "json",
                    level,
                }));
                log::set_max_level(level);
            })
            .is_some(),
        None => false,
    };
    if let Err(e) = run(cli) {
        let msg = format!("{e:#}");
        log::error!("{msg}");
        if !logged {
            eprintln!("ember-oci: {msg}");
        }
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Create {
            bundle,
            pid_file,
            console_socket,
            preserve_fds,
            id,
            ..
        } => create(
            &cli,
            bundle,
            pid_file.as_deref(),
            console_socket.clone(),
            *preserve_fds,
            id,
        ),
        Cmd::Start { id } => start(&cli.root, id),
        Cmd::State { id } => state(&cli.root, id),
        Cmd::Kill {
            all, id, signal, ..
        } => kill(&cli.root, id, signal, *all),
        Cmd::Delete { force, id } => delete(&cli.root, id, *force),
        Cmd::Exec {
            process,
            detach,
            pid_file,
            console_socket,
            tty,
            cwd,
            env,
            id,
            args,
        } => exec(
            &cli,
            id,
            exec_process(process.as_deref(), *tty, args, env, cwd.as_deref())?,
            *detach,
            pid_file.as_deref(),
            console_socket.as_deref(),
        ),
        Cmd::Ps { format, id, .. } => ps(&cli.root, id, format),
        Cmd::Pause { id } => ask(&cli.root, id, Request::Pause).map(drop),
        Cmd::Resume { id } => ask(&cli.root, id, Request::Resume).map(drop),
        Cmd::Update {
            resources,
            memory,
            memory_swap,
            cpu_quota,
            cpu_period,
            cpu_share,
            pids_limit,
            id,
        } => update(
            &cli.root,
            id,
            resources.as_deref(),
            &resources::Flags {
                memory: memory.clone(),
                memory_swap: memory_swap.clone(),
                cpu_quota: cpu_quota.clone(),
                cpu_period: cpu_period.clone(),
                cpu_shares: cpu_share.clone(),
                pids_limit: pids_limit.clone(),
            },
        ),
        Cmd::Events {
            stats,
            interval,
            id,
        } => events(&cli.root, id, *stats, interval),
        Cmd::Supervise { bundle, ctl_fd, id } => supervisor::run(supervisor::Opts {
            root: cli.root.clone(),
            id: id.clone(),
            bundle: bundle.clone(),
            backend: cli.backend.clone(),
            ctl_fd: *ctl_fd,
        }),
        Cmd::Relay { fd, id } => relay(*fd, id),
    }
}

/// `start`: the supervisor starts the container's process, then the
/// poststart hooks run.
fn start(root: &Path, id: &str) -> Result<()> {
    let st = existing(root, id)?;
    let reply = ask(root, id, Request::Start)?;
    log::info!("{id}: started, guest pid {:?}", reply.pid);
    let spec = ember::container::spec::Spec::load(Path::new(&st.bundle))?;
    run_hooks(&spec.hooks.poststart, &hook_state(&st, "running"), false)
}

/// `state`: the OCI state, as JSON on stdout.
fn state(root: &Path, id: &str) -> Result<()> {
    let st = existing(root, id)?;
    let out = serde_json::json!({
        "ociVersion": OCI_VERSION,
        "id": st.id,
        "pid": st.pid,
        "status": st.status(),
        "bundle": st.bundle,
        "rootfs": st.rootfs,
        "created": st.created,
        "owner": "",
        "annotations": st.annotations,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// `kill`: a signal to the container's process (or all of them).
fn kill(root: &Path, id: &str, signal: &str, all: bool) -> Result<()> {
    let st = existing(root, id)?;
    if !st.alive() {
        bail!("container not running");
    }
    ask(
        root,
        id,
        Request::Kill {
            signal: parse_signal(signal)?,
            all,
        },
    )
    .map(drop)
}

/// `exec`'s process as the OCI process JSON: the `--process` file's, or
/// one made of the command line's.
fn exec_process(
    process: Option<&Path>,
    tty: bool,
    args: &[String],
    env: &[String],
    cwd: Option<&str>,
) -> Result<String> {
    Ok(match process {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?,
        None => {
            if args.is_empty() {
                bail!("exec: no --process and no command");
            }
            serde_json::json!({
                "terminal": tty, "args": args, "env": env,
                "cwd": cwd.unwrap_or("/"),
            })
            .to_string()
        }
    })
}

/// `ps`: the container's processes, as JSON or a `PID CMD` table.
fn ps(root: &Path, id: &str, format: &str) -> Result<()> {
    existing(root, id)?;
    let reply = ask(root, id, Request::Pids)?;
    if format == "json" {
        println!("{}", serde_json::to_string(&reply.pids)?);
    } else {
        println!("PID CMD");
        for p in reply.pids {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            println!("{p} {}", cmd.trim_end());
        }
    }
    Ok(())
}

fn existing(root: &Path, id: &str) -> Result<State> {
    State::load(root, id).ok_or_else(|| anyhow!("container \"{id}\" does not exist"))
}

/// One request to the container's supervisor, answered.
fn ask(root: &Path, id: &str, req: Request) -> Result<ctl::Reply> {
    let st = existing(root, id)?;
    if !st.alive() {
        bail!("container \"{id}\" is not running");
    }
    let mut conn = Conn::send(&state::ctl(root, id), &req, &[])
        .with_context(|| format!("container \"{id}\"'s supervisor"))?;
    let reply = conn
        .reply(Some(Duration::from_secs(60)))?
        .ok_or_else(|| anyhow!("container \"{id}\"'s supervisor hung up"))?;
    match reply.error {
        Some(e) => Err(anyhow!(e)),
        None => Ok(reply),
    }
}

fn parse_signal(s: &str) -> Result<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return Ok(n);
    }
    let name = s.trim_start_matches("SIG");
    let n = match name {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "TERM" => libc::SIGTERM,
        "CONT" => libc::SIGCONT,
        "STOP" => libc::SIGSTOP,
        "WINCH" => libc::SIGWINCH,
        "ALRM" => libc::SIGALRM,
        _ => bail!("unknown signal {s}"),
    };
    Ok(n)
}

fn hook_state(st: &State, status: &str) -> Vec<u8> {
    serde_json::json!({
        "ociVersion": OCI_VERSION,
        "id": st.id,
        "status": status,
        "pid": st.pid,
        "bundle": st.bundle,
        "annotations": st.annotations,
    })
    .to_string()
    .into_bytes()
}

/// Runs hooks in order, the container's state on their stdin; a failure
/// is an error unless `lenient` (poststart/poststop: runc only warns).
fn run_hooks(hooks: &[ember::container::spec::Hook], state: &[u8], lenient: bool) -> Result<()> {
    for h in hooks {
        let mut cmd = Command::new(&h.path);
        if let Some((argv0, rest)) = h.args.split_first() {
            cmd.arg0(argv0).args(rest);
        }
        cmd.env_clear()
            .envs(h.env.iter().filter_map(|e| e.split_once('=')))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let result = (|| -> Result<()> {
            let mut child = cmd.spawn().with_context(|| format!("hook {}", h.path))?;
            if let Some(mut i) = child.stdin.take() {
                let _ = i.write_all(state);
            }
            let deadline = h.timeout.map(|t| Instant::now() + Duration::from_secs(t));
            loop {
                if let Some(status) = child.try_wait()? {
                    if status.success() {
                        return Ok(());
                    }
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    bail!("hook {} failed ({status}): {}", h.path, err.trim());
                }
                if deadline.is_some_and(|d| Instant::now() > d) {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("hook {} timed out", h.path);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })();
        match result {
            Err(e) if lenient => log::warn!("{e:#}"),
            other => other?,
        }
    }
    Ok(())
}

/// The network namespace the container's host process lives in: joined
/// (a `path`) or made (none), as runc would make the container's.
fn network_namespace(spec: &ember::container::spec::Spec) -> Option<String> {
    spec.linux
        .namespaces
        .iter()
        .find(|n| n.kind == "network")
        .map(|n| n.path.clone().unwrap_or_default())
}

fn create(
    cli: &Cli,
    bundle: &Path,
    pid_file: Option<&Path>,
    console_socket: Option<String>,
    preserve_fds: u32,
    id: &str,
) -> Result<()> {
    if preserve_fds != 0 {
        bail!("not implemented: --preserve-fds (descriptors cannot reach the VM)");
    }
    if id.is_empty() || id.contains('/') || id.starts_with('.') {
        bail!("invalid container id {id:?}");
    }
    let bundle =
        std::fs::canonicalize(bundle).with_context(|| format!("bundle {}", bundle.display()))?;
    let spec = ember::container::spec::Spec::load(&bundle)?;
    let process = spec
        .process
        .as_ref()
        .ok_or_else(|| anyhow!("bundle {}: config.json has no process", bundle.display()))?;
    if process.terminal && console_socket.is_none() {
        bail!("a terminal (process.terminal) needs --console-socket");
    }
    let dir = state::dir(&cli.root, id);
    std::fs::create_dir_all(&cli.root).with_context(|| format!("mkdir {}", cli.root.display()))?;
    std::fs::create_dir(&dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            anyhow!("container with id \"{id}\" already exists")
        } else {
            anyhow!("mkdir {}: {e}", dir.display())
        }
    })?;
    let made = create_in(cli, &bundle, &spec, pid_file, console_socket, id);
    if made.is_err() {
        remove_host_cgroups(&cli.root, id);
        let _ = std::fs::remove_dir_all(&dir);
    }
    made
}

fn create_in(
    cli: &Cli,
    bundle: &Path,
    spec: &ember::container::spec::Spec,
    pid_file: Option<&Path>,
    console_socket: Option<String>,
    id: &str,
) -> Result<()> {
    let mut st = creating(bundle, spec, id);
    st.save(&cli.root)?;
    let ctl = state::ctl(&cli.root, id);
    let (_dir, short) = state::socket_path(&ctl)?;
    let listener = std::os::unix::net::UnixListener::bind(&short)
        .with_context(|| format!("listen on {}", ctl.display()))?;
    // The namespace's file is held open until the supervisor has joined it.
    let (mut cmd, _netns_file) = supervisor_command(cli, bundle, spec, id, listener.as_raw_fd())?;
    let child = cmd.spawn().context("start the container's supervisor")?;
    drop(listener);
    let pid = child.id();
    st.pid = pid;
    let result = boot_supervised(spec, &st, &ctl, console_socket, pid_file);
    if result.is_err() {
        // SAFETY: kill has no memory effects; the pid is our child's.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let mut child = child;
        let _ = child.wait();
    }
    result
}

/// The state of a container being created from `bundle`.
fn creating(bundle: &Path, spec: &ember::container::spec::Spec, id: &str) -> State {
    let rootfs = spec
        .root
        .as_ref()
        .map(|r| r.path.clone())
        .unwrap_or_default();
    State {
        id: id.to_owned(),
        pid: 0,
        status: "creating".into(),
        bundle: bundle.display().to_string(),
        rootfs: if Path::new(&rootfs).is_absolute() {
            rootfs
        } else {
            bundle.join(rootfs).display().to_string()
        },
        created: state::rfc3339(SystemTime::now()),
        annotations: spec.annotations.clone(),
    }
}

/// `ember-oci supervise` for the container, in its own session and in the
/// spec's network namespace (a new one, or joined through the returned
/// file), inheriting the control listener `ctl_fd`.
fn supervisor_command(
    cli: &Cli,
    bundle: &Path,
    spec: &ember::container::spec::Spec,
    id: &str,
    ctl_fd: i32,
) -> Result<(Command, Option<std::fs::File>)> {
    let netns = network_namespace(spec);
    let netns_file = match netns.as_deref() {
        Some(p) if !p.is_empty() => {
            Some(std::fs::File::open(p).with_context(|| format!("network namespace {p}"))?)
        }
        _ => None,
    };
    let new_netns = netns.as_deref() == Some("");
    let joined = netns_file.as_ref().map(|f| f.as_raw_fd());
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--root").arg(&cli.root);
    if let Some(l) = &cli.log {
        cmd.arg("--log")
            .arg(l)
            .args(["--log-format", &cli.log_format]);
    }
    if let Some(b) = &cli.backend {
        cmd.args(["--backend", b]);
    }
    if spec.process.as_ref().is_some_and(|p| p.terminal) {
        // The terminal is the container's stdio; ours is a pipe whose
        // reader (containerd's runc shim) waits for its end.
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
    }
    cmd.arg("supervise")
        .arg("--bundle")
        .arg(bundle)
        .args(["--ctl-fd", &ctl_fd.to_string()])
        .arg(id);
    // SAFETY: only async-signal-safe calls (setsid, unshare, setns, fcntl)
    // between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            if new_netns && libc::unshare(libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(fd) = joined
                && libc::setns(fd, libc::CLONE_NEWNET) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The listener, inherited.
            if libc::fcntl(ctl_fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok((cmd, netns_file))
}

/// With the supervisor started (`st.pid`): the create hooks, the VM's boot
/// through the supervisor, then the pid file.
fn boot_supervised(
    spec: &ember::container::spec::Spec,
    st: &State,
    ctl: &Path,
    console_socket: Option<String>,
    pid_file: Option<&Path>,
) -> Result<()> {
    let hs = hook_state(st, "created");
    // Docker's network is set up by a prestart hook in the namespace
    // the supervisor made: before the VM boots, so passt finds it.
    run_hooks(&spec.hooks.create_runtime, &hs, false)?;
    run_hooks(&spec.hooks.prestart, &hs, false)?;
    let mut conn = Conn::send(ctl, &Request::Boot { console_socket }, &[])
        .context("the container's supervisor")?;
    let reply = conn
        .reply(Some(BOOT_TIMEOUT))?
        .ok_or_else(|| anyhow!("the container's supervisor ended while booting its VM"))?;
    if let Some(e) = reply.error {
        bail!("{e}");
    }
    if let Some(p) = pid_file {
        let tmp = p.with_extension("ember-tmp");
        std::fs::write(&tmp, st.pid.to_string())?;
        std::fs::rename(&tmp, p)?;
    }
    Ok(())
}

fn delete(root: &Path, id: &str, force: bool) -> Result<()> {
    let Some(st) = State::load(root, id) else {
        if force {
            return Ok(());
        }
        bail!("container \"{id}\" does not exist");
    };
    if st.alive() {
        if !force && st.status != "created" {
            bail!(
                "cannot delete container {id} that is not stopped: {}",
                st.status
            );
        }
        // Its VM goes with it (the parent-death signal ember run has).
        // SAFETY: kill has no memory effects.
        unsafe { libc::kill(st.pid as i32, libc::SIGKILL) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while st.alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let spec = ember::container::spec::Spec::load(Path::new(&st.bundle)).unwrap_or_default();
    // What a supervisor killed before its end left mounted (the root and
    // bind mounts' sources): removing the directory would remove those.
    ember::container::pod::PodDir::new(state::pod_dir(root, id)).destroy();
    if ember::container::rootfs::is_mounted_under(&state::dir(root, id)) {
        bail!(
            "cannot delete container {id}: {} is still mounted below",
            state::dir(root, id).display()
        );
    }
    remove_host_cgroups(root, id);
    std::fs::remove_dir_all(state::dir(root, id))
        .with_context(|| format!("rm {}", state::dir(root, id).display()))?;
    run_hooks(&spec.hooks.poststop, &hook_state(&st, "stopped"), true)
}

/// The host cgroups of a supervisor that did not remove them (killed),
/// and whatever of its VM's is still in them.
fn remove_host_cgroups(root: &Path, id: &str) {
    let listed = std::fs::read_to_string(state::host_cgroups(root, id)).unwrap_or_default();
    let dirs: Vec<PathBuf> = listed.lines().map(PathBuf::from).collect();
    hostcg::clear(&dirs, Duration::from_secs(5));
}

fn exec(
    cli: &Cli,
    id: &str,
    process: String,
    detach: bool,
    pid_file: Option<&Path>,
    console_socket: Option<&str>,
) -> Result<()> {
    let st = existing(&cli.root, id)?;
    if !st.alive() || st.status != "running" {
        bail!("cannot exec in a container that is {}", st.status());
    }
    let terminal = ember::container::spec::Process::parse(process.as_bytes())
        .map_err(|e| anyhow!(e))?
        .terminal;
    let mut held: Vec<OwnedFd> = Vec::new();
    let fds: Vec<i32> = if terminal {
        let socket = console_socket.ok_or_else(|| anyhow!("a terminal needs --console-socket"))?;
        let (master, slave) = fdpass::pty()?;
        fdpass::send_console(socket, &master)
            .with_context(|| format!("console socket {socket}"))?;
        let fd = slave.as_raw_fd();
        held.push(slave);
        vec![fd]
    } else {
        vec![0, 1, 2]
    };
    let mut conn = Conn::send(&state::ctl(&cli.root, id), &Request::Exec { process }, &fds)
        .with_context(|| format!("container \"{id}\"'s supervisor"))?;
    drop(held);
    let reply = conn
        .reply(Some(Duration::from_secs(60)))?
        .ok_or_else(|| anyhow!("container \"{id}\"'s supervisor hung up"))?;
    if let Some(e) = reply.error {
        bail!("{e}");
    }
    if detach {
        // The exec's host process: a relay that waits for its status.
        let stream = conn.into_stream();
        stream.set_read_timeout(None)?;
        let fd = stream.as_raw_fd();
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--root")
            .arg(&cli.root)
            .args(["relay", "--fd", &fd.to_string(), id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: fcntl only, between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().context("start the exec's relay")?;
        if let Some(p) = pid_file {
            let tmp = p.with_extension("ember-tmp");
            std::fs::write(&tmp, child.id().to_string())?;
            std::fs::rename(&tmp, p)?;
        }
        return Ok(());
    }
    let status = wait_status(&mut conn);
    std::process::exit(status);
}

fn wait_status(conn: &mut Conn) -> i32 {
    loop {
        match conn.reply(None) {
            Ok(Some(r)) => {
                if let Some(s) = r.status {
                    return s;
                }
            }
            // The supervisor went: the container (and the exec) with it.
            _ => return 255,
        }
    }
}

fn relay(fd: i32, _id: &str) -> Result<()> {
    // SAFETY: `exec` passed this connected socket for us to own.
    let stream =
        unsafe { <std::os::unix::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut conn = ctl::Conn::from_stream(stream);
    std::process::exit(wait_status(&mut conn));
}

fn update(root: &Path, id: &str, resources: Option<&str>, flags: &resources::Flags) -> Result<()> {
    existing(root, id)?;
    let wanted = match resources {
        Some(from) => {
            if flags.any() {
                log::warn!(
                    "update {id}: --resources given, so the other flags are ignored (as runc does)"
                );
            }
            let json = if from == "-" {
                let mut s = Vec::new();
                std::io::stdin()
                    .read_to_end(&mut s)
                    .context("read the resources from stdin")?;
                s
            } else {
                std::fs::read(from).with_context(|| format!("--resources {from}"))?
            };
            ember::container::spec::LinuxResources::parse(&json)?
        }
        None => flags.to_resources()?,
    };
    let resources = resources::to_agent(&wanted)?;
    if resources == ember_agent::Resources::default() {
        // Nothing asked (runc's update without flags): nothing to do.
        return Ok(());
    }
    ask(root, id, Request::Update { resources }).map(drop)
}

/// The container's figures, from its cgroup in the guest.
fn stats(root: &Path, id: &str) -> Result<serde_json::Value> {
    let reply = ask(root, id, Request::Stats)?;
    let s = reply
        .stats
        .ok_or_else(|| anyhow!("container \"{id}\"'s supervisor sent no figures"))?;
    Ok(resources::event(id, &s))
}

fn events(root: &Path, id: &str, once: bool, interval: &str) -> Result<()> {
    let every = interval
        .strip_suffix("ms")
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
        .or_else(|| {
            interval
                .strip_suffix('s')
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v > 0.0)
                .map(Duration::from_secs_f64)
        })
        .ok_or_else(|| anyhow!("bad --interval {interval}"))?;
    loop {
        let st = existing(root, id)?;
        if !st.alive() {
            if once {
                bail!("container \"{id}\" is not running");
            }
            return Ok(());
        }
        match stats(root, id) {
            Ok(e) => println!("{e}"),
            // It ended between the two looks: the stream ends with it.
            Err(_) if !once && !st.alive() => return Ok(()),
            Err(e) => return Err(e),
        }
        if once {
            return Ok(());
        }
        std::thread::sleep(every);
    }
}
