//! Backends: the VMMs a guest can be booted with. The boot lab and the
//! appliance describe *what* to boot as a [`GuestSpec`]; a [`Backend`] turns
//! that into a command line for its VMM. Adding Firecracker or Cloud
//! Hypervisor means adding one more implementation of [`Backend`].

pub mod qemu;
pub mod virtiofsd;

use ember_vmm::devices::virtio::{BalloonConfig, DiskConfig, FsConfig, PmemConfig, RngConfig};
use ember_vmm::machine::DeviceSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// Backend errors.
#[derive(Debug, Error)]
pub enum BackendError {
    /// The VMM binary is not installed or not executable.
    #[error("{name}: `{binary}` not found or not executable (install it, or pass its path)")]
    MissingBinary {
        /// Backend name.
        name: String,
        /// The binary we looked for.
        binary: String,
    },
    /// Running the VMM to ask its version failed.
    #[error("{0}: could not query its version")]
    Version(String, #[source] std::io::Error),
    /// The spec asks for something this backend cannot do.
    #[error("{backend} cannot {what}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// What it cannot do.
        what: String,
    },
    /// An unknown backend name.
    #[error("unknown backend `{0}` (known: auto, ember, qemu)")]
    Unknown(String),
    /// A `--mem` value that is not a size.
    #[error("`{0}` is not a memory size (e.g. 256M, 1G)")]
    MemSize(String),
    /// A `--mem` of zero.
    #[error("`{0}` is no memory")]
    NoMemory(String),
    /// A `--mem` that is not whole MiB.
    #[error("`{0}` is not a whole number of MiB")]
    MemNotMib(String),
}

/// Which VMM boots a guest (`--backend`, the same values and default in
/// every subcommand).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BackendKind {
    /// ember where KVM runs guest kernels natively (hardware
    /// virtualization), QEMU with TCG elsewhere (a software KVM emulates
    /// guest kernel mode, far slower than TCG).
    #[default]
    Auto,
    /// ember's own VMM (`ember boot`).
    Ember,
    /// qemu-system-x86_64 (`$EMBER_QEMU`).
    Qemu,
}

impl BackendKind {
    /// `Auto` resolved for this host: never `Auto`.
    pub fn resolve(self) -> BackendKind {
        match self {
            BackendKind::Auto if qemu::hardware_kvm_usable() => BackendKind::Ember,
            BackendKind::Auto => BackendKind::Qemu,
            k => k,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Auto => "auto",
            BackendKind::Ember => "ember",
            BackendKind::Qemu => "qemu",
        })
    }
}

/// The devices a guest gets and how they are announced, as `ember boot` and
/// `ember run` both take them: one definition, so both accept (and refuse)
/// the same syntax.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DeviceArgs {
    /// A virtio-blk disk (/dev/vda, /dev/vdb, … in the guest):
    /// PATH[,ro][,direct][,serial=ID][,poll=US] (poll=: ember's VMM only).
    /// Repeatable.
    #[arg(long, value_name = "PATH[,ro][,direct][,serial=ID][,poll=US]")]
    pub disk: Vec<DiskConfig>,
    /// A virtio-pmem region backed by this file (/dev/pmem0, …; a DAX root).
    /// Repeatable. With `ember boot --restore`: backs the snapshot's pmem
    /// devices, in order, instead (each the size of the one it replaces).
    #[arg(long)]
    pub pmem: Vec<PmemConfig>,
    /// Add a virtio-rng device (/dev/hwrng: entropy from the host's getrandom).
    #[arg(long)]
    pub rng: bool,
    /// Add a virtio-balloon device (statistics, free page reporting).
    #[arg(long)]
    pub balloon: bool,
    /// Share a host directory (virtio-fs; in the guest: `mount -t virtiofs
    /// TAG DIR`), confined to DIR, `ro` refusing writes. ember's VMM only.
    /// Repeatable, one tag each. With `ember boot --restore`: the snapshot's
    /// share of that tag serves DIR instead.
    #[arg(long, value_name = "tag=TAG,dir=DIR[,ro]")]
    pub fs: Vec<FsConfig>,
    /// Describe devices with an MP table and the command line only (no ACPI tables).
    #[arg(long)]
    pub no_acpi: bool,
    /// Write the VMM-side boot timeline (JSON) here (ember's VMM only).
    #[arg(long, value_name = "FILE.json")]
    pub events: Option<PathBuf>,
}

