//! QEMU as a backend: `qemu-system-x86_64` with KVM where KVM runs guest
//! kernels natively, TCG otherwise.

use super::{
    Backend, BackendError, ChannelKind, GuestSpec, ShareSupport, binary_version, find_binary,
};
use std::path::PathBuf;
use std::process::Command;

/// qboot, Debian's minimal firmware for QEMU: no boot-device search, no
/// option ROMs; `-kernel` boots straight away.
pub const QBOOT: &str = "/usr/share/qemu/qboot.rom";

/// Accelerator choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// KVM if the host CPU virtualizes (vmx/svm), else TCG.
    Auto,
    /// Force KVM.
    Kvm,
    /// Force TCG.
    Tcg,
}

/// QEMU backend.
#[derive(Debug, Clone)]
pub struct QemuBackend {
    /// The qemu-system-x86_64 binary.
    pub binary: PathBuf,
    /// `microvm` or `q35` (or any machine QEMU knows).
    pub machine: String,
    /// Resolved accelerator (never `Auto`).
    pub accel: Accel,
    /// Firmware image (`-bios`) instead of the machine's default.
    pub bios: Option<PathBuf>,
    /// Mirror the firmware's debug port (0x402, where SeaBIOS logs) onto
    /// the console, so the boot lab sees the firmware's own steps.
    pub firmware_log: bool,
    /// TCG only: `-icount shift=0,sleep=off`, so the guest's clock counts
    /// its instructions (1 ns each) instead of following the host's.
    pub icount: bool,
}

/// Whether /dev/kvm can run guest kernels at native speed: it must be
/// accessible and the CPU must have hardware virtualization. (A software KVM
/// such as PVM emulates guest kernel mode, which makes TCG the faster choice.)
pub fn hardware_kvm_usable() -> bool {
    let kvm_ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hw = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    kvm_ok && hw
}

