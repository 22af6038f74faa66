//! virtio-mem (virtio 1.2 §5.15): memory the guest plugs block by block.
//!
//! - The VMM reserves a region of guest-physical space above RAM (one KVM
//!   memory slot for all of it, lazily backed like RAM) and tells the device
//!   where it is; the guest's e820 map and ACPI tables do not describe it, so
//!   the guest boots with its boot RAM only and its `virtio_mem` driver adds
//!   the rest, as it is plugged.
//! - The VMM sets a requested size ([`MemHandle::set_requested`]; a config
//!   change interrupt tells the driver), and the driver plugs (or unplugs)
//!   blocks towards it. The protocol itself is `protocol`, a pure state
//!   machine; this module is its queue, its config space and its handle.
//! - With `--prefault async` the VMM's committer raises the committed part of
//!   the region as it commits it ([`MemHandle::set_committed`]): the driver is
//!   never asked for more than is committed, and a plug of a block past it is
//!   refused. Without, the whole region counts as committed (lazily backed).
//! - Unplugged blocks are discarded (`MADV_DONTNEED`): host memory falls.
//!   With `--prefault` ([`MemHandle::keep_committed`]) a discarded block is
//!   committed again before a plug of it is acknowledged: plugged memory is
//!   committed memory, the first time or the tenth.
//! - Snapshots carry the plugged bitmap and the sizes (`MemState`).

pub(crate) mod protocol;

use std::io::{Read, Write};
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_queue::{DescriptorChain, Queue, Reader, Writer};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use self::protocol::{Blocks, REQ_LEN, Request, Response};
use super::worker::{QueueHandler, Worker, activate_single_queue};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt,
    read_config_bytes, serve_queue,
};
use crate::ranges::RangeSet;

/// `VIRTIO_ID_MEM`.
pub(crate) const VIRTIO_ID_MEM: u32 = 24;
/// Entries in the request queue.
pub(crate) const QUEUE_SIZE: u16 = 128;
/// The default block: x86's page block, the smallest Linux plugs.
pub const DEFAULT_BLOCK_SIZE: u64 = 2 << 20;
/// Where the region starts and what its size is a multiple of: Linux adds
/// memory in 128 MiB memory blocks, and a region not aligned to them loses
/// its ragged ends.
pub const REGION_ALIGN: u64 = 128 << 20;
/// The most descriptors a request chain may have (Linux sends two).
const MAX_REQUEST_DESCRIPTORS: usize = 16;
const CONFIG_LEN: usize = 56;
const DEVICE: &str = "virtio-mem";

/// virtio-mem configuration and resize errors.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MemError {
    /// Not `SIZE[,block=SIZE]`.
    #[error("`{0}` is not a virtio-mem region (SIZE[,block=SIZE])")]
    Parse(String),
    /// A block size that is not a power of two of at least 2 MiB.
    #[error("a virtio-mem block of {0} bytes (a power of two, at least 2 MiB)")]
    BlockSize(u64),
    /// A region that is not whole 128 MiB memory blocks, or empty.
    #[error("a virtio-mem region of {0} bytes (whole multiples of 128 MiB)")]
    RegionSize(u64),
    /// A requested size past the region.
    #[error("{asked} bytes requested of a {region}-byte virtio-mem region")]
    TooLarge {
        /// Asked for.
        asked: u64,
        /// The region.
        region: u64,
    },
    /// A saved state that the device could not have made.
    #[error("a virtio-mem state that does not fit its region")]
    BadState,
}

/// A virtio-mem region as the user configures it (`--mem SIZE --mem-boot
/// BOOT` makes one of `SIZE - BOOT`; see [`crate::machine`] for the rule).
/// Where it sits is the device manager's choice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemConfig {
    /// Bytes of the region (hot-pluggable memory beyond the boot RAM).
    pub size: u64,
    /// Bytes per block.
    pub block_size: u64,
}

impl MemConfig {
    /// A region of `size` bytes in default blocks, checked.
    pub fn new(size: u64) -> Result<Self, MemError> {
        let c = MemConfig {
            size,
            block_size: DEFAULT_BLOCK_SIZE,
        };
        c.check()?;
        Ok(c)
    }

