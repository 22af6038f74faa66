//! A polling virtio-mmio virtio-mem driver (virtio 1.2 §5.15): plug, unplug
//! and state requests by hand, so the tests can make the ones a correct
//! driver would not (out of range, not committed yet), and write and check
//! what is plugged.
//!
//! One queue of two descriptors (request, response) at fixed addresses
//! below `virtio_blk`'s, polled. The region sits above 4 GiB, in the
//! 4-5 GiB the page tables map (boot.rs).

use crate::io::Clock;
use crate::{io, println};

const EMBER_WINDOWS: (u64, u64) = (0xd000_0000, 0x1000);
const WINDOWS: u64 = 16;
const MAGIC: u32 = 0x7472_6976;
const DEVICE_ID_MEM: u32 = 24;
const F_VERSION_1: u64 = 1 << 32;

mod reg {
    pub const MAGIC: u64 = 0x000;
    pub const DEVICE_ID: u64 = 0x008;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// `virtio_mem_config` fields (offsets into the config space).
const CFG_BLOCK_SIZE: u64 = 0;
const CFG_ADDR: u64 = 16;
const CFG_REGION_SIZE: u64 = 24;
const CFG_PLUGGED: u64 = 40;
const CFG_REQUESTED: u64 = 48;

const QUEUE_SIZE: u32 = 8;
const DESC_TABLE: u64 = 0x70_0000;
const AVAIL_RING: u64 = 0x70_1000;
const USED_RING: u64 = 0x70_2000;
const REQ: u64 = 0x70_3000;
const RESP: u64 = 0x70_3100;
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// The page tables map guest-physical memory up to here.
const MAPPED_END: u64 = 5 << 30;

/// Request types.
pub const PLUG: u16 = 0;
pub const UNPLUG: u16 = 1;
pub const UNPLUG_ALL: u16 = 2;
pub const STATE: u16 = 3;

fn rd<T: Copy>(addr: u64) -> T {
    // SAFETY: driver-owned RAM or an MMIO register (identity mapped).
    unsafe { (addr as *const T).read_volatile() }
}
fn wr<T: Copy>(addr: u64, v: T) {
    // SAFETY: as for rd.
    unsafe { (addr as *mut T).write_volatile(v) }
}

/// The device, initialized.
pub struct VirtioMem {
    base: u64,
    avail_idx: u16,
    last_used: u16,
}

impl VirtioMem {
    /// Finds and initializes the first virtio-mem device.
    pub fn init() -> Result<Self, &'static str> {
        let base = (0..WINDOWS)
            .map(|i| EMBER_WINDOWS.0 + i * EMBER_WINDOWS.1)
            .find(|&b| {
                rd::<u32>(b + reg::MAGIC) == MAGIC && rd::<u32>(b + reg::DEVICE_ID) == DEVICE_ID_MEM
            })
            .ok_or("no virtio-mem device")?;
        let w = |off, v: u32| wr(base + off, v);
        w(reg::STATUS, 0);
        w(reg::STATUS, 1);
        w(reg::STATUS, 3);
        w(reg::DEVICE_FEATURES_SEL, 1);
        let high = u64::from(rd::<u32>(base + reg::DEVICE_FEATURES)) << 32;
        if high & F_VERSION_1 == 0 {
            return Err("no VIRTIO_F_VERSION_1");
        }
        w(reg::DRIVER_FEATURES_SEL, 0);
        w(reg::DRIVER_FEATURES, 0);
        w(reg::DRIVER_FEATURES_SEL, 1);
        w(reg::DRIVER_FEATURES, 1);
        w(reg::STATUS, 11);
        if rd::<u32>(base + reg::STATUS) & 8 == 0 {
            return Err("features refused");
        }
        w(reg::QUEUE_SEL, 0);
        w(reg::QUEUE_NUM, QUEUE_SIZE);
        for addr in (DESC_TABLE..REQ).step_by(8) {
            wr::<u64>(addr, 0);
        }
        wr::<u16>(AVAIL_RING, AVAIL_F_NO_INTERRUPT);
        for (low, high, addr) in [
            (reg::QUEUE_DESC_LOW, reg::QUEUE_DESC_HIGH, DESC_TABLE),
            (reg::QUEUE_DRIVER_LOW, reg::QUEUE_DRIVER_HIGH, AVAIL_RING),
            (reg::QUEUE_DEVICE_LOW, reg::QUEUE_DEVICE_HIGH, USED_RING),
        ] {
            w(low, addr as u32);
            w(high, (addr >> 32) as u32);
        }
        w(reg::QUEUE_READY, 1);
        w(reg::STATUS, 15);
        // Descriptor 0: the request; 1: the response.
        wr::<u64>(DESC_TABLE, REQ);
        wr::<u32>(DESC_TABLE + 8, 24);
        wr::<u16>(DESC_TABLE + 12, DESC_F_NEXT);
        wr::<u16>(DESC_TABLE + 14, 1);
        wr::<u64>(DESC_TABLE + 16, RESP);
        wr::<u32>(DESC_TABLE + 24, 10);
        wr::<u16>(DESC_TABLE + 28, DESC_F_WRITE);
        Ok(VirtioMem {
            base,
            avail_idx: 0,
            last_used: 0,
        })
    }

