//! The host side of the hybrid vsock (Firecracker's design and wire protocol):
//! every connection is a Unix stream socket.
//!
//! - Host to guest: a host program connects to the device's socket `PATH` and
//!   writes `CONNECT <port>\n`; the guest gets a REQUEST for `<port>` from a
//!   host port ember picks (from 2^30 up), and once it answers the host program
//!   reads `OK <host port>\n` and the stream carries the connection.
//! - Guest to host: a guest REQUEST to host port `P` connects to `PATH_P`,
//!   where a host program listens.
//!
//! The muxer owns the connections, the listener and the handshakes in progress,
//! all non-blocking on the device thread's epoll. It never sees guest memory:
//! it takes the guest's packets as headers and payloads and hands back the
//! next packet for the guest the same way.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::conn::{self, Conn, Verdict};
use super::packet::{HOST_CID, Header, TYPE_STREAM, op};

/// Most connections at once; a host or guest opening more is refused.
pub(crate) const MAX_CONNECTIONS: usize = 1024;
/// Most host connections that have not sent their `CONNECT` line yet.
const MAX_HANDSHAKES: usize = 64;
/// Most RSTs for unknown connections waiting for a receive buffer (each is
/// advisory: dropping one only leaves a guest socket to its own timeout).
const MAX_LOOSE_RSTS: usize = 256;
/// How long a host program may take to send its `CONNECT <port>\n` line
/// after connecting; then it is dropped, so one that never sends it cannot
/// hold one of the `MAX_HANDSHAKES` places for good.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest `CONNECT <port>\n` line.
const MAX_CONNECT_LINE: usize = 32;
/// Epoll token of the listener; a stream's token is `FD_TOKEN + fd`.
pub(crate) const LISTENER_TOKEN: u64 = 1 << 40;
/// Tokens of host streams start here (queue and kill tokens are below).
pub(crate) const FD_TOKEN: u64 = 1 << 32;
/// The first host port given to a host-initiated connection.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// A connection's identity: our port and the guest's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) local: u32,
    pub(crate) peer: u32,
}

/// What a host stream's fd is.
#[derive(Debug)]
enum Watch {
    /// A host program that has not sent `CONNECT <port>\n` yet, and when
    /// it is dropped if it still has not.
    Handshake(UnixStream, Instant),
    /// A connection's stream.
    Conn(Key),
}

/// The connections of one device.
#[derive(Debug)]
pub(crate) struct Muxer {
    cid: u64,
    uds: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    conns: HashMap<Key, Conn>,
    fds: HashMap<RawFd, Watch>,
    local_ports: HashSet<u32>,
    next_port: u32,
    /// Connections with something for the guest, in turn.
    ready: VecDeque<Key>,
    /// RSTs answering packets for no connection.
    loose_rsts: VecDeque<Key>,
}