    /// Whether the sizes are ones the device can offer.
    pub fn check(&self) -> Result<(), MemError> {
        if !self.block_size.is_power_of_two()
            || self.block_size < DEFAULT_BLOCK_SIZE
            || self.block_size > REGION_ALIGN
        {
            return Err(MemError::BlockSize(self.block_size));
        }
        if self.size == 0 || self.size % REGION_ALIGN != 0 {
            return Err(MemError::RegionSize(self.size));
        }
        Ok(())
    }
}

impl FromStr for MemConfig {
    type Err = MemError;

    /// Parses `SIZE[,block=SIZE]`.
    fn from_str(s: &str) -> Result<Self, MemError> {
        let bad = || MemError::Parse(s.to_owned());
        let size = |v: &str| crate::vstate::memory::parse_size(v).map_err(|_| bad());
        let mut parts = s.split(',');
        let mut c = MemConfig::new(size(parts.next().ok_or_else(bad)?)?)?;
        for p in parts {
            match p.split_once('=') {
                Some(("block", v)) => c.block_size = size(v)?,
                _ => return Err(bad()),
            }
        }
        c.check()?;
        Ok(c)
    }
}

/// A virtio-mem device's state in a snapshot, besides its transport's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MemState {
    /// The region, the plugged bitmap and the sizes.
    pub(crate) blocks: Blocks,
    /// The config generation the driver last saw.
    pub(crate) generation: u32,
}