impl QemuBackend {
    /// Finds the binary and resolves the accelerator.
    pub fn detect(machine: &str, accel: Accel) -> Result<Self, BackendError> {
        let name = std::env::var("EMBER_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
        let binary = find_binary(&name).ok_or_else(|| BackendError::MissingBinary {
            name: "qemu".into(),
            binary: name.clone(),
        })?;
        let accel = match accel {
            Accel::Auto if hardware_kvm_usable() => Accel::Kvm,
            Accel::Auto => Accel::Tcg,
            a => a,
        };
        Ok(QemuBackend {
            binary,
            machine: machine.to_owned(),
            accel,
            bios: None,
            firmware_log: false,
            icount: false,
        })
    }

    fn is_microvm(&self) -> bool {
        self.machine.starts_with("microvm")
    }
}

impl QemuBackend {
    /// The kernel command line QEMU gets: the spec's, plus on microvm under
    /// TCG the TSC's rate (`tsc_early_khz=`), unless the line sets it. That
    /// machine has no HPET, no ACPI PM timer and no port 0x61 to gate the
    /// PIT, so Linux cannot calibrate the TSC; on a loaded host it then
    /// stopped for good right after `tsc: Marking TSC unstable due to could
    /// not calculate TSC khz` (3 boots of 3 hung at load 23–28; with the rate
    /// given, 3 of 3 ran). Under TCG the guest reads the host's own TSC.
    fn cmdline(&self, spec: &GuestSpec) -> String {
        let needs_rate = self.is_microvm()
            && self.accel == Accel::Tcg
            && !spec
                .cmdline
                .split_whitespace()
                .any(|o| o.starts_with("tsc_early_khz="));
        match host_tsc_khz().filter(|_| needs_rate) {
            Some(khz) => format!("{} tsc_early_khz={khz}", spec.cmdline),
            None => spec.cmdline.clone(),
        }
    }
}

/// The host TSC's rate in kHz, measured once against CLOCK_MONOTONIC_RAW
/// (over ≥ 2 ms, from samples whose TSC read sits between two clock reads
/// close together, so a preemption cannot skew it); `None` off x86_64.
pub fn host_tsc_khz() -> Option<u64> {
    static KHZ: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *KHZ.get_or_init(measure_tsc_khz)
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> Option<u64> {
    use std::time::{Duration, Instant};
    // One (ns, tsc) sample: the TSC read between two clock reads ≤ 20 µs apart.
    let sample = || {
        for _ in 0..100 {
            let t0 = Instant::now();
            // SAFETY: RDTSC reads a counter; it touches no memory and exists on every x86_64 CPU.
            let tsc = unsafe { std::arch::x86_64::_rdtsc() };
            let t1 = Instant::now();
            if t1 - t0 <= Duration::from_micros(20) {
                return Some((t0 + (t1 - t0) / 2, tsc));
            }
        }
        None
    };
    let (a, tsc_a) = sample()?;
    std::thread::sleep(Duration::from_millis(2));
    let (b, tsc_b) = sample()?;
    let ns = (b - a).as_nanos() as u64;
    (ns > 0 && tsc_b > tsc_a).then(|| (tsc_b - tsc_a) * 1_000_000 / ns)
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> Option<u64> {
    None
}

impl Backend for QemuBackend {
    fn name(&self) -> &str {
        "qemu"
    }

    fn version(&self) -> Result<String, BackendError> {
        binary_version("qemu", &self.binary)
    }

    fn describe(&self) -> String {
        let accel = if self.accel == Accel::Kvm {
            "KVM"
        } else {
            "TCG (software CPU)"
        };
        format!("qemu -M {} with {accel}", self.machine)
    }

    /// A virtio-console port: measured on QEMU/TCG q35 it boots no slower than
    /// a second 16550 and moves data ~6x faster (1 MB through `cat`: 4.2 s
    /// vs 25 s), and microvm has no second UART at all.
    fn channel_kind(&self) -> ChannelKind {
        ChannelKind::VirtioSerialPort
    }

    /// Every virtio device this backend adds is `-device` on microvm and
    /// `-pci` on a PC machine (see `command`), so the guest needs one
    /// transport's driver, not both.
    fn virtio_transports(&self) -> &'static [&'static str] {
        if self.is_microvm() {
            &["mmio"]
        } else {
            &["pci"]
        }
    }

    /// The doctor's advice for TCG guests (BENCHMARKS.md §8). TCG has no
    /// TSC-deadline timer and no way to tell the guest its APIC timer's
    /// frequency, so Linux calibrates that timer against HZ/10 ticks of the
    /// PIT or HPET: with one vCPU the HPET can drive the tick alone (with
    /// more, each CPU's timer would go through a broadcast, so they keep
    /// theirs). And ftrace's boot-time check of its ~38 000 call sites
    /// (kernel/trace/ftrace.c, a symbol lookup each) only matters to
    /// function tracing. Together −225 ms of the busybox initramfs's 687 ms
    /// under `-icount`. Not under KVM, where neither has been measured and
    /// the timer has a TSC deadline.
    fn kernel_options(&self, cpus: u32) -> &'static str {
        match (self.accel, cpus) {
            (Accel::Tcg, 1) => "nolapic_timer initcall_blacklist=ftrace_check_for_weak_functions",
            (Accel::Tcg, _) => "initcall_blacklist=ftrace_check_for_weak_functions",
            _ => "",
        }
    }

    fn share_support(&self) -> ShareSupport {
        ShareSupport::Virtiofsd
    }

    /// The command line in QEMU's own order: machine, memory, boot, the
    /// channel and shares, then the devices. Each part refuses what it
    /// cannot render, never drops it.
    fn command(&self, spec: &GuestSpec) -> Result<Command, BackendError> {
        let mut c = Command::new(&self.binary);
        self.machine_args(&mut c, spec)?;
        let pmem = self.pmem_sizes(spec)?;
        memory_args(&mut c, spec, &pmem);
        self.boot_args(&mut c, spec);
        self.channel_and_share_args(&mut c, spec)?;
        // Guest-chosen exit status, the same port ember listens on.
        c.args(["-device", "isa-debug-exit,iobase=0x501,iosize=1"]);
        refuse_ember_only(spec)?;
        self.mem_region_args(&mut c, spec)?;
        if !spec.devices.fs.is_empty() {
            return Err(unsupported(
                "share a directory with --fs (use --backend ember)",
            ));
        }
        self.disk_args(&mut c, spec)?;
        if spec.devices.rng.is_some() {
            c.args(["-device", &self.virtio_device("virtio-rng")]);
        }
        if let Some(b) = &spec.devices.balloon {
            if b.target_bytes != 0 {
                return Err(unsupported(
                    "start a balloon inflated (use --backend ember)",
                ));
            }
            c.args(["-device", &self.virtio_device("virtio-balloon")]);
        }
        self.network_args(&mut c, spec)?;
        pmem_args(&mut c, spec, &pmem);
        Ok(c)
    }
}

/// A refusal of what ember has and this backend does not.
fn unsupported(what: &str) -> BackendError {
    BackendError::Unsupported {
        backend: "the qemu backend".into(),
        what: what.into(),
    }
}

/// The virtio-mem region's size in MiB (0 without one) and the RAM the
/// guest boots with: a region is a memory device too (in `maxmem`), so the
/// guest boots with the rest.
fn region_and_boot_mib(spec: &GuestSpec) -> (u64, u64) {
    let region_mib = spec.devices.mem.as_ref().map_or(0, |m| m.size >> 20);
    (region_mib, spec.mem_mib.saturating_sub(region_mib))
}

/// `-m` and `-smp`.
fn memory_args(c: &mut Command, spec: &GuestSpec, pmem: &[u64]) {
    let (region_mib, boot_mib) = region_and_boot_mib(spec);
    // virtio-pmem regions are memory devices: they live in the machine's
    // device-memory area, which `maxmem` above the RAM size makes.
    let pmem_total: u64 = pmem.iter().sum();
    if pmem_total == 0 && region_mib == 0 {
        c.args(["-m", &format!("{}M", spec.mem_mib)]);
    } else {
        let max = spec.mem_mib + pmem_total.div_ceil(1 << 20);
        c.args(["-m", &format!("{boot_mib}M,maxmem={max}M")]);
    }
    c.args(["-smp", &spec.cpus.to_string()]);
}

/// What ember has and this backend does not: refused, never dropped.
fn refuse_ember_only(spec: &GuestSpec) -> Result<(), BackendError> {
    if spec.events.is_some() {
        return Err(unsupported("write --events (use --backend ember)"));
    }
    if spec.prefault.is_some() {
        return Err(unsupported("take --prefault (use --backend ember)"));
    }
    if spec.restore.is_some() || spec.api_socket.is_some() {
        return Err(unsupported("restore a snapshot or serve a control socket"));
    }
    // QEMU's vsock needs the host's vhost-vsock; ember's is its own.
    if spec.devices.vsock.is_some() {
        return Err(unsupported(
            "attach a hybrid vsock (--vsock; use --backend ember)",
        ));
    }
    Ok(())
}

/// The `--pmem` files as virtio-pmem-pci memory devices of `pmem`'s sizes.
fn pmem_args(c: &mut Command, spec: &GuestSpec, pmem: &[u64]) {
    let paths = spec.devices.pmem.iter().map(|p| &p.path);
    for (i, (path, size)) in paths.zip(pmem).enumerate() {
        // share=on: the guest's writes reach the file, as with ember's
        // shared mapping.
        c.arg("-object").arg(format!(
            "memory-backend-file,id=pmem{i},share=on,mem-path={},size={size}",
            path.display()
        ));
        c.args([
            "-device",
            &format!("virtio-pmem-pci,memdev=pmem{i},id=vpmem{i}"),
        ]);
    }
}

impl QemuBackend {
    /// A virtio device's name on this machine's transport: `-device` on
    /// microvm, `-pci` on a PC machine.
    fn virtio_device(&self, pci: &str) -> String {
        if self.is_microvm() {
            format!("{pci}-device")
        } else {
            format!("{pci}-pci")
        }
    }

