//! `ember run` and `ember setup` as the user writes them: their arguments,
//! and the values checked and derived from them before anything is built.

use super::error::ApplianceError;
use super::kernel;
use crate::backend;
use clap::Args;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The command's environment unless `--env` overrides an entry.
const DEFAULT_ENV: &[&str] = &[
    // busybox's applets last: the command's own files come first.
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/lib/ember/busybox",
    "HOME=/root",
    "TERM=linux",
];

/// Arguments of `ember run [OPTIONS] -- CMD…`: only what the appliance
/// honours. The devices a command can use ([`backend::DeviceArgs`]: disks
/// with all their options, pmem, rng, balloon, `--no-acpi`, `--events`) are
/// passed to the backend, which refuses in one line what it cannot do; what
/// the appliance owns itself (initrd, console, channel) clap refuses here
/// rather than the appliance dropping it; QEMU's `--machine` and `--bios`
/// are refused on the ember backend.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Kernel to boot; defaults to the one `ember setup` fetched.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Extra kernel command-line arguments, after the appliance's own.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory, with an optional K/M/G suffix (bytes without one); a
    /// whole number of MiB.
    #[arg(long, default_value = "256M", value_parser = backend::parse_mem_mib)]
    pub mem: u64,
    /// Boot with this much RAM and offer the rest of `--mem` as a
    /// virtio-mem region that the guest plugs and onlines as it boots
    /// (its driver loaded before any other device's): a large `--mem`
    /// then costs the boot no more than a small one. On QEMU a
    /// `virtio-mem-pci` device (q35).
    #[arg(long, value_name = "SIZE", value_parser = backend::parse_mem_mib)]
    pub mem_boot: Option<u64>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    #[command(flatten)]
    pub devices: backend::DeviceArgs,
    /// When guest memory is committed, as `ember boot --prefault` (ember
    /// backend only): `sync`, or `async[,window=SIZE]…` — which adds the
    /// balloon and loads its driver before any other device's, so the fence
    /// is up early in the boot.
    #[arg(long, value_name = "sync|async[,OPTIONS]")]
    pub prefault: Option<String>,
    /// Which VMM boots the appliance.
    #[arg(long, value_enum, default_value_t = backend::BackendKind::Auto)]
    pub backend: backend::BackendKind,
    /// qemu backend: machine type [default: q35].
    #[arg(long)]
    pub machine: Option<String>,
    /// qemu backend: the firmware, or `seabios` for the machine's own.
    /// Default: qboot where QEMU ships it — SeaBIOS searches PCI for boot
    /// devices and mirrors its screen to the serial port before it reaches
    /// the kernel that `-kernel` gives it anyway (`ember analyze --advise`
    /// measures it from SeaBIOS's own log).
    #[arg(long, value_name = "FILE|seabios")]
    pub bios: Option<String>,
    /// Give up after this many seconds (the VM is killed; exit status 124).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Set VAR=VALUE in the command's environment. Repeatable.
    #[arg(long, value_name = "VAR=VALUE")]
    pub env: Vec<String>,
    /// The command's working directory in the guest.
    #[arg(long)]
    pub workdir: Option<String>,
    /// Run from the initramfs appliance: the command and its files carried
    /// in (as `--rootfs`, `--bare`, `--with`, `--file` and `--nested-kvm`
    /// do), instead of on the host's root. Without it the guest's root is
    /// the host's, read-only over virtio-fs with a writable layer in guest
    /// memory: whatever runs on the host runs, and writes outside a
    /// `--share …,rw` vanish with the guest.
    #[arg(long)]
    pub initramfs: bool,
    /// Share this host directory with the command, at GUEST (default: the
    /// same path), read-only unless `,rw`: its writes reach the host, owned
    /// by the caller. Repeatable.
    #[arg(long, value_name = "DIR[:GUEST][,rw]")]
    pub share: Vec<String>,
    /// Run in a copy of this host directory instead of a minimal root (the
    /// initramfs appliance).
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Show the guest kernel's console.
    #[arg(long, short)]
    pub verbose: bool,
    /// qemu backend: the nested rig. The guest gets an emulated AMD SVM CPU
    /// (QEMU/TCG `-cpu max`) and loads kvm-amd before CMD, so CMD has a
    /// /dev/kvm (e.g. `-- ember boot --kernel …`). Give it memory
    /// (`--mem 2G`), 2 vCPUs and a generous `--timeout`.
    #[arg(long)]
    pub nested_kvm: bool,
    /// Carry this host file or directory into the guest at GUEST (default:
    /// the same path; the initramfs appliance). Symlinks are followed; a dynamically linked program
    /// brings its libraries. Repeatable.
    #[arg(long, value_name = "HOST[:GUEST]")]
    pub file: Vec<String>,
    /// Also carry this host command and its libraries (found on PATH), as CMD
    /// is (the initramfs appliance). Repeatable.
    #[arg(long = "with", value_name = "CMD")]
    pub with: Vec<String>,
    /// Carry only CMD (and `--with`) files: no busybox userland (a smaller
    /// initramfs appliance; the command cannot call `ls`, `cat`, … unless
    /// carried).
    #[arg(long)]
    pub bare: bool,
    /// Only build (or find) the appliance for CMD and print it as JSON (path,
    /// size, cached, milliseconds, the kernel command line and the backend
    /// a cold boot would use); do not boot.
    #[arg(long)]
    pub prepare_only: bool,
    /// Give the command a network, without privileges: user-mode, through
    /// passt (the host's addresses, routes and name servers; eth0 is
    /// configured before CMD starts). Without it the guest has none.
    #[arg(long)]
    pub net: bool,
    /// Forward the host's port HOST (on ADDR only, if given) to the guest's
    /// port GUEST; implies `--net`. Repeatable.
    #[arg(long, value_name = "[ADDR:]HOST:GUEST[/tcp|/udp]")]
    pub publish: Vec<String>,
    /// Give the guest the network namespace PATH's interface (one CNI made,
    /// `/var/run/netns/NAME`): its address, routes, MTU and MAC, the
    /// interface's traffic redirected to and from the guest with tc, as Kata
    /// Containers does. Needs root.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["net", "publish"])]
    pub netns: Option<PathBuf>,
    /// ember backend: boot the appliance cold instead of restoring (or
    /// making) its snapshot. Runs with disks, pmem, rng, a balloon,
    /// `--rootfs` or `--nested-kvm` always boot cold.
    #[arg(long)]
    pub no_snapshot: bool,
    /// The command to run in the guest, and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// The virtio-mem region `--mem-boot` asks for: the rest of `--mem`.
