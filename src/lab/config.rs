//! The guest and VMM options every lab command shares, turned into a
//! [`BootConfig`]; the `--vs` override syntax; and the host description that
//! heads every report.

use super::analysis::Milestones;
use super::record::BootConfig;
use crate::backend::qemu::{Accel, QemuBackend};
use crate::backend::{
    Backend, BackendError, BackendKind, EmberBackend, GuestSpec, find_binary, parse_mem_mib,
};
use clap::Args;
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Configuration errors.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The backend cannot be used.
    #[error("cannot use the backend")]
    Backend(#[source] BackendError),
    /// The generated initramfs could not be built.
    #[error("cannot build the busybox initramfs")]
    Guest(#[source] super::guest::GuestError),
    /// The appliance's initramfs (the default) could not be built.
    #[error(
        "no --initrd given, and the appliance's initramfs cannot be built \
         (pass --initrd FILE, --busybox-init or --no-initrd)"
    )]
    Appliance(#[source] crate::appliance::ApplianceError),
    /// An option value makes no sense.
    #[error("{0}")]
    Invalid(String),
    /// A regex option does not compile.
    #[error("bad regex in {option}: {reason}")]
    Regex {
        /// The option.
        option: String,
        /// Why, on one line.
        reason: String,
    },
}

/// Accelerator choice for the QEMU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum AccelArg {
    /// KVM when the CPU virtualizes in hardware, else TCG.
    Auto,
    /// KVM.
    Kvm,
    /// TCG (software CPU).
    Tcg,
}

/// What to boot and with which VMM (shared by `bench`, `analyze`, `bench-range`).
#[derive(Debug, Clone, Args)]
pub struct GuestOpts {
    /// Which VMM boots the guest.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    pub backend: BackendKind,
    /// QEMU machine type (`q35`, `microvm`, …).
    #[arg(long, default_value = "q35")]
    pub machine: String,
    /// QEMU accelerator.
    #[arg(long, value_enum, default_value_t = AccelArg::Auto)]
    pub accel: AccelArg,
    /// The VMM binary to run instead of the default one (`qemu-system-x86_64`
    /// on PATH, or this ember).
    #[arg(long, value_name = "PATH")]
    pub vmm: Option<PathBuf>,
    /// Guest kernel; defaults to the one `ember setup` fetched.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Guest initramfs. Without it (and without `--busybox-init` or
    /// `--no-initrd`) the lab boots ember's appliance, as libguestfs's
    /// boot-benchmark boots its own: the initramfs `ember run` boots, without
    /// a command — ember-init and the kernel's virtio console and transport
    /// modules, built and cached as `ember run` builds its own (it needs
    /// ember-init, and the modules `ember setup` unpacked for the default
    /// kernel). Its init loads the modules, says it has no channel to take a
    /// command from, and powers off.
    #[arg(long, conflicts_with_all = ["busybox_init", "no_initrd"])]
    pub initrd: Option<PathBuf>,
    /// Use a generated initramfs instead: busybox with an /init that prints the
    /// lab's markers and powers off at once (see `ember::lab::guest`).
    #[arg(long, conflicts_with = "no_initrd")]
    pub busybox_init: bool,
    /// Boot with no initramfs at all: for a kernel with one built in, or a
    /// guest that is not Linux.
    #[arg(long)]
    pub no_initrd: bool,
    /// Kernel command line. A boot whose kernel panics is ended at its panic
    /// line and reported as panicked, with that line, whatever `panic=` says.
    /// The default's `no_timer_check` skips the IO-APIC timer check, as
    /// `ember run`'s appliance does: under TCG on a loaded host it can miss
    /// its ticks and panic ("IO-APIC + timer doesn't work!").
    #[arg(long, default_value = "console=ttyS0 panic=-1 no_timer_check")]
    pub cmdline: String,
    /// Guest memory, with an optional K/M/G suffix (bytes without one); a
    /// whole number of MiB.
    #[arg(long, default_value = "256M", value_parser = parse_mem_mib)]
    pub mem: u64,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// Per-boot timeout, seconds: a boot still running then is killed and
    /// reported as timed out (never averaged in).
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Console line (regex) that means userspace runs.
    #[arg(
        long,
        value_name = "REGEX",
        default_value = "^Run /init as init process|^ember-lab: |^ember-test-guest: ring 3"
    )]
    pub userspace: String,
    /// QEMU backend: the firmware image (`-bios`), e.g. qboot
    /// (`/usr/share/qemu/qboot.rom`) instead of the machine's SeaBIOS.
    #[arg(long, value_name = "FILE")]
    pub bios: Option<PathBuf>,
    /// QEMU backend: put the firmware's debug port (0x402) on the console
    /// too, so SeaBIOS's own log is timestamped with the kernel's.
    #[arg(long)]
    pub firmware_log: bool,
    /// QEMU backend under TCG: count the guest's instructions (`-icount
    /// shift=0,sleep=off`). The guest's clock then advances 1 ns per
    /// instruction, so the kernel's timestamps, the initcall times and
    /// `--verify`'s savings (but a firmware's, which runs before the kernel's
    /// clock) measure the work the guest does, the same on a loaded machine
    /// as on a quiet one. Wall times are then not the guest's.
    #[arg(long)]
    pub icount: bool,
    /// Extra boot mark: NAME=REGEX on console lines (printk prefix stripped).
    /// Repeatable; reported in the given order.
    #[arg(long = "mark", value_name = "NAME=REGEX")]
    pub marks: Vec<String>,
}