impl DeviceArgs {
    /// The virtio devices these options ask for (a balloon with its defaults).
    pub fn device_set(&self) -> DeviceSet {
        DeviceSet {
            disks: self.disk.clone(),
            pmem: self.pmem.clone(),
            rng: self.rng.then(RngConfig::default),
            balloon: self.balloon.then(BalloonConfig::default),
            net: Vec::new(),
            // `ember boot --vsock` only: the QEMU backend has no vsock here.
            vsock: None,
            // `--mem-boot` makes it (`boot`), from the memory sizes.
            mem: None,
            fs: self.fs.clone(),
        }
    }

    /// Puts these devices into `spec`.
    pub fn apply(&self, spec: &mut GuestSpec) {
        spec.devices = self.device_set();
        spec.acpi = !self.no_acpi;
        spec.events = self.events.clone();
    }
}

/// Everything needed to boot one guest, independent of the VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestSpec {
    /// Kernel (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory in MiB: with a virtio-mem region (`devices.mem`), the
    /// boot RAM and the region together.
    pub mem_mib: u64,
    /// vCPUs.
    pub cpus: u32,
    /// The virtio devices: disks, pmem regions, rng, balloon. With
    /// `restore`, only `pmem` counts: its files back the snapshot's pmem
    /// devices.
    pub devices: DeviceSet,
    /// A unix socket (already listening) the guest's data channel connects to:
    /// a virtio-console port where the backend has one, else a second serial
    /// line. The guest sees it as `/dev/hvc0` or `/dev/ttyS1`. (A vsock
    /// channel is `devices.vsock` instead: see [`ChannelKind::Vsock`].)
    pub channel: Option<PathBuf>,
    /// Where ember writes its event timeline (ignored by other backends).
    pub events: Option<PathBuf>,
    /// Guest console on the backend's stdout (`false`: no console device).
    pub console: bool,
    /// `ember boot --prefault` (ember only): when guest memory is committed.
    pub prefault: Option<String>,
    /// ACPI tables (`false`: an MP table, devices on the command line).
    pub acpi: bool,
    /// Resume this snapshot directory instead of booting `kernel` (ember
    /// only): `devices.pmem` files then back the snapshot's pmem devices
    /// and `channel` is where its channel connects.
    pub restore: Option<PathBuf>,
    /// Serve the control socket here (ember only).
    pub api_socket: Option<PathBuf>,
    /// A network through passt (`ember run --net`): the VMM's end of a
    /// stream socket connected to passt, inherited at this number; the
    /// guest gets a virtio-net device on it.
    pub net_fd: Option<std::os::fd::RawFd>,
    /// Host directories the guest mounts by tag (virtio-fs).
    pub shares: Vec<Share>,
}

/// A host directory served to the guest over virtio-fs, mounted there by
/// its tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The tag the guest mounts (`mount -t virtiofs TAG DIR`).
    pub tag: String,
    /// The host directory.
    pub dir: PathBuf,
    /// The guest may not change it.
    pub read_only: bool,
    /// The vhost-user socket of the daemon serving it, where the backend
    /// needs one ([`ShareSupport::Virtiofsd`]): started by the caller.
    pub socket: Option<PathBuf>,
}

/// How a backend serves [`GuestSpec::shares`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareSupport {
    /// Through a `virtiofsd` per share, which the caller starts
    /// ([`virtiofsd`]) and names in [`Share::socket`].
    Virtiofsd,
    /// Through the VMM's own virtio-fs device: nothing to start.
    InProcess,
    /// Not at all; why, in a few words.
    Unsupported(&'static str),
}

impl GuestSpec {
    /// A spec with defaults for everything but the kernel.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        GuestSpec {
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            mem_mib: 256,
            cpus: 1,
            devices: DeviceSet::default(),
            channel: None,
            events: None,
            console: true,
            prefault: None,
            acpi: true,
            restore: None,
            api_socket: None,
            net_fd: None,
            shares: Vec::new(),
        }
    }
}