    /// `-M` with its options (and the shared memory backend shares need),
    /// the accelerator and its CPU, `-icount`.
    fn machine_args(&self, c: &mut Command, spec: &GuestSpec) -> Result<(), BackendError> {
        let mut machine = if self.is_microvm() {
            // No option ROMs, and keep the ISA serial port; ACPI stays on so
            // kernels without virtio-mmio command-line devices find devices.
            format!("{},x-option-roms=off,rtc=off", self.machine)
        } else {
            self.machine.clone()
        };
        if !spec.acpi {
            // microvm then announces its virtio-mmio devices on the command
            // line (its auto-kernel-cmdline), as ember does. A PC machine
            // is refused: SeaBIOS makes ACPI tables of its own when QEMU
            // gives none, and with qboot Linux finds the virtio-pci devices
            // unusable ("modern interface but does not have
            // VIRTIO_F_VERSION_1", seen on q35 with two devices).
            if !self.is_microvm() {
                return Err(unsupported(
                    "boot a PC machine without ACPI (--no-acpi: use --machine microvm)",
                ));
            }
            machine.push_str(",acpi=off");
        }
        let (_, boot_mib) = region_and_boot_mib(spec);
        if !spec.shares.is_empty() {
            // vhost-user: virtiofsd maps guest memory, which must then be
            // a shared mapping it can be handed (a memfd), not QEMU's
            // private anonymous one.
            machine.push_str(",memory-backend=ram0");
            c.arg("-object").arg(format!(
                "memory-backend-memfd,id=ram0,size={boot_mib}M,share=on"
            ));
        }
        c.args(["-M", &machine]);
        match self.accel {
            // `-cpu host` needs a CPU KVM can pass through; a software KVM (PVM)
            // refuses some of its MSRs at start, so it gets a plain model.
            Accel::Kvm if !hardware_kvm_usable() => c.args(["-accel", "kvm", "-cpu", "qemu64"]),
            Accel::Kvm => c.args(["-accel", "kvm", "-cpu", "host"]),
            _ => c.args(["-accel", "tcg", "-cpu", "max"]),
        };
        if self.icount {
            if self.accel != Accel::Tcg {
                return Err(unsupported(
                    "count instructions (-icount) under KVM: it needs --accel tcg",
                ));
            }
            // The guest's clock advances 1 ns per instruction and skips
            // idle time: what the guest does, whatever the host's load.
            c.args(["-icount", "shift=0,sleep=off"]);
        }
        Ok(())
    }

