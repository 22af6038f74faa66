//! The virtio-blk I/O thread: one per device, owning an epoll over the queue eventfd, a
//! kill eventfd and the engine's completion eventfd.
//!
//! Each pass drains the available ring — at most one queue's worth, since a buggy or
//! malicious driver can keep adding while we read — submits the batch, completes whatever
//! has finished into the used ring and raises the interrupt once for the batch, unless the
//! driver asked for none (`VRING_AVAIL_F_NO_INTERRUPT`). A request is acknowledged (put in
//! the used ring) only after its syscall has completed.
//!
//! Out of work, the thread busy-polls the available ring and the engine's completions for
//! a short, adaptive window ([`PollWindow`], QEMU's `poll-max-ns` scheme) with
//! `VRING_USED_F_NO_NOTIFY` set, so a driver that submits again within the window never
//! exits to notify and the thread never sleeps. Only then does it clear the flag, look at
//! the ring once more (a request published before the driver saw the flag cleared comes
//! with no notification) and sleep in epoll.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::io::{AlignedBuf, Completion, Engine, Op};
use super::request::{
    self, DISCARD_SEGMENT_LEN, ParseError, Request, RequestType, Segment, Segments,
};
use super::{MAX_DISCARD_SECTORS, SECTOR_SHIFT, SECTOR_SIZE};
use crate::devices::virtio::{GuestMemory, VirtioInterrupt, needs_interrupt};

/// What the I/O thread knows about its disk.
#[derive(Debug, Clone)]
pub struct DiskParams {
    /// Size in 512-byte sectors.
    pub capacity: u64,
    /// Refuse writes.
    pub read_only: bool,
    /// The file is open with `O_DIRECT`: buffers must be aligned.
    pub direct: bool,
    /// `GET_ID` answer, zero-padded.
    pub serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
}

/// Largest bounce buffer for one `O_DIRECT` request; bigger unaligned requests fail
/// rather than letting the guest make us allocate gigabytes.
const MAX_BOUNCE_BYTES: u32 = 32 << 20;
/// The most bounce-buffer memory one disk holds at once. Without it a guest could keep a
/// queue's worth (256) of [`MAX_BOUNCE_BYTES`] requests in flight: 8 GiB per disk whatever
/// `--mem` says. Past the budget, the I/O thread waits for earlier bounced requests to
/// finish before starting the next (the guest sees a slower disk, never an error).
pub const BOUNCE_BUDGET: usize = 64 << 20;
/// Guest buffers handed to `O_DIRECT` must be aligned to the logical block size.
const DIRECT_IO_ALIGN: usize = SECTOR_SIZE as usize;

/// One entry of the in-flight table; its index is the engine token.
///
/// The buffers outlive the requests: a new request clears and refills them, so once each
/// slot has served its largest request, a steady stream of requests allocates nothing
/// (musl's allocator made per-request `Vec`s cost up to 40 % of 4 KiB QD32 reads). The
/// table itself never grows past the queue size, which `BlockHandler::new` reserves.
#[derive(Default)]
struct Slot {
    /// The request using the slot; `None` while free.
    busy: Option<InFlight>,
    /// The request's iovecs. The kernel reads them until the request completes, so they
    /// are only touched while the slot is free. (It reads the `Vec`'s heap buffer, which
    /// stays put even if the table were to move the `Slot`.)
    iovecs: Vec<libc::iovec>,
    /// For a bounced read: the guest segments the data is copied to on completion.
    copy_back: Vec<Segment>,
}

// SAFETY: the iovecs point into guest memory (mapped for as long as the handler holds its
// `GuestMemory`) or into the slot's own bounce buffer; neither is tied to a thread, and only
// the thread that owns the handler touches them.
unsafe impl Send for Slot {}

/// A request the engine is working on. Owns everything the kernel may still touch,
/// together with its slot's iovecs.
struct InFlight {
    head: u16,
    status: GuestAddress,
    expect: usize,
    used_len: u32,
    discard: bool,
    bounce: Option<Bounce>,
}

/// An aligned copy of an unaligned guest data area (`O_DIRECT` only). Allocated per
/// request: Linux aligns its buffers, so this is a rare path, and keeping up to
/// [`MAX_BOUNCE_BYTES`] per slot around would cost far more than it saves.
struct Bounce {
    buf: AlignedBuf,
    /// Bytes of it charged to the handler's bounce budget.
    len: usize,
    /// A read: copy the data to the slot's `copy_back` segments once it has arrived.
    copy_back: bool,
}

