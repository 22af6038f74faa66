//! Virtio devices over the MMIO transport.
//!
//! Every device here has the same shape:
//!
//! - a state struct implementing [`VirtioDevice`]: what it offers (type, queues, features,
//!   config space) and what it does when the driver sets `DRIVER_OK` (`activate`) or
//!   writes 0 to the status register (`reset`);
//! - a queue handler that turns descriptor chains into side effects; it is a plain struct
//!   that unit tests drive directly on a mock queue;
//! - a worker thread (`worker`) that owns an epoll over the queue eventfds and a kill
//!   eventfd and calls the handler. virtio-blk has its own loop (it also waits for io_uring
//!   completions), following Cloud Hypervisor's dedicated per-device I/O thread.
//!
//! Devices never see KVM. [`MmioTransport`] is the register file the guest pokes; the VMM
//! puts it on the MMIO bus, registers [`MmioTransport::queue_evts`] as ioeventfds and backs
//! its interrupt line with an irqfd.
//!
//! # Wiring devices into a VM
//!
//! `device_manager` puts each transport on the MMIO bus in its window
//! (`layout::VIRTIO_MMIO_START` + i × `VIRTIO_MMIO_SIZE`), registers its queue
//! eventfds as ioeventfds and its interrupt line as an irqfd, and announces it
//! to the guest (ACPI, or `mmio::cmdline_device` on the command line).
//!
//! Boxed devices work too (`Box<dyn VirtioDevice>` is a `VirtioDevice`). On VM exit drop
//! the transport: device threads finish what is in flight and are joined.

pub mod balloon;
pub mod block;
pub(crate) mod console;
pub mod fs;
pub mod mem;
pub(crate) mod mmio;
pub mod net;
pub(crate) mod pmem;
pub(crate) mod rng;
pub(crate) mod vsock;
mod worker;

#[cfg(test)]
pub(crate) mod test_utils;

pub use block::{Block, DiskConfig};
pub use console::{Console, ConsoleInput};
pub use fs::{Fs, FsConfig, FsHandle, FsState};

pub(crate) use balloon::BalloonState;
pub use balloon::{Balloon, BalloonConfig, BalloonError, BalloonHandle, target_pages};
pub(crate) use mem::MemState;
pub use mem::{MemConfig, MemError, MemHandle, VirtioMem};
pub use mmio::MmioTransport;
pub use net::{Net, NetConfig};
pub use pmem::PmemConfig;
pub(crate) use pmem::{Pmem, PmemRegion};

pub use rng::{Rng, RngConfig};
pub use vsock::{Error as VsockError, Vsock, VsockConfig};

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use thiserror::Error;
use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::Interrupt;

/// The guest memory type every device works on.
pub type GuestMemory = GuestMemoryMmap<()>;

/// `VIRTIO_F_VERSION_1`: the device is a modern (virtio 1.x) device. Every device offers it
/// and the transport refuses a driver that does not accept it.
pub(crate) const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
/// `VIRTIO_RING_F_INDIRECT_DESC`: the driver may use indirect descriptor tables.
/// `virtio-queue` walks them for us, so every device offers it.
pub(crate) const VIRTIO_RING_F_INDIRECT_DESC: u64 =
    1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
/// `VIRTIO_RING_F_EVENT_IDX`: each side says how far the other may go before it wants to
/// hear (the driver's `used_event`, the device's `avail_event`). The transport turns it
/// on in the queues when the driver accepts it; only devices whose handlers keep
/// `avail_event` current (`Queue::enable_notification` whenever they want a
/// notification) offer it, or the driver would stop notifying them.
pub(crate) const VIRTIO_RING_F_EVENT_IDX: u64 =
    1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

