//! A polling virtio-mmio (version 2) network driver, and the `net*` commands
//! built on it: frames out and in (counted, timed, their contents checked), a
//! TCP segment of up to 64 KiB handed to the device unsegmented, malformed
//! chains the device must refuse, and a watch on the link status.
//!
//! Both queues live at fixed guest-physical addresses (4-8 MiB, identity
//! mapped). Receive descriptor i is a 4 KiB buffer, all posted at once and
//! reposted as they come back (mergeable buffers: a frame spans as many as
//! its header says). Transmit descriptor i is a 2 KiB slot, reused in ring
//! order (both VMMs complete transmits in order). We poll both used rings and
//! ask for no interrupts. Event indices are negotiated unless `netevent=0`, as
//! Linux's driver does: the device then says after how many new buffers it
//! wants a notification.

use crate::io::{self, Clock};
use crate::println;
use crate::virtio::{
    DESC_F_WRITE, INT_CONFIG, Mmio, Rings, STATUS_NEEDS_RESET, rd8, rd16, rd32, reg, wr8, wr16,
    wr32,
};
use core::sync::atomic::{Ordering, fence};

const DEVICE_ID_NET: u32 = 1;

const F_CSUM: u64 = 1 << 0;
const F_GUEST_CSUM: u64 = 1 << 1;
const F_MTU: u64 = 1 << 3;
const F_MAC: u64 = 1 << 5;
const F_GUEST_TSO4: u64 = 1 << 7;
const F_GUEST_TSO6: u64 = 1 << 8;
const F_HOST_TSO4: u64 = 1 << 11;
const F_HOST_TSO6: u64 = 1 << 12;
const F_MRG_RXBUF: u64 = 1 << 15;
const F_STATUS: u64 = 1 << 16;
const F_EVENT_IDX: u64 = 1 << 29;
const OFFLOADS: u64 =
    F_CSUM | F_GUEST_CSUM | F_GUEST_TSO4 | F_GUEST_TSO6 | F_HOST_TSO4 | F_HOST_TSO6;

const HDR_LEN: u64 = 12;
const HDR_F_NEEDS_CSUM: u8 = 1;
const GSO_TCPV4: u8 = 1;
/// The ethertype of our own test frames (IEEE local experimental).
pub const ETHERTYPE_TEST: u16 = 0x88b5;
/// The TCP sequence number of the first payload byte of `nettso`.
const TCP_ISN: u32 = 1000;

const RX: u32 = 0;
const TX: u32 = 1;
const QUEUE_SIZE_MAX: u16 = 256;
const RX_RINGS: Rings = Rings { desc: 0x40_0000 };
const RX_AVAIL: u64 = RX_RINGS.avail();
const RX_USED: u64 = RX_RINGS.used();
const TX_RINGS: Rings = Rings { desc: 0x40_4000 };
const TX_AVAIL: u64 = TX_RINGS.avail();
const TX_USED: u64 = TX_RINGS.used();
const TX_SLOTS: u64 = 0x41_0000;
const TX_SLOT: u64 = 2048;
const TX_BIG: u64 = 0x4a_0000;
const RX_BUFS: u64 = 0x50_0000;
const RX_BUF: u64 = 4096;
/// Where a received frame is gathered from its buffers.
const SCRATCH: u64 = 0x60_0000;
const SCRATCH_LEN: u64 = 0x2_0000;

/// One option token (they persist for later commands).
pub enum NetOpt {
    Offloads(bool),
    /// `VIRTIO_RING_F_EVENT_IDX` (on by default, as in Linux's driver).
    EventIdx(bool),
    Len(u64),
    Count(u64),
    Bytes(u64),
    Secs(u64),
}

/// One command.
pub enum NetCmd {
    Info,
    Tx,
    Tso(u64),
    Rx,
    Bad(BadKind),
    Watch(u64),
}

/// The malformed chain `netbad` offers.
#[derive(Clone, Copy)]
pub enum BadKind {
    /// A buffer far outside guest memory.
    OutOfMemory,
    /// A device-writable descriptor to transmit.
    Writable,
    /// A frame longer than any frame.
    TooLong,
}

