//! `ember boot`: boot a kernel directly on KVM with ember-vmm, wait for the
//! guest to end and turn how it ended into the process exit status.

use crate::backend::DeviceArgs;
use crate::exit::{EXIT_GUEST_CRASHED, EXIT_SECCOMP, EXIT_TIMEOUT, guest_end_status};
use crate::passt;
use clap::Args;
use ember_vmm::builder::{self, BeforeGo, VmConfig};
use ember_vmm::devices::virtio::{
    BalloonConfig, DiskConfig, MemConfig, NetConfig, PmemConfig, VsockConfig, target_pages,
};
use ember_vmm::events::{Recorder, kind};
use ember_vmm::machine::{DeviceSet, Machine};
use ember_vmm::prefault::MemoryOptions;
use ember_vmm::seccomp;
use ember_vmm::snapshot::restore::{self, RestoreConfig};
use ember_vmm::vstate::end::{EndError, GuestEnd};
use ember_vmm::vstate::memory;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Arguments of `ember boot`.
#[derive(Debug, Clone, Args)]
pub struct BootArgs {
    /// Kernel: ELF vmlinux (with or without a PVH note) or bzImage.
    #[arg(long, required_unless_present = "restore")]
    pub kernel: Option<PathBuf>,
    /// Initramfs.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line. ember adds `pci=off` (it has no PCI bus) unless
    /// a `pci=` option is given.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory, with an optional K/M/G suffix (bytes without one).
    #[arg(long, default_value = "256M")]
    pub mem: String,
    /// Boot with this much RAM and offer the rest of --mem as a virtio-mem
    /// region the guest plugs as it goes (whole 128 MiB blocks; all of it
    /// requested at once, or as it is committed with --prefault).
    #[arg(long, value_name = "SIZE")]
    pub mem_boot: Option<String>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// Where the guest's COM1 goes.
    #[arg(long, value_enum, default_value_t = ConsoleMode::Serial)]
    pub console: ConsoleMode,
    #[command(flatten)]
    pub devices: DeviceArgs,
    /// A virtio-net device (eth0, eth1, … in the guest) on an existing tap
    /// interface, on a tap descriptor ember inherited (`fd=N`), or user-mode
    /// networking through a passt ember starts and stops (`passt`: the
    /// host's addresses, offered by passt's DHCP/NDP/DHCPv6; or `socket=N`, a
    /// passt stream socket ember inherited):
    /// tap=NAME|fd=N|passt|socket=N[,mac=MAC][,mtu=N][,rx_bytes=R][,rx_ops=R][,tx_bytes=R][,tx_ops=R],
    /// a rate R being SIZE[/MS][+BURST] (SIZE bytes or frames per MS
    /// milliseconds, 1000 by default; a one-time BURST). Repeatable. With
    /// --restore: the backends of the snapshot's network devices, in order
    /// (a new tap or MAC shows the guest its link going down and up).
    #[arg(long, value_name = "tap=NAME|fd=N|passt[,mac=MAC][,mtu=N]")]
    pub net: Vec<NetConfig>,
    /// With `--net passt`: forward the host's port HOST (on ADDR only, if
    /// given) to the guest's port GUEST. Repeatable.
    #[arg(long, value_name = "[ADDR:]HOST:GUEST[/tcp|/udp]")]
    pub publish: Vec<String>,
    /// The virtio devices as JSON (`ember run` hands its devices over this
    /// way, not as options to parse again).
    #[arg(
        long,
        hide = true,
        value_name = "JSON",
        value_parser = parse_device_set,
        conflicts_with_all = ["disk", "pmem", "rng", "balloon", "balloon_target", "balloon_no_reporting", "net", "vsock", "fs"]
    )]
    pub devices_json: Option<DeviceSet>,
    /// A virtio-vsock device (Firecracker's hybrid vsock): the guest's CID and
    /// a Unix socket. Host programs connect to PATH and write `CONNECT <port>\n`
    /// (answered `OK <host port>\n`); guest connections to host port P go to
    /// `PATH_P`. With --restore the snapshot's device binds its PATH again, or
    /// this one's (and takes this CID): how a clone runs beside its original.
    #[arg(long, value_name = "cid=N,uds=PATH")]
    pub vsock: Option<VsockConfig>,
    /// The balloon's initial target (memory the guest gives back), e.g. 256M; adds the balloon.
    #[arg(long, value_name = "SIZE")]
    pub balloon_target: Option<String>,
    /// The balloon without free page reporting: the guest's free memory is given
    /// back to the host only when the balloon inflates (always so with --prefault).
    #[arg(long)]
    pub balloon_no_reporting: bool,
    /// Commit guest memory up front: `sync` (all of it before the guest starts) or
    /// `async[,window=SIZE][,chunk=SIZE]` (a boot window before, the rest in the
    /// background, fenced by the balloon); `,threads=N` for either. With --restore:
    /// the restored memory (RAM, plugged virtio-mem blocks) before or beside the guest.
    #[arg(long, value_name = "off|sync|async[,window=SIZE]")]
    pub prefault: Option<String>,
    /// Lock guest memory in host RAM (mlock; pages lock as they are committed).
    #[arg(long)]
    pub mem_lock: bool,
    /// Back guest memory with huge pages: hugetlbfs where the host reserved enough, THP otherwise.
    #[arg(long)]
    pub hugepages: bool,
    /// Connect a virtio-console port to this unix socket (the appliance's data channel).
    /// With --restore: where a snapshotted channel connects.
    #[arg(long)]
    pub channel: Option<PathBuf>,
    /// Give up after this many seconds (the VM is killed; exit status 124).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Serve pause, resume, snapshot, shutdown, status and balloon requests on
    /// this unix socket (`ember ctl`, `ember snapshot`); made 0600, removed at exit.
    #[arg(long, value_name = "PATH")]
    pub api_socket: Option<PathBuf>,
    /// Resume the VM saved in this snapshot directory (`ember snapshot`)
    /// instead of booting a kernel.
    /// The snapshot fixes the machine: options that would change it (vCPUs,
    /// memory size and backing, devices, ACPI) are refused with it.
    #[arg(long, value_name = "DIR", conflicts_with_all = [
        "kernel", "initrd", "cmdline", "disk", "rng", "balloon", "cpus", "mem", "mem_boot", "hugepages",
        "no_acpi", "balloon_target", "balloon_no_reporting",
    ])]
    pub restore: Option<PathBuf>,
    /// Seccomp filters on every thread (allow-lists in ember-vmm's seccomp/):
    /// `trap` stops a forbidden system call and exits with status 4, naming it;
    /// `log` lets it through and has the kernel log it; `off` filters nothing.
    #[arg(long, value_enum, default_value_t = SeccompMode::Trap)]
    pub seccomp: SeccompMode,
}