/// Why a request completes without reaching the engine: its status and, for the log, why.
type Done = (u32, &'static str);

/// The request-processing half of the I/O thread, free of epoll so tests can drive it.
pub struct BlockHandler {
    mem: GuestMemory,
    queue: Queue,
    irq: VirtioInterrupt,
    engine: Box<dyn Engine>,
    disk: DiskParams,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// The data area of the request being parsed, reused for every request.
    data: Segments,
    pending_irq: bool,
    broken: bool,
    /// The last wake-up stopped early because a queue's worth was already in flight.
    throttled: bool,
    /// `VRING_USED_F_NO_NOTIFY` is set: the thread is polling and the driver need not
    /// notify.
    notify_off: bool,
    completions: Vec<Completion>,
    /// Bounce-buffer bytes held by requests in flight, and the most they may be.
    bounced: usize,
    bounce_budget: usize,
    /// The largest `bounced` has been (for tests and the curious).
    peak_bounced: usize,
}

impl Drop for BlockHandler {
    /// The kernel may still be using the slots' iovecs and bounce buffers: wait for every
    /// operation before they are freed, and leak them if waiting fails.
    fn drop(&mut self) {
        self.drain();
        if self.in_flight() > 0 {
            std::mem::forget(std::mem::take(&mut self.slots));
        }
    }
}

impl BlockHandler {
    /// A handler for `queue` doing its I/O on `file` through the engine `kind` asks for.
    pub fn open(
        mem: GuestMemory,
        queue: Queue,
        irq: VirtioInterrupt,
        kind: super::EngineKind,
        file: std::fs::File,
        disk: DiskParams,
    ) -> io::Result<Self> {
        Ok(Self::new(
            mem,
            queue,
            irq,
            super::io::open(kind, file)?,
            disk,
        ))
    }

    /// A handler for `queue` doing its I/O through `engine`.
    pub(crate) fn new(
        mem: GuestMemory,
        queue: Queue,
        irq: VirtioInterrupt,
        engine: Box<dyn Engine>,
        disk: DiskParams,
    ) -> Self {
        // At most a queue's worth is ever in flight (`process_queue`), so reserving that
        // much up front means neither table reallocates while requests are served.
        let size = usize::from(queue.size());
        Self {
            mem,
            queue,
            irq,
            engine,
            disk,
            slots: Vec::with_capacity(size),
            free: Vec::with_capacity(size),
            data: Segments::new(),
            pending_irq: false,
            broken: false,
            throttled: false,
            notify_off: false,
            completions: Vec::with_capacity(size),
            bounced: 0,
            bounce_budget: BOUNCE_BUDGET,
            peak_bounced: 0,
        }
    }

    /// Lowers the bounce budget (tests exercise it without allocating 64 MiB).
    pub fn set_bounce_budget(&mut self, bytes: usize) {
        self.bounce_budget = bytes;
    }

    /// The most bounce-buffer memory that was held at once.
    pub fn peak_bounced(&self) -> usize {
        self.peak_bounced
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Processes up to one queue's worth of available requests. Returns true when the
    /// ring may hold more (the caller should come back, after checking for a kill).
    pub fn process_queue(&mut self) -> bool {
        if self.broken {
            return false;
        }
        // Never more than a queue's worth in flight: a driver re-publishing heads it has
        // not got back yet cannot make us queue unbounded work (or overflow the ring).
        let budget = usize::from(self.queue.size()).saturating_sub(self.in_flight());
        if budget == 0 {
            self.throttled = true;
            return false;
        }
        // A synchronous engine has finished each request when `push` returns: hand each
        // back at once, so a polling driver can reuse it while we do the next.
        let inline = self.engine.notifier().is_none();
        // Out of `self` for the pass, so `start` can borrow the handler mutably.
        let mut data = std::mem::take(&mut self.data);
        let mut taken = 0;
        while taken < budget {
            // One chain at a time, each parsed into the same `data` and started before
            // the next is read. (A fresh iterator each time, because starting a request
            // may touch the used ring; the price is one more load of the available index.)
            let chain = match self.queue.iter(&self.mem) {
                Ok(mut iter) => iter.next(),
                Err(e) => {
                    crate::guest_warn!(
                        "virtio-blk: unusable available ring ({e}); device needs reset"
                    );
                    self.broken = true;
                    self.irq.set_needs_reset();
                    break;
                }
            };
            let Some(chain) = chain else {
                break;
            };
            taken += 1;
            let parsed = request::parse(&self.mem, chain, &mut data);
            self.start(parsed, &data);
            if inline {
                self.complete_finished();
            }
        }
        self.data = data;
        if taken == 0 {
            // Nothing new: spare the engine a submit (a syscall for io_uring).
            self.flush_irq();
            return false;
        }
        if let Err(e) = self.engine.submit() {
            crate::guest_warn!("virtio-blk: {} submit failed: {e}", self.engine.name());
        }
        self.process_completions();
        taken == budget
    }

    /// Completes whatever the engine has finished and raises the interrupt once.
    pub fn process_completions(&mut self) {
        self.complete_finished();
        self.flush_irq();
    }

    /// Puts whatever the engine has finished in the used ring, without interrupting.
    fn complete_finished(&mut self) {
        // Checked first so a pass with nothing finished costs no syscall.
        if !self.engine.has_completions() {
            return;
        }
        let mut done = std::mem::take(&mut self.completions);
        self.engine.reap(&mut done);
        for (token, result) in done.drain(..) {
            self.finish(token, result);
        }
        self.completions = done;
    }

    /// Whether there is something to do right now: finished I/O, or available requests
    /// and room to take them. Reads shared memory only (no syscall), for polling.
    pub fn has_work(&mut self) -> bool {
        if self.broken {
            return false;
        }
        if self.engine.has_completions() {
            return true;
        }
        if self.in_flight() >= usize::from(self.queue.size()) {
            return false;
        }
        match self.queue.avail_idx(&self.mem, Ordering::Acquire) {
            Ok(idx) => idx.0 != self.queue.next_avail(),
            // Let `process_queue` find the ring unusable and mark the device broken.
            Err(_) => true,
        }
    }

    /// The device was marked `NEEDS_RESET` and serves nothing more.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Asks the driver not to notify (`VRING_USED_F_NO_NOTIFY`): the thread is about to
    /// poll the available ring instead.
    pub fn suppress_notifications(&mut self) {
        if self.notify_off || self.broken {
            return;
        }
        match self.queue.disable_notification(&self.mem) {
            Ok(()) => self.notify_off = true,
            Err(e) => crate::guest_warn!("virtio-blk: cannot set VRING_USED_F_NO_NOTIFY: {e}"),
        }
    }

    /// Asks the driver to notify again, before the thread sleeps. Returns whether there is
    /// work after all: the driver may have published a request while the flag was still
    /// set, and no notification will come for that one.
    pub fn resume_notifications(&mut self) -> bool {
        if std::mem::take(&mut self.notify_off)
            && let Err(e) = self.queue.enable_notification(&self.mem)
        {
            crate::guest_warn!("virtio-blk: cannot clear VRING_USED_F_NO_NOTIFY: {e}");
        }
        // `enable_notification` fences its store before any later load, so this re-read
        // and the driver's re-read of the flag cannot both miss each other's update.
        self.has_work()
    }

    /// Whether `process_queue` held back for lack of in-flight room; clears the mark.
    pub fn take_throttled(&mut self) -> bool {
        std::mem::take(&mut self.throttled)
    }

    /// Waits for every in-flight request and completes it (shutdown and reset).
    pub fn drain(&mut self) {
        while self.in_flight() > 0 {
            if let Err(e) = self.engine.wait() {
                crate::guest_warn!("virtio-blk: waiting for in-flight I/O failed: {e}");
                break;
            }
            self.process_completions();
        }
        self.flush_irq();
    }

    fn start(&mut self, parsed: Result<Request, ParseError>, data: &[Segment]) {
        let req = match parsed {
            Ok(req) => req,
            Err(ParseError::Invalid {
                head,
                status,
                reason,
            }) => {
                crate::guest_warn!("virtio-blk: bad request {head}: {reason}");
                self.complete(head, status, VIRTIO_BLK_S_IOERR, 1);
                return;
            }
            Err(ParseError::NoStatus { head, reason }) => {
                crate::guest_warn!(
                    "virtio-blk: dropping request {head}: {reason}; device needs reset"
                );
                self.irq.set_needs_reset();
                self.add_used(head, 0);
                return;
            }
        };
        if let Err((status, reason)) = self.submit(&req, data) {
            if status != VIRTIO_BLK_S_OK {
                crate::guest_warn!(
                    "virtio-blk: request {} ({:?}): {reason}",
                    req.head,
                    req.kind
                );
            }
            let used_len = if status == VIRTIO_BLK_S_OK {
                reason_len(&req)
            } else {
                1
            };
            self.complete(req.head, req.status, status, used_len);
        }
    }

    /// Hands `req` to the engine; `Err((status, why))` means it completes right away.
    fn submit(&mut self, req: &Request, data: &[Segment]) -> Result<(), Done> {
        let ioerr = |reason| (VIRTIO_BLK_S_IOERR, reason);
        match req.kind {
            RequestType::In | RequestType::Out => {
                let write = req.kind == RequestType::Out;
                if write && self.disk.read_only {
                    return Err(ioerr("write to a read-only disk"));
                }
                if req.data_len % SECTOR_SIZE != 0 {
                    return Err(ioerr("data length is not a whole number of sectors"));
                }
                let offset =
                    self.check_range(req.sector, u64::from(req.data_len >> SECTOR_SHIFT))?;
                if req.data_len == 0 {
                    return Err((VIRTIO_BLK_S_OK, ""));
                }
                self.submit_rw(req, data, offset, write)
            }
            RequestType::Flush => {
                let index = self.claim_slot();
                self.push(index, req, Op::Flush, 0, false, None)
            }
            RequestType::GetId => {
                write_segments(&self.mem, data, &self.disk.serial);
                Err((VIRTIO_BLK_S_OK, ""))
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                if self.disk.read_only {
                    return Err(ioerr("discard or write-zeroes on a read-only disk"));
                }
                if req.data_len as usize != DISCARD_SEGMENT_LEN {
                    return Err(ioerr("expected exactly one discard/write-zeroes segment"));
                }
                let mut seg = [0u8; DISCARD_SEGMENT_LEN];
                read_segments(&self.mem, data, &mut seg)
                    .ok_or(ioerr("unreadable discard segment"))?;
                let sector = u64::from_le_bytes(seg[..8].try_into().unwrap_or_default());
                let sectors = u32::from_le_bytes(seg[8..12].try_into().unwrap_or_default());
                let flags = u32::from_le_bytes(seg[12..].try_into().unwrap_or_default());
                let discard = req.kind == RequestType::Discard;
                let allowed = if discard {
                    0
                } else {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                };
                if flags & !allowed != 0 {
                    return Err((VIRTIO_BLK_S_UNSUPP, "unknown discard/write-zeroes flags"));
                }
                if sectors > MAX_DISCARD_SECTORS {
                    return Err(ioerr("discard/write-zeroes larger than advertised"));
                }
                let offset = self.check_range(sector, u64::from(sectors))?;
                let len = u64::from(sectors) << SECTOR_SHIFT;
                let op = if discard {
                    Op::Discard { offset, len }
                } else {
                    Op::WriteZeroes { offset, len }
                };
                let index = self.claim_slot();
                self.push(index, req, op, 0, discard, None)
            }
            RequestType::Unsupported(t) => {
                crate::guest_warn!("virtio-blk: unsupported request type {t}");
                Err((VIRTIO_BLK_S_UNSUPP, "unsupported request type"))
            }
        }
    }

    /// Byte offset of `sector`, if `sectors` sectors from there fit on the disk.
    fn check_range(&self, sector: u64, sectors: u64) -> Result<u64, Done> {
        match sector.checked_add(sectors) {
            Some(end) if end <= self.disk.capacity => Ok(sector << SECTOR_SHIFT),
            _ => Err((
                VIRTIO_BLK_S_IOERR,
                "sector range beyond the end of the disk",
            )),
        }
    }

    fn submit_rw(
        &mut self,
        req: &Request,
        data: &[Segment],
        offset: u64,
        write: bool,
    ) -> Result<(), Done> {
        let index = self.claim_slot();
        let bounce = match self.fill_iovecs(index, req, data, write) {
            Ok(bounce) => bounce,
            Err(done) => {
                self.free.push(index);
                return Err(done);
            }
        };
        let iovecs = &self.slots[index].iovecs;
        let (iovecs, count) = (iovecs.as_ptr(), iovecs.len());
        let op = if write {
            Op::Write {
                offset,
                iovecs,
                count,
            }
        } else {
            Op::Read {
                offset,
                iovecs,
                count,
            }
        };
        self.push(index, req, op, req.data_len as usize, false, bounce)
    }

    /// Points the iovecs of the free slot `index` at the data area, or at an aligned copy
    /// of it when `O_DIRECT` needs one (returned, to live as long as the request).
    fn fill_iovecs(
        &mut self,
        index: usize,
        req: &Request,
        data: &[Segment],
        write: bool,
    ) -> Result<Option<Bounce>, Done> {
        let slot = &mut self.slots[index];
        // Whatever the slot's last request left must not leak into this one.
        slot.iovecs.clear();
        slot.copy_back.clear();
        for seg in data {
            let slice = self
                .mem
                .get_slice(seg.addr, seg.len as usize)
                .map_err(|_| (VIRTIO_BLK_S_IOERR, "data buffer crosses a memory region"))?;
            slot.iovecs.push(libc::iovec {
                iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                iov_len: slice.len(),
            });
        }
        let misaligned = |v: &libc::iovec| {
            v.iov_base as usize % DIRECT_IO_ALIGN != 0 || v.iov_len % DIRECT_IO_ALIGN != 0
        };
        if !self.disk.direct || !slot.iovecs.iter().any(misaligned) {
            return Ok(None);
        }
        if req.data_len > MAX_BOUNCE_BYTES {
            return Err((
                VIRTIO_BLK_S_IOERR,
                "unaligned direct request too large to bounce",
            ));
        }
        let len = req.data_len as usize;
        // Within budget: wait for bounced requests in flight to finish and free theirs. A
        // request alone is always allowed (it is at most MAX_BOUNCE_BYTES).
        while self.bounced > 0 && self.bounced + len > self.bounce_budget {
            if let Err(e) = self.engine.wait() {
                crate::guest_warn!("virtio-blk: waiting for bounced I/O failed: {e}");
                return Err((VIRTIO_BLK_S_IOERR, "bounce budget exhausted"));
            }
            self.complete_finished();
        }
        let mut buf = AlignedBuf::new(len)
            .map_err(|_| (VIRTIO_BLK_S_IOERR, "no memory for a bounce buffer"))?;
        self.bounced += len;
        self.peak_bounced = self.peak_bounced.max(self.bounced);
        let slot = &mut self.slots[index];
        if write {
            read_segments(&self.mem, data, buf.as_mut_slice())
                .ok_or((VIRTIO_BLK_S_IOERR, "unreadable data buffer"))?;
        } else {
            slot.copy_back.extend_from_slice(data);
        }
        slot.iovecs.clear();
        slot.iovecs.push(libc::iovec {
            iov_base: buf.as_ptr().cast(),
            iov_len: req.data_len as usize,
        });
        Ok(Some(Bounce {
            buf,
            len,
            copy_back: !write,
        }))
    }

    /// A free slot: the most recently freed one (its buffers are the warmest), else a new
    /// one. Until `push` fills it, it counts as in flight but is nobody's.
    fn claim_slot(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot::default());
            self.slots.len() - 1
        })
    }

    /// Records `req` in the claimed slot `index` and hands `op` to the engine.
    fn push(
        &mut self,
        index: usize,
        req: &Request,
        op: Op,
        expect: usize,
        discard: bool,
        bounce: Option<Bounce>,
    ) -> Result<(), Done> {
        let used_len = match req.kind {
            RequestType::In => req.data_len + 1,
            _ => 1,
        };
        self.slots[index].busy = Some(InFlight {
            head: req.head,
            status: req.status,
            expect,
            used_len,
            discard,
            bounce,
        });
        // SAFETY: a data `op` points at this slot's `iovecs` (filled by `fill_iovecs`),
        // which describe guest memory (mapped as long as the handler holds `mem`) or the
        // slot's bounce buffer (kept in `busy` above). Neither the slot's iovecs nor its
        // bounce buffer are touched until `finish` reaps this token (the slot is off the
        // free list), and `Drop` waits for every operation before either is freed.
        if let Err(e) = unsafe { self.engine.push(op, index as u64) } {
            crate::guest_warn!("virtio-blk: {} rejected a request: {e}", self.engine.name());
            if let Some(b) = self.slots[index].busy.take().and_then(|f| f.bounce) {
                self.bounced -= b.len;
            }
            self.free.push(index);
            return Err((VIRTIO_BLK_S_IOERR, "engine rejected the request"));
        }
        Ok(())
    }

    fn finish(&mut self, token: u64, result: io::Result<usize>) {
        let Some((index, inflight)) = usize::try_from(token)
            .ok()
            .and_then(|i| Some((i, self.slots.get_mut(i)?.busy.take()?)))
        else {
            crate::guest_warn!("virtio-blk: completion for unknown token {token}");
            return;
        };
        self.free.push(index);
        if let Some(b) = &inflight.bounce {
            self.bounced -= b.len;
        }
        let status = match result {
            Ok(n) if n == inflight.expect => VIRTIO_BLK_S_OK,
            Ok(n) => {
                crate::guest_warn!(
                    "virtio-blk: short transfer ({n} of {} bytes)",
                    inflight.expect
                );
                VIRTIO_BLK_S_IOERR
            }
            // Discard is advisory: a file system without hole punching just keeps the data.
            Err(e) if inflight.discard && e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                VIRTIO_BLK_S_OK
            }
            Err(e) => {
                crate::guest_error!("virtio-blk: I/O error: {e}");
                VIRTIO_BLK_S_IOERR
            }
        };
        if status == VIRTIO_BLK_S_OK
            && let Some(Bounce {
                mut buf,
                copy_back: true,
                ..
            }) = inflight.bounce
        {
            let len = inflight.expect;
            write_segments(
                &self.mem,
                &self.slots[index].copy_back,
                &buf.as_mut_slice()[..len],
            );
        }
        self.complete(inflight.head, inflight.status, status, inflight.used_len);
    }

    /// Writes the status byte and returns the chain to the driver.
    fn complete(&mut self, head: u16, status_addr: GuestAddress, status: u32, used_len: u32) {
        if let Err(e) = self.mem.write_obj(status as u8, status_addr) {
            crate::guest_warn!("virtio-blk: cannot write the status of request {head}: {e}");
        }
        self.add_used(head, used_len);
    }

    fn add_used(&mut self, head: u16, len: u32) {
        match self.queue.add_used(&self.mem, head, len) {
            Ok(()) => self.pending_irq = true,
            Err(e) => {
                crate::guest_warn!(
                    "virtio-blk: cannot return request {head}: {e}; device needs reset"
                );
                self.irq.set_needs_reset();
            }
        }
    }

    fn flush_irq(&mut self) {
        if !std::mem::take(&mut self.pending_irq) {
            return;
        }
        if needs_interrupt(&mut self.queue, &self.mem, "virtio-blk") {
            self.irq.signal_used_queue();
        }
    }
}

