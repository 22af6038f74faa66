//! One stream connection between a guest port and a host Unix socket: the
//! virtio-vsock state machine (handshake, credit, shutdown, reset) over a
//! non-blocking [`UnixStream`].
//!
//! Memory stays bounded whatever either side does. Guest to host, the guest may
//! send only what we advertised (`BUF_ALLOC` less what is still in our buffer);
//! what the host socket does not take at once waits in a buffer of at most
//! `BUF_ALLOC` bytes, and a guest that sends more is reset. Host to guest, we
//! read the socket only when the guest has credit and a buffer for it, so a
//! slow guest leaves the data in the host's socket, not in ember.

use std::io;
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::EventSet;

use super::Region;
use super::packet::{Header, SHUTDOWN_RCV, SHUTDOWN_SEND, op};

/// The receive buffer we advertise to the guest, and the most guest data we
/// hold for one connection.
pub(crate) const BUF_ALLOC: u32 = 256 * 1024;
/// Below this much free space (as the guest believes it), we tell the guest
/// what we forwarded so it can go on sending.
const CREDIT_UPDATE_THRESHOLD: u32 = BUF_ALLOC / 4;
/// How long the guest has to answer a host-initiated REQUEST, and to let us
/// drain a connection it shut down both ways.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(2);

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// The host connected (`CONNECT <port>`); the guest has not answered.
    LocalInit,
    /// The guest asked (REQUEST); our RESPONSE is not sent yet.
    PeerInit,
    /// Data flows.
    Established,
    /// Being torn down: only an RST is left to send.
    Killed,
}

/// Packets a connection owes the guest, besides data.
mod pending {
    pub(super) const REQUEST: u8 = 1;
    pub(super) const RESPONSE: u8 = 2;
    pub(super) const RST: u8 = 4;
    pub(super) const CREDIT_UPDATE: u8 = 8;
    pub(super) const SHUTDOWN: u8 = 16;
}

/// What the muxer does with a connection after a guest packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// It lives on.
    Keep,
    /// Forget it now (the guest reset it).
    Remove,
}

/// Guest data the host socket has not taken yet, in a mapping of its own
/// made on first use: the device thread's filter cannot let glibc read
/// `/proc/sys/vm/overcommit_memory`, which it does the first time freeing a
/// large block shrinks a thread's heap.
#[derive(Debug, Default)]
struct TxBuf {
    mem: Option<Region>,
    start: usize,
    end: usize,
}