/// `--seccomp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SeccompMode {
    /// A forbidden system call ends ember (status 4) with a line naming it.
    Trap,
    /// Forbidden system calls are allowed and logged by the kernel (audit log, dmesg).
    Log,
    /// No filters.
    Off,
}

impl From<SeccompMode> for seccomp::Mode {
    fn from(m: SeccompMode) -> Self {
        match m {
            SeccompMode::Trap => seccomp::Mode::Trap,
            SeccompMode::Log => seccomp::Mode::Log,
            SeccompMode::Off => seccomp::Mode::Off,
        }
    }
}

/// Where the guest's serial console goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConsoleMode {
    /// COM1 to stdout, and stdin to COM1.
    Serial,
    /// No console device.
    None,
}

/// The command line used when `--cmdline` is not given: the console on COM1,
/// reboot through the keyboard controller (which ember turns into an exit),
/// reboot at once on panic, and no probing for hardware ember does not have
/// (the Firecracker findings: every probe is a trap to the VMM).
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 pci=off 8250.nr_uarts=1 i8042.noaux i8042.nomux i8042.dumbkbd";

fn parse_device_set(json: &str) -> Result<DeviceSet, serde_json::Error> {
    serde_json::from_str(json)
}

impl BootArgs {
    /// The virtio devices asked for: handed over as JSON, or the options.
    fn device_set(&self) -> anyhow::Result<DeviceSet> {
        if let Some(d) = &self.devices_json {
            return Ok(d.clone());
        }
        let mut d = self.devices.device_set();
        d.net = self.net.clone();
        d.vsock = self.vsock.clone();
        let target = match &self.balloon_target {
            Some(t) => {
                let bytes = memory::parse_size(t)?;
                target_pages(bytes, memory::parse_size(&self.mem)?)
                    .map_err(|e| anyhow::anyhow!("--balloon-target {t}: {e}"))?;
                bytes
            }
            None => 0,
        };
        if d.balloon.is_some() || target > 0 {
            d.balloon = Some(BalloonConfig {
                target_bytes: target,
                free_page_reporting: !self.balloon_no_reporting,
            });
        }
        if let Some(boot) = &self.mem_boot {
            let (all, boot_bytes) = (memory::parse_size(&self.mem)?, memory::parse_size(boot)?);
            if boot_bytes >= all {
                anyhow::bail!("--mem-boot {boot} must be less than --mem {}", self.mem);
            }
            d.mem = Some(
                MemConfig::new(all - boot_bytes)
                    .map_err(|e| anyhow::anyhow!("--mem {} --mem-boot {boot}: {e}", self.mem))?,
            );
        }
        Ok(d)
    }