/// Keys `--vs` understands.
const VS_KEYS: &[&str] = &[
    "backend", "machine", "accel", "vmm", "kernel", "initrd", "cmdline", "cmdline+", "mem", "cpus",
    "bios",
];

/// Applies a `--vs` description such as
/// `backend=qemu,machine=microvm,cmdline+=quiet` to a copy of `base`.
/// A comma only separates pairs when a known key follows it, so values may
/// contain commas (`cmdline=console=ttyS0,115200`). `cmdline+=` appends.
pub fn apply_vs(base: &GuestOpts, vs: &str) -> Result<GuestOpts, ConfigError> {
    let starts_pair = |s: &str| {
        VS_KEYS
            .iter()
            .any(|k| s.strip_prefix(k).is_some_and(|r| r.starts_with('=')))
    };
    let mut pairs: Vec<String> = Vec::new();
    for piece in vs.split(',') {
        match pairs.last_mut() {
            Some(last) if !starts_pair(piece) => {
                last.push(',');
                last.push_str(piece);
            }
            _ => pairs.push(piece.to_owned()),
        }
    }
    let mut o = base.clone();
    for pair in pairs {
        let bad = || {
            ConfigError::Invalid(format!(
                "--vs: expected KEY=VALUE with KEY one of {}, got `{pair}`",
                VS_KEYS.join(", ")
            ))
        };
        let (key, value) = pair.split_once('=').ok_or_else(bad)?;
        let number = |v: &str| {
            v.parse::<u64>().map_err(|_| {
                ConfigError::Invalid(format!("--vs: `{key}` needs a number, got `{v}`"))
            })
        };
        match key {
            "backend" => {
                o.backend = <BackendKind as clap::ValueEnum>::from_str(value, true)
                    .map_err(|_| ConfigError::Invalid(format!("--vs: unknown backend `{value}`")))?
            }
            "machine" => o.machine = value.into(),
            "accel" => {
                o.accel = <AccelArg as clap::ValueEnum>::from_str(value, true)
                    .map_err(|_| ConfigError::Invalid(format!("--vs: unknown accel `{value}`")))?
            }
            "vmm" => o.vmm = Some(value.into()),
            "kernel" => o.kernel = Some(value.into()),
            "initrd" => {
                // B boots this one, whatever A boots.
                o.initrd = Some(value.into());
                o.busybox_init = false;
                o.no_initrd = false;
            }
            "cmdline" => o.cmdline = value.into(),
            "cmdline+" => {
                o.cmdline.push(' ');
                o.cmdline.push_str(value);
            }
            "mem" => {
                o.mem = parse_mem_mib(value)
                    .map_err(|e| ConfigError::Invalid(format!("--vs: `mem`: {e}")))?
            }
            "cpus" => o.cpus = number(value)? as u32,
            "bios" => o.bios = Some(value.into()),
            _ => return Err(bad()),
        }
    }
    Ok(o)
}

