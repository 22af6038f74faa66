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
//! 5. create the virtio devices (MMIO windows, irqfds, ioeventfds);
//! 6. write the boot structures: command line, GDT, page tables, MP table, ACPI
//!    tables, and the zero page with its e820 map or the PVH start info;
//! 7. put the legacy devices on the buses;
//! 8. hand every vCPU the finished buses and the boot vCPU its entry registers;
//!    it enters the guest.
//!
//! `ARCHITECTURE.md` walks the same path with more of the why.

use crate::arch::x86_64::{acpi, boot, cpuid, layout, mptable, msr, regs};
use crate::devices::IrqFdLine;
use crate::devices::bus::{Bus, BusError};
use crate::devices::legacy::{
    AcpiSleep, BootTimer, ConsoleSink, DebugExit, DebugPort, I8042, Serial, SerialIrq, SerialUart,
    VmEnd,
};
use crate::devices::virtio::pmem::PMEM_ALIGN;
use crate::devices::virtio::{
    self, Balloon, BalloonHandle, Block, Console, DiskConfig, MmioTransport, Pmem, PmemRegion, Rng,
    VirtioDevice,
};
use crate::events::{Recorder, kind};
use crate::vstate::kvm::{self, KvmError};
use crate::vstate::memory::{self, MemoryError};
use crate::vstate::vcpu::{BootEntry, Vcpu, VcpuError};
use crate::vstate::vm::{Vm, VmError};
use linux_loader::loader::bootparam::setup_header;
use linux_loader::loader::elf::{self, Elf, PvhBootCapability};
use linux_loader::loader::{self, KernelLoader, bzimage::BzImage};
use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use thiserror::Error;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_NOTIFY;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

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
    /// A virtio transport could not be set up.
    #[error("cannot set up virtio device {name}")]
    Virtio {
        /// Which device.
        name: String,
        /// Why.
        #[source]
        source: virtio::mmio::Error,
    },
    /// A pmem backing file could not be mapped.
    #[error("cannot map pmem file {0}: {1}")]
    Pmem(PathBuf, String),
    /// A disk could not be opened or is unusable.
    #[error("cannot attach disk {0}")]
    Disk(PathBuf, #[source] virtio::block::Error),
    /// More virtio devices than MMIO windows.
    #[error(
        "at most {} virtio devices are supported",
        layout::VIRTIO_MMIO_MAX_DEVICES
    )]
    TooManyDevices,
    /// The appliance channel socket could not be reached.
    #[error("cannot connect the channel to {0}")]
    Channel(PathBuf, #[source] std::io::Error),
    /// Device placement.
    #[error("cannot place a device")]
    Bus(#[from] BusError),
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
    /// virtio-blk disks.
    pub disks: Vec<DiskConfig>,
    /// A unix socket to connect a virtio-console port to.
    pub channel: Option<PathBuf>,
    /// Add a virtio-rng device.
    pub rng: bool,
    /// Files to expose as virtio-pmem regions (a DAX root).
    pub pmem: Vec<PathBuf>,
    /// Add a virtio-balloon device (statistics, free page reporting).
    pub balloon: bool,
}

/// What a parked vCPU thread receives when the VM is complete.
struct Start {
    mem: GuestMemoryMmap,
    io: Bus,
    mmio: Bus,
    entry: BootEntry,
}

/// A built VM whose vCPUs are running.
pub struct Vmm {
    /// Guest memory (kept alive for KVM and devices).
    pub mem: GuestMemoryMmap,
    /// The ending, reported by devices and vCPU threads.
    pub end: Arc<VmEnd>,
    /// COM1, for console input.
    pub serial: Arc<Mutex<Serial>>,
    /// The VM; dropping it tears the VM down.
    pub vm: Arc<Vm>,
    /// vCPU threads (never joined on the fast exit path; see `run`).
    pub vcpu_threads: Vec<JoinHandle<()>>,
    /// virtio-pmem file mappings, alive as long as the VM.
    pub pmem: Vec<PmemRegion>,
    /// Control of the balloon, when there is one.
    pub balloon: Option<BalloonHandle>,
}

/// Builds the VM described by `cfg` and starts its vCPUs. Steps are numbered
/// as in the module docs.
pub fn build(cfg: VmConfig, recorder: Arc<Recorder>) -> Result<Vmm, BuildError> {
    if cfg.vcpus == 0 {
        return Err(BuildError::NoVcpus);
    }
    memory::check_size(cfg.mem_size)?;

    // 1. KVM.
    let kvm = Arc::new(kvm::open()?);
    let max = u32::try_from(kvm.get_max_vcpus())
        .unwrap_or(u32::MAX)
        .min(mptable::max_cpus());
    if cfg.vcpus > max {
        return Err(BuildError::TooManyVcpus {
            asked: cfg.vcpus,
            max,
        });
    }

    // 2. vCPU threads, started before the VM exists: asking KVM for its CPUID
    // (once per process; a few hundred microseconds where CPUID traps) runs
    // while this thread creates the VM and its memory. Each thread then waits
    // for the irqchip, creates and configures its vCPU in parallel with steps
    // 4-7, and waits for the go.
    let end = Arc::new(VmEnd::new()?);
    let mut readies = Vec::new();
    let mut starts = Vec::new();
    let mut vcpu_threads = Vec::new();
    let configured = Arc::new(AtomicU32::new(0));
    for id in 0..cfg.vcpus {
        let (ready_tx, ready_rx) = mpsc::channel::<Arc<Vm>>();
        let (tx, rx) = mpsc::channel::<Arc<Start>>();
        readies.push(ready_tx);
        starts.push(tx);
        let (kvm, end, recorder, configured) = (
            kvm.clone(),
            end.clone(),
            recorder.clone(),
            configured.clone(),
        );
        let vcpus = cfg.vcpus;
        let thread = std::thread::Builder::new()
            .name(format!("ember-vcpu{id}"))
            .spawn(move || {
                let result = (|| -> Result<(), BuildError> {
                    let supported = kvm::supported_cpuid(&kvm)?;
                    // A closed channel means the build failed: just leave.
                    let Ok(vm) = ready_rx.recv() else {
                        return Ok(());
                    };
                    let mut vcpu = Vcpu::new(vm.fd(), id)?;
                    // The TSC rate goes into the KVM timing leaf so guests need not calibrate.
                    let cpuid = cpuid::configure_cpuid(supported, id, vcpus, vcpu.tsc_khz())?;
                    vcpu.configure(&cpuid, &msr::boot_msrs())?;
                    if configured.fetch_add(1, Ordering::SeqCst) + 1 == vcpus {
                        recorder.mark(kind::VCPUS_CREATED);
                    }
                    let Ok(start) = rx.recv() else { return Ok(()) };
                    if id == 0 {
                        vcpu.set_boot_state(start.entry)?;
                        recorder.mark(kind::FIRST_GUEST_ENTRY);
                    }
                    Ok(vcpu.run(&start.io, &start.mmio, &end, &vm, &start.mem)?)
                })();
                if let Err(e) = result {
                    end.fail(error_chain(&e));
                }
            })?;
        vcpu_threads.push(thread);
    }

    // 3. Guest memory: mapped here, and given to KVM (~0.3 ms per 512 MiB on
    // this host) on a thread of its own while this one loads the kernel into
    // it. Registered before the irqchip exists (see `Vm::new`); then the vCPU
    // threads may create their vCPUs, while the PIT (a kernel thread of its
    // own) is made.
    let vm = Arc::new(Vm::new(&kvm)?);
    recorder.mark(kind::KVM_OPEN);
    let mem = memory::create(cfg.mem_size)?;
    let ram = layout::ram_ranges(cfg.mem_size);
    // pmem files are mapped into guest-physical space above RAM, each at a 2 MiB
    // boundary (what the guest's nd_pmem driver needs for DAX), and given to
    // KVM with the RAM, before the irqchip.
    let mut pmem_regions = Vec::new();
    // (guest address, length, host address) of each.
    let mut pmem_slots = Vec::new();
    let mut pmem_next = layout::PMEM_START_MIN
        .max(ram.last().map_or(0, |r| r.0 + r.1))
        .next_multiple_of(PMEM_ALIGN);
    for path in &cfg.pmem {
        let region =
            PmemRegion::map(path).map_err(|e| BuildError::Pmem(path.clone(), error_chain(&e)))?;
        pmem_slots.push((pmem_next, region.len(), region.host_addr()));
        pmem_next = (pmem_next + region.len()).next_multiple_of(PMEM_ALIGN);
        pmem_regions.push(region);
    }
    let kvm_side = {
        let (vm, mem, recorder) = (vm.clone(), mem.clone(), recorder.clone());
        let pmem_slots = pmem_slots.clone();
        std::thread::Builder::new()
            .name("ember-memory".into())
            .spawn(move || -> Result<(), BuildError> {
                vm.register_memory(&mem)?;
                for (addr, len, host) in pmem_slots {
                    // The mappings live in `Vmm::pmem` as long as the VM.
                    vm.add_region(addr, len, host)?;
                }
                vm.create_irqchip()?;
                recorder.mark(kind::MEMORY_READY);
                for ready in readies {
                    // A vCPU thread that already failed has hung up; its
                    // error is in `end`.
                    let _ = ready.send(vm.clone());
                }
                vm.create_pit()?;
                Ok(())
            })?
    };

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
    kvm_side
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;

    // 5. virtio devices: windows, interrupts and queue notifiers (kernel-side
    // eventfds, so a notify never stops a vCPU); described to the guest below.
    let mut mmio = Bus::new();
    let mut announced = Vec::new();
    let mut place = |name: &str, make: MmioTransportFactory| -> Result<(), BuildError> {
        let i = announced.len();
        if i >= layout::VIRTIO_MMIO_MAX_DEVICES {
            return Err(BuildError::TooManyDevices);
        }
        let base = layout::VIRTIO_MMIO_START + i as u64 * layout::VIRTIO_MMIO_SIZE;
        let gsi = layout::VIRTIO_IRQ_BASE + i as u32;
        let irq = EventFd::new(libc::EFD_NONBLOCK)?;
        vm.register_irqfd(&irq, gsi)?;
        let transport =
            make(mem.clone(), Arc::new(IrqFdLine(irq))).map_err(|source| BuildError::Virtio {
                name: name.to_owned(),
                source,
            })?;
        for (q, evt) in transport.queue_evts().iter().enumerate() {
            vm.register_mmio_ioevent(evt, base + u64::from(VIRTIO_MMIO_QUEUE_NOTIFY), q as u32)?;
        }
        mmio.insert(
            Arc::new(Mutex::new(transport)),
            base,
            layout::VIRTIO_MMIO_SIZE,
        )?;
        announced.push(acpi::VirtioMmioAcpi {
            base,
            len: layout::VIRTIO_MMIO_SIZE,
            gsi,
        });
        Ok(())
    };
    for disk in &cfg.disks {
        let block = Block::new(disk).map_err(|e| BuildError::Disk(disk.path.clone(), e))?;
        place("block", transport_for(block))?;
    }
    if let Some(sock) = &cfg.channel {
        let stream = UnixStream::connect(sock).map_err(|e| BuildError::Channel(sock.clone(), e))?;
        let console =
            Console::from_unix_stream(stream).map_err(|e| BuildError::Channel(sock.clone(), e))?;
        place("console", transport_for(console))?;
    }
    if cfg.rng {
        place("rng", transport_for(Rng::new()))?;
    }
    for ((path, region), &(addr, ..)) in cfg.pmem.iter().zip(&pmem_regions).zip(&pmem_slots) {
        let dev =
            Pmem::new(region, addr).map_err(|e| BuildError::Pmem(path.clone(), e.to_string()))?;
        place("pmem", transport_for(dev))?;
    }
    let balloon = if cfg.balloon {
        let dev = Balloon::new(0)?;
        let handle = dev.handle();
        place("balloon", transport_for(dev))?;
        Some(handle)
    } else {
        None
    };

    // 6. Boot structures.
    let cmdline_max = match hdr {
        Some(h) if h.version >= MIN_BOOT_PROTOCOL => {
            (h.cmdline_size as usize).min(layout::CMDLINE_MAX_SIZE)
        }
        Some(_) => DEFAULT_CMDLINE_SIZE,
        // An ELF kernel has no setup header: Linux's own limit applies.
        None => boot::LINUX_CMDLINE_MAX,
    };
    // Devices are announced both ways: on the command line for kernels with
    // VIRTIO_MMIO_CMDLINE_DEVICES, in the DSDT for kernels that only read ACPI.
    let mut cmdline = cfg.cmdline.trim().to_owned();
    for d in &announced {
        cmdline.push(' ');
        cmdline.push_str(&virtio::mmio::cmdline_device(d.base, d.len, d.gsi));
    }
    boot::write_cmdline(&mem, &cmdline, cmdline_max)?;
    regs::write_gdt_and_idt(&mem)?;
    regs::write_identity_page_tables(&mem)?;
    mptable::setup_mptable(&mem, cfg.vcpus)?;
    let rsdp = if cfg.acpi {
        Some(acpi::setup_acpi(&mem, cfg.vcpus, &announced)?)
    } else {
        None
    };
    let boot_layout = boot::BootLayout {
        ram: &ram,
        cmdline: &cmdline,
        initrd,
        rsdp,
    };
    match entry {
        BootEntry::Pvh(_) => boot::configure_pvh(&mem, &boot_layout)?,
        BootEntry::Linux64(_) => boot::configure_linux(&mem, &boot_layout, hdr)?,
    }

    // 7. Legacy devices.
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK)?;
    vm.register_irqfd(&serial_irq, layout::COM1_IRQ)?;
    let sink = ConsoleSink::new(cfg.console, recorder.clone());
    let serial = Arc::new(Mutex::new(Serial(SerialUart::new(
        SerialIrq(serial_irq),
        sink,
    ))));
    let mut io = Bus::new();
    io.insert(
        serial.clone(),
        layout::COM1_PORT.into(),
        layout::COM1_PORT_LEN.into(),
    )?;
    let i8042_len = u64::from(layout::I8042_COMMAND_PORT - layout::I8042_DATA_PORT) + 1;
    io.insert(
        Arc::new(Mutex::new(I8042::new(end.clone()))),
        layout::I8042_DATA_PORT.into(),
        i8042_len,
    )?;
    io.insert(
        Arc::new(Mutex::new(DebugPort::new(recorder.clone()))),
        layout::DEBUG_PORT.into(),
        1,
    )?;
    io.insert(
        Arc::new(Mutex::new(DebugExit::new(end.clone()))),
        layout::DEBUG_EXIT_PORT.into(),
        1,
    )?;
    io.insert(
        Arc::new(Mutex::new(AcpiSleep::new(end.clone()))),
        layout::ACPI_SLEEP_CONTROL_PORT.into(),
        2,
    )?;
    let timer = Arc::new(Mutex::new(BootTimer::new(recorder.clone())));
    mmio.insert(
        timer,
        layout::BOOT_TIMER_MMIO_START,
        layout::BOOT_TIMER_MMIO_SIZE,
    )?;

    // 8. Go: every vCPU gets the finished buses; the boot vCPU also its entry.
    let start = Arc::new(Start {
        mem: mem.clone(),
        io,
        mmio,
        entry,
    });
    for tx in starts {
        // A vCPU thread that already failed has hung up; its error is in `end`.
        let _ = tx.send(start.clone());
    }
    Ok(Vmm {
        mem,
        end,
        serial,
        vm,
        vcpu_threads,
        pmem: pmem_regions,
        balloon,
    })
}