    /// No defaults, the kernel, its initrd and command line, the firmware
    /// and the console.
    fn boot_args(&self, c: &mut Command, spec: &GuestSpec) {
        c.args([
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-display",
            "none",
            "-no-reboot",
        ]);
        c.arg("-kernel").arg(&spec.kernel);
        if let Some(initrd) = &spec.initrd {
            c.arg("-initrd").arg(initrd);
        }
        c.args(["-append", &self.cmdline(spec)]);
        if let Some(bios) = &self.bios {
            c.arg("-bios").arg(bios);
        }
        // ttyS0: the console on stdout (or a null sink, so ttyS1 keeps its name).
        if spec.console && self.firmware_log {
            // One stdio chardev, muxed between COM1 and the debug port.
            c.args([
                "-chardev",
                "stdio,mux=on,id=con0",
                "-serial",
                "chardev:con0",
            ]);
            c.args(["-device", "isa-debugcon,chardev=con0,iobase=0x402"]);
        } else {
            c.args(["-serial", if spec.console { "stdio" } else { "null" }]);
        }
    }

    /// The shares' vhost-user-fs devices and the channel's virtio-serial
    /// port, interleaved as QEMU and the guest need them.
    fn channel_and_share_args(
        &self,
        c: &mut Command,
        spec: &GuestSpec,
    ) -> Result<(), BackendError> {
        // The shares' chardevs come before the channel's: QEMU connects its
        // chardevs in this order, and once the channel is connected ember
        // removes the daemons' socket paths (host::run). Their devices come
        // after the channel's: the guest names the channel's port after
        // its virtio device's index (`vport0p1` as the first).
        for (i, share) in spec.shares.iter().enumerate() {
            let Some(socket) = &share.socket else {
                return Err(unsupported(&format!(
                    "share `{}` without its virtiofsd socket",
                    share.tag
                )));
            };
            c.arg("-chardev")
                .arg(format!("socket,id=fs{i},path={}", socket.display()));
        }
        if let Some(ch) = &spec.channel {
            c.arg("-chardev")
                .arg(format!("socket,id=ch0,path={}", ch.display()));
            // A port, not `virtconsole`: QEMU drops a console's output when
            // the socket would block, and throttles a port's (ChannelKind).
            c.args([
                "-device",
                &self.virtio_device("virtio-serial"),
                "-device",
                "virtserialport,chardev=ch0,name=ember.channel",
            ]);
        }
        for (i, share) in spec.shares.iter().enumerate() {
            c.args([
                "-device",
                &format!(
                    "{},chardev=fs{i},tag={}",
                    self.virtio_device("vhost-user-fs"),
                    share.tag
                ),
            ]);
        }
        Ok(())
    }

    /// The virtio-mem region, as virtio-mem-pci in a PCI machine's
    /// device-memory area (`maxmem`); all of it requested at once, as ember
    /// does without --prefault.
    fn mem_region_args(&self, c: &mut Command, spec: &GuestSpec) -> Result<(), BackendError> {
        let Some(m) = &spec.devices.mem else {
            return Ok(());
        };
        if self.is_microvm() {
            return Err(unsupported(
                "offer a virtio-mem region on microvm (use q35)",
            ));
        }
        let (region_mib, _) = region_and_boot_mib(spec);
        let (kind, share) = if spec.shares.is_empty() {
            ("ram", "")
        } else {
            ("memfd", ",share=on")
        };
        c.arg("-object").arg(format!(
            "memory-backend-{kind},id=vmem0,size={region_mib}M{share}"
        ));
        c.arg("-device").arg(format!(
            "virtio-mem-pci,id=vm0,memdev=vmem0,block-size={}K,requested-size={region_mib}M",
            m.block_size >> 10
        ));
        Ok(())
    }

    /// Each `--disk` as a raw `-drive` and its virtio-blk device.
    fn disk_args(&self, c: &mut Command, spec: &GuestSpec) -> Result<(), BackendError> {
        for (i, d) in spec.devices.disks.iter().enumerate() {
            if d.poll_us.is_some() {
                return Err(unsupported("busy-poll a disk (poll=; use --backend ember)"));
            }
            let ro = if d.read_only { ",readonly=on" } else { "" };
            // `direct` is O_DIRECT, QEMU's cache=none; without it the host's
            // page cache, as ember does.
            let cache = if d.direct { "none" } else { "writeback" };
            c.arg("-drive").arg(format!(
                "id=d{i},file={},format=raw,if=none,cache={cache},aio=io_uring{ro}",
                d.path.display()
            ));
            let serial = d
                .serial
                .as_ref()
                .map(|s| format!(",serial={s}"))
                .unwrap_or_default();
            c.args([
                "-device",
                &format!("{},drive=d{i}{serial}", self.virtio_device("virtio-blk")),
            ]);
        }
        Ok(())
    }

