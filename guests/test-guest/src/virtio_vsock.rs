//! A polling virtio-mmio vsock driver (one stream connection at a time) and
//! the `vsock=` scenarios the host tests drive through it.
//!
//! Three split virtqueues of 32 entries at fixed guest-physical addresses
//! (2-3.25 MiB): rx (32 buffers of 16 KiB, each one descriptor, reposted as soon
//! as its packet is handled), tx (32 slots of 16 KiB, header and payload in
//! one descriptor) and event (4 buffers). No interrupts: we poll the used
//! rings. The driver keeps the protocol's credit both ways and checks the
//! device keeps it too: more data than our advertised buffer is an error.
//!
//! Data is checked byte for byte: what the guest sends is `pattern(seed, i)`,
//! and what it expects from the host is the same function with the host's
//! seed (`vsockseed=`), so the host test can check and produce the same bytes.

use crate::io::{self, Clock};
use crate::println;
use crate::virtio::{
    DESC_F_WRITE, Mmio, Rings, STATUS_NEEDS_RESET, fence, rd8, rd16, rd32, rd64, reg, wr8, wr16,
    wr32, wr64,
};

/// One option token.
pub enum VsockOpt {
    /// `vsockport=P`: the guest port to serve, or the host port to connect to.
    Port(u32),
    /// `vsockbytes=N`: how much the guest sends (`connect`).
    Bytes(u64),
    /// `vsockbuf=N`: the receive buffer the guest advertises (credit).
    Buf(u32),
    /// `vsockslow=US`: spin this long before taking each received packet.
    SlowUs(u64),
    /// `vsocksecs=N`: give up after N seconds of no progress.
    Secs(u64),
}

/// The scenarios.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Wait for the host's connection on `port`, read until the host's end of
    /// file, send it all back, close.
    Serve,
    /// Connect to host `port`, send `bytes` of pattern, half-close, read and
    /// check the host's pattern until its end of file, close.
    Connect,
    /// Send a packet whose header lies about its length: the device must
    /// report an error (DEVICE_NEEDS_RESET), and nothing else happens.
    Malformed,
    /// Connect to host `port`, then wait for a TRANSPORT_RESET event (a
    /// restore) and report the connection gone.
    WaitReset,
}

/// Settings for the next `vsock=` run.
pub struct Options {
    port: u32,
    bytes: u64,
    buf_alloc: u32,
    slow_us: u64,
    secs: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            port: 1234,
            bytes: 1 << 20,
            buf_alloc: 64 * 1024,
            slow_us: 0,
            secs: 30,
        }
    }
}

impl Options {
    pub fn set(&mut self, o: VsockOpt) {
        match o {
            VsockOpt::Port(p) => self.port = p,
            VsockOpt::Bytes(n) => self.bytes = n,
            VsockOpt::Buf(n) => self.buf_alloc = n,
            VsockOpt::SlowUs(n) => self.slow_us = n,
            VsockOpt::Secs(n) => self.secs = n,
        }
    }
}

/// The byte at offset `i` of stream `seed` (the host tests compute the same).
pub fn pattern(seed: u32, i: u64) -> u8 {
    let x = i
        .wrapping_mul(0x9e37_79b9)
        .wrapping_add(u64::from(seed) * 7919);
    (x ^ (x >> 13) ^ (i >> 8)) as u8
}

/// The seed of the guest's own bytes; the host's are `HOST_SEED`.
const GUEST_SEED: u32 = 1;
const HOST_SEED: u32 = 2;

const DEVICE_ID_VSOCK: u32 = 19;

const QSIZE: u16 = 32;
const RX: u32 = 0;
const TX: u32 = 1;
const EV: u32 = 2;
/// Queue `q`'s rings: descriptors, then avail (+4 KiB), then used (+8 KiB).
/// All of this driver's memory is in 2-3.25 MiB: above our image, below the
/// virtio-net driver's 4-8 MiB and virtio-blk's 8-16 MiB.
const RINGS: u64 = 0x20_0000;
const RING_STRIDE: u64 = 0x4000;
const EV_BUFS: u64 = 0x23_0000;
const RX_BUFS: u64 = 0x24_0000;
const TX_BUFS: u64 = 0x2c_0000;
const BUF_SIZE: u64 = 0x4000;
/// Where `serve` keeps what it received (up to 64 MiB).
const STORE: u64 = 0x200_0000;
const STORE_MAX: u64 = 64 << 20;