/// Copies `src` into the guest segments, in order; returns the bytes written.
fn write_segments(mem: &GuestMemory, segs: &[Segment], src: &[u8]) -> usize {
    let mut done = 0;
    for seg in segs {
        let n = (seg.len as usize).min(src.len() - done);
        if n == 0 {
            break;
        }
        if mem.write_slice(&src[done..done + n], seg.addr).is_err() {
            break;
        }
        done += n;
    }
    done
}

/// Fills `dst` from the guest segments, in order; `None` if they are too short or
/// unreadable.
fn read_segments(mem: &GuestMemory, segs: &[Segment], dst: &mut [u8]) -> Option<()> {
    let mut done = 0;
    for seg in segs {
        let n = (seg.len as usize).min(dst.len() - done);
        if n == 0 {
            break;
        }
        mem.read_slice(&mut dst[done..done + n], seg.addr).ok()?;
        done += n;
    }
    (done == dst.len()).then_some(())
}

/// Used length of a request that completed without I/O: GET_ID reports the serial bytes
/// it wrote, everything else only the status byte.
fn reason_len(req: &Request) -> u32 {
    match req.kind {
        RequestType::GetId => req.data_len.min(VIRTIO_BLK_ID_BYTES) + 1,
        _ => 1,
    }
}

/// How long the I/O thread busy-polls for more work before sleeping, adapted like QEMU's
/// event-loop polling (`poll-max-ns`, `poll-grow`, `poll-shrink`).
///
/// The measure is the *idle time*: from running out of work to the next work arriving,
/// whether polling found it or a notification woke the thread. Idle time within the
/// window is the sweet spot and changes nothing; beyond the window but within the maximum,
/// polling a little longer would have caught it, so the window doubles; beyond the
/// maximum, polling would have been wasted, so it halves, down to zero. An idle device
/// therefore costs at most a few windows of CPU before it only sleeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollWindow {
    ns: u64,
    max_ns: u64,
}