    /// `ember run --net`'s passt socket, then each `--net` device.
    fn network_args(&self, c: &mut Command, spec: &GuestSpec) -> Result<(), BackendError> {
        use ember_vmm::devices::virtio::net::NetBackendConfig;
        if let Some(fd) = spec.net_fd {
            // passt's framing (a 4-byte length before each frame) is the
            // stream netdev's; the socket is already connected.
            c.arg("-netdev")
                .arg(format!("stream,id=net0,addr.type=fd,addr.str={fd}"));
            c.args([
                "-device",
                &format!("{},netdev=net0", self.virtio_device("virtio-net")),
            ]);
        }
        for (i, n) in spec.devices.net.iter().enumerate() {
            if !n.rx_rate.is_none() || !n.tx_rate.is_none() {
                return Err(unsupported(
                    "limit a network device's rate (use --backend ember)",
                ));
            }
            let netdev = match &n.backend {
                // Userspace virtio-net as ember's: no vhost, the tap with its header.
                NetBackendConfig::Tap(name) => format!(
                    "tap,id=n{i},ifname={name},script=no,downscript=no,vhost=off,vnet_hdr=on"
                ),
                // QEMU takes the header from the descriptor's own flags and
                // refuses script=, downscript= and vnet_hdr= beside fd=.
                NetBackendConfig::Fd(fd) => format!("tap,id=n{i},fd={fd},vhost=off"),
                // passt's framing is the stream netdev's.
                NetBackendConfig::Socket(fd) => {
                    format!("stream,id=n{i},addr.type=fd,addr.str={fd}")
                }
                NetBackendConfig::Passt => {
                    return Err(unsupported("start passt itself (use ember run --net)"));
                }
            };
            c.arg("-netdev").arg(netdev);
            let mut dev = format!("{},netdev=n{i}", self.virtio_device("virtio-net"));
            if let Some(mac) = n.mac {
                dev.push_str(&format!(",mac={mac}"));
            }
            if let Some(mtu) = n.mtu {
                dev.push_str(&format!(",host_mtu={mtu}"));
            }
            c.args(["-device", &dev]);
        }
        Ok(())
    }
}

impl QemuBackend {
    /// Each `--pmem` file's size, or why this QEMU machine cannot map it.
    fn pmem_sizes(&self, spec: &GuestSpec) -> Result<Vec<u64>, BackendError> {
        let unsupported = |what: String| BackendError::Unsupported {
            backend: "the qemu backend".into(),
            what,
        };
        if !spec.devices.pmem.is_empty() && self.is_microvm() {
            return Err(unsupported(
                "attach --pmem to -M microvm (no memory-device area; use --machine q35 \
                 or --backend ember)"
                    .into(),
            ));
        }
        spec.devices
            .pmem
            .iter()
            .map(|p| &p.path)
            .map(|p| {
                let size = std::fs::metadata(p)
                    .map_err(|e| unsupported(format!("read --pmem {}: {e}", p.display())))?
                    .len();
                // QEMU would grow a shorter file to the region's size; the
                // guest hot-adds the region in 2 MiB sections.
                if size == 0 || size % PMEM_ALIGN != 0 {
                    return Err(unsupported(format!(
                        "map --pmem {} ({size} bytes): it needs a non-empty multiple of 2 MiB",
                        p.display()
                    )));
                }
                Ok(size)
            })
            .collect()
    }
}

/// virtio-pmem regions are hot-added as memory in 2 MiB sections.
const PMEM_ALIGN: u64 = 2 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use ember_vmm::devices::virtio::PmemConfig;

    fn qemu(machine: &str, accel: Accel) -> QemuBackend {
        QemuBackend {
            binary: "/usr/bin/qemu-system-x86_64".into(),
            machine: machine.into(),
            accel,
            bios: None,
            firmware_log: false,
            icount: false,
        }
    }

    /// Only a TCG guest with one vCPU skips the APIC timer's calibration:
    /// under KVM the timer has a TSC deadline, and with more vCPUs each
    /// keeps its own timer. Every TCG guest skips ftrace's check.
    #[test]
    fn only_a_one_vcpu_tcg_guest_boots_without_the_apic_timer() {
        let tcg = qemu("q35", Accel::Tcg);
        assert!(tcg.kernel_options(1).contains("nolapic_timer"));
        assert!(!tcg.kernel_options(2).contains("nolapic_timer"));
        assert!(
            tcg.kernel_options(2)
                .contains("initcall_blacklist=ftrace_check_for_weak_functions")
        );
        assert_eq!(qemu("q35", Accel::Kvm).kernel_options(1), "");
    }