    /// The guest's boot RAM: `--mem-boot` when given, else all of `--mem`.
    fn boot_mem(&self) -> anyhow::Result<u64> {
        Ok(memory::parse_size(
            self.mem_boot.as_deref().unwrap_or(&self.mem),
        )?)
    }
}

/// Runs `ember boot`; returns the process exit status.
pub fn main(args: BootArgs) -> anyhow::Result<i32> {
    check_timeout(args.timeout)?;
    // Bound before any thread starts: binding sets the process's umask.
    let api = match &args.api_socket {
        Some(path) => Some(Arc::new(crate::api::ApiSocket::bind(path)?)),
        None => None,
    };
    // Filters are compiled, and the SIGSYS handler installed, before any
    // thread starts; each thread installs its own (`ember_vmm::seccomp`).
    seccomp::init(args.seccomp.into(), EXIT_SECCOMP)?;
    // A forbidden call on a raw terminal leaves it as it was found. (Only
    // that: the calling thread's filter may not allow removing a file.)
    seccomp::on_violation(crate::terminal::restore);
    let recorder = Arc::new(Recorder::new(args.devices.events.is_some()));
    let console: Option<Box<dyn Write + Send>> = match args.console {
        ConsoleMode::Serial => Some(Box::new(std::io::stdout())),
        ConsoleMode::None => None,
    };
    // A terminal goes raw: keys reach the guest as typed, Ctrl-A x quits.
    let serial = args.console == ConsoleMode::Serial;
    let raw = serial && crate::terminal::enter_raw()?;
    // `api` is held here until the end: the socket goes when it is dropped.
    let before_go = before_go(&args, api.clone(), serial, raw);
    let mut devices = args.device_set()?;
    start_passt(&mut devices.net, &args.publish)?;
    let machine = match &args.restore {
        Some(dir) => {
            // The snapshot's devices are its own: files given replace
            // its pmem devices' backing.
            let cfg = RestoreConfig {
                dir: dir.clone(),
                console,
                channel: args.channel.clone(),
                pmem: devices.pmem,
                net: devices.net,
                fs: devices.fs,
                vsock: devices.vsock,
                before_go: Some(before_go),
                memory: memory_options(&args)?,
            };
            restore::restore(cfg, recorder.clone())?
        }
        None => boot(&args, devices, console, before_go, recorder.clone())?,
    };
    let timeout = args.timeout.map(|t| Duration::from_secs_f64(t.max(0.0)));
    let code = exit_status(&args, &recorder, machine.wait(timeout));
    machine.finish_console();
    if let Some(path) = &args.devices.events {
        write_events(path, &recorder, &machine);
    }
    // `exit` runs no destructors: the terminal goes back and the control
    // socket goes first.
    crate::cleanup::run_all();
    // The VM's teardown is left to a process nobody waits for.
    machine.exit(code)
}

/// Refuses a `--timeout` that is not a usable number of seconds.
fn check_timeout(timeout: Option<f64>) -> anyhow::Result<()> {
    if let Some(t) = timeout {
        // Durations from floats panic on NaN, infinity and overflow: refuse them here.
        if t.is_nan() || t <= 0.0 {
            anyhow::bail!("--timeout must be a positive number of seconds, not {t}");
        }
        if t >= 1e9 {
            anyhow::bail!(
                "--timeout {t} is too large: it must be less than 1e9 seconds (31 years)"
            );
        }
    }
    Ok(())
}

/// What runs once the VM is complete and before it runs: a restored VM's
/// memory locked, the control socket served, stdin fed to COM1.
fn before_go(
    args: &BootArgs,
    api: Option<Arc<crate::api::ApiSocket>>,
    serial: bool,
    raw: bool,
) -> BeforeGo {
    // The control socket's and stdin's threads start once the VM is complete
    // and before it runs, from this thread while it is not yet filtered: each
    // takes its own seccomp filter instead of running under this thread's.
    // A fresh VM's memory is locked as it is made; a restored one's here.
    let lock_restored = args.mem_lock && args.restore.is_some();
    Box::new(move |machine: &Arc<Machine>| {
        if lock_restored {
            machine
                .lock_memory()
                .map_err(|e| io::Error::other(ember_vmm::error_chain(&e)))?;
        }
        if let Some(api) = &api {
            api.serve(crate::api::ApiContext {
                machine: machine.clone(),
            })
            .map_err(io::Error::other)?;
        }
        // Whatever stdin is (a terminal, a pipe; /dev/null ends at once)
        // feeds COM1: a restored guest waiting at a prompt takes its
        // command there.
        if serial {
            forward_stdin(machine.clone(), raw);
        }
        Ok(())
    })
}