/// Settings and the device, kept between commands.
pub struct Net {
    offloads: bool,
    event_idx: bool,
    len: u64,
    count: u64,
    bytes: u64,
    secs: u64,
    dev: Option<Device>,
}

impl Default for Net {
    fn default() -> Self {
        Net {
            offloads: true,
            event_idx: true,
            len: 60,
            count: 1000,
            bytes: 0,
            secs: 0,
            dev: None,
        }
    }
}

struct Device {
    mmio: Mmio,
    features: u64,
    rx_size: u16,
    tx_size: u16,
    rx_avail: u16,
    rx_used: u16,
    tx_avail: u16,
    tx_used: u16,
    /// The avail index each queue's driver last told the device about (or
    /// decided it need not): where event-index notification counts from.
    told: [u16; 2],
}

impl Device {
    fn init(offloads: bool, event_idx: bool) -> Result<Device, &'static str> {
        let mmio = Mmio::find(DEVICE_ID_NET).ok_or("no virtio-net device found")?;
        let mut want = F_MAC | F_STATUS | F_MRG_RXBUF | F_MTU;
        if offloads {
            want |= OFFLOADS;
        }
        if event_idx {
            want |= F_EVENT_IDX;
        }
        let accepted = mmio.negotiate(want)?;
        if accepted & F_MRG_RXBUF == 0 {
            return Err("the device does not offer mergeable receive buffers");
        }
        let rx_size = mmio.setup_queue(RX, RX_RINGS, 2, QUEUE_SIZE_MAX)?;
        let tx_size = mmio.setup_queue(TX, TX_RINGS, 2, QUEUE_SIZE_MAX)?;
        for i in 0..rx_size {
            let buf = RX_BUFS + u64::from(i) * RX_BUF;
            RX_RINGS.write_desc(i, buf, RX_BUF as u32, DESC_F_WRITE, 0);
            RX_RINGS.offer(i, i);
        }
        fence(Ordering::SeqCst);
        wr16(RX_AVAIL + 2, rx_size);
        mmio.driver_ok();
        let mut dev = Device {
            mmio,
            features: accepted,
            rx_size,
            tx_size,
            rx_avail: rx_size,
            rx_used: 0,
            tx_avail: 0,
            tx_used: 0,
            told: [0, 0],
        };
        dev.notify(RX);
        Ok(dev)
    }

    /// Tells the device of the buffers published since the last call, if it
    /// asked: past its avail event with `VIRTIO_RING_F_EVENT_IDX`, else
    /// unless it set `VRING_USED_F_NO_NOTIFY`.
    fn notify(&mut self, queue: u32) {
        let (rings, new, size, used) = if queue == RX {
            (RX_RINGS, self.rx_avail, self.rx_size, self.rx_used)
        } else {
            (TX_RINGS, self.tx_avail, self.tx_size, self.tx_used)
        };
        let old = core::mem::replace(&mut self.told[queue as usize], new);
        let kick = if self.features & F_EVENT_IDX != 0 {
            // No interrupts (the flag means nothing with event indices): the
            // used event is kept half the index space ahead.
            wr16(
                rings.avail() + 4 + 2 * u64::from(size),
                used.wrapping_add(0x8000),
            );
            fence(Ordering::SeqCst);
            let event = rd16(rings.used() + 4 + 8 * u64::from(size));
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            !rings.no_notify()
        };
        if kick {
            self.mmio.write(reg::QUEUE_NOTIFY, queue);
        }
    }

    fn mac(&self) -> [u8; 6] {
        core::array::from_fn(|i| self.mmio.read(reg::CONFIG + i as u64) as u8)
    }

    fn link_status(&self) -> u16 {
        self.mmio.read(reg::CONFIG + 6) as u16
    }

    fn status(&self) -> u32 {
        self.mmio.read(reg::STATUS)
    }

    /// Takes back finished transmits; how many are still in flight.
    fn reap_tx(&mut self) -> u16 {
        fence(Ordering::SeqCst);
        self.tx_used = rd16(TX_USED + 2);
        self.tx_avail.wrapping_sub(self.tx_used)
    }

    /// Queues one transmit (unpublished until `publish_tx`) of the `len` bytes
    /// at `addr` (header included).
    fn queue_tx(&mut self, addr: u64, len: u64, flags: u16) {
        let slot = self.tx_avail % self.tx_size;
        TX_RINGS.write_desc(slot, addr, len as u32, flags, 0);
        TX_RINGS.offer(slot, slot);
        self.tx_avail = self.tx_avail.wrapping_add(1);
    }

    fn publish_tx(&mut self) {
        fence(Ordering::SeqCst);
        wr16(TX_AVAIL + 2, self.tx_avail);
        self.notify(TX);
    }
}

