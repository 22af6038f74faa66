//! A backend on a connected stream socket with QEMU's stream-netdev framing, as
//! passt speaks it (`passt --fd`): each Ethernet frame preceded by its length as a
//! 4-byte big-endian number, no virtio-net header (so the device offers no
//! offloads).
//!
//! The socket is non-blocking: frames are cut out of what has arrived. A frame
//! the socket has no room for waits a little ([`ROOM_WAIT`]: passt reads all the
//! time, but a burst of the guest's can fill a Unix socket's buffer) and is then
//! dropped, as a full tap drops one; a frame written only in part keeps its
//! unwritten tail here, written before anything else (the stream must never carry
//! half a frame followed by another).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::Mutex;

use super::Error;
use super::backend::Backend;

/// The length prefix.
const LEN_BYTES: usize = 4;
/// The longest frame taken: a 64 KiB frame and some; longer ones are skipped
/// (passt sends at most 65535 + an Ethernet header).
const MAX_FRAME: usize = 65_550;
/// Bytes of the stream held at once: two whole frames.
const RX_CAP: usize = 2 * (LEN_BYTES + MAX_FRAME);
/// How long a frame waits for room in the socket before it is dropped (the
/// device thread waits with it: short enough for a VM's stop not to notice).
const ROOM_WAIT_MS: libc::c_int = 50;

/// What has arrived and not yet been taken as a frame.
#[derive(Debug)]
struct Rx {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Bytes still to skip of an over-long frame.
    skip: usize,
}

/// The stream backend.
#[derive(Debug)]
pub(crate) struct Stream {
    file: File,
    rx: Mutex<Rx>,
    /// The unwritten tail of the last frame sent.
    tx_tail: Mutex<Vec<u8>>,
}

