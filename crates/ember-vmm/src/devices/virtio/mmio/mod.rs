//! The virtio-mmio transport, modern (version 2) register layout (virtio 1.x §4.2.2).
//!
//! One 4 KiB window per device: 32-bit registers below `0x100`, the device's configuration
//! space from `0x100`. The transport owns the driver-visible state — status, feature
//! windows, queue registers — and hands the device its queues when the driver sets
//! `DRIVER_OK`.

use std::sync::Arc;

use thiserror::Error;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::{
    ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VirtioDevice,
    VirtioInterrupt,
};
use crate::devices::Interrupt;
use crate::vstate::bus::BusDevice;

mod state;
#[cfg(test)]
pub(crate) use state::QueueRegs;
pub(crate) use state::TransportState;

/// "virt" in little-endian: the value of the `MagicValue` register.
pub(crate) const MMIO_MAGIC: u32 = 0x7472_6976;
/// The modern register layout.
pub(crate) const MMIO_VERSION: u32 = 2;
/// Our `VendorID`: "EMBR" read as a little-endian word.
pub(crate) const MMIO_VENDOR_ID: u32 = u32::from_le_bytes(*b"EMBR");
/// `SHMLen` of a shared-memory region that does not exist (all ones, §4.2.2).
const SHM_ABSENT: u32 = u32::MAX;
/// Registers are 32 bits wide and must be accessed as such.
const REGISTER_WIDTH: usize = 4;

/// Transport construction errors.
#[derive(Debug, Error)]
pub enum Error {
    /// A device asked for a queue size virtio-queue cannot represent.
    #[error("device queue {index} has an invalid maximum size {size}")]
    QueueMaxSize {
        /// The queue.
        index: usize,
        /// Its maximum size.
        size: u16,
    },
    /// The device has no queues or more than a `u32` can count.
    #[error("a device needs between one and 1024 queues")]
    QueueCount,
    /// Creating a notify eventfd failed.
    #[error("failed to create a queue notify eventfd")]
    EventFd(#[source] std::io::Error),
}

/// Most queues a device may have (far more than any device here uses).
const MAX_QUEUES: usize = 1024;

/// The kernel command-line parameter that tells Linux about a virtio-mmio device when
/// there is no ACPI/device-tree description: `virtio_mmio.device=<size>@<base>:<gsi>`.
/// E.g. `virtio_mmio.device=4K@0xd0000000:5`.
pub(crate) fn cmdline_device(base: u64, size: u64, gsi: u32) -> String {
    format!("virtio_mmio.device={}K@{base:#x}:{gsi}", size >> 10)
}

/// A virtio device behind a virtio-mmio register window.
///
/// # Example
///
/// A driver's view, as the guest kernel probes a device:
///
/// ```
/// use std::sync::Arc;
/// use ember_vmm::devices::CountingInterrupt;
/// use ember_vmm::vstate::bus::BusDevice;
/// use ember_vmm::devices::virtio::{MmioTransport, Rng};
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
/// let irq = Arc::new(CountingInterrupt::default());
/// let mut dev = MmioTransport::new(Rng::new(), mem, irq).unwrap();
///
/// let mut word = [0u8; 4];
/// dev.read(0x000, &mut word); // MagicValue
/// assert_eq!(u32::from_le_bytes(word), 0x7472_6976);
/// dev.read(0x008, &mut word); // DeviceID
/// assert_eq!(u32::from_le_bytes(word), 4); // entropy source
/// // The VMM registers each of these as an ioeventfd on base + 0x50, datamatch = index.
/// assert_eq!(dev.queue_evts().len(), 1);
/// ```
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    interrupt: VirtioInterrupt,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    active: bool,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device.device_type())
            .field("status", &self.status)
            .field("active", &self.active)
            .finish()
    }
}

