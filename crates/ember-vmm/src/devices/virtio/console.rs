//! virtio-console with a single port (virtio 1.x §5.3, no `MULTIPORT`): a binary-safe
//! byte pipe between the guest's `/dev/hvc0` and a host `Read`/`Write` pair — typically
//! both ends of one unix socket (`ember run --channel SOCK`).
//!
//! Transmit (queue 1) copies guest bytes to the output. Receive (queue 0) is fed from the
//! input fd by the device thread; when the guest has no receive buffers posted, the thread
//! stops reading (back-pressure) until the guest offers some.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_ids::VIRTIO_ID_CONSOLE;
use virtio_queue::{Queue, QueueOwnedT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::worker::{QueueHandler, Worker, spawn_queue_worker};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC,
    VirtioDevice, VirtioInterrupt, check_queues, pop_chains, return_chain,
};

/// Entries per queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// Index of the receive queue (host to guest).
pub(crate) const RX_QUEUE: usize = 0;
/// Index of the transmit queue (guest to host).
pub(crate) const TX_QUEUE: usize = 1;
/// Bytes read from the input in one go.
const INPUT_CHUNK: usize = 4096;
/// Bytes copied from guest memory to the output in one go: all the transmit path ever
/// holds on the host, however long the guest's descriptors say they are.
pub(crate) const TX_CHUNK: usize = 64 * 1024;
/// The most one transmit chain may carry. Linux's hvc driver sends at most a page per
/// chain; a longer chain is a broken or hostile driver, and it is dropped, not sent.
pub(crate) const MAX_TX_CHAIN: u64 = 1 << 20;
/// The most descriptors one transmit chain may have. An indirect table's length is the
/// guest's to write (up to 65535 descriptors), and the segment list is held while the chain
/// is checked: this bounds it to 4 KiB. Linux sends one descriptor per chain.
pub(crate) const MAX_TX_SEGMENTS: usize = QUEUE_SIZE as usize;
const DEVICE: &str = "virtio-console";

/// Where guest input comes from: anything readable with an fd epoll can watch (a socket,
/// a pipe, a terminal).
pub trait ConsoleInput: Read + AsRawFd + Send {}
impl<T: Read + AsRawFd + Send> ConsoleInput for T {}

/// The host ends, shared by the device and its thread so they survive a guest reset.
struct HostIo {
    input: Option<Box<dyn ConsoleInput>>,
    output: Box<dyn Write + Send>,
    /// Input read but not yet delivered (the guest had no buffers).
    pending: Vec<u8>,
    /// The input reached end of file.
    input_closed: bool,
}

/// A single-port virtio console.
///
/// # Example
///
/// ```
/// use std::os::unix::net::UnixStream;
/// use ember_vmm::devices::virtio::{Console, VirtioDevice};
///
/// let (vmm_end, _appliance_end) = UnixStream::pair().unwrap();
/// let console = Console::from_unix_stream(vmm_end).unwrap();
/// assert_eq!(console.device_type(), 3);
/// assert_eq!(console.queue_max_sizes().len(), 2);
/// ```
pub struct Console {
    io: Arc<Mutex<HostIo>>,
    input_fd: Option<RawFd>,
    worker: Option<Worker>,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("input_fd", &self.input_fd)
            .field("active", &self.worker.is_some())
            .finish()
    }
}

impl Console {
    /// A console reading guest input from `input` (if any) and writing guest output to
    /// `output`. For stdio: `Console::new(Some(Box::new(std::io::stdin())),
    /// Box::new(std::io::stdout()))`.
    pub fn new(input: Option<Box<dyn ConsoleInput>>, output: Box<dyn Write + Send>) -> Self {
        let input_fd = input.as_ref().map(|i| i.as_raw_fd());
        Self {
            io: Arc::new(Mutex::new(HostIo {
                input,
                output,
                pending: Vec::new(),
                input_closed: false,
            })),
            input_fd,
            worker: None,
        }
    }

    /// A console whose input and output are both ends of `stream`: the appliance's data
    /// channel.
    pub fn from_unix_stream(stream: UnixStream) -> io::Result<Self> {
        let output = stream.try_clone()?;
        Ok(Self::new(Some(Box::new(stream)), Box::new(output)))
    }
}

