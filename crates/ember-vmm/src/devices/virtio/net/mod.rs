//! virtio-net: an Ethernet device whose frames go through a backend — a tap
//! interface today (virtio 1.x §5.1).
//!
//! [`Net`] is the device state (features, configuration space, link status); on
//! activation it starts one I/O thread (`ember-netN`, its loop in `event_loop`) that
//! owns both queues and hands them to a `NetHandler` (`handler`: the frames' way in
//! and out, rate limits). The backend sits behind a small trait (`backend`): a tap
//! opened with `IFF_VNET_HDR` (`tap`) passes the virtio-net header through, so the
//! checksum and segmentation offloads the driver negotiates are the tap's too (a
//! 64 KiB TCP segment crosses unsegmented in both directions).
//!
//! One receive/transmit queue pair, mergeable receive buffers, the MTU when one is
//! configured, and the link status: a restore onto another backend or MAC shows the
//! guest its link going down and up again, so it reconfigures.

mod backend;
mod config;
mod event_loop;
pub(crate) mod handler;
pub(crate) mod rate_limiter;
mod stream;
pub(crate) mod tap;

pub use config::{MacAddr, NetBackendConfig, NetConfig};
pub use rate_limiter::{BucketConfig, RateLimit};
pub use tap::create_tap;

use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};

use thiserror::Error;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_HOST_UFO,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_MTU, VIRTIO_NET_F_STATUS,
    VIRTIO_NET_S_LINK_UP,
};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

pub(crate) use backend::Backend;
use handler::NetHandler;
use rate_limiter::Limiter;

use super::worker::Worker;
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC, VirtioDevice, VirtioInterrupt, check_queues, read_config_bytes,
};

/// Entries in each queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// `struct virtio_net_hdr_v1`: every frame's header with `VIRTIO_F_VERSION_1`.
pub(crate) const HDR_LEN: usize = 12;
/// The largest frame with its header: a 64 KiB IP packet, an Ethernet header with
/// a VLAN tag, and the virtio-net header (what Firecracker allows too).
pub(crate) const MAX_BUFFER: usize = HDR_LEN + 65_550;
const DEVICE: &str = "virtio-net";

/// Offsets in `struct virtio_net_config` (§5.1.4).
mod config_offset {
    pub(super) const MAC: usize = 0;
    pub(super) const STATUS: usize = 6;
    pub(super) const MAX_VIRTQUEUE_PAIRS: usize = 8;
    pub(super) const MTU: usize = 10;
    pub(super) const LEN: usize = 12;
}

/// virtio-net errors: a bad `--net`, or a backend that cannot be opened.
#[derive(Debug, Error)]
pub enum Error {
    /// Neither `tap=` nor `fd=`.
    #[error("--net needs tap=NAME or fd=N (a tap), passt, or socket=N (passt's stream socket)")]
    MissingBackend,
    /// Both.
    #[error("--net takes only one of tap=NAME, fd=N, passt and socket=N")]
    TwoBackends,
    /// An option we do not know.
    #[error(
        "unknown --net option `{0}` (expected tap=NAME, fd=N, passt, socket=N, mac=MAC, mtu=N, rx_bytes=, rx_ops=, tx_bytes=, tx_ops=)"
    )]
    UnknownOption(String),
    /// Not six hex bytes, or a multicast address.
    #[error("bad MAC address `{0}` (expected six hex bytes like 02:00:00:00:00:01, not multicast)")]
    BadMac(String),
    /// An MTU out of range.
    #[error("bad MTU `{0}` (expected 68 to 65521)")]
    BadMtu(String),
    /// A rate that is not `SIZE[/MS][+BURST]`.
    #[error(
        "bad rate `{0}` (expected SIZE[/MS][+BURST]: SIZE tokens per MS milliseconds, MS 1 to 3600000, SIZE above 0)"
    )]
    BadRate(String),
    /// `fd=` that is not a descriptor number.
    #[error("bad descriptor `{0}` in fd= (expected a number from 0)")]
    BadFd(String),
    /// A tap name the kernel cannot have.
    #[error("bad interface name `{0}` (1 to 15 bytes, no NUL)")]
    BadTapName(String),
    /// No such interface.
    #[error(
        "no network interface `{0}` in this network namespace (create it first: ip tuntap add {0} mode tap)"
    )]
    NoSuchTap(String),
    /// `/dev/net/tun` would not open.
    #[error("cannot open /dev/net/tun")]
    OpenTun(#[source] std::io::Error),
    /// The tap belongs to another user (or we lack CAP_NET_ADMIN).
    #[error(
        "no permission to attach to tap `{0}` (it belongs to another user: ip tuntap add {0} mode tap user $USER)"
    )]
    TapPermission(String),
    /// Another process has the tap open.
    #[error("tap `{0}` is in use by another process")]
    TapBusy(String),
    /// An interface of that name exists already (making a tap).
    #[error("an interface `{0}` exists already")]
    InterfaceExists(String),
    /// An interface of that name that is no tap.
    #[error("`{0}` is not a tap interface")]
    NotATap(String),
    /// Another failure attaching to the tap.
    #[error("cannot attach to tap `{0}`")]
    Tap(String, #[source] std::io::Error),
    /// `fd=N` that is no usable tap.
    #[error("fd={0}: {1}")]
    BadTapFd(RawFd, String),
    /// `passt` reached the device without a passt behind it (the caller starts
    /// one and hands its socket over as `socket=N`).
    #[error("--net passt: no passt was started for this device")]
    PasstNotStarted,
    /// `socket=N` that is no connected stream socket.
    #[error("socket={0}: {1}")]
    BadSocketFd(RawFd, String),
}