/// Reads the device status (for `NEEDS_RESET`) at most once a millisecond:
/// each read is an exit to the VMM, which would otherwise cost more than the
/// frames being measured while the loops poll.
struct StatusWatch {
    next: u64,
    every: u64,
}

impl StatusWatch {
    fn new(clock: &Clock) -> StatusWatch {
        StatusWatch {
            next: 0,
            every: clock.ticks(1_000_000),
        }
    }

    /// Whether the device needs a reset (checked if a millisecond passed).
    fn needs_reset(&mut self, dev: &Device) -> bool {
        let now = io::rdtsc();
        if now < self.next {
            return false;
        }
        self.next = now + self.every;
        dev.status() & STATUS_NEEDS_RESET != 0
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.mmio.write(reg::STATUS, 0);
    }
}

/// The byte at offset `k` of test frame `seq`.
pub fn test_byte(seq: u32, k: u64) -> u8 {
    (seq as u8).wrapping_mul(31).wrapping_add(k as u8)
}

/// The TCP payload byte at stream offset `o`.
fn stream_byte(o: u64) -> u8 {
    (o % 251) as u8
}

fn fmt_mac(m: [u8; 6]) -> MacText {
    let mut t = MacText([0; 17]);
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in m.iter().enumerate() {
        t.0[i * 3] = HEX[usize::from(b >> 4)];
        t.0[i * 3 + 1] = HEX[usize::from(b & 15)];
        if i < 5 {
            t.0[i * 3 + 2] = b':';
        }
    }
    t
}

struct MacText([u8; 17]);

/// `n` per `ns` nanoseconds, per second.
fn per_second(n: u64, ns: u64) -> u64 {
    (u128::from(n) * 1_000_000_000 / u128::from(ns.max(1))) as u64
}

/// Bytes per second as MiB/s with two decimals.
struct Mibps(u64);

impl core::fmt::Display for Mibps {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let hundredths = (u128::from(self.0) * 100) >> 20;
        write!(f, "{}.{:02}", hundredths / 100, hundredths % 100)
    }
}

impl core::fmt::Display for MacText {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(core::str::from_utf8(&self.0).unwrap_or("?"))
    }
}

impl Net {
    pub fn set(&mut self, opt: NetOpt) {
        match opt {
            NetOpt::Offloads(on) => {
                self.offloads = on;
                // Renegotiated at the next command.
                self.dev = None;
            }
            NetOpt::EventIdx(on) => {
                self.event_idx = on;
                self.dev = None;
            }
            NetOpt::Len(n) => self.len = n,
            NetOpt::Count(n) => self.count = n,
            NetOpt::Bytes(n) => self.bytes = n,
            NetOpt::Secs(n) => self.secs = n,
        }
    }

    pub fn run(&mut self, cmd: NetCmd, clock: &Clock) -> Result<(), &'static str> {
        if self.dev.is_none() {
            self.dev = Some(Device::init(self.offloads, self.event_idx)?);
        }
        let Some(dev) = self.dev.as_mut() else {
            return Err("no device");
        };
        match cmd {
            NetCmd::Info => info(dev),
            NetCmd::Tx => tx(dev, self.len, self.count, self.secs, clock)?,
            NetCmd::Tso(n) => tso(dev, n, self.count, self.secs, clock)?,
            NetCmd::Rx => rx(dev, self.count, self.bytes, self.secs, clock),
            NetCmd::Bad(kind) => {
                bad(dev, kind, clock);
                // The device is broken until reset: the next command starts afresh.
                self.dev = None;
            }
            NetCmd::Watch(secs) => watch(dev, secs, clock),
        }
        Ok(())
    }
}

