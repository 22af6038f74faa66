//! The device's queues: frames from the transmit queue to the backend, and from the
//! backend into the receive queue's buffers. A plain state machine the I/O thread
//! (`event_loop`) drives, and unit tests and the fuzz target drive directly.
//!
//! Frames are copied through one buffer per direction: a frame is at most
//! [`MAX_BUFFER`] bytes whatever the guest's descriptors say, and every guest
//! address is checked by the copy. A driver that breaks the protocol (a writable
//! descriptor to transmit, a readable one to receive into, a frame larger than any
//! frame can be, a buffer outside its memory, a corrupt ring) gets the device marked
//! `NEEDS_RESET` and the queues stop until it resets the device.

use std::io;
use std::num::Wrapping;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::backend::Backend;
use super::rate_limiter::Limiter;
use super::{DEVICE, HDR_LEN, MAX_BUFFER, NetCounters};
use crate::devices::virtio::{GuestMemory, VirtioInterrupt, needs_interrupt};

/// Offset of `num_buffers` in the header.
const NUM_BUFFERS: usize = 10;
/// How long the receive side rests after a backend error other than "nothing waiting",
/// so that a broken backend costs no busy loop.
const ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// How long a starved receive queue waits for the driver to cross a raised
/// avail event (`rx_notify_after`) before it looks at the ring anyway: a
/// safety net for a driver that gives back fewer buffers than it once had
/// out, not a pace (a driver that refills crosses the event well before).
const RX_RECHECK: Duration = Duration::from_millis(1);

/// The most pieces one readv or writev takes (`IOV_MAX`).
const MAX_PIECES: usize = 1024;

/// How many sent chains wait in the used ring before its index moves past them:
/// one index store (and one cache line taken from the polling driver) for that
/// many frames rather than each, while an eighth of a 256-entry ring leaves the
/// driver room to go on filling it.
const TX_USED_BATCH: u16 = 32;

/// How `receive_direct` went.
enum Direct {
    /// A frame went into the guest's buffers.
    Delivered,
    /// A frame was read but waits in `rx_buf` (no room in place, or the rate
    /// limit): deliver it by copying.
    Held,
    /// Nothing this time, but look again.
    Again,
    /// No frame, no buffers, or the device broke.
    Stop,
}

/// Pieces of guest memory (or of the device's buffers) for one readv or
/// writev: raw pointers, so not `Send` by themselves.
struct Pieces(Vec<libc::iovec>);

// SAFETY: the pointers are filled in and used by the one thread that owns the
// handler, within one frame's handling; between frames they are stale and never
// read.
unsafe impl Send for Pieces {}

impl std::ops::Deref for Pieces {
    type Target = Vec<libc::iovec>;
    fn deref(&self) -> &Vec<libc::iovec> {
        &self.0
    }
}

impl std::ops::DerefMut for Pieces {
    fn deref_mut(&mut self) -> &mut Vec<libc::iovec> {
        &mut self.0
    }
}

/// The pieces without their first `n` bytes (they hold at least `n`).
fn skip_front(iov: &mut [libc::iovec], mut n: usize) -> &[libc::iovec] {
    let mut i = 0;
    while i < iov.len() && n >= iov[i].iov_len {
        n -= iov[i].iov_len;
        i += 1;
    }
    if n > 0 {
        iov[i].iov_base = iov[i].iov_base.cast::<u8>().wrapping_add(n).cast();
        iov[i].iov_len -= n;
    }
    &iov[i..]
}

/// Queue indices.
pub(crate) const RX: usize = 0;
pub(crate) const TX: usize = 1;

/// Why a frame could not go into the receive queue.
enum Deliver {
    Done,
    /// The frame fits no buffer (without mergeable buffers) and was dropped.
    Dropped,
    /// Not enough buffers up to this available index: the frame waits for more.
    NoBuffers(u16),
    /// The driver broke the protocol.
    Broken,
}

/// Both queues of an active device and the backend they move frames through.
pub(crate) struct NetHandler {
    pub(crate) mem: GuestMemory,
    pub(crate) rx: Queue,
    pub(crate) tx: Queue,
    pub(crate) irq: VirtioInterrupt,
    pub(crate) backend: Arc<dyn Backend>,
    /// `VIRTIO_NET_F_MRG_RXBUF`: a frame may span several receive chains.
    mrg_rxbuf: bool,
    rx_buf: Box<[u8]>,
    /// Length of the frame waiting in `rx_buf` (header included); 0: none.
    rx_len: usize,
    /// Whether the waiting frame's tokens are already taken.
    rx_paid: bool,
    tx_buf: Box<[u8]>,
    rx_limit: Limiter,
    tx_limit: Limiter,
    /// When the rate limiter (or a backend error) lets each direction go on.
    rx_wait: Option<Instant>,
    /// The receive ring had no buffer and the driver was asked to notify when
    /// it adds one: until then a readable backend is no reason to wake (it
    /// stays readable, and watching it would spin the I/O thread on a core
    /// the driver needs to refill the ring).
    rx_starved: bool,
    /// The most receive buffers the driver has had out at once (made
    /// available and not yet used): how deep it fills the ring, and so how
    /// many it gives back after the device has used them all.
    rx_depth: u16,
    /// Starved behind a raised avail event: when to look at the ring anyway,
    /// and the available index it starved at.
    rx_recheck: Option<(Instant, u16)>,
    tx_wait: Option<Instant>,
    /// The driver broke the protocol: nothing more until a reset.
    broken: bool,
    /// Receive chains gathered for the frame being delivered: (head, segments end),
    /// then (head, bytes written).
    chains: Vec<(u16, usize)>,
    /// Receive chains used since the driver was last asked about an interrupt.
    rx_added: u16,
    /// Transmit chains in the used ring past its published index (`publish_tx`).
    tx_pending: u16,
    /// Transmit chains published since the driver was last asked about an
    /// interrupt.
    tx_added: u16,
    /// The driver wants an interrupt for chains used since the last one; raised
    /// once per wake-up of the I/O thread (`raise_interrupt`), whichever queues
    /// (one line serves both).
    irq_due: bool,
    segs: Vec<(GuestAddress, u32)>,
    /// The current frame's pieces for readv/writev, and (receiving) the guest
    /// address of each.
    iov: Pieces,
    iov_addr: Vec<GuestAddress>,
    /// How many bytes the last frame received had: how much buffer the next
    /// read straight into the guest's buffers offers.
    rx_want: usize,
    counters: Arc<NetCounters>,
}