/// How the backend's guest data channel appears inside the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelKind {
    /// `/dev/hvc0` (virtio-console; needs the virtio_console driver).
    VirtioConsole,
    /// `/dev/vport0p1`: a virtio-serial port that is not a console (the
    /// same driver). QEMU holds a port's output back while the host side
    /// cannot take it, but drops a console's (its `virtconsole` is not flow
    /// controlled), so QEMU's channel is a port.
    VirtioSerialPort,
    /// `/dev/ttyS1` (second 16550).
    Serial,
    /// A vsock stream from the guest to the host's port
    /// [`VSOCK_CHANNEL_PORT`] (the guest's init connects it, again after a
    /// restore: a restored vsock device resets every connection), which
    /// the VMM's hybrid vsock hands to the Unix socket `<uds>_<port>`.
    /// Packets of up to 64 KiB instead of a console's tty writes; the
    /// guest kernel needs vsock over virtio (`CONFIG_VIRTIO_VSOCKETS`,
    /// built in or as a module the appliance carries).
    Vsock,
}

/// The host port the guest's init connects to over a [`ChannelKind::Vsock`]
/// channel.
pub const VSOCK_CHANNEL_PORT: u32 = 1024;
/// The guest's vsock context ID for its channel (the first guest CID: the
/// VM's vsock is its own, seen by no other).
pub const VSOCK_CHANNEL_CID: u32 = 3;

/// A VMM that can boot a [`GuestSpec`].
pub trait Backend: Send + Sync {
    /// Short name (`ember`, `qemu`).
    fn name(&self) -> &str;
    /// The binary's version string.
    fn version(&self) -> Result<String, BackendError>;
    /// Human description of how it runs guests (`KVM`, `TCG`, machine type).
    fn describe(&self) -> String;
    /// How the data channel shows up in the guest.
    fn channel_kind(&self) -> ChannelKind;
    /// The command that boots `spec`; the guest console is on its stdout.
    fn command(&self, spec: &GuestSpec) -> Result<Command, BackendError>;
    /// The appliance's module groups for the virtio transports this
    /// backend's devices sit on (`pci`, `mmio`; see
    /// `appliance::modules::MODULE_GROUPS`): the guest loads only those.
    fn virtio_transports(&self) -> &'static [&'static str] {
        &["pci", "mmio"]
    }
    /// Kernel options this backend's guests of `cpus` vCPUs boot faster
    /// with (the boot doctor's advice where it holds for every guest).
    fn kernel_options(&self, _cpus: u32) -> &'static str {
        ""
    }
    /// How this backend serves shared host directories.
    fn share_support(&self) -> ShareSupport {
        ShareSupport::Unsupported("this backend has no virtio-fs device")
    }
}

/// ember itself, run as a child process (`ember boot --kernel …`).
#[derive(Debug, Clone)]
pub struct EmberBackend {
    /// Path of the ember binary (normally the running executable).
    pub binary: PathBuf,
}

impl EmberBackend {
    /// The running executable.
    pub fn current() -> Result<Self, BackendError> {
        let binary = std::env::current_exe().map_err(|_| BackendError::MissingBinary {
            name: "ember".into(),
            binary: "ember".into(),
        })?;
        Ok(EmberBackend { binary })
    }
}

impl Backend for EmberBackend {
    fn name(&self) -> &str {
        "ember"
    }

    fn version(&self) -> Result<String, BackendError> {
        binary_version("ember", &self.binary)
    }

    fn describe(&self) -> String {
        "ember on KVM".into()
    }

    fn channel_kind(&self) -> ChannelKind {
        ChannelKind::Vsock
    }

    fn share_support(&self) -> ShareSupport {
        ShareSupport::InProcess
    }