/// Errors a device reports when the driver sets `DRIVER_OK`.
#[derive(Debug, Error)]
pub enum ActivateError {
    /// The device needs this queue and the driver did not set it up.
    #[error("queue {0} is not ready")]
    QueueNotReady(usize),
    /// The driver set up fewer queues than the device needs.
    #[error("expected {expected} queues, got {got}")]
    QueueCount {
        /// How many the device needs.
        expected: usize,
        /// How many it got.
        got: usize,
    },
    /// Creating or cloning an eventfd failed.
    #[error("failed to set up a device eventfd")]
    EventFd(#[source] io::Error),
    /// The worker thread could not be started.
    #[error("failed to spawn the device thread")]
    Spawn(#[source] io::Error),
    /// A device-specific resource could not be prepared.
    #[error("failed to prepare the device backend")]
    Backend(#[source] io::Error),
}

/// What the transport hands a device for each queue on activation: the queue the driver
/// configured and a clone of the eventfd its notifications arrive on.
#[derive(Debug)]
pub struct ActiveQueue {
    /// The configured queue (ready, sized, addresses set).
    pub queue: Queue,
    /// Readable when the driver notified this queue.
    pub evt: EventFd,
}

/// The interrupt side of a virtio device: an interrupt-status word the transport shows in
/// its `InterruptStatus` register, and the line that tells the guest to look at it.
///
/// Cheap to clone; the device's worker thread keeps one.
#[derive(Clone)]
pub struct VirtioInterrupt {
    status: Arc<AtomicU32>,
    line: Arc<dyn Interrupt>,
    needs_reset: Arc<AtomicBool>,
}

impl std::fmt::Debug for VirtioInterrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioInterrupt")
            .field("status", &self.status())
            .field("needs_reset", &self.needs_reset())
            .finish()
    }
}

impl VirtioInterrupt {
    /// A fresh interrupt with no pending causes.
    pub fn new(line: Arc<dyn Interrupt>) -> Self {
        Self {
            status: Arc::new(AtomicU32::new(0)),
            line,
            needs_reset: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Tells the driver that a used ring has new entries.
    pub(crate) fn signal_used_queue(&self) {
        self.signal(VIRTIO_MMIO_INT_VRING);
    }

    /// Tells the driver that the configuration space (or the device status) changed.
    pub(crate) fn signal_config_change(&self) {
        self.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    /// Marks the device broken (`DEVICE_NEEDS_RESET`) after guest input it cannot recover
    /// from, and tells the driver through a configuration-change interrupt.
    pub(crate) fn set_needs_reset(&self) {
        self.needs_reset.store(true, Ordering::SeqCst);
        self.signal_config_change();
    }

    /// Whether [`set_needs_reset`](Self::set_needs_reset) was called since the last reset.
    pub(crate) fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::SeqCst)
    }

    /// The pending interrupt causes (`VIRTIO_MMIO_INT_*` bits).
    pub(crate) fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Clears the causes the driver acknowledged.
    pub(crate) fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Sets the pending causes to `bits` (a restored snapshot's).
    pub(crate) fn restore_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    /// Forgets every pending cause and the needs-reset mark (device reset).
    pub(crate) fn clear(&self) {
        self.status.store(0, Ordering::SeqCst);
        self.needs_reset.store(false, Ordering::SeqCst);
    }

    fn signal(&self, cause: u32) {
        // Set the cause before raising the line: the guest's handler reads it.
        self.status.fetch_or(cause, Ordering::SeqCst);
        if let Err(e) = self.line.trigger() {
            crate::guest_warn!("virtio: failed to raise the interrupt: {e}");
        }
    }
}

/// A virtio device as the transport sees it.
///
/// The transport calls these from the vCPU thread that touched the MMIO window; the work
/// itself happens on the device's own thread, started by `activate` and stopped by `reset`
/// (and on drop).
pub trait VirtioDevice: Send {
    /// The virtio device ID (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;
    /// The maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// The feature bits the device offers.
    fn avail_features(&self) -> u64;
    /// The driver accepted these features (a subset of `avail_features`, checked by the
    /// transport) when it set `FEATURES_OK`.
    fn ack_features(&mut self, features: u64);
    /// A driver read of the device configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// A driver write to the configuration space. Most devices have nothing writable.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        crate::guest_warn!(
            "virtio: ignoring a {}-byte write to read-only config offset {offset:#x}",
            data.len()
        );
    }
    /// Bumped whenever the device changes its configuration space on its own.
    fn config_generation(&self) -> u32 {
        0
    }
    /// The driver set `DRIVER_OK`: start serving the queues.
    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError>;
    /// The driver reset the device: stop serving (finishing what is in flight) and return
    /// to the state before `activate`.
    fn reset(&mut self);
    /// Whether the device keeps the buffers the driver makes available on `queue`
    /// until it has something for them (the console's receive queue, the balloon's
    /// statistics queue) rather than completing them. Such a queue never drains: a
    /// snapshot does not wait for it, and a restored device takes those buffers
    /// again from the queue's used index (`mmio::state`).
    fn holds_buffers(&self, _queue: usize) -> bool {
        false
    }
}

impl<D: VirtioDevice + ?Sized> VirtioDevice for Box<D> {
    fn device_type(&self) -> u32 {
        (**self).device_type()
    }
    fn queue_max_sizes(&self) -> &[u16] {
        (**self).queue_max_sizes()
    }
    fn avail_features(&self) -> u64 {
        (**self).avail_features()
    }
    fn ack_features(&mut self, features: u64) {
        (**self).ack_features(features)
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        (**self).read_config(offset, data)
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        (**self).write_config(offset, data)
    }
    fn config_generation(&self) -> u32 {
        (**self).config_generation()
    }
    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        (**self).activate(mem, interrupt, queues)
    }
    fn reset(&mut self) {
        (**self).reset()
    }
    fn holds_buffers(&self, queue: usize) -> bool {
        (**self).holds_buffers(queue)
    }
}