impl Muxer {
    /// A muxer for the guest `cid`, serving `listener` (bound at `uds`,
    /// already non-blocking: the device thread may not ioctl).
    pub(crate) fn new(cid: u64, uds: PathBuf, listener: UnixListener) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, LISTENER_TOKEN),
        )?;
        Ok(Muxer {
            cid,
            uds,
            listener,
            epoll,
            conns: HashMap::new(),
            fds: HashMap::new(),
            local_ports: HashSet::new(),
            next_port: FIRST_LOCAL_PORT,
            ready: VecDeque::new(),
            loose_rsts: VecDeque::new(),
        })
    }

    /// The epoll the device thread waits on (its queue and kill eventfds go in too).
    pub(crate) fn epoll(&self) -> &Epoll {
        &self.epoll
    }

    /// How many connections are open (tests).
    #[cfg(test)]
    pub(crate) fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Whether a packet waits for the guest.
    pub(crate) fn has_rx(&self) -> bool {
        !self.loose_rsts.is_empty() || !self.ready.is_empty()
    }

    /// The earliest time a connection or a handshake times out.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let handshakes = self.fds.values().filter_map(|w| match w {
            Watch::Handshake(_, until) => Some(*until),
            Watch::Conn(_) => None,
        });
        self.conns
            .values()
            .filter_map(|c| c.expiry)
            .chain(handshakes)
            .min()
    }

    /// Resets the connections and drops the handshakes whose time is up.
    pub(crate) fn expire(&mut self, now: Instant) {
        let slow: Vec<RawFd> = self
            .fds
            .iter()
            .filter(|(_, w)| matches!(w, Watch::Handshake(_, until) if *until <= now))
            .map(|(fd, _)| *fd)
            .collect();
        for fd in slow {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            // Closing the stream tells the host program.
            self.fds.remove(&fd);
        }
        let late: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.expired(now))
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            if let Some(c) = self.conns.get_mut(&key) {
                c.kill();
            }
            self.sync(key);
        }
    }

    /// An epoll event for `token` (the listener or a host stream).
    pub(crate) fn event(&mut self, token: u64, events: EventSet) {
        if token == LISTENER_TOKEN {
            return self.accept();
        }
        let Ok(fd) = RawFd::try_from(token - FD_TOKEN) else {
            return;
        };
        match self.fds.get(&fd) {
            Some(Watch::Handshake(..)) => self.handshake(fd),
            Some(Watch::Conn(key)) => {
                let key = *key;
                let Some(c) = self.conns.get_mut(&key) else {
                    return;
                };
                if events.intersects(EventSet::HANG_UP | EventSet::ERROR) {
                    c.on_hangup();
                } else {
                    if events.contains(EventSet::IN) {
                        c.readable = true;
                    }
                    if events.contains(EventSet::OUT) {
                        c.on_writable();
                    }
                }
                self.sync(key);
            }
            None => {}
        }
    }

    fn accept(&mut self) {
        loop {
            // SAFETY: accept4 on our listening socket; no address is asked for.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted => continue,
                    io::ErrorKind::WouldBlock => return,
                    _ => {
                        crate::guest_warn!("virtio-vsock: accept on {}: {e}", self.uds.display());
                        return;
                    }
                }
            }
            // SAFETY: accept4 just returned this descriptor; nothing else owns it.
            let stream = unsafe { UnixStream::from_raw_fd(fd) };
            let handshakes = self.fds.len() - self.conns.len();
            if handshakes >= MAX_HANDSHAKES || self.conns.len() >= MAX_CONNECTIONS {
                crate::guest_warn!("virtio-vsock: too many host connections; one refused");
                continue;
            }
            if let Err(e) = self.epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, FD_TOKEN + fd as u64),
            ) {
                crate::guest_warn!("virtio-vsock: cannot watch a host connection: {e}");
                continue;
            }
            let until = Instant::now() + HANDSHAKE_TIMEOUT;
            self.fds.insert(fd, Watch::Handshake(stream, until));
        }
    }

    /// A host program's `CONNECT <port>\n`, read without taking any byte past it.
    fn handshake(&mut self, fd: RawFd) {
        let Some(Watch::Handshake(stream, _)) = self.fds.get(&fd) else {
            return;
        };
        let mut line = [0u8; MAX_CONNECT_LINE];
        let n = match conn::recv(stream, &mut line, libc::MSG_PEEK) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Ok(n) => n,
            Err(_) => 0,
        };
        let port = match line[..n].iter().position(|&b| b == b'\n') {
            Some(end) => {
                let mut consumed = [0u8; MAX_CONNECT_LINE];
                let took = conn::recv(stream, &mut consumed[..=end], 0).unwrap_or(0);
                if took == end + 1 {
                    parse_connect(&line[..end])
                } else {
                    None
                }
            }
            // Not all there yet: wait for more, unless it can never be a line.
            None if n > 0 && n < MAX_CONNECT_LINE => return,
            None => None,
        };
        let Some(Watch::Handshake(stream, _)) = self.fds.remove(&fd) else {
            return;
        };
        let Some(peer) = port.filter(|_| self.conns.len() < MAX_CONNECTIONS) else {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            return;
        };
        let local = self.allocate_port();
        let key = Key { local, peer };
        let mut c = Conn::local_init(stream, local, peer);
        c.watching = EventSet::IN;
        self.conns.insert(key, c);
        self.fds.insert(fd, Watch::Conn(key));
        self.sync(key);
    }

    fn allocate_port(&mut self) -> u32 {
        loop {
            let p = self.next_port;
            self.next_port = self.next_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if self.local_ports.insert(p) {
                return p;
            }
        }
    }

    /// A packet from the guest's transmit queue.
    pub(crate) fn send(&mut self, hdr: &Header, data: &[u8]) {
        // Our side of the connection is the destination.
        let key = Key {
            local: hdr.dst_port,
            peer: hdr.src_port,
        };
        if hdr.dst_cid != HOST_CID {
            crate::guest_warn!("virtio-vsock: a packet for CID {} dropped", hdr.dst_cid);
            return;
        }
        if hdr.kind != TYPE_STREAM {
            return self.loose_rst(key, hdr);
        }
        if !self.conns.contains_key(&key) {
            match hdr.op {
                op::REQUEST => self.guest_connect(key, hdr),
                // Nothing to answer an RST with.
                op::RST => {}
                _ => self.loose_rst(key, hdr),
            }
            return;
        }
        let verdict = match self.conns.get_mut(&key) {
            Some(c) => c.guest_packet(hdr, data),
            None => return,
        };
        match verdict {
            Verdict::Remove => self.remove(key),
            Verdict::Keep => self.sync(key),
        }
    }

    fn loose_rst(&mut self, key: Key, hdr: &Header) {
        if hdr.op == op::RST {
            return;
        }
        if self.loose_rsts.len() < MAX_LOOSE_RSTS {
            self.loose_rsts.push_back(key);
        }
    }

    /// A guest REQUEST: connect to `PATH_<port>`, or refuse with an RST.
    fn guest_connect(&mut self, key: Key, hdr: &Header) {
        if self.conns.len() >= MAX_CONNECTIONS {
            return self.loose_rst(key, hdr);
        }
        let mut path = self.uds.as_os_str().to_owned();
        path.push(format!("_{}", key.local));
        match connect_nonblocking(Path::new(&path)) {
            Ok(stream) => {
                let fd = stream.as_raw_fd();
                self.local_ports.insert(key.local);
                self.conns.insert(key, Conn::peer_init(stream, hdr));
                self.fds.insert(fd, Watch::Conn(key));
                self.sync(key);
            }
            Err(_) => self.loose_rst(key, hdr),
        }
    }

    /// Brings a connection's epoll registration and ready-queue place up to date.
    fn sync(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        if c.has_rx() && !c.queued {
            c.queued = true;
            self.ready.push_back(key);
        }
        // A hung-up socket reports HUP whatever it is asked for: stop watching it.
        let want = if c.hup {
            EventSet::empty()
        } else {
            c.interest()
        };
        if want == c.watching {
            return;
        }
        let fd = c.stream.as_raw_fd();
        let event = EpollEvent::new(want, FD_TOKEN + fd as u64);
        let result = if c.watching.is_empty() {
            self.epoll.ctl(ControlOperation::Add, fd, event)
        } else if want.is_empty() {
            self.epoll.ctl(ControlOperation::Delete, fd, event)
        } else {
            self.epoll.ctl(ControlOperation::Modify, fd, event)
        };
        match result {
            Ok(()) => c.watching = want,
            Err(e) => {
                crate::guest_warn!("virtio-vsock: cannot watch a connection: {e}");
                c.kill();
                if !c.queued {
                    c.queued = true;
                    self.ready.push_back(key);
                }
            }
        }
    }

    fn remove(&mut self, key: Key) {
        let Some(c) = self.conns.remove(&key) else {
            return;
        };
        let fd = c.stream.as_raw_fd();
        if !c.watching.is_empty() {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        }
        self.fds.remove(&fd);
        self.local_ports.remove(&key.local);
    }

    /// The next packet for the guest: its header, and its payload (`len`
    /// bytes, at most `buf.len()`) in `buf`.
    pub(crate) fn recv(&mut self, buf: &mut [u8]) -> Option<Header> {
        let mut hdr = if let Some(key) = self.loose_rsts.pop_front() {
            Header {
                src_port: key.local,
                dst_port: key.peer,
                op: op::RST,
                ..Header::default()
            }
        } else {
            self.conn_packet(buf)?
        };
        hdr.src_cid = HOST_CID;
        hdr.dst_cid = self.cid;
        hdr.kind = TYPE_STREAM;
        Some(hdr)
    }

    fn conn_packet(&mut self, buf: &mut [u8]) -> Option<Header> {
        // Each connection is tried at most once per call, so one whose
        // socket turned out empty cannot keep us here.
        for _ in 0..self.ready.len() {
            let key = self.ready.pop_front()?;
            let Some(c) = self.conns.get_mut(&key) else {
                continue;
            };
            c.queued = false;
            let packet = c.next_packet(buf);
            match packet {
                Some(h) if h.op == op::RST => {
                    self.remove(key);
                    return Some(h);
                }
                Some(h) => {
                    self.sync(key);
                    return Some(h);
                }
                None => self.sync(key),
            }
        }
        None
    }
}