    fn command(&self, spec: &GuestSpec) -> Result<Command, BackendError> {
        let mut c = Command::new(&self.binary);
        c.arg("boot");
        // passt's socket: the first network device, booted or restored.
        let mut devices = spec.devices.clone();
        // The shares are ember's own virtio-fs devices; restored, they name
        // the directories the snapshot's shares serve this time.
        for share in &spec.shares {
            let fs = FsConfig::new(&share.tag, &share.dir, share.read_only).map_err(|e| {
                BackendError::Unsupported {
                    backend: "the ember backend".into(),
                    what: format!("share {}: {e}", share.dir.display()),
                }
            })?;
            devices.fs.push(fs);
        }
        if let Some(fd) = spec.net_fd {
            let mut n = ember_vmm::devices::virtio::NetConfig::tap("");
            n.backend = ember_vmm::devices::virtio::net::NetBackendConfig::Socket(fd);
            devices.net.insert(0, n);
        }
        let spec = &GuestSpec {
            devices,
            ..spec.clone()
        };
        if let Some(dir) = &spec.restore {
            // Everything else is the snapshot's.
            c.arg("--restore").arg(dir);
            c.arg("--console")
                .arg(if spec.console { "serial" } else { "none" });
            let pmem = DeviceSet {
                pmem: spec.devices.pmem.clone(),
                net: spec.devices.net.clone(),
                fs: spec.devices.fs.clone(),
                vsock: spec.devices.vsock.clone(),
                ..DeviceSet::default()
            };
            hand_over(&mut c, &pmem);
            if let Some(ch) = &spec.channel {
                c.arg("--channel").arg(ch);
            }
            if let Some(ev) = &spec.events {
                c.arg("--events").arg(ev);
            }
            return Ok(c);
        }
        c.arg("--kernel").arg(&spec.kernel);
        if let Some(api) = &spec.api_socket {
            c.arg("--api-socket").arg(api);
        }
        if let Some(initrd) = &spec.initrd {
            c.arg("--initrd").arg(initrd);
        }
        c.arg("--cmdline").arg(&spec.cmdline);
        c.arg("--mem").arg(format!("{}M", spec.mem_mib));
        if let Some(region) = &spec.devices.mem {
            // `mem_mib` is all of it; the region (handed over with the
            // devices) is what the guest does not boot with.
            c.arg("--mem-boot").arg(format!(
                "{}M",
                spec.mem_mib.saturating_sub(region.size >> 20)
            ));
        }
        c.arg("--cpus").arg(spec.cpus.to_string());
        c.arg("--console")
            .arg(if spec.console { "serial" } else { "none" });
        hand_over(&mut c, &spec.devices);
        if !spec.acpi {
            c.arg("--no-acpi");
        }
        if let Some(ch) = &spec.channel {
            c.arg("--channel").arg(ch);
        }
        if let Some(ev) = &spec.events {
            c.arg("--events").arg(ev);
        }
        if let Some(p) = &spec.prefault {
            c.arg("--prefault").arg(p);
        }
        Ok(c)
    }
}

/// Hands `devices` to the child `ember boot` as they are (JSON, the
/// [`BOOT_DEVICES_ARG`] option), not re-rendered as `--disk` options.
fn hand_over(c: &mut Command, devices: &DeviceSet) {
    if *devices != DeviceSet::default() {
        // Serializing plain data into a String cannot fail.
        let json = serde_json::to_string(devices).unwrap_or_default();
        c.arg(BOOT_DEVICES_ARG).arg(json);
    }
}

/// The hidden `ember boot` option that takes a [`DeviceSet`] as JSON.
pub const BOOT_DEVICES_ARG: &str = "--devices-json";

/// The backend `kind` names (`Auto` resolved for this host); `qemu_bios` is
/// QEMU's firmware (`None`: the machine's own, SeaBIOS on q35).
pub fn by_kind(
    kind: BackendKind,
    qemu_machine: &str,
    qemu_bios: Option<&Path>,
) -> Result<Box<dyn Backend>, BackendError> {
    match kind.resolve() {
        BackendKind::Qemu => {
            let mut q = qemu::QemuBackend::detect(qemu_machine, qemu::Accel::Auto)?;
            q.bios = qemu_bios.map(Path::to_path_buf);
            Ok(Box::new(q))
        }
        _ => Ok(Box::new(EmberBackend::current()?)),
    }
}

