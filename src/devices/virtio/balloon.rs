//! virtio-balloon (virtio 1.x §5.5): lets the host take guest memory back.
//!
//! - The VMM sets a target ([`BalloonHandle::set_target_pages`]); the driver inflates
//!   (hands pages over, queue 0) or deflates (takes them back, queue 1) towards it and
//!   reports its progress in the `actual` config field.
//! - Inflated pages are dropped from the host with `madvise(MADV_DONTNEED)`; they read
//!   back as zeroes if the guest touches them again.
//! - With `STATS_VQ` the driver keeps one statistics buffer posted; the device holds it and
//!   returns it to ask for fresh numbers ([`BalloonHandle::request_stats`]). The last
//!   report stays readable ([`BalloonHandle::stats`]).
//! - With `PAGE_REPORTING` the driver reports free page ranges, which are discarded the
//!   same way as inflated pages.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::worker::{QueueHandler, Worker, spawn_queue_worker};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt,
    pop_chains, read_config_bytes, return_chain,
};

/// The driver may deflate on its own when the guest runs out of memory.
pub const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u32 = 2;
/// A statistics queue exists.
pub const VIRTIO_BALLOON_F_STATS_VQ: u32 = 1;
/// A free page reporting queue exists.
pub const VIRTIO_BALLOON_F_FREE_PAGE_REPORTING: u32 = 5;

/// Entries per queue.
pub const QUEUE_SIZE: u16 = 256;
/// Balloon page frame numbers are in 4 KiB units, whatever the guest's page size.
pub const BALLOON_PAGE_SHIFT: u32 = 12;
const BALLOON_PAGE_SIZE: u64 = 1 << BALLOON_PAGE_SHIFT;
/// Most bytes read from one inflate/deflate/stats buffer (the Linux driver sends 1 KiB).
const MAX_BUFFER_BYTES: usize = 64 * 1024;
/// Size of one `struct virtio_balloon_stat` (`le16 tag; le64 val`, packed).
const STAT_LEN: usize = 10;
/// Offsets in the configuration space.
const CONFIG_NUM_PAGES: usize = 0;
const CONFIG_ACTUAL: usize = 4;
const CONFIG_LEN: usize = 16;
const DEVICE: &str = "virtio-balloon";

/// Statistics tags (`VIRTIO_BALLOON_S_*`).
pub mod stat {
    /// Bytes swapped in.
    pub const SWAP_IN: u16 = 0;
    /// Bytes swapped out.
    pub const SWAP_OUT: u16 = 1;
    /// Major page faults.
    pub const MAJOR_FAULTS: u16 = 2;
    /// Minor page faults.
    pub const MINOR_FAULTS: u16 = 3;
    /// Free memory, bytes.
    pub const FREE_MEMORY: u16 = 4;
    /// Total memory, bytes.
    pub const TOTAL_MEMORY: u16 = 5;
    /// Available memory, bytes.
    pub const AVAILABLE_MEMORY: u16 = 6;
    /// Disk caches, bytes.
    pub const DISK_CACHES: u16 = 7;
}

/// The last statistics report, as (tag, value) pairs in the driver's order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BalloonStats {
    /// Every reported pair.
    pub entries: Vec<(u16, u64)>,
}

impl BalloonStats {
    /// The value reported for `tag` (see [`stat`]).
    pub fn get(&self, tag: u16) -> Option<u64> {
        self.entries.iter().find(|e| e.0 == tag).map(|e| e.1)
    }
}

/// State shared by the device, its thread and the VMM's handles.
#[derive(Debug, Default)]
struct Shared {
    target_pages: u32,
    actual_pages: u32,
    generation: u32,
    stats: Option<BalloonStats>,
    /// Set while the device is active, so a new target can interrupt the guest.
    irq: Option<VirtioInterrupt>,
    discarded_pages: u64,
}

/// The VMM's remote control for a balloon (cheap to clone, usable from any thread).
#[derive(Debug, Clone)]
pub struct BalloonHandle {
    shared: Arc<Mutex<Shared>>,
    stats_request: Arc<EventFd>,
}

impl BalloonHandle {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the guest to hold `pages` 4 KiB pages in the balloon.
    pub fn set_target_pages(&self, pages: u32) {
        let mut s = self.lock();
        s.target_pages = pages;
        s.generation = s.generation.wrapping_add(1);
        if let Some(irq) = &s.irq {
            irq.signal_config_change();
        }
    }