impl VirtioDevice for Console {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_CONSOLE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC
    }

    fn ack_features(&mut self, _features: u64) {}

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // cols/rows/max_nr_ports/emerg_wr are only meaningful with features we do not
        // offer; they read as zero.
        super::read_config_bytes(&[0; 12], offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        irq: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        check_queues(&queues, 2)?;
        let mut evts = Vec::with_capacity(2);
        let mut qs = Vec::with_capacity(2);
        for ActiveQueue { queue, evt } in queues {
            qs.push(queue);
            evts.push(evt);
        }
        let tx = qs.pop().ok_or(ActivateError::QueueNotReady(TX_QUEUE))?;
        let rx = qs.pop().ok_or(ActivateError::QueueNotReady(RX_QUEUE))?;
        let handler = ConsoleHandler {
            mem,
            rx,
            tx,
            irq,
            io: self.io.clone(),
            tx_chunk: None,
        };
        self.worker = Some(spawn_queue_worker(
            "ember-console".into(),
            crate::seccomp::Thread::Console,
            handler,
            evts,
            self.input_fd,
        )?);
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
    }

    fn holds_buffers(&self, queue: usize) -> bool {
        // Receive buffers wait for host input.
        queue == RX_QUEUE
    }
}

/// Moves bytes between the queues and the host ends.
pub(crate) struct ConsoleHandler {
    mem: GuestMemory,
    rx: Queue,
    tx: Queue,
    irq: VirtioInterrupt,
    io: Arc<Mutex<HostIo>>,
    /// The transmit copy buffer, made on first use and kept.
    tx_chunk: Option<Vec<u8>>,
}

/// Checks a transmit chain's readable segments before anything is read or allocated for
/// them: at most [`MAX_TX_SEGMENTS`] of them, each inside guest memory, their sum within
/// [`MAX_TX_CHAIN`].
fn check_tx_chain(mem: &GuestMemory, segs: &[(GuestAddress, u32)]) -> Result<(), &'static str> {
    if segs.len() > MAX_TX_SEGMENTS {
        return Err("more descriptors than the per-chain cap");
    }
    let mut total = 0u64;
    for &(addr, len) in segs {
        total += u64::from(len);
        if total > MAX_TX_CHAIN {
            return Err("longer than the per-chain cap");
        }
        if !mem.check_range(addr, len as usize) {
            return Err("buffer outside guest memory");
        }
    }
    Ok(())
}

/// Copies checked segments to `out` through `chunk`, a piece at a time.
fn stream_segments(
    mem: &GuestMemory,
    segs: &[(GuestAddress, u32)],
    chunk: &mut [u8],
    out: &mut dyn Write,
) -> io::Result<()> {
    for &(addr, len) in segs {
        let mut done = 0usize;
        let len = len as usize;
        while done < len {
            let n = (len - done).min(chunk.len());
            // `check_tx_chain` accepted the whole segment, so `addr + done` cannot wrap.
            mem.read_slice(&mut chunk[..n], GuestAddress(addr.0 + done as u64))
                .map_err(|e| io::Error::other(e.to_string()))?;
            out.write_all(&chunk[..n])?;
            done += n;
        }
    }
    Ok(())
}

impl ConsoleHandler {
    fn io(&self) -> std::sync::MutexGuard<'_, HostIo> {
        self.io.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends everything the guest queued for transmission to the output.
    ///
    /// The guest writes every descriptor's address and length, so nothing is allocated from
    /// them: each chain is checked whole first (every descriptor inside guest memory, the
    /// total within [`MAX_TX_CHAIN`]) and then streamed through one fixed [`TX_CHUNK`]
    /// buffer. A chain that fails the check is returned unsent and logged; the host holds
    /// at most one chunk whatever the guest queues.
    fn transmit(&mut self) {
        let chains = pop_chains(&mut self.tx, &self.mem, &self.irq, DEVICE);
        if chains.is_empty() {
            return;
        }
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let mut heads = Vec::with_capacity(chains.len());
        let mut segs = Vec::new();
        for chain in chains {
            heads.push(chain.head_index());
            // One past the cap is enough to refuse the chain: the rest is never read.
            segs.clear();
            segs.extend(
                chain
                    .readable()
                    .take(MAX_TX_SEGMENTS + 1)
                    .map(|d| (d.addr(), d.len())),
            );
            if let Err(problem) = check_tx_chain(&self.mem, &segs) {
                crate::guest_warn!("{DEVICE}: transmit chain dropped: {problem}");
                continue;
            }
            let chunk = self.tx_chunk.get_or_insert_with(|| vec![0; TX_CHUNK]);
            if let Err(e) = stream_segments(&self.mem, &segs, chunk, &mut *io.output) {
                crate::guest_warn!("{DEVICE}: output failed: {e}");
            }
        }
        if let Err(e) = io.output.flush() {
            crate::guest_warn!("{DEVICE}: output flush failed: {e}");
        }
        drop(io);
        let mut returned = false;
        for head in heads {
            returned |= return_chain(&mut self.tx, &self.mem, &self.irq, DEVICE, head, 0);
        }
        if returned {
            self.notify(TX_QUEUE);
        }
    }