/// Copies the `data.len()` bytes at `offset` of a configuration space into `data`; bytes
/// past its end read as zero.
pub(crate) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if let Some(src) = config.get(start..) {
        let n = src.len().min(data.len());
        data[..n].copy_from_slice(&src[..n]);
    }
}

/// Checks the queues the transport handed over: the right number, each ready.
pub(crate) fn check_queues(queues: &[ActiveQueue], expected: usize) -> Result<(), ActivateError> {
    use virtio_queue::QueueT;
    if queues.len() != expected {
        return Err(ActivateError::QueueCount {
            expected,
            got: queues.len(),
        });
    }
    match queues.iter().position(|q| !q.queue.ready()) {
        Some(i) => Err(ActivateError::QueueNotReady(i)),
        None => Ok(()),
    }
}

/// Takes up to one queue's worth of available chains — a driver can keep adding while we
/// read, so a bound is what keeps one wake-up finite. A corrupt available ring marks the
/// device `NEEDS_RESET` and yields nothing.
pub(crate) fn pop_chains<'m>(
    queue: &mut Queue,
    mem: &'m GuestMemory,
    irq: &VirtioInterrupt,
    device: &str,
) -> Vec<virtio_queue::DescriptorChain<&'m GuestMemory>> {
    use virtio_queue::{QueueOwnedT, QueueT};
    let budget = usize::from(queue.size());
    match queue.iter(mem) {
        Ok(iter) => iter.take(budget).collect(),
        Err(e) => {
            crate::guest_warn!("{device}: unusable available ring ({e}); device needs reset");
            irq.set_needs_reset();
            Vec::new()
        }
    }
}

/// Puts a finished chain in the used ring; a head the ring cannot take (guest garbage)
/// marks the device `NEEDS_RESET`. Returns whether it was added.
pub(crate) fn return_chain(
    queue: &mut Queue,
    mem: &GuestMemory,
    irq: &VirtioInterrupt,
    device: &str,
    head: u16,
    len: u32,
) -> bool {
    use virtio_queue::QueueT;
    match queue.add_used(mem, head, len) {
        Ok(()) => true,
        Err(e) => {
            crate::guest_warn!("{device}: cannot return chain {head}: {e}; device needs reset");
            irq.set_needs_reset();
            false
        }
    }
}

