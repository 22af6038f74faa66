//! What the test guest's virtio-mmio drivers share (virtio 1.2 §2, §4.2):
//! the register window, finding a device, feature negotiation, setting up a
//! split virtqueue at fixed addresses, and volatile access to the memory the
//! guest shares with the device. Each driver (`virtio_blk`, `virtio_net`,
//! `virtio_vsock`, `virtio_mem`) keeps only what is its device's own: its
//! features, its queues' layout and its requests.
//!
//! Everything is polled: the drivers ask for no interrupts, so none of this
//! needs an interrupt controller.

/// ember's device windows (`layout::VIRTIO_MMIO_START`): 16, 4 KiB apart.
pub(crate) const EMBER_WINDOWS: (u64, u64, u64) = (0xd000_0000, 0x1000, 16);
/// QEMU microvm's transports: 0xfeb00000, 512 bytes apart.
pub(crate) const QEMU_MICROVM_WINDOWS: (u64, u64, u64) = (0xfeb0_0000, 0x200, 32);

/// virtio-mmio registers (virtio 1.2 §4.2.2).
pub(crate) mod reg {
    pub const MAGIC: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    /// The device-specific configuration space.
    pub const CONFIG: u64 = 0x100;
}

pub(crate) const MAGIC: u32 = 0x7472_6976; // "virt"
pub(crate) const MODERN_VERSION: u32 = 2;

pub(crate) const STATUS_ACKNOWLEDGE: u32 = 1;
pub(crate) const STATUS_DRIVER: u32 = 2;
pub(crate) const STATUS_DRIVER_OK: u32 = 4;
pub(crate) const STATUS_FEATURES_OK: u32 = 8;
/// The device met an error it cannot recover from without a reset.
pub(crate) const STATUS_NEEDS_RESET: u32 = 0x40;
/// Interrupt status: the configuration changed.
pub(crate) const INT_CONFIG: u32 = 2;

/// VIRTIO_F_VERSION_1 (bit 32): every driver here requires it.
pub(crate) const F_VERSION_1: u64 = 1 << 32;

pub(crate) const DESC_F_NEXT: u16 = 1;
pub(crate) const DESC_F_WRITE: u16 = 2;
/// avail.flags: we poll, don't interrupt us.
pub(crate) const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// used.flags: the device doesn't need a notification now.
pub(crate) const USED_F_NO_NOTIFY: u16 = 1;

pub(crate) fn rd8(addr: u64) -> u8 {
    // SAFETY: `addr` is RAM a driver owns (its fixed layout) and shares
    // with the device, identity mapped.
    unsafe { (addr as *const u8).read_volatile() }
}
pub(crate) fn wr8(addr: u64, v: u8) {
    // SAFETY: as for rd8.
    unsafe { (addr as *mut u8).write_volatile(v) }
}
pub(crate) fn rd16(addr: u64) -> u16 {
    // SAFETY: as for rd8; ring and header fields are naturally aligned.
    unsafe { (addr as *const u16).read_volatile() }
}
pub(crate) fn wr16(addr: u64, v: u16) {
    // SAFETY: as for rd16.
    unsafe { (addr as *mut u16).write_volatile(v) }
}
pub(crate) fn rd32(addr: u64) -> u32 {
    // SAFETY: as for rd16.
    unsafe { (addr as *const u32).read_volatile() }
}
pub(crate) fn wr32(addr: u64, v: u32) {
    // SAFETY: as for rd16.
    unsafe { (addr as *mut u32).write_volatile(v) }
}
pub(crate) fn rd64(addr: u64) -> u64 {
    // SAFETY: as for rd16.
    unsafe { (addr as *const u64).read_volatile() }
}
pub(crate) fn wr64(addr: u64, v: u64) {
    // SAFETY: as for rd16.
    unsafe { (addr as *mut u64).write_volatile(v) }
}

/// Orders the driver's ring writes against the device's view (and the
/// device's against ours): a full fence, as the drivers poll.
pub(crate) fn fence() {
    core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
}

/// A virtio-mmio register window. All registers are 32-bit; the pages of the
/// device hole are mapped uncached (boot.rs).
#[derive(Clone, Copy)]
pub(crate) struct Mmio(pub(crate) u64);

impl Mmio {
    pub(crate) fn read(self, offset: u64) -> u32 {
        // SAFETY: an MMIO register in the device hole; reads have no effect on our memory.
        unsafe { ((self.0 + offset) as *const u32).read_volatile() }
    }
    pub(crate) fn write(self, offset: u64, value: u32) {
        // SAFETY: as for read; the device only touches memory we handed it.
        unsafe { ((self.0 + offset) as *mut u32).write_volatile(value) }
    }

    /// The first device of type `id` in ember's windows, or QEMU microvm's.
    pub(crate) fn find(id: u32) -> Option<Mmio> {
        [EMBER_WINDOWS, QEMU_MICROVM_WINDOWS]
            .into_iter()
            .flat_map(|(start, step, count)| (0..count).map(move |i| Mmio(start + i * step)))
            .find(|m| m.read(reg::MAGIC) == MAGIC && m.read(reg::DEVICE_ID) == id)
    }

    /// The 64 feature bits the device offers.
    pub(crate) fn features(self) -> u64 {
        let mut bits = 0;
        for sel in [1, 0] {
            self.write(reg::DEVICE_FEATURES_SEL, sel);
            bits = (bits << 32) | u64::from(self.read(reg::DEVICE_FEATURES));
        }
        bits
    }