    /// Copies pending input into the guest's receive buffers, one chain at a time, while
    /// both last.
    fn deliver(&mut self) {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let mut returned = false;
        while !io.pending.is_empty() {
            let chain = match self.rx.iter(&self.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    crate::guest_warn!("{DEVICE}: unusable receive ring ({e}); device needs reset");
                    self.irq.set_needs_reset();
                    None
                }
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let mut written = 0usize;
            for desc in chain.writable() {
                let n = (desc.len() as usize).min(io.pending.len() - written);
                if n == 0 {
                    break;
                }
                if self
                    .mem
                    .write_slice(&io.pending[written..written + n], desc.addr())
                    .is_err()
                {
                    crate::guest_warn!("{DEVICE}: receive buffer outside guest memory");
                    break;
                }
                written += n;
            }
            io.pending.drain(..written);
            returned |= return_chain(
                &mut self.rx,
                &self.mem,
                &self.irq,
                DEVICE,
                head,
                written as u32,
            );
        }
        drop(io);
        if returned {
            self.notify(RX_QUEUE);
        }
    }

    fn notify(&mut self, index: usize) {
        let queue = if index == RX_QUEUE {
            &mut self.rx
        } else {
            &mut self.tx
        };
        if super::needs_interrupt(queue, &self.mem, DEVICE) {
            self.irq.signal_used_queue();
        }
    }
}

impl QueueHandler for ConsoleHandler {
    fn process_queue(&mut self, index: usize) {
        match index {
            RX_QUEUE => self.deliver(),
            TX_QUEUE => self.transmit(),
            _ => {}
        }
    }

    fn process_input(&mut self) {
        {
            let mut io = self.io();
            if !io.pending.is_empty() || io.input_closed {
                return;
            }
            let mut chunk = [0u8; INPUT_CHUNK];
            let Some(input) = io.input.as_mut() else {
                return;
            };
            match input.read(&mut chunk) {
                Ok(0) => io.input_closed = true,
                Ok(n) => io.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    crate::guest_warn!("{DEVICE}: input failed: {e}");
                    io.input_closed = true;
                }
            }
        }
        self.deliver();
    }

    fn wants_input(&self) -> bool {
        let io = self.io();
        io.input.is_some() && !io.input_closed && io.pending.is_empty()
    }
}