impl MemState {
    /// Checks what a state file's checksum cannot.
    pub(crate) fn check(&self, config: &MemConfig, addr: u64) -> Result<(), MemError> {
        let b = &self.blocks;
        if !b.check()
            || b.addr != addr
            || b.block_size != config.block_size
            || b.region_size() != config.size
        {
            return Err(MemError::BadState);
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Shared {
    blocks: Blocks,
    generation: u32,
    /// Set while the device is active, so a resize can interrupt the guest.
    irq: Option<VirtioInterrupt>,
    /// Bytes discarded on the host so far.
    discarded: u64,
    /// With `--prefault`: the region's ranges an unplug discarded and no plug
    /// has committed again (guest-physical). `None`: lazily backed.
    stale: Option<RangeSet>,
}

/// The VMM's remote control for a virtio-mem device (cheap to clone).
#[derive(Debug, Clone)]
pub struct MemHandle {
    shared: Arc<Mutex<Shared>>,
    /// Notified when a driver sets the device up (DRIVER_OK).
    bound: Arc<Condvar>,
}

impl MemHandle {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes what the driver sees after `f`, telling it when the requested
    /// size moved.
    fn update(&self, f: impl FnOnce(&mut Blocks)) {
        let mut s = self.lock();
        let before = s.blocks.requested_size();
        f(&mut s.blocks);
        if s.blocks.requested_size() != before {
            s.generation = s.generation.wrapping_add(1);
            if let Some(irq) = &s.irq {
                irq.signal_config_change();
            }
        }
    }

    /// Asks the driver to have `bytes` of the region plugged (rounded up to
    /// whole blocks).
    pub fn set_requested(&self, bytes: u64) -> Result<(), MemError> {
        let region = self.region_size();
        if bytes > region {
            return Err(MemError::TooLarge {
                asked: bytes,
                region,
            });
        }
        self.update(|b| b.user = bytes.next_multiple_of(b.block_size));
        Ok(())
    }

    /// The first `bytes` of the region are committed on the host (the
    /// committer's progress): the driver may be asked for them.
    pub fn set_committed(&self, bytes: u64) {
        self.update(|b| b.committed = bytes.min(b.region_size()));
    }

    /// Plugged memory is to be committed memory (`--prefault`): a block an
    /// unplug discarded is committed again before its next plug is
    /// acknowledged.
    pub fn keep_committed(&self) {
        let mut s = self.lock();
        if s.stale.is_none() {
            s.stale = Some(RangeSet::new());
        }
    }

    /// A restored VM with `--prefault`: as [`Self::keep_committed`], and
    /// every block not plugged now counts as discarded (the memory file
    /// backs it, nothing committed it), so a plug of it commits it first.
    /// The plugged blocks are the committer's ([`Self::with_plugged`]).
    pub(crate) fn keep_committed_restored(&self) {
        let mut s = self.lock();
        let (addr, size) = (s.blocks.addr, s.blocks.region_size());
        let mut stale = RangeSet::new();
        stale.insert(addr, addr + size);
        for (a, z) in s.blocks.plugged_ranges() {
            stale.remove(a, z);
        }
        s.stale = Some(stale);
    }

    /// Runs `f` on the plugged parts of guest-physical `start..end` with no
    /// request answered meanwhile: a block `f` commits cannot be unplugged
    /// (and discarded) under it.
    pub(crate) fn with_plugged<R>(
        &self,
        start: u64,
        end: u64,
        f: impl FnOnce(&[(u64, u64)]) -> R,
    ) -> R {
        let s = self.lock();
        let parts: Vec<(u64, u64)> = s
            .blocks
            .plugged_ranges()
            .into_iter()
            .filter_map(|(a, z)| {
                let (a, z) = (a.max(start), z.min(end));
                (a < z).then_some((a, z))
            })
            .collect();
        f(&parts)
    }

    /// Bytes of the region.
    pub fn region_size(&self) -> u64 {
        self.lock().blocks.region_size()
    }

    /// Guest-physical start of the region.
    pub fn addr(&self) -> u64 {
        self.lock().blocks.addr
    }

    /// What the driver is asked to have plugged.
    pub fn requested_bytes(&self) -> u64 {
        self.lock().blocks.requested_size()
    }

    /// The user's requested size (before the committed part bounds it).
    pub fn user_requested_bytes(&self) -> u64 {
        self.lock().blocks.user
    }

    /// What the driver has plugged.
    pub fn plugged_bytes(&self) -> u64 {
        self.lock().blocks.plugged_size()
    }

    /// Plugged blocks as merged guest-physical ranges.
    pub fn plugged_ranges(&self) -> Vec<(u64, u64)> {
        self.lock().blocks.plugged_ranges()
    }

    /// Bytes discarded on the host by unplugs so far.
    pub fn discarded_bytes(&self) -> u64 {
        self.lock().discarded
    }

    /// Whether a driver has the device up.
    pub fn driver_active(&self) -> bool {
        self.lock().irq.is_some()
    }

    /// Waits until a driver has the device up (its DRIVER_OK: the guest's
    /// driver is bound and reads the requested size from then on). Returns
    /// false, without waiting further, once this handle is the device's last
    /// (the VM is gone and no driver can come).
    pub fn wait_for_driver(&self) -> bool {
        let mut s = self.lock();
        while s.irq.is_none() {
            if Arc::strong_count(&self.shared) == 1 {
                return false;
            }
            // (Timed: the VM's end notifies no one.)
            s = self
                .bound
                .wait_timeout(s, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// The state for a snapshot (the VM paused, the queue drained).
    pub(crate) fn state(&self) -> MemState {
        let s = self.lock();
        MemState {
            blocks: s.blocks.clone(),
            generation: s.generation,
        }
    }
}

/// A virtio-mem device.
#[derive(Debug)]
pub struct VirtioMem {
    handle: MemHandle,
    worker: Option<Worker>,
}

impl VirtioMem {
    /// A device for a region of `config` at guest-physical `addr`; nothing
    /// requested or committed yet.
    pub fn new(config: &MemConfig, addr: u64) -> Result<Self, MemError> {
        config.check()?;
        if addr % REGION_ALIGN != 0 {
            return Err(MemError::BadState);
        }
        let blocks = Blocks::new(addr, config.block_size, config.size / config.block_size);
        Ok(Self::with(blocks, 0))
    }

    /// A device as a snapshot recorded it (`s` passed [`MemState::check`]).
    pub(crate) fn from_state(s: &MemState) -> Self {
        Self::with(s.blocks.clone(), s.generation)
    }

    fn with(blocks: Blocks, generation: u32) -> Self {
        VirtioMem {
            handle: MemHandle {
                shared: Arc::new(Mutex::new(Shared {
                    blocks,
                    generation,
                    irq: None,
                    discarded: 0,
                    stale: None,
                })),
                bound: Arc::new(Condvar::new()),
            },
            worker: None,
        }
    }

    /// The VMM's control.
    pub fn handle(&self) -> MemHandle {
        self.handle.clone()
    }
}

impl VirtioDevice for VirtioMem {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_MEM
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn ack_features(&mut self, _features: u64) {}

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let s = self.handle.lock();
        let b = &s.blocks;
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |at: usize, v: u64| c[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put(0, b.block_size);
        // node_id and padding (8..16) stay zero: no ACPI_PXM.
        put(16, b.addr);
        put(24, b.region_size());
        // usable_region_size: all of it.
        put(32, b.region_size());
        put(40, b.plugged_size());
        put(48, b.requested_size());
        read_config_bytes(&c, offset, data);
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
        let shared = self.handle.shared.clone();
        let irq2 = irq.clone();
        self.worker = Some(activate_single_queue(
            "ember-mem",
            crate::seccomp::Thread::Mem,
            queues,
            |queue| MemHandler {
                mem,
                queue,
                irq: irq2,
                shared,
            },
        )?);
        self.handle.lock().irq = Some(irq);
        self.handle.bound.notify_all();
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
        // The plugged blocks stay: a driver that comes back (a rebooted
        // guest) finds plugged_size and unplugs all first, as Linux does.
        self.handle.lock().irq = None;
    }
}

/// Answers plug, unplug and state requests.
pub(crate) struct MemHandler {
    mem: GuestMemory,
    queue: Queue,
    irq: VirtioInterrupt,
    shared: Arc<Mutex<Shared>>,
}

impl MemHandler {
    /// Handles one request chain; returns the used length.
    fn handle(
        mem: &GuestMemory,
        shared: &Mutex<Shared>,
        chain: DescriptorChain<&GuestMemory>,
    ) -> u32 {
        if chain.clone().take(MAX_REQUEST_DESCRIPTORS + 1).count() > MAX_REQUEST_DESCRIPTORS {
            crate::guest_warn!(
                "{DEVICE}: request of more than {MAX_REQUEST_DESCRIPTORS} descriptors dropped"
            );
            return 0;
        }
        // A request without room for its answer is not carried out: the
        // driver could not learn what became of it.
        let Some(mut writer) = Writer::<()>::new(mem, chain.clone())
            .ok()
            .filter(|w| w.available_bytes() >= protocol::RESP_LEN)
        else {
            crate::guest_warn!("{DEVICE}: no room for the response; request dropped");
            return 0;
        };
        let mut raw = [0u8; REQ_LEN];
        let read = Reader::<()>::new(mem, chain)
            .ok()
            .and_then(|mut r| r.read_exact(&mut raw).ok());
        let resp = match read {
            Some(()) => Self::answer(mem, shared, Request::parse(&raw)),
            None => {
                crate::guest_warn!("{DEVICE}: short or unreadable request");
                Response::Error
            }
        };
        match writer.write_all(&resp.encode()) {
            Ok(()) => protocol::RESP_LEN as u32,
            Err(_) => {
                crate::guest_warn!("{DEVICE}: the response could not be written");
                0
            }
        }
    }

    fn answer(mem: &GuestMemory, shared: &Mutex<Shared>, req: Request) -> Response {
        let mut freed = Vec::new();
        let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
        let resp = s.blocks.handle(req, &mut freed);
        if resp == Response::Error {
            crate::guest_warn!("{DEVICE}: refused {req:?}");
        }
        // Committed again before the driver learns it may use the blocks.
        if let (Response::Ack, Request::Plug { addr, nb_blocks }) = (resp, req) {
            let end = addr + u64::from(nb_blocks) * s.blocks.block_size;
            if let Some(stale) = &mut s.stale {
                recommit(mem, stale, addr, end);
            }
        }
        // Discarded before the next request (this thread's) can plug them again.
        for (start, end) in freed {
            if discard(mem, start, end) {
                s.discarded += end - start;
                if let Some(stale) = &mut s.stale {
                    stale.insert(start, end);
                }
            }
        }
        resp
    }
}

/// Commits the parts of guest-physical `start..end` in `stale` and takes
/// them out of it. A failure (the host out of memory) is said and the rest
/// left to fault in lazily, as the committer does.
fn recommit(mem: &GuestMemory, stale: &mut RangeSet, start: u64, end: u64) {
    let parts: Vec<(u64, u64)> = stale
        .iter()
        .filter_map(|(s, e)| {
            let (s, e) = (s.max(start), e.min(end));
            (s < e).then_some((s, e))
        })
        .collect();
    for (s, e) in parts {
        stale.remove(s, e);
        let host = mem
            .find_region(GuestAddress(s))
            .filter(|r| e <= r.start_addr().0 + r.len())
            .and_then(|_| mem.get_host_address(GuestAddress(s)).ok());
        let Some(host) = host else { continue };
        if let Err(e) = crate::vstate::memory::populate(host as u64, e - s) {
            crate::guest_warn!("{DEVICE}: cannot commit {s:#x} again: {e}");
        }
    }
}

/// Drops guest-physical `start..end` from the host (`MADV_DONTNEED`: private
/// memory reads back as zeroes, a restored VM's as its memory file). Returns
/// whether it was guest memory.
fn discard(mem: &GuestMemory, start: u64, end: u64) -> bool {
    let Some(region) = mem.find_region(GuestAddress(start)) else {
        return false;
    };
    if end > region.start_addr().0 + region.len() {
        return false;
    }
    let Ok(host) = mem.get_host_address(GuestAddress(start)) else {
        return false;
    };
    let len = (end - start) as usize;
    // SAFETY: `host..host+(end-start)` lies inside one region vm-memory keeps
    // mapped as long as `mem`; the driver gave these blocks up, so no guest
    // data lives there, and DONTNEED changes no Rust-visible invariant (the
    // pages read back as zeroes or the file's).
    let mut rc = unsafe { libc::madvise(host.cast(), len, libc::MADV_DONTNEED) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // Locked memory (`--mem-lock`) cannot be discarded: unlocked for
        // the discard, then locked again on fault, so a block plugged
        // again is locked as the guest commits it.
        // SAFETY: the same range as above; locking changes residency only.
        rc = unsafe {
            libc::munlock(host.cast(), len);
            let rc = libc::madvise(host.cast(), len, libc::MADV_DONTNEED);
            libc::mlock2(host.cast(), len, libc::MLOCK_ONFAULT);
            rc
        };
    }
    if rc != 0 {
        crate::guest_warn!(
            "{DEVICE}: cannot discard {start:#x}..{end:#x}: {}",
            std::io::Error::last_os_error()
        );
        return false;
    }
    true
}

impl QueueHandler for MemHandler {
    fn process_queue(&mut self, _index: usize) {
        let Self {
            mem,
            queue,
            irq,
            shared,
        } = self;
        serve_queue(queue, mem, irq, DEVICE, |chain| {
            Self::handle(mem, shared, chain)
        });
    }
}

/// For the fuzz target `mem`: a device over a small region at `addr` with
/// everything requested, its queue served twice on arbitrary memory.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queue(mem: GuestMemory, queue: Queue, irq: VirtioInterrupt, addr: u64) {
    let dev = VirtioMem::with(Blocks::new(addr, DEFAULT_BLOCK_SIZE, 64), 0);
    dev.handle.update(|b| {
        b.user = b.region_size() / 2;
        b.committed = b.region_size() / 4 * 3;
    });
    let mut h = MemHandler {
        mem,
        queue,
        irq,
        shared: dev.handle.shared.clone(),
    };
    h.process_queue(0);
    dev.handle.update(|b| b.user = 0);
    h.process_queue(0);
}

#[cfg(test)]
mod tests {
    use super::protocol::{REQ_PLUG, REQ_UNPLUG, RESP_LEN};
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::test_utils::*;
    use vm_memory::Bytes;

    const BS: u64 = DEFAULT_BLOCK_SIZE;
    /// A region of 128 MiB at 2 MiB, inside the test memory's first 4 MiB:
    /// blocks 0 and (half of) 1 are real memory the handler can discard.
    const REGION: u64 = 2 << 20;

    fn request(mem: &GuestMemory, at: u64, ty: u16, addr: u64, n: u16) {
        let mut raw = [0u8; 24];
        raw[..2].copy_from_slice(&ty.to_le_bytes());
        raw[8..16].copy_from_slice(&addr.to_le_bytes());
        raw[16..18].copy_from_slice(&n.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(at)).unwrap();
    }

    #[test]
    fn requests_are_answered_and_unplugged_blocks_discarded() {
        let mem = memory();
        let dev = VirtioMem::with(Blocks::new(REGION, BS, 64), 0);
        let handle = dev.handle();
        handle.set_requested(4 * BS).unwrap();
        handle.set_committed(64 * BS);
        let vq = TestQueue::new(&mem, 16);
        let (req, resp) = (DATA_START, DATA_START + 0x100);
        // Plug block 0 and write it; unplug it; a short request; no room for
        // the response.
        request(&mem, req, REQ_PLUG, REGION, 1);
        request(&mem, req + 0x40, REQ_UNPLUG, REGION, 1);
        add_chain(&vq, 0, &[r(req, 24), w(resp, 10)]);
        let irq = Arc::new(CountingInterrupt::default());
        let mut h = MemHandler {
            mem: mem.clone(),
            queue: vq.create_queue().unwrap(),
            irq: VirtioInterrupt::new(irq.clone()),
            shared: handle.shared.clone(),
        };
        h.process_queue(0);
        assert_eq!(used(&vq), [(0, RESP_LEN as u32)]);
        assert_eq!(mem.read_obj::<u16>(GuestAddress(resp)).unwrap(), 0);
        assert_eq!(handle.plugged_bytes(), BS);
        mem.write_slice(&[0xab; 4096], GuestAddress(REGION))
            .unwrap();

        add_chain(&vq, 2, &[r(req + 0x40, 24), w(resp + 0x20, 10)]);
        add_chain(&vq, 4, &[r(req, 8), w(resp + 0x40, 10)]);
        add_chain(&vq, 6, &[r(req, 24)]);
        h.process_queue(0);
        assert_eq!(
            used(&vq),
            [(0, 10), (2, 10), (4, 10), (6, 0)],
            "answered, answered with an error, dropped"
        );
        assert_eq!(mem.read_obj::<u16>(GuestAddress(resp + 0x20)).unwrap(), 0);
        assert_eq!(mem.read_obj::<u16>(GuestAddress(resp + 0x40)).unwrap(), 3);
        assert_eq!(handle.plugged_bytes(), 0);
        assert_eq!(handle.discarded_bytes(), BS);
        assert_eq!(
            mem.read_obj::<u64>(GuestAddress(REGION)).unwrap(),
            0,
            "an unplugged block is dropped from the host"
        );
    }

    /// `--prefault`: a block plugged again after an unplug is committed
    /// again before the plug is acknowledged (the committer committed it
    /// once; the unplug's discard undid that).
    #[test]
    fn a_block_plugged_again_is_committed_again() {
        let ram = crate::vstate::memory::create(16 << 20).unwrap();
        let region = 4u64 << 30;
        let (mem, _) = crate::vstate::memory::add_hotplug(&ram, region, 128 << 20).unwrap();
        let resident = |a: u64| {
            let host = mem.get_host_address(GuestAddress(a)).unwrap();
            let mut v = vec![0u8; (BS / 4096) as usize];
            // SAFETY: a block of the region, mapped; mincore only fills `v`.
            let rc = unsafe { libc::mincore(host.cast(), BS as usize, v.as_mut_ptr()) };
            assert_eq!(rc, 0);
            v.iter().filter(|&&b| b & 1 != 0).count()
        };
        let dev = VirtioMem::with(Blocks::new(region, BS, 64), 0);
        let handle = dev.handle();
        handle.set_requested(64 * BS).unwrap();
        handle.set_committed(64 * BS);
        handle.keep_committed();
        // As the committer leaves them: blocks 0 and 1 committed.
        crate::vstate::memory::populate(
            mem.get_host_address(GuestAddress(region)).unwrap() as u64,
            2 * BS,
        )
        .unwrap();
        let shared = &handle.shared;
        let ack = |req| MemHandler::answer(&mem, shared, req);
        let (plug, unplug) = (
            |n| Request::Plug {
                addr: region,
                nb_blocks: n,
            },
            |n| Request::Unplug {
                addr: region,
                nb_blocks: n,
            },
        );
        assert_eq!(ack(plug(2)), Response::Ack);
        assert_eq!(ack(unplug(1)), Response::Ack);
        assert_eq!(resident(region), 0, "the unplug discarded block 0");
        assert_eq!(ack(plug(1)), Response::Ack);
        assert_eq!(
            resident(region),
            512,
            "block 0 plugged again, committed again"
        );
        assert_eq!(resident(region + BS), 512);
        assert!(handle.lock().stale.as_ref().is_some_and(|s| s.total() == 0));
        // Lazily backed (no --prefault), an unplugged block stays off the host.
        let lazy = VirtioMem::with(Blocks::new(region, BS, 64), 0).handle();
        lazy.set_requested(64 * BS).unwrap();
        lazy.set_committed(64 * BS);
        let ack = |req| MemHandler::answer(&mem, &lazy.shared, req);
        assert_eq!(ack(plug(1)), Response::Ack);
        assert_eq!(ack(unplug(1)), Response::Ack);
        assert_eq!(ack(plug(1)), Response::Ack);
        assert_eq!(resident(region), 0);
    }

    /// A restored VM with `--prefault`: the committer commits the plugged
    /// blocks (and RAM) and nothing else; a block plugged afterwards is
    /// committed before the plug is acknowledged.
    #[test]
    fn a_restored_region_commits_its_plugged_blocks_and_each_new_plug() {
        let ram = crate::vstate::memory::create(16 << 20).unwrap();
        let region = 4u64 << 30;
        let (mem, _) = crate::vstate::memory::add_hotplug(&ram, region, 128 << 20).unwrap();
        let resident = |b: u64| {
            let host = mem.get_host_address(GuestAddress(region + b * BS)).unwrap();
            let mut v = vec![0u8; (BS / 4096) as usize];
            // SAFETY: a block of the region, mapped; mincore only fills `v`.
            let rc = unsafe { libc::mincore(host.cast(), BS as usize, v.as_mut_ptr()) };
            assert_eq!(rc, 0);
            v.iter().filter(|&&b| b & 1 != 0).count()
        };
        // As a snapshot has it: blocks 0-3 and 20 plugged, all requested.
        let mut blocks = Blocks::new(region, BS, 64);
        (blocks.user, blocks.committed) = (64 * BS, 64 * BS);
        for (addr, nb_blocks) in [(region, 4), (region + 20 * BS, 1)] {
            assert_eq!(
                blocks.handle(Request::Plug { addr, nb_blocks }, &mut Vec::new()),
                Response::Ack
            );
        }
        let dev = VirtioMem::from_state(&MemState {
            blocks,
            generation: 3,
        });
        let h = dev.handle();
        h.keep_committed_restored();
        let c = crate::prefault::Committer::new(&mem, 2);
        let (ram_bytes, plugged) =
            crate::prefault::commit_restored(&c, None, Some(&h), 8 * BS).unwrap();
        assert_eq!((ram_bytes, plugged), (16 << 20, 5 * BS));
        assert_eq!(
            (0..4).chain([20]).map(resident).collect::<Vec<_>>(),
            [512; 5],
            "the plugged blocks are committed"
        );
        assert_eq!(
            (4..20).chain(21..64).map(resident).sum::<usize>(),
            0,
            "nothing else of the region is"
        );
        let ack = |addr, nb_blocks| {
            MemHandler::answer(&mem, &h.shared, Request::Plug { addr, nb_blocks })
        };
        assert_eq!(ack(region + 30 * BS, 2), Response::Ack);
        assert_eq!((resident(30), resident(31)), (512, 512));
        assert_eq!(resident(32), 0);
    }

    /// `--mem-lock`: a locked block is discarded all the same (madvise
    /// alone refuses locked memory) and stays locked for its next plug.
    #[test]
    fn a_locked_block_is_discarded_too() {
        let mem = memory();
        let host = mem.get_host_address(GuestAddress(REGION)).unwrap();
        // SAFETY: the test memory's own mapping; locking changes residency only.
        let rc = unsafe { libc::mlock2(host.cast(), BS as usize, libc::MLOCK_ONFAULT) };
        assert_eq!(rc, 0, "mlock2: {}", std::io::Error::last_os_error());
        mem.write_slice(&[0xab; 4096], GuestAddress(REGION))
            .unwrap();
        // SAFETY: as above.
        let plain = unsafe { libc::madvise(host.cast(), BS as usize, libc::MADV_DONTNEED) };
        assert_ne!(
            plain, 0,
            "madvise alone discards locked memory: nothing to test"
        );
        assert!(discard(&mem, REGION, REGION + BS));
        assert_eq!(mem.read_obj::<u64>(GuestAddress(REGION)).unwrap(), 0);
        // The mapping holding the block is marked lock-on-fault again.
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let at = host as u64;
        let mut ours = false;
        let flags = smaps.lines().find_map(|l| {
            if let Some((range, _)) = l.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
            {
                ours = (a..b).contains(&at);
            }
            l.strip_prefix("VmFlags:").filter(|_| ours)
        });
        assert!(
            flags.is_some_and(|f| f.split_whitespace().any(|x| x == "lf")),
            "{flags:?}"
        );
    }

    /// Unplugged blocks are whole 2 MiB-aligned huge pages of the region
    /// (`memory::add_hotplug` maps it 2 MiB-aligned; blocks are 2 MiB or
    /// more): no page is left around them for the kernel to collapse or fault
    /// back in, so unlike the balloon's holes they need no huge-page advice.
    #[test]
    fn an_unplugged_block_stays_discarded_when_huge_pages_are_collapsed() {
        const MADV_COLLAPSE: i32 = 25;
        let ram = crate::vstate::memory::create(16 << 20).unwrap();
        let at = 4u64 << 30;
        let (mem, _) = crate::vstate::memory::add_hotplug(&ram, at, 128 << 20).unwrap();
        let host = |a: u64| mem.get_host_address(GuestAddress(a)).unwrap();
        let resident = |a: u64| {
            let mut v = vec![0u8; (BS / 4096) as usize];
            // SAFETY: a block of the region, mapped; mincore only fills `v`.
            let rc = unsafe { libc::mincore(host(a).cast(), BS as usize, v.as_mut_ptr()) };
            assert_eq!(rc, 0);
            v.iter().filter(|&&b| b & 1 != 0).count()
        };
        mem.write_slice(&vec![0xab; 3 * BS as usize], GuestAddress(at))
            .unwrap();
        assert!(discard(&mem, at + BS, at + 2 * BS));
        // Collapse each block as khugepaged would (MADV_COLLAPSE, Linux 6.1+);
        // the kernel may refuse (nothing to collapse, no huge page free).
        for b in 0..3 {
            // SAFETY: one block of the region; collapsing changes no contents.
            unsafe { libc::madvise(host(at + b * BS).cast(), BS as usize, MADV_COLLAPSE) };
        }
        assert_eq!(resident(at + BS), 0, "the unplugged block came back");
        assert_eq!((resident(at), resident(at + 2 * BS)), (512, 512));
        // A neighbour's fault stays in its own block.
        discard(&mem, at, at + BS);
        mem.write_obj(1u8, GuestAddress(at + BS - 1)).unwrap();
        assert_eq!(resident(at + BS), 0);
    }

    /// The region's committer waits for the driver: woken when it binds,
    /// and let go when the device is gone and no driver can come.
    #[test]
    fn waiting_for_the_driver_ends_when_it_binds_or_the_device_goes() {
        let dev = VirtioMem::new(&MemConfig::new(256 << 20).unwrap(), 4 << 30).unwrap();
        let h = dev.handle();
        let waiter = {
            let h = h.clone();
            std::thread::spawn(move || h.wait_for_driver())
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "returned before any driver");
        h.lock().irq = Some(VirtioInterrupt::new(Arc::new(CountingInterrupt::default())));
        h.bound.notify_all();
        assert!(waiter.join().unwrap());

        let gone = VirtioMem::new(&MemConfig::new(256 << 20).unwrap(), 4 << 30).unwrap();
        let h = gone.handle();
        drop(gone);
        assert!(!h.wait_for_driver());
    }

    #[test]
    fn a_resize_changes_the_config_space_and_interrupts_an_active_driver() {
        let dev = VirtioMem::new(&MemConfig::new(256 << 20).unwrap(), 4 << 30).unwrap();
        let handle = dev.handle();
        let read = |off| {
            let mut b = [0u8; 8];
            dev.read_config(off, &mut b);
            u64::from_le_bytes(b)
        };
        assert_eq!((read(0), read(16), read(24)), (BS, 4 << 30, 256 << 20));
        handle.set_requested(256 << 20).unwrap();
        assert_eq!(read(48), 0, "nothing committed yet");
        let line = Arc::new(CountingInterrupt::default());
        handle.lock().irq = Some(VirtioInterrupt::new(line.clone()));
        let g = dev.config_generation();
        handle.set_committed(100 << 20);
        assert_eq!(read(48), 100 << 20);
        assert_ne!(dev.config_generation(), g);
        assert_eq!(line.count(), 1);
        handle.set_committed(100 << 20);
        assert_eq!(line.count(), 1, "no change, no interrupt");
        assert!(handle.set_requested(257 << 20).is_err());
        assert_eq!(
            "1G,block=4M".parse::<MemConfig>().unwrap(),
            MemConfig {
                size: 1 << 30,
                block_size: 4 << 20
            }
        );
        for bad in ["100M", "1G,block=3M", "1G,block=1M", "1G,colour=red", ""] {
            assert!(bad.parse::<MemConfig>().is_err(), "{bad}");
        }
    }
}