/// The window grows from zero to this; below it, it drops to zero.
const POLL_GROW_START_NS: u64 = 4_000;

impl PollWindow {
    /// A window of at most `max` (zero: never poll), starting at `max`.
    pub fn new(max: Duration) -> Self {
        let max_ns = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        Self { ns: max_ns, max_ns }
    }

    /// How long to poll now.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.ns)
    }

    /// Adapts to one idle period of length `idle`.
    pub fn record(&mut self, idle: Duration) {
        let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
        if idle <= self.ns || self.max_ns == 0 {
            return;
        }
        if idle > self.max_ns {
            self.ns /= 2;
            if self.ns < POLL_GROW_START_NS {
                self.ns = 0;
            }
        } else {
            self.ns = self
                .ns
                .saturating_mul(2)
                .max(POLL_GROW_START_NS)
                .min(self.max_ns);
        }
    }
}

/// How often the I/O thread looks at its eventfds (for a kill, mainly) while polling keeps
/// finding work and it therefore never sleeps.
const EVENT_CHECK_PERIOD: Duration = Duration::from_millis(1);

/// Epoll tokens of the I/O thread.
const QUEUE_TOKEN: u64 = 0;
const KILL_TOKEN: u64 = 1;
const COMPLETION_TOKEN: u64 = 2;

/// The I/O thread body: runs until `kill`, then finishes what is in flight. It polls for
/// up to `poll_max` (adaptively) before sleeping; zero disables polling.
pub fn run(mut handler: BlockHandler, queue_evt: EventFd, kill: EventFd, poll_max: Duration) {
    let mut poll = Windows {
        guest: PollWindow::new(poll_max),
        engine: PollWindow::new(poll_max),
    };
    if let Err(e) = event_loop(&mut handler, &queue_evt, &kill, &mut poll) {
        crate::guest_warn!("virtio-blk: I/O thread failed: {e}");
    }
    handler.drain();
}

/// One poll window per thing the thread can be waiting for, since they keep different
/// times: with nothing in flight only the driver can bring work, and a polling driver
/// answers a completion within a microsecond or two; with I/O in flight the disk may take
/// far longer than is worth polling (`O_DIRECT`), and a shared window would then shrink
/// to nothing and make the driver notify again.
struct Windows {
    guest: PollWindow,
    engine: PollWindow,
}

impl Windows {
    fn for_state(&mut self, handler: &BlockHandler) -> &mut PollWindow {
        if handler.in_flight() > 0 {
            &mut self.engine
        } else {
            &mut self.guest
        }
    }
}

/// Busy-polls `handler` for up to `window` with notifications suppressed. Returns whether
/// it found work; if not, notifications are back on and the caller may sleep.
fn poll_for_work(handler: &mut BlockHandler, window: Duration) -> bool {
    if window.is_zero() || handler.is_broken() {
        return handler.resume_notifications();
    }
    let start = Instant::now();
    handler.suppress_notifications();
    loop {
        // Notifications stay off while there is work: the next poll follows the pass.
        if handler.has_work() {
            return true;
        }
        if start.elapsed() >= window {
            return handler.resume_notifications();
        }
        std::hint::spin_loop();
    }
}