/// Parses a memory size the way `ember boot --mem` does (`256M`, `1G`,
/// `524288K`, or bytes) into whole MiB: the one `--mem` syntax of every
/// subcommand.
pub fn parse_mem_mib(s: &str) -> Result<u64, BackendError> {
    let bytes = ember_vmm::vstate::memory::parse_size(s)
        .map_err(|_| BackendError::MemSize(s.to_owned()))?;
    match bytes {
        0 => Err(BackendError::NoMemory(s.to_owned())),
        b if b % (1 << 20) != 0 => Err(BackendError::MemNotMib(s.to_owned())),
        b => Ok(b >> 20),
    }
}

/// Looks up a backend by name (`auto`, `ember`, `qemu`).
pub fn by_name(name: &str, qemu_machine: &str) -> Result<Box<dyn Backend>, BackendError> {
    let kind = <BackendKind as clap::ValueEnum>::from_str(name, false)
        .map_err(|_| BackendError::Unknown(name.to_owned()))?;
    by_kind(kind, qemu_machine, None)
}

/// First line of `binary --version`.
pub fn binary_version(name: &str, binary: &Path) -> Result<String, BackendError> {
    let mut probe = Command::new(binary);
    probe.arg("--version");
    crate::cleanup::dies_with_ember(&mut probe);
    let out = probe
        .output()
        .map_err(|e| BackendError::Version(name.to_owned(), e))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_owned())
}

/// Finds `binary` on PATH (or accepts it as a path).
pub fn find_binary(binary: &str) -> Option<PathBuf> {
    let p = Path::new(binary);
    if p.components().count() > 1 {
        return is_executable(p).then(|| p.to_path_buf());
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(binary))
        .find(|c| is_executable(c))
}

/// Whether `p` is a regular file someone may execute.
pub(crate) fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A backend for unit tests: a name and the virtio transports it uses;
/// it boots nothing.
#[cfg(test)]
pub(crate) struct Fake {
    name: &'static str,
    transports: &'static [&'static str],
}

#[cfg(test)]
impl Fake {
    /// A backend called `name`, on both transports.
    pub(crate) fn named(name: &'static str) -> Fake {
        Fake {
            name,
            transports: &["pci", "mmio"],
        }
    }

    /// A backend whose devices sit on `transports`.
    pub(crate) fn with_transports(transports: &'static [&'static str]) -> Fake {
        Fake {
            name: "test",
            transports,
        }
    }
}

