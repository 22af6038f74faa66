//! virtio-balloon (virtio 1.x §5.5): lets the host take guest memory back.
//!
//! - The VMM sets a target ([`BalloonHandle::set_target_pages`]); the driver inflates
//!   (hands pages over, queue 0) or deflates (takes them back, queue 1) towards it and
//!   reports its progress in the `actual` config field.
//! - Inflated pages are dropped from the host with `madvise(MADV_DONTNEED)`; they read
//!   back as zeroes if the guest touches them again. The device keeps the pages it holds
//!   as merged guest-physical ranges ([`BalloonHandle::held`]), its own count beside the
//!   driver's `actual`. Discarded pages are [`Holes`]: their 2 MiB ranges stay off
//!   transparent huge pages until deflated, or the kernel would refill them.
//! - A [`MemoryFence`] (ember's memory committer, `prefault`) may be attached: a
//!   deflate is then acknowledged only once the committer has committed the pages it
//!   returns (the driver must not reuse them before, `VIRTIO_BALLOON_F_MUST_TELL_HOST`),
//!   and while the fence is up, inflated pages are kept rather than discarded.
//! - With `STATS_VQ` the driver keeps one statistics buffer posted; the device holds it and
//!   returns it to ask for fresh numbers ([`BalloonHandle::request_stats`]). The last
//!   report stays readable ([`BalloonHandle::stats`]).
//! - With `PAGE_REPORTING` the driver reports free page ranges, which are discarded the
//!   same way as inflated pages.
//! - Snapshots (`BalloonState`): the target (the user's and the committer's floor),
//!   `actual`, the held ranges, the counters, the last statistics and the config
//!   generation are saved. The statistics buffer the device holds is not returned
//!   first (it would make the driver post a new one at once): like the console's
//!   receive buffers, it is the buffer at the statistics queue's used index, and a
//!   restored device takes it again from there ([`VirtioDevice::holds_buffers`]).

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::ranges::RangeSet;
use crate::vstate::holes::Holes;

use super::worker::{QueueHandler, Worker, spawn_queue_worker};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt,
    pop_chains, read_config_bytes, return_chain,
};

/// The driver must tell the device before it reuses deflated pages.
pub(crate) const VIRTIO_BALLOON_F_MUST_TELL_HOST: u32 = 0;
/// The driver may deflate on its own when the guest runs out of memory.
pub(crate) const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u32 = 2;
/// A statistics queue exists.
pub(crate) const VIRTIO_BALLOON_F_STATS_VQ: u32 = 1;
/// A free page reporting queue exists.
pub(crate) const VIRTIO_BALLOON_F_FREE_PAGE_REPORTING: u32 = 5;

/// Entries per queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// Balloon page frame numbers are in 4 KiB units, whatever the guest's page size.
pub(crate) const BALLOON_PAGE_SHIFT: u32 = 12;
const BALLOON_PAGE_SIZE: u64 = 1 << BALLOON_PAGE_SHIFT;
/// A balloon target that cannot be set, or a saved balloon state that cannot be restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BalloonError {
    /// More than the guest has: the driver would inflate until the guest runs out.
    #[error("a balloon of {} is larger than the guest's memory ({})", size(*.target), size(*.mem))]
    LargerThanMemory {
        /// The target, bytes.
        target: u64,
        /// The guest's memory, bytes.
        mem: u64,
    },
    /// More pages than the 32-bit `num_pages` field can say (16 TiB).
    #[error("a balloon of {} is more than the device can hold (16 TiB)", size(*.0))]
    BeyondDevice(u64),
    /// A saved state lists more held ranges than the device could have made.
    #[error("{0} held ranges")]
    TooManyRanges(usize),
    /// A saved state lists more statistics than the device could have read.
    #[error("too many statistics")]
    TooManyStats,
    /// A saved held range that is not whole pages of guest RAM, in order.
    #[error("held range {start:#x}..{end:#x} is not whole pages of guest RAM in order")]
    HeldRange {
        /// Guest-physical start.
        start: u64,
        /// Guest-physical end.
        end: u64,
    },
    /// A saved statistics buffer head outside the queue.
    #[error("the held statistics buffer is outside its queue")]
    HeldStats,
}

/// `bytes` in MiB when it is whole MiB, else in bytes.
fn size(bytes: u64) -> String {
    if bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

/// The balloon target, in 4 KiB pages (rounded up), of `bytes` in a guest of
/// `mem` bytes. The one rule for every way a target enters (a boot's
/// `--balloon-target`, the control socket's `balloon`): never more than the
/// guest's memory, nor than the device can say.
pub fn target_pages(bytes: u64, mem: u64) -> Result<u32, BalloonError> {
    if bytes > mem {
        return Err(BalloonError::LargerThanMemory { target: bytes, mem });
    }
    u32::try_from(bytes.div_ceil(BALLOON_PAGE_SIZE)).map_err(|_| BalloonError::BeyondDevice(bytes))
}

/// Most bytes read from one inflate/deflate/stats buffer (the Linux driver sends 1 KiB).
const MAX_BUFFER_BYTES: usize = 64 * 1024;
/// Size of one `struct virtio_balloon_stat` (`le16 tag; le64 val`, packed).
const STAT_LEN: usize = 10;
/// Offsets in the configuration space.
const CONFIG_NUM_PAGES: usize = 0;
const CONFIG_ACTUAL: usize = 4;
const CONFIG_LEN: usize = 16;
const DEVICE: &str = "virtio-balloon";

/// The statistics tags (`VIRTIO_BALLOON_S_*`) the tests report.
#[cfg(test)]
mod stat {
    /// Bytes swapped in.
    pub(crate) const SWAP_IN: u16 = 0;
    /// Free memory, bytes.
    pub(crate) const FREE_MEMORY: u16 = 4;
    /// Total memory, bytes.
    pub(crate) const TOTAL_MEMORY: u16 = 5;
}

/// The last statistics report, as (tag, value) pairs in the driver's order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BalloonStats {
    /// Every reported pair.
    pub entries: Vec<(u16, u64)>,
}