fn event_loop(
    handler: &mut BlockHandler,
    queue_evt: &EventFd,
    kill: &EventFd,
    poll: &mut Windows,
) -> io::Result<()> {
    let epoll = Epoll::new()?;
    let add = |fd, token| {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    };
    add(queue_evt.as_raw_fd(), QUEUE_TOKEN)?;
    add(kill.as_raw_fd(), KILL_TOKEN)?;
    if let Some(fd) = handler.engine.notifier() {
        add(fd, COMPLETION_TOKEN)?;
    }
    let mut events = [EpollEvent::default(); 3];
    let mut last_look = Instant::now();
    // The driver may have published requests before we started watching.
    let mut work = true;
    loop {
        let mut more = false;
        if work {
            // Completions first: they make room for requests a full queue held back.
            handler.process_completions();
            handler.take_throttled();
            crate::seccomp::test_hook::block_request();
            more = handler.process_queue();
        }
        let idle = Instant::now();
        let window = poll.for_state(handler);
        // More than a queue's worth was waiting: no need to poll for it.
        work = more || poll_for_work(handler, window.window());
        if work && last_look.elapsed() < EVENT_CHECK_PERIOD {
            continue;
        }
        // Sleep; or, with work in hand, only look, so a kill is seen between passes.
        let timeout = if work { 0 } else { -1 };
        let n = match epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        last_look = Instant::now();
        if !work {
            window.record(last_look - idle);
        }
        let ready = |token| events[..n].iter().any(|e| e.data() == token);
        if ready(KILL_TOKEN) {
            return Ok(());
        }
        if ready(QUEUE_TOKEN) {
            // Read the counter before the pass, so a notification racing with it wakes
            // us again rather than being lost.
            let _ = queue_evt.read();
            work = true;
        }
        work |= ready(COMPLETION_TOKEN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::block::io::{self as bio, EngineKind};
    use crate::devices::virtio::block::request::MAX_SEGMENTS;
    use crate::devices::virtio::test_utils::*;
    use std::sync::Arc;
    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
        VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    };
    use virtio_bindings::virtio_ring::{
        VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
    };

    const QSIZE: u16 = 16;
    const DISK_SECTORS: u64 = 64;
    const HDR: u64 = DATA_START;
    const DATA: u64 = DATA_START + 0x1000;
    const STATUS: u64 = DATA_START + 0x3000;

    struct Rig {
        mem: GuestMemory,
        file: TempFile,
        irq: Arc<CountingInterrupt>,
        virq: VirtioInterrupt,
    }

    impl Rig {
        fn new() -> Self {
            let pattern: Vec<u8> = (0..DISK_SECTORS * 512).map(|i| (i / 512) as u8).collect();
            let irq = Arc::new(CountingInterrupt::default());
            Self {
                mem: memory(),
                file: TempFile::new(&pattern),
                virq: VirtioInterrupt::new(irq.clone()),
                irq,
            }
        }

        fn handler(&self, vq: &TestQueue, kind: EngineKind, ro: bool) -> BlockHandler {
            let mut serial = [0u8; 20];
            serial[..5].copy_from_slice(b"disk0");
            BlockHandler::new(
                self.mem.clone(),
                vq.create_queue().unwrap(),
                self.virq.clone(),
                bio::open(kind, self.file.open()).unwrap(),
                DiskParams {
                    capacity: DISK_SECTORS,
                    read_only: ro,
                    direct: false,
                    serial,
                },
            )
        }

        /// A handler over the file opened with `O_DIRECT`.
        fn direct_handler(&self, vq: &TestQueue, kind: EngineKind) -> BlockHandler {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&self.file.path)
                .unwrap();
            BlockHandler::new(
                self.mem.clone(),
                vq.create_queue().unwrap(),
                self.virq.clone(),
                bio::open(kind, file).unwrap(),
                DiskParams {
                    capacity: DISK_SECTORS,
                    read_only: false,
                    direct: true,
                    serial: [0; 20],
                },
            )
        }

        /// A queue whose every entry is the same flush chain (head 0), published
        /// `QSIZE` times over, as a hostile driver could: a queue's worth of work.
        fn queue_full_of_one_flush(&self) -> TestQueue<'_> {
            let vq = TestQueue::new(&self.mem, QSIZE);
            self.header(HDR, VIRTIO_BLK_T_FLUSH, 0);
            add_chain(&vq, 0, &[r(HDR, 16), w(STATUS, 1)]);
            for _ in 1..QSIZE {
                publish(&vq, QSIZE, 0);
            }
            vq
        }

        /// A handler whose engine holds every request until told (`HoldEngine`).
        fn hold_handler(&self, vq: &TestQueue) -> BlockHandler {
            BlockHandler::new(
                self.mem.clone(),
                vq.create_queue().unwrap(),
                self.virq.clone(),
                Box::new(HoldEngine::default()),
                DiskParams {
                    capacity: DISK_SECTORS,
                    read_only: false,
                    direct: false,
                    serial: [0; 20],
                },
            )
        }

        fn header(&self, at: u64, kind: u32, sector: u64) {
            self.mem.write_obj(kind, GuestAddress(at)).unwrap();
            self.mem.write_obj(0u32, GuestAddress(at + 4)).unwrap();
            self.mem.write_obj(sector, GuestAddress(at + 8)).unwrap();
            self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        }

        fn status(&self) -> u8 {
            byte(&self.mem, STATUS)
        }
    }

    fn both_engines(f: impl Fn(EngineKind)) {
        f(EngineKind::Sync);
        f(EngineKind::IoUring);
    }

    fn run_all(h: &mut BlockHandler) {
        h.process_queue();
        h.drain();
    }

    #[test]
    fn reads_sectors_into_guest_buffers() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            rig.header(HDR, VIRTIO_BLK_T_IN, 3);
            add_chain(
                &vq,
                0,
                &[r(HDR, 16), w(DATA, 512), w(DATA + 512, 512), w(STATUS, 1)],
            );
            let mut h = rig.handler(&vq, kind, false);
            run_all(&mut h);
            assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
            assert_eq!(byte(&rig.mem, DATA), 3);
            assert_eq!(byte(&rig.mem, DATA + 1023), 4);
            assert_eq!(used(&vq), [(0, 1025)]);
            assert_eq!(rig.irq.count(), 1);
        });
    }

    #[test]
    fn writes_reach_the_file_only_before_acknowledgement() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            rig.header(HDR, VIRTIO_BLK_T_OUT, 1);
            rig.mem
                .write_slice(&[0x5a; 1024], GuestAddress(DATA))
                .unwrap();
            add_chain(&vq, 0, &[r(HDR, 16), r(DATA, 1024), w(STATUS, 1)]);
            let mut h = rig.handler(&vq, kind, false);
            run_all(&mut h);
            assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
            assert_eq!(used(&vq), [(0, 1)]);
            let c = rig.file.contents();
            assert!(c[512..1536].iter().all(|&b| b == 0x5a));
            assert_eq!(c[511], 0);
            assert_eq!(c[1536], 3);
        });
    }

    #[test]
    fn a_batch_raises_one_interrupt_and_flush_follows_writes() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            for i in 0..4u64 {
                let hdr = HDR + i * 16;
                rig.header(hdr, VIRTIO_BLK_T_OUT, i);
                add_chain(
                    &vq,
                    (i * 3) as u16,
                    &[r(hdr, 16), r(DATA, 512), w(STATUS + i, 1)],
                );
            }
            rig.header(HDR + 0x100, VIRTIO_BLK_T_FLUSH, 0);
            add_chain(&vq, 12, &[r(HDR + 0x100, 16), w(STATUS + 8, 1)]);
            rig.mem.write_slice(&[7; 512], GuestAddress(DATA)).unwrap();
            let mut h = rig.handler(&vq, kind, false);
            run_all(&mut h);
            let u = used(&vq);
            assert_eq!(u.len(), 5);
            // The flush is drained behind the writes, so it is acknowledged last.
            assert_eq!(u.last().unwrap().0, 12);
            // Synchronous completions all land in one batch. io_uring's land as
            // the kernel finishes them: one reap may find them all, or (on a
            // loaded host, with the writes punted to kernel workers) each its
            // own; still never more than one interrupt per request.
            match kind {
                EngineKind::Sync => assert_eq!(rig.irq.count(), 1, "one interrupt per batch"),
                _ => assert!((1..=5).contains(&rig.irq.count()), "{}", rig.irq.count()),
            }
            for i in 0..4 {
                assert_eq!(byte(&rig.mem, STATUS + i), 0);
            }
            assert_eq!(byte(&rig.mem, STATUS + 8), 0);
            assert!(rig.file.contents()[..2048].iter().all(|&b| b == 7));
        });
    }

    #[test]
    fn get_id_discard_and_write_zeroes() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            rig.header(HDR, VIRTIO_BLK_T_GET_ID, 0);
            add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 20), w(STATUS, 1)]);
            let mut h = rig.handler(&vq, kind, false);
            run_all(&mut h);
            let mut id = [0u8; 20];
            rig.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
            assert_eq!(&id[..6], b"disk0\0");
            assert_eq!(used(&vq), [(0, 21)]);

            for (i, (t, sector)) in [
                (VIRTIO_BLK_T_WRITE_ZEROES, 8u64),
                (VIRTIO_BLK_T_DISCARD, 16),
            ]
            .into_iter()
            .enumerate()
            {
                let hdr = HDR + 0x40 * (i as u64 + 1);
                let seg = DATA + 0x100 * (i as u64 + 1);
                rig.header(hdr, t, 0);
                rig.mem.write_obj(sector, GuestAddress(seg)).unwrap();
                rig.mem.write_obj(8u32, GuestAddress(seg + 8)).unwrap();
                rig.mem.write_obj(0u32, GuestAddress(seg + 12)).unwrap();
                add_chain(
                    &vq,
                    3 + 3 * i as u16,
                    &[r(hdr, 16), r(seg, 16), w(STATUS, 1)],
                );
                run_all(&mut h);
                assert_eq!(rig.status(), 0, "type {t}");
            }
            let c = rig.file.contents();
            assert_eq!(c.len() as u64, DISK_SECTORS * 512, "size kept");
            assert!(c[8 * 512..24 * 512].iter().all(|&b| b == 0));
            assert_eq!(c[7 * 512], 7);
            assert_eq!(c[24 * 512], 24);
        });
    }

    #[test]
    fn read_only_disks_refuse_writes_and_leave_the_file_identical() {
        both_engines(|kind| {
            let rig = Rig::new();
            let before = rig.file.contents();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            rig.header(HDR, VIRTIO_BLK_T_OUT, 0);
            add_chain(&vq, 0, &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]);
            rig.header(HDR + 16, VIRTIO_BLK_T_DISCARD, 0);
            add_chain(&vq, 3, &[r(HDR + 16, 16), r(DATA, 16), w(STATUS + 1, 1)]);
            rig.header(HDR + 32, VIRTIO_BLK_T_WRITE_ZEROES, 0);
            add_chain(&vq, 6, &[r(HDR + 32, 16), r(DATA, 16), w(STATUS + 2, 1)]);
            let mut h = rig.handler(&vq, kind, true);
            rig.mem.write_slice(&[0; 16], GuestAddress(DATA)).unwrap();
            rig.mem.write_obj(1u32, GuestAddress(DATA + 8)).unwrap();
            run_all(&mut h);
            for i in 0..3 {
                assert_eq!(byte(&rig.mem, STATUS + i), VIRTIO_BLK_S_IOERR as u8);
            }
            assert_eq!(used(&vq).len(), 3);
            assert_eq!(rig.file.contents(), before);
        });
    }

    #[test]
    fn bad_requests_get_error_statuses() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let cases: [(u32, u64, Vec<Seg>, u32); 7] = [
            // Past the end of the disk.
            (
                VIRTIO_BLK_T_IN,
                DISK_SECTORS,
                vec![r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
                VIRTIO_BLK_S_IOERR,
            ),
            // Sector arithmetic overflowing.
            (
                VIRTIO_BLK_T_IN,
                u64::MAX,
                vec![r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
                VIRTIO_BLK_S_IOERR,
            ),
            // Not a whole sector.
            (
                VIRTIO_BLK_T_OUT,
                0,
                vec![r(HDR, 16), r(DATA, 100), w(STATUS, 1)],
                VIRTIO_BLK_S_IOERR,
            ),
            // Unknown type.
            (99, 0, vec![r(HDR, 16), w(STATUS, 1)], VIRTIO_BLK_S_UNSUPP),
            // Header in a device-writable buffer.
            (
                VIRTIO_BLK_T_IN,
                0,
                vec![w(HDR, 16), w(DATA, 512), w(STATUS, 1)],
                VIRTIO_BLK_S_IOERR,
            ),
            // Data outside guest memory.
            (
                VIRTIO_BLK_T_IN,
                0,
                vec![r(HDR, 16), w(1 << 40, 512), w(STATUS, 1)],
                VIRTIO_BLK_S_IOERR,
            ),
            // Readable after writable.
            (
                VIRTIO_BLK_T_OUT,
                0,
                vec![r(HDR, 16), w(DATA, 512), r(DATA, 512), w(STATUS, 1)],
                VIRTIO_BLK_S_IOERR,
            ),
        ];
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        for (i, (t, sector, segs, want)) in cases.iter().enumerate() {
            rig.header(HDR, *t, *sector);
            add_chain(&vq, 0, segs);
            run_all(&mut h);
            assert_eq!(u32::from(rig.status()), *want, "case {i}");
            assert_eq!(used(&vq).len(), i + 1, "case {i} returned");
        }
        assert!(!rig.virq.needs_reset());
        assert_eq!(rig.file.contents()[0], 0, "nothing written");
    }

    #[test]
    fn chains_without_a_writable_status_are_dropped_with_needs_reset() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_IN, 0);
        // Status byte device-readable.
        add_chain(&vq, 0, &[r(HDR, 16), r(STATUS, 1)]);
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        run_all(&mut h);
        assert_eq!(rig.status(), 0xff, "nothing written");
        assert!(rig.virq.needs_reset());
        assert_eq!(used(&vq), [(0, 0)], "the chain is still returned");
    }

    #[test]
    fn looping_and_overlong_chains_do_not_hang() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_IN, 0);
        let next = VRING_DESC_F_NEXT as u16;
        let wr = VRING_DESC_F_WRITE as u16;
        // 0 -> 1 -> 2 -> 1 -> ...
        put_desc(&vq, 0, HDR, 16, next, 1);
        put_desc(&vq, 1, DATA, 512, next | wr, 2);
        put_desc(&vq, 2, STATUS, 1, next | wr, 1);
        publish(&vq, QSIZE, 0);
        // Next index beyond the table.
        put_desc(&vq, 5, HDR, 16, next, 200);
        publish(&vq, QSIZE, 5);
        // Head index beyond the table.
        publish(&vq, QSIZE, 900);
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        run_all(&mut h);
        assert!(rig.virq.needs_reset());
        // The first two come back; the bogus head cannot be put in the used ring.
        assert_eq!(used(&vq), [(0, 0), (5, 0)]);
    }

    #[test]
    fn an_avail_index_far_ahead_breaks_the_queue_not_the_vmm() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        vq.set_avail_idx(QSIZE + 5);
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        assert!(!h.process_queue());
        assert!(rig.virq.needs_reset());
        assert!(used(&vq).is_empty());
        assert!(!h.process_queue(), "stays broken until reset");
    }

    #[test]
    fn one_wakeup_takes_at_most_a_queue_worth() {
        let rig = Rig::new();
        let vq = rig.queue_full_of_one_flush();
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        assert!(h.process_queue(), "a full ring may have more");
        h.drain();
        assert_eq!(vq.used_idx(), QSIZE);
        assert!(!h.process_queue());
    }

    #[test]
    fn indirect_chains_are_followed() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_IN, 2);
        let table = DATA_START + 0x8000;
        let descs = [
            (HDR, 16, VRING_DESC_F_NEXT),
            (DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE),
            (STATUS, 1, VRING_DESC_F_WRITE),
        ];
        for (i, (a, l, f)) in descs.into_iter().enumerate() {
            let d = virtio_queue::desc::split::Descriptor::new(a, l, f as u16, i as u16 + 1);
            rig.mem
                .write_obj(d, GuestAddress(table + 16 * i as u64))
                .unwrap();
        }
        put_desc(
            &vq,
            0,
            table,
            48,
            virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16,
            0,
        );
        publish(&vq, QSIZE, 0);
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        run_all(&mut h);
        assert_eq!(rig.status(), 0);
        assert_eq!(byte(&rig.mem, DATA), 2);
    }

    /// A batch of unaligned O_DIRECT requests bigger than the bounce budget: every one is
    /// served, but never more bounce memory at once than the budget.
    #[test]
    fn direct_io_bounce_memory_stays_within_the_budget() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.direct_handler(&vq, EngineKind::IoUring);
        h.set_bounce_budget(2048);
        // Five unaligned 1 KiB writes, all available at once: 5 KiB if all bounced together.
        for i in 0..5u64 {
            let at = DATA + i * 0x400 + 1;
            let hdr = HDR + i * 16;
            let status = STATUS + i;
            rig.mem
                .write_obj(VIRTIO_BLK_T_OUT, GuestAddress(hdr))
                .unwrap();
            rig.mem.write_obj(i * 2, GuestAddress(hdr + 8)).unwrap();
            rig.mem
                .write_slice(&[i as u8 + 1; 1024], GuestAddress(at))
                .unwrap();
            add_chain(
                &vq,
                (i * 3) as u16,
                &[r(hdr, 16), r(at, 1024), w(status, 1)],
            );
        }
        run_all(&mut h);
        for i in 0..5u64 {
            assert_eq!(byte(&rig.mem, STATUS + i), 0, "request {i}");
            let at = (i * 2 * 512) as usize;
            assert!(
                rig.file.contents()[at..at + 1024]
                    .iter()
                    .all(|&b| b == i as u8 + 1)
            );
        }
        assert!(h.peak_bounced() > 0);
        assert!(h.peak_bounced() <= 2048, "peak {}", h.peak_bounced());
    }

    #[test]
    fn direct_io_bounces_unaligned_guest_buffers() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.direct_handler(&vq, EngineKind::IoUring);
        // Write from an odd address, then read back into another odd address.
        rig.header(HDR, VIRTIO_BLK_T_OUT, 4);
        rig.mem
            .write_slice(&[0x33; 512], GuestAddress(DATA + 3))
            .unwrap();
        add_chain(
            &vq,
            0,
            &[
                r(HDR, 16),
                r(DATA + 3, 300),
                r(DATA + 303, 212),
                w(STATUS, 1),
            ],
        );
        run_all(&mut h);
        assert_eq!(rig.status(), 0);
        assert!(rig.file.contents()[2048..2560].iter().all(|&b| b == 0x33));
        rig.header(HDR, VIRTIO_BLK_T_IN, 4);
        add_chain(&vq, 4, &[r(HDR, 16), w(DATA + 0x801, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(rig.status(), 0);
        assert_eq!(byte(&rig.mem, DATA + 0x801), 0x33);
        assert_eq!(byte(&rig.mem, DATA + 0x800 + 512), 0x33);
    }

    #[test]
    fn a_chain_at_the_segment_cap_is_served_and_one_past_it_fails_alone() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            let mut h = rig.handler(&vq, kind, false);
            // Only an indirect table can carry this many descriptors.
            let table = DATA_START + 0x2_0000;
            let mut h_chain = |head, sector, data: &[Seg]| {
                rig.header(HDR, VIRTIO_BLK_T_IN, sector);
                let mut segs = vec![r(HDR, 16)];
                segs.extend_from_slice(data);
                segs.push(w(STATUS, 1));
                add_indirect_chain(&vq, head, table, &segs);
                run_all(&mut h);
            };
            // At the cap: one sector in 2-byte pieces.
            let pieces: Vec<Seg> = (0..MAX_SEGMENTS as u64)
                .map(|i| w(DATA + 2 * i, 2))
                .collect();
            assert_eq!(pieces.len() * 2, 512);
            h_chain(0, 3, &pieces);
            assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
            let mut got = [0u8; 512];
            rig.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
            assert!(got.iter().all(|&b| b == 3));
            assert_eq!(used(&vq), [(0, 513)]);

            // One past: still whole sectors, so only the count is wrong.
            rig.mem
                .write_slice(&[0xee; 1024], GuestAddress(DATA))
                .unwrap();
            let mut pieces = pieces;
            pieces.push(w(DATA + 512, 512));
            h_chain(1, 5, &pieces);
            assert_eq!(rig.status(), VIRTIO_BLK_S_IOERR as u8);
            assert_eq!(used(&vq)[1], (1, 1));
            let mut got = [0u8; 1024];
            rig.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
            assert!(got.iter().all(|&b| b == 0xee), "nothing read");
            assert!(!rig.virq.needs_reset());

            // The device goes on.
            rig.header(HDR, VIRTIO_BLK_T_IN, 7);
            add_chain(&vq, 2, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
            run_all(&mut h);
            assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
            assert_eq!(byte(&rig.mem, DATA), 7);
            assert_eq!(used(&vq).len(), 3);
        });
    }

    #[test]
    fn slot_buffers_carry_nothing_over_to_the_next_request() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            let mut h = rig.handler(&vq, kind, false);
            // Two sectors into two buffers, then one sector into one: the second request
            // gets the same slot and must use one iovec, not the first's two.
            rig.header(HDR, VIRTIO_BLK_T_IN, 3);
            add_chain(
                &vq,
                0,
                &[r(HDR, 16), w(DATA, 256), w(DATA + 0x400, 768), w(STATUS, 1)],
            );
            run_all(&mut h);
            assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
            assert_eq!(byte(&rig.mem, DATA + 0x400 + 767), 4);
            rig.mem
                .write_slice(&[0xee; 0x800], GuestAddress(DATA))
                .unwrap();
            rig.header(HDR, VIRTIO_BLK_T_IN, 9);
            add_chain(&vq, 4, &[r(HDR, 16), w(DATA + 0x1000, 512), w(STATUS, 1)]);
            run_all(&mut h);
            assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
            assert_eq!(h.slots.len(), 1, "the slot was reused");
            assert_eq!(byte(&rig.mem, DATA + 0x1000), 9);
            assert_eq!(byte(&rig.mem, DATA + 0x1000 + 511), 9);
            let mut old = [0u8; 0x800];
            rig.mem.read_slice(&mut old, GuestAddress(DATA)).unwrap();
            assert!(old.iter().all(|&b| b == 0xee), "old buffers untouched");
            assert_eq!(used(&vq), [(0, 1025), (4, 513)]);
        });

        // O_DIRECT: a bounced read leaves copy-back segments in its slot; an aligned read
        // in the same slot must not copy anything to them.
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.direct_handler(&vq, EngineKind::IoUring);
        rig.header(HDR, VIRTIO_BLK_T_IN, 4);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA + 1, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(byte(&rig.mem, DATA + 512), 4);
        rig.mem
            .write_slice(&[0xee; 0x400], GuestAddress(DATA))
            .unwrap();
        rig.header(HDR, VIRTIO_BLK_T_IN, 6);
        add_chain(&vq, 3, &[r(HDR, 16), w(DATA + 0x1000, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(h.slots.len(), 1, "the slot was reused");
        assert_eq!(byte(&rig.mem, DATA + 0x1000), 6);
        let mut old = [0u8; 0x400];
        rig.mem.read_slice(&mut old, GuestAddress(DATA)).unwrap();
        assert!(old.iter().all(|&b| b == 0xee), "no stale copy-back");
    }

    #[test]
    fn steady_state_requests_allocate_nothing() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            let mut h = rig.handler(&vq, kind, false);
            // Eight requests in flight at once, each in three descriptors or more.
            let reads: Vec<u16> = (0..8).map(|i| i * 2).collect();
            for (i, &head) in reads.iter().enumerate() {
                let i = i as u64;
                let hdr = HDR + 16 * i;
                let buf = DATA + 0x200 * i;
                rig.header(hdr, VIRTIO_BLK_T_IN, i);
                let data = [w(buf, 100), w(buf + 100, 412)];
                let table = DATA_START + 0x2_0000 + 0x100 * i;
                add_indirect_chain(
                    &vq,
                    head,
                    table,
                    &[r(hdr, 16), data[0], data[1], w(STATUS + i, 1)],
                );
            }
            // Mixed work for the measured rounds: writes, a flush, a discard and GET_ID.
            let mixed: Vec<u16> = (0..8).map(|i| i * 2 + 1).collect();
            let mixed_hdr = HDR + 0x200;
            for (i, &head) in mixed.iter().enumerate() {
                let i = i as u64;
                let hdr = mixed_hdr + 16 * i;
                let buf = DATA + 0x200 * i;
                let table = DATA_START + 0x3_0000 + 0x100 * i;
                let status = w(STATUS + 16 + i, 1);
                let segs = match i {
                    0 => {
                        rig.mem
                            .write_obj(VIRTIO_BLK_T_FLUSH, GuestAddress(hdr))
                            .unwrap();
                        vec![r(hdr, 16), status]
                    }
                    1 => {
                        rig.mem
                            .write_obj(VIRTIO_BLK_T_GET_ID, GuestAddress(hdr))
                            .unwrap();
                        vec![r(hdr, 16), w(buf, 20), status]
                    }
                    2 => {
                        let seg = DATA_START + 0x4_0000;
                        rig.mem
                            .write_obj(VIRTIO_BLK_T_DISCARD, GuestAddress(hdr))
                            .unwrap();
                        rig.mem.write_obj(32u64, GuestAddress(seg)).unwrap();
                        rig.mem.write_obj(8u32, GuestAddress(seg + 8)).unwrap();
                        rig.mem.write_obj(0u32, GuestAddress(seg + 12)).unwrap();
                        vec![r(hdr, 16), r(seg, 16), status]
                    }
                    _ => {
                        rig.mem
                            .write_obj(VIRTIO_BLK_T_OUT, GuestAddress(hdr))
                            .unwrap();
                        rig.mem.write_obj(40 + i, GuestAddress(hdr + 8)).unwrap();
                        vec![r(hdr, 16), r(buf, 300), r(buf + 300, 212), status]
                    }
                };
                add_indirect_chain(&vq, head, table, &segs);
            }
            // Warm-up: the helpers published every request once; then the reads twice over,
            // so that every slot has held a two-iovec request, whichever slot a request
            // lands in later.
            run_all(&mut h);
            for &head in reads.iter().chain(&reads) {
                publish(&vq, QSIZE, head);
            }
            run_all(&mut h);
            assert_eq!(vq.used_idx(), 32);
            let mut allocated = 0;
            for round in 0..20 {
                let heads = if round % 2 == 0 { &reads } else { &mixed };
                for &head in heads {
                    publish(&vq, QSIZE, head);
                }
                let before = allocations();
                run_all(&mut h);
                allocated += allocations() - before;
            }
            assert_eq!(vq.used_idx(), 32 + 20 * 8);
            assert!(!rig.virq.needs_reset());
            for i in 0..8 {
                assert_eq!(byte(&rig.mem, STATUS + i), 0, "read {i}");
                assert_eq!(byte(&rig.mem, STATUS + 16 + i), 0, "mixed {i}");
            }
            assert_eq!(
                allocated, 0,
                "{kind:?}: heap allocations while serving requests"
            );
        });
    }

    #[test]
    fn no_interrupt_flag_is_honoured() {
        both_engines(|kind| {
            let rig = Rig::new();
            let vq = TestQueue::new(&rig.mem, QSIZE);
            let mut h = rig.handler(&vq, kind, false);
            // A polling driver: no interrupts, please.
            vq.set_avail_flags(VRING_AVAIL_F_NO_INTERRUPT as u16);
            rig.header(HDR, VIRTIO_BLK_T_IN, 1);
            add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
            run_all(&mut h);
            assert_eq!(used(&vq), [(0, 513)], "completed all the same");
            assert_eq!(rig.irq.count(), 0, "no interrupt with NO_INTERRUPT set");
            // The driver wants them again.
            vq.set_avail_flags(0);
            rig.header(HDR, VIRTIO_BLK_T_IN, 2);
            add_chain(&vq, 3, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
            run_all(&mut h);
            assert_eq!(used(&vq).len(), 2);
            assert_eq!(rig.irq.count(), 1);
        });
    }

    #[test]
    fn polling_sets_no_notify_and_clears_it_after() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        assert_eq!(vq.used_flags(), 0);
        h.suppress_notifications();
        assert_eq!(vq.used_flags(), VRING_USED_F_NO_NOTIFY as u16);
        assert!(!h.has_work());
        assert!(!h.resume_notifications(), "nothing arrived");
        assert_eq!(vq.used_flags(), 0);
    }

    #[test]
    fn a_request_published_as_polling_ends_is_not_lost() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.handler(&vq, EngineKind::Sync, false);
        h.suppress_notifications();
        assert!(!h.has_work());
        // The driver publishes while the flag is still set, so it does not notify; the
        // device gives up polling right after.
        rig.header(HDR, VIRTIO_BLK_T_IN, 5);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        assert!(
            h.resume_notifications(),
            "the late request must be reported"
        );
        assert_eq!(vq.used_flags(), 0);
        h.process_queue();
        assert_eq!(used(&vq), [(0, 513)]);
        assert_eq!(byte(&rig.mem, DATA), 5);
        assert!(!h.resume_notifications());
    }

    #[test]
    fn has_work_sees_requests_only_with_room_and_io_uring_completions() {
        let rig = Rig::new();
        let vq = rig.queue_full_of_one_flush();
        let mut h = rig.hold_handler(&vq);
        assert!(h.has_work());
        h.process_queue();
        publish(&vq, QSIZE, 0);
        assert!(
            !h.has_work(),
            "a full queue in flight: nothing can be taken"
        );
        h.drain();
        assert!(h.has_work(), "room again");

        // io_uring: a finished request is work before anyone reaps it.
        let vq = TestQueue::create(&rig.mem, GuestAddress(0x8_0000), QSIZE);
        let mut h = rig.handler(&vq, EngineKind::IoUring, false);
        rig.header(HDR, VIRTIO_BLK_T_IN, 1);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        h.process_queue();
        let start = Instant::now();
        while vq.used_idx() == 0 {
            assert!(start.elapsed() < Duration::from_secs(5), "never completed");
            if h.has_work() {
                h.process_completions();
            }
        }
        assert!(!h.has_work());
        assert_eq!(used(&vq), [(0, 513)]);
    }

    #[test]
    fn the_poll_window_adapts() {
        let us = Duration::from_micros;
        let mut p = PollWindow::new(us(32));
        assert_eq!(p.window(), us(32));
        // Work within the window: the sweet spot.
        p.record(us(3));
        assert_eq!(p.window(), us(32));
        // Idle longer than the maximum: halve, down to zero.
        for want in [16, 8, 4, 0, 0] {
            p.record(us(1000));
            assert_eq!(p.window(), us(want));
        }
        // Work soon after sleeping: polling would have caught it, grow.
        p.record(us(2));
        assert_eq!(p.window(), Duration::from_nanos(POLL_GROW_START_NS));
        p.record(us(6));
        assert_eq!(p.window(), us(8));
        p.record(us(20));
        assert_eq!(p.window(), us(16));
        p.record(us(30));
        p.record(us(30));
        assert_eq!(p.window(), us(32), "capped at the maximum");
        // Zero never polls.
        let mut off = PollWindow::new(Duration::ZERO);
        off.record(us(2));
        assert_eq!(off.window(), Duration::ZERO);
    }

    #[test]
    fn waiting_for_the_disk_and_for_the_driver_adapt_separately() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.hold_handler(&vq);
        let max = Duration::from_micros(32);
        let mut win = Windows {
            guest: PollWindow::new(max),
            engine: PollWindow::new(max),
        };
        // A slow disk: every wait with I/O in flight is long.
        rig.header(HDR, VIRTIO_BLK_T_FLUSH, 0);
        add_chain(&vq, 0, &[r(HDR, 16), w(STATUS, 1)]);
        h.process_queue();
        for _ in 0..8 {
            win.for_state(&h).record(Duration::from_millis(1));
        }
        assert_eq!(win.engine.window(), Duration::ZERO);
        h.drain();
        // ...while the driver still answers within the window.
        assert_eq!(win.for_state(&h).window(), max);
    }

    /// Waits up to 5 s for `cond`.
    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "timed out: {what}"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    #[test]
    fn the_io_thread_takes_unnotified_requests_while_polling_then_sleeps() {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let h = rig.handler(&vq, EngineKind::Sync, false);
        let queue_evt = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let kick = queue_evt.try_clone().unwrap();
        // A long window, so the test does not race it; it still ends.
        let window = Duration::from_millis(300);
        let mut worker = crate::devices::virtio::worker::Worker::spawn(
            "ember-blk-test".into(),
            crate::seccomp::Thread::Block,
            move |kill| run(h, queue_evt, kill, window),
        )
        .unwrap();
        rig.header(HDR, VIRTIO_BLK_T_IN, 1);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        kick.write(1).unwrap();
        wait_for("first request", || vq.used_idx() == 1);
        // Polling now: the driver is told not to notify, and need not.
        wait_for("NO_NOTIFY set", || {
            vq.used_flags() == VRING_USED_F_NO_NOTIFY as u16
        });
        rig.mem
            .write_obj(VIRTIO_BLK_T_IN, GuestAddress(HDR + 0x40))
            .unwrap();
        rig.mem.write_obj(2u64, GuestAddress(HDR + 0x48)).unwrap();
        add_chain(&vq, 3, &[r(HDR + 0x40, 16), w(DATA, 512), w(STATUS, 1)]);
        // Never notified: polling takes it, or the look after polling does.
        wait_for("unnotified request", || vq.used_idx() == 2);
        assert_eq!(byte(&rig.mem, DATA), 2);
        // Out of work, the window runs out and notifications come back on.
        wait_for("NO_NOTIFY cleared", || vq.used_flags() == 0);
        // Sleeping now: a notified request still gets served.
        rig.header(HDR, VIRTIO_BLK_T_IN, 3);
        add_chain(&vq, 6, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        kick.write(1).unwrap();
        wait_for("notified request", || vq.used_idx() == 3);
        worker.stop();
        assert_eq!(byte(&rig.mem, DATA), 3);
    }

    /// An engine that completes nothing until asked to wait.
    #[derive(Default)]
    struct HoldEngine {
        held: Vec<u64>,
        done: Vec<Completion>,
    }

    impl Engine for HoldEngine {
        unsafe fn push(&mut self, _op: Op, token: u64) -> io::Result<()> {
            self.held.push(token);
            Ok(())
        }
        fn submit(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn reap(&mut self, out: &mut Vec<Completion>) {
            out.append(&mut self.done);
        }
        fn wait(&mut self) -> io::Result<()> {
            self.done.extend(self.held.drain(..).map(|t| (t, Ok(0))));
            Ok(())
        }
        fn notifier(&self) -> Option<std::os::fd::RawFd> {
            None
        }
        fn has_completions(&mut self) -> bool {
            !self.done.is_empty()
        }
        fn name(&self) -> &'static str {
            "hold"
        }
    }

    #[test]
    fn in_flight_work_is_capped_at_the_queue_size() {
        let rig = Rig::new();
        let vq = rig.queue_full_of_one_flush();
        let mut h = rig.hold_handler(&vq);
        assert!(h.process_queue());
        assert_eq!(h.in_flight(), usize::from(QSIZE));
        for _ in 0..QSIZE {
            publish(&vq, QSIZE, 0);
        }
        assert!(!h.process_queue(), "no room: nothing taken");
        assert!(h.take_throttled());
        assert_eq!(h.in_flight(), usize::from(QSIZE));
        h.drain();
        assert_eq!(h.in_flight(), 0);
        assert_eq!(vq.used_idx(), QSIZE);
        assert!(h.process_queue());
        h.drain();
        assert_eq!(vq.used_idx(), 2 * QSIZE);
    }

    use std::os::unix::fs::OpenOptionsExt;
}