pub fn mem_region(
    args: &RunArgs,
) -> Result<Option<ember_vmm::devices::virtio::MemConfig>, ApplianceError> {
    let Some(boot) = args.mem_boot else {
        return Ok(None);
    };
    if boot >= args.mem {
        return Err(ApplianceError::BadArg(format!(
            "--mem-boot {boot}M must be less than --mem {}M",
            args.mem
        )));
    }
    ember_vmm::devices::virtio::MemConfig::new((args.mem - boot) << 20)
        .map(Some)
        .map_err(|e| ApplianceError::BadArg(format!("--mem {}M --mem-boot {boot}M: {e}", args.mem)))
}

/// Arguments of `ember setup`.
#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    /// Use this kernel instead of downloading Debian's cloud kernel (its
    /// modules are looked up by version in the cache and /lib/modules).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
}

/// Parses `256M`, `1G`, `512K` or bytes (the VMM's size syntax) into MiB.
pub fn parse_mem_mib(s: &str) -> Result<u64, ApplianceError> {
    backend::parse_mem_mib(s).map_err(|e| ApplianceError::BadArg(format!("bad --mem: {e}")))
}

/// Whether the run has a network (`--net`, or `--publish`, which implies it).
pub(super) fn wants_net(args: &RunArgs) -> bool {
    args.net || !args.publish.is_empty()
}

/// `--publish` parsed.
pub(super) fn publish(args: &RunArgs) -> Result<Vec<crate::passt::Publish>, ApplianceError> {
    Ok(args
        .publish
        .iter()
        .map(|p| p.parse())
        .collect::<Result<_, _>>()?)
}