#[cfg(test)]
impl Backend for Fake {
    fn name(&self) -> &str {
        self.name
    }
    fn version(&self) -> Result<String, BackendError> {
        Ok(String::new())
    }
    fn describe(&self) -> String {
        String::new()
    }
    fn channel_kind(&self) -> ChannelKind {
        ChannelKind::VirtioConsole
    }
    fn command(&self, _: &GuestSpec) -> Result<Command, BackendError> {
        unreachable!("not booted")
    }
    fn virtio_transports(&self) -> &'static [&'static str] {
        self.transports
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arguments of the `ember boot` the ember backend runs for `spec`.
    fn ember_args(b: &EmberBackend, spec: &GuestSpec) -> Vec<String> {
        b.command(spec)
            .unwrap()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    /// The devices handed over in `args`.
    fn handed_devices(args: &[String]) -> DeviceSet {
        let at = args.iter().position(|a| a == BOOT_DEVICES_ARG).unwrap();
        serde_json::from_str(&args[at + 1]).unwrap()
    }

    #[test]
    fn ember_command_carries_the_spec() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        let mut spec = GuestSpec::new("/k");
        spec.initrd = Some("/i".into());
        spec.cmdline = "console=ttyS0".into();
        spec.devices
            .disks
            .push("/d.img,ro,direct,serial=s1,poll=0".parse().unwrap());
        spec.devices.pmem.push("/p.img".parse().unwrap());
        spec.devices.rng = Some(RngConfig::default());
        spec.devices.balloon = Some(BalloonConfig::default());
        spec.prefault = Some("async,window=64M".into());
        spec.acpi = false;
        let c = b.command(&spec).unwrap();
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "boot",
                "--kernel",
                "/k",
                "--initrd",
                "/i",
                "--cmdline",
                "console=ttyS0",
                "--mem",
                "256M",
                "--cpus",
                "1",
                "--console",
                "serial",
                "--devices-json",
                r#"{"disks":[{"path":"/d.img","read_only":true,"direct":true,"serial":"s1","poll_us":0}],"pmem":[{"path":"/p.img"}],"rng":{},"balloon":{"target_bytes":0,"free_page_reporting":true}}"#,
                "--no-acpi",
                "--prefault",
                "async,window=64M"
            ]
        );
    }

    /// With a virtio-mem region `--mem` stays all of the memory and
    /// `--mem-boot` is the rest; the region goes with the devices.
    #[test]
    fn a_region_is_handed_over_with_the_boot_ram_beside_it() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        let mut spec = GuestSpec::new("/k");
        spec.mem_mib = 1024;
        spec.devices.mem = Some(ember_vmm::devices::virtio::MemConfig::new(768 << 20).unwrap());
        let args = ember_args(&b, &spec);
        let s = args.join(" ");
        assert!(s.contains("--mem 1024M --mem-boot 256M "), "{s}");
        let handed = handed_devices(&args);
        assert_eq!(handed.mem, spec.devices.mem);
    }

    /// passt's socket becomes the first network device, `socket=N`, booted
    /// or restored.
    #[test]
    fn passts_socket_is_the_first_network_device() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        let mut spec = GuestSpec::new("/k");
        spec.net_fd = Some(9);
        for restore in [None, Some("/snap".into())] {
            spec.restore = restore;
            let args = ember_args(&b, &spec);
            let handed = handed_devices(&args);
            assert_eq!(
                handed.net[0].backend,
                ember_vmm::devices::virtio::net::NetBackendConfig::Socket(9)
            );
        }
    }

    /// Shares become ember's own virtio-fs devices, booted or restored (a
    /// restore's name the directories the snapshot's shares serve now).
    #[test]
    fn shares_are_embers_own_fs_devices_booted_or_restored() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        let mut spec = GuestSpec::new("/k");
        spec.shares.push(Share {
            tag: "root".into(),
            dir: "/".into(),
            read_only: true,
            socket: None,
        });
        spec.shares.push(Share {
            tag: "data".into(),
            dir: "/srv/data".into(),
            read_only: false,
            socket: None,
        });
        for restore in [None, Some("/snap".into())] {
            spec.restore = restore;
            let args = ember_args(&b, &spec);
            let handed = handed_devices(&args);
            assert_eq!(
                handed.fs,
                [
                    FsConfig::new("root", "/", true).unwrap(),
                    FsConfig::new("data", "/srv/data", false).unwrap()
                ]
            );
        }
        assert_eq!(b.share_support(), ShareSupport::InProcess);
    }

    /// The appliance's vsock channel is a vsock device on this run's
    /// socket, booted or restored (a restore's replaces the snapshot's).
    #[test]
    fn the_channels_vsock_device_is_handed_over_booted_or_restored() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        assert_eq!(b.channel_kind(), ChannelKind::Vsock);
        let mut spec = GuestSpec::new("/k");
        let vsock = ember_vmm::devices::virtio::VsockConfig {
            cid: VSOCK_CHANNEL_CID,
            uds: "/tmp/v.sock".into(),
        };
        spec.devices.vsock = Some(vsock.clone());
        for restore in [None, Some("/snap".into())] {
            spec.restore = restore;
            let args = ember_args(&b, &spec);
            assert_eq!(handed_devices(&args).vsock.as_ref(), Some(&vsock));
            assert!(!args.iter().any(|a| a == "--channel"), "{args:?}");
        }
    }

    #[test]
    fn a_restore_hands_over_only_its_pmem_files() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        let mut spec = GuestSpec::new("/k");
        spec.restore = Some("/snap".into());
        spec.devices.disks.push("/d.img".parse().unwrap());
        spec.devices.pmem.push("/slot.img".parse().unwrap());
        let args = ember_args(&b, &spec);
        let handed = handed_devices(&args);
        assert_eq!(
            handed,
            DeviceSet {
                pmem: spec.devices.pmem.clone(),
                ..DeviceSet::default()
            }
        );
    }

    #[test]
    fn unknown_backend_and_missing_binary_are_errors() {
        assert!(matches!(
            by_name("bochs", "microvm"),
            Err(BackendError::Unknown(_))
        ));
        assert_eq!(find_binary("/nonexistent/qemu"), None);
        assert!(find_binary("sh").is_some());
    }
}