impl BalloonStats {
    /// The value reported for `tag`.
    #[cfg(test)]
    fn get(&self, tag: u16) -> Option<u64> {
        self.entries.iter().find(|e| e.0 == tag).map(|e| e.1)
    }
}

/// Where the balloon meets ember's memory committer (`prefault`). Devices hold
/// no memory policy; this hook is how the device asks for one. Addresses are
/// guest-physical, whole 4 KiB pages inside guest RAM.
pub trait MemoryFence: Send + Sync + std::fmt::Debug {
    /// Whether inflated pages are discarded now. False while guest memory is still
    /// being committed: those pages come back on deflate, committed.
    fn discard_inflated(&self) -> bool;
    /// `addr..addr+len` was discarded: it is no longer committed.
    fn discarded(&self, addr: u64, len: u64);
    /// Commits `addr..addr+len` before the guest gets it back (a deflate).
    fn commit(&self, addr: u64, len: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// State shared by the device, its thread and the VMM's handles.
#[derive(Debug, Default)]
struct Shared {
    /// What the driver is asked for: the larger of the user's and the fence's.
    target_pages: u32,
    /// The VMM user's target (command line, control socket).
    user_pages: u32,
    /// The memory committer's: memory not committed yet (`prefault`).
    fence_pages: u32,
    actual_pages: u32,
    generation: u32,
    stats: Option<BalloonStats>,
    /// Set while the device is active, so a new target can interrupt the guest.
    irq: Option<VirtioInterrupt>,
    discarded_pages: u64,
    /// Guest-physical byte ranges the driver has inflated and not deflated (pages in RAM only).
    held: RangeSet,
    fence: Option<Arc<dyn MemoryFence>>,
    /// Pages inflated and deflated so far (a driver's progress, for tests and stats).
    inflated_pages: u64,
    deflated_pages: u64,
    /// The head of the statistics buffer the device holds (the I/O thread's; here so a
    /// snapshot can record it).
    held_stats: Option<u16>,
    /// Offer `FREE_PAGE_REPORTING` (on unless turned off).
    reporting: bool,
    /// The held pages discarded (the device's and the committer's), kept off
    /// huge pages; made from guest memory when a driver first activates.
    holes: Option<Holes>,
}

/// Most held ranges and statistics a [`BalloonState`] may carry (a forged state
/// file cannot make ember allocate without bound).
const MAX_STATE_RANGES: usize = 1 << 20;
const MAX_STATE_STATS: usize = MAX_BUFFER_BYTES / STAT_LEN;

/// A balloon as the user configures it (`--balloon`, `--balloon-target SIZE`,
/// `--balloon-no-reporting`; see [`crate::machine`] for the rule). What it holds once
/// the guest runs is its `BalloonState`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonConfig {
    /// The initial target in bytes (memory the guest gives back); zero: none.
    #[serde(default)]
    pub target_bytes: u64,
    /// Offer free page reporting (the guest's free memory goes back to the host).
    pub free_page_reporting: bool,
}

impl Default for BalloonConfig {
    fn default() -> Self {
        BalloonConfig {
            target_bytes: 0,
            free_page_reporting: true,
        }
    }
}

/// A balloon's state in a snapshot, besides its transport's registers and queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BalloonState {
    /// Whether free page reporting was offered (the driver may have accepted it).
    pub(crate) reporting: bool,
    /// The user's target, pages.
    pub(crate) user_pages: u32,
    /// The memory committer's floor, pages (`--prefault async` not finished).
    pub(crate) fence_pages: u32,
    /// The driver's `actual`.
    pub(crate) actual_pages: u32,
    /// The config generation the driver last saw.
    pub(crate) generation: u32,
    /// Guest-physical byte ranges held in the balloon, merged, ascending.
    pub(crate) held: Vec<(u64, u64)>,
    /// Counters.
    pub(crate) discarded_pages: u64,
    /// Pages inflated so far.
    pub(crate) inflated_pages: u64,
    /// Pages deflated so far.
    pub(crate) deflated_pages: u64,
    /// The last statistics report.
    pub(crate) stats: Option<Vec<(u16, u64)>>,
    /// The head of the statistics buffer the device held (informational and
    /// checked: the restored device takes the buffer at the queue's used index).
    pub(crate) held_stats: Option<u16>,
}