    /// Initialization up to FEATURES_OK (§3.1.1): reset, acknowledge, and
    /// accept what the device offers of `want` (VIRTIO_F_VERSION_1 always).
    /// Returns the accepted features.
    pub(crate) fn negotiate(self, want: u64) -> Result<u64, &'static str> {
        if self.read(reg::VERSION) != MODERN_VERSION {
            return Err("not a modern (version 2) virtio-mmio device");
        }
        self.write(reg::STATUS, 0);
        self.write(reg::STATUS, STATUS_ACKNOWLEDGE);
        self.write(reg::STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        let offered = self.features();
        if offered & F_VERSION_1 == 0 {
            return Err("the device does not offer VIRTIO_F_VERSION_1");
        }
        let accepted = offered & (want | F_VERSION_1);
        for (sel, half) in [(0, accepted as u32), (1, (accepted >> 32) as u32)] {
            self.write(reg::DRIVER_FEATURES_SEL, sel);
            self.write(reg::DRIVER_FEATURES, half);
        }
        self.write(reg::STATUS, Self::NEGOTIATED);
        if self.read(reg::STATUS) & STATUS_FEATURES_OK == 0 {
            return Err("the device refused our features");
        }
        Ok(accepted)
    }

    const NEGOTIATED: u32 = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;

    /// The last step of initialization: the driver is ready.
    pub(crate) fn driver_ok(self) {
        self.write(reg::STATUS, Self::NEGOTIATED | STATUS_DRIVER_OK);
    }

    /// Queue `index` at `rings` (descriptors, then the avail ring at +4 KiB
    /// and the used ring at +8 KiB, all three zeroed), with the largest
    /// power-of-two size the device allows up to `max`; fails below `min`.
    /// Returns the size.
    pub(crate) fn setup_queue(
        self,
        index: u32,
        rings: Rings,
        min: u16,
        max: u16,
    ) -> Result<u16, &'static str> {
        self.write(reg::QUEUE_SEL, index);
        if self.read(reg::QUEUE_READY) != 0 {
            return Err("the queue is already in use");
        }
        let allowed = self.read(reg::QUEUE_NUM_MAX).min(u32::from(max));
        if allowed < u32::from(min) || allowed == 0 {
            return Err("the device's queue is too small");
        }
        let size = 1u16 << (31 - allowed.leading_zeros());
        self.write(reg::QUEUE_NUM, size.into());
        // Fresh rings: no stale indices from an earlier run.
        for addr in (rings.desc..rings.desc + Rings::SPAN).step_by(8) {
            wr64(addr, 0);
        }
        wr16(rings.avail(), AVAIL_F_NO_INTERRUPT);
        for (low, high, addr) in [
            (reg::QUEUE_DESC_LOW, reg::QUEUE_DESC_HIGH, rings.desc),
            (reg::QUEUE_DRIVER_LOW, reg::QUEUE_DRIVER_HIGH, rings.avail()),
            (reg::QUEUE_DEVICE_LOW, reg::QUEUE_DEVICE_HIGH, rings.used()),
        ] {
            self.write(low, addr as u32);
            self.write(high, (addr >> 32) as u32);
        }
        self.write(reg::QUEUE_READY, 1);
        Ok(size)
    }

    /// A 64-bit field of the configuration space, read consistently (the
    /// generation unchanged around it).
    pub(crate) fn config64(self, offset: u64) -> u64 {
        loop {
            let generation = self.read(reg::CONFIG_GENERATION);
            let low = u64::from(self.read(reg::CONFIG + offset));
            let high = u64::from(self.read(reg::CONFIG + offset + 4));
            if self.read(reg::CONFIG_GENERATION) == generation {
                return high << 32 | low;
            }
        }
    }
}

/// Where one split virtqueue lives: 12 KiB from `desc`, each part 4 KiB
/// aligned (room for 256 entries).
#[derive(Clone, Copy)]
pub(crate) struct Rings {
    pub(crate) desc: u64,
}

impl Rings {
    const SPAN: u64 = 0x3000;

    pub(crate) const fn avail(self) -> u64 {
        self.desc + 0x1000
    }
    pub(crate) const fn used(self) -> u64 {
        self.desc + 0x2000
    }
    /// The used ring's index, as the device last published it.
    pub(crate) fn used_idx(self) -> u16 {
        fence();
        rd16(self.used() + 2)
    }
    /// Writes descriptor `i`.
    pub(crate) fn write_desc(self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * u64::from(i);
        wr64(d, addr);
        wr32(d + 8, len);
        wr16(d + 12, flags);
        wr16(d + 14, next);
    }
    /// Puts `head` in avail ring slot `slot` (unpublished until `publish`).
    pub(crate) fn offer(self, slot: u16, head: u16) {
        wr16(self.avail() + 4 + 2 * u64::from(slot), head);
    }
    /// Publishes the avail index `idx`, after the entries it covers.
    pub(crate) fn publish(self, idx: u16) {
        fence();
        wr16(self.avail() + 2, idx);
    }
    /// Whether the device asked not to be notified.
    pub(crate) fn no_notify(self) -> bool {
        fence();
        rd16(self.used()) & USED_F_NO_NOTIFY != 0
    }
}
