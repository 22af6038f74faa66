//! A polling virtio-mmio virtio-mem driver (virtio 1.2 §5.15): plug, unplug
//! and state requests by hand, so the tests can make the ones a correct
//! driver would not (out of range, not committed yet), and write and check
//! what is plugged.
//!
//! One queue of two descriptors (request, response) at fixed addresses
//! below `virtio_blk`'s, polled. The region sits above 4 GiB, in the
//! 4-5 GiB the page tables map (boot.rs).

use crate::io::Clock;
use crate::virtio::{DESC_F_NEXT, DESC_F_WRITE, Mmio, Rings, fence, rd16, rd64, reg, wr16, wr64};
use crate::{io, println};

const DEVICE_ID_MEM: u32 = 24;

/// `virtio_mem_config` fields (offsets into the config space).
const CFG_BLOCK_SIZE: u64 = 0;
const CFG_ADDR: u64 = 16;
const CFG_REGION_SIZE: u64 = 24;
const CFG_PLUGGED: u64 = 40;
const CFG_REQUESTED: u64 = 48;

const QUEUE_SIZE: u16 = 8;
const RINGS: Rings = Rings { desc: 0x70_0000 };
const REQ: u64 = 0x70_3000;
const RESP: u64 = 0x70_3100;
/// The page tables map guest-physical memory up to here.
const MAPPED_END: u64 = 5 << 30;

/// Request types.
pub const PLUG: u16 = 0;
pub const UNPLUG: u16 = 1;
pub const UNPLUG_ALL: u16 = 2;
pub const STATE: u16 = 3;

/// The device, initialized.
pub struct VirtioMem {
    mmio: Mmio,
    avail_idx: u16,
    last_used: u16,
}

impl VirtioMem {
    /// Finds and initializes the first virtio-mem device.
    pub fn init() -> Result<Self, &'static str> {
        let mmio = Mmio::find(DEVICE_ID_MEM).ok_or("no virtio-mem device")?;
        mmio.negotiate(0)?;
        mmio.setup_queue(0, RINGS, 2, QUEUE_SIZE)?;
        mmio.driver_ok();
        // Descriptor 0: the request; 1: the response.
        RINGS.write_desc(0, REQ, 24, DESC_F_NEXT, 1);
        RINGS.write_desc(1, RESP, 10, DESC_F_WRITE, 0);
        Ok(VirtioMem {
            mmio,
            avail_idx: 0,
            last_used: 0,
        })
    }

    /// A 64-bit config field, read consistently.
    pub fn config(&self, off: u64) -> u64 {
        self.mmio.config64(off)
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
            wr64(REQ + off, 0);
        }
        wr16(REQ, ty);
        wr64(REQ + 8, addr);
        wr16(REQ + 16, n as u16);
        wr64(RESP, u64::MAX);
        RINGS.offer(self.avail_idx % QUEUE_SIZE, 0);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        RINGS.publish(self.avail_idx);
        fence();
        self.mmio.write(reg::QUEUE_NOTIFY, 0);
        while RINGS.used_idx() == self.last_used {
            core::hint::spin_loop();
        }
        self.last_used = self.last_used.wrapping_add(1);
        fence();
        (rd16(RESP), rd16(RESP + 8))
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
            wr64(a, pattern(a));
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
            if rd64(a) != pattern(a) {
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