/// For the fuzz target `console` (fuzz/, built by scripts/fuzz with `--cfg fuzzing`):
/// transmit, receive (with `input` waiting to be delivered), transmit again, on arbitrary
/// memory.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queues(
    mem: GuestMemory,
    rx: Queue,
    tx: Queue,
    irq: VirtioInterrupt,
    input: &[u8],
) {
    let console = Console::new(None, Box::new(io::sink()));
    console
        .io
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pending
        .extend_from_slice(input);
    let mut h = ConsoleHandler {
        mem,
        rx,
        tx,
        irq,
        io: console.io.clone(),
        tx_chunk: None,
    };
    h.process_queue(TX_QUEUE);
    h.process_queue(RX_QUEUE);
    h.process_queue(TX_QUEUE);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::test_utils::*;
    use vm_memory::GuestAddress;

    const RX_AT: u64 = 0x8000;

    fn rig() -> (GuestMemory, Arc<CountingInterrupt>, UnixStream, Console) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        (
            memory(),
            Arc::new(CountingInterrupt::default()),
            theirs,
            Console::from_unix_stream(ours).unwrap(),
        )
    }

    fn handler(
        mem: &GuestMemory,
        rx: &TestQueue,
        tx: &TestQueue,
        irq: &Arc<CountingInterrupt>,
        console: &Console,
    ) -> ConsoleHandler {
        ConsoleHandler {
            mem: mem.clone(),
            rx: rx.create_queue().unwrap(),
            tx: tx.create_queue().unwrap(),
            irq: VirtioInterrupt::new(irq.clone()),
            io: console.io.clone(),
            tx_chunk: None,
        }
    }

    #[test]
    fn transmit_is_binary_safe() {
        let (mem, irq, mut peer, console) = rig();
        let rx = TestQueue::create(&mem, GuestAddress(RX_AT), 16);
        let tx = TestQueue::new(&mem, 16);
        let all: Vec<u8> = (0..=255).collect();
        mem.write_slice(&all, GuestAddress(DATA_START)).unwrap();
        add_chain(&tx, 0, &[r(DATA_START, 200), r(DATA_START + 200, 56)]);
        add_chain(&tx, 2, &[r(DATA_START, 3), w(DATA_START + 0x1000, 8)]);
        let mut h = handler(&mem, &rx, &tx, &irq, &console);
        h.process_queue(TX_QUEUE);
        let mut got = vec![0u8; 259];
        peer.read_exact(&mut got).unwrap();
        assert_eq!(&got[..256], &all[..]);
        assert_eq!(&got[256..], &[0, 1, 2]);
        assert_eq!(used(&tx), [(0, 0), (2, 0)]);
        assert_eq!(irq.count(), 1);
    }

    /// A hostile driver's transmit chains: lengths far beyond guest memory, addresses
    /// outside it, and a chain longer than the cap. None may size a host allocation, nothing
    /// of a bad chain is sent, and every chain comes back.
    #[test]
    fn hostile_transmit_chains_allocate_nothing_big() {
        let (mem, irq, mut peer, console) = rig();
        let rx = TestQueue::create(&mem, GuestAddress(RX_AT), 16);
        let tx = TestQueue::new(&mem, 16);
        mem.write_slice(b"ok", GuestAddress(DATA_START)).unwrap();
        let end = MEM_SIZE as u64;
        // Starts inside guest memory, runs 64 MiB past its end (the old code sized its
        // buffer from this length before checking the address).
        add_chain(&tx, 0, &[r(end - 16, 64 << 20)]);
        // Entirely outside guest memory.
        add_chain(&tx, 1, &[r(end + 0x1000, 2 << 20)]);
        // Inside guest memory, but 3 MiB in one chain: over the cap.
        add_chain(
            &tx,
            2,
            &[r(0, 1 << 20), r(0, 1 << 20), r(DATA_START, 1 << 20)],
        );
        // Inside and small: goes through.
        add_chain(&tx, 5, &[r(DATA_START, 2)]);
        let mut h = handler(&mem, &rx, &tx, &irq, &console);
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            peer.read_to_end(&mut got).unwrap();
            got
        });
        reset_largest_allocation();
        h.process_queue(TX_QUEUE);
        let largest = largest_allocation();
        assert_eq!(used(&tx), [(0, 0), (1, 0), (2, 0), (5, 0)]);
        drop(h);
        drop(console);
        assert_eq!(reader.join().unwrap(), b"ok");
        assert!(largest <= TX_CHUNK, "transmit allocated {largest} bytes");
    }

    /// An indirect table of 4096 one-byte descriptors (the guest writes the table's length:
    /// up to 65535) is over the descriptor cap: dropped whole, and the segment list the
    /// check holds stays small. Without the cap it held 64 KiB of segments for this chain
    /// and 1 MiB for a full table; the chain at the cap still goes through.
    #[test]
    fn transmit_chains_with_too_many_descriptors_are_dropped() {
        let (mem, irq, mut peer, console) = rig();
        let rx = TestQueue::create(&mem, GuestAddress(RX_AT), 16);
        let tx = TestQueue::new(&mem, 16);
        mem.write_slice(&[b'x'; 4096], GuestAddress(DATA_START))
            .unwrap();
        let many: Vec<Seg> = (0..4096).map(|i| r(DATA_START + i, 1)).collect();
        add_indirect_chain(&tx, 0, DATA_START + 0x1_0000, &many);
        let at_cap: Vec<Seg> = (0..MAX_TX_SEGMENTS as u64)
            .map(|i| r(DATA_START + i, 1))
            .collect();
        add_indirect_chain(&tx, 1, DATA_START + 0x2_0000, &at_cap);
        let mut h = handler(&mem, &rx, &tx, &irq, &console);
        // The copy buffer made up front, so what is measured is the segment list.
        h.tx_chunk = Some(vec![0; TX_CHUNK]);
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            peer.read_to_end(&mut got).unwrap();
            got
        });
        reset_largest_allocation();
        h.process_queue(TX_QUEUE);
        let largest = largest_allocation();
        assert_eq!(used(&tx), [(0, 0), (1, 0)]);
        drop(h);
        drop(console);
        assert_eq!(reader.join().unwrap().len(), MAX_TX_SEGMENTS);
        assert!(
            largest <= 16 << 10,
            "the segment list grew with the table: {largest} bytes"
        );
    }

    /// A chain up to the cap streams through in chunks, unchanged.
    #[test]
    fn transmit_streams_a_chain_at_the_cap() {
        let (mem, irq, mut peer, console) = rig();
        let rx = TestQueue::create(&mem, GuestAddress(RX_AT), 16);
        let tx = TestQueue::new(&mem, 16);
        let data: Vec<u8> = (0..MAX_TX_CHAIN as usize)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        mem.write_slice(&data, GuestAddress(DATA_START)).unwrap();
        let half = (MAX_TX_CHAIN / 2) as u32;
        add_chain(
            &tx,
            0,
            &[r(DATA_START, half), r(DATA_START + u64::from(half), half)],
        );
        let mut h = handler(&mem, &rx, &tx, &irq, &console);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; MAX_TX_CHAIN as usize];
            peer.read_exact(&mut got).unwrap();
            got
        });
        reset_largest_allocation();
        h.process_queue(TX_QUEUE);
        assert!(largest_allocation() <= TX_CHUNK);
        assert!(reader.join().unwrap() == data);
        assert_eq!(used(&tx), [(0, 0)]);
    }

    #[test]
    fn input_waits_for_receive_buffers() {
        let (mem, irq, mut peer, console) = rig();
        let rx = TestQueue::create(&mem, GuestAddress(RX_AT), 16);
        let tx = TestQueue::new(&mem, 16);
        let mut h = handler(&mem, &rx, &tx, &irq, &console);
        assert!(h.wants_input());
        peer.write_all(b"\x00hello\xff").unwrap();
        h.process_input();
        // No buffers posted: the bytes wait and reading pauses.
        assert!(!h.wants_input());
        assert!(used(&rx).is_empty());
        add_chain(&rx, 0, &[w(DATA_START, 4)]);
        add_chain(&rx, 1, &[w(DATA_START + 0x100, 64)]);
        h.process_queue(RX_QUEUE);
        assert_eq!(used(&rx), [(0, 4), (1, 3)]);
        let mut got = [0u8; 7];
        mem.read_slice(&mut got[..4], GuestAddress(DATA_START))
            .unwrap();
        mem.read_slice(&mut got[4..], GuestAddress(DATA_START + 0x100))
            .unwrap();
        assert_eq!(&got, b"\x00hello\xff");
        assert!(h.wants_input());
        // End of file stops reading for good.
        drop(peer);
        h.process_input();
        assert!(!h.wants_input());
    }

    #[test]
    fn activated_console_pipes_both_ways() {
        use crate::devices::virtio::VirtioDevice;
        let (mem, irq, mut peer, mut console) = rig();
        let rx = TestQueue::create(&mem, GuestAddress(RX_AT), 16);
        let tx = TestQueue::new(&mem, 16);
        add_chain(&rx, 0, &[w(DATA_START, 16)]);
        let evts: Vec<_> = (0..2)
            .map(|_| {
                vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap()
            })
            .collect();
        let kick_tx = evts[1].try_clone().unwrap();
        let queues = vec![
            ActiveQueue {
                queue: rx.create_queue().unwrap(),
                evt: evts[0].try_clone().unwrap(),
            },
            ActiveQueue {
                queue: tx.create_queue().unwrap(),
                evt: evts[1].try_clone().unwrap(),
            },
        ];
        console
            .activate(mem.clone(), VirtioInterrupt::new(irq.clone()), queues)
            .unwrap();
        peer.write_all(b"ping").unwrap();
        mem.write_slice(b"pong", GuestAddress(DATA_START + 0x100))
            .unwrap();
        add_chain(&tx, 0, &[r(DATA_START + 0x100, 4)]);
        kick_tx.write(1).unwrap();
        let mut got = [0u8; 4];
        peer.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");
        let start = std::time::Instant::now();
        while rx.used_idx() == 0 {
            assert!(start.elapsed().as_secs() < 5, "input never delivered");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        console.reset();
        let mut delivered = [0u8; 4];
        mem.read_slice(&mut delivered, GuestAddress(DATA_START))
            .unwrap();
        assert_eq!(&delivered, b"ping");
    }
}