const HDR_LEN: u64 = 44;
const HOST_CID: u64 = 2;
const TYPE_STREAM: u16 = 1;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const SHUTDOWN_RCV: u32 = 1;
const SHUTDOWN_SEND: u32 = 2;
/// The guest's own port for connections it opens.
const GUEST_PORT: u32 = 40000;

fn desc(q: u32) -> u64 {
    RINGS + u64::from(q) * RING_STRIDE
}
fn avail(q: u32) -> u64 {
    desc(q) + 0x1000
}
fn used(q: u32) -> u64 {
    desc(q) + 0x2000
}

/// A packet header.
#[derive(Clone, Copy, Default)]
struct Hdr {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    kind: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

impl Hdr {
    fn read(a: u64) -> Hdr {
        Hdr {
            src_cid: rd64(a),
            dst_cid: rd64(a + 8),
            src_port: rd32(a + 16),
            dst_port: rd32(a + 20),
            len: rd32(a + 24),
            kind: rd16(a + 28),
            op: rd16(a + 30),
            flags: rd32(a + 32),
            buf_alloc: rd32(a + 36),
            fwd_cnt: rd32(a + 40),
        }
    }
    fn write(&self, a: u64) {
        wr64(a, self.src_cid);
        wr64(a + 8, self.dst_cid);
        wr32(a + 16, self.src_port);
        wr32(a + 20, self.dst_port);
        wr32(a + 24, self.len);
        wr16(a + 28, self.kind);
        wr16(a + 30, self.op);
        wr32(a + 32, self.flags);
        wr32(a + 36, self.buf_alloc);
        wr32(a + 40, self.fwd_cnt);
    }
}

/// Where received data goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// Stored at STORE (serve).
    Store,
    /// Checked against the host's pattern (connect).
    Verify,
}

struct Driver<'c> {
    mmio: Mmio,
    cid: u64,
    clock: &'c Clock,
    opts: &'c Options,
    rx_used: u16,
    tx_avail: u16,
    tx_used: u16,
    ev_used: u16,
    // The connection.
    local: u32,
    peer: u32,
    established: bool,
    reset: bool,
    transport_reset: bool,
    peer_shut: u32,
    rx_cnt: u32,
    fwd_cnt: u32,
    told_fwd: u32,
    tx_cnt: u32,
    peer_buf: u32,
    peer_fwd: u32,
    credit_waits: u64,
    received: u64,
    sink: Sink,
    bad_byte: Option<u64>,
    deadline: u64,
}

