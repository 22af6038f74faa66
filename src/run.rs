//! `ember run`: boot a kernel directly on KVM, or (with a trailing command)
//! run that command in a fresh appliance VM.

use crate::builder::{self, VmConfig, Vmm};
use crate::devices::legacy::{GuestEnd, Serial};
use crate::devices::virtio::DiskConfig;
use crate::events::{Recorder, kind};
use crate::vstate::memory;
use clap::Args;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Arguments of `ember run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Kernel: ELF vmlinux (with or without a PVH note) or bzImage. In appliance
    /// mode, defaults to the kernel `ember setup` fetched.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initramfs.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory, with an optional K/M/G suffix (bytes without one).
    #[arg(long, default_value = "256M")]
    pub mem: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// Where the guest's COM1 goes.
    #[arg(long, value_enum, default_value_t = ConsoleMode::Serial)]
    pub console: ConsoleMode,
    /// Write the VMM-side boot timeline (JSON) here.
    #[arg(long, value_name = "FILE.json")]
    pub events: Option<PathBuf>,
    /// A virtio-blk disk: PATH[,ro][,direct][,serial=ID][,poll=US]. Repeatable.
    #[arg(long, value_name = "PATH[,ro][,direct][,serial=ID][,poll=US]")]
    pub disk: Vec<String>,
    /// A virtio-pmem region backed by this file (a DAX root). Repeatable.
    #[arg(long)]
    pub pmem: Vec<PathBuf>,
    /// Add a virtio-rng device (guest entropy from the host's getrandom).
    #[arg(long)]
    pub rng: bool,
    /// Add a virtio-balloon device (statistics, free page reporting).
    #[arg(long)]
    pub balloon: bool,
    /// Connect a virtio-console port to this unix socket (the appliance's data channel).
    #[arg(long)]
    pub channel: Option<PathBuf>,
    /// Describe devices with an MP table and the command line only (no ACPI tables).
    #[arg(long)]
    pub no_acpi: bool,
    /// Appliance mode: which VMM boots the appliance: `ember`, `qemu`, or `auto`
    /// (ember where KVM has hardware virtualization, QEMU with TCG elsewhere).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Appliance mode, qemu backend: machine type.
    #[arg(long, default_value = "q35")]
    pub machine: String,
    /// Give up after this many seconds (the VM is killed; exit status 124).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Appliance mode: set VAR=VALUE in the command's environment. Repeatable.
    #[arg(long, value_name = "VAR=VALUE")]
    pub env: Vec<String>,
    /// Appliance mode: the command's working directory in the guest.
    #[arg(long)]
    pub workdir: Option<String>,
    /// Appliance mode: run in a copy of this host directory instead of a minimal root.
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Appliance mode: show the guest kernel's console.
    #[arg(long, short)]
    pub verbose: bool,
    /// Appliance mode: only build (or find) the appliance for CMD and print
    /// it as JSON (path, size, cached, milliseconds); do not boot.
    #[arg(long)]
    pub prepare_only: bool,
    /// Appliance mode: the command to run in the guest, and its arguments.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Where the guest's serial console goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConsoleMode {
    /// COM1 to stdout (and stdin when it is a terminal).
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

/// Runs `ember run`; returns the process exit status.
pub fn main(args: RunArgs) -> anyhow::Result<i32> {
    if let Some(t) = args.timeout {
        // Durations from floats panic on NaN, infinity and overflow: refuse them here.
        if !(t.is_finite() && t > 0.0 && t < 1e9) {
            anyhow::bail!("--timeout must be a positive number of seconds, not {t}");
        }
    }
    if !args.command.is_empty() {
        return crate::appliance::run_command(&args);
    }
    let Some(kernel) = args.kernel.clone() else {
        anyhow::bail!(
            "give a kernel (--kernel FILE), or a command to run in the appliance (ember run -- CMD)"
        );
    };
    let mem_size = memory::parse_size(&args.mem)?;
    let recorder = Arc::new(Recorder::new(args.events.is_some()));
    let console: Option<Box<dyn Write + Send>> = match args.console {
        ConsoleMode::Serial => Some(Box::new(std::io::stdout())),
        ConsoleMode::None => None,
    };
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
        acpi: !args.no_acpi,
        disks: args
            .disk
            .iter()
            .map(|d| DiskConfig::parse(d))
            .collect::<Result<_, _>>()?,
        channel: args.channel.clone(),
        rng: args.rng,
        pmem: args.pmem.clone(),
        balloon: args.balloon,
    };
    let vmm = builder::build(cfg, recorder.clone())
        .map_err(|e| anyhow::anyhow!(builder::error_chain(&e)))?;
    if args.console == ConsoleMode::Serial && std::io::stdin().is_terminal() {
        forward_stdin(vmm.serial.clone());
    }
    let outcome = wait(&vmm, args.timeout);
    let code = match &outcome {
        Some(Ok(end)) => {
            recorder.mark(end.event_kind());
            if *end == GuestEnd::TripleFault {
                eprintln!("ember: the guest crashed (triple fault)");
            }
            end.exit_status()
        }
        Some(Err(why)) => {
            eprintln!("ember: {why}");
            EXIT_GUEST_CRASHED
        }
        None => {
            eprintln!(
                "ember: the guest did not finish within {:.1} s",
                args.timeout.unwrap_or_default()
            );
            EXIT_TIMEOUT
        }
    };
    finish_console(&vmm);
    if let Some(path) = &args.events {
        record_memory(&recorder, &vmm);
        recorder.mark(kind::PROCESS_EXIT);
        let json = serde_json::to_vec_pretty(&recorder.snapshot())?;
        std::fs::write(path, json)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    // The VM's teardown is left to a process nobody waits for.
    crate::vstate::teardown::exit(code, vmm.vm.fd().as_raw_fd())
}

/// Waits for the guest to end; `None` when `timeout` (seconds) passes first.
fn wait(vmm: &Vmm, timeout: Option<f64>) -> Option<Result<GuestEnd, String>> {
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    loop {
        if let Some(outcome) = vmm.end.outcome() {
            return Some(outcome);
        }
        let wait_ms = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return None;
                }
                i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
            }
            None => -1,
        };
        let mut pfd = libc::pollfd {
            fd: vmm.end.eventfd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call and the count is 1.
        unsafe { libc::poll(&mut pfd, 1, wait_ms) };
    }
}

/// Records the VMM's peak RSS and how much of it is guest memory, so the
/// VMM's own overhead can be told apart (`memory` event, sizes in KiB).
fn record_memory(recorder: &Recorder, vmm: &Vmm) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    let guest = crate::vstate::memory::resident_bytes(&vmm.mem) / 1024;
    recorder.mark_text(
        kind::MEMORY,
        &format!("vm_hwm_kib={hwm} guest_resident_kib={guest}"),
    );
}

/// Flushes a trailing partial console line into the timeline.
fn finish_console(vmm: &Vmm) {
    let mut serial = vmm.serial.lock().unwrap_or_else(|p| p.into_inner());
    serial.0.writer_mut().finish();
}

/// Feeds terminal input to COM1 from a helper thread.
fn forward_stdin(serial: Arc<Mutex<Serial>>) {
    let spawned = std::thread::Builder::new()
        .name("ember-stdin".into())
        .spawn(move || {
            let mut buf = [0u8; 64];
            let mut stdin = std::io::stdin().lock();
            while let Ok(n @ 1..) = stdin.read(&mut buf) {
                let mut rest = &buf[..n];
                while !rest.is_empty() {
                    let taken = serial
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                        .enqueue_raw_bytes(rest)
                        .unwrap_or(0);
                    rest = &rest[taken..];
                    if !rest.is_empty() {
                        // The UART's FIFO is full: let the guest drain it.
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        log::warn!("no console input: {e}");
    }
}

/// Exit status when the guest asked for a reset (reboot).
pub const EXIT_GUEST_RESET: i32 = 2;
/// Exit status when the guest crashed (triple fault) or KVM could not run it.
pub const EXIT_GUEST_CRASHED: i32 = 3;
/// Exit status when `--timeout` expired.
pub const EXIT_TIMEOUT: i32 = 124;