/// Builds the backend `opts` asks for.
pub fn backend(opts: &GuestOpts) -> Result<Arc<dyn Backend>, ConfigError> {
    let check = |name: &str, p: &PathBuf| {
        find_binary(&p.to_string_lossy()).ok_or_else(|| {
            ConfigError::Backend(BackendError::MissingBinary {
                name: name.into(),
                binary: p.display().to_string(),
            })
        })
    };
    let backend = opts.backend.resolve();
    if opts.icount && backend != BackendKind::Qemu {
        return Err(ConfigError::Invalid(
            "--icount counts instructions under QEMU's TCG: it needs --backend qemu".into(),
        ));
    }
    match backend {
        BackendKind::Ember | BackendKind::Auto => {
            let binary = match &opts.vmm {
                Some(p) => check("ember", p)?,
                None => {
                    EmberBackend::current()
                        .map_err(ConfigError::Backend)?
                        .binary
                }
            };
            Ok(Arc::new(EmberBackend { binary }))
        }
        BackendKind::Qemu => {
            let accel = match opts.accel {
                AccelArg::Auto => Accel::Auto,
                AccelArg::Kvm => Accel::Kvm,
                AccelArg::Tcg => Accel::Tcg,
            };
            let mut q = match &opts.vmm {
                // Resolve the accelerator without requiring the default binary.
                Some(p) => QemuBackend {
                    binary: check("qemu", p)?,
                    machine: opts.machine.clone(),
                    accel,
                    bios: None,
                    firmware_log: false,
                    icount: false,
                },
                None => QemuBackend::detect(&opts.machine, accel).map_err(ConfigError::Backend)?,
            };
            q.bios = opts.bios.clone();
            q.firmware_log = opts.firmware_log;
            q.icount = opts.icount;
            if q.accel == Accel::Auto {
                q.accel = if crate::backend::qemu::hardware_kvm_usable() {
                    Accel::Kvm
                } else {
                    Accel::Tcg
                };
            }
            Ok(Arc::new(q))
        }
    }
}

/// Builds a boot configuration and its milestones.
pub fn build(opts: &GuestOpts, label: &str) -> Result<(BootConfig, Milestones), ConfigError> {
    let kernel = match &opts.kernel {
        Some(k) => k.clone(),
        None => default_kernel()?,
    };
    for (what, p) in [("kernel", Some(&kernel)), ("initrd", opts.initrd.as_ref())] {
        if let Some(p) = p {
            if !p.is_file() {
                return Err(ConfigError::Invalid(format!(
                    "{what} {} does not exist",
                    p.display()
                )));
            }
        }
    }
    // Bounded too: a float too large for a `Duration` would panic later.
    if !(opts.timeout > 0.0 && opts.timeout < 1e9) {
        return Err(ConfigError::Invalid(
            "--timeout must be a positive number of seconds".into(),
        ));
    }
    let milestones = milestones(opts)?;
    let backend = backend(opts)?;
    let mut spec = GuestSpec::new(&kernel);
    let (initrd, held) = initrd(opts, backend.as_ref())?;
    spec.initrd = initrd;
    spec.cmdline = opts.cmdline.clone();
    spec.mem_mib = opts.mem;
    spec.cpus = opts.cpus;
    let cfg = BootConfig {
        label: label.into(),
        backend,
        spec,
        timeout: Duration::from_secs_f64(opts.timeout),
        held,
    };
    Ok((cfg, milestones))
}