/// `CONNECT <port>` (the word in any case, as Firecracker reads it).
fn parse_connect(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    let mut words = text.split_whitespace();
    let verb = words.next()?;
    let port = words.next()?.parse().ok()?;
    (verb.eq_ignore_ascii_case("connect") && words.next().is_none()).then_some(port)
}

/// Connects a non-blocking Unix stream socket to `path` (a full listen queue
/// is a refusal, never a wait on the device thread).
pub(crate) fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    // SAFETY: plain socket creation; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain data; all zeros is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (d, &s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un of at least `len` bytes.
    let rc = unsafe { libc::connect(fd, (&raw const addr).cast(), len as libc::socklen_t) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    struct Rig {
        dir: PathBuf,
        m: Muxer,
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn rig(name: &str) -> Rig {
        let dir = std::env::temp_dir().join(format!("ember-vsock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let uds = dir.join("v.sock");
        let l = UnixListener::bind(&uds).unwrap();
        l.set_nonblocking(true).unwrap();
        Rig {
            dir,
            m: Muxer::new(3, uds, l).unwrap(),
        }
    }

    /// Runs the muxer's epoll once (as the device thread would).
    fn pump(m: &mut Muxer) {
        let mut evs = [EpollEvent::default(); 16];
        let n = m.epoll().wait(200, &mut evs).unwrap();
        for e in &evs[..n] {
            m.event(e.data(), e.event_set());
        }
    }

    fn guest(op: u16, src_port: u32, dst_port: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            kind: TYPE_STREAM,
            op,
            buf_alloc: 1 << 20,
            ..Header::default()
        }
    }

    #[test]
    fn connect_lines_parse_as_firecracker_reads_them() {
        assert_eq!(parse_connect(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect(b"connect 1024 "), Some(1024));
        assert_eq!(parse_connect(b"CONNECT"), None);
        assert_eq!(parse_connect(b"CONNECT x"), None);
        assert_eq!(parse_connect(b"LISTEN 52"), None);
        assert_eq!(parse_connect(b"CONNECT 52 53"), None);
    }

    #[test]
    fn host_initiated_connection_handshakes_and_carries_data() {
        let mut r = rig("host");
        let mut host = UnixStream::connect(&r.m.uds).unwrap();
        host.write_all(b"CONNECT 52\nearly").unwrap();
        pump(&mut r.m);
        pump(&mut r.m);
        let mut buf = [0u8; 4096];
        let req = r.m.recv(&mut buf).unwrap();
        assert_eq!((req.op, req.dst_port, req.dst_cid), (op::REQUEST, 52, 3));
        assert_eq!(req.src_port, FIRST_LOCAL_PORT);
        r.m.send(&guest(op::RESPONSE, 52, req.src_port), &[]);
        let mut ok = [0u8; 14];
        host.read_exact(&mut ok).unwrap();
        assert_eq!(&ok, b"OK 1073741824\n");
        // The bytes written after the line are data, not lost to the handshake.
        pump(&mut r.m);
        let rw = r.m.recv(&mut buf).unwrap();
        assert_eq!((rw.op, &buf[..rw.len as usize]), (op::RW, &b"early"[..]));
        r.m.send(&guest(op::RW, 52, req.src_port), b"pong");
        let mut got = [0u8; 4];
        host.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");
        r.m.send(&guest(op::RST, 52, req.src_port), &[]);
        assert_eq!(r.m.connections(), 0);
        assert_eq!(
            host.read(&mut got).unwrap(),
            0,
            "the host sees the reset as EOF"
        );
    }

    #[test]
    fn guest_initiated_connection_reaches_path_port_or_is_reset() {
        let mut r = rig("guest");
        let mut buf = [0u8; 4096];
        r.m.send(&guest(op::REQUEST, 2000, 1234), &[]);
        let rst = r.m.recv(&mut buf).unwrap();
        assert_eq!((rst.op, rst.src_port, rst.dst_port), (op::RST, 1234, 2000));
        let l = UnixListener::bind(r.dir.join("v.sock_1234")).unwrap();
        r.m.send(&guest(op::REQUEST, 2000, 1234), &[]);
        let resp = r.m.recv(&mut buf).unwrap();
        assert_eq!(resp.op, op::RESPONSE);
        let (mut host, _) = l.accept().unwrap();
        r.m.send(&guest(op::RW, 2000, 1234), b"hi host");
        let mut got = [0u8; 7];
        host.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi host");
        drop(host);
        pump(&mut r.m);
        let end = r.m.recv(&mut buf).unwrap();
        assert_eq!(end.op, op::SHUTDOWN);
    }

    /// A host program that connects and never sends its line is dropped once
    /// its time is up, and its place is free again; a handshake within its time
    /// goes on.
    #[test]
    fn a_host_that_never_sends_connect_is_dropped_after_the_timeout() {
        let mut r = rig("slow");
        let mut silent: Vec<UnixStream> = (0..MAX_HANDSHAKES)
            .map(|_| UnixStream::connect(&r.m.uds).unwrap())
            .collect();
        pump(&mut r.m);
        let at = r.m.deadline().expect("the handshakes have a deadline");
        // Every handshake's time runs from its own accept: the last may be
        // well after the first on a loaded host, but none after now.
        let last = Instant::now() + HANDSHAKE_TIMEOUT;
        assert!(at <= last);
        // Every place is taken: one more is refused (closed at once).
        let mut extra = UnixStream::connect(&r.m.uds).unwrap();
        pump(&mut r.m);
        let mut b = [0u8; 1];
        assert_eq!(extra.read(&mut b).unwrap(), 0, "refused while full");
        r.m.expire(at - Duration::from_millis(1));
        assert_eq!(r.m.fds.len(), MAX_HANDSHAKES, "not yet");
        r.m.expire(last + Duration::from_millis(1));
        assert!(r.m.fds.is_empty() && r.m.deadline().is_none());
        for s in &mut silent {
            assert_eq!(s.read(&mut b).unwrap(), 0, "closed by the timeout");
        }
        // The places are free: a prompt host connects.
        let mut host = UnixStream::connect(&r.m.uds).unwrap();
        host.write_all(b"CONNECT 7\n").unwrap();
        pump(&mut r.m);
        pump(&mut r.m);
        let mut buf = [0u8; 64];
        assert_eq!(r.m.recv(&mut buf).unwrap().op, op::REQUEST);
    }

    #[test]
    fn packets_for_no_connection_get_an_rst_and_bad_lines_are_dropped() {
        let mut r = rig("loose");
        let mut buf = [0u8; 4096];
        r.m.send(&guest(op::RW, 5, 6), b"x");
        assert_eq!(r.m.recv(&mut buf).unwrap().op, op::RST);
        r.m.send(&guest(op::RST, 5, 6), &[]);
        assert!(!r.m.has_rx(), "an RST is never answered");
        let mut host = UnixStream::connect(&r.m.uds).unwrap();
        host.write_all(b"HELLO THERE\n").unwrap();
        pump(&mut r.m);
        pump(&mut r.m);
        assert!(!r.m.has_rx());
        let mut b = [0u8; 1];
        assert_eq!(host.read(&mut b).unwrap(), 0, "closed");
    }
}