impl NetHandler {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        mem: GuestMemory,
        rx: Queue,
        tx: Queue,
        irq: VirtioInterrupt,
        backend: Arc<dyn Backend>,
        mrg_rxbuf: bool,
        rx_limit: Limiter,
        tx_limit: Limiter,
        counters: Arc<NetCounters>,
    ) -> Self {
        NetHandler {
            mem,
            rx,
            tx,
            irq,
            backend,
            mrg_rxbuf,
            rx_buf: vec![0; MAX_BUFFER].into_boxed_slice(),
            rx_len: 0,
            rx_paid: false,
            tx_buf: vec![0; MAX_BUFFER].into_boxed_slice(),
            rx_limit,
            tx_limit,
            rx_wait: None,
            rx_starved: false,
            rx_depth: 0,
            rx_recheck: None,
            tx_wait: None,
            broken: false,
            chains: Vec::new(),
            rx_added: 0,
            tx_pending: 0,
            tx_added: 0,
            irq_due: false,
            segs: Vec::new(),
            iov: Pieces(Vec::new()),
            iov_addr: Vec::new(),
            rx_want: 1,
            counters,
        }
    }

    /// Whether the backend's descriptor should be watched: there is room for a frame
    /// (none waiting, a buffer to put it in) and the rate limit allows one.
    pub(crate) fn wants_backend(&self) -> bool {
        !self.broken && self.rx_len == 0 && self.rx_wait.is_none() && !self.rx_starved
    }

    /// The earliest moment a rate-limited direction may go on, or a starved
    /// receive queue looks at its ring again.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        [self.rx_wait, self.tx_wait, self.rx_recheck.map(|(t, _)| t)]
            .into_iter()
            .flatten()
            .min()
    }

    /// Time passed: each direction whose wait is over goes on.
    pub(crate) fn on_timer(&mut self, now: Instant) {
        if self.tx_wait.is_some_and(|t| t <= now) {
            self.tx_wait = None;
            self.process_tx();
        }
        if self.rx_wait.is_some_and(|t| t <= now) {
            self.rx_wait = None;
            self.process_rx();
        }
        if let Some((t, seen)) = self.rx_recheck
            && t <= now
        {
            self.rx_recheck = None;
            // The driver did not cross the raised event in time: what it added
            // meanwhile is used, or, if it added nothing, its next buffer
            // notifies.
            match self.rx_event_at(seen, seen) {
                Ok(true) => self.process_rx(),
                Ok(false) => {}
                Err(e) => self.fail(format_args!("unusable receive ring ({e})")),
            }
        }
    }

    fn fail(&mut self, why: std::fmt::Arguments<'_>) {
        crate::guest_warn!("{DEVICE}: {why}; device needs reset");
        self.broken = true;
        self.irq.set_needs_reset();
    }

    /// Takes the next available chain of `queue`: `Err` when the ring is corrupt.
    fn pop<'m>(
        queue: &mut Queue,
        mem: &'m GuestMemory,
    ) -> Result<Option<DescriptorChain<&'m GuestMemory>>, virtio_queue::Error> {
        Ok(queue.iter(mem)?.next())
    }

    /// Sends every frame the driver made available, as far as the rate limit
    /// allows. The driver is asked not to notify while we drain (each
    /// notification is a VM exit); once the ring looks empty notifications go
    /// back on and the ring is looked at once more, so a frame added meanwhile
    /// is not left waiting.
    pub(crate) fn process_tx(&mut self) {
        let mut returned = false;
        while !self.broken && self.tx_wait.is_none() {
            if let Err(e) = self.tx.disable_notification(&self.mem) {
                return self.fail(format_args!("unusable transmit ring ({e})"));
            }
            returned |= self.drain_tx();
            if self.broken || self.tx_wait.is_some() {
                // The rate limit's timer comes back; the driver need not notify.
                break;
            }
            match self.tx.enable_notification(&self.mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => return self.fail(format_args!("unusable transmit ring ({e})")),
            }
        }
        if returned && wants_interrupt(&mut self.tx, &self.mem, &mut self.tx_added) {
            self.irq_due = true;
        }
    }

    /// Interrupts the driver if a pass since the last call used chains it wants
    /// to hear about: one interrupt for everything one wake-up did (each costs
    /// the guest an exit, and an injection here).
    pub(crate) fn raise_interrupt(&mut self) {
        if std::mem::take(&mut self.irq_due) {
            self.irq.signal_used_queue();
        }
    }

    /// Sends what the transmit ring holds now; whether any chain went back.
    fn drain_tx(&mut self) -> bool {
        let returned = self.send_available();
        // Whatever happened, what was sent is told to the driver.
        if !self.publish_tx() {
            self.broken = true;
        }
        returned
    }

    /// Puts sent chain `head` in the used ring, after those not yet published;
    /// the index moves in `publish_tx`, every `TX_USED_BATCH` chains and when a
    /// pass ends.
    fn use_tx(&mut self, head: u16) -> bool {
        let size = self.tx.size();
        if head >= size {
            self.fail(format_args!("chain {head}: not a descriptor of the ring"));
            return false;
        }
        let slot = self.tx.next_used().wrapping_add(self.tx_pending) % size;
        let mut elem = [0u8; 8];
        elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        // The ring's place was checked when the queue was made ready.
        let at = GuestAddress(self.tx.used_ring() + 4 + 8 * u64::from(slot));
        if self.mem.write_slice(&elem, at).is_err() {
            self.fail(format_args!("a used ring outside guest memory"));
            return false;
        }
        self.tx_pending += 1;
        self.tx_pending < TX_USED_BATCH || self.publish_tx()
    }

    /// Moves the transmit ring's used index past the chains `use_tx` put there.
    fn publish_tx(&mut self) -> bool {
        if self.tx_pending == 0 {
            return true;
        }
        let next = self.tx.next_used().wrapping_add(self.tx_pending);
        self.tx.set_next_used(next);
        self.tx_added = self.tx_added.wrapping_add(self.tx_pending);
        self.tx_pending = 0;
        let at = GuestAddress(self.tx.used_ring() + 2);
        if let Err(e) = self
            .mem
            .store(next.to_le(), at, std::sync::atomic::Ordering::Release)
        {
            self.fail(format_args!("a used ring outside guest memory ({e})"));
            return false;
        }
        true
    }

    fn send_available(&mut self) -> bool {
        let mut returned = false;
        let hdr = self.backend.vnet_hdr();
        loop {
            let mem = &self.mem;
            let chain = match Self::pop(&mut self.tx, mem) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    self.fail(format_args!("unusable transmit ring ({e})"));
                    return returned;
                }
            };
            let head = chain.head_index();
            let mut len = 0usize;
            let mut bad = None;
            self.segs.clear();
            for d in chain {
                if d.is_write_only() {
                    bad = Some("a device-writable descriptor in a transmit chain");
                    break;
                }
                len += d.len() as usize;
                if len > MAX_BUFFER {
                    bad = Some("a transmit chain longer than any frame");
                    break;
                }
                self.segs.push((d.addr(), d.len()));
            }
            if bad.is_none() && len < HDR_LEN {
                bad = Some("a transmit chain shorter than the header");
            }
            if bad.is_none() {
                bad = self.gather_tx(len);
            }
            if let Some(why) = bad {
                self.fail(format_args!("chain {head}: {why}"));
                return returned;
            }
            if let Err(wait) = self.tx_limit.consume(len - HDR_LEN) {
                self.tx.go_to_previous_position();
                self.tx_wait = Some(Instant::now() + wait);
                break;
            }
            let sent = if self.iov.is_empty() {
                let frame = if hdr {
                    &self.tx_buf[..len]
                } else {
                    &self.tx_buf[HDR_LEN..len]
                };
                self.backend.send(frame)
            } else {
                let iov = if hdr {
                    &self.iov[..]
                } else {
                    skip_front(&mut self.iov, HDR_LEN)
                };
                // SAFETY: each piece is a checked range of guest memory
                // (`gather_tx`), mapped while `self.mem` lives.
                unsafe { self.backend.send_gather(iov) }
            };
            match sent {
                Ok(()) => self.counters.tx(len - HDR_LEN),
                Err(e) => {
                    self.counters.tx_dropped();
                    crate::guest_warn!("{DEVICE}: a {}-byte frame was not sent: {e}", len);
                }
            }
            if !self.use_tx(head) {
                return returned;
            }
            returned = true;
        }
        returned
    }

    /// Prepares the chain in `segs` (`len` bytes) for sending: as pieces of guest
    /// memory in `iov` when the backend takes them, else copied into `tx_buf`
    /// (`iov` left empty). Why the chain is unusable, if it is.
    fn gather_tx(&mut self, len: usize) -> Option<&'static str> {
        const OUTSIDE: &str = "a transmit buffer outside guest memory";
        self.iov.clear();
        if self.backend.scatters() {
            'gather: for &(addr, dl) in &self.segs {
                for piece in self.mem.get_slices(addr, dl as usize) {
                    let Ok(piece) = piece else {
                        return Some(OUTSIDE);
                    };
                    if self.iov.len() == MAX_PIECES {
                        // More pieces than a writev takes (no driver of ours
                        // makes them): the copy below serves.
                        self.iov.clear();
                        break 'gather;
                    }
                    self.iov.push(libc::iovec {
                        iov_base: piece.ptr_guard().as_ptr().cast_mut().cast(),
                        iov_len: piece.len(),
                    });
                }
            }
            if !self.iov.is_empty() {
                return None;
            }
        }
        let mut off = 0usize;
        for &(addr, dl) in &self.segs {
            let dl = dl as usize;
            if self
                .mem
                .read_slice(&mut self.tx_buf[off..off + dl], addr)
                .is_err()
            {
                return Some(OUTSIDE);
            }
            off += dl;
        }
        debug_assert_eq!(off, len);
        None
    }

    /// Delivers waiting frames into the receive queue's buffers, reading more from the
    /// backend while there are buffers and the rate limit allows.
    ///
    /// While buffers last it is frames that wake the device, not the driver's
    /// refills: the driver is asked not to notify, and asked again to only once
    /// the device finds too few buffers (`rx_notify_after`).
    pub(crate) fn process_rx(&mut self) {
        let mut returned = false;
        self.rx_starved = false;
        self.rx_recheck = None;
        if !self.broken
            && let Err(e) = self.rx.disable_notification(&self.mem)
        {
            self.fail(format_args!("unusable receive ring ({e})"));
        }
        // The available index as last read: buffers up to it need no new look at
        // the ring (one guest-memory load a frame fewer while they last).
        let mut seen = self.rx.next_avail();
        while !self.broken && self.rx_wait.is_none() {
            if self.rx_len == 0 {
                // Read again once the buffers seen are used (or when the ring
                // moved in a way no driver moves it).
                let ahead = seen.wrapping_sub(self.rx.next_avail());
                if ahead == 0 || ahead > self.rx.size() {
                    seen = match self.rx_avail() {
                        Ok(a) => a,
                        Err(e) => {
                            self.fail(format_args!("unusable receive ring ({e})"));
                            break;
                        }
                    };
                    let out = seen.wrapping_sub(self.rx.next_used());
                    if out <= self.rx.size() {
                        self.rx_depth = self.rx_depth.max(out);
                    }
                }
                if seen == self.rx.next_avail() {
                    if self.rx_short(seen) {
                        continue;
                    }
                    // The driver's notification brings us back.
                    self.rx_starved = !self.broken;
                    break;
                }
                if self.backend.scatters() && self.backend.vnet_hdr() {
                    match self.receive_direct() {
                        Direct::Delivered => {
                            returned = true;
                            continue;
                        }
                        Direct::Again => {
                            seen = self.rx.next_avail();
                            continue;
                        }
                        Direct::Stop => break,
                        // In `rx_buf` now: on as a copied frame.
                        Direct::Held => {}
                    }
                } else if !self.read_frame() {
                    break;
                }
                // A frame too short for its header is nothing a tap sends:
                // dropped, and the next one read.
                if self.rx_len < HDR_LEN {
                    self.rx_len = 0;
                    continue;
                }
            }
            if !self.rx_paid {
                if let Err(wait) = self.rx_limit.consume(self.rx_len - HDR_LEN) {
                    self.rx_wait = Some(Instant::now() + wait);
                    break;
                }
                self.rx_paid = true;
            }
            match self.deliver() {
                Deliver::Done => {
                    returned = true;
                    self.counters.rx(self.rx_len - HDR_LEN);
                    self.rx_len = 0;
                    self.rx_paid = false;
                }
                Deliver::Dropped => {
                    self.rx_len = 0;
                    self.rx_paid = false;
                }
                Deliver::NoBuffers(seen) => {
                    if self.rx_short(seen) {
                        continue;
                    }
                    break;
                }
                Deliver::Broken => break,
            }
        }
        if returned && self.rx_wants_interrupt() {
            self.irq_due = true;
        }
    }

    /// The receive ring's available index.
    fn rx_avail(&self) -> Result<u16, virtio_queue::Error> {
        Ok(self
            .rx
            .avail_idx(&self.mem, std::sync::atomic::Ordering::Acquire)?
            .0)
    }

    /// The buffers up to available index `seen` were too few: the driver is asked
    /// to notify when it adds one past it. Whether it did meanwhile (look again);
    /// a ring that cannot be written breaks the device.
    fn rx_short(&mut self, seen: u16) -> bool {
        match self.rx_notify_after(seen) {
            Ok(more) => more,
            Err(e) => {
                self.fail(format_args!("unusable receive ring ({e})"));
                false
            }
        }
    }

    /// Asks the driver to notify once it has added buffers past `seen`, then
    /// reads the available index again: a buffer added before the driver
    /// could see the request is found here, one added after brings a
    /// notification.
    ///
    /// With `VIRTIO_RING_F_EVENT_IDX` the driver is asked to notify only once
    /// three quarters of the buffers it keeps out (`rx_depth`) are available
    /// again, not at its first. A driver refills in batches (Linux's
    /// 64 a NAPI poll, the test guest's 32) and notifies at the first; on a
    /// host short of cores the I/O thread that notification wakes takes the
    /// core of the vCPU still refilling, and the two then take turns a batch
    /// at a time, each turn paying two switches between a vCPU and a thread
    /// (costly under nested or PVM virtualization). Receiving small frames
    /// (`cargo bench --bench net`) that ping-pong ran at 32 buffers a turn;
    /// at 192 it goes 1.2–1.3× as fast. Linux gives the whole ring back after
    /// a starvation (`try_fill_recv` fills every free descriptor), so it
    /// crosses the raised event; `RX_RECHECK` covers a driver that never does.
    fn rx_notify_after(&mut self, seen: u16) -> Result<bool, virtio_queue::Error> {
        if !self.rx.event_idx_enabled() {
            return self.rx_event_at(seen, seen);
        }
        // Buffers up to `seen` are there (too few for a waiting frame, or
        // none): the driver is asked for as many more as bring them to three
        // quarters of its depth, and for one at least.
        let target = self.rx_depth - self.rx_depth / 4;
        let have = seen.wrapping_sub(self.rx.next_avail()).min(self.rx.size());
        let more = target.saturating_sub(have).max(1);
        let moved = self.rx_event_at(seen.wrapping_add(more - 1), seen)?;
        if more > 1 && !moved {
            // Waiting behind the raised event.
            self.rx_recheck = Some((Instant::now() + RX_RECHECK, seen));
        }
        Ok(moved)
    }

    /// Asks the driver to notify once the available index passes `event`
    /// (without `VIRTIO_RING_F_EVENT_IDX`: at its next buffer), then reads it
    /// again: whether it moved from `seen`.
    fn rx_event_at(&mut self, event: u16, seen: u16) -> Result<bool, virtio_queue::Error> {
        use std::sync::atomic::{Ordering, fence};
        if self.rx.event_idx_enabled() {
            // Written here, not by `enable_notification` (which writes
            // `next_avail`): a frame waiting for more buffers than are
            // available already wants to hear of the next one.
            let at = self.rx.used_ring() + 4 + 8 * u64::from(self.rx.size());
            self.mem
                .store(event.to_le(), GuestAddress(at), Ordering::Relaxed)
                .map_err(virtio_queue::Error::GuestMemory)?;
        } else {
            // Clears `VRING_USED_F_NO_NOTIFY`; its answer compares with
            // `next_avail`, which is not the question here.
            self.rx.enable_notification(&self.mem)?;
        }
        fence(Ordering::SeqCst);
        Ok(self.rx_avail()? != seen)
    }

    /// Reads one frame from the backend straight into the receive buffers: as
    /// many chains as the last frame needed (at least one) and, behind them,
    /// `rx_buf` for what does not fit. A frame that fits is used in place;
    /// one that does not (or that the rate limit holds) is moved whole into
    /// `rx_buf` and the chains are given back to the ring, to go the copying
    /// way.
    ///
    /// One function: the per-frame hot path, whose chains and iovecs are
    /// gathered, read into and used or given back in one pass.
    fn receive_direct(&mut self) -> Direct {
        let start = self.rx.next_avail();
        self.chains.clear();
        self.iov.clear();
        self.iov_addr.clear();
        let mut capacity = 0usize;
        let want = self.rx_want.clamp(1, MAX_BUFFER);
        while capacity < want && (self.chains.is_empty() || self.mrg_rxbuf) {
            let mem = &self.mem;
            let chain = match Self::pop(&mut self.rx, mem) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    self.fail(format_args!("unusable receive ring ({e})"));
                    return Direct::Stop;
                }
            };
            let head = chain.head_index();
            let before = capacity;
            let mut bad = None;
            'chain: for d in chain {
                if !d.is_write_only() {
                    bad = Some("a device-readable descriptor in a receive chain");
                    break;
                }
                let mut addr = d.addr();
                for piece in mem.get_slices(addr, d.len() as usize) {
                    let Ok(piece) = piece else {
                        bad = Some("a receive buffer outside guest memory");
                        break 'chain;
                    };
                    if self.iov.len() == MAX_PIECES - 1 {
                        // The rest of this chain stays unused (readv's limit;
                        // one piece is kept for `rx_buf`).
                        break 'chain;
                    }
                    self.iov.push(libc::iovec {
                        iov_base: piece.ptr_guard_mut().as_ptr().cast(),
                        iov_len: piece.len(),
                    });
                    self.iov_addr.push(addr);
                    addr = addr.unchecked_add(piece.len() as u64);
                    capacity += piece.len();
                }
            }
            if bad.is_none() && capacity == before {
                bad = Some("an empty receive chain");
            }
            if let Some(why) = bad {
                self.fail(format_args!("chain {head}: {why}"));
                return Direct::Stop;
            }
            self.chains.push((head, self.iov.len()));
            if self.iov.len() == MAX_PIECES - 1 {
                break;
            }
        }
        if self.chains.is_empty() {
            // The available index went back (a driver's garbage): the caller
            // reads it again.
            return Direct::Again;
        }
        self.iov.push(libc::iovec {
            iov_base: self.rx_buf.as_mut_ptr().cast(),
            iov_len: self.rx_buf.len(),
        });
        // SAFETY: the pieces before the last are checked ranges of guest memory,
        // mapped while `self.mem` lives; the last is `rx_buf`.
        let got = unsafe { self.backend.recv_scatter(&self.iov) };
        let n = match got {
            Ok(n) if (HDR_LEN..=MAX_BUFFER).contains(&n) => n,
            Ok(_) => {
                // Nothing a tap sends; skip it.
                self.rx.set_next_avail(start);
                self.counters.rx_dropped();
                return Direct::Again;
            }
            Err(e) => {
                self.rx.set_next_avail(start);
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Direct::Stop,
                    io::ErrorKind::Interrupted => Direct::Again,
                    _ => {
                        crate::guest_warn!("{DEVICE}: reading from the backend failed: {e}");
                        self.rx_wait = Some(Instant::now() + ERROR_BACKOFF);
                        Direct::Stop
                    }
                };
            }
        };
        self.rx_want = n;
        if n > capacity || self.rx_limit.consume(n - HDR_LEN).is_err() {
            return self.hold_direct(start, n, capacity);
        }
        // The chains the frame filled go back, together (head, bytes written);
        // the rest stay available.
        let mut off = 0usize;
        let mut piece = 0usize;
        let mut used = 0usize;
        while off < n {
            let end = self.chains[used].1;
            let mut len = 0usize;
            while piece < end && off < n {
                let take = self.iov[piece].iov_len.min(n - off);
                off += take;
                len += take;
                piece += 1;
            }
            self.chains[used].1 = len;
            used += 1;
        }
        if self.write_num_buffers(used as u16).is_err() {
            self.fail(format_args!("a receive buffer outside guest memory"));
            return Direct::Stop;
        }
        self.rx.set_next_avail(start.wrapping_add(used as u16));
        self.chains.truncate(used);
        if !self.use_together() {
            self.broken = true;
            return Direct::Stop;
        }
        self.counters.rx(n - HDR_LEN);
        Direct::Delivered
    }

    /// Writes `num_buffers` into the header at the front of the pieces.
    fn write_num_buffers(&self, n: u16) -> Result<(), vm_memory::GuestMemoryError> {
        let mut skip = NUM_BUFFERS;
        let mut bytes = &n.to_le_bytes()[..];
        for (i, addr) in self.iov_addr.iter().enumerate() {
            let len = self.iov[i].iov_len;
            if skip >= len {
                skip -= len;
                continue;
            }
            let take = (len - skip).min(bytes.len());
            self.mem
                .write_slice(&bytes[..take], addr.unchecked_add(skip as u64))?;
            bytes = &bytes[take..];
            skip = 0;
            if bytes.is_empty() {
                break;
            }
        }
        Ok(())
    }

    /// The frame (`n` bytes) read by `receive_direct` did not go in place: it
    /// moves whole into `rx_buf` (what is in the guest's buffers after what
    /// overflowed into it), and its chains go back to the ring.
    fn hold_direct(&mut self, start: u16, n: usize, capacity: usize) -> Direct {
        let in_guest = n.min(capacity);
        self.rx_buf.copy_within(0..n - in_guest, in_guest);
        let mut off = 0usize;
        for (i, &addr) in self.iov_addr.iter().enumerate() {
            if off == in_guest {
                break;
            }
            let take = self.iov[i].iov_len.min(in_guest - off);
            if self
                .mem
                .read_slice(&mut self.rx_buf[off..off + take], addr)
                .is_err()
            {
                self.fail(format_args!("a receive buffer outside guest memory"));
                return Direct::Stop;
            }
            off += take;
        }
        self.rx.set_next_avail(start);
        self.rx_len = n;
        self.rx_paid = false;
        Direct::Held
    }

    /// Reads one frame from the backend into `rx_buf`; whether there was one.
    fn read_frame(&mut self) -> bool {
        let off = if self.backend.vnet_hdr() {
            0
        } else {
            // A header-less backend: the guest gets a header saying nothing.
            self.rx_buf[..HDR_LEN].fill(0);
            HDR_LEN
        };
        match self.backend.recv(&mut self.rx_buf[off..]) {
            Ok(n) if n + off >= HDR_LEN => {
                self.rx_len = n + off;
                true
            }
            Ok(_) => {
                // Nothing a tap sends; skip it.
                self.counters.rx_dropped();
                true
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => true,
            Err(e) => {
                crate::guest_warn!("{DEVICE}: reading from the backend failed: {e}");
                self.rx_wait = Some(Instant::now() + ERROR_BACKOFF);
                false
            }
        }
    }

    /// Puts the waiting frame into one receive chain, or several with mergeable
    /// buffers.
    fn deliver(&mut self) -> Deliver {
        let start = self.rx.next_avail();
        self.chains.clear();
        self.segs.clear();
        let mut capacity = 0usize;
        while capacity < self.rx_len {
            if !self.chains.is_empty() && !self.mrg_rxbuf {
                // One chain must hold the frame: drop it, keep the buffer.
                self.rx.set_next_avail(start);
                self.counters.rx_dropped();
                crate::guest_warn!(
                    "{DEVICE}: a {}-byte frame does not fit a receive buffer of {capacity}",
                    self.rx_len
                );
                return Deliver::Dropped;
            }
            let mem = &self.mem;
            let chain = match Self::pop(&mut self.rx, mem) {
                Ok(Some(c)) => c,
                Ok(None) => {
                    // The iterator found the available index here.
                    let seen = self.rx.next_avail();
                    self.rx.set_next_avail(start);
                    return Deliver::NoBuffers(seen);
                }
                Err(e) => {
                    self.fail(format_args!("unusable receive ring ({e})"));
                    return Deliver::Broken;
                }
            };
            let head = chain.head_index();
            let before = capacity;
            let mut readable = false;
            for d in chain {
                if !d.is_write_only() {
                    readable = true;
                    break;
                }
                if capacity >= self.rx_len {
                    break;
                }
                self.segs.push((d.addr(), d.len()));
                capacity += d.len() as usize;
            }
            if readable {
                self.fail(format_args!(
                    "chain {head}: a device-readable descriptor in a receive chain"
                ));
                return Deliver::Broken;
            }
            if capacity == before {
                self.fail(format_args!("chain {head}: an empty receive chain"));
                return Deliver::Broken;
            }
            self.chains.push((head, self.segs.len()));
        }
        let n = self.chains.len() as u16;
        self.rx_buf[NUM_BUFFERS..NUM_BUFFERS + 2].copy_from_slice(&n.to_le_bytes());
        let mut off = 0usize;
        let mut seg = 0usize;
        for i in 0..self.chains.len() {
            let (head, end) = self.chains[i];
            let mut used = 0u32;
            while seg < end {
                let (addr, len) = self.segs[seg];
                let take = (len as usize).min(self.rx_len - off);
                if self
                    .mem
                    .write_slice(&self.rx_buf[off..off + take], addr)
                    .is_err()
                {
                    self.fail(format_args!(
                        "chain {head}: a receive buffer outside guest memory"
                    ));
                    return Deliver::Broken;
                }
                off += take;
                used += take as u32;
                seg += 1;
            }
            self.chains[i].1 = used as usize;
        }
        if !self.use_together() {
            self.broken = true;
            return Deliver::Broken;
        }
        Deliver::Done
    }

    /// Puts the gathered chains (head, bytes written) in the used ring and then
    /// moves the used index once, past all of them. The driver must never see part
    /// of a frame (virtio 1.x §5.1.6.4.2: the buffers of one packet are used
    /// together): Linux's driver, polling on another CPU, would count the rest
    /// missing, drop the frame and take each remaining buffer for a frame of its
    /// own, reading payload bytes as its header.
    fn use_together(&mut self) -> bool {
        let size = self.rx.size();
        let ring = self.rx.used_ring();
        let first = Wrapping(self.rx.next_used());
        for (i, &(head, used)) in self.chains.iter().enumerate() {
            if head >= size {
                self.fail(format_args!("chain {head}: not a descriptor of the ring"));
                return false;
            }
            let slot = (first + Wrapping(i as u16)).0 % size;
            let mut elem = [0u8; 8];
            elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
            elem[4..].copy_from_slice(&(used as u32).to_le_bytes());
            // The ring's place was checked when the queue was made ready.
            let at = GuestAddress(ring + 4 + 8 * u64::from(slot));
            if self.mem.write_slice(&elem, at).is_err() {
                self.fail(format_args!("a used ring outside guest memory"));
                return false;
            }
        }
        let next = first + Wrapping(self.chains.len() as u16);
        self.rx.set_next_used(next.0);
        self.rx_added += self.chains.len() as u16;
        if let Err(e) = self.mem.store(
            next.0.to_le(),
            GuestAddress(ring + 2),
            std::sync::atomic::Ordering::Release,
        ) {
            self.fail(format_args!("a used ring outside guest memory ({e})"));
            return false;
        }
        true
    }

    /// Whether the driver wants an interrupt for the receive chains used since the
    /// last one.
    fn rx_wants_interrupt(&mut self) -> bool {
        wants_interrupt(&mut self.rx, &self.mem, &mut self.rx_added)
    }
}