impl BalloonState {
    /// Checks what a state file's checksum cannot: held ranges are whole pages,
    /// ascending, apart, and inside `ram` (guest-physical (start, len) ranges), and
    /// no list is longer than the device could have made.
    pub(crate) fn check(&self, ram: &[(u64, u64)]) -> Result<(), BalloonError> {
        if self.held.len() > MAX_STATE_RANGES {
            return Err(BalloonError::TooManyRanges(self.held.len()));
        }
        if self
            .stats
            .as_ref()
            .is_some_and(|s| s.len() > MAX_STATE_STATS)
        {
            return Err(BalloonError::TooManyStats);
        }
        let mut last_end = 0;
        for &(start, end) in &self.held {
            let in_ram = ram.iter().any(|&(g, len)| start >= g && end <= g + len);
            if start >= end
                || start % BALLOON_PAGE_SIZE != 0
                || end % BALLOON_PAGE_SIZE != 0
                || start < last_end
                || !in_ram
            {
                return Err(BalloonError::HeldRange { start, end });
            }
            last_end = end;
        }
        if self.held_stats.is_some_and(|h| h >= QUEUE_SIZE) {
            return Err(BalloonError::HeldStats);
        }
        Ok(())
    }
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

    /// Asks the guest to hold `pages` 4 KiB pages in the balloon (the user's
    /// target; while memory is being committed the guest may be asked for more).
    pub fn set_target_pages(&self, pages: u32) {
        let mut s = self.lock();
        s.user_pages = pages;
        Self::retarget(&mut s);
    }

    /// The memory committer's floor: `pages` not committed yet, which the guest must
    /// leave in the balloon whatever the user's target.
    pub fn set_fence_pages(&self, pages: u32) {
        let mut s = self.lock();
        s.fence_pages = pages;
        Self::retarget(&mut s);
    }

    fn retarget(s: &mut Shared) {
        let pages = s.user_pages.max(s.fence_pages);
        if s.target_pages == pages {
            return;
        }
        s.target_pages = pages;
        s.generation = s.generation.wrapping_add(1);
        if let Some(irq) = &s.irq {
            irq.signal_config_change();
        }
    }

    /// The user's target (without the committer's floor).
    pub(crate) fn user_target_pages(&self) -> u32 {
        self.lock().user_pages
    }

    /// The memory committer's floor (pages not committed yet).
    pub(crate) fn fence_pages(&self) -> u32 {
        self.lock().fence_pages
    }

    /// The current target (the larger of the user's and the committer's).
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

    /// Asks the guest to hold `bytes` (rounded up to whole 4 KiB pages, at most
    /// what the 32-bit `num_pages` field can say: 16 TiB) in the balloon.
    pub fn set_target_bytes(&self, bytes: u64) {
        let pages = bytes.div_ceil(BALLOON_PAGE_SIZE);
        self.set_target_pages(u32::try_from(pages).unwrap_or(u32::MAX));
    }

    /// Bytes the device itself counts in the balloon (inflated, not deflated, in RAM).
    pub fn held_bytes(&self) -> u64 {
        self.lock().held.total()
    }

    /// The guest-physical ranges held in the balloon, merged.
    pub fn held(&self) -> Vec<(u64, u64)> {
        self.lock().held.iter().collect()
    }

    /// How many merged ranges the balloon's pages make.
    pub fn held_ranges(&self) -> usize {
        self.lock().held.len()
    }

    /// Pages the driver has inflated so far (in RAM; repeats counted).
    pub(crate) fn inflated_pages(&self) -> u64 {
        self.lock().inflated_pages
    }

    /// Pages the driver has deflated so far.
    pub fn deflated_pages(&self) -> u64 {
        self.lock().deflated_pages
    }

    /// The parts of guest-physical `start..end` NOT held in the balloon (at most
    /// `budget` bytes of them): memory the guest may be using.
    pub fn not_held(&self, start: u64, end: u64, budget: u64) -> Vec<(u64, u64)> {
        self.lock().held.gaps(start, end, budget)
    }

    /// Whether a driver has set the device up (features acknowledged, queues live).
    pub fn driver_active(&self) -> bool {
        self.lock().irq.is_some()
    }

    /// Attaches the memory committer (see [`MemoryFence`]).
    pub fn set_fence(&self, fence: Arc<dyn MemoryFence>) {
        self.lock().fence = Some(fence);
    }

    /// Runs `f` on the held ranges (and their [`Holes`], once a driver is
    /// active) with the device's lock held, so no inflate or deflate runs
    /// meanwhile (the committer uses it to release what the balloon holds once
    /// the fence comes down).
    pub(crate) fn with_held<R>(&self, f: impl FnOnce(&RangeSet, Option<&Holes>) -> R) -> R {
        let s = self.lock();
        f(&s.held, s.holes.as_ref())
    }

    /// The latest statistics the driver reported, if any.
    pub fn stats(&self) -> Option<BalloonStats> {
        self.lock().stats.clone()
    }

