//! The device thread: guest memory on one side, the muxer on the other.
//!
//! Packets cross guest memory here and only here. A chain that cannot be a
//! packet (a header that does not fit, a payload longer than the chain or
//! than a packet may be, a buffer on the wrong side) is a device error: the
//! device is marked `NEEDS_RESET` and stops serving until the driver resets
//! it; nothing the guest writes makes this thread panic or allocate more
//! than one packet.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::{ControlOperation, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::Region;
use super::muxer::{FD_TOKEN, LISTENER_TOKEN, Muxer};
use super::packet::{EVENT_TRANSPORT_RESET, HDR_LEN, Header};
use crate::devices::virtio::{GuestMemory, VirtioInterrupt, needs_interrupt, return_chain};

/// Queue indices (virtio 1.2 §5.10.2).
pub(crate) const RX: usize = 0;
pub(crate) const TX: usize = 1;
pub(crate) const EVENT: usize = 2;
/// The largest payload one packet carries, either way (Linux's own bound).
pub(crate) const MAX_PAYLOAD: usize = 64 * 1024;
const DEVICE: &str = "virtio-vsock";
const KILL_TOKEN: u64 = u64::MAX;

/// Why a chain is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChainError {
    /// A receive buffer the device may not write, or a transmit one it may not read.
    #[error("a descriptor points the wrong way")]
    Direction,
    /// Shorter than a header.
    #[error("a chain of {0} bytes cannot hold a packet header")]
    NoHeader(usize),
    /// The header's length is more than the chain holds or a packet may carry.
    #[error("a packet of {len} bytes in a chain of {room}")]
    BadLength { len: u32, room: usize },
    /// A descriptor outside guest memory.
    #[error("a buffer outside guest memory")]
    Memory,
}

/// Serves the three queues.
pub(crate) struct Handler {
    pub(crate) mem: GuestMemory,
    pub(crate) queues: [Queue; 3],
    pub(crate) irq: VirtioInterrupt,
    pub(crate) muxer: Muxer,
    /// A TRANSPORT_RESET waits for an event buffer (a restored device).
    pub(crate) reset_event: bool,
    /// A device error happened: nothing is served until reset.
    pub(crate) broken: bool,
    /// One packet's payload, reused (a mapping: see `conn::TxBuf`).
    buf: Region,
}

impl Handler {
    pub(crate) fn new(
        mem: GuestMemory,
        queues: [Queue; 3],
        irq: VirtioInterrupt,
        muxer: Muxer,
        reset_event: bool,
    ) -> io::Result<Self> {
        Ok(Handler {
            mem,
            queues,
            irq,
            muxer,
            reset_event,
            broken: false,
            buf: Region::new(MAX_PAYLOAD)?,
        })
    }

    fn device_error(&mut self, e: ChainError) {
        crate::guest_warn!("{DEVICE}: {e}; device needs reset");
        self.broken = true;
        self.irq.set_needs_reset();
    }