    /// The current target.
    pub fn target_pages(&self) -> u32 {
        self.lock().target_pages
    }

    /// How many pages the driver says it holds.
    pub fn actual_pages(&self) -> u32 {
        self.lock().actual_pages
    }

    /// Pages discarded on the host so far (inflations and reported free pages).
    pub fn discarded_pages(&self) -> u64 {
        self.lock().discarded_pages
    }

    /// The latest statistics the driver reported, if any.
    pub fn stats(&self) -> Option<BalloonStats> {
        self.lock().stats.clone()
    }

    /// Asks the driver for fresh statistics (they arrive asynchronously).
    pub fn request_stats(&self) {
        if let Err(e) = self.stats_request.write(1) {
            log::warn!("{DEVICE}: cannot request statistics: {e}");
        }
    }
}

/// A virtio balloon.
///
/// ```
/// use ember::devices::virtio::{Balloon, VirtioDevice};
/// let balloon = Balloon::new(0).unwrap();
/// let handle = balloon.handle();
/// handle.set_target_pages(256); // 1 MiB; interrupts the guest once it is active
/// let mut num_pages = [0u8; 4];
/// balloon.read_config(0, &mut num_pages);
/// assert_eq!(u32::from_le_bytes(num_pages), 256);
/// ```
#[derive(Debug)]
pub struct Balloon {
    handle: BalloonHandle,
    acked: u64,
    worker: Option<Worker>,
}

impl Balloon {
    /// A balloon that starts with a target of `target_pages` 4 KiB pages.
    pub fn new(target_pages: u32) -> std::io::Result<Self> {
        let shared = Shared {
            target_pages,
            ..Shared::default()
        };
        Ok(Self {
            handle: BalloonHandle {
                shared: Arc::new(Mutex::new(shared)),
                stats_request: Arc::new(EventFd::new(EFD_NONBLOCK)?),
            },
            acked: 0,
            worker: None,
        })
    }

    /// A handle for the VMM to steer the balloon and read its statistics.
    pub fn handle(&self) -> BalloonHandle {
        self.handle.clone()
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        // inflate, deflate, stats, reporting; the driver only sets up the ones its
        // features call for, and numbers them consecutively.
        &[QUEUE_SIZE; 4]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
            | 1 << VIRTIO_BALLOON_F_STATS_VQ
            | 1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM
            | 1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING
    }