/// `--timeout` as a duration.
pub(super) fn timeout(args: &RunArgs) -> Result<Option<Duration>, ApplianceError> {
    match args.timeout {
        // Durations from floats panic on NaN, infinity and overflow: refuse them here.
        Some(t) if t.is_finite() && t > 0.0 && t < 1e9 => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) => Err(ApplianceError::BadArg(format!("bad --timeout {t}"))),
        None => Ok(None),
    }
}

/// Whether `--prefault` asks for `async`, which is fenced by the balloon: the
/// VM gets one and the guest its driver.
pub(super) fn prefault_fenced(args: &RunArgs) -> bool {
    args.prefault
        .as_deref()
        .is_some_and(|p| p.split(',').next().map(str::trim) == Some("async"))
}

/// The environment: defaults, then `--env` entries (same name replaces).
pub(super) fn environment(extra: &[String]) -> Result<Vec<String>, ApplianceError> {
    let mut env: Vec<String> = DEFAULT_ENV.iter().map(|s| s.to_string()).collect();
    for e in extra {
        let Some((name, _)) = e.split_once('=').filter(|(n, _)| !n.is_empty()) else {
            return Err(ApplianceError::BadArg(format!(
                "bad --env `{e}` (want NAME=VALUE)"
            )));
        };
        env.retain(|x| x.split_once('=').map(|(n, _)| n) != Some(name));
        env.push(e.clone());
    }
    Ok(env)
}

/// `--no-acpi` with a kernel that can boot that way. Without ACPI the devices reaching here are virtio-mmio ones named on the
/// kernel command line (ember, QEMU microvm), which only a kernel built with
/// CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES reads; Debian's cloud kernel is not,
/// and would wait for its channel until the timeout. Refused up front when
/// the kernel's configuration says so.
pub(super) fn no_acpi_check(kernel_arg: Option<&Path>) -> Result<(), ApplianceError> {
    let k = kernel::find_kernel(kernel_arg, &kernel::cache_dir()?)?;
    if kernel::config_has(&k, "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES") == Some(false) {
        return Err(ApplianceError::BadArg(format!(
            "--no-acpi: kernel {} cannot find virtio-mmio devices without ACPI \
             (built without CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES)",
            k.version.as_deref().unwrap_or("?")
        )));
    }
    Ok(())
}

/// The QEMU machine a run asks for.
pub(super) fn machine(args: &RunArgs) -> &str {
    args.machine.as_deref().unwrap_or(DEFAULT_MACHINE)
}

/// QEMU's machine when `--machine` is not given: q35 (PCI devices, found
/// with or without ACPI; microvm has no memory-device area for pmem).
const DEFAULT_MACHINE: &str = "q35";

/// The QEMU firmware an appliance boots through (see `--bios`).
pub(super) fn appliance_bios(args: &RunArgs) -> Option<PathBuf> {
    match args.bios.as_deref() {
        Some("seabios") => None,
        Some(path) => Some(PathBuf::from(path)),
        // microvm has its own minimal firmware.
        None if machine(args).starts_with("microvm") => None,
        None => {
            let qboot = Path::new(crate::backend::qemu::QBOOT);
            qboot.is_file().then(|| qboot.to_path_buf())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_defaults() {
        let e = environment(&["PATH=/x".into(), "A=b=c".into()]).unwrap();
        assert!(e.contains(&"PATH=/x".to_string()));
        assert!(!e.iter().any(|x| x.starts_with("PATH=/usr")));
        assert!(e.contains(&"A=b=c".to_string()));
        assert!(environment(&["novalue".into()]).is_err());
        assert!(environment(&["=v".into()]).is_err());
    }

    #[test]
    fn mem_sizes() {
        assert_eq!(parse_mem_mib("256M").unwrap(), 256);
        assert_eq!(parse_mem_mib("1g").unwrap(), 1024);
        assert_eq!(parse_mem_mib("524288K").unwrap(), 512);
        assert_eq!(parse_mem_mib("1048576").unwrap(), 1);
        for bad in ["", "M", "12Q", "-1M", "0", "99999999999999G"] {
            assert!(parse_mem_mib(bad).is_err(), "{bad}");
        }
    }
}