fn info(dev: &Device) {
    let f = dev.features;
    let on = |bit: u64| u8::from(f & bit != 0);
    println!(
        "net: mac={} status={} mtu={} features={f:#x} csum={} guest_csum={} tso4={} tso6={} guest_tso4={} guest_tso6={} mrg_rxbuf={} event_idx={} dev={:#x}",
        fmt_mac(dev.mac()),
        dev.link_status(),
        dev.mmio.read(reg::CONFIG + 10) & 0xffff,
        on(F_CSUM),
        on(F_GUEST_CSUM),
        on(F_HOST_TSO4),
        on(F_HOST_TSO6),
        on(F_GUEST_TSO4),
        on(F_GUEST_TSO6),
        on(F_MRG_RXBUF),
        on(F_EVENT_IDX),
        dev.mmio.0
    );
}

/// Sends test frames of `len` bytes (Ethernet header included) to the
/// broadcast address: `count` of them, or for `secs` seconds.
fn tx(
    dev: &mut Device,
    len: u64,
    count: u64,
    secs: u64,
    clock: &Clock,
) -> Result<(), &'static str> {
    if !(60..=TX_SLOT - HDR_LEN).contains(&len) {
        return Err("netlen must be 60 to 2036");
    }
    let mac = dev.mac();
    let start = io::rdtsc();
    let deadline = (secs > 0).then(|| start + clock.ticks(secs * 1_000_000_000));
    let mut sent = 0u64;
    let mut sum = 0u64;
    let mut in_flight = dev.reap_tx();
    let mut watch = StatusWatch::new(clock);
    loop {
        let more = match deadline {
            Some(d) => io::rdtsc() < d,
            None => sent < count,
        };
        if !more {
            break;
        }
        let mut queued = 0;
        while in_flight + queued < dev.tx_size && queued < 64 {
            if deadline.is_none() && sent >= count {
                break;
            }
            let slot = TX_SLOTS + u64::from(dev.tx_avail % dev.tx_size) * TX_SLOT;
            for k in 0..HDR_LEN {
                wr8(slot + k, 0);
            }
            let f = slot + HDR_LEN;
            for k in 0..6 {
                wr8(f + k, 0xff);
                wr8(f + 6 + k, mac[k as usize]);
            }
            wr8(f + 12, (ETHERTYPE_TEST >> 8) as u8);
            wr8(f + 13, ETHERTYPE_TEST as u8);
            let seq = sent as u32;
            wr32(f + 14, seq);
            for k in 18..len {
                let b = test_byte(seq, k);
                wr8(f + k, b);
                sum = sum.wrapping_add(u64::from(b));
            }
            dev.queue_tx(slot, HDR_LEN + len, 0);
            sent += 1;
            queued += 1;
        }
        if queued > 0 {
            dev.publish_tx();
        }
        in_flight = dev.reap_tx();
        if queued == 0 && watch.needs_reset(dev) {
            return Err("the device needs a reset");
        }
    }
    while dev.reap_tx() != 0 {
        core::hint::spin_loop();
    }
    let ns = clock.ns(io::rdtsc() - start).max(1);
    let bytes = sent * len;
    println!(
        "nettx: frames={sent} bytes={bytes} len={len} ns={ns} fps={} mibps={} sum={sum}",
        per_second(sent, ns),
        Mibps(per_second(bytes, ns))
    );
    Ok(())
}