    fn next_chain<'m>(
        &mut self,
        q: usize,
        mem: &'m GuestMemory,
    ) -> Option<DescriptorChain<&'m GuestMemory>> {
        match self.queues[q].iter(mem) {
            Ok(mut it) => it.next(),
            Err(e) => {
                crate::guest_warn!("{DEVICE}: unusable available ring ({e}); device needs reset");
                self.broken = true;
                self.irq.set_needs_reset();
                None
            }
        }
    }

    fn give_back(&mut self, q: usize, head: u16, len: u32) -> bool {
        let Self {
            queues, mem, irq, ..
        } = self;
        let ok = return_chain(&mut queues[q], mem, irq, DEVICE, head, len);
        if !ok {
            self.broken = true;
        }
        ok
    }

    fn interrupt(&mut self, q: usize) {
        if needs_interrupt(&mut self.queues[q], &self.mem, DEVICE) {
            self.irq.signal_used_queue();
        }
    }

    /// The guest's transmit queue: every packet to the muxer.
    pub(crate) fn process_tx(&mut self) {
        let mut returned = false;
        let budget = usize::from(self.queues[TX].size());
        let mem = self.mem.clone();
        for _ in 0..budget {
            if self.broken {
                break;
            }
            let Some(chain) = self.next_chain(TX, &mem) else {
                break;
            };
            let head = chain.head_index();
            match read_packet(&mem, chain, &mut self.buf) {
                Ok(hdr) => {
                    self.muxer.send(&hdr, &self.buf[..hdr.len as usize]);
                    returned |= self.give_back(TX, head, 0);
                }
                Err(e) => self.device_error(e),
            }
        }
        if returned {
            self.interrupt(TX);
        }
        self.process_rx();
    }

    /// The guest's receive queue: the muxer's packets, while there are buffers.
    pub(crate) fn process_rx(&mut self) {
        let mut returned = false;
        let mem = self.mem.clone();
        while !self.broken && self.muxer.has_rx() {
            let Some(chain) = self.next_chain(RX, &mem) else {
                break;
            };
            let head = chain.head_index();
            let room = match writable_room(&chain) {
                Ok(room) => room,
                Err(e) => {
                    self.device_error(e);
                    break;
                }
            };
            let room = (room - HDR_LEN).min(MAX_PAYLOAD);
            let Some(hdr) = self.muxer.recv(&mut self.buf[..room]) else {
                // Nothing after all (a socket had no data): the buffer stays the guest's.
                self.queues[RX].go_to_previous_position();
                break;
            };
            match write_packet(&mem, chain, &hdr, &self.buf[..hdr.len as usize]) {
                Ok(len) => returned |= self.give_back(RX, head, len),
                Err(e) => self.device_error(e),
            }
        }
        if returned {
            self.interrupt(RX);
        }
    }

    /// The event queue: a pending TRANSPORT_RESET goes into its first buffer.
    pub(crate) fn process_event(&mut self) {
        if !self.reset_event || self.broken {
            return;
        }
        let mem = self.mem.clone();
        let Some(chain) = self.next_chain(EVENT, &mem) else {
            return;
        };
        let head = chain.head_index();
        let Some(desc) = chain.clone().next() else {
            return self.device_error(ChainError::NoHeader(0));
        };
        if !desc.is_write_only() || desc.len() < 4 {
            return self.device_error(ChainError::Direction);
        }
        if self
            .mem
            .write_obj(EVENT_TRANSPORT_RESET.to_le(), desc.addr())
            .is_err()
        {
            return self.device_error(ChainError::Memory);
        }
        self.reset_event = false;
        if self.give_back(EVENT, head, 4) {
            self.interrupt(EVENT);
        }
    }

    /// The thread's loop, until `kill` is written.
    pub(crate) fn run(mut self, evts: Vec<EventFd>, kill: EventFd) {
        if let Err(e) = self.run_loop(&evts, &kill) {
            crate::guest_warn!("{DEVICE}: device thread stopped: {e}");
        }
    }

    fn run_loop(&mut self, evts: &[EventFd], kill: &EventFd) -> io::Result<()> {
        add(self.muxer.epoll(), kill.as_raw_fd(), KILL_TOKEN)?;
        for (i, e) in evts.iter().enumerate() {
            add(self.muxer.epoll(), e.as_raw_fd(), i as u64)?;
        }
        // A restored device owes the guest its reset before anything else.
        self.process_event();
        let mut events = [EpollEvent::default(); 32];
        loop {
            let timeout = match self.muxer.deadline() {
                Some(t) => {
                    let left = t.saturating_duration_since(Instant::now());
                    i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
                }
                None => -1,
            };
            let n = match self.muxer.epoll().wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for ev in &events[..n] {
                match ev.data() {
                    KILL_TOKEN => return Ok(()),
                    t if t == LISTENER_TOKEN || t >= FD_TOKEN => {
                        if !self.broken {
                            self.muxer.event(t, ev.event_set());
                        }
                    }
                    i => {
                        let Some(evt) = evts.get(i as usize) else {
                            continue;
                        };
                        // Drain first: a notification racing the work wakes us again.
                        let _ = evt.read();
                        if self.broken {
                            continue;
                        }
                        match i as usize {
                            TX => self.process_tx(),
                            EVENT => self.process_event(),
                            _ => {}
                        }
                    }
                }
            }
            if !self.broken {
                self.muxer.expire(Instant::now());
                self.process_rx();
            }
        }
    }
}