/// The initramfs `opts` boots with on `backend`: `--initrd`, the generated
/// busybox one, none, or by default the appliance's for `--kernel` (or, as
/// `ember run` finds it, the default kernel with its modules), held while
/// the lab boots it.
fn initrd(opts: &GuestOpts, backend: &dyn Backend) -> Result<Held, ConfigError> {
    if opts.busybox_init {
        return super::guest::busybox_initramfs()
            .map(|p| (Some(p), None))
            .map_err(ConfigError::Guest);
    }
    if opts.no_initrd {
        return Ok((None, None));
    }
    match &opts.initrd {
        Some(path) => Ok((Some(path.clone()), None)),
        None => super::guest::appliance_initramfs(opts.kernel.as_deref(), backend)
            .map(|(p, held)| (Some(p), held))
            .map_err(ConfigError::Appliance),
    }
}

/// An initramfs (if any) and, for a cached one, its file held open.
type Held = (Option<PathBuf>, Option<Arc<std::fs::File>>);

/// The kernel `ember setup` fetched (as `ember run` finds it).
fn default_kernel() -> Result<PathBuf, ConfigError> {
    let none = |e: &dyn std::fmt::Display| {
        ConfigError::Invalid(format!(
            "no --kernel given and no default kernel ({e}): run `ember setup` or pass --kernel"
        ))
    };
    let cache = crate::appliance::kernel::cache_dir().map_err(|e| none(&e))?;
    crate::appliance::kernel::find_kernel(None, &cache)
        .map(|k| k.image)
        .map_err(|e| none(&e))
}

/// The milestones (`--mark`, `--userspace`) of `opts`.
pub fn milestones(opts: &GuestOpts) -> Result<Milestones, ConfigError> {
    let compile = |option: &str, re: &str| {
        Regex::new(re).map_err(|e| ConfigError::Regex {
            option: option.into(),
            reason: super::activities::regex_reason(&e),
        })
    };
    let mut m = Milestones {
        userspace: compile("--userspace", &opts.userspace)?,
        ..Milestones::default()
    };
    for mark in &opts.marks {
        let (name, re) = mark.split_once('=').ok_or_else(|| {
            ConfigError::Invalid(format!("--mark: expected NAME=REGEX, got `{mark}`"))
        })?;
        m.marks
            .push((name.to_owned(), compile(&format!("--mark {name}"), re)?));
    }
    Ok(m)
}

/// How long a VMM may take to answer `--version`.
const VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// The backend's version, asked on a helper thread so a VMM binary that hangs
/// on `--version` delays the report by `limit` at most.
fn version_within(cfg: &BootConfig, limit: Duration) -> String {
    let backend = cfg.backend.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(backend.version());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => format!("unknown ({e})"),
        Err(_) => format!(
            "unknown (no answer to --version within {} s)",
            limit.as_secs()
        ),
    }
}

/// The machine and configuration a report was made on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    /// `uname -n`.
    pub host: String,
    /// Host kernel release and version.
    pub host_kernel: String,
    /// CPU model and count.
    pub host_cpu: String,
    /// Backend name.
    pub backend: String,
    /// Its version string.
    pub backend_version: String,
    /// How it runs guests (accelerator, machine).
    pub accel: String,
    /// Guest kernel.
    pub kernel: String,
    /// Guest initramfs.
    pub initrd: Option<String>,
    /// Command line.
    pub cmdline: String,
    /// vCPUs.
    pub cpus: u32,
    /// Memory, MiB.
    pub mem_mib: u64,
}