    fn args(c: &Command) -> Vec<String> {
        c.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn microvm_tcg_command() {
        let mut spec = GuestSpec::new("/k");
        spec.cmdline = "console=ttyS0 quiet".into();
        spec.channel = Some("/tmp/ch.sock".into());
        let a = args(&qemu("microvm", Accel::Tcg).command(&spec).unwrap());
        let s = a.join(" ");
        assert!(
            s.starts_with(
                "-M microvm,x-option-roms=off,rtc=off -accel tcg -cpu max -m 256M -smp 1"
            ),
            "{s}"
        );
        let khz = host_tsc_khz().expect("the host TSC's rate");
        assert!(
            s.contains(&format!(
                "-kernel /k -append console=ttyS0 quiet tsc_early_khz={khz} -serial stdio"
            )),
            "{s}"
        );
        // A rate the user gave is kept; q35 (HPET, PM timer) and KVM
        // (kvm-clock) calibrate for themselves.
        spec.cmdline = "quiet tsc_early_khz=1000".into();
        let s = args(&qemu("microvm", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(
            s.contains("-append quiet tsc_early_khz=1000 -serial"),
            "{s}"
        );
        spec.cmdline = "quiet".into();
        for q in [qemu("q35", Accel::Tcg), qemu("microvm", Accel::Kvm)] {
            let s = args(&q.command(&spec).unwrap()).join(" ");
            assert!(!s.contains("tsc_early_khz"), "{s}");
        }
        assert!(s.contains(
            "-chardev socket,id=ch0,path=/tmp/ch.sock -device virtio-serial-device \
             -device virtserialport,chardev=ch0,name=ember.channel"
        ));
    }

    #[test]
    fn the_guest_loads_only_the_transport_its_devices_use() {
        let mut spec = GuestSpec::new("/k");
        spec.channel = Some("/tmp/ch.sock".into());
        for (machine, transport, device) in [
            ("q35", "pci", "virtio-serial-pci"),
            ("microvm", "mmio", "virtio-serial-device"),
        ] {
            let q = qemu(machine, Accel::Tcg);
            assert_eq!(q.virtio_transports(), &[transport], "{machine}");
            let s = args(&q.command(&spec).unwrap()).join(" ");
            assert!(s.contains(device), "{machine}: {s}");
        }
    }

    #[test]
    fn the_host_tsc_rate_is_plausible() {
        let khz = host_tsc_khz().expect("the host TSC's rate");
        // 500 MHz … 10 GHz; and a second look agrees (it is measured once).
        assert!((500_000..10_000_000).contains(&khz), "{khz} kHz");
        assert_eq!(
            measure_tsc_khz().map(|k| k.abs_diff(khz) < khz / 100),
            Some(true)
        );
    }

    #[test]
    fn firmware_choice_and_its_log_on_the_console() {
        let spec = GuestSpec::new("/k");
        let mut q = qemu("q35", Accel::Tcg);
        let s = args(&q.command(&spec).unwrap()).join(" ");
        assert!(!s.contains("-bios") && s.contains("-serial stdio"), "{s}");
        q.bios = Some("/usr/share/qemu/qboot.rom".into());
        q.firmware_log = true;
        let s = args(&q.command(&spec).unwrap()).join(" ");
        assert!(s.contains("-bios /usr/share/qemu/qboot.rom"), "{s}");
        assert!(
            s.contains(
                "-chardev stdio,mux=on,id=con0 -serial chardev:con0 \
                 -device isa-debugcon,chardev=con0,iobase=0x402"
            ),
            "{s}"
        );
    }

    #[test]
    fn icount_counts_instructions_under_tcg_only() {
        let spec = GuestSpec::new("/k");
        let mut q = qemu("q35", Accel::Tcg);
        assert!(!args(&q.command(&spec).unwrap()).contains(&"-icount".to_string()));
        q.icount = true;
        let s = args(&q.command(&spec).unwrap()).join(" ");
        assert!(
            s.contains("-accel tcg -cpu max -icount shift=0,sleep=off"),
            "{s}"
        );
        q.accel = Accel::Kvm;
        let e = q.command(&spec).unwrap_err().to_string();
        assert!(e.contains("--accel tcg"), "{e}");
    }

    #[test]
    fn q35_kvm_with_disk() {
        let mut spec = GuestSpec::new("/k");
        spec.devices = ember_vmm::machine::DeviceSet {
            disks: ["/d,ro,direct,serial=s1", "/e"]
                .map(|d| d.parse().unwrap())
                .into(),
            rng: Some(Default::default()),
            balloon: Some(Default::default()),
            net: vec![
                "tap=tap7,mac=02:00:00:00:00:07,mtu=9000".parse().unwrap(),
                "fd=5".parse().unwrap(),
            ],
            ..Default::default()
        };
        spec.console = false;
        let s = args(&qemu("q35", Accel::Kvm).command(&spec).unwrap()).join(" ");
        let cpu = if hardware_kvm_usable() {
            "host"
        } else {
            "qemu64"
        };
        assert!(s.contains(&format!("-M q35 -accel kvm -cpu {cpu}")), "{s}");
        assert!(s.contains("-serial null"));
        assert!(s.contains("file=/d,format=raw,if=none,cache=none,aio=io_uring,readonly=on"));
        assert!(s.contains("virtio-blk-pci,drive=d0,serial=s1"));
        assert!(s.contains("file=/e,format=raw,if=none,cache=writeback,aio=io_uring -device"));
        assert!(
            s.contains("-device virtio-rng-pci -device virtio-balloon-pci"),
            "{s}"
        );
        assert!(
            s.contains(
                "-netdev tap,id=n0,ifname=tap7,script=no,downscript=no,vhost=off,vnet_hdr=on \
                 -device virtio-net-pci,netdev=n0,mac=02:00:00:00:00:07,host_mtu=9000"
            ),
            "{s}"
        );
        // A passed tap: QEMU refuses script=, downscript= and vnet_hdr= with fd=.
        assert!(
            s.contains("-netdev tap,id=n1,fd=5,vhost=off -device virtio-net-pci,netdev=n1"),
            "{s}"
        );
    }

    #[test]
    fn pmem_is_a_virtio_pmem_pci_memory_device() {
        let dir = ember_testing::TempDir::new("qemu-pmem");
        let (a, b) = (dir.join("a.img"), dir.join("b.img"));
        std::fs::File::create(&a).unwrap().set_len(4 << 20).unwrap();
        std::fs::File::create(&b).unwrap().set_len(2 << 20).unwrap();
        let mut spec = GuestSpec::new("/k");
        spec.devices.pmem = vec![PmemConfig::new(&a), PmemConfig::new(&b)];
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(s.contains("-m 256M,maxmem=262M "), "{s}");
        assert!(
            s.contains(&format!(
                "-object memory-backend-file,id=pmem0,share=on,mem-path={},size=4194304 \
                 -device virtio-pmem-pci,memdev=pmem0,id=vpmem0",
                a.display()
            )),
            "{s}"
        );
        assert!(
            s.contains("id=pmem1,share=on") && s.contains("memdev=pmem1"),
            "{s}"
        );

        // microvm has no memory-device area; a file QEMU would have to grow
        // (or cannot find) is refused, in one line each.
        let e = qemu("microvm", Accel::Tcg).command(&spec).unwrap_err();
        assert!(e.to_string().contains("microvm"), "{e}");
        std::fs::File::create(&b).unwrap().set_len(3 << 20).unwrap();
        let e = qemu("q35", Accel::Tcg)
            .command(&spec)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 2 MiB") && !e.contains('\n'), "{e}");
        spec.devices.pmem = vec![PmemConfig::new(dir.join("missing.img"))];
        let e = qemu("q35", Accel::Tcg)
            .command(&spec)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.img"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `ember run --net`: a virtio-net device on the machine's transport,
    /// its netdev the already-connected socket to passt, by number.
    #[test]
    fn a_network_is_a_stream_netdev_on_passts_socket() {
        let mut spec = GuestSpec::new("/k");
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(!s.contains("netdev"), "{s}");
        spec.net_fd = Some(7);
        for (machine, device) in [("q35", "virtio-net-pci"), ("microvm", "virtio-net-device")] {
            let s = args(&qemu(machine, Accel::Tcg).command(&spec).unwrap()).join(" ");
            assert!(
                s.contains(&format!(
                    "-netdev stream,id=net0,addr.type=fd,addr.str=7 -device {device},netdev=net0"
                )),
                "{machine}: {s}"
            );
        }
    }

    /// A virtio-mem region is a `virtio-mem-pci` device in the device-memory
    /// area: `-m` is the boot RAM, `maxmem` all of it; refused on microvm.
    #[test]
    fn a_region_is_a_virtio_mem_pci_device_beside_the_boot_ram() {
        let mut spec = GuestSpec::new("/k");
        spec.mem_mib = 1024;
        spec.devices.mem = Some(ember_vmm::devices::virtio::MemConfig::new(768 << 20).unwrap());
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(s.contains("-m 256M,maxmem=1024M "), "{s}");
        assert!(
            s.contains(
                "-object memory-backend-ram,id=vmem0,size=768M \
                 -device virtio-mem-pci,id=vm0,memdev=vmem0,block-size=2048K,requested-size=768M"
            ),
            "{s}"
        );
        // With a share the region is shared memory too (virtiofsd maps it).
        spec.shares.push(super::super::Share {
            tag: "root".into(),
            dir: "/".into(),
            read_only: true,
            socket: Some("/tmp/fs.sock".into()),
        });
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(
            s.contains("memory-backend-memfd,id=ram0,size=256M,share=on"),
            "{s}"
        );
        assert!(
            s.contains("memory-backend-memfd,id=vmem0,size=768M,share=on"),
            "{s}"
        );
        let e = qemu("microvm", Accel::Tcg).command(&spec).unwrap_err();
        assert!(
            e.to_string().contains("virtio-mem region on microvm"),
            "{e}"
        );
    }

    /// A share is a vhost-user-fs device on the daemon's socket, and guest
    /// memory a shared memfd the daemon can map; one without its socket is
    /// refused.
    #[test]
    fn a_share_is_a_vhost_user_fs_device_over_shared_memory() {
        let mut spec = GuestSpec::new("/k");
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(!s.contains("memory-backend"), "{s}");
        spec.mem_mib = 512;
        spec.shares.push(super::super::Share {
            tag: "root".into(),
            dir: "/".into(),
            read_only: true,
            socket: Some("/tmp/fs.sock".into()),
        });
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(
            s.starts_with(
                "-object memory-backend-memfd,id=ram0,size=512M,share=on \
                 -M q35,memory-backend=ram0 "
            ),
            "{s}"
        );
        assert!(
            s.contains("-chardev socket,id=fs0,path=/tmp/fs.sock ")
                && s.contains("-device vhost-user-fs-pci,chardev=fs0,tag=root"),
            "{s}"
        );
        spec.channel = Some("/tmp/ch.sock".into());
        let s = args(&qemu("microvm", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(
            s.contains("-device vhost-user-fs-device,chardev=fs0"),
            "{s}"
        );
        // The share's chardev is connected before the channel's (whose
        // connection tells ember it may remove the daemon's socket); its
        // device comes after the channel's, which the guest names by its
        // virtio index (`vport0p1`).
        assert!(s.find("id=fs0").unwrap() < s.find("id=ch0").unwrap(), "{s}");
        assert!(
            s.find("virtserialport").unwrap() < s.find("vhost-user-fs").unwrap(),
            "{s}"
        );
        spec.shares[0].socket = None;
        let e = qemu("q35", Accel::Tcg).command(&spec).unwrap_err();
        assert!(e.to_string().contains("virtiofsd socket"), "{e}");
    }

    #[test]
    fn no_acpi_turns_the_machines_acpi_off() {
        let mut spec = GuestSpec::new("/k");
        spec.acpi = false;
        let s = args(&qemu("microvm", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(
            s.starts_with("-M microvm,x-option-roms=off,rtc=off,acpi=off "),
            "{s}"
        );
        let e = qemu("q35", Accel::Tcg).command(&spec).unwrap_err();
        assert!(e.to_string().contains("--machine microvm"), "{e}");
        spec.acpi = true;
        let s = args(&qemu("q35", Accel::Tcg).command(&spec).unwrap()).join(" ");
        assert!(!s.contains("acpi=off"), "{s}");
    }

    #[test]
    fn what_qemu_lacks_is_refused() {
        let q = qemu("q35", Accel::Tcg);
        let mut spec = GuestSpec::new("/k");
        spec.events = Some("/e.json".into());
        assert!(
            q.command(&spec)
                .unwrap_err()
                .to_string()
                .contains("--events")
        );
        let mut spec = GuestSpec::new("/k");
        spec.prefault = Some("async".into());
        assert!(
            q.command(&spec)
                .unwrap_err()
                .to_string()
                .contains("--prefault")
        );
        let mut spec = GuestSpec::new("/k");
        spec.devices.disks.push("/d,poll=5".parse().unwrap());
        assert!(q.command(&spec).unwrap_err().to_string().contains("poll="));
        let mut spec = GuestSpec::new("/k");
        spec.devices.balloon = Some(ember_vmm::devices::virtio::BalloonConfig {
            target_bytes: 1 << 20,
            ..Default::default()
        });
        let e = q.command(&spec).unwrap_err().to_string();
        assert!(e.contains("balloon inflated"), "{e}");
        let mut spec = GuestSpec::new("/k");
        spec.devices.vsock = Some("cid=3,uds=/v.sock".parse().unwrap());
        let e = q.command(&spec).unwrap_err().to_string();
        assert!(e.contains("--vsock"), "{e}");
        let mut spec = GuestSpec::new("/k");
        spec.devices.fs.push("tag=t,dir=/srv".parse().unwrap());
        assert!(q.command(&spec).unwrap_err().to_string().contains("--fs"));
    }
}