fn add(epoll: &vmm_sys_util::epoll::Epoll, fd: i32, token: u64) -> io::Result<()> {
    epoll.ctl(
        ControlOperation::Add,
        fd,
        EpollEvent::new(EventSet::IN, token),
    )
}

/// The bytes a receive chain can take; every descriptor must be writable.
fn writable_room(chain: &DescriptorChain<&GuestMemory>) -> Result<usize, ChainError> {
    let mut room = 0usize;
    for d in chain.clone() {
        if !d.is_write_only() {
            return Err(ChainError::Direction);
        }
        room = room.saturating_add(d.len() as usize);
    }
    if room < HDR_LEN {
        return Err(ChainError::NoHeader(room));
    }
    Ok(room)
}

/// Reads a transmit chain: its header, and its payload into `data`.
pub(crate) fn read_packet(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    data: &mut [u8],
) -> Result<Header, ChainError> {
    let mut got = 0usize;
    let mut hdr_bytes = [0u8; HDR_LEN];
    let mut have_hdr = 0usize;
    let mut want: Option<usize> = None;
    let mut total = 0usize;
    for d in chain {
        if d.is_write_only() {
            return Err(ChainError::Direction);
        }
        let mut addr = d.addr();
        let mut left = d.len() as usize;
        total = total.saturating_add(left);
        if have_hdr < HDR_LEN {
            let n = left.min(HDR_LEN - have_hdr);
            mem.read_slice(&mut hdr_bytes[have_hdr..have_hdr + n], addr)
                .map_err(|_| ChainError::Memory)?;
            have_hdr += n;
            left -= n;
            addr = GuestAddress(addr.0.wrapping_add(n as u64));
            if have_hdr == HDR_LEN {
                let len = Header::decode(&hdr_bytes).len;
                if len as usize > MAX_PAYLOAD.min(data.len()) {
                    return Err(ChainError::BadLength { len, room: total });
                }
                want = Some(len as usize);
            }
        }
        if let Some(w) = want {
            let n = left.min(w - got);
            if n > 0 {
                mem.read_slice(&mut data[got..got + n], addr)
                    .map_err(|_| ChainError::Memory)?;
                got += n;
            }
            if got == w {
                break;
            }
        }
    }
    let hdr = Header::decode(&hdr_bytes);
    if have_hdr < HDR_LEN {
        return Err(ChainError::NoHeader(total));
    }
    if got != hdr.len as usize {
        return Err(ChainError::BadLength {
            len: hdr.len,
            room: total.saturating_sub(HDR_LEN),
        });
    }
    Ok(hdr)
}

/// Writes a packet into a receive chain; returns the bytes written.
pub(crate) fn write_packet(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    hdr: &Header,
    data: &[u8],
) -> Result<u32, ChainError> {
    let mut hdr = *hdr;
    hdr.len = data.len() as u32;
    let head = hdr.encode();
    let mut parts: [&[u8]; 2] = [&head, data];
    let mut written = 0usize;
    for d in chain {
        let mut addr = d.addr();
        let mut left = d.len() as usize;
        for part in parts.iter_mut() {
            if left == 0 {
                break;
            }
            let n = left.min(part.len());
            if n == 0 {
                continue;
            }
            mem.write_slice(&part[..n], addr)
                .map_err(|_| ChainError::Memory)?;
            *part = &part[n..];
            addr = GuestAddress(addr.0.wrapping_add(n as u64));
            left -= n;
            written += n;
        }
        if parts.iter().all(|p| p.is_empty()) {
            break;
        }
    }
    if parts.iter().any(|p| !p.is_empty()) {
        return Err(ChainError::BadLength {
            len: data.len() as u32,
            room: written,
        });
    }
    Ok(written as u32)
}