/// The process's exit status for how the guest ended (`None`: it did not
/// within the timeout), saying why on stderr when it did not end well.
fn exit_status(
    args: &BootArgs,
    recorder: &Recorder,
    outcome: Option<Result<GuestEnd, EndError>>,
) -> i32 {
    match &outcome {
        Some(Ok(end)) => {
            recorder.mark(end.event_kind());
            if *end == GuestEnd::TripleFault {
                match damaged_memory(args) {
                    Some(why) => eprintln!("ember: {why}"),
                    None => eprintln!("ember: the guest crashed (triple fault)"),
                }
            }
            guest_end_status(*end)
        }
        Some(Err(why)) => {
            eprintln!(
                "ember: {}",
                damaged_memory(args).unwrap_or_else(|| why.to_string())
            );
            EXIT_GUEST_CRASHED
        }
        None => {
            eprintln!(
                "ember: the guest did not finish within {:.1} s",
                args.timeout.unwrap_or_default()
            );
            EXIT_TIMEOUT
        }
    }
}

/// Writes the run's timeline to `path` (`--events`).
fn write_events(path: &std::path::Path, recorder: &Recorder, machine: &Machine) {
    record_memory(recorder, machine);
    recorder.mark(kind::PROCESS_EXIT);
    // The guest's status is the answer the caller asked for: a timeline that cannot be
    // written is reported, and the status kept.
    let written = serde_json::to_vec_pretty(&recorder.snapshot())
        .map_err(io::Error::other)
        .and_then(|json| std::fs::write(path, json));
    if let Err(e) = written {
        eprintln!("ember: cannot write the events to {}: {e}", path.display());
    }
}

/// Starts a passt for each `--net passt` device and puts its socket in the
/// device's place (`--publish`'s forwards go to the first). passt is left to
/// end by itself: when this process (and with it the VMM's end of its
/// socket) goes.
fn start_passt(nets: &mut [NetConfig], publish: &[String]) -> anyhow::Result<()> {
    use ember_vmm::devices::virtio::net::NetBackendConfig;
    use std::os::fd::IntoRawFd;
    let is_passt = |n: &&mut NetConfig| n.backend == NetBackendConfig::Passt;
    if !nets.iter_mut().any(|n| is_passt(&n)) {
        if !publish.is_empty() {
            anyhow::bail!("--publish needs --net passt");
        }
        return Ok(());
    }
    let publish: Vec<passt::Publish> = publish
        .iter()
        .map(|p| p.parse())
        .collect::<Result<_, _>>()?;
    let guest = passt::GuestNet::from_host()?;
    for (i, n) in nets.iter_mut().filter(is_passt).enumerate() {
        let forwards = if i == 0 { &publish[..] } else { &[] };
        let (mut p, fd) = passt::Passt::start(&guest, forwards)?;
        p.wait_ready()?;
        n.backend = NetBackendConfig::Socket(fd.into_raw_fd());
        p.detach();
    }
    Ok(())
}

/// When a restored guest crashed: the damaged memory file that explains it,
/// if the snapshot's checksum says so (the guest is blamed otherwise).
fn damaged_memory(args: &BootArgs) -> Option<String> {
    match ember_vmm::snapshot::check_memory(args.restore.as_ref()?) {
        Err(e @ ember_vmm::snapshot::SnapshotError::MemoryDamaged(_)) => Some(e.to_string()),
        _ => None,
    }
}

/// Boots the kernel `args` name.
fn boot(
    args: &BootArgs,
    devices: DeviceSet,
    console: Option<Box<dyn Write + Send>>,
    before_go: BeforeGo,
    recorder: Arc<Recorder>,
) -> anyhow::Result<Arc<Machine>> {
    let Some(kernel) = args.kernel.clone() else {
        anyhow::bail!("give a kernel (--kernel FILE) or a snapshot (--restore DIR)");
    };
    let mem_size = args.boot_mem()?;
    check_images_once(&devices.disks, &devices.pmem)?;
    let cfg = VmConfig {
        kernel,
        initrd: args.initrd.clone(),
        cmdline: args
            .cmdline
            .clone()
            .unwrap_or_else(|| DEFAULT_CMDLINE.to_owned()),
        mem_size,
        vcpus: args.cpus,
        console,
        acpi: !args.devices.no_acpi,
        devices,
        channel: args.channel.clone(),
        memory: memory_options(args)?,
        before_go: Some(before_go),
    };
    builder::build(cfg, recorder).map_err(|e| anyhow::anyhow!(ember_vmm::error_chain(&e)))
}

