//! Where devices go and how the guest learns of them.
//!
//! The builder (and a snapshot's restore) decide *which* devices a VM has; the
//! device manager decides *where*: each `attach_*` function gives a device its
//! place (an MMIO window or ports, a GSI backed by an irqfd, one ioeventfd per
//! virtqueue), puts it on the right bus, and remembers it for the
//! announcements the boot structures carry (`virtio_mmio.device=` on the
//! command line, `LNRO0005` in the DSDT). Devices themselves hold no KVM: the
//! irqfds and ioeventfds are registered here, through [`Vm`].

use crate::arch::x86_64::acpi::VirtioMmioAcpi;
use crate::arch::x86_64::layout;
use crate::devices::legacy::{
    AcpiSleep, BootTimer, DebugExit, DebugPort, I8042, Serial, SerialIrq,
};
use crate::devices::virtio::{self, MmioTransport, VirtioDevice};
use crate::devices::{Interrupt, IrqFdLine};
use crate::events::Recorder;
use crate::vstate::bus::{Bus, BusError, SharedDevice};
use crate::vstate::end::VmEnd;
use crate::vstate::vm::{Vm, VmError};
use std::sync::{Arc, Mutex};
use thiserror::Error;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_NOTIFY;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// Device placement errors.
#[derive(Debug, Error)]
pub enum DeviceManagerError {
    /// A virtio transport could not be set up.
    #[error("cannot set up a virtio device")]
    Virtio(#[from] virtio::mmio::Error),
    /// More virtio devices than MMIO windows.
    #[error(
        "at most {} virtio devices are supported",
        layout::VIRTIO_MMIO_MAX_DEVICES
    )]
    TooManyDevices,
    /// Registering an irqfd or ioeventfd with KVM failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// Two devices on one address.
    #[error("cannot place a device")]
    Bus(#[from] BusError),
    /// An eventfd could not be made.
    #[error("cannot create an interrupt eventfd")]
    Io(#[from] std::io::Error),
    /// The thread that starts device I/O threads could not be started.
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

/// Makes a device's MMIO transport once guest memory and its interrupt line exist.
pub(crate) type TransportFactory = Box<
    dyn FnOnce(GuestMemoryMmap, Arc<dyn Interrupt>) -> Result<MmioTransport, virtio::mmio::Error>,
>;

/// The factory for `dev`'s transport.
pub(crate) fn transport_for<D: VirtioDevice + 'static>(dev: D) -> TransportFactory {
    Box::new(move |mem, irq| MmioTransport::new(dev, mem, irq))
}

/// The VM's buses and the devices announced to the guest.
pub(crate) struct DeviceManager {
    vm: Arc<Vm>,
    mem: GuestMemoryMmap,
    io: Bus,
    mmio: Bus,
    virtio: Vec<VirtioMmioAcpi>,
}

impl DeviceManager {
    /// Empty buses for `vm` (whose irqchip must exist: interrupt lines are
    /// registered with it) over guest memory `mem`.
    pub(crate) fn new(vm: Arc<Vm>, mem: GuestMemoryMmap) -> Self {
        DeviceManager {
            vm,
            mem,
            io: Bus::new(),
            mmio: Bus::new(),
            virtio: Vec::new(),
        }
    }

    /// Attaches a virtio device in the next MMIO window: its GSI becomes an
    /// irqfd and each queue's notify register an ioeventfd, so neither an
    /// interrupt nor a notify stops a vCPU. Returns its transport (a snapshot
    /// saves and restores it).
    pub(crate) fn attach_virtio(
        &mut self,
        make: TransportFactory,
    ) -> Result<Arc<Mutex<MmioTransport>>, DeviceManagerError> {
        let i = self.virtio.len();
        if i >= layout::VIRTIO_MMIO_MAX_DEVICES {
            return Err(DeviceManagerError::TooManyDevices);
        }
        // Its I/O thread will be started by the spawner (a driver activates
        // the device from a filtered vCPU thread).
        crate::seccomp::start_spawner()?;
        let base = layout::VIRTIO_MMIO_START + i as u64 * layout::VIRTIO_MMIO_SIZE;
        let gsi = layout::VIRTIO_IRQ_BASE + i as u32;
        let irq = self.irq_line(gsi)?;
        let transport = make(self.mem.clone(), Arc::new(IrqFdLine(irq)))?;
        for (q, evt) in transport.queue_evts().iter().enumerate() {
            self.vm.register_mmio_ioevent(
                evt,
                base + u64::from(VIRTIO_MMIO_QUEUE_NOTIFY),
                q as u32,
            )?;
        }
        let transport = Arc::new(Mutex::new(transport));
        self.mmio
            .insert(transport.clone(), base, layout::VIRTIO_MMIO_SIZE)?;
        self.virtio.push(VirtioMmioAcpi {
            base,
            len: layout::VIRTIO_MMIO_SIZE,
            gsi,
        });
        Ok(transport)
    }

    /// COM1's interrupt line: an irqfd on its ISA IRQ. The caller makes the
    /// UART with it (fresh, or from a snapshot) and attaches it with
    /// [`DeviceManager::attach_legacy`].
    pub(crate) fn com1_irq(&self) -> Result<SerialIrq, DeviceManagerError> {
        Ok(SerialIrq(self.irq_line(layout::COM1_IRQ)?))
    }

    /// Attaches the PC devices a direct-booted guest needs: COM1, the i8042
    /// reset line, the POST port's boot marks, isa-debug-exit, the ACPI sleep
    /// register and the boot-timer page.
    pub(crate) fn attach_legacy(
        &mut self,
        serial: Arc<Mutex<Serial>>,
        end: &Arc<VmEnd>,
        recorder: &Arc<Recorder>,
    ) -> Result<(), DeviceManagerError> {
        self.attach_port(serial, layout::COM1_PORT, layout::COM1_PORT_LEN.into())?;
        let i8042_len = u64::from(layout::I8042_COMMAND_PORT - layout::I8042_DATA_PORT) + 1;
        self.attach_port(
            Arc::new(Mutex::new(I8042::new(end.clone()))),
            layout::I8042_DATA_PORT,
            i8042_len,
        )?;
        self.attach_port(
            Arc::new(Mutex::new(DebugPort::new(recorder.clone()))),
            layout::DEBUG_PORT,
            1,
        )?;
        self.attach_port(
            Arc::new(Mutex::new(DebugExit::new(end.clone()))),
            layout::DEBUG_EXIT_PORT,
            1,
        )?;
        self.attach_port(
            Arc::new(Mutex::new(AcpiSleep::new(end.clone()))),
            layout::ACPI_SLEEP_CONTROL_PORT,
            2,
        )?;
        self.mmio.insert(
            Arc::new(Mutex::new(BootTimer::new(recorder.clone()))),
            layout::BOOT_TIMER_MMIO_START,
            layout::BOOT_TIMER_MMIO_SIZE,
        )?;
        Ok(())
    }

    /// `cmdline` with every virtio device announced on it
    /// (`virtio_mmio.device=4K@0xd0000000:5`), for kernels with
    /// `VIRTIO_MMIO_CMDLINE_DEVICES`.
    pub(crate) fn announce_on_cmdline(&self, cmdline: &str) -> String {
        let mut out = cmdline.trim().to_owned();
        for d in &self.virtio {
            out.push(' ');
            out.push_str(&virtio::mmio::cmdline_device(d.base, d.len, d.gsi));
        }
        out
    }

    /// The virtio devices as the DSDT describes them, for kernels that only read ACPI.
    pub(crate) fn acpi_devices(&self) -> &[VirtioMmioAcpi] {
        &self.virtio
    }

    /// The finished buses: port I/O, then MMIO.
    pub(crate) fn into_buses(self) -> (Bus, Bus) {
        (self.io, self.mmio)
    }

    /// The ACPI Generic Event Device's interrupt line (`layout::GED_GSI`).
    pub(crate) fn ged_irq(&self) -> Result<Arc<dyn Interrupt>, DeviceManagerError> {
        Ok(Arc::new(IrqFdLine(self.irq_line(layout::GED_GSI)?)))
    }

    /// An eventfd registered with KVM as the irqfd of `gsi`.
    fn irq_line(&self, gsi: u32) -> Result<EventFd, DeviceManagerError> {
        let irq = EventFd::new(libc::EFD_NONBLOCK)?;
        self.vm.register_irqfd(&irq, gsi)?;
        Ok(irq)
    }

    fn attach_port(
        &mut self,
        dev: SharedDevice,
        port: u16,
        len: u64,
    ) -> Result<(), DeviceManagerError> {
        Ok(self.io.insert(dev, port.into(), len)?)
    }
}