    /// The balloon's state for a snapshot (take it with the vCPUs paused and the
    /// inflate and deflate queues drained).
    pub(crate) fn state(&self) -> BalloonState {
        let s = self.lock();
        BalloonState {
            reporting: s.reporting,
            user_pages: s.user_pages,
            fence_pages: s.fence_pages,
            actual_pages: s.actual_pages,
            generation: s.generation,
            held: s.held.iter().collect(),
            discarded_pages: s.discarded_pages,
            inflated_pages: s.inflated_pages,
            deflated_pages: s.deflated_pages,
            stats: s.stats.as_ref().map(|st| st.entries.clone()),
            held_stats: s.held_stats,
        }
    }

    /// Asks the driver for fresh statistics (they arrive asynchronously).
    pub fn request_stats(&self) {
        if let Err(e) = self.stats_request.write(1) {
            crate::guest_warn!("{DEVICE}: cannot request statistics: {e}");
        }
    }
}

/// A virtio balloon.
///
/// ```
/// use ember_vmm::devices::virtio::{Balloon, VirtioDevice};
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
        Self::with_shared(Shared {
            target_pages,
            user_pages: target_pages,
            reporting: true,
            ..Shared::default()
        })
    }

    /// A balloon as a snapshot recorded it (`s` passed [`BalloonState::check`]).
    /// Its transport's restore then acknowledges the driver's features and starts
    /// it on its queues; the statistics buffer it held is taken again from there.
    /// No memory committer is attached: the caller attaches one
    /// ([`BalloonHandle::set_fence`]) before lowering the recorded floor.
    pub(crate) fn from_state(s: &BalloonState) -> std::io::Result<Self> {
        let mut held = RangeSet::new();
        for &(start, end) in &s.held {
            held.insert(start, end);
        }
        Self::with_shared(Shared {
            target_pages: s.user_pages.max(s.fence_pages),
            user_pages: s.user_pages,
            fence_pages: s.fence_pages,
            actual_pages: s.actual_pages,
            generation: s.generation,
            stats: s.stats.clone().map(|entries| BalloonStats { entries }),
            discarded_pages: s.discarded_pages,
            held,
            inflated_pages: s.inflated_pages,
            deflated_pages: s.deflated_pages,
            reporting: s.reporting,
            ..Shared::default()
        })
    }

    fn with_shared(shared: Shared) -> std::io::Result<Self> {
        Ok(Self {
            handle: BalloonHandle {
                shared: Arc::new(Mutex::new(shared)),
                stats_request: Arc::new(EventFd::new(EFD_NONBLOCK)?),
            },
            acked: 0,
            worker: None,
        })
    }

    /// Whether the device offers free page reporting (before the driver
    /// negotiates). Off, the guest's free memory stays resident on the host
    /// until the balloon takes it, as with QEMU's and Cloud Hypervisor's
    /// default balloon.
    pub(crate) fn set_free_page_reporting(&mut self, on: bool) {
        self.handle.lock().reporting = on;
    }

    /// The roles of the queues the driver sets up for the features it accepted.
    fn roles(&self) -> Vec<Role> {
        let mut roles = vec![Role::Inflate, Role::Deflate];
        if self.acked & 1 << VIRTIO_BALLOON_F_STATS_VQ != 0 {
            roles.push(Role::Stats);
        }
        if self.acked & 1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING != 0 {
            roles.push(Role::Reporting);
        }
        roles
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
            | 1 << VIRTIO_BALLOON_F_MUST_TELL_HOST
            | 1 << VIRTIO_BALLOON_F_STATS_VQ
            | 1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM
            | u64::from(self.handle.lock().reporting) << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING
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
            crate::guest_warn!("{DEVICE}: ignoring config write at {offset:#x}");
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
        let roles = self.roles();
        super::check_queues(&queues, roles.len())?;
        let (qs, evts): (Vec<_>, Vec<_>) = queues.into_iter().map(|a| (a.queue, a.evt)).unzip();
        let stats_request = self
            .handle
            .stats_request
            .try_clone()
            .map_err(ActivateError::EventFd)?;
        let stats_fd = stats_request.as_raw_fd();
        // Kept across a driver's resets: the advice it holds is for the pages held.
        let holes = self
            .handle
            .lock()
            .holes
            .get_or_insert_with(|| Holes::new(&mem))
            .clone();
        let handler = BalloonHandler {
            holes,
            mem,
            queues: qs,
            roles,
            irq: irq.clone(),
            shared: self.handle.shared.clone(),
            stats_request,
        };
        self.worker = Some(spawn_queue_worker(
            "ember-balloon".into(),
            crate::seccomp::Thread::Balloon,
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
        s.held_stats = None;
        self.acked = 0;
    }

    fn holds_buffers(&self, queue: usize) -> bool {
        self.roles().get(queue) == Some(&Role::Stats)
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
    /// Inflated pages' huge-page advice (`vstate::holes`).
    holes: Holes,
    queues: Vec<Queue>,
    roles: Vec<Role>,
    irq: VirtioInterrupt,
    shared: Arc<Mutex<Shared>>,
    /// Readable when the VMM asked for statistics; owned here so the fd outlives the loop.
    stats_request: EventFd,
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
                crate::guest_warn!(
                    "{DEVICE}: buffer at {:#x} outside guest memory",
                    desc.addr().0
                );
                out.truncate(start);
                break;
            }
        }
        out
    }

    /// The guest-physical byte ranges (merged, inside guest RAM) of the frame numbers
    /// in an inflate or deflate buffer. Frames outside RAM are guest garbage: skipped.
    fn pfn_ranges(&self, chain: DescriptorChain<&GuestMemory>) -> Vec<(u64, u64)> {
        let bytes = self.read_chain(chain);
        let mut pfns: Vec<u64> = bytes
            .chunks_exact(4)
            .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        pfns.sort_unstable();
        pfns.dedup();
        let mut out = Vec::new();
        // Coalesce runs of consecutive frames into one range each.
        let mut i = 0;
        while i < pfns.len() {
            let start = pfns[i];
            let mut end = start + 1;
            i += 1;
            while i < pfns.len() && pfns[i] == end {
                end += 1;
                i += 1;
            }
            let (start, end) = (start << BALLOON_PAGE_SHIFT, end << BALLOON_PAGE_SHIFT);
            // Clip to RAM region by region (a run may straddle the device hole).
            let mut at = start;
            while at < end {
                match self.mem.find_region(GuestAddress(at)) {
                    Some(region) => {
                        let stop = end.min(region.start_addr().0 + region.len());
                        out.push((at, stop));
                        at = stop;
                    }
                    None => {
                        crate::guest_warn!("{DEVICE}: page {at:#x} is not guest RAM");
                        at += BALLOON_PAGE_SIZE;
                    }
                }
            }
        }
        out
    }

    fn inflate(&self, chain: DescriptorChain<&GuestMemory>) {
        let ranges = self.pfn_ranges(chain);
        let fence = self.shared().fence.clone();
        for (start, end) in ranges {
            // Decided under the lock: the committer lowers the fence and then releases
            // what is held under this lock, so a page is either held and released by
            // it, or discarded here.
            let discard = {
                let mut s = self.shared();
                s.held.insert(start, end);
                s.inflated_pages += (end - start) / BALLOON_PAGE_SIZE;
                fence.as_ref().is_none_or(|f| f.discard_inflated())
            };
            if discard {
                // Off huge pages first: khugepaged would refill the holes.
                self.holes.punch(start, end);
                self.discard(GuestAddress(start), end - start);
                if let Some(f) = &fence {
                    f.discarded(start, end - start);
                }
            }
        }
    }

    /// The driver takes pages back: with a fence, they are committed before the
    /// buffer is returned (the driver does not touch them until then).
    fn deflate(&self, chain: DescriptorChain<&GuestMemory>) {
        let ranges = self.pfn_ranges(chain);
        let fence = self.shared().fence.clone();
        for (start, end) in ranges {
            {
                let mut s = self.shared();
                s.held.remove(start, end);
                s.deflated_pages += (end - start) / BALLOON_PAGE_SIZE;
            }
            // Back on huge pages where no hole is left, before they are committed.
            self.holes.give_back(start, end);
            if let Some(f) = &fence {
                if let Err(e) = f.commit(start, end - start) {
                    // Host out of memory: the pages fault in lazily instead.
                    crate::guest_error!(
                        "{DEVICE}: cannot commit deflated pages at {start:#x}: {}",
                        crate::error_chain(&*e)
                    );
                }
            }
        }
    }

    fn report_free_pages(&self, chain: DescriptorChain<&GuestMemory>) {
        // The reported ranges are the (device-writable) descriptors themselves.
        // They are no holes: Linux reports whole 2 MiB blocks (nothing to
        // refill) and reuses them without a word.
        for desc in chain {
            self.discard(desc.addr(), u64::from(desc.len()));
        }
    }

    /// Drops the host pages behind whole 4 KiB pages of `addr..addr+len` that lie in
    /// guest RAM; anything else is guest garbage and is logged and skipped.
    fn discard(&self, addr: GuestAddress, len: u64) {
        // Both ends checked: a range in the last page below 2^64 would round its
        // start up past the top, and a wrapped start of 0 would discard guest RAM
        // from its first byte (the fuzzer's find).
        let (Some(end), Some(mut at)) = (
            addr.0.checked_add(len),
            addr.0.checked_next_multiple_of(BALLOON_PAGE_SIZE),
        ) else {
            crate::guest_warn!("{DEVICE}: range at {:#x} overflows", addr.0);
            return;
        };
        let end = end - end % BALLOON_PAGE_SIZE;
        while at < end {
            let Some(region) = self.mem.find_region(GuestAddress(at)) else {
                crate::guest_warn!("{DEVICE}: page {at:#x} is not guest RAM");
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
                        crate::guest_warn!(
                            "{DEVICE}: madvise failed: {}",
                            std::io::Error::last_os_error()
                        );
                    } else {
                        self.shared().discarded_pages += chunk / BALLOON_PAGE_SIZE;
                    }
                }
                Err(e) => crate::guest_warn!("{DEVICE}: no host address for {at:#x}: {e}"),
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
        // The statistics buffer the driver posted is kept until we want new numbers.
        let old = {
            let mut s = self.shared();
            s.stats = Some(BalloonStats { entries });
            s.held_stats.replace(head)
        };
        // A driver posting a second buffer gets the first one back.
        if let Some(old) = old {
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
                // Without a fence, pages come back on their own when the guest touches them.
                Role::Deflate => self.deflate(chain),
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
        let held = self.shared().held_stats.take();
        if let Some(head) = held {
            self.give_back_stats(head);
        }
    }

    fn wants_input(&self) -> bool {
        true
    }
}