/// Refuses an image used twice by this VM with a writer among its uses (two
/// `--disk`, a `--disk` and a `--pmem`): the second use would find the
/// first's lock, this VM's own, and be told another VM holds it.
fn check_images_once(disks: &[DiskConfig], pmem: &[PmemConfig]) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let uses = disks
        .iter()
        .map(|d| (d.path.as_path(), !d.read_only))
        .chain(pmem.iter().map(|p| (p.path.as_path(), true)));
    let mut seen: Vec<((u64, u64), &std::path::Path, bool)> = Vec::new();
    for (path, writes) in uses {
        // A path that cannot be looked up is left to its open, which says why.
        let Ok(m) = std::fs::metadata(path) else {
            continue;
        };
        let id = (m.dev(), m.ino());
        if let Some((_, first, first_writes)) = seen.iter().find(|(i, ..)| *i == id)
            && (writes || *first_writes)
        {
            let again = if *first == path {
                "is given twice".to_owned()
            } else {
                format!("is {} again", first.display())
            };
            anyhow::bail!(
                "{} {again}: one VM may use an image more than once only read-only (`,ro` on each --disk)",
                path.display()
            );
        }
        seen.push((id, path, writes));
    }
    Ok(())
}

/// `--prefault`, `--mem-lock`, `--hugepages` as memory options.
fn memory_options(args: &BootArgs) -> anyhow::Result<MemoryOptions> {
    let mut opts = MemoryOptions {
        mem_lock: args.mem_lock,
        hugepages: args.hugepages,
        ..MemoryOptions::default()
    };
    if let Some(p) = &args.prefault {
        opts.set_prefault(p)?;
    }
    Ok(opts)
}

/// Records the VMM's peak RSS and how much of it is guest memory, so the
/// VMM's own overhead can be told apart (`memory` event, sizes in KiB).
fn record_memory(recorder: &Recorder, machine: &Machine) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    let guest = machine.guest_resident_bytes() / 1024;
    recorder.mark_text(
        kind::MEMORY,
        &format!("vm_hwm_kib={hwm} guest_resident_kib={guest}"),
    );
}

/// Whether stdin is /dev/null (character device 1:3), which ends at once.
fn stdin_is_dev_null() -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    // stat (not open) through the descriptor's link.
    let Ok(stdin) = std::fs::metadata("/proc/self/fd/0") else {
        return false;
    };
    stdin.file_type().is_char_device() && stdin.rdev() == libc::makedev(1, 3)
}

/// Feeds stdin to COM1 from a helper thread. On a raw terminal the escape
/// keys are ember's: Ctrl-A x restores the terminal and ends the VM as a
/// guest power-off would.
fn forward_stdin(machine: Arc<Machine>, raw: bool) {
    if stdin_is_dev_null() {
        // Nothing to forward: no thread (nor its seccomp filter) to start.
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("ember-stdin".into())
        .spawn(move || {
            seccomp::confine_or_exit(seccomp::Thread::Stdin);
            let mut buf = [0u8; 64];
            let mut stdin = std::io::stdin().lock();
            let mut escape = crate::terminal::Escape::default();
            while let Ok(n @ 1..) = stdin.read(&mut buf) {
                let keys = match raw {
                    true => escape.feed(&buf[..n]),
                    false => crate::terminal::Keys {
                        guest: buf[..n].to_vec(),
                        ..Default::default()
                    },
                };
                if keys.help {
                    eprint!("{}", crate::terminal::HELP);
                }
                let mut rest = &keys.guest[..];
                while !rest.is_empty() {
                    let taken = machine.feed_console(rest);
                    rest = &rest[taken..];
                    if !rest.is_empty() {
                        // The UART's FIFO is full: let the guest drain it.
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                if keys.quit && raw {
                    crate::terminal::restore();
                    eprintln!("\nember: quit (Ctrl-A x)");
                    machine.exit(0);
                }
            }
        });
    if let Err(e) = spawned {
        log::warn!("no console input: {e}");
    }
}