/// What a device has moved, for tests and the benchmark (read with relaxed ordering:
/// counters, not synchronization).
#[derive(Debug, Default)]
pub struct NetCounters {
    /// Frames delivered to the guest.
    pub rx_frames: AtomicU64,
    /// Their bytes (without headers).
    pub rx_bytes: AtomicU64,
    /// Frames the guest sent.
    pub tx_frames: AtomicU64,
    /// Their bytes (without headers).
    pub tx_bytes: AtomicU64,
    /// Frames dropped either way.
    pub dropped: AtomicU64,
}

impl NetCounters {
    fn rx(&self, bytes: usize) {
        self.rx_frames.fetch_add(1, Ordering::Relaxed);
        self.rx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    fn tx(&self, bytes: usize) {
        self.tx_frames.fetch_add(1, Ordering::Relaxed);
        self.tx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    fn rx_dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }
    fn tx_dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// The link status the guest reads, shared by the device (on the vCPU that reads
/// the configuration) and its I/O thread (which brings the link back up).
#[derive(Debug)]
pub(crate) struct Link {
    status: AtomicU16,
    generation: AtomicU32,
    /// The link is down for a change the driver must notice before it comes up.
    changing: AtomicBool,
    /// Written once the driver has read the status as down.
    seen_down: EventFd,
    seen: AtomicBool,
}

impl Link {
    fn new() -> std::io::Result<Self> {
        Ok(Link {
            status: AtomicU16::new(VIRTIO_NET_S_LINK_UP as u16),
            generation: AtomicU32::new(0),
            changing: AtomicBool::new(false),
            seen_down: EventFd::new(EFD_NONBLOCK)?,
            seen: AtomicBool::new(false),
        })
    }

    /// The I/O thread: the driver has seen the link down; up it comes.
    pub(crate) fn bring_up(&self, irq: &VirtioInterrupt) {
        if self.changing.swap(false, Ordering::SeqCst) {
            self.status
                .store(VIRTIO_NET_S_LINK_UP as u16, Ordering::SeqCst);
            self.generation.fetch_add(1, Ordering::SeqCst);
            irq.signal_config_change();
        }
    }

    pub(crate) fn is_changing(&self) -> bool {
        self.changing.load(Ordering::SeqCst)
    }
}

/// A virtio network device.
#[derive(Debug)]
pub struct Net {
    mac: MacAddr,
    mtu: Option<u16>,
    rx_rate: RateLimit,
    tx_rate: RateLimit,
    backend: Arc<dyn Backend>,
    avail_features: u64,
    acked_features: u64,
    link: Arc<Link>,
    counters: Arc<NetCounters>,
    worker: Option<Worker>,
}

/// Numbers the I/O threads `ember-net0`, `ember-net1`, …
static NEXT_ID: AtomicU32 = AtomicU32::new(0);

impl Net {
    /// The device `config` describes, on its backend (opened here). `config.mac`
    /// must be set (the builder picks one).
    pub fn new(config: &NetConfig) -> Result<Self, Error> {
        config.validate()?;
        let backend: Arc<dyn Backend> = match &config.backend {
            NetBackendConfig::Tap(name) => Arc::new(tap::Tap::open(name)?),
            NetBackendConfig::Fd(fd) => Arc::new(tap::Tap::from_fd(*fd)?),
            NetBackendConfig::Socket(fd) => Arc::new(stream::Stream::from_fd(*fd)?),
            NetBackendConfig::Passt => return Err(Error::PasstNotStarted),
        };
        Self::with_backend(config, backend).map_err(|e| Error::Tap(config.backend.to_string(), e))
    }

    pub(crate) fn with_backend(
        config: &NetConfig,
        backend: Arc<dyn Backend>,
    ) -> std::io::Result<Self> {
        let bit = |b: u32| 1u64 << b;
        // EVENT_IDX: the handler keeps `avail_event` current on both queues.
        let mut f = VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_INDIRECT_DESC
            | VIRTIO_RING_F_EVENT_IDX
            | bit(VIRTIO_NET_F_MAC)
            | bit(VIRTIO_NET_F_STATUS)
            | bit(VIRTIO_NET_F_MRG_RXBUF);
        if config.mtu.is_some() {
            f |= bit(VIRTIO_NET_F_MTU);
        }
        if backend.vnet_hdr() {
            for b in [
                VIRTIO_NET_F_CSUM,
                VIRTIO_NET_F_GUEST_CSUM,
                VIRTIO_NET_F_GUEST_TSO4,
                VIRTIO_NET_F_GUEST_TSO6,
                VIRTIO_NET_F_GUEST_UFO,
                VIRTIO_NET_F_HOST_TSO4,
                VIRTIO_NET_F_HOST_TSO6,
                VIRTIO_NET_F_HOST_UFO,
            ] {
                f |= bit(b);
            }
        }
        Ok(Net {
            mac: config.mac.unwrap_or_else(MacAddr::random),
            mtu: config.mtu,
            rx_rate: config.rx_rate,
            tx_rate: config.tx_rate,
            backend,
            avail_features: f,
            acked_features: 0,
            link: Arc::new(Link::new()?),
            counters: Arc::default(),
            worker: None,
        })
    }

    /// A restored device on another backend or MAC: its link shows down until the
    /// driver has read it so, then comes up, so the guest notices the change.
    pub fn change_link(&mut self) {
        self.link.status.store(0, Ordering::SeqCst);
        self.link.generation.fetch_add(1, Ordering::SeqCst);
        self.link.changing.store(true, Ordering::SeqCst);
    }

    /// What the device has moved.
    pub fn counters(&self) -> Arc<NetCounters> {
        self.counters.clone()
    }

    fn config_space(&self) -> [u8; config_offset::LEN] {
        use config_offset::*;
        let mut c = [0u8; LEN];
        c[MAC..MAC + 6].copy_from_slice(&self.mac.0);
        c[STATUS..STATUS + 2]
            .copy_from_slice(&self.link.status.load(Ordering::SeqCst).to_le_bytes());
        c[MAX_VIRTQUEUE_PAIRS..MAX_VIRTQUEUE_PAIRS + 2].copy_from_slice(&1u16.to_le_bytes());
        c[MTU..MTU + 2].copy_from_slice(&self.mtu.unwrap_or(1500).to_le_bytes());
        c
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn ack_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space(), offset, data);
        let s = config_offset::STATUS as u64;
        let reads_status = offset < s + 2 && offset + data.len() as u64 > s;
        if reads_status && self.link.is_changing() && !self.link.seen.swap(true, Ordering::SeqCst) {
            // The I/O thread brings the link up once the driver has had its look.
            if let Err(e) = self.link.seen_down.write(1) {
                crate::guest_warn!("{DEVICE}: cannot tell the I/O thread the link was seen: {e}");
            }
        }
    }

    fn config_generation(&self) -> u32 {
        self.link.generation.load(Ordering::SeqCst)
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        irq: VirtioInterrupt,
        mut queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        check_queues(&queues, 2)?;
        let tx = queues.remove(1);
        let rx = queues.remove(0);
        let acked = self.acked_features;
        let handler = NetHandler::new(
            mem,
            rx.queue,
            tx.queue,
            irq.clone(),
            self.backend.clone(),
            acked & (1 << VIRTIO_NET_F_MRG_RXBUF) != 0,
            Limiter::new(&self.rx_rate),
            Limiter::new(&self.tx_rate),
            self.counters.clone(),
        );
        if self.link.is_changing() {
            if acked & (1 << VIRTIO_NET_F_STATUS) == 0 {
                // A driver that does not read the status cannot be told.
                self.link.bring_up(&irq);
            } else {
                irq.signal_config_change();
            }
        }
        let link = self.link.clone();
        let seen = self
            .link
            .seen_down
            .try_clone()
            .map_err(ActivateError::EventFd)?;
        let evts = [rx.evt, tx.evt];
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.worker = Some(
            Worker::spawn(
                format!("ember-net{id}"),
                crate::seccomp::Thread::Net,
                move |kill| event_loop::run(handler, acked, evts, link, seen, kill),
            )
            .map_err(ActivateError::Spawn)?,
        );
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
        self.acked_features = 0;
    }

    fn holds_buffers(&self, queue: usize) -> bool {
        // Receive buffers wait for frames.
        queue == handler::RX
    }
}

/// For the fuzz target `net_stream`: passt's framing, see `stream`.
#[cfg(fuzzing)]
pub(crate) fn fuzz_stream(input: &[u8]) {
    stream::fuzz_stream(input);
}

/// For the fuzz target `net` (fuzz/, built by scripts/fuzz with `--cfg fuzzing`):
/// transmit, receive (with `input` frames waiting in the backend), and both again,
/// on arbitrary memory, with and without mergeable buffers.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queues(
    mem: GuestMemory,
    rx: virtio_queue::Queue,
    tx: virtio_queue::Queue,
    irq: VirtioInterrupt,
    input: &[u8],
    mrg_rxbuf: bool,
) {
    let (mut backend, peer) = backend::SocketBackend::pair(true);
    // Both ways through the device: straight from and into guest memory, and copied.
    backend.scatter = input.first().is_none_or(|b| b & 1 == 0);
    peer.set_nonblocking(true).ok();
    for frame in input.chunks(1500) {
        let _ = peer.send(frame);
    }
    let mut h = NetHandler::new(
        mem,
        rx,
        tx,
        irq,
        Arc::new(backend),
        mrg_rxbuf,
        Limiter::default(),
        Limiter::default(),
        Arc::default(),
    );
    for _ in 0..2 {
        h.process_tx();
        h.process_rx();
        h.raise_interrupt();
    }
    let mut sink = [0u8; 2048];
    while peer.recv(&mut sink).is_ok() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use backend::SocketBackend;

    fn net() -> Net {
        let (b, _peer) = SocketBackend::pair(true);
        let mut c = NetConfig::tap("t");
        c.mac = Some(MacAddr([2, 1, 2, 3, 4, 5]));
        c.mtu = Some(9000);
        Net::with_backend(&c, Arc::new(b)).unwrap()
    }

    #[test]
    fn config_space_has_mac_status_pairs_and_mtu() {
        let n = net();
        let mut c = [0u8; 12];
        n.read_config(0, &mut c);
        assert_eq!(c, [2, 1, 2, 3, 4, 5, 1, 0, 1, 0, 0x28, 0x23]);
        let f = n.avail_features();
        for b in [
            VIRTIO_NET_F_MAC,
            VIRTIO_NET_F_STATUS,
            VIRTIO_NET_F_MRG_RXBUF,
            VIRTIO_NET_F_MTU,
            VIRTIO_NET_F_CSUM,
            VIRTIO_NET_F_GUEST_TSO4,
            VIRTIO_NET_F_HOST_TSO6,
        ] {
            assert!(f & (1 << b) != 0, "feature {b}");
        }
        let (b, _peer) = SocketBackend::pair(false);
        let plain = Net::with_backend(&NetConfig::tap("t"), Arc::new(b)).unwrap();
        assert_eq!(plain.avail_features() & (1 << VIRTIO_NET_F_CSUM), 0);
        assert_eq!(plain.avail_features() & (1 << VIRTIO_NET_F_MTU), 0);
        assert_eq!(plain.mac.0[0] & 3, 2, "a random local MAC");
    }

    #[test]
    fn a_changed_link_goes_down_until_the_driver_has_read_it() {
        let mut n = net();
        let g0 = n.config_generation();
        n.change_link();
        assert_ne!(n.config_generation(), g0);
        let mut s = [0u8; 2];
        // A read of the MAC alone tells the thread nothing.
        n.read_config(0, &mut [0u8; 6]);
        assert!(n.link.seen_down.read().is_err());
        n.read_config(6, &mut s);
        assert_eq!(s, [0, 0]);
        assert_eq!(n.link.seen_down.read().unwrap(), 1);
        let line = Arc::new(CountingInterrupt::default());
        let irq = VirtioInterrupt::new(line.clone());
        n.link.bring_up(&irq);
        n.read_config(6, &mut s);
        assert_eq!(s, [1, 0]);
        assert_eq!(line.count(), 1);
        n.link.bring_up(&irq);
        assert_eq!(line.count(), 1, "once");
    }
}
