//! The one place that knows the boot order. Reading [`build`] top to bottom is
//! reading how a microVM comes to life:
//!
//! 1. open /dev/kvm;
//! 2. start the vCPU threads — they fetch KVM's CPUID while the VM is being
//!    made, then create and configure their vCPUs in parallel with everything
//!    that follows;
//! 3. create the VM and map guest memory (lazily); on another thread, give
//!    its first GiB to KVM (the rest on first touch), create the in-kernel
//!    irqchip, then the PIT while the vCPU threads create their vCPUs;
//! 4. meanwhile, load the kernel straight from its file into guest memory (ELF
//!    with a PVH note, ELF without, or bzImage) and the initramfs after it;
//! 5. create the virtio devices and attach them through the
//!    `DeviceManager` (MMIO windows, irqfds, ioeventfds);
//! 6. write the boot structures: command line, GDT, page tables, MP table, ACPI
//!    tables, and the zero page with its e820 map or the PVH start info;
//! 7. attach the legacy devices (COM1, i8042, debug ports, ACPI sleep);
//! 8. hand every vCPU the finished buses and the boot vCPU its entry registers;
//!    it enters the guest.
//!
//! `ARCHITECTURE.md` walks the same path, with the same numbers and more of
//! the why.

use crate::arch::x86_64::{acpi, boot, cpuid, layout, mptable, msr, regs};
use crate::device_manager::{DeviceManager, DeviceManagerError, TransportFactory, transport_for};
use crate::devices::legacy::{ConsoleSink, Serial, SerialUart};
use crate::devices::virtio::pmem::PMEM_ALIGN;
use crate::devices::virtio::{
    self, Balloon, BalloonConfig, BalloonHandle, Block, Console, Fs, FsConfig, MemConfig, MemError,
    MemHandle, Net, Pmem, PmemConfig, PmemRegion, Rng, VirtioMem, Vsock,
};
use crate::devices::vmgenid;
use crate::events::{Recorder, kind};
use crate::machine::{Attached, AttachedDevice, DeviceConfig, DeviceSet, Machine, Placement};
use crate::prefault::{self, CommitError, Committer, MemoryOptions, Prefault};
use crate::vstate::bus::Bus;
use crate::vstate::end::{EndError, VmEnd};
use crate::vstate::kvm::{self, KvmError};
use crate::vstate::memory::{self, MemoryError};
use crate::vstate::vcpu::{BootEntry, Control, Vcpu, VcpuError};
use crate::vstate::vm::{Vm, VmError};
use linux_loader::loader::bootparam::setup_header;
use linux_loader::loader::elf::{self, Elf, PvhBootCapability};
use linux_loader::loader::{self, KernelLoader, bzimage::BzImage};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Offset of the 64-bit entry point from the start of a bzImage's protected-mode
/// code (the boot protocol's `startup_64`).
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Boot protocol 2.06 is the oldest with `cmdline_size`; ember needs 64-bit entry (2.12+ in practice).
const MIN_BOOT_PROTOCOL: u16 = 0x0206;
/// The boot protocol's default command-line limit before 2.06.
const DEFAULT_CMDLINE_SIZE: usize = 255;