impl TxBuf {
    fn len(&self) -> usize {
        self.end - self.start
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `bytes`; the caller keeps the total within `BUF_ALLOC`.
    fn push(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mem = match &mut self.mem {
            Some(m) => m,
            None => self.mem.insert(Region::new(BUF_ALLOC as usize)?),
        };
        if self.end + bytes.len() > mem.len() {
            mem.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let Some(dst) = mem.get_mut(self.end..self.end + bytes.len()) else {
            return Err(io::Error::other("vsock transmit buffer overflow"));
        };
        dst.copy_from_slice(bytes);
        self.end += bytes.len();
        Ok(())
    }

    /// Writes what it can; returns how much went.
    fn flush(&mut self, stream: &UnixStream) -> io::Result<usize> {
        let Some(mem) = &self.mem else {
            return Ok(0);
        };
        let mut done = 0;
        while self.start < self.end {
            match send(stream, &mem[self.start..self.end]) {
                Ok(n) => {
                    self.start += n;
                    done += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        Ok(done)
    }
}

/// `send(2)` without SIGPIPE: a host peer that went away is an error, not a signal.
pub(crate) fn send(stream: &UnixStream, buf: &[u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes; the fd is the stream's, open.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recv(2)`, non-blocking (`flags` may add `MSG_PEEK`).
pub(crate) fn recv(stream: &UnixStream, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid and writable for `buf.len()` bytes; the fd is open.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                flags | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One connection.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) stream: UnixStream,
    state: State,
    /// Our (host-side) port.
    pub(crate) local_port: u32,
    /// The guest's port.
    pub(crate) peer_port: u32,
    pending: u8,
    /// The guest will receive no more (its SHUTDOWN_RCV).
    peer_no_recv: bool,
    /// The guest will send no more (its SHUTDOWN_SEND).
    peer_no_send: bool,
    /// The host socket reached end of file.
    local_eof: bool,
    /// We shut the host socket's writing side.
    local_write_shut: bool,
    tx: TxBuf,
    /// Guest bytes written to the host socket.
    fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as the guest last heard it.
    fwd_cnt_told: Wrapping<u32>,
    /// Bytes sent to the guest.
    rx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// The host socket may have data (or its end) to read.
    pub(crate) readable: bool,
    /// We asked the guest for credit and it has not given any since.
    credit_requested: bool,
    /// The host socket hung up: no more events will come from it.
    pub(crate) hup: bool,
    /// When the connection is given up if nothing happens.
    pub(crate) expiry: Option<Instant>,
    /// The events the muxer's epoll watches on the stream (none: not registered).
    pub(crate) watching: EventSet,
    /// Whether it is in the muxer's ready queue.
    pub(crate) queued: bool,
}

impl Conn {
    fn new(stream: UnixStream, state: State, local_port: u32, peer_port: u32, pending: u8) -> Self {
        Conn {
            stream,
            state,
            local_port,
            peer_port,
            pending,
            peer_no_recv: false,
            peer_no_send: false,
            local_eof: false,
            local_write_shut: false,
            tx: TxBuf::default(),
            fwd_cnt: Wrapping(0),
            fwd_cnt_told: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            readable: false,
            credit_requested: false,
            hup: false,
            expiry: None,
            watching: EventSet::empty(),
            queued: false,
        }
    }

    /// A host-initiated connection (`CONNECT <port>` read): a REQUEST to send.
    pub(crate) fn local_init(stream: UnixStream, local_port: u32, peer_port: u32) -> Self {
        let mut c = Conn::new(
            stream,
            State::LocalInit,
            local_port,
            peer_port,
            pending::REQUEST,
        );
        c.expiry = Some(Instant::now() + TIMEOUT);
        c
    }

    /// A guest-initiated connection whose host socket is connected: a RESPONSE to send.
    pub(crate) fn peer_init(stream: UnixStream, hdr: &Header) -> Self {
        let mut c = Conn::new(
            stream,
            State::PeerInit,
            hdr.dst_port,
            hdr.src_port,
            pending::RESPONSE,
        );
        c.peer_buf_alloc = hdr.buf_alloc;
        c.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        c
    }

    #[cfg(test)]
    pub(crate) fn state(&self) -> State {
        self.state
    }

    /// How much more the guest can take.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether host data may go to the guest now (credit aside).
    fn may_read(&self) -> bool {
        self.state == State::Established && !self.peer_no_recv && !self.local_eof
    }

    /// Whether it has something for the guest's receive queue.
    pub(crate) fn has_rx(&self) -> bool {
        self.pending != 0
            || (self.readable
                && self.may_read()
                && (self.peer_credit() > 0 || !self.credit_requested))
    }

    /// The events to watch on the host socket.
    pub(crate) fn interest(&self) -> EventSet {
        let mut e = EventSet::empty();
        if self.may_read() && !self.readable && self.peer_credit() > 0 {
            e |= EventSet::IN;
        }
        if !self.tx.is_empty() {
            e |= EventSet::OUT;
        }
        e
    }

    /// Gives up: only an RST is left to send.
    pub(crate) fn kill(&mut self) {
        self.state = State::Killed;
        self.pending = pending::RST;
        self.tx = TxBuf::default();
        self.readable = false;
        self.expiry = None;
    }

    /// The guest's packet for this connection (`data` its payload).
    pub(crate) fn guest_packet(&mut self, hdr: &Header, data: &[u8]) -> Verdict {
        if self.state == State::Killed {
            return if hdr.op == op::RST {
                Verdict::Remove
            } else {
                Verdict::Keep
            };
        }
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
        match hdr.op {
            op::RST => return Verdict::Remove,
            op::RESPONSE if self.state == State::LocalInit => {
                self.state = State::Established;
                self.expiry = None;
                // The hybrid vsock handshake's answer to `CONNECT <port>`.
                let line = format!("OK {}\n", self.local_port);
                match send(&self.stream, line.as_bytes()) {
                    Ok(n) if n == line.len() => {}
                    Ok(_) | Err(_) => self.kill(),
                }
            }
            op::RW if self.state == State::Established && !self.peer_no_send => {
                self.take_data(data)
            }
            op::SHUTDOWN if self.state == State::Established => {
                self.peer_no_recv |= hdr.flags & SHUTDOWN_RCV != 0;
                self.peer_no_send |= hdr.flags & SHUTDOWN_SEND != 0;
                self.after_tx();
            }
            op::CREDIT_REQUEST => self.pending |= pending::CREDIT_UPDATE,
            op::CREDIT_UPDATE | op::REQUEST | op::RESPONSE | op::RW | op::SHUTDOWN => {}
            _ => {
                crate::guest_warn!("virtio-vsock: unknown op {} resets its connection", hdr.op);
                self.kill();
            }
        }
        Verdict::Keep
    }

    fn take_data(&mut self, data: &[u8]) {
        let mut rest = data;
        if self.tx.is_empty() {
            match send(&self.stream, rest) {
                Ok(n) => {
                    self.fwd_cnt += Wrapping(n as u32);
                    rest = &rest[n..];
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return self.kill(),
            }
        }
        if !rest.is_empty() {
            if self.tx.len() + rest.len() > BUF_ALLOC as usize {
                crate::guest_warn!(
                    "virtio-vsock: the guest sent past its credit on port {}; reset",
                    self.peer_port
                );
                return self.kill();
            }
            if self.tx.push(rest).is_err() {
                return self.kill();
            }
        }
        self.after_tx();
    }

    /// After guest data moved: half-close, close, or tell the guest its credit.
    fn after_tx(&mut self) {
        if !self.tx.is_empty() {
            if self.peer_no_recv && self.peer_no_send && self.expiry.is_none() {
                self.expiry = Some(Instant::now() + TIMEOUT);
            }
            return self.maybe_credit_update();
        }
        if self.peer_no_send && !self.local_write_shut {
            self.local_write_shut = true;
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        if self.peer_no_recv && self.peer_no_send {
            // Both ways closed and all delivered: the guest waits for our RST.
            self.state = State::Killed;
            self.pending = pending::RST;
            self.expiry = None;
            return;
        }
        self.maybe_credit_update();
    }

    fn maybe_credit_update(&mut self) {
        let received = self.fwd_cnt + Wrapping(self.tx.len() as u32);
        let free_as_guest_sees = BUF_ALLOC.saturating_sub((received - self.fwd_cnt_told).0);
        if free_as_guest_sees < CREDIT_UPDATE_THRESHOLD && self.fwd_cnt != self.fwd_cnt_told {
            self.pending |= pending::CREDIT_UPDATE;
        }
    }

    /// The host socket can take more.
    pub(crate) fn on_writable(&mut self) {
        if self.state == State::Killed {
            return;
        }
        match self.tx.flush(&self.stream) {
            Ok(n) => {
                self.fwd_cnt += Wrapping(n as u32);
                self.after_tx();
            }
            Err(_) => self.kill(),
        }
    }

    /// The host socket hung up (both ways): read what is left, then its end.
    pub(crate) fn on_hangup(&mut self) {
        self.hup = true;
        self.readable = true;
        if !self.tx.is_empty() {
            self.on_writable();
        }
    }

    /// Whether it timed out by `now`.
    pub(crate) fn expired(&self, now: Instant) -> bool {
        self.expiry.is_some_and(|t| t <= now)
    }

    /// The next packet for the guest, its payload (`len` bytes, at most
    /// `buf.len()`) read into `buf`; `None` when there is nothing after all
    /// (the socket had no data).
    pub(crate) fn next_packet(&mut self, buf: &mut [u8]) -> Option<Header> {
        let mut hdr = Header {
            src_port: self.local_port,
            dst_port: self.peer_port,
            ..Header::default()
        };
        let take = |p: &mut u8, bit: u8| {
            let had = *p & bit != 0;
            *p &= !bit;
            had
        };
        if take(&mut self.pending, pending::RST) {
            self.pending = 0;
            hdr.op = op::RST;
        } else if take(&mut self.pending, pending::RESPONSE) {
            self.state = State::Established;
            hdr.op = op::RESPONSE;
        } else if take(&mut self.pending, pending::REQUEST) {
            hdr.op = op::REQUEST;
        } else if let Some(h) = self.data_packet(buf, hdr) {
            hdr = h;
        } else if take(&mut self.pending, pending::SHUTDOWN) {
            hdr.op = op::SHUTDOWN;
            hdr.flags = SHUTDOWN_SEND;
        } else if take(&mut self.pending, pending::CREDIT_UPDATE) {
            hdr.op = op::CREDIT_UPDATE;
        } else {
            return None;
        }
        hdr.buf_alloc = BUF_ALLOC;
        hdr.fwd_cnt = self.fwd_cnt.0;
        self.fwd_cnt_told = self.fwd_cnt;
        Some(hdr)
    }

    fn data_packet(&mut self, buf: &mut [u8], mut hdr: Header) -> Option<Header> {
        if !self.readable || !self.may_read() {
            return None;
        }
        let credit = self.peer_credit() as usize;
        if credit == 0 {
            if self.credit_requested {
                return None;
            }
            self.credit_requested = true;
            hdr.op = op::CREDIT_REQUEST;
            return Some(hdr);
        }
        let want = buf.len().min(credit);
        if want == 0 {
            return None;
        }
        match recv(&self.stream, &mut buf[..want], 0) {
            Ok(0) => {
                // The host will send no more; the guest may still send to it.
                self.local_eof = true;
                self.readable = false;
                hdr.op = op::SHUTDOWN;
                hdr.flags = SHUTDOWN_SEND;
                Some(hdr)
            }
            Ok(n) => {
                self.rx_cnt += Wrapping(n as u32);
                hdr.op = op::RW;
                hdr.len = n as u32;
                Some(hdr)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.readable = false;
                None
            }
            Err(_) => {
                self.kill();
                self.pending = 0;
                hdr.op = op::RST;
                Some(hdr)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn hdr(op: u16, len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1000,
            dst_port: 52,
            len,
            kind: 1,
            op,
            flags: 0,
            buf_alloc: 64 * 1024,
            fwd_cnt: 0,
        }
    }

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn established() -> (Conn, UnixStream) {
        let (a, b) = pair();
        let mut c = Conn::peer_init(a, &hdr(op::REQUEST, 0));
        let mut buf = [0u8; 4096];
        assert_eq!(c.next_packet(&mut buf).unwrap().op, op::RESPONSE);
        assert_eq!(c.state(), State::Established);
        (c, b)
    }

    #[test]
    fn a_host_connection_sends_request_and_answers_ok_on_response() {
        let (a, mut host) = pair();
        let mut c = Conn::local_init(a, 1 << 30, 52);
        let mut buf = [0u8; 4096];
        let h = c.next_packet(&mut buf).unwrap();
        assert_eq!((h.op, h.src_port, h.dst_port), (op::REQUEST, 1 << 30, 52));
        assert!(c.next_packet(&mut buf).is_none());
        let mut resp = hdr(op::RESPONSE, 0);
        resp.src_port = 52;
        assert_eq!(c.guest_packet(&resp, &[]), Verdict::Keep);
        let mut line = [0u8; 14];
        host.read_exact(&mut line).unwrap();
        assert_eq!(&line, b"OK 1073741824\n");
    }

    #[test]
    fn data_flows_both_ways_within_credit() {
        let (mut c, mut host) = established();
        c.guest_packet(&hdr(op::RW, 5), b"hello");
        let mut got = [0u8; 5];
        host.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        host.write_all(b"world!").unwrap();
        c.readable = true;
        let mut buf = [0u8; 4096];
        let h = c.next_packet(&mut buf[..4]).unwrap();
        assert_eq!((h.op, h.len, &buf[..4]), (op::RW, 4, &b"worl"[..]));
        assert_eq!(h.fwd_cnt, 5, "tells the guest what went to the host");
        let h = c.next_packet(&mut buf).unwrap();
        assert_eq!((h.op, &buf[..2]), (op::RW, &b"d!"[..]));
        assert!(c.next_packet(&mut buf).is_none());
        assert!(!c.readable);
    }

    #[test]
    fn no_credit_means_no_read_and_one_credit_request() {
        let (mut c, mut host) = established();
        let mut h = hdr(op::CREDIT_UPDATE, 0);
        h.buf_alloc = 3;
        c.guest_packet(&h, &[]);
        host.write_all(b"abcdef").unwrap();
        c.readable = true;
        let mut buf = [0u8; 4096];
        assert_eq!(c.next_packet(&mut buf).unwrap().len, 3);
        assert!(c.interest().is_empty(), "no reading without credit");
        assert_eq!(c.next_packet(&mut buf).unwrap().op, op::CREDIT_REQUEST);
        assert!(c.next_packet(&mut buf).is_none());
        h.fwd_cnt = 3;
        c.guest_packet(&h, &[]);
        let h = c.next_packet(&mut buf).unwrap();
        assert_eq!(&buf[..h.len as usize], b"def");
    }

    #[test]
    fn a_slow_host_reader_buffers_at_most_the_credit_then_resets() {
        let (mut c, host) = established();
        let chunk = vec![7u8; 64 * 1024];
        let mut sent = 0usize;
        // The guest ignores its credit: ember holds at most BUF_ALLOC, then resets.
        while c.state() != State::Killed {
            c.guest_packet(&hdr(op::RW, chunk.len() as u32), &chunk);
            sent += chunk.len();
            assert!(c.tx.len() <= BUF_ALLOC as usize);
            assert!(sent < 64 << 20, "never reset");
        }
        let mut buf = [0u8; 4096];
        assert_eq!(c.next_packet(&mut buf).unwrap().op, op::RST);
        drop(host);
    }

    #[test]
    fn a_full_shutdown_is_answered_with_rst_and_eof_with_shutdown() {
        let (mut c, mut host) = established();
        drop(host.write_all(b"x"));
        host.shutdown(std::net::Shutdown::Write).unwrap();
        c.readable = true;
        let mut buf = [0u8; 4096];
        assert_eq!(c.next_packet(&mut buf).unwrap().op, op::RW);
        let h = c.next_packet(&mut buf).unwrap();
        assert_eq!((h.op, h.flags), (op::SHUTDOWN, SHUTDOWN_SEND));
        let mut s = hdr(op::SHUTDOWN, 0);
        s.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
        c.guest_packet(&s, &[]);
        assert_eq!(c.next_packet(&mut buf).unwrap().op, op::RST);
        let mut rest = Vec::new();
        host.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "the host saw its end of file");
    }

    #[test]
    fn an_unknown_op_resets() {
        let (mut c, _host) = established();
        c.guest_packet(&hdr(99, 0), &[]);
        let mut buf = [0u8; 4096];
        assert_eq!(c.next_packet(&mut buf).unwrap().op, op::RST);
    }
}