fn ip_checksum(addr: u64, len: u64) -> u16 {
    let mut s = 0u32;
    for i in (0..len).step_by(2) {
        s += u32::from(rd8(addr + i)) << 8 | u32::from(rd8(addr + i + 1));
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// A TCP/IPv4 segment of `n` payload bytes (10.0.0.2:1000 → 10.0.0.1:5001),
/// handed to the device whole, for it to segment (`VIRTIO_NET_F_HOST_TSO4`):
/// `count` times, or for `secs` seconds (the same segment again and again).
fn tso(dev: &mut Device, n: u64, count: u64, secs: u64, clock: &Clock) -> Result<(), &'static str> {
    if dev.features & F_HOST_TSO4 == 0 {
        return Err("TSO was not negotiated");
    }
    if n == 0 || n > 65_495 {
        return Err("nettso takes 1 to 65495 bytes");
    }
    let b = TX_BIG;
    // virtio_net_hdr_v1: NEEDS_CSUM, GSO TCPv4, hdr_len 54, gso_size 1448,
    // csum_start 34, csum_offset 16.
    wr8(b, HDR_F_NEEDS_CSUM);
    wr8(b + 1, GSO_TCPV4);
    wr16(b + 2, 54);
    wr16(b + 4, 1448);
    wr16(b + 6, 34);
    wr16(b + 8, 16);
    wr16(b + 10, 0);
    let f = b + HDR_LEN;
    let mac = dev.mac();
    for k in 0..6 {
        wr8(f + k, 0xff);
        wr8(f + 6 + k, mac[k as usize]);
    }
    wr8(f + 12, 0x08);
    wr8(f + 13, 0x00);
    let ip = f + 14;
    let total = 40 + n;
    let be16 = |a: u64, v: u16| {
        wr8(a, (v >> 8) as u8);
        wr8(a + 1, v as u8);
    };
    wr8(ip, 0x45);
    wr8(ip + 1, 0);
    be16(ip + 2, total as u16);
    be16(ip + 4, 1);
    be16(ip + 6, 0x4000);
    wr8(ip + 8, 64);
    wr8(ip + 9, 6);
    be16(ip + 10, 0);
    for (k, v) in [10u8, 0, 0, 2, 10, 0, 0, 1].iter().enumerate() {
        wr8(ip + 12 + k as u64, *v);
    }
    let c = ip_checksum(ip, 20);
    be16(ip + 10, c);
    let tcp = ip + 20;
    be16(tcp, 1000);
    be16(tcp + 2, 5001);
    be16(tcp + 4, (TCP_ISN >> 16) as u16);
    be16(tcp + 6, TCP_ISN as u16);
    be16(tcp + 8, 0);
    be16(tcp + 10, 0);
    wr8(tcp + 12, 5 << 4);
    wr8(tcp + 13, 0x18); // PSH, ACK
    be16(tcp + 14, 0xffff);
    // With NEEDS_CSUM the checksum field holds the pseudo-header sum (not inverted).
    let pseudo = 0x0a00 + 0x0002 + 0x0a00 + 0x0001 + 6 + (20 + n) as u32;
    let folded = (pseudo & 0xffff) + (pseudo >> 16);
    be16(tcp + 16, folded as u16);
    be16(tcp + 18, 0);
    let mut sum = 0u64;
    for o in 0..n {
        let v = stream_byte(o);
        wr8(tcp + 20 + o, v);
        sum = sum.wrapping_add(u64::from(v));
    }
    let len = HDR_LEN + 54 + n;
    let start = io::rdtsc();
    let deadline = (secs > 0).then(|| start + clock.ticks(secs * 1_000_000_000));
    let mut sent = 0u64;
    let mut watch = StatusWatch::new(clock);
    loop {
        let more = match deadline {
            Some(d) => io::rdtsc() < d,
            None => sent < count,
        };
        if !more {
            break;
        }
        // The device only reads the buffer: one copy serves every frame in flight.
        let mut queued = 0;
        while dev.reap_tx() + queued < dev.tx_size
            && queued < 64
            && (deadline.is_some() || sent < count)
        {
            dev.queue_tx(b, len, 0);
            sent += 1;
            queued += 1;
        }
        if queued > 0 {
            dev.publish_tx();
        }
        if queued == 0 && watch.needs_reset(dev) {
            return Err("the device needs a reset");
        }
    }
    while dev.reap_tx() != 0 {
        if watch.needs_reset(dev) {
            return Err("the device needs a reset");
        }
        core::hint::spin_loop();
    }
    let ns = clock.ns(io::rdtsc() - start).max(1);
    println!(
        "nettso: frames={sent} bytes={n} frame={} ns={ns} mibps={} sum={sum}",
        54 + n,
        Mibps(per_second(sent * (54 + n), ns))
    );
    Ok(())
}

/// What `rx` counts.
#[derive(Default)]
struct RxStats {
    frames: u64,
    bytes: u64,
    payload: u64,
    gso: u64,
    max: u64,
    other: u64,
    bad: u64,
    sum: u64,
}

/// Checks one received frame (gathered at SCRATCH, `len` bytes after the header).
fn check_frame(len: u64, s: &mut RxStats) {
    let f = SCRATCH + HDR_LEN;
    if rd8(SCRATCH + 1) != 0 {
        s.gso += 1;
    }
    if len < 14 {
        s.bad += 1;
        return;
    }
    let ethertype = u16::from(rd8(f + 12)) << 8 | u16::from(rd8(f + 13));
    if ethertype == ETHERTYPE_TEST && len >= 18 {
        let seq = rd32(f + 14);
        for k in 18..len {
            let b = rd8(f + k);
            if b != test_byte(seq, k) {
                s.bad += 1;
                return;
            }
            s.sum = s.sum.wrapping_add(u64::from(b));
        }
        s.payload += len - 18;
    } else if ethertype == 0x0800 && len >= 54 && rd8(f + 23) == 6 {
        let ip = f + 14;
        let ihl = u64::from(rd8(ip) & 15) * 4;
        let tcp = ip + ihl;
        let doff = u64::from(rd8(tcp + 12) >> 4) * 4;
        let seq = u32::from_be(rd32(tcp + 4));
        let data = tcp + doff;
        let ip_total = u64::from(rd8(ip + 2)) << 8 | u64::from(rd8(ip + 3));
        // A GSO frame's IP length may be that of the whole; the frame's own
        // length is what counts.
        let end = (ip + ip_total).min(f + len).max(data);
        let o0 = u64::from(seq.wrapping_sub(TCP_ISN));
        for (i, a) in (data..end).enumerate() {
            let b = rd8(a);
            if b != stream_byte(o0 + i as u64) {
                s.bad += 1;
                return;
            }
            s.sum = s.sum.wrapping_add(u64::from(b));
        }
        s.payload += end - data;
    } else {
        s.other += 1;
        return;
    }
    s.frames += 1;
    s.bytes += len;
    s.max = s.max.max(len);
}

/// Receives until `count` test frames (or TCP segments) came, or `bytes` of
/// payload, or `secs` seconds (10 when neither is given) passed.
fn rx(dev: &mut Device, count: u64, bytes: u64, secs: u64, clock: &Clock) {
    let mut s = RxStats::default();
    let start = io::rdtsc();
    let limit = if secs > 0 { secs } else { 10 };
    let deadline = start + clock.ticks(limit * 1_000_000_000);
    let mut first = None;
    let mut last = start;
    let mut reposted = 0u16;
    let mut gathered = 0u64;
    let mut left = 0u16;
    let mut watch = StatusWatch::new(clock);
    loop {
        let done = if secs > 0 {
            false
        } else if bytes > 0 {
            s.payload >= bytes
        } else {
            s.frames >= count
        };
        if done || io::rdtsc() >= deadline {
            break;
        }
        fence(Ordering::SeqCst);
        let used_idx = rd16(RX_USED + 2);
        if used_idx == dev.rx_used {
            if reposted > 0 {
                fence(Ordering::SeqCst);
                wr16(RX_AVAIL + 2, dev.rx_avail);
                dev.notify(RX);
                reposted = 0;
            }
            if watch.needs_reset(dev) {
                s.bad += 1;
                break;
            }
            core::hint::spin_loop();
            continue;
        }
        while dev.rx_used != used_idx {
            let e = RX_USED + 4 + 8 * u64::from(dev.rx_used % dev.rx_size);
            let id = rd32(e) as u16;
            let len = u64::from(rd32(e + 4));
            dev.rx_used = dev.rx_used.wrapping_add(1);
            let buf = RX_BUFS + u64::from(id) * RX_BUF;
            if left == 0 {
                gathered = 0;
                left = rd16(buf + 10).max(1);
            }
            if gathered + len <= SCRATCH_LEN {
                // SAFETY: both ranges are ours, inside the driver area.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        buf as *const u8,
                        (SCRATCH + gathered) as *mut u8,
                        len as usize,
                    )
                };
            }
            gathered += len;
            left -= 1;
            // Repost the buffer.
            wr16(RX_AVAIL + 4 + 2 * u64::from(dev.rx_avail % dev.rx_size), id);
            dev.rx_avail = dev.rx_avail.wrapping_add(1);
            reposted += 1;
            if left == 0 {
                let now = io::rdtsc();
                first.get_or_insert(now);
                last = now;
                if !(HDR_LEN..=SCRATCH_LEN).contains(&gathered) {
                    s.bad += 1;
                } else {
                    check_frame(gathered - HDR_LEN, &mut s);
                }
            }
            if reposted >= 32 {
                fence(Ordering::SeqCst);
                wr16(RX_AVAIL + 2, dev.rx_avail);
                dev.notify(RX);
                reposted = 0;
            }
        }
    }
    if reposted > 0 {
        fence(Ordering::SeqCst);
        wr16(RX_AVAIL + 2, dev.rx_avail);
        dev.notify(RX);
    }
    // The rate counts from the first frame to the last.
    let ns = clock.ns(last - first.unwrap_or(last)).max(1);
    println!(
        "netrx: frames={} bytes={} payload={} gso={} max={} other={} bad={} ns={ns} fps={} mibps={} sum={}",
        s.frames,
        s.bytes,
        s.payload,
        s.gso,
        s.max,
        s.other,
        s.bad,
        per_second(s.frames, ns),
        Mibps(per_second(s.bytes, ns)),
        s.sum
    );
}