/// For the fuzz target `balloon` (fuzz/, built by scripts/fuzz with `--cfg fuzzing`): the
/// four queues (inflate, deflate, statistics, free-page reporting) served in `order` on
/// arbitrary memory.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queues(
    mem: GuestMemory,
    queues: Vec<Queue>,
    irq: VirtioInterrupt,
    order: &[u8],
) {
    let Ok(balloon) = Balloon::new(16) else {
        return;
    };
    let Ok(stats_request) = balloon.handle.stats_request.try_clone() else {
        return;
    };
    let mut h = BalloonHandler {
        holes: Holes::default(),
        mem,
        queues,
        roles: vec![Role::Inflate, Role::Deflate, Role::Stats, Role::Reporting],
        irq,
        shared: balloon.handle.shared.clone(),
        stats_request,
    };
    for &q in order.iter().take(8) {
        h.process_queue(usize::from(q % 4));
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

    #[test]
    fn a_target_is_at_most_the_guests_memory_and_what_the_device_can_say() {
        const M: u64 = 1 << 20;
        assert_eq!(target_pages(64 * M, 64 * M), Ok(16384));
        assert_eq!(target_pages(1, 64 * M), Ok(1), "rounded up to a page");
        assert_eq!(
            target_pages(64 * M + 1, 64 * M),
            Err(BalloonError::LargerThanMemory {
                target: 64 * M + 1,
                mem: 64 * M
            })
        );
        let t = 16u64 << 40;
        assert_eq!(target_pages(t, t), Err(BalloonError::BeyondDevice(t)));
        assert_eq!(
            BalloonError::LargerThanMemory {
                target: 1 << 40,
                mem: 64 * M
            }
            .to_string(),
            "a balloon of 1048576 MiB is larger than the guest's memory (64 MiB)"
        );
    }

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
            holes: Holes::default(),
            mem: rig.mem.clone(),
            queues: vqs.iter().map(|v| v.create_queue().unwrap()).collect(),
            roles: roles.to_vec(),
            irq: VirtioInterrupt::new(rig.irq.clone()),
            shared: rig.balloon.handle.shared.clone(),
            stats_request: rig.balloon.handle.stats_request.try_clone().unwrap(),
        }
    }

    #[test]
    fn free_page_reporting_is_offered_unless_turned_off() {
        let mut b = Balloon::new(0).unwrap();
        let bit = 1u64 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING;
        assert_ne!(b.avail_features() & bit, 0);
        b.set_free_page_reporting(false);
        assert_eq!(b.avail_features() & bit, 0);
        // Everything else stays offered.
        assert_ne!(b.avail_features() & 1 << VIRTIO_BALLOON_F_STATS_VQ, 0);
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
        rig.mem
            .write_slice(&[0xcd; 0x1000], GuestAddress(0))
            .unwrap();
        // 0x800 into the first page up to the end of the third: only pages 2 and 3 go.
        // Then two ranges at the top of the address space: one whose end overflows,
        // one whose start, rounded up to a page, would (it wrapped to 0 and took
        // guest RAM from its first page with it).
        add_chain(
            &vqs[2],
            0,
            &[
                w(base + 0x800, 0x2800),
                w(u64::MAX - 0x10, 0x100),
                w(u64::MAX - 0x800, 0x10),
            ],
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
        assert_eq!(byte(&rig.mem, 0), 0xcd);
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

    /// Inflate and statistics buffers whose descriptors claim 3 MiB (inside RAM) and
    /// 0xFFFF_FFFF bytes: what is read from them is capped at `MAX_BUFFER_BYTES`, so no
    /// host buffer grows with the guest's lengths (the frame-number list is twice the bytes
    /// read: 4-byte frame numbers become 8-byte ones).
    #[test]
    fn buffer_lengths_from_the_guest_do_not_size_host_buffers() {
        let rig = rig();
        let vqs: Vec<_> = [0, Q1, Q3]
            .iter()
            .map(|&a| TestQueue::create(&rig.mem, GuestAddress(a), 16))
            .collect();
        // Frame numbers of the last page of RAM, far from the rings.
        let last_pfn = ((MEM_SIZE as u64 >> BALLOON_PAGE_SHIFT) - 1) as u32;
        let pfns: Vec<u8> = std::iter::repeat_n(last_pfn.to_le_bytes(), MAX_BUFFER_BYTES / 4)
            .flatten()
            .collect();
        rig.mem
            .write_slice(&pfns, GuestAddress(DATA_START))
            .unwrap();
        add_chain(&vqs[0], 0, &[r(DATA_START, 3 << 20)]);
        add_chain(&vqs[0], 1, &[r(DATA_START, u32::MAX)]);
        add_chain(&vqs[2], 0, &[r(DATA_START, 3 << 20)]);
        let mut h = handler(
            &rig,
            &[&vqs[0], &vqs[1], &vqs[2]],
            &[Role::Inflate, Role::Deflate, Role::Stats],
        );
        reset_largest_allocation();
        h.process_queue(0);
        h.process_queue(2);
        let largest = largest_allocation();
        assert_eq!(used(&vqs[0]), [(0, 0), (1, 0)]);
        assert!(
            largest <= 2 * MAX_BUFFER_BYTES,
            "a guest buffer length sized a host allocation of {largest} bytes"
        );
        assert!(rig.balloon.handle().stats().is_some(), "statistics read");
        let last = MEM_SIZE as u64 - BALLOON_PAGE_SIZE;
        assert_eq!(
            rig.balloon.handle().held(),
            [(last, last + BALLOON_PAGE_SIZE)]
        );
    }

    /// A balloon that inflated, reported statistics and holds their buffer, saved
    /// and rebuilt from its state: the same state, the same config space, and the
    /// restored device, started on the queues where the snapshot left them, takes
    /// the held statistics buffer again and returns it on request.
    #[test]
    fn state_round_trips_and_the_held_stats_buffer_is_taken_again() {
        let rig = rig();
        let vqs: Vec<_> = [0, Q1, Q3]
            .iter()
            .map(|&a| TestQueue::create(&rig.mem, GuestAddress(a), 16))
            .collect();
        let page = DATA_START + 0x10000;
        let pfns: Vec<u8> = [page >> 12, (page >> 12) + 1, (page >> 12) + 5]
            .iter()
            .flat_map(|&p| (p as u32).to_le_bytes())
            .collect();
        rig.mem
            .write_slice(&pfns, GuestAddress(DATA_START))
            .unwrap();
        add_chain(&vqs[0], 0, &[r(DATA_START, 12)]);
        let stats_at = DATA_START + 0x100;
        let mut buf = stat::FREE_MEMORY.to_le_bytes().to_vec();
        buf.extend_from_slice(&(7u64 << 20).to_le_bytes());
        rig.mem.write_slice(&buf, GuestAddress(stats_at)).unwrap();
        add_chain(&vqs[2], 3, &[r(stats_at, buf.len() as u32)]);
        let roles = [Role::Inflate, Role::Deflate, Role::Stats];
        let mut h = handler(&rig, &[&vqs[0], &vqs[1], &vqs[2]], &roles);
        h.process_queue(0);
        h.process_queue(2);
        let handle = rig.balloon.handle();
        handle.set_target_pages(40);
        handle.set_fence_pages(90);
        let mut b = rig.balloon;
        b.set_free_page_reporting(false);
        b.write_config(4, &3u32.to_le_bytes());
        let saved = handle.state();
        assert_eq!(
            saved.held,
            [(page, page + 0x2000), (page + 0x5000, page + 0x6000)]
        );
        assert_eq!(saved.held_stats, Some(3));
        assert_eq!(
            (saved.user_pages, saved.fence_pages, saved.actual_pages),
            (40, 90, 3)
        );
        assert!(!saved.reporting);
        assert_eq!(saved.stats, Some(vec![(stat::FREE_MEMORY, 7 << 20)]));
        assert_eq!(saved.inflated_pages, 3);

        // Through the state file's encoding and back.
        let json = serde_json::to_vec(&saved).unwrap();
        let restored = Balloon::from_state(&serde_json::from_slice(&json).unwrap()).unwrap();
        let back = restored.handle();
        let mut want = saved.clone();
        // Held by the old I/O thread; the new one takes it again below.
        want.held_stats = None;
        assert_eq!(back.state(), want);
        assert_eq!(
            back.target_pages(),
            90,
            "the committer's floor still applies"
        );
        assert_eq!(restored.avail_features(), b.avail_features());
        for off in [0, 4] {
            let (mut x, mut y) = ([0u8; 4], [0u8; 4]);
            b.read_config(off, &mut x);
            restored.read_config(off, &mut y);
            assert_eq!(x, y, "config offset {off}");
        }
        assert_eq!(restored.config_generation(), b.config_generation());

        // The restored device starts where the transport puts it: each queue at
        // its used index, where the held statistics buffer still waits.
        let irq = Arc::new(CountingInterrupt::default());
        let mut h2 = BalloonHandler {
            holes: Holes::default(),
            mem: rig.mem.clone(),
            queues: vqs.iter().map(|v| v.create_queue().unwrap()).collect(),
            roles: roles.to_vec(),
            irq: VirtioInterrupt::new(irq.clone()),
            shared: restored.handle.shared.clone(),
            stats_request: restored.handle.stats_request.try_clone().unwrap(),
        };
        h2.process_queue(2);
        assert_eq!(back.state().held_stats, Some(3));
        assert!(used(&vqs[2]).is_empty(), "still held");
        back.request_stats();
        h2.process_input();
        assert_eq!(used(&vqs[2]), [(3, 0)]);
        assert_eq!(irq.count(), 1);
        // Deflating what the old device held leaves the restored one holding the rest.
        rig.mem
            .write_obj((page >> 12) as u32, GuestAddress(DATA_START))
            .unwrap();
        add_chain(&vqs[1], 0, &[r(DATA_START, 4)]);
        h2.process_queue(1);
        assert_eq!(
            back.held(),
            [
                (page + 0x1000, page + 0x2000),
                (page + 0x5000, page + 0x6000)
            ]
        );
    }

    /// A VM snapshotted while `--prefault async` was still committing, restored:
    /// its RAM is the snapshot's memory file mapped privately, the floor comes
    /// down at once (the target is the user's again), and every page the driver
    /// deflates is committed (resident, a private copy) before its deflate is
    /// acknowledged; the pages still in the balloon stay uncommitted.
    #[test]
    fn a_restored_fence_commits_each_deflated_page_before_the_guest_gets_it() {
        let scratch = ember_testing::TempDir::new("fence");
        let file = scratch.join("memory");
        // A sparse file: what the guest never wrote (the fenced pages) is a hole.
        std::fs::File::create(&file)
            .unwrap()
            .set_len(MEM_SIZE as u64)
            .unwrap();
        let mem = crate::snapshot::memory::map_private(&file, MEM_SIZE as u64).unwrap();
        std::fs::remove_dir_all(&scratch).unwrap();
        let page = DATA_START + 0x10_0000;
        let held = (page, page + 16 * BALLOON_PAGE_SIZE);
        let restored = Balloon::from_state(&BalloonState {
            reporting: false,
            user_pages: 2,
            fence_pages: 16,
            actual_pages: 16,
            generation: 1,
            held: vec![held],
            discarded_pages: 0,
            inflated_pages: 16,
            deflated_pages: 0,
            stats: None,
            held_stats: None,
        })
        .unwrap();
        let handle = restored.handle();
        assert_eq!(handle.target_pages(), 16);
        crate::snapshot::restore::restore_fence(&handle, &mem);
        assert_eq!(handle.target_pages(), 2, "the floor came down");
        assert_eq!(handle.fence_pages(), 0);

        let inflate = TestQueue::new(&mem, 16);
        let deflate = TestQueue::create(&mem, GuestAddress(Q1), 16);
        let pfns: Vec<u8> = (0..14u64)
            .flat_map(|i| (((page >> 12) + i) as u32).to_le_bytes())
            .collect();
        mem.write_slice(&pfns, GuestAddress(DATA_START)).unwrap();
        add_chain(&deflate, 0, &[r(DATA_START, pfns.len() as u32)]);
        let irq = Arc::new(CountingInterrupt::default());
        let mut h = BalloonHandler {
            holes: Holes::default(),
            mem: mem.clone(),
            queues: vec![
                inflate.create_queue().unwrap(),
                deflate.create_queue().unwrap(),
            ],
            roles: vec![Role::Inflate, Role::Deflate],
            irq: VirtioInterrupt::new(irq.clone()),
            shared: restored.handle.shared.clone(),
            stats_request: restored.handle.stats_request.try_clone().unwrap(),
        };
        // Committed = a private copy: present in pagemap and not a page of the
        // file (mincore cannot tell: the file's page cache, read ahead around
        // what the test wrote, counts as resident).
        let private = |a: u64, pages: u64| -> bool {
            use std::os::unix::fs::FileExt;
            let host = mem.get_host_address(GuestAddress(a)).unwrap() as u64;
            let pm = std::fs::File::open("/proc/self/pagemap").unwrap();
            (0..pages).all(|i| {
                let mut e = [0u8; 8];
                pm.read_exact_at(&mut e, (host / BALLOON_PAGE_SIZE + i) * 8)
                    .unwrap();
                let e = u64::from_le_bytes(e);
                e & 1 << 63 != 0 && e & 1 << 61 == 0
            })
        };
        assert!(!private(page, 1));
        h.process_queue(1);
        assert_eq!(used(&deflate), [(0, 0)]);
        let given_back = 14 * BALLOON_PAGE_SIZE;
        assert!(
            private(page, 14),
            "a deflated page was handed back uncommitted"
        );
        // The two pages still held were not committed.
        assert!(!private(page + given_back, 1));
        assert_eq!(handle.held(), [(page + given_back, held.1)]);
    }

    /// The statistics queue is the one whose buffers the balloon holds (queue 2 when
    /// the driver accepted `STATS_VQ`), so a snapshot does not wait for it to drain.
    #[test]
    fn only_the_statistics_queue_holds_buffers() {
        let mut b = Balloon::new(0).unwrap();
        b.ack_features(1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING);
        assert!((0..4).all(|q| !b.holds_buffers(q)));
        b.ack_features(1 << VIRTIO_BALLOON_F_STATS_VQ | 1 << VIRTIO_BALLOON_F_FREE_PAGE_REPORTING);
        assert_eq!(
            (0..4).map(|q| b.holds_buffers(q)).collect::<Vec<_>>(),
            [false, false, true, false]
        );
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
        // The memory committer's floor wins while it is higher than the user's target.
        handle.set_fence_pages(500);
        assert_eq!(
            (handle.target_pages(), handle.user_target_pages()),
            (500, 10)
        );
        handle.set_target_pages(700);
        assert_eq!(handle.target_pages(), 700);
        handle.set_target_pages(20);
        handle.set_fence_pages(0);
        assert_eq!(handle.target_pages(), 20);
        assert_eq!(rig.irq.count(), 5);
        // An unchanged target does not interrupt.
        handle.set_target_pages(20);
        assert_eq!(rig.irq.count(), 5);
    }
}