    /// A 64-bit config field, read consistently.
    pub fn config(&self, off: u64) -> u64 {
        loop {
            let g = rd::<u32>(self.base + reg::CONFIG_GENERATION);
            let lo = u64::from(rd::<u32>(self.base + reg::CONFIG + off));
            let hi = u64::from(rd::<u32>(self.base + reg::CONFIG + off + 4));
            if rd::<u32>(self.base + reg::CONFIG_GENERATION) == g {
                return hi << 32 | lo;
            }
        }
    }

    pub fn block_size(&self) -> u64 {
        self.config(CFG_BLOCK_SIZE)
    }
    pub fn addr(&self) -> u64 {
        self.config(CFG_ADDR)
    }

    /// Prints the config space.
    pub fn info(&self) {
        println!(
            "vmem: addr={:#x} region={} block={} plugged={} requested={}",
            self.addr(),
            self.config(CFG_REGION_SIZE),
            self.block_size(),
            self.config(CFG_PLUGGED),
            self.config(CFG_REQUESTED)
        );
    }

    /// One request on blocks `block..block+n` of the region; the response
    /// type and state.
    pub fn request(&mut self, ty: u16, block: u64, n: u64) -> (u16, u16) {
        let addr = self
            .addr()
            .wrapping_add(block.wrapping_mul(self.block_size()));
        for off in (0..24).step_by(8) {
            wr::<u64>(REQ + off, 0);
        }
        wr::<u16>(REQ, ty);
        wr::<u64>(REQ + 8, addr);
        wr::<u16>(REQ + 16, n as u16);
        wr::<u64>(RESP, u64::MAX);
        let slot = u64::from(self.avail_idx % QUEUE_SIZE as u16);
        wr::<u16>(AVAIL_RING + 4 + 2 * slot, 0);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        wr::<u16>(AVAIL_RING + 2, self.avail_idx);
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        wr::<u32>(self.base + reg::QUEUE_NOTIFY, 0);
        while rd::<u16>(USED_RING + 2) == self.last_used {
            core::hint::spin_loop();
        }
        self.last_used = self.last_used.wrapping_add(1);
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        (rd::<u16>(RESP), rd::<u16>(RESP + 8))
    }

    /// Plugs blocks one by one from the region's start until the plugged
    /// size reaches the requested size (or nothing more plugs).
    pub fn plug_to_requested(&mut self) {
        let blocks = self.config(CFG_REGION_SIZE) / self.block_size();
        let mut b = 0;
        while self.config(CFG_PLUGGED) < self.config(CFG_REQUESTED) && b < blocks {
            self.request(PLUG, b, 1);
            b += 1;
        }
        println!(
            "vmem: plugged={} requested={}",
            self.config(CFG_PLUGGED),
            self.config(CFG_REQUESTED)
        );
    }

    /// Unplugs blocks from the top until the plugged size is down to the requested.
    pub fn unplug_to_requested(&mut self) {
        let mut b = self.config(CFG_REGION_SIZE) / self.block_size();
        while self.config(CFG_PLUGGED) > self.config(CFG_REQUESTED) && b > 0 {
            b -= 1;
            if self.request(STATE, b, 1).1 == 0 {
                self.request(UNPLUG, b, 1);
            }
        }
        println!(
            "vmem: plugged={} requested={}",
            self.config(CFG_PLUGGED),
            self.config(CFG_REQUESTED)
        );
    }

    /// Waits (up to a minute) for the requested size to become `bytes`.
    pub fn wait_requested(&self, bytes: u64, clock: &Clock) -> Result<(), &'static str> {
        let until = io::rdtsc().saturating_add(clock.ticks(60_000_000_000));
        while self.config(CFG_REQUESTED) != bytes {
            if io::rdtsc() > until {
                return Err("the requested size never came");
            }
            core::hint::spin_loop();
        }
        println!("vmem: requested={bytes}");
        Ok(())
    }

    /// Guest-physical range of `n` blocks from `block`, if mapped.
    fn span(&self, block: u64, n: u64) -> Result<(u64, u64), &'static str> {
        let start = self.addr() + block * self.block_size();
        let end = start + n * self.block_size();
        if end > MAPPED_END {
            return Err("past the mapped 5 GiB");
        }
        Ok((start, end))
    }

    /// Writes every word of the blocks with a pattern of its address.
    pub fn fill(&self, block: u64, n: u64) -> Result<(), &'static str> {
        let (start, end) = self.span(block, n)?;
        let mut a = start;
        while a < end {
            wr::<u64>(a, pattern(a));
            a += 8;
        }
        println!("vmem: filled {n} blocks from {block}");
        Ok(())
    }

    /// Checks every word of the blocks holds its pattern.
    pub fn check(&self, block: u64, n: u64) -> Result<(), &'static str> {
        let (start, end) = self.span(block, n)?;
        let mut a = start;
        while a < end {
            if rd::<u64>(a) != pattern(a) {
                println!("vmem: check {n} blocks from {block}: bad at {a:#x}");
                return Ok(());
            }
            a += 8;
        }
        println!("vmem: check {n} blocks from {block}: intact");
        Ok(())
    }
}

fn pattern(a: u64) -> u64 {
    a ^ 0x5a5a_0000_0000_a5a5
}

/// A response's name.
pub fn name(resp: (u16, u16), ty: u16) -> &'static str {
    match (resp.0, ty) {
        (0, STATE) => ["plugged", "unplugged", "mixed"]
            .get(usize::from(resp.1))
            .copied()
            .unwrap_or("?"),
        (0, _) => "ack",
        (1, _) => "nack",
        (2, _) => "busy",
        (3, _) => "error",
        _ => "?",
    }
}