impl MmioTransport {
    /// Wraps `device`. `irq` is the device's interrupt line (an irqfd in the VMM).
    pub fn new(
        device: impl VirtioDevice + 'static,
        mem: GuestMemory,
        irq: Arc<dyn Interrupt>,
    ) -> Result<Self, Error> {
        let sizes = device.queue_max_sizes();
        if sizes.is_empty() || sizes.len() > MAX_QUEUES {
            return Err(Error::QueueCount);
        }
        let queues = sizes
            .iter()
            .enumerate()
            .map(|(index, &size)| Queue::new(size).map_err(|_| Error::QueueMaxSize { index, size }))
            .collect::<Result<Vec<_>, _>>()?;
        let queue_evts = (0..queues.len())
            .map(|_| EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            device: Box::new(device),
            mem,
            interrupt: VirtioInterrupt::new(irq),
            queues,
            queue_evts,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            active: false,
        })
    }

    /// One notify eventfd per queue, in queue order. Register queue `i`'s as a KVM
    /// ioeventfd on `base + 0x50` with datamatch `i`; the transport also signals it when a
    /// `QueueNotify` write does reach it.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device status register as the driver reads it.
    pub(crate) fn status(&self) -> u32 {
        if self.interrupt.needs_reset() {
            self.status | VIRTIO_CONFIG_S_NEEDS_RESET
        } else {
            self.status
        }
    }

    /// Whether the device is serving its queues (`DRIVER_OK` accepted).
    pub fn is_active(&self) -> bool {
        self.active
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    fn read_register(&self, offset: u32) -> u32 {
        match offset {
            VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => MMIO_VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.avail_features() as u32,
                1 => (self.device.avail_features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size().into()),
            VIRTIO_MMIO_QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready().into()),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            VIRTIO_MMIO_STATUS => self.status(),
            // No shared-memory regions: every SHMSel reads as absent.
            VIRTIO_MMIO_SHM_LEN_LOW | VIRTIO_MMIO_SHM_LEN_HIGH => SHM_ABSENT,
            VIRTIO_MMIO_SHM_BASE_LOW | VIRTIO_MMIO_SHM_BASE_HIGH => SHM_ABSENT,
            VIRTIO_MMIO_CONFIG_GENERATION => self.device.config_generation(),
            _ => {
                crate::guest_warn!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }

    fn write_register(&mut self, offset: u32, value: u32) {
        match offset {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(value),
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = value,
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(value),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(value),
            VIRTIO_MMIO_STATUS => self.write_status(value),
            VIRTIO_MMIO_SHM_SEL => {}
            VIRTIO_MMIO_QUEUE_NUM
            | VIRTIO_MMIO_QUEUE_READY
            | VIRTIO_MMIO_QUEUE_DESC_LOW
            | VIRTIO_MMIO_QUEUE_DESC_HIGH
            | VIRTIO_MMIO_QUEUE_AVAIL_LOW
            | VIRTIO_MMIO_QUEUE_AVAIL_HIGH
            | VIRTIO_MMIO_QUEUE_USED_LOW
            | VIRTIO_MMIO_QUEUE_USED_HIGH => self.write_queue_register(offset, value),
            _ => crate::guest_warn!(
                "virtio-mmio: write of {value:#x} to unknown register {offset:#x}"
            ),
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        // Features may only change between DRIVER and FEATURES_OK (§3.1.1).
        if self.status & (VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK)
            != VIRTIO_CONFIG_S_DRIVER
        {
            crate::guest_warn!(
                "virtio-mmio: driver features written in status {:#x}",
                self.status
            );
            return;
        }
        let value = u64::from(value);
        match self.driver_features_sel {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | value,
            1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (value << 32),
            sel => crate::guest_warn!("virtio-mmio: driver features written to window {sel}"),
        }
    }

    fn write_queue_register(&mut self, offset: u32, value: u32) {
        // Queues are configured after FEATURES_OK and before DRIVER_OK (§3.1.1).
        if self.status & (VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK)
            != VIRTIO_CONFIG_S_FEATURES_OK
        {
            crate::guest_warn!(
                "virtio-mmio: queue register {offset:#x} written in status {:#x}",
                self.status
            );
            return;
        }
        let sel = self.queue_sel;
        let Some(q) = self.queues.get_mut(sel as usize) else {
            crate::guest_warn!("virtio-mmio: register {offset:#x} written for missing queue {sel}");
            return;
        };
        match offset {
            VIRTIO_MMIO_QUEUE_NUM if q.try_set_size(value.try_into().unwrap_or(0)).is_err() => {
                crate::guest_warn!(
                    "virtio-mmio: queue {sel}: size {value} is not a power of two up to {}",
                    q.max_size()
                );
            }
            VIRTIO_MMIO_QUEUE_NUM => {}
            VIRTIO_MMIO_QUEUE_READY => q.set_ready(value == 1),
            VIRTIO_MMIO_QUEUE_DESC_LOW => q.set_desc_table_address(Some(value), None),
            VIRTIO_MMIO_QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(value)),
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => q.set_avail_ring_address(Some(value), None),
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => q.set_avail_ring_address(None, Some(value)),
            VIRTIO_MMIO_QUEUE_USED_LOW => q.set_used_ring_address(Some(value), None),
            VIRTIO_MMIO_QUEUE_USED_HIGH => q.set_used_ring_address(None, Some(value)),
            _ => {}
        }
    }

    fn notify(&self, index: u32) {
        match self.queue_evts.get(index as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    crate::guest_warn!("virtio-mmio: failed to signal queue {index}: {e}");
                }
            }
            None => crate::guest_warn!("virtio-mmio: notify for missing queue {index}"),
        }
    }

    /// The device status state machine (§2.1, §3.1.1): the driver adds one bit at a time,
    /// in order; writing 0 resets; FAILED may be set at any time.
    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // NEEDS_RESET is the device's bit: a driver echoing it back changes nothing.
        let value = value & !VIRTIO_CONFIG_S_NEEDS_RESET;
        if value & self.status != self.status {
            crate::guest_warn!(
                "virtio-mmio: driver cleared status bits ({:#x} -> {value:#x})",
                self.status
            );
            return;
        }
        let added = value & !self.status;
        const ACK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
        const DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
        const FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
        match (self.status, added) {
            (_, 0) => {}
            (_, VIRTIO_CONFIG_S_FAILED) => {
                crate::guest_warn!("virtio-mmio: driver gave up on the device (FAILED)");
                self.status |= VIRTIO_CONFIG_S_FAILED;
            }
            (0, ACK) => self.status = ACK,
            (s, DRIVER) if s == ACK => self.status |= DRIVER,
            (s, FEATURES_OK) if s == ACK | DRIVER => {
                if self.features_acceptable() {
                    self.device.ack_features(self.driver_features);
                    self.status |= FEATURES_OK;
                }
            }
            (s, VIRTIO_CONFIG_S_DRIVER_OK) if s == ACK | DRIVER | FEATURES_OK => self.activate(),
            _ => crate::guest_warn!(
                "virtio-mmio: invalid status transition {:#x} -> {value:#x}",
                self.status
            ),
        }
    }

    /// The driver must not accept features the device did not offer, and must accept
    /// `VIRTIO_F_VERSION_1` on this (modern-only) transport.
    fn features_acceptable(&self) -> bool {
        let unknown = self.driver_features & !self.device.avail_features();
        if unknown != 0 {
            crate::guest_warn!("virtio-mmio: driver accepted unoffered features {unknown:#x}");
            return false;
        }
        if self.driver_features & VIRTIO_F_VERSION_1 == 0 {
            crate::guest_warn!("virtio-mmio: driver did not accept VIRTIO_F_VERSION_1");
            return false;
        }
        true
    }

    fn activate(&mut self) {
        let mut active = Vec::with_capacity(self.queues.len());
        for (i, (q, evt)) in self.queues.iter().zip(&self.queue_evts).enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                crate::guest_warn!("virtio-mmio: queue {i} lies outside guest memory");
                self.interrupt.set_needs_reset();
                return;
            }
            let mut queue = match Queue::try_from(q.state()) {
                Ok(queue) => queue,
                Err(e) => {
                    crate::guest_warn!("virtio-mmio: queue {i} is inconsistent: {e}");
                    self.interrupt.set_needs_reset();
                    return;
                }
            };
            let evt = match evt.try_clone() {
                Ok(evt) => evt,
                Err(e) => {
                    crate::guest_warn!("virtio-mmio: failed to clone queue {i}'s eventfd: {e}");
                    self.interrupt.set_needs_reset();
                    return;
                }
            };
            queue.set_event_idx(self.driver_features & VIRTIO_RING_F_EVENT_IDX != 0);
            active.push(ActiveQueue { queue, evt });
        }
        // Only queues the driver enabled are handed over, in order; devices with optional
        // queues (the balloon's) count them from the features they acked.
        let ready = active.into_iter().take_while(|a| a.queue.ready()).collect();
        match self
            .device
            .activate(self.mem.clone(), self.interrupt.clone(), ready)
        {
            Ok(()) => {
                self.status |= VIRTIO_CONFIG_S_DRIVER_OK;
                self.active = true;
            }
            Err(e) => {
                crate::guest_warn!("virtio-mmio: device activation failed: {e}");
                self.status |= VIRTIO_CONFIG_S_DRIVER_OK;
                self.interrupt.set_needs_reset();
            }
        }
    }

    /// Device reset (the driver wrote 0 to `Status`): stops the device — it finishes what
    /// is in flight first — and forgets everything the driver set.
    fn reset(&mut self) {
        if self.active {
            self.device.reset();
            self.active = false;
        }
        for q in &mut self.queues {
            q.reset();
        }
        for evt in &self.queue_evts {
            // Discard stale notifications; an empty counter reads as EAGAIN.
            let _ = evt.read();
        }
        self.interrupt.clear();
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device
                .read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        if data.len() != REGISTER_WIDTH || offset % REGISTER_WIDTH as u64 != 0 {
            crate::guest_warn!(
                "virtio-mmio: {}-byte read at {offset:#x} is not an aligned 32-bit access",
                data.len()
            );
            data.fill(0);
            return;
        }
        let value = self.read_register(offset as u32);
        data.copy_from_slice(&value.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device
                .write_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        let Ok(bytes) = <[u8; REGISTER_WIDTH]>::try_from(data) else {
            crate::guest_warn!(
                "virtio-mmio: {}-byte write at {offset:#x} ignored",
                data.len()
            );
            return;
        };
        if offset % REGISTER_WIDTH as u64 != 0 {
            crate::guest_warn!("virtio-mmio: unaligned write at {offset:#x} ignored");
            return;
        }
        self.write_register(offset as u32, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::ActivateError;
    use std::sync::Mutex;
    use vm_memory::GuestAddress;

    /// A device wired as `device_manager` wires it: a transport on the MMIO bus
    /// at its window, announced on the command line, its interrupt an irqfd.
    #[test]
    fn a_device_on_the_bus_answers_the_guest_and_is_announced() {
        use crate::arch::x86_64::layout::{VIRTIO_IRQ_BASE, VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START};
        use crate::devices::IrqFdLine;
        use crate::devices::virtio::Rng;
        use crate::vstate::bus::Bus;
        use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

        let mem =
            vm_memory::GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        let mut bus = Bus::new();
        let line = Arc::new(IrqFdLine(EventFd::new(EFD_NONBLOCK).unwrap()));
        let transport = MmioTransport::new(Rng::new(), mem, line).unwrap();
        assert_eq!(transport.queue_evts().len(), 1);
        bus.insert(
            Arc::new(Mutex::new(transport)),
            VIRTIO_MMIO_START,
            VIRTIO_MMIO_SIZE,
        )
        .unwrap();
        assert_eq!(
            cmdline_device(VIRTIO_MMIO_START, VIRTIO_MMIO_SIZE, VIRTIO_IRQ_BASE),
            "virtio_mmio.device=4K@0xd0000000:5"
        );
        // A guest read of MagicValue through the bus.
        let mut magic = [0u8; 4];
        assert!(bus.read(VIRTIO_MMIO_START, &mut magic));
        assert_eq!(&magic, b"virt");
    }

    /// A device that records what the transport tells it.
    #[derive(Default)]
    struct Probe {
        log: Arc<Mutex<Vec<String>>>,
        /// Signals a used buffer from `activate`, as a device thread that
        /// finds work at once does (the restored appliance's console).
        signal_on_activate: bool,
        /// Offered beside VERSION_1 and 0b101.
        extra_features: u64,
    }

    impl VirtioDevice for Probe {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 8]
        }
        fn avail_features(&self) -> u64 {
            VIRTIO_F_VERSION_1 | 0b101 | self.extra_features
        }
        fn ack_features(&mut self, features: u64) {
            self.log.lock().unwrap().push(format!("ack {features:#x}"));
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            super::super::read_config_bytes(&[1, 2, 3, 4, 5, 6, 7, 8], offset, data);
        }
        fn activate(
            &mut self,
            _mem: GuestMemory,
            irq: VirtioInterrupt,
            queues: Vec<ActiveQueue>,
        ) -> Result<(), ActivateError> {
            let event_idx =
                !queues.is_empty() && queues.iter().all(|q| q.queue.event_idx_enabled());
            self.log.lock().unwrap().push(format!(
                "activate {}{}",
                queues.len(),
                if event_idx { " event_idx" } else { "" }
            ));
            if self.signal_on_activate {
                irq.signal_used_queue();
            }
            Ok(())
        }
        fn reset(&mut self) {
            self.log.lock().unwrap().push("reset".into());
        }
    }

    fn transport() -> (MmioTransport, Arc<Mutex<Vec<String>>>) {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let probe = Probe::default();
        let log = probe.log.clone();
        let t = MmioTransport::new(probe, mem, Arc::new(CountingInterrupt::default())).unwrap();
        (t, log)
    }

    fn rd(t: &mut MmioTransport, off: u32) -> u32 {
        let mut d = [0u8; 4];
        t.read(off.into(), &mut d);
        u32::from_le_bytes(d)
    }

    fn wr(t: &mut MmioTransport, off: u32, v: u32) {
        t.write(off.into(), &v.to_le_bytes());
    }

    fn negotiate(t: &mut MmioTransport) {
        wr(t, VIRTIO_MMIO_STATUS, 1);
        wr(t, VIRTIO_MMIO_STATUS, 3);
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
        wr(t, VIRTIO_MMIO_STATUS, 3 | 8);
    }

    fn setup_queue(t: &mut MmioTransport, sel: u32, base: u32) {
        wr(t, VIRTIO_MMIO_QUEUE_SEL, sel);
        wr(t, VIRTIO_MMIO_QUEUE_NUM, 8);
        wr(t, VIRTIO_MMIO_QUEUE_DESC_LOW, base);
        wr(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, base + 0x1000);
        wr(t, VIRTIO_MMIO_QUEUE_USED_LOW, base + 0x2000);
        wr(t, VIRTIO_MMIO_QUEUE_READY, 1);
    }

    /// A restored device whose thread signals a used buffer before the
    /// restore has finished (the appliance's console, whose channel holds
    /// the job when it starts) keeps that cause pending: the recorded causes
    /// must not overwrite it, or the guest reads an empty InterruptStatus,
    /// ignores the interrupt and never sees its buffer (the restored
    /// appliance hung).
    #[test]
    fn a_cause_signalled_while_restoring_stays_pending() {
        let (mut t, _) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 0x1_0000);
        setup_queue(&mut t, 1, 0x2_0000);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0xf);
        assert!(t.is_active());
        // Nothing pending when the snapshot is taken.
        assert_eq!(rd(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        let saved = t.state();

        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let line = Arc::new(CountingInterrupt::default());
        let probe = Probe {
            signal_on_activate: true,
            ..Probe::default()
        };
        let mut restored = MmioTransport::new(probe, mem, line.clone()).unwrap();
        restored.restore(&saved).unwrap();
        assert!(restored.is_active());
        assert_eq!(line.count(), 1, "the device raised its line");
        assert_eq!(
            rd(&mut restored, VIRTIO_MMIO_INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_VRING,
            "the cause behind that interrupt must still be there for the guest to read"
        );

        // Causes recorded in the snapshot come back too.
        let mut pending = saved.clone();
        pending.interrupt_status = VIRTIO_MMIO_INT_CONFIG;
        let (mut again, _) = transport();
        again.restore(&pending).unwrap();
        assert_eq!(
            rd(&mut again, VIRTIO_MMIO_INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_CONFIG
        );
    }

    #[test]
    fn identifies_itself() {
        let (mut t, _) = transport();
        assert_eq!(rd(&mut t, VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_VERSION), 2);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_ID), 42);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 0b101);
        wr(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1);
        wr(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 2);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 0);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_SHM_LEN_LOW), SHM_ABSENT);
        let mut b = [0u8; 2];
        t.read(0x102, &mut b);
        assert_eq!(b, [3, 4], "config space allows narrow accesses");
    }

    #[test]
    fn full_negotiation_activates_with_ready_queues() {
        let (mut t, log) = transport();
        negotiate(&mut t);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0xb);
        setup_queue(&mut t, 0, 0x1_0000);
        setup_queue(&mut t, 1, 0x2_0000);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0xf);
        assert!(t.is_active());
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0xf);
        assert_eq!(*log.lock().unwrap(), ["ack 0x100000000", "activate 2"]);
        // After DRIVER_OK the queues are frozen.
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 0);
        wr(&mut t, VIRTIO_MMIO_QUEUE_READY, 0);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_READY), 1);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_READY), 0);
        assert!(!t.is_active());
        assert_eq!(log.lock().unwrap().last().unwrap(), "reset");
    }

    /// A driver that accepts `VIRTIO_RING_F_EVENT_IDX` gets queues that use it,
    /// and so does the same device restored from a snapshot.
    #[test]
    fn accepted_event_idx_is_on_in_the_active_queues_and_after_a_restore() {
        let probe = || Probe {
            extra_features: VIRTIO_RING_F_EVENT_IDX,
            ..Probe::default()
        };
        let mem = || GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let line = Arc::new(CountingInterrupt::default());
        let p = probe();
        let log = p.log.clone();
        let mut t = MmioTransport::new(p, mem(), line.clone()).unwrap();
        wr(&mut t, VIRTIO_MMIO_STATUS, 1);
        wr(&mut t, VIRTIO_MMIO_STATUS, 3);
        wr(
            &mut t,
            VIRTIO_MMIO_DRIVER_FEATURES,
            VIRTIO_RING_F_EVENT_IDX as u32,
        );
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
        wr(&mut t, VIRTIO_MMIO_STATUS, 3 | 8);
        setup_queue(&mut t, 0, 0x1_0000);
        setup_queue(&mut t, 1, 0x2_0000);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0xf);
        assert_eq!(log.lock().unwrap().last().unwrap(), "activate 2 event_idx");
        let saved = t.state();
        let p = probe();
        let log = p.log.clone();
        let mut restored = MmioTransport::new(p, mem(), line).unwrap();
        restored.restore(&saved).unwrap();
        assert_eq!(log.lock().unwrap().last().unwrap(), "activate 2 event_idx");
        // Without it accepted, the same device's queues do not use it.
        let (mut plain, log) = transport();
        negotiate(&mut plain);
        setup_queue(&mut plain, 0, 0x1_0000);
        setup_queue(&mut plain, 1, 0x2_0000);
        wr(&mut plain, VIRTIO_MMIO_STATUS, 0xf);
        assert_eq!(log.lock().unwrap().last().unwrap(), "activate 2");
    }

    #[test]
    fn rejects_out_of_order_status_and_bad_features() {
        let (mut t, log) = transport();
        wr(&mut t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_DRIVER_OK);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0);
        wr(&mut t, VIRTIO_MMIO_STATUS, 1);
        wr(&mut t, VIRTIO_MMIO_STATUS, 1 | 8);
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_STATUS),
            1,
            "FEATURES_OK before DRIVER"
        );
        wr(&mut t, VIRTIO_MMIO_STATUS, 3);
        // Without VERSION_1 FEATURES_OK does not stick.
        wr(&mut t, VIRTIO_MMIO_STATUS, 3 | 8);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 3);
        // Nor with a feature the device never offered.
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 0b10);
        wr(&mut t, VIRTIO_MMIO_STATUS, 3 | 8);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 3);
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 0b100);
        wr(&mut t, VIRTIO_MMIO_STATUS, 3 | 8);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0xb);
        // Clearing a bit is not allowed; FAILED always is.
        wr(&mut t, VIRTIO_MMIO_STATUS, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0xb);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0xb | VIRTIO_CONFIG_S_FAILED);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0x8b);
        assert_eq!(*log.lock().unwrap(), ["ack 0x100000004"]);
    }

    #[test]
    fn queue_size_must_be_power_of_two_within_max() {
        let (mut t, _) = transport();
        negotiate(&mut t);
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 8);
        for bad in [0, 3, 16, 0x1_0004] {
            wr(&mut t, VIRTIO_MMIO_QUEUE_NUM, bad);
            assert_eq!(t.queues[1].size(), 8, "size {bad} accepted");
        }
        wr(&mut t, VIRTIO_MMIO_QUEUE_NUM, 4);
        assert_eq!(t.queues[1].size(), 4);
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 7);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        wr(&mut t, VIRTIO_MMIO_QUEUE_NUM, 4); // missing queue: ignored
    }

    #[test]
    fn queue_outside_memory_marks_needs_reset() {
        let (mut t, log) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 0x8000_0000);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0xf);
        assert!(!t.is_active());
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET,
            VIRTIO_CONFIG_S_NEEDS_RESET
        );
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_CONFIG
        );
        wr(&mut t, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        assert!(
            !log.lock()
                .unwrap()
                .iter()
                .any(|l| l.starts_with("activate"))
        );
        wr(&mut t, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0);
    }

    #[test]
    fn notify_signals_the_queue_eventfd_and_odd_accesses_are_ignored() {
        let (mut t, _) = transport();
        wr(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 1);
        assert_eq!(t.queue_evts()[1].read().unwrap(), 1);
        assert!(
            t.queue_evts()[0].read().is_err(),
            "queue 0 was not notified"
        );
        wr(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 9); // no such queue
        t.write(0x70, &[1]); // byte write to Status
        t.write(0x72, &[1, 0, 0, 0]); // unaligned
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0);
        let mut d = [0xffu8; 2];
        t.read(0x0, &mut d);
        assert_eq!(d, [0, 0]);
        assert_eq!(rd(&mut t, 0x0c8), 0, "unknown register reads zero");
    }
}