/// Whether the driver wants an interrupt for the `added` chains `queue` used since
/// the last one (`added` is then reset). The used ring is written here, not by
/// `Queue::add_used`, so the queue's own count for `VIRTIO_RING_F_EVENT_IDX` does
/// not see them: with it, the used event is checked against `added`.
fn wants_interrupt(queue: &mut Queue, mem: &GuestMemory, added: &mut u16) -> bool {
    let added = std::mem::take(added);
    if !queue.event_idx_enabled() {
        return needs_interrupt(queue, mem, DEVICE);
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    let at = queue.avail_ring() + 4 + 2 * u64::from(queue.size());
    let event = match mem.load::<u16>(GuestAddress(at), std::sync::atomic::Ordering::Acquire) {
        Ok(e) => Wrapping(u16::from_le(e)),
        Err(_) => return true,
    };
    let next = Wrapping(queue.next_used());
    // The event index lies among the entries just added (virtio's vring_need_event).
    (next - event - Wrapping(1)).0 < added
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::net::backend::SocketBackend;
    use crate::devices::virtio::net::rate_limiter::{BucketConfig, RateLimit};
    use crate::devices::virtio::test_utils::*;
    use std::os::unix::net::UnixDatagram;

    struct Rig<'a> {
        mem: &'a GuestMemory,
        rxq: TestQueue<'a>,
        txq: TestQueue<'a>,
        line: Arc<CountingInterrupt>,
        h: NetHandler,
        peer: UnixDatagram,
    }

    fn rig(mem: &GuestMemory, mrg: bool, vnet_hdr: bool, tx_limit: RateLimit) -> Rig<'_> {
        let rxq = TestQueue::create(mem, GuestAddress(0), 64);
        let txq = TestQueue::create(mem, GuestAddress(0x8000), 64);
        let line = Arc::new(CountingInterrupt::default());
        let (backend, peer) = SocketBackend::pair(vnet_hdr);
        peer.set_nonblocking(true).unwrap();
        let h = NetHandler::new(
            mem.clone(),
            rxq.create_queue().unwrap(),
            txq.create_queue().unwrap(),
            VirtioInterrupt::new(line.clone()),
            Arc::new(backend),
            mrg,
            Limiter::default(),
            Limiter::new(&tx_limit),
            Arc::default(),
        );
        Rig {
            mem,
            rxq,
            txq,
            line,
            h,
            peer,
        }
    }

    fn frame(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
    }

    fn read(mem: &GuestMemory, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    #[test]
    fn transmit_sends_header_and_frame_as_one_datagram() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        let f = frame(HDR_LEN + 1000, 1);
        mem.write_slice(&f[..HDR_LEN], GuestAddress(DATA_START))
            .unwrap();
        mem.write_slice(&f[HDR_LEN..], GuestAddress(DATA_START + 0x1000))
            .unwrap();
        add_chain(
            &t.txq,
            0,
            &[r(DATA_START, HDR_LEN as u32), r(DATA_START + 0x1000, 1000)],
        );
        t.h.process_tx();
        let mut got = vec![0; 70000];
        let n = t.peer.recv(&mut got).unwrap();
        assert_eq!(&got[..n], &f[..]);
        assert_eq!(used(&t.txq), [(0, 0)]);
        assert_eq!(t.line.count(), 0, "raised once per wake-up, not per pass");
        t.h.raise_interrupt();
        assert_eq!(t.line.count(), 1);
        assert_eq!(t.txq.used_flags(), 0, "notifications back on once drained");
    }

    #[test]
    fn frames_go_in_place_one_chain_each_and_the_rest_stay_available() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        for i in 0..3u16 {
            add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 2048)]);
        }
        let a = frame(HDR_LEN + 100, 4);
        let b = frame(HDR_LEN + 1500, 5);
        t.peer.send(&a).unwrap();
        t.peer.send(&b).unwrap();
        t.h.process_rx();
        assert_eq!(
            used(&t.rxq),
            [(0, a.len() as u32), (1, b.len() as u32)],
            "one chain a frame, the third left"
        );
        for (i, f) in [(0u64, &a), (1, &b)] {
            let got = read(&mem, DATA_START + i * 0x1000, f.len());
            assert_eq!(&got[NUM_BUFFERS..NUM_BUFFERS + 2], &1u16.to_le_bytes());
            assert_eq!(&got[HDR_LEN..], &f[HDR_LEN..]);
        }
        // The third chain still takes the next frame.
        t.peer.send(&a).unwrap();
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 3);
        assert_eq!(used(&t.rxq)[2], (2, a.len() as u32));
    }

    #[test]
    fn a_big_frame_after_a_big_one_goes_in_place_with_its_count_across_pieces() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        let f = frame(HDR_LEN + 20_000, 6);
        // The header itself split 6 + 6: num_buffers lands in the second piece.
        let chain = |t: &Rig<'_>, id: u16, at: u64| {
            add_chain(&t.rxq, id, &[w(at, 6), w(at + 6, 4090)]);
        };
        for round in 0..2u64 {
            for i in 0..5u16 {
                // Two descriptors a chain: heads at even indices.
                chain(
                    &t,
                    2 * (5 * round as u16 + i),
                    DATA_START + u64::from(i) * 0x1000,
                );
            }
            t.peer.send(&f).unwrap();
            t.h.process_rx();
            let u = used(&t.rxq);
            assert_eq!(u.len(), 5 * (round as usize + 1), "round {round}");
            let got = read(&mem, DATA_START, 6);
            let mut whole = got.clone();
            for i in 0..5u64 {
                let at = DATA_START + i * 0x1000;
                let n = (f.len() - whole.len()).min(if i == 0 { 4090 } else { 4096 });
                whole.extend(read(&mem, at + if i == 0 { 6 } else { 0 }, n));
            }
            assert_eq!(&whole[NUM_BUFFERS..NUM_BUFFERS + 2], &5u16.to_le_bytes());
            assert_eq!(&whole[HDR_LEN..], &f[HDR_LEN..], "round {round}");
        }
    }

    #[test]
    fn a_backend_that_does_not_scatter_gets_and_gives_copies() {
        let mem = memory();
        let mut t = rig(&mem, true, false, RateLimit::default());
        let (mut backend, peer) = SocketBackend::pair(false);
        backend.scatter = false;
        t.h.backend = Arc::new(backend);
        let f = frame(HDR_LEN + 300, 7);
        mem.write_slice(&f, GuestAddress(DATA_START)).unwrap();
        add_chain(
            &t.txq,
            0,
            &[r(DATA_START, 4), r(DATA_START + 4, f.len() as u32 - 4)],
        );
        t.h.process_tx();
        let mut got = vec![0; 1000];
        let n = peer.recv(&mut got).unwrap();
        assert_eq!(&got[..n], &f[HDR_LEN..]);
        peer.send(&f[HDR_LEN..]).unwrap();
        add_chain(&t.rxq, 0, &[w(DATA_START + 0x1000, 2048)]);
        t.h.process_rx();
        assert_eq!(used(&t.rxq), [(0, f.len() as u32)]);
        assert_eq!(
            read(&mem, DATA_START + 0x1000 + HDR_LEN as u64, 300),
            &f[HDR_LEN..]
        );
    }

    #[test]
    fn a_headerless_backend_gets_the_frame_alone_even_with_the_header_in_pieces() {
        let mem = memory();
        let mut t = rig(&mem, true, false, RateLimit::default());
        let f = frame(HDR_LEN + 60, 8);
        mem.write_slice(&f, GuestAddress(DATA_START)).unwrap();
        add_chain(
            &t.txq,
            0,
            &[
                r(DATA_START, 5),
                r(DATA_START + 5, 7),
                r(DATA_START + 12, 10),
                r(DATA_START + 22, 50),
            ],
        );
        t.h.process_tx();
        let mut got = vec![0; 100];
        let n = t.peer.recv(&mut got).unwrap();
        assert_eq!(&got[..n], &f[HDR_LEN..]);
    }

    #[test]
    fn a_headerless_backend_gets_the_frame_alone() {
        let mem = memory();
        let mut t = rig(&mem, true, false, RateLimit::default());
        let f = frame(HDR_LEN + 60, 2);
        mem.write_slice(&f, GuestAddress(DATA_START)).unwrap();
        add_chain(&t.txq, 0, &[r(DATA_START, f.len() as u32)]);
        t.h.process_tx();
        let mut got = vec![0; 100];
        let n = t.peer.recv(&mut got).unwrap();
        assert_eq!(&got[..n], &f[HDR_LEN..]);
        // And receives get a zero header with num_buffers = 1.
        t.peer.send(&[0xaa; 50]).unwrap();
        add_chain(&t.rxq, 0, &[w(DATA_START + 0x1000, 2048)]);
        t.h.process_rx();
        assert_eq!(used(&t.rxq), [(0, (HDR_LEN + 50) as u32)]);
        let got = read(&mem, DATA_START + 0x1000, HDR_LEN + 50);
        assert_eq!(&got[..HDR_LEN], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        assert!(got[HDR_LEN..].iter().all(|&b| b == 0xaa));
    }

    #[test]
    fn a_large_frame_spans_mergeable_buffers_and_says_how_many() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        let f = frame(HDR_LEN + 65_000, 3);
        t.peer.send(&f).unwrap();
        // 15 chains of 4 KiB cannot hold it: nothing is used, the frame waits.
        for i in 0..15u16 {
            add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 4096)]);
        }
        t.h.process_rx();
        assert!(used(&t.rxq).is_empty());
        assert!(!t.h.wants_backend(), "a frame waits");
        add_chain(&t.rxq, 15, &[w(DATA_START + 15 * 0x1000, 4096)]);
        add_chain(&t.rxq, 16, &[w(DATA_START + 16 * 0x1000, 4096)]);
        t.h.process_rx();
        let u = used(&t.rxq);
        assert_eq!(u.len(), 16);
        assert_eq!(u.iter().map(|&(_, l)| l as usize).sum::<usize>(), f.len());
        let got = read(&mem, DATA_START, f.len());
        assert_eq!(&got[NUM_BUFFERS..NUM_BUFFERS + 2], &16u16.to_le_bytes());
        assert_eq!(&got[HDR_LEN..], &f[HDR_LEN..]);
        assert!(t.h.wants_backend());
    }

    /// A frame spanning several chains is published in one step: a driver
    /// polling the used index (as Linux's NAPI does, on another CPU) must never
    /// see part of a frame, or it counts the rest missing, drops the frame and
    /// takes its remaining buffers for frames of their own.
    #[test]
    fn a_frame_of_several_chains_is_used_all_at_once() {
        use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
        const CHAINS: u16 = 16;
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        let used_at = t.rxq.used_idx_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let (seen, torn) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let watcher = {
            let (mem, stop, seen, torn) = (mem.clone(), stop.clone(), seen.clone(), torn.clone());
            std::thread::spawn(move || {
                let mut last = 0u16;
                while !stop.load(Ordering::Acquire) {
                    let idx = mem
                        .load::<u16>(GuestAddress(used_at), std::sync::atomic::Ordering::Acquire)
                        .unwrap();
                    if idx != last {
                        seen.fetch_add(1, Ordering::Relaxed);
                        if idx % CHAINS != 0 {
                            torn.fetch_add(1, Ordering::Relaxed);
                        }
                        last = idx;
                    }
                }
            })
        };
        let f = frame(HDR_LEN + 65_000, 9);
        // Until the watcher has seen the index move often enough (it may
        // get little CPU on a loaded machine), or ten seconds.
        let start = Instant::now();
        let mut rounds = 0u32;
        while seen.load(Ordering::Relaxed) < 300 && start.elapsed() < Duration::from_secs(10) {
            rounds += 1;
            // Four frames' worth of 4 KiB chains: the ring's 64 entries.
            for i in 0..4 * CHAINS {
                add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 4096)]);
            }
            for _ in 0..4 {
                t.peer.send(&f).unwrap();
            }
            t.h.process_rx();
            assert_eq!(t.h.rx_len, 0, "every frame delivered");
        }
        stop.store(true, Ordering::Release);
        watcher.join().unwrap();
        assert_eq!(t.rxq.used_idx(), (rounds * 4 * u32::from(CHAINS)) as u16);
        assert!(
            seen.load(Ordering::Relaxed) > 0,
            "the watcher saw the index move"
        );
        assert_eq!(
            torn.load(Ordering::Relaxed),
            0,
            "a used index inside a frame was seen"
        );
    }

    #[test]
    fn without_mergeable_buffers_a_frame_too_big_is_dropped() {
        let mem = memory();
        let mut t = rig(&mem, false, true, RateLimit::default());
        t.peer.send(&frame(HDR_LEN + 3000, 4)).unwrap();
        t.peer.send(&frame(HDR_LEN + 100, 5)).unwrap();
        add_chain(&t.rxq, 0, &[w(DATA_START, 1600)]);
        add_chain(&t.rxq, 1, &[w(DATA_START + 0x1000, 1600)]);
        t.h.process_rx();
        assert_eq!(used(&t.rxq), [(0, (HDR_LEN + 100) as u32)]);
    }

    #[test]
    fn malformed_chains_are_a_device_error() {
        let cases: [&[Seg]; 4] = [
            &[w(DATA_START, 100)],
            &[r(DATA_START, 70_000)],
            &[r(1 << 40, 100)],
            &[r(DATA_START, 4)],
        ];
        for segs in cases {
            let mem = memory();
            let mut t = rig(&mem, true, true, RateLimit::default());
            add_chain(&t.txq, 0, segs);
            t.h.process_tx();
            assert!(t.h.irq.needs_reset(), "{segs:?}");
            assert!(t.peer.recv(&mut [0; 100]).is_err(), "nothing sent");
        }
        for segs in [&[r(DATA_START, 100)][..], &[w(1 << 40, 100)]] {
            let mem = memory();
            let mut t = rig(&mem, true, true, RateLimit::default());
            t.peer.send(&frame(80, 0)).unwrap();
            add_chain(&t.rxq, 0, segs);
            t.h.process_rx();
            assert!(t.h.irq.needs_reset(), "{segs:?}");
            assert!(!t.h.wants_backend());
        }
        // A ring that claims more chains than it has.
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        t.txq.set_avail_idx(1000);
        t.h.process_tx();
        assert!(t.h.irq.needs_reset());
    }

    #[test]
    fn transmit_waits_for_the_rate_limit() {
        let mem = memory();
        let limit = RateLimit {
            bytes: None,
            ops: Some(BucketConfig {
                size: 2,
                refill_ms: 50,
                one_time_burst: 0,
            }),
        };
        let mut t = rig(&mem, true, true, limit);
        for i in 0..3u16 {
            add_chain(&t.txq, i, &[r(DATA_START, 64)]);
        }
        t.h.process_tx();
        assert_eq!(used(&t.txq).len(), 2);
        assert_eq!(
            t.txq.used_flags(),
            1,
            "no notifications while the timer runs"
        );
        let deadline = t.h.deadline().expect("waiting");
        t.h.on_timer(deadline - Duration::from_millis(1));
        assert_eq!(used(&t.txq).len(), 2, "not yet");
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        t.h.on_timer(Instant::now());
        assert_eq!(used(&t.txq).len(), 3);
        assert!(t.h.deadline().is_none());
        assert_eq!(t.txq.used_flags(), 0);
        let _ = t.mem;
    }

    fn with_event_idx(t: &mut Rig<'_>) {
        t.h.rx.set_event_idx(true);
        t.h.tx.set_event_idx(true);
    }

    #[test]
    fn one_interrupt_for_both_queues_in_one_wake_up() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        add_chain(&t.txq, 0, &[r(DATA_START, 100)]);
        add_chain(&t.rxq, 0, &[w(DATA_START + 0x1000, 2048)]);
        t.peer.send(&frame(HDR_LEN + 100, 1)).unwrap();
        t.h.process_tx();
        t.h.process_rx();
        assert_eq!((used(&t.txq).len(), used(&t.rxq).len()), (1, 1));
        t.h.raise_interrupt();
        t.h.raise_interrupt();
        assert_eq!(t.line.count(), 1);
    }

    #[test]
    fn with_event_idx_transmit_interrupts_past_the_used_event_and_asks_to_hear_of_the_next() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        with_event_idx(&mut t);
        // The driver wants to hear once the third chain is used (used index past 2).
        t.txq.set_used_event(2);
        for i in 0..2u16 {
            add_chain(&t.txq, i, &[r(DATA_START, 64)]);
        }
        t.h.process_tx();
        t.h.raise_interrupt();
        assert_eq!(used(&t.txq).len(), 2);
        assert_eq!(t.line.count(), 0, "the used index did not pass 2");
        assert_eq!(t.txq.avail_event(), 2, "notify me of the chain after these");
        assert_eq!(t.txq.used_flags(), 0, "the flag is not how it asks");
        add_chain(&t.txq, 2, &[r(DATA_START, 64)]);
        t.h.process_tx();
        t.h.raise_interrupt();
        assert_eq!(t.line.count(), 1);
        assert_eq!(t.txq.avail_event(), 3);
        for _ in 0..3 {
            assert!(t.peer.recv(&mut [0; 100]).is_ok());
        }
    }

    #[test]
    fn sent_chains_are_published_in_batches_and_all_by_the_end_of_a_pass() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        with_event_idx(&mut t);
        let n = TX_USED_BATCH + 8;
        // The driver wants to hear once the used index passes a chain in the
        // second batch: the count since the last interrupt covers both.
        t.txq.set_used_event(TX_USED_BATCH + 3);
        for i in 0..n {
            add_chain(&t.txq, i, &[r(DATA_START, 64)]);
        }
        t.h.process_tx();
        assert_eq!(
            t.txq.used_idx(),
            n,
            "the last, partial batch is published too"
        );
        let want: Vec<(u32, u32)> = (0..u32::from(n)).map(|i| (i, 0)).collect();
        assert_eq!(used(&t.txq), want, "in order, each once");
        t.h.raise_interrupt();
        assert_eq!(t.line.count(), 1);
        for _ in 0..n {
            assert!(t.peer.recv(&mut [0; 100]).is_ok());
        }
    }

    #[test]
    fn an_empty_receive_ring_stops_the_watch_on_the_backend_until_the_driver_adds_a_buffer() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        with_event_idx(&mut t);
        t.peer.send(&frame(HDR_LEN + 100, 1)).unwrap();
        t.h.process_rx();
        // The backend is readable but there is nowhere to put its frame:
        // watching it would wake the I/O thread again and again.
        assert!(
            !t.h.wants_backend(),
            "no buffer: the driver's kick wakes us"
        );
        assert_eq!(
            t.rxq.avail_event(),
            0,
            "the driver is asked for the next buffer"
        );
        add_chain(&t.rxq, 0, &[w(DATA_START, 2048)]);
        add_chain(&t.rxq, 1, &[w(DATA_START + 0x1000, 2048)]);
        // The kick.
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 1);
        assert!(t.h.wants_backend(), "a buffer waits: frames wake us again");
        t.peer.send(&frame(HDR_LEN + 100, 2)).unwrap();
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 2);
        assert!(!t.h.wants_backend(), "the ring is empty again");
    }

    #[test]
    fn receive_notifications_are_off_while_buffers_last() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        for i in 0..2u16 {
            add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 2048)]);
        }
        t.h.process_rx();
        assert_eq!(
            t.rxq.used_flags(),
            1,
            "buffers wait: frames wake the device"
        );
        for seed in 0..3 {
            t.peer.send(&frame(HDR_LEN + 100, seed)).unwrap();
        }
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 2);
        assert_eq!(t.rxq.used_flags(), 0, "out of buffers: the driver must say");
        add_chain(&t.rxq, 2, &[w(DATA_START + 0x2000, 2048)]);
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 3, "the third frame");
    }

    /// Whether a driver that moved the available index from `old` to `new`
    /// notifies, the device's avail event being `event` (virtio 1.x 2.7.10).
    fn driver_notifies(event: u16, old: u16, new: u16) -> bool {
        new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
    }

    /// Gives the device `n` 2 KiB receive chains from descriptor `first` on.
    fn add_rx_chains(t: &Rig<'_>, first: u16, n: u16) {
        for i in first..first + n {
            add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 2048)]);
        }
    }

    /// A device with event indices whose driver gave it 8 buffers, all now
    /// used by 8 frames.
    fn starved_after_eight(mem: &GuestMemory) -> Rig<'_> {
        let mut t = rig(mem, true, true, RateLimit::default());
        with_event_idx(&mut t);
        add_rx_chains(&t, 0, 8);
        for k in 0..8 {
            t.peer.send(&frame(HDR_LEN + 60, k)).unwrap();
        }
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 8);
        t
    }

    #[test]
    fn with_event_idx_a_starved_receive_ring_asks_for_most_of_the_drivers_buffers_back() {
        let mem = memory();
        let mut t = starved_after_eight(&mem);
        // The driver had 8 out: it is asked to notify once 6 are back.
        assert_eq!(t.rxq.avail_event(), 8 + 6 - 1);
        assert!(t.h.deadline().is_some(), "a recheck, in case it never does");
        add_rx_chains(&t, 8, 5);
        assert!(!driver_notifies(t.rxq.avail_event(), 8, 13));
        add_rx_chains(&t, 13, 1);
        assert!(driver_notifies(t.rxq.avail_event(), 13, 14));
        // The notification.
        t.h.process_rx();
        assert!(t.h.wants_backend(), "six buffers wait: frames wake us");
        assert_eq!(t.h.deadline(), None, "not starved: no recheck");
        t.peer.send(&frame(HDR_LEN + 60, 9)).unwrap();
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 9);
    }

    #[test]
    fn with_event_idx_a_driver_that_gives_back_fewer_is_served_at_the_recheck() {
        let mem = memory();
        let mut t = starved_after_eight(&mem);
        // Two come back, short of the event: no notification; a frame waits.
        add_rx_chains(&t, 8, 2);
        assert!(!driver_notifies(t.rxq.avail_event(), 8, 10));
        t.peer.send(&frame(HDR_LEN + 60, 8)).unwrap();
        let at = t.h.deadline().expect("a recheck");
        assert!(at <= Instant::now() + RX_RECHECK);
        t.h.on_timer(at);
        assert_eq!(used(&t.rxq).len(), 9, "the recheck found the buffers");
        assert_eq!(t.h.deadline(), None);
        // Starved again, and this time the driver adds nothing: after the
        // recheck its next buffer notifies, and no timer runs on.
        t.peer.send(&frame(HDR_LEN + 60, 9)).unwrap();
        t.h.process_rx();
        assert_eq!(used(&t.rxq).len(), 10);
        assert_eq!(t.rxq.avail_event(), 10 + 6 - 1);
        let at = t.h.deadline().expect("a recheck");
        t.h.on_timer(at);
        assert_eq!(t.rxq.avail_event(), 10);
        assert!(driver_notifies(t.rxq.avail_event(), 10, 11));
        assert_eq!(t.h.deadline(), None);
        assert_eq!(used(&t.rxq).len(), 10);
    }

    #[test]
    fn with_event_idx_receive_asks_to_hear_of_the_buffer_it_lacks() {
        let mem = memory();
        let mut t = rig(&mem, true, true, RateLimit::default());
        with_event_idx(&mut t);
        // Nothing to receive into: tell me of the first buffer.
        t.rxq.set_avail_event(0x55);
        t.h.process_rx();
        assert_eq!(t.rxq.avail_event(), 0);
        // A 20000-byte frame needs five 4 KiB chains; three are there. The
        // device wants to hear of the fourth, not of the first (it has it).
        let f = frame(HDR_LEN + 20_000, 3);
        t.peer.send(&f).unwrap();
        for i in 0..3u16 {
            add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 4096)]);
        }
        t.rxq.set_avail_event(0x55);
        t.h.process_rx();
        assert!(used(&t.rxq).is_empty());
        assert_eq!(t.rxq.avail_event(), 3);
        for i in 3..5u16 {
            add_chain(&t.rxq, i, &[w(DATA_START + u64::from(i) * 0x1000, 4096)]);
        }
        t.rxq.set_used_event(0);
        t.h.process_rx();
        t.h.raise_interrupt();
        assert_eq!(used(&t.rxq).len(), 5);
        assert_eq!(t.line.count(), 1, "used index past 0");
        let got = read(&mem, DATA_START, 4096);
        assert_eq!(&got[HDR_LEN..], &f[HDR_LEN..4096]);
        // The ring is empty: the driver, which had three out at most, is asked
        // to notify once three are back (index 8), not at the first.
        assert_eq!(t.rxq.avail_event(), 7);
        // While buffers wait the event index stays (no new request), and
        // interrupts follow the driver's used event.
        add_chain(&t.rxq, 5, &[w(DATA_START + 0x5000, 4096)]);
        add_chain(&t.rxq, 6, &[w(DATA_START + 0x6000, 4096)]);
        t.rxq.set_used_event(10);
        t.peer.send(&frame(HDR_LEN + 100, 4)).unwrap();
        t.h.process_rx();
        t.h.raise_interrupt();
        assert_eq!(used(&t.rxq).len(), 6);
        assert_eq!(t.rxq.avail_event(), 7, "a buffer still waits");
        assert_eq!(t.line.count(), 1, "used index 6 is not past 10");
    }
}