    fn ack_features(&mut self, features: u64) {
        self.acked = features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let s = self.handle.lock();
        let mut c = [0u8; CONFIG_LEN];
        c[CONFIG_NUM_PAGES..CONFIG_NUM_PAGES + 4].copy_from_slice(&s.target_pages.to_le_bytes());
        c[CONFIG_ACTUAL..CONFIG_ACTUAL + 4].copy_from_slice(&s.actual_pages.to_le_bytes());
        read_config_bytes(&c, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` is driver-writable.
        if offset != CONFIG_ACTUAL as u64 || data.len() != 4 {
            log::warn!("{DEVICE}: ignoring config write at {offset:#x}");
            return;
        }
        let mut word = [0u8; 4];
        word.copy_from_slice(data);
        self.handle.lock().actual_pages = u32::from_le_bytes(word);
    }

    fn config_generation(&self) -> u32 {
        self.handle.lock().generation
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        irq: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        let mut roles = vec![Role::Inflate, Role::Deflate];
        if self.acked & 1 << VIRTIO_BALLOON_F_STATS_VQ != 0 {
            roles.push(Role::Stats);
        }
        if self.acked & 1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING != 0 {
            roles.push(Role::Reporting);
        }
        super::check_queues(&queues, roles.len())?;
        let (qs, evts): (Vec<_>, Vec<_>) = queues.into_iter().map(|a| (a.queue, a.evt)).unzip();
        let stats_request = self
            .handle
            .stats_request
            .try_clone()
            .map_err(ActivateError::EventFd)?;
        let stats_fd = stats_request.as_raw_fd();
        let handler = BalloonHandler {
            mem,
            queues: qs,
            roles,
            irq: irq.clone(),
            shared: self.handle.shared.clone(),
            stats_request,
            held_stats: None,
        };
        self.worker = Some(spawn_queue_worker(
            "ember-balloon".into(),
            handler,
            evts,
            Some(stats_fd),
        )?);
        self.handle.lock().irq = Some(irq);
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
        let mut s = self.handle.lock();
        s.irq = None;
        s.actual_pages = 0;
        self.acked = 0;
    }
}

/// What each queue the driver set up is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Inflate,
    Deflate,
    Stats,
    Reporting,
}

/// The balloon's queue work.
pub(crate) struct BalloonHandler {
    mem: GuestMemory,
    queues: Vec<Queue>,
    roles: Vec<Role>,
    irq: VirtioInterrupt,
    shared: Arc<Mutex<Shared>>,
    /// Readable when the VMM asked for statistics; owned here so the fd outlives the loop.
    stats_request: EventFd,
    /// The statistics buffer the driver posted, kept until we want new numbers.
    held_stats: Option<u16>,
}

impl BalloonHandler {
    fn shared(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the device-readable bytes of a chain (bounded).
    fn read_chain(&self, chain: DescriptorChain<&GuestMemory>) -> Vec<u8> {
        let mut out = Vec::new();
        for desc in chain.readable() {
            let n = (desc.len() as usize).min(MAX_BUFFER_BYTES - out.len());
            if n == 0 {
                break;
            }
            let start = out.len();
            out.resize(start + n, 0);
            if self.mem.read_slice(&mut out[start..], desc.addr()).is_err() {
                log::warn!(
                    "{DEVICE}: buffer at {:#x} outside guest memory",
                    desc.addr().0
                );
                out.truncate(start);
                break;
            }
        }
        out
    }

    fn inflate(&self, chain: DescriptorChain<&GuestMemory>) {
        let bytes = self.read_chain(chain);
        let mut pfns: Vec<u64> = bytes
            .chunks_exact(4)
            .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        pfns.sort_unstable();
        pfns.dedup();
        // Coalesce runs of consecutive frames into one madvise each.
        let mut i = 0;
        while i < pfns.len() {
            let start = pfns[i];
            let mut end = start + 1;
            i += 1;
            while i < pfns.len() && pfns[i] == end {
                end += 1;
                i += 1;
            }
            self.discard(
                GuestAddress(start << BALLOON_PAGE_SHIFT),
                (end - start) << BALLOON_PAGE_SHIFT,
            );
        }
    }

    fn report_free_pages(&self, chain: DescriptorChain<&GuestMemory>) {
        // The reported ranges are the (device-writable) descriptors themselves.
        for desc in chain {
            self.discard(desc.addr(), u64::from(desc.len()));
        }
    }

    /// Drops the host pages behind whole 4 KiB pages of `addr..addr+len` that lie in
    /// guest RAM; anything else is guest garbage and is logged and skipped.
    fn discard(&self, addr: GuestAddress, len: u64) {
        let Some(end) = addr.0.checked_add(len) else {
            log::warn!("{DEVICE}: range at {:#x} overflows", addr.0);
            return;
        };
        let mut at = addr.0.next_multiple_of(BALLOON_PAGE_SIZE);
        let end = end - end % BALLOON_PAGE_SIZE;
        while at < end {
            let Some(region) = self.mem.find_region(GuestAddress(at)) else {
                log::warn!("{DEVICE}: page {at:#x} is not guest RAM");
                return;
            };
            let region_end = region.start_addr().0 + region.len();
            let chunk = (end.min(region_end)) - at;
            match self.mem.get_host_address(GuestAddress(at)) {
                Ok(host) => {
                    // SAFETY: `host..host+chunk` lies inside one guest memory region we
                    // map; dropping its pages only makes the guest see zeroes there, which
                    // is what it asked for by giving the pages away.
                    let ret =
                        unsafe { libc::madvise(host.cast(), chunk as usize, libc::MADV_DONTNEED) };
                    if ret != 0 {
                        log::warn!(
                            "{DEVICE}: madvise failed: {}",
                            std::io::Error::last_os_error()
                        );
                    } else {
                        self.shared().discarded_pages += chunk / BALLOON_PAGE_SIZE;
                    }
                }
                Err(e) => log::warn!("{DEVICE}: no host address for {at:#x}: {e}"),
            }
            at += chunk;
        }
    }

    fn record_stats(&mut self, chain: DescriptorChain<&GuestMemory>) {
        let head = chain.head_index();
        let bytes = self.read_chain(chain);
        let entries = bytes
            .chunks_exact(STAT_LEN)
            .map(|c| {
                let tag = u16::from_le_bytes([c[0], c[1]]);
                let mut val = [0u8; 8];
                val.copy_from_slice(&c[2..]);
                (tag, u64::from_le_bytes(val))
            })
            .collect();
        self.shared().stats = Some(BalloonStats { entries });
        // A driver posting a second buffer gets the first one back.
        if let Some(old) = self.held_stats.replace(head) {
            self.give_back_stats(old);
        }
    }

    fn give_back_stats(&mut self, head: u16) {
        let Some(i) = self.roles.iter().position(|r| *r == Role::Stats) else {
            return;
        };
        if return_chain(&mut self.queues[i], &self.mem, &self.irq, DEVICE, head, 0) {
            self.irq.signal_used_queue();
        }
    }
}

impl QueueHandler for BalloonHandler {
    fn process_queue(&mut self, index: usize) {
        let Some(&role) = self.roles.get(index) else {
            return;
        };
        // A local handle (regions are reference-counted) so the chains do not borrow self.
        let mem = self.mem.clone();
        let chains = pop_chains(&mut self.queues[index], &mem, &self.irq, DEVICE);
        let mut returned = false;
        for chain in chains {
            let head = chain.head_index();
            match role {
                Role::Inflate => self.inflate(chain),
                // Pages come back on their own when the guest touches them.
                Role::Deflate => {}
                Role::Reporting => self.report_free_pages(chain),
                Role::Stats => {
                    self.record_stats(chain);
                    continue;
                }
            }
            returned |= return_chain(&mut self.queues[index], &mem, &self.irq, DEVICE, head, 0);
        }
        if returned && super::needs_interrupt(&mut self.queues[index], &mem, DEVICE) {
            self.irq.signal_used_queue();
        }
    }

    fn process_input(&mut self) {
        // The VMM asked for statistics: returning the buffer makes the driver refill it.
        let _ = self.stats_request.read();
        if let Some(head) = self.held_stats.take() {
            self.give_back_stats(head);
        }
    }

    fn wants_input(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::test_utils::*;

    const Q1: u64 = 0x8000;
    const Q2: u64 = 0x1_0000;
    const Q3: u64 = 0x1_8000;

    struct Rig {
        mem: GuestMemory,
        irq: Arc<CountingInterrupt>,
        balloon: Balloon,
    }

    fn rig() -> Rig {
        Rig {
            mem: memory(),
            irq: Arc::new(CountingInterrupt::default()),
            balloon: Balloon::new(0).unwrap(),
        }
    }

    fn handler(rig: &Rig, vqs: &[&TestQueue], roles: &[Role]) -> BalloonHandler {
        BalloonHandler {
            mem: rig.mem.clone(),
            queues: vqs.iter().map(|v| v.create_queue().unwrap()).collect(),
            roles: roles.to_vec(),
            irq: VirtioInterrupt::new(rig.irq.clone()),
            shared: rig.balloon.handle.shared.clone(),
            stats_request: rig.balloon.handle.stats_request.try_clone().unwrap(),
            held_stats: None,
        }
    }

    #[test]
    fn inflated_pages_are_discarded() {
        let rig = rig();
        let inflate = TestQueue::new(&rig.mem, 16);
        let deflate = TestQueue::create(&rig.mem, GuestAddress(Q1), 16);
        let page = DATA_START + 0x10000;
        rig.mem
            .write_slice(&[0xab; 0x3000], GuestAddress(page))
            .unwrap();
        // Three PFNs (two adjacent, given out of order, one duplicated) and one beyond RAM.
        let pfns: [u32; 5] = [
            (page >> 12) as u32 + 1,
            (page >> 12) as u32,
            (page >> 12) as u32,
            (page >> 12) as u32 + 2,
            0xfff_ffff,
        ];
        for (i, p) in pfns.iter().enumerate() {
            rig.mem
                .write_obj(*p, GuestAddress(DATA_START + 4 * i as u64))
                .unwrap();
        }
        add_chain(&inflate, 0, &[r(DATA_START, 20)]);
        let mut h = handler(&rig, &[&inflate, &deflate], &[Role::Inflate, Role::Deflate]);
        h.process_queue(0);
        assert_eq!(used(&inflate), [(0, 0)]);
        assert_eq!(rig.irq.count(), 1);
        let mut back = [0xffu8; 0x3000];
        rig.mem.read_slice(&mut back, GuestAddress(page)).unwrap();
        assert!(back.iter().all(|&b| b == 0), "pages read back as zeroes");
        assert_eq!(rig.balloon.handle().discarded_pages(), 3);
        // A deflate is just acknowledged.
        add_chain(&deflate, 0, &[r(DATA_START, 8)]);
        h.process_queue(1);
        assert_eq!(used(&deflate), [(0, 0)]);
    }

    #[test]
    fn reported_free_ranges_are_discarded_whole_pages_only() {
        let rig = rig();
        let vqs: Vec<_> = [0, Q1, Q2]
            .iter()
            .map(|&a| TestQueue::create(&rig.mem, GuestAddress(a), 16))
            .collect();
        let base = DATA_START + 0x40000;
        rig.mem
            .write_slice(&[0xcd; 0x4000], GuestAddress(base))
            .unwrap();
        // 0x800 into the first page up to the end of the third: only pages 2 and 3 go.
        add_chain(
            &vqs[2],
            0,
            &[w(base + 0x800, 0x2800), w(u64::MAX - 0x10, 0x100)],
        );
        let mut h = handler(
            &rig,
            &[&vqs[0], &vqs[1], &vqs[2]],
            &[Role::Inflate, Role::Deflate, Role::Reporting],
        );
        h.process_queue(2);
        assert_eq!(used(&vqs[2]), [(0, 0)]);
        assert_eq!(byte(&rig.mem, base), 0xcd);
        assert_eq!(byte(&rig.mem, base + 0xfff), 0xcd);
        assert_eq!(byte(&rig.mem, base + 0x1000), 0);
        assert_eq!(byte(&rig.mem, base + 0x2fff), 0);
        assert_eq!(byte(&rig.mem, base + 0x3000), 0xcd);
    }

    #[test]
    fn stats_are_kept_and_the_buffer_returned_on_request() {
        let rig = rig();
        let vqs: Vec<_> = [0, Q1, Q3]
            .iter()
            .map(|&a| TestQueue::create(&rig.mem, GuestAddress(a), 16))
            .collect();
        let mut buf = Vec::new();
        for (tag, val) in [
            (stat::FREE_MEMORY, 1u64 << 30),
            (stat::TOTAL_MEMORY, 2 << 30),
        ] {
            buf.extend_from_slice(&tag.to_le_bytes());
            buf.extend_from_slice(&val.to_le_bytes());
        }
        rig.mem.write_slice(&buf, GuestAddress(DATA_START)).unwrap();
        add_chain(&vqs[2], 0, &[r(DATA_START, buf.len() as u32)]);
        let mut h = handler(
            &rig,
            &[&vqs[0], &vqs[1], &vqs[2]],
            &[Role::Inflate, Role::Deflate, Role::Stats],
        );
        h.process_queue(2);
        let handle = rig.balloon.handle();
        let stats = handle.stats().unwrap();
        assert_eq!(stats.get(stat::FREE_MEMORY), Some(1 << 30));
        assert_eq!(stats.get(stat::TOTAL_MEMORY), Some(2 << 30));
        assert_eq!(stats.get(stat::SWAP_IN), None);
        assert!(used(&vqs[2]).is_empty(), "held until the VMM wants more");
        handle.request_stats();
        h.process_input();
        assert_eq!(used(&vqs[2]), [(0, 0)]);
        assert_eq!(rig.irq.count(), 1);
    }

    #[test]
    fn target_and_actual_go_through_config_space() {
        let mut rig = rig();
        let handle = rig.balloon.handle();
        let gen0 = rig.balloon.config_generation();
        handle.set_target_pages(1000);
        assert_ne!(rig.balloon.config_generation(), gen0);
        let mut word = [0u8; 4];
        rig.balloon.read_config(0, &mut word);
        assert_eq!(u32::from_le_bytes(word), 1000);
        rig.balloon.write_config(4, &600u32.to_le_bytes());
        assert_eq!(handle.actual_pages(), 600);
        rig.balloon.write_config(0, &5u32.to_le_bytes());
        assert_eq!(handle.target_pages(), 1000, "num_pages is read-only");
        // Once active, a new target interrupts the guest.
        handle.lock().irq = Some(VirtioInterrupt::new(rig.irq.clone()));
        handle.set_target_pages(10);
        assert_eq!(rig.irq.count(), 1);
    }
}