impl Header {
    /// Describes the host and `cfg`.
    pub fn new(cfg: &BootConfig) -> Header {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        let cpuinfo = read("/proc/cpuinfo");
        let model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')))
            .map(|(_, m)| m.trim().to_owned())
            .unwrap_or_else(|| "unknown".into());
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Header {
            host: read("/proc/sys/kernel/hostname"),
            host_kernel: format!(
                "Linux {} {}",
                read("/proc/sys/kernel/osrelease"),
                read("/proc/sys/kernel/version")
            ),
            host_cpu: format!("{model} ({cpus} CPUs)"),
            backend: cfg.backend.name().to_owned(),
            backend_version: version_within(cfg, VERSION_TIMEOUT),
            accel: cfg.backend.describe(),
            kernel: cfg.spec.kernel.display().to_string(),
            initrd: cfg.spec.initrd.as_ref().map(|p| p.display().to_string()),
            cmdline: cfg.spec.cmdline.clone(),
            cpus: cfg.spec.cpus,
            mem_mib: cfg.spec.mem_mib,
        }
    }

    /// The paper-style aligned block.
    pub fn render(&self, label: Option<&str>) -> String {
        let mut s = String::new();
        let mut row = |k: &str, v: &str| s.push_str(&format!("{k:>13}: {v}\n"));
        if let Some(l) = label {
            row("config", l);
        }
        row("host", &self.host);
        row("host kernel", &self.host_kernel);
        row("host CPU", &self.host_cpu);
        row(
            "backend",
            &format!("{} — {}", self.backend, self.backend_version),
        );
        row("runs on", &self.accel);
        row("vCPUs", &self.cpus.to_string());
        row("memory", &format!("{} MiB", self.mem_mib));
        row("kernel", &self.kernel);
        row("initrd", self.initrd.as_deref().unwrap_or("(none)"));
        row("cmdline", &self.cmdline);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        g: GuestOpts,
    }

    fn opts(args: &[&str]) -> GuestOpts {
        Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).g
    }

    #[test]
    fn vs_overrides_keys_and_keeps_commas_in_values() {
        let base = opts(&["--backend", "qemu", "--cmdline", "console=ttyS0"]);
        let b = apply_vs(&base, "machine=microvm,cmdline+=quiet,loglevel=3,cpus=2").unwrap();
        assert_eq!(b.initrd, None);
        for a in [&["--busybox-init"][..], &["--no-initrd"]] {
            let b = apply_vs(&opts(a), "initrd=/b.cpio").unwrap();
            assert_eq!(b.initrd.as_deref(), Some(std::path::Path::new("/b.cpio")));
            assert!(!b.busybox_init && !b.no_initrd, "{a:?}");
        }
        assert_eq!(b.machine, "microvm");
        assert_eq!(b.cmdline, "console=ttyS0 quiet,loglevel=3");
        assert_eq!(b.cpus, 2);
        assert_eq!(b.backend, BackendKind::Qemu);
        assert_eq!(apply_vs(&base, "mem=1G").unwrap().mem, 1024);
        assert!(apply_vs(&base, "mem=lots").is_err());
        assert!(apply_vs(&base, "backend=bochs").is_err());
        assert!(apply_vs(&base, "colour=red").is_err());
        assert!(
            apply_vs(&base, "cpus=two")
                .unwrap_err()
                .to_string()
                .contains("number")
        );
        assert!(apply_vs(&base, "accel=warp").is_err());
    }

    #[test]
    fn bad_options_are_clear_errors() {
        assert_eq!(opts(&["--mem", "1G"]).mem, 1024);
        assert_eq!(opts(&[]).mem, 256);
        assert_eq!(opts(&[]).backend, BackendKind::Auto);
        let e = build(&opts(&["--kernel", "/nonexistent/k"]), "A").unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        let e = backend(&opts(&["--backend", "qemu", "--vmm", "/nonexistent/qemu"]))
            .err()
            .unwrap();
        let chain = format!("{:#}", anyhow::Error::from(e));
        assert!(chain.contains("/nonexistent/qemu` not found"), "{chain}");
        let e = milestones(&opts(&["--mark", "x=("])).unwrap_err();
        assert_eq!(e.to_string(), "bad regex in --mark x: unclosed group");
        assert!(milestones(&opts(&["--mark", "nonsense"])).is_err());
        let e = backend(&opts(&["--backend", "ember", "--icount"]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("--backend qemu"), "{e}");
    }
}