/// Makes the MMIO transport for a device once guest memory and its interrupt line exist.
type MmioTransportFactory = Box<
    dyn FnOnce(
        GuestMemoryMmap,
        Arc<dyn crate::devices::Interrupt>,
    ) -> Result<MmioTransport, virtio::mmio::Error>,
>;

fn transport_for<D: VirtioDevice + 'static>(dev: D) -> MmioTransportFactory {
    Box::new(move |mem, irq| MmioTransport::new(dev, mem, irq))
}

/// Loads the kernel from `path`: an ELF (entered through its PVH note when it
/// has one, else at its 64-bit entry) or a bzImage (64-bit entry).
fn load_kernel(
    mem: &GuestMemoryMmap,
    path: &Path,
) -> Result<(BootEntry, Option<setup_header>, u64), BuildError> {
    let mut file = File::open(path).map_err(|e| BuildError::KernelOpen(path.to_owned(), e))?;
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
    let mut file = File::open(path).map_err(io_err)?;
    let size = file.metadata().map_err(io_err)?.len();
    let addr = boot::initrd_address(ram, size, addr_max, kernel_end)?;
    let len = usize::try_from(size).map_err(|_| io_err(std::io::ErrorKind::FileTooLarge.into()))?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, len)
        .map_err(|e| io_err(std::io::Error::other(e.to_string())))?;
    Ok((addr, size))
}

/// Formats an error and its sources on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}