/// One pass over a queue in the shape the simple devices share: take up to a
/// queue's worth of chains, answer each with `handle` (its used length), then
/// interrupt the guest once if anything went back and the driver wants to hear.
pub(crate) fn serve_queue(
    queue: &mut Queue,
    mem: &GuestMemory,
    irq: &VirtioInterrupt,
    device: &str,
    mut handle: impl FnMut(virtio_queue::DescriptorChain<&GuestMemory>) -> u32,
) {
    let mut returned = false;
    for chain in pop_chains(queue, mem, irq, device) {
        let head = chain.head_index();
        let len = handle(chain);
        returned |= return_chain(queue, mem, irq, device, head, len);
    }
    if returned && needs_interrupt(queue, mem, device) {
        irq.signal_used_queue();
    }
}

/// Whether the driver wants an interrupt for the chains just put in the used ring.
///
/// With `VIRTIO_RING_F_EVENT_IDX` that is the used-event index (`virtio-queue` checks it);
/// without, the driver's `VRING_AVAIL_F_NO_INTERRUPT` flag, which `virtio-queue` ignores:
/// a driver that polls its used ring sets it and an interrupt would only cost it an exit
/// and us a syscall. When in doubt (the ring is unreadable), interrupt.
pub(crate) fn needs_interrupt(queue: &mut Queue, mem: &GuestMemory, device: &str) -> bool {
    use virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT;
    use virtio_queue::QueueT;
    use vm_memory::{Bytes, GuestAddress};
    // Fences the used-ring writes before the reads below: the driver clears the flag and
    // then re-reads the used index, so one of the two sides sees the other's store.
    let wanted = match queue.needs_notification(mem) {
        Ok(wanted) => wanted,
        Err(e) => {
            crate::guest_warn!("{device}: cannot read the used event index: {e}");
            return true;
        }
    };
    if !wanted || queue.event_idx_enabled() {
        return wanted;
    }
    match mem.load::<u16>(GuestAddress(queue.avail_ring()), Ordering::Acquire) {
        Ok(flags) => u16::from_le(flags) & VRING_AVAIL_F_NO_INTERRUPT as u16 == 0,
        Err(e) => {
            crate::guest_warn!("{device}: cannot read the available ring flags: {e}");
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;

    #[test]
    fn interrupt_sets_cause_then_triggers_and_acks() {
        let line = Arc::new(CountingInterrupt::default());
        let irq = VirtioInterrupt::new(line.clone());
        irq.signal_used_queue();
        assert_eq!(irq.status(), VIRTIO_MMIO_INT_VRING);
        irq.signal_config_change();
        assert_eq!(irq.status(), VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(line.count(), 2);
        irq.ack(VIRTIO_MMIO_INT_VRING);
        assert_eq!(irq.status(), VIRTIO_MMIO_INT_CONFIG);
        irq.set_needs_reset();
        assert!(irq.needs_reset());
        irq.clear();
        assert_eq!(irq.status(), 0);
        assert!(!irq.needs_reset());
    }

    #[test]
    fn serve_queue_interrupts_unless_the_driver_says_no_interrupt() {
        use test_utils::*;
        let line = Arc::new(CountingInterrupt::default());
        let irq = VirtioInterrupt::new(line.clone());
        let mem = memory();
        let vq = TestQueue::new(&mem, 8);
        let mut queue = vq.create_queue().unwrap();
        add_chain(&vq, 0, &[w(DATA_START, 4)]);
        serve_queue(&mut queue, &mem, &irq, "test", |_| 4);
        assert_eq!(line.count(), 1);
        vq.set_avail_flags(virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT as u16);
        add_chain(&vq, 1, &[w(DATA_START, 4)]);
        serve_queue(&mut queue, &mem, &irq, "test", |_| 4);
        assert_eq!(used(&vq).len(), 2);
        assert_eq!(line.count(), 1, "the driver asked for no interrupt");
    }

    #[test]
    fn config_reads_are_bounded_and_zero_filled() {
        let cfg = [1u8, 2, 3, 4];
        let mut d = [0xffu8; 4];
        read_config_bytes(&cfg, 2, &mut d);
        assert_eq!(d, [3, 4, 0, 0]);
        read_config_bytes(&cfg, 100, &mut d);
        assert_eq!(d, [0; 4]);
        read_config_bytes(&cfg, u64::MAX, &mut d);
        assert_eq!(d, [0; 4]);
    }
}