impl<'c> Driver<'c> {
    fn init(opts: &'c Options, clock: &'c Clock) -> Result<Self, &'static str> {
        let mmio = Mmio::find(DEVICE_ID_VSOCK).ok_or("no virtio-vsock device")?;
        mmio.negotiate(0)?;
        for q in [RX, TX, EV] {
            mmio.setup_queue(q, Rings { desc: desc(q) }, QSIZE, QSIZE)?;
        }
        // Every rx and event buffer offered up front; tx descriptors fixed to their slots.
        for i in 0..QSIZE {
            let d = desc(RX) + 16 * u64::from(i);
            wr64(d, RX_BUFS + u64::from(i) * BUF_SIZE);
            wr32(d + 8, BUF_SIZE as u32);
            wr16(d + 12, DESC_F_WRITE);
            wr16(avail(RX) + 4 + 2 * u64::from(i), i);
            let t = desc(TX) + 16 * u64::from(i);
            wr64(t, TX_BUFS + u64::from(i) * BUF_SIZE);
        }
        for i in 0..4u16 {
            let d = desc(EV) + 16 * u64::from(i);
            wr64(d, EV_BUFS + u64::from(i) * 16);
            wr32(d + 8, 8);
            wr16(d + 12, DESC_F_WRITE);
            wr16(avail(EV) + 4 + 2 * u64::from(i), i);
        }
        fence();
        wr16(avail(RX) + 2, QSIZE);
        wr16(avail(EV) + 2, 4);
        let cid = u64::from(mmio.read(reg::CONFIG)) | u64::from(mmio.read(reg::CONFIG + 4)) << 32;
        mmio.driver_ok();
        mmio.write(reg::QUEUE_NOTIFY, RX);
        mmio.write(reg::QUEUE_NOTIFY, EV);
        let mut d = Driver {
            mmio,
            cid,
            clock,
            opts,
            rx_used: 0,
            tx_avail: 0,
            tx_used: 0,
            ev_used: 0,
            local: GUEST_PORT,
            peer: 0,
            established: false,
            reset: false,
            transport_reset: false,
            peer_shut: 0,
            rx_cnt: 0,
            fwd_cnt: 0,
            told_fwd: 0,
            tx_cnt: 0,
            peer_buf: 0,
            peer_fwd: 0,
            credit_waits: 0,
            received: 0,
            sink: Sink::Verify,
            bad_byte: None,
            deadline: 0,
        };
        d.progress();
        Ok(d)
    }

    /// Pushes the no-progress deadline out.
    fn progress(&mut self) {
        let secs = self.opts.secs.saturating_mul(1_000_000_000);
        self.deadline = io::rdtsc().saturating_add(self.clock.ticks(secs));
    }

    fn timed_out(&self) -> bool {
        io::rdtsc() > self.deadline
    }

    fn needs_reset(&self) -> bool {
        self.mmio.read(reg::STATUS) & STATUS_NEEDS_RESET != 0
    }

    /// Sends a packet (`data` at most one slot's worth), waiting for a free slot.
    fn send(&mut self, op: u16, flags: u32, data: &[u8]) -> Result<(), &'static str> {
        while self.tx_avail.wrapping_sub(self.tx_used) >= QSIZE {
            self.reclaim_tx();
            if self.timed_out() {
                return Err("no transmit slot came back");
            }
            if self.needs_reset() {
                return Err("the device reported an error");
            }
        }
        let slot = self.tx_avail % QSIZE;
        let buf = TX_BUFS + u64::from(slot) * BUF_SIZE;
        let h = Hdr {
            src_cid: self.cid,
            dst_cid: HOST_CID,
            src_port: self.local,
            dst_port: self.peer,
            len: data.len() as u32,
            kind: TYPE_STREAM,
            op,
            flags,
            buf_alloc: self.opts.buf_alloc,
            fwd_cnt: self.fwd_cnt,
        };
        h.write(buf);
        for (i, &b) in data.iter().enumerate() {
            wr8(buf + HDR_LEN + i as u64, b);
        }
        self.told_fwd = self.fwd_cnt;
        self.post_tx(slot, HDR_LEN as u32 + data.len() as u32);
        Ok(())
    }

    fn post_tx(&mut self, slot: u16, len: u32) {
        let d = desc(TX) + 16 * u64::from(slot);
        wr32(d + 8, len);
        wr16(d + 12, 0);
        wr16(avail(TX) + 4 + 2 * u64::from(self.tx_avail % QSIZE), slot);
        fence();
        self.tx_avail = self.tx_avail.wrapping_add(1);
        wr16(avail(TX) + 2, self.tx_avail);
        fence();
        self.mmio.write(reg::QUEUE_NOTIFY, TX);
    }

    fn reclaim_tx(&mut self) {
        fence();
        self.tx_used = rd16(used(TX) + 2);
    }

    /// Handles every received packet there is; returns whether there was one.
    fn poll(&mut self) -> Result<bool, &'static str> {
        fence();
        let mut any = false;
        if rd16(used(EV) + 2) != self.ev_used {
            let id = rd32(used(EV) + 4 + 8 * u64::from(self.ev_used % 4));
            if rd32(EV_BUFS + u64::from(id) * 16) == 0 {
                self.transport_reset = true;
            }
            self.ev_used = self.ev_used.wrapping_add(1);
            any = true;
        }
        while rd16(used(RX) + 2) != self.rx_used {
            let at = used(RX) + 4 + 8 * u64::from(self.rx_used % QSIZE);
            let id = rd32(at) as u16;
            let buf = RX_BUFS + u64::from(id) * BUF_SIZE;
            self.handle(buf)?;
            // The buffer goes straight back.
            self.rx_used = self.rx_used.wrapping_add(1);
            let next = self.rx_used.wrapping_add(QSIZE - 1);
            wr16(avail(RX) + 4 + 2 * u64::from(next % QSIZE), id);
            fence();
            wr16(avail(RX) + 2, self.rx_used.wrapping_add(QSIZE));
            fence();
            self.mmio.write(reg::QUEUE_NOTIFY, RX);
            any = true;
        }
        if any {
            self.progress();
        }
        Ok(any)
    }

    fn handle(&mut self, buf: u64) -> Result<(), &'static str> {
        let h = Hdr::read(buf);
        if h.kind != TYPE_STREAM || h.src_cid != HOST_CID || h.dst_cid != self.cid {
            return Err("a received packet has a bad header");
        }
        // A host connection on the port we serve.
        if h.op == OP_REQUEST && !self.established && h.dst_port == self.opts.port {
            self.local = h.dst_port;
            self.peer = h.src_port;
            self.peer_buf = h.buf_alloc;
            self.peer_fwd = h.fwd_cnt;
            self.established = true;
            return self.send(OP_RESPONSE, 0, &[]);
        }
        if h.dst_port != self.local || h.src_port != self.peer {
            println!(
                "vsock: stray packet op={} {}->{}",
                h.op, h.src_port, h.dst_port
            );
            return Ok(());
        }
        self.peer_buf = h.buf_alloc;
        self.peer_fwd = h.fwd_cnt;
        match h.op {
            OP_RESPONSE => self.established = true,
            OP_RST => self.reset = true,
            OP_SHUTDOWN => self.peer_shut |= h.flags,
            OP_CREDIT_REQUEST => self.send(OP_CREDIT_UPDATE, 0, &[])?,
            OP_CREDIT_UPDATE => {}
            OP_RW => {
                let len = h.len;
                if u64::from(len) > BUF_SIZE - HDR_LEN {
                    return Err("a data packet longer than its buffer");
                }
                self.rx_cnt = self.rx_cnt.wrapping_add(len);
                if self.rx_cnt.wrapping_sub(self.told_fwd) > self.opts.buf_alloc {
                    return Err("the device sent past our credit");
                }
                if self.opts.slow_us > 0 {
                    let until = io::rdtsc() + self.clock.ticks(self.opts.slow_us * 1000);
                    while io::rdtsc() < until {
                        core::hint::spin_loop();
                    }
                }
                for i in 0..u64::from(len) {
                    let b = rd8(buf + HDR_LEN + i);
                    let at = self.received + i;
                    match self.sink {
                        Sink::Store if at < STORE_MAX => wr8(STORE + at, b),
                        Sink::Store => return Err("more data than serve can hold"),
                        Sink::Verify => {
                            if self.bad_byte.is_none() && b != pattern(HOST_SEED, at) {
                                self.bad_byte = Some(at);
                            }
                        }
                    }
                }
                self.received += u64::from(len);
                self.fwd_cnt = self.fwd_cnt.wrapping_add(len);
                // Tell the device once half our buffer is free again.
                if self.fwd_cnt.wrapping_sub(self.told_fwd) >= self.opts.buf_alloc / 2 {
                    self.send(OP_CREDIT_UPDATE, 0, &[])?;
                }
            }
            _ => println!("vsock: unexpected op {}", h.op),
        }
        Ok(())
    }

    /// Polls until `done`, failing on a timeout or a device error.
    fn wait(
        &mut self,
        what: &'static str,
        done: impl Fn(&Self) -> bool,
    ) -> Result<(), &'static str> {
        let mut spins = 0u32;
        while !done(self) {
            self.poll()?;
            // A register read is an exit: look only now and then.
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && self.needs_reset() {
                return Err("the device reported an error");
            }
            if self.timed_out() {
                println!("vsock: timed out waiting for {what}");
                return Err("timed out");
            }
        }
        Ok(())
    }

    fn credit(&self) -> u32 {
        self.peer_buf
            .saturating_sub(self.tx_cnt.wrapping_sub(self.peer_fwd))
    }

    /// Sends `n` bytes from `byte(i)` within the host's credit.
    fn send_stream(&mut self, n: u64, byte: impl Fn(u64) -> u8) -> Result<(), &'static str> {
        let mut chunk = [0u8; (BUF_SIZE - HDR_LEN) as usize];
        let mut sent = 0u64;
        while sent < n {
            if self.reset {
                return Err("the connection was reset while sending");
            }
            let credit = self.credit();
            if credit == 0 {
                self.credit_waits += 1;
                self.send(OP_CREDIT_REQUEST, 0, &[])?;
                let before = self.peer_fwd;
                self.wait("credit", |d| {
                    d.peer_fwd != before || d.credit() > 0 || d.reset
                })?;
                continue;
            }
            let take = (n - sent).min(chunk.len() as u64).min(u64::from(credit)) as usize;
            for (i, c) in chunk[..take].iter_mut().enumerate() {
                *c = byte(sent + i as u64);
            }
            self.send(OP_RW, 0, &chunk[..take])?;
            self.tx_cnt = self.tx_cnt.wrapping_add(take as u32);
            sent += take as u64;
            self.poll()?;
        }
        Ok(())
    }

    /// Closes both ways and waits for the device's RST.
    fn close(&mut self) -> Result<(), &'static str> {
        self.send(OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND, &[])?;
        self.wait("the RST closing the connection", |d| d.reset)
    }

    fn connect(&mut self) -> Result<bool, &'static str> {
        self.local = GUEST_PORT;
        self.peer = self.opts.port;
        self.send(OP_REQUEST, 0, &[])?;
        self.wait("the connection", |d| d.established || d.reset)?;
        Ok(self.established)
    }
}