/// Offers one malformed transmit chain and waits (up to 2 s) for the device to
/// say it needs a reset.
fn bad(dev: &mut Device, kind: BadKind, clock: &Clock) {
    let (name, addr, len, flags) = match kind {
        BadKind::OutOfMemory => ("oob", 1u64 << 40, 100u64, 0u16),
        BadKind::Writable => ("write", TX_SLOTS, 100, DESC_F_WRITE),
        BadKind::TooLong => ("long", TX_BIG, 70_000, 0),
    };
    dev.reap_tx();
    dev.queue_tx(addr, len, flags);
    dev.publish_tx();
    let deadline = io::rdtsc() + clock.ticks(2_000_000_000);
    while dev.status() & STATUS_NEEDS_RESET == 0 && io::rdtsc() < deadline {
        core::hint::spin_loop();
    }
    let status = dev.status();
    println!(
        "netbad: kind={name} needs_reset={} status={status:#x}",
        u8::from(status & STATUS_NEEDS_RESET != 0)
    );
}

/// Watches the link for `secs` seconds, printing each change of status or
/// MAC; returns early once the link came back up after going down.
fn watch(dev: &mut Device, secs: u64, clock: &Clock) {
    let deadline = io::rdtsc() + clock.ticks(secs * 1_000_000_000);
    let mut status = dev.link_status();
    let mut mac = dev.mac();
    let mut config_irqs = 0u32;
    let mut went_down = false;
    println!("netlink: status={status} mac={} (watching)", fmt_mac(mac));
    while io::rdtsc() < deadline {
        let pending = dev.mmio.read(reg::INTERRUPT_STATUS);
        if pending & INT_CONFIG != 0 {
            dev.mmio.write(reg::INTERRUPT_ACK, INT_CONFIG);
            config_irqs += 1;
        }
        let (g0, s, m, g1) = (
            dev.mmio.read(reg::CONFIG_GENERATION),
            dev.link_status(),
            dev.mac(),
            dev.mmio.read(reg::CONFIG_GENERATION),
        );
        if g0 != g1 {
            continue;
        }
        if s != status || m != mac {
            println!(
                "netlink: status={s} mac={} config_irqs={config_irqs}",
                fmt_mac(m)
            );
            went_down |= s & 1 == 0;
            status = s;
            mac = m;
            if went_down && s & 1 != 0 {
                return;
            }
        }
        // A millisecond between looks: each look is a few exits.
        let until = io::rdtsc() + clock.ticks(1_000_000);
        while io::rdtsc() < until {
            core::hint::spin_loop();
        }
    }
    println!("netlink: no change within {secs} s config_irqs={config_irqs}");
}