impl Stream {
    /// Takes over a connected stream socket the caller opened (`socket=N`).
    pub(crate) fn from_fd(fd: RawFd) -> Result<Self, Error> {
        let bad = |why: &str| Error::BadSocketFd(fd, why.to_owned());
        // SAFETY: F_GETFD only asks about the descriptor number.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(bad("not an open descriptor"));
        }
        let mut kind: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: SO_TYPE writes an int into `kind`, whose size `len` gives.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_TYPE,
                (&mut kind as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(bad("not a socket"));
        }
        if kind != libc::SOCK_STREAM {
            return Err(bad("not a stream socket"));
        }
        // SAFETY: the caller handed this descriptor to ember to own.
        let file = unsafe { File::from_raw_fd(fd) };
        // SAFETY: F_GETFL/F_SETFL/F_SETFD on a descriptor we own.
        unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
        Ok(Stream::new(file))
    }

    fn new(file: File) -> Self {
        Stream {
            file,
            rx: Mutex::new(Rx {
                buf: vec![0u8; RX_CAP].into_boxed_slice(),
                start: 0,
                end: 0,
                skip: 0,
            }),
            tx_tail: Mutex::new(Vec::new()),
        }
    }

    /// Writes what is left of the last frame, waiting up to [`ROOM_WAIT_MS`]
    /// for room if `wait`; whether nothing is left.
    fn flush_tail(&self, tail: &mut Vec<u8>, wait: bool) -> io::Result<bool> {
        while !tail.is_empty() {
            match (&self.file).write(tail) {
                Ok(n) => {
                    tail.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !(wait && self.wait_for_room()) {
                        return Ok(false);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Waits up to [`ROOM_WAIT_MS`] for the socket to take more; whether it will.
    fn wait_for_room(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.file.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one pollfd, which `p` is, for the call's duration.
        unsafe { libc::poll(&mut p, 1, ROOM_WAIT_MS) == 1 }
    }
}

impl Backend for Stream {
    fn vnet_hdr(&self) -> bool {
        false
    }

    fn set_offloads(&self, _guest_features: u64) -> io::Result<()> {
        Ok(())
    }

    fn recv(&self, out: &mut [u8]) -> io::Result<usize> {
        // A tail left by a full socket goes as soon as there is room.
        {
            let mut tail = self.tx_tail.lock().unwrap_or_else(|e| e.into_inner());
            self.flush_tail(&mut tail, false)?;
        }
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        let rx = &mut *rx;
        loop {
            if rx.skip > 0 {
                let n = rx.skip.min(rx.end - rx.start);
                rx.start += n;
                rx.skip -= n;
            }
            let held = rx.end - rx.start;
            if rx.skip == 0 && held >= LEN_BYTES {
                let at = rx.start;
                let mut len = [0u8; LEN_BYTES];
                len.copy_from_slice(&rx.buf[at..at + LEN_BYTES]);
                let len = u32::from_be_bytes(len) as usize;
                if len > MAX_FRAME {
                    rx.start += LEN_BYTES;
                    rx.skip = len;
                    continue;
                }
                if held >= LEN_BYTES + len {
                    let n = len.min(out.len());
                    out[..n].copy_from_slice(&rx.buf[at + LEN_BYTES..at + LEN_BYTES + n]);
                    rx.start += LEN_BYTES + len;
                    return Ok(n);
                }
            }
            // More is needed: keep what is held at the front, then read.
            if rx.start > 0 {
                rx.buf.copy_within(rx.start..rx.end, 0);
                rx.end -= rx.start;
                rx.start = 0;
            }
            match (&self.file).read(&mut rx.buf[rx.end..]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the socket's other end closed",
                    ));
                }
                Ok(n) => rx.end += n,
                Err(e) => return Err(e),
            }
        }
    }

    fn send(&self, frame: &[u8]) -> io::Result<()> {
        let mut tail = self.tx_tail.lock().unwrap_or_else(|e| e.into_inner());
        if !self.flush_tail(&mut tail, true)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let len = u32::try_from(frame.len())
            .ok()
            .filter(|&l| l as usize <= MAX_FRAME)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too long"))?;
        let mut whole = Vec::with_capacity(LEN_BYTES + frame.len());
        whole.extend_from_slice(&len.to_be_bytes());
        whole.extend_from_slice(frame);
        loop {
            match (&self.file).write(&whole) {
                Ok(n) if n == whole.len() => return Ok(()),
                Ok(n) => {
                    // Part of it is in the stream: the rest must follow first.
                    whole.drain(..n);
                    *tail = whole;
                    self.flush_tail(&mut tail, true)?;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !self.wait_for_room() {
                        return Err(e);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// For the fuzz target `net_stream` (fuzz/, built by scripts/fuzz with `--cfg
/// fuzzing`): `input` as everything passt sent, arriving in pieces of the size its
/// first byte picks, cut into frames into a buffer of the size its second byte
/// picks; then the same bytes as frames the guest sends. A length prefix may say
/// anything: the backend must neither crash, hand back more than the buffer, nor
/// hold more than its two frames' worth.
#[cfg(fuzzing)]
pub(crate) fn fuzz_stream(input: &[u8]) {
    use std::os::unix::net::UnixStream;
    let Ok((ours, mut peer)) = UnixStream::pair() else {
        return;
    };
    if ours.set_nonblocking(true).is_err() || peer.set_nonblocking(true).is_err() {
        return;
    }
    let s = Stream::new(File::from(std::os::fd::OwnedFd::from(ours)));
    let piece = 1 + usize::from(input.first().copied().unwrap_or(0)) * 97;
    let mut out = vec![0u8; 1 + usize::from(input.get(1).copied().unwrap_or(255)) * 300];
    let body = input.get(2..).unwrap_or_default();
    let mut drain = |s: &Stream| {
        loop {
            match s.recv(&mut out) {
                Ok(n) => assert!(n <= out.len()),
                Err(_) => break,
            }
            let rx = s.rx.lock().unwrap_or_else(|e| e.into_inner());
            assert!(rx.start <= rx.end && rx.end <= RX_CAP);
        }
    };
    for p in body.chunks(piece) {
        let mut p = p;
        while !p.is_empty() {
            match peer.write(p) {
                Ok(n) => p = &p[n..],
                Err(_) => drain(&s),
            }
        }
        drain(&s);
    }
    drop(peer);
    drain(&s);
    // The guest's side: frames of the lengths the input gives, into a peer that
    // has gone (an error, never half a frame kept forever or a crash).
    for p in body.chunks(piece) {
        let _ = s.send(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair() -> (Stream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (Stream::new(File::from(std::os::fd::OwnedFd::from(a))), b)
    }

    fn framed(frame: &[u8]) -> Vec<u8> {
        let mut v = (frame.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(frame);
        v
    }

    #[test]
    fn frames_are_cut_out_of_the_stream_however_it_arrives() {
        let (s, mut peer) = pair();
        let mut out = [0u8; 70_000];
        assert_eq!(
            s.recv(&mut out).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        let big: Vec<u8> = (0..60_000u32).map(|i| i as u8).collect();
        let mut wire = framed(b"first");
        wire.extend(framed(&big));
        wire.extend(framed(b""));
        // Byte by byte for the first frame, then the rest at once.
        for b in &wire[..6] {
            peer.write_all(&[*b]).unwrap();
            assert_eq!(
                s.recv(&mut out).unwrap_err().kind(),
                io::ErrorKind::WouldBlock
            );
        }
        peer.write_all(&wire[6..]).unwrap();
        let n = s.recv(&mut out).unwrap();
        assert_eq!(&out[..n], b"first");
        let n = s.recv(&mut out).unwrap();
        assert_eq!(&out[..n], &big[..]);
        assert_eq!(s.recv(&mut out).unwrap(), 0);
        // An over-long frame is skipped whole; the next one is found.
        peer.write_all(&(MAX_FRAME as u32 + 1).to_be_bytes())
            .unwrap();
        peer.write_all(&vec![7u8; MAX_FRAME + 1]).unwrap();
        peer.write_all(&framed(b"after")).unwrap();
        let n = loop {
            match s.recv(&mut out) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(&out[..n], b"after");
        drop(peer);
        assert_eq!(
            s.recv(&mut out).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn a_full_socket_never_leaves_half_a_frame_behind_another() {
        let (s, mut peer) = pair();
        let frame = vec![0xabu8; 60_000];
        // Fill the socket until a frame is refused.
        let mut sent = 0;
        loop {
            match s.send(&frame) {
                Ok(()) => sent += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(sent > 0);
        // The peer reads everything: whole frames, each one's length first.
        peer.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut frames = 0;
        loop {
            match peer.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(_) => {
                    // Let the backend write the tail it kept.
                    let mut out = [0u8; 16];
                    let _ = s.recv(&mut out);
                    match peer.read(&mut buf) {
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                        Err(_) => break,
                    }
                }
            }
            while got.len() >= 4 {
                let len = u32::from_be_bytes(got[..4].try_into().unwrap()) as usize;
                if got.len() < 4 + len {
                    break;
                }
                assert_eq!(len, frame.len());
                assert!(got[4..4 + len].iter().all(|&b| b == 0xab));
                got.drain(..4 + len);
                frames += 1;
            }
        }
        assert!(got.is_empty(), "{} bytes of half a frame", got.len());
        assert_eq!(frames, sent);
    }
}
