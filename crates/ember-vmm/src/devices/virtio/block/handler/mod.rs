//! The virtio-blk request handler: the queue logic of a disk's I/O thread, free of epoll
//! so tests, benchmarks and fuzzing can drive it ([`BlockHandler`]).
//!
//! Each pass drains the available ring — at most one queue's worth, since a buggy or
//! malicious driver can keep adding while we read — submits the batch, completes whatever
//! has finished into the used ring and raises the interrupt once for the batch, unless the
//! driver asked for none (`VRING_AVAIL_F_NO_INTERRUPT`). A request is acknowledged (put in
//! the used ring) only after its syscall has completed. The thread around it is
//! [`super::event_loop`].

use std::io;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

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
pub(crate) const BOUNCE_BUDGET: usize = 64 << 20;
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
    #[cfg(test)]
    pub(crate) fn set_bounce_budget(&mut self, bytes: usize) {
        self.bounce_budget = bytes;
    }

    /// The most bounce-buffer memory that was held at once.
    #[cfg(test)]
    pub(crate) fn peak_bounced(&self) -> usize {
        self.peak_bounced
    }

    /// Requests submitted and not yet completed.
    pub(crate) fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The engine's completion eventfd, for the I/O thread's epoll (none: completions
    /// come back as the requests are submitted).
    pub(crate) fn completion_notifier(&self) -> Option<std::os::fd::RawFd> {
        self.engine.notifier()
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
    pub(crate) fn process_completions(&mut self) {
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
    pub(crate) fn has_work(&mut self) -> bool {
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
    pub(crate) fn is_broken(&self) -> bool {
        self.broken
    }

    /// Asks the driver not to notify (`VRING_USED_F_NO_NOTIFY`): the thread is about to
    /// poll the available ring instead.
    pub(crate) fn suppress_notifications(&mut self) {
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
    pub(crate) fn resume_notifications(&mut self) -> bool {
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
    pub(crate) fn take_throttled(&mut self) -> bool {
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

#[cfg(test)]
mod tests;