/// VM build errors.
#[derive(Debug, Error)]
pub enum BuildError {
    /// KVM problems.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// Guest memory problems.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Committing guest memory (`--prefault`, `--mem-lock`, `--hugepages`).
    #[error(transparent)]
    Commit(#[from] CommitError),
    /// VM set-up problems.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// vCPU set-up problems.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// More vCPUs than KVM (or our firmware tables) allow.
    #[error("{asked} vCPUs requested, but this host allows at most {max}")]
    TooManyVcpus {
        /// Requested.
        asked: u32,
        /// Allowed.
        max: u32,
    },
    /// Zero vCPUs.
    #[error("a VM needs at least one vCPU")]
    NoVcpus,
    /// The vsock device's socket.
    #[error(transparent)]
    Vsock(virtio::VsockError),
    /// The kernel file cannot be opened.
    #[error("cannot open kernel {0}")]
    KernelOpen(PathBuf, #[source] std::io::Error),
    /// The kernel is neither a loadable ELF nor a bzImage.
    #[error("{path} is not a kernel ember can boot (ELF: {elf}; bzImage: {bzimage})")]
    NotAKernel {
        /// Kernel path.
        path: PathBuf,
        /// Why the ELF loader refused it.
        elf: String,
        /// Why the bzImage loader refused it.
        bzimage: String,
    },
    /// A bzImage with a boot protocol too old to boot directly.
    #[error("{path} uses boot protocol {version:#x}; ember needs at least 2.06")]
    OldBootProtocol {
        /// Kernel path.
        path: PathBuf,
        /// Its protocol version.
        version: u16,
    },
    /// The initramfs cannot be read.
    #[error("cannot read initrd {0}")]
    Initrd(PathBuf, #[source] std::io::Error),
    /// x86 boot structures could not be written.
    #[error(transparent)]
    Boot(#[from] boot::Error),
    /// Registers/GDT/page tables.
    #[error(transparent)]
    Regs(#[from] regs::Error),
    /// CPUID set-up.
    #[error(transparent)]
    Cpuid(#[from] cpuid::Error),
    /// MP table.
    #[error(transparent)]
    Mptable(#[from] mptable::Error),
    /// ACPI tables.
    #[error(transparent)]
    Acpi(#[from] acpi::Error),
    /// The VM generation ID could not be written.
    #[error(transparent)]
    VmGenId(#[from] vmgenid::Error),
    /// Placing a device failed.
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// The virtio-mem region cannot be offered.
    #[error("virtio-mem")]
    Hotplug(#[from] MemError),
    /// A pmem backing file could not be mapped.
    #[error("cannot map pmem file {0}: {1}")]
    Pmem(PathBuf, String),
    /// A virtio-fs share is refused.
    #[error(transparent)]
    Fs(virtio::fs::Error),
    /// A disk could not be opened or is unusable.
    #[error("cannot attach disk {0}")]
    Disk(PathBuf, #[source] virtio::block::Error),
    /// A network device's backend could not be opened, or its options are wrong.
    #[error("--net: {0}")]
    Net(#[source] virtio::net::Error),
    /// The appliance channel socket could not be reached.
    #[error("cannot connect the channel to {0}")]
    Channel(PathBuf, #[source] std::io::Error),
    /// The main thread's seccomp filter could not be installed.
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    /// The handler of the signal that kicks vCPUs out of KVM_RUN.
    #[error("cannot install the vCPU kick handler")]
    KickHandler(#[source] crate::vstate::control::ControlError),
    /// The caller's work before the vCPUs start ([`BeforeGo`]).
    #[error("cannot start the VM's helper threads")]
    BeforeGo(#[source] std::io::Error),
    /// Eventfd/thread plumbing.
    #[error("VMM plumbing failed")]
    Io(#[from] std::io::Error),
}

/// What to boot, validated by the caller.
pub struct VmConfig {
    /// Kernel image.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line (device announcements are appended).
    pub cmdline: String,
    /// Guest RAM in bytes.
    pub mem_size: u64,
    /// vCPU count.
    pub vcpus: u32,
    /// Where the serial console writes (None: console off).
    pub console: Option<Box<dyn Write + Send>>,
    /// Write ACPI tables (MP table is always written).
    pub acpi: bool,
    /// The virtio devices: disks, pmem regions (a DAX root), rng, balloon.
    pub devices: DeviceSet,
    /// A unix socket to connect a virtio-console port to.
    pub channel: Option<PathBuf>,
    /// How guest memory is backed and committed (`--prefault`, `--mem-lock`, `--hugepages`).
    pub memory: MemoryOptions,
    /// Run once the VM is complete, before the vCPUs start (see [`BeforeGo`]).
    pub before_go: Option<BeforeGo>,
}

/// Work the caller does on the building thread once the VM is complete, just
/// before that thread takes its seccomp filter and the vCPUs start: the place
/// to start the caller's own threads (console input, the control socket).
/// Started here they are not under the building thread's filter (each takes
/// its own), so that filter stays short: installing one costs kernel time in
/// proportion to its length, on the way to the guest's first instruction.
pub type BeforeGo = Box<dyn FnOnce(&Arc<Machine>) -> std::io::Result<()> + Send>;

/// What a parked vCPU thread receives when the VM is complete.
struct Start {
    mem: GuestMemoryMmap,
    io: Bus,
    mmio: Bus,
    entry: BootEntry,
}

/// Builds the VM described by `cfg` and starts its vCPUs. Steps are numbered
/// as in the module docs and `ARCHITECTURE.md`.
///
/// One function on purpose: the numbered boot path reads top to bottom, each
/// step a call or a few lines, as ARCHITECTURE.md walks it.
pub fn build(cfg: VmConfig, recorder: Arc<Recorder>) -> Result<Arc<Machine>, BuildError> {
    if cfg.vcpus == 0 {
        return Err(BuildError::NoVcpus);
    }
    memory::check_size(cfg.mem_size)?;

    // 1. KVM.
    let kvm = Arc::new(kvm::open()?);
    check_vcpu_count(&kvm, cfg.vcpus)?;

    // 2. vCPU threads, started before the VM exists (see `start_vcpu_threads`).
    let end = Arc::new(VmEnd::new()?);
    let control = Control::new(cfg.vcpus as usize);
    let vcpus = start_vcpu_threads(&kvm, cfg.vcpus, &end, &control, &recorder)?;

    // 3. The VM and guest memory; KVM learns of the memory on a thread of its
    // own (`register_memory`) while this one loads the kernel into it.
    let vm = Arc::new(Vm::new(&kvm)?);
    recorder.mark(kind::KVM_OPEN);
    let mem = prefault::create_memory(cfg.mem_size, &cfg.memory)?;
    let ram = layout::ram_ranges(cfg.mem_size);
    let committer =
        (cfg.memory.prefault != Prefault::Off).then(|| Committer::new(&mem, cfg.memory.threads));
    let upfront = match &committer {
        Some(c) => Some(commit_upfront(c, &cfg.memory, &recorder)?),
        None => None,
    };
    // The virtio-mem region: guest memory KVM and the devices see, but not
    // the guest's boot map (`ram`); its own committer's.
    let hotplug_at = layout::hotplug_start(cfg.mem_size);
    let (mem, hotplug_mem) = match &cfg.devices.mem {
        Some(c) => {
            c.check()?;
            let (all, alone) = memory::add_hotplug(&mem, hotplug_at, c.size)?;
            if cfg.memory.mem_lock {
                prefault::lock(&alone)?;
            }
            (all, Some(alone))
        }
        None => (mem, None),
    };
    let above = cfg
        .devices
        .mem
        .as_ref()
        .map_or(0, |c| hotplug_at + c.size)
        .max(ram.last().map_or(0, |r| r.0 + r.1));
    let pmem = map_pmem(&cfg.devices.pmem, above)?;
    let kvm_side = register_memory(&vm, &mem, &pmem, vcpus.readies, &recorder)?;

    // 4. Kernel and initramfs, read once, straight into guest memory.
    let (entry, hdr, kernel_end) = load_kernel(&mem, &cfg.kernel)?;
    recorder.mark(kind::KERNEL_LOADED);
    let initrd = match &cfg.initrd {
        Some(path) => {
            let max = hdr.map(|h| h.initrd_addr_max).filter(|&m| m != 0);
            let r = load_initrd(&mem, &ram, path, max, kernel_end)?;
            recorder.mark(kind::INITRD_LOADED);
            Some(r)
        }
        None => None,
    };
    // Interrupt lines need the irqchip.
    join(kvm_side)?;

    // 5. virtio devices, placed by the device manager.
    let mut devices = DeviceManager::new(vm.clone(), mem.clone());
    let Attached {
        devices: attached,
        balloon,
        hotplug,
    } = attach_virtio_devices(&mut devices, &cfg, &pmem, committer.as_ref(), hotplug_at)?;
    if let (Some(h), Some(region)) = (&hotplug, &hotplug_mem)
        && cfg.memory.prefault == Prefault::Sync
    {
        prefault::commit_hotplug(&Committer::new(region, cfg.memory.threads), h, &cfg.memory)?;
    }

    // 6. Boot structures, announcing the devices (and the absence of PCI).
    let cmdline = boot::with_no_pci(&devices.announce_on_cmdline(&cfg.cmdline));
    let boot = BootInfo { entry, hdr, initrd };
    write_boot_structures(&mem, &cfg, &cmdline, devices.acpi_devices(), &ram, &boot)?;

    // 7. Legacy devices.
    let sink = ConsoleSink::new(cfg.console, recorder.clone());
    let serial = Arc::new(Mutex::new(Serial(SerialUart::new(
        devices.com1_irq()?,
        sink,
    ))));
    devices.attach_legacy(serial.clone(), &end, &recorder)?;
    if let Some(t) = upfront {
        join(t)?;
    }

    // 8. Go. Every thread this one starts is started first (the background
    // commit, the caller's), so none runs under this thread's filter; then
    // this thread takes its filter (the vCPUs took theirs while they waited);
    // every vCPU gets the finished buses, the boot vCPU also its entry. The
    // vCPU kick handler is installed before the filter: the control socket
    // pauses vCPUs from threads whose lists have no `rt_sigaction`, and may
    // do so before any vCPU has run.
    let (io, mmio) = devices.into_buses();
    let machine = Arc::new(Machine {
        control,
        devices: attached,
        mem_size: cfg.mem_size,
        vcpus: cfg.vcpus,
        anonymous_memory: true,
        vmgenid: cfg.acpi,
        balloon: balloon.clone(),
        hotplug: hotplug.clone(),
        vm: vm.clone(),
        mem: mem.clone(),
        serial,
        end,
        _vcpu_threads: vcpus.threads,
        _pmem: pmem.into_iter().map(|p| p.region).collect(),
        _committer: committer.clone(),
    });
    if let Some(c) = committer
        .as_ref()
        .filter(|_| cfg.memory.prefault == Prefault::Async)
    {
        c.start_background(balloon, &cfg.memory, recorder.clone())?;
    }
    if let (Some(h), Some(region)) = (hotplug, hotplug_mem)
        && cfg.memory.prefault == Prefault::Async
    {
        prefault::start_hotplug_background(region, h, &cfg.memory, recorder.clone())?;
    }
    if let Some(f) = cfg.before_go {
        f(&machine).map_err(BuildError::BeforeGo)?;
    }
    crate::vstate::control::install_kick_handler().map_err(BuildError::KickHandler)?;
    crate::seccomp::confine(crate::seccomp::Thread::Main)?;
    let start = Arc::new(Start {
        mem,
        io,
        mmio,
        entry,
    });
    for tx in vcpus.starts {
        // A vCPU thread that already failed has hung up; its error is in `end`.
        let _ = tx.send(start.clone());
    }
    Ok(machine)
}

/// Refuses more vCPUs than KVM, or the MP table, can describe.
fn check_vcpu_count(kvm: &kvm_ioctls::Kvm, vcpus: u32) -> Result<(), BuildError> {
    let max = u32::try_from(kvm.get_max_vcpus())
        .unwrap_or(u32::MAX)
        .min(mptable::max_cpus());
    if vcpus > max {
        return Err(BuildError::TooManyVcpus { asked: vcpus, max });
    }
    Ok(())
}

/// Joins a set-up thread, passing its panic on.
fn join<E>(t: JoinHandle<Result<(), E>>) -> Result<(), BuildError>
where
    BuildError: From<E>,
{
    Ok(t.join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?)
}

/// The vCPU threads and the two hand-overs each waits for.
struct VcpuThreads {
    /// The VM, once its irqchip exists: each thread then creates its vCPU.
    readies: Vec<mpsc::Sender<Arc<Vm>>>,
    /// The finished buses and the boot entry: each thread then runs.
    starts: Vec<mpsc::Sender<Arc<Start>>>,
    threads: Vec<JoinHandle<()>>,
}

/// Starts one thread per vCPU before the VM exists: asking KVM for its CPUID
/// (once per process; a few hundred microseconds where CPUID traps to the
/// hypervisor) runs while the main thread creates the VM and its memory. Each
/// thread then waits for the irqchip, creates and configures its vCPU in
/// parallel with steps 4-7, and waits for the go. Errors go to `end`.
fn start_vcpu_threads(
    kvm: &Arc<kvm_ioctls::Kvm>,
    vcpus: u32,
    end: &Arc<VmEnd>,
    control: &Arc<Control>,
    recorder: &Arc<Recorder>,
) -> Result<VcpuThreads, BuildError> {
    let mut out = VcpuThreads {
        readies: Vec::new(),
        starts: Vec::new(),
        threads: Vec::new(),
    };
    let configured = Arc::new(AtomicU32::new(0));
    for id in 0..vcpus {
        let (ready_tx, ready_rx) = mpsc::channel::<Arc<Vm>>();
        let (tx, rx) = mpsc::channel::<Arc<Start>>();
        out.readies.push(ready_tx);
        out.starts.push(tx);
        let (kvm, end, recorder, configured, control) = (
            kvm.clone(),
            end.clone(),
            recorder.clone(),
            configured.clone(),
            control.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("ember-vcpu{id}"))
            .spawn(move || {
                let result = (|| -> Result<(), BuildError> {
                    let supported = kvm::supported_cpuid(&kvm)?;
                    // Filtered while it would otherwise wait for the VM:
                    // everything it does from here on is on the vCPU list.
                    Vcpu::confine_thread(id)?;
                    // A closed channel means the build failed: just leave.
                    let Ok(vm) = ready_rx.recv() else {
                        return Ok(());
                    };
                    let mut vcpu = Vcpu::new(vm.fd(), id)?;
                    // The TSC rate goes into the KVM timing leaf so guests need not
                    // calibrate, and the LAPIC's TSC-deadline mode spares them
                    // calibrating its timer.
                    let timers = cpuid::Timers {
                        tsc_khz: vcpu.tsc_khz(),
                        tsc_deadline: kvm::tsc_deadline_timer(&kvm),
                    };
                    let cpuid = cpuid::configure_cpuid(supported, id, vcpus, timers)?;
                    vcpu.configure(&cpuid, &msr::boot_msrs())?;
                    if configured.fetch_add(1, Ordering::SeqCst) + 1 == vcpus {
                        recorder.mark(kind::VCPUS_CREATED);
                    }
                    let Ok(start) = rx.recv() else { return Ok(()) };
                    if id == 0 {
                        vcpu.set_boot_state(start.entry)?;
                        recorder.mark(kind::FIRST_GUEST_ENTRY);
                    }
                    Ok(vcpu.run(&start.io, &start.mmio, &end, &vm, &start.mem, &control)?)
                })();
                if let Err(e) = result {
                    end.fail(EndError::Vcpu(crate::error_chain(&e)));
                }
            })?;
        out.threads.push(thread);
    }
    Ok(out)
}

/// `--prefault`: commits the pages the guest starts with (all of it, or the
/// boot window) on a thread of its own while the kernel loads; the guest
/// starts once it is done. `async` commits the rest after the guest started.
fn commit_upfront(
    c: &Committer,
    opts: &MemoryOptions,
    recorder: &Arc<Recorder>,
) -> Result<JoinHandle<Result<(), CommitError>>, BuildError> {
    let (c, opts, recorder) = (c.clone(), opts.clone(), recorder.clone());
    Ok(std::thread::Builder::new()
        .name("ember-prefault".into())
        .spawn(move || -> Result<(), CommitError> {
            if opts.prefault == Prefault::Sync {
                c.commit_all()?;
                recorder.mark(prefault::EVENT_COMMITTED);
            } else {
                c.set_fence_up(true);
                c.commit_window(opts.window)?;
            }
            Ok(())
        })?)
}

/// A virtio-pmem file mapped for the guest.
struct MappedPmem {
    config: PmemConfig,
    region: PmemRegion,
    /// Where it sits in guest-physical space.
    addr: u64,
}

/// Maps the pmem files into guest-physical space above `above` (the end of
/// RAM and of a virtio-mem region), each at a 2 MiB boundary (what the
/// guest's nd_pmem driver needs for DAX).
fn map_pmem(pmem: &[PmemConfig], above: u64) -> Result<Vec<MappedPmem>, BuildError> {
    let mut next = layout::PMEM_START_MIN
        .max(above)
        .next_multiple_of(PMEM_ALIGN);
    let mut out = Vec::new();
    for config in pmem {
        let path = &config.path;
        let region = PmemRegion::map(path)
            .map_err(|e| BuildError::Pmem(path.clone(), crate::error_chain(&e)))?;
        let addr = next;
        next = (next + region.len()).next_multiple_of(PMEM_ALIGN);
        out.push(MappedPmem {
            config: config.clone(),
            region,
            addr,
        });
    }
    Ok(out)
}

/// Gives guest memory to KVM (~0.3 ms per 512 MiB where KVM allocates per-page
/// metadata for each slot) on a thread of its own: RAM and the pmem files,
/// before the irqchip exists (see `Vm::new`); then the vCPU threads may create
/// their vCPUs, while the PIT (a kernel thread of its own) is made.
fn register_memory(
    vm: &Arc<Vm>,
    mem: &GuestMemoryMmap,
    pmem: &[MappedPmem],
    readies: Vec<mpsc::Sender<Arc<Vm>>>,
    recorder: &Arc<Recorder>,
) -> Result<JoinHandle<Result<(), BuildError>>, BuildError> {
    let (vm, mem, recorder) = (vm.clone(), mem.clone(), recorder.clone());
    // (guest address, length, host address) of each pmem file; the mappings
    // live in the `Machine` as long as the VM.
    let slots: Vec<_> = pmem
        .iter()
        .map(|p| (p.addr, p.region.len(), p.region.host_addr()))
        .collect();
    Ok(std::thread::Builder::new()
        .name("ember-memory".into())
        .spawn(move || -> Result<(), BuildError> {
            vm.register_memory(&mem)?;
            for (addr, len, host) in slots {
                vm.add_region(addr, len, host)?;
            }
            vm.create_irqchip()?;
            recorder.mark(kind::MEMORY_READY);
            for ready in readies {
                // A vCPU thread that already failed has hung up; its error is in `end`.
                let _ = ready.send(vm.clone());
            }
            vm.create_pit()?;
            Ok(())
        })?)
}

/// Creates the virtio devices `cfg` asks for and attaches them in a fixed
/// order (disks, channel, rng, pmem, balloon, network devices, vsock, shares,
/// virtio-mem at `hotplug_at`). Returns them as a snapshot records them, the
/// balloon's handle and the virtio-mem device's.
fn attach_virtio_devices(
    devices: &mut DeviceManager,
    cfg: &VmConfig,
    pmem: &[MappedPmem],
    committer: Option<&Committer>,
    hotplug_at: u64,
) -> Result<Attached, BuildError> {
    let mut attached = Vec::new();
    let mut place = |config: DeviceConfig,
                     placement: Placement,
                     make: TransportFactory|
     -> Result<(), BuildError> {
        let transport = devices.attach_virtio(make)?;
        attached.push(AttachedDevice {
            config,
            placement,
            transport,
            fs: None,
        });
        Ok(())
    };
    let here = Placement::default();
    for disk in &cfg.devices.disks {
        let block = Block::new(disk).map_err(|e| BuildError::Disk(disk.path.clone(), e))?;
        place(
            DeviceConfig::Block(disk.clone()),
            here,
            transport_for(block),
        )?;
    }
    if let Some(sock) = &cfg.channel {
        let stream = UnixStream::connect(sock).map_err(|e| BuildError::Channel(sock.clone(), e))?;
        let console =
            Console::from_unix_stream(stream).map_err(|e| BuildError::Channel(sock.clone(), e))?;
        place(DeviceConfig::Console, here, transport_for(console))?;
    }
    if let Some(rng) = &cfg.devices.rng {
        place(
            DeviceConfig::Rng(rng.clone()),
            here,
            transport_for(Rng::new()),
        )?;
    }
    for p in pmem {
        let dev = Pmem::new(&p.region, p.addr)
            .map_err(|e| BuildError::Pmem(p.config.path.clone(), e.to_string()))?;
        let placement = Placement {
            region: Some(p.addr),
        };
        place(
            DeviceConfig::Pmem(p.config.clone()),
            placement,
            transport_for(dev),
        )?;
    }
    let balloon = match balloon_device(cfg, committer)? {
        Some((config, dev, handle)) => {
            place(DeviceConfig::Balloon(config), here, transport_for(dev))?;
            Some(handle)
        }
        None => None,
    };
    for net in &cfg.devices.net {
        // The MAC is fixed here, so that a snapshot records the one the guest saw.
        let mut net = net.clone();
        net.mac.get_or_insert_with(virtio::net::MacAddr::random);
        let dev = Net::new(&net).map_err(BuildError::Net)?;
        place(DeviceConfig::Net(net), here, transport_for(dev))?;
    }
    if let Some(v) = &cfg.devices.vsock {
        let dev = Vsock::new(v).map_err(BuildError::Vsock)?;
        place(DeviceConfig::Vsock(v.clone()), here, transport_for(dev))?;
    }
    FsConfig::check_tags(&cfg.devices.fs).map_err(BuildError::Fs)?;
    let mut tables = Vec::new();
    for share in &cfg.devices.fs {
        let dev = Fs::new(share).map_err(BuildError::Fs)?;
        tables.push(dev.handle());
        place(DeviceConfig::Fs(share.clone()), here, transport_for(dev))?;
    }
    let hotplug = match &cfg.devices.mem {
        Some(config) => {
            let (dev, handle) = mem_device(config, cfg.memory.prefault, hotplug_at)?;
            let placement = Placement {
                region: Some(hotplug_at),
            };
            place(
                DeviceConfig::Mem(config.clone()),
                placement,
                transport_for(dev),
            )?;
            Some(handle)
        }
        None => None,
    };
    let shares = attached
        .iter_mut()
        .filter(|d| matches!(d.config, DeviceConfig::Fs(_)));
    for (d, table) in shares.zip(tables) {
        d.fs = Some(table);
    }
    Ok(Attached {
        devices: attached,
        balloon,
        hotplug,
    })
}

/// The balloon `cfg` asks for, or the one `--prefault async` needs for its
/// fence; its configuration, the device and its handle.
fn balloon_device(
    cfg: &VmConfig,
    committer: Option<&Committer>,
) -> Result<Option<(BalloonConfig, Balloon, BalloonHandle)>, BuildError> {
    let fenced = cfg.memory.prefault == Prefault::Async;
    let Some(config) = cfg
        .devices
        .balloon
        .clone()
        .or_else(|| fenced.then(BalloonConfig::default))
    else {
        return Ok(None);
    };
    // `async`: the guest may use the boot window only, until the committer
    // lowers the target chunk by chunk.
    let mut dev = Balloon::new(0)?;
    // Committed memory stays committed: with `--prefault` the guest's free
    // pages are not reported (each report would drop pages the user asked
    // to have ready); only a balloon target gives memory back.
    dev.set_free_page_reporting(config.free_page_reporting && cfg.memory.prefault == Prefault::Off);
    let handle = dev.handle();
    handle.set_target_bytes(config.target_bytes);
    if let Some(c) = committer.filter(|_| fenced) {
        let rest = c.ram_bytes().saturating_sub(cfg.memory.window);
        handle.set_fence_pages(u32::try_from(rest / 4096).unwrap_or(u32::MAX));
    }
    if let Some(c) = committer {
        handle.set_fence(c.fence());
    }
    Ok(Some((config, dev, handle)))
}

/// The virtio-mem device for `config` at `hotplug_at`, and its handle.
fn mem_device(
    config: &MemConfig,
    prefault: Prefault,
    hotplug_at: u64,
) -> Result<(VirtioMem, MemHandle), BuildError> {
    let dev = VirtioMem::new(config, hotplug_at)?;
    let handle = dev.handle();
    // All of it requested; with `--prefault` the committer lets the driver
    // have it as it is committed, without, it is all there (lazily backed)
    // at once.
    handle.set_requested(config.size)?;
    if prefault == Prefault::Off {
        handle.set_committed(config.size);
    } else {
        handle.keep_committed();
    }
    Ok((dev, handle))
}

/// What loading the kernel and initramfs decided, for the boot structures.
struct BootInfo {
    entry: BootEntry,
    hdr: Option<setup_header>,
    initrd: Option<(u64, u64)>,
}

/// Writes the command line, GDT and IDT, identity page tables, the MP table,
/// the ACPI tables (unless `--no-acpi`) and the zero page with its e820 map or
/// the PVH start info.
fn write_boot_structures(
    mem: &GuestMemoryMmap,
    cfg: &VmConfig,
    cmdline: &str,
    virtio: &[acpi::VirtioMmioAcpi],
    ram: &[(u64, u64)],
    boot_info: &BootInfo,
) -> Result<(), BuildError> {
    let cmdline_max = match boot_info.hdr {
        Some(h) if h.version >= MIN_BOOT_PROTOCOL => {
            (h.cmdline_size as usize).min(layout::CMDLINE_MAX_SIZE)
        }
        Some(_) => DEFAULT_CMDLINE_SIZE,
        // An ELF kernel has no setup header: Linux's own limit applies.
        None => boot::LINUX_CMDLINE_MAX,
    };
    boot::write_cmdline(mem, cmdline, cmdline_max)?;
    regs::write_gdt_and_idt(mem)?;
    regs::write_identity_page_tables(mem)?;
    mptable::setup_mptable(mem, cfg.vcpus)?;
    let rsdp = if cfg.acpi {
        // The DSDT describes the VM generation ID; its first value is
        // written now, for the guest's driver to read at probe.
        vmgenid::write_fresh_id(mem, layout::VMGENID_START)?;
        Some(acpi::setup_acpi(mem, cfg.vcpus, virtio)?)
    } else {
        None
    };
    let boot_layout = boot::BootLayout {
        ram,
        cmdline,
        initrd: boot_info.initrd,
        rsdp,
    };
    match boot_info.entry {
        BootEntry::Pvh(_) => boot::configure_pvh(mem, &boot_layout)?,
        BootEntry::Linux64(_) => boot::configure_linux(mem, &boot_layout, boot_info.hdr)?,
    }
    Ok(())
}

/// Loads the kernel from `path`: an ELF (entered through its PVH note when it
/// has one, else at its 64-bit entry) or a bzImage (64-bit entry).
fn load_kernel(
    mem: &GuestMemoryMmap,
    path: &Path,
) -> Result<(BootEntry, Option<setup_header>, u64), BuildError> {
    let mut file =
        crate::files::open_regular(path).map_err(|e| BuildError::KernelOpen(path.to_owned(), e))?;
    let himem = Some(GuestAddress(layout::HIMEM_START));
    let elf_err = match Elf::load(mem, None, &mut file, himem) {
        Ok(r) => {
            let entry = match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => BootEntry::Pvh(addr.0),
                _ => BootEntry::Linux64(r.kernel_load.0),
            };
            return Ok((entry, None, r.kernel_end));
        }
        // Only a wrong magic means "not an ELF": any other ELF error is the real problem.
        Err(loader::Error::Elf(elf::Error::InvalidElfMagicNumber)) => "not an ELF file".to_owned(),
        Err(e) => return Err(not_a_kernel(path, e.to_string(), "not tried".into())),
    };
    match BzImage::load(mem, None, &mut file, himem) {
        Ok(r) => {
            let hdr = r
                .setup_header
                .ok_or_else(|| not_a_kernel(path, elf_err.clone(), "no setup header".into()))?;
            if hdr.version < MIN_BOOT_PROTOCOL {
                return Err(BuildError::OldBootProtocol {
                    path: path.to_owned(),
                    version: hdr.version,
                });
            }
            // ember enters bzImages at their 64-bit entry, which only kernels that
            // say so (protocol 2.12+, XLF_KERNEL_64) have.
            boot::check_64bit_entry(&hdr)?;
            let entry = BootEntry::Linux64(r.kernel_load.0 + BZIMAGE_64BIT_ENTRY_OFFSET);
            // The kernel decompresses itself in place up to `init_size` past its load
            // address: nothing (the initramfs) may be put there.
            let end = boot::bzimage_kernel_end(&hdr, r.kernel_load.0, r.kernel_end);
            Ok((entry, Some(hdr), end))
        }
        Err(e) => Err(not_a_kernel(path, elf_err, e.to_string())),
    }
}

fn not_a_kernel(path: &Path, elf: String, bzimage: String) -> BuildError {
    BuildError::NotAKernel {
        path: path.to_owned(),
        elf,
        bzimage,
    }
}

/// Reads the initramfs straight into guest memory, as high as the protocol allows.
fn load_initrd(
    mem: &GuestMemoryMmap,
    ram: &[(u64, u64)],
    path: &Path,
    addr_max: Option<u32>,
    kernel_end: u64,
) -> Result<(u64, u64), BuildError> {
    let io_err = |e| BuildError::Initrd(path.to_owned(), e);
    let mut file = crate::files::open_regular(path).map_err(io_err)?;
    let size = file.metadata().map_err(io_err)?.len();
    let addr = boot::initrd_address(ram, size, addr_max, kernel_end)?;
    let len = usize::try_from(size).map_err(|_| io_err(std::io::ErrorKind::FileTooLarge.into()))?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, len)
        .map_err(|e| io_err(std::io::Error::other(e.to_string())))?;
    Ok((addr, size))
}