impl Drop for Driver<'_> {
    fn drop(&mut self) {
        self.mmio.write(reg::STATUS, 0);
    }
}

/// Runs one scenario.
pub fn run(opts: &Options, mode: Mode, clock: &Clock) -> Result<(), &'static str> {
    let mut d = Driver::init(opts, clock)?;
    println!("vsock: cid={}", d.cid);
    match mode {
        Mode::Serve => {
            d.sink = Sink::Store;
            println!("vsock: listening on port {}", opts.port);
            d.wait("a host connection", |d| d.established)?;
            println!("vsock: accepted from host port {}", d.peer);
            d.wait("the host's end of file", |d| {
                d.peer_shut & SHUTDOWN_SEND != 0 || d.reset
            })?;
            let n = d.received;
            d.send_stream(n, |i| rd8(STORE + i))?;
            d.close()?;
            println!(
                "vsock: served received={n} echoed={n} credit_waits={}",
                d.credit_waits
            );
        }
        Mode::Connect => {
            if !d.connect()? {
                println!("vsock: connection refused (rst)");
                return Ok(());
            }
            println!("vsock: connected to host port {}", opts.port);
            d.send_stream(opts.bytes, |i| pattern(GUEST_SEED, i))?;
            d.send(OP_SHUTDOWN, SHUTDOWN_SEND, &[])?;
            d.wait("the host's end of file", |d| {
                d.peer_shut & SHUTDOWN_SEND != 0 || d.reset
            })?;
            if let Some(at) = d.bad_byte {
                println!("vsock: host data differs at byte {at}");
                return Err("the host's data differs");
            }
            let received = d.received;
            d.close()?;
            println!(
                "vsock: sent={} received={received} ok credit_waits={} rst",
                opts.bytes, d.credit_waits
            );
        }
        Mode::Malformed => {
            // A header claiming 4000 bytes in a 54-byte descriptor.
            d.peer = opts.port;
            let buf = TX_BUFS;
            Hdr {
                src_cid: d.cid,
                dst_cid: HOST_CID,
                src_port: GUEST_PORT,
                dst_port: opts.port,
                len: 4000,
                kind: TYPE_STREAM,
                op: OP_RW,
                ..Hdr::default()
            }
            .write(buf);
            d.post_tx(0, HDR_LEN as u32 + 10);
            let until = io::rdtsc() + clock.ticks(5_000_000_000);
            while !d.needs_reset() && io::rdtsc() < until {
                core::hint::spin_loop();
            }
            if !d.needs_reset() {
                return Err("the device took a malformed packet");
            }
            println!("vsock: malformed packet refused (device needs reset)");
        }
        Mode::WaitReset => {
            if !d.connect()? {
                return Err("the host refused the connection");
            }
            d.send_stream(opts.bytes, |i| pattern(GUEST_SEED, i))?;
            println!("vsock: connected, sent={}", opts.bytes);
            d.wait("a transport reset", |d| d.transport_reset)?;
            println!("vsock: transport reset (connections dropped)");
        }
    }
    Ok(())
}
