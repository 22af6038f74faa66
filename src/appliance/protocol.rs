//! The appliance channel protocol: how the command, its stdin, stdout,
//! stderr and exit status travel between ember and the guest init over one
//! byte stream (a serial line, a virtio-console port, or on the ember
//! backend a vsock connection).
//!
//! Every message is a frame:
//!
//! ```text
//! +---------+----------------------+-----------------+
//! | type u8 | length u32 (le)      | payload (length)|
//! +---------+----------------------+-----------------+
//! ```
//!
//! Payloads are raw bytes (binary-safe) of at most [`MAX_PAYLOAD`]; longer
//! data is sent as several frames of the same type. The conversation:
//!
//! 1. guest → host `READY` once its channel tty is raw (so nothing the host
//!    sends is echoed back);
//! 2. host → guest `ARG`… (argv, argv[0] first), `ENV`… (`NAME=value`),
//!    optionally `CWD` and `ROOT` (a block device with the command's root
//!    file system: init mounts it and runs the command chrooted there) or
//!    `HOSTROOT` (the virtio-fs tag of the host's root: init mounts it
//!    read-only under an overlay in guest memory) and `SHARE`s (`ro|rw TAG
//!    PATH`: a virtio-fs share mounted at PATH of that root), and `NET`
//!    (`eth0`'s configuration, `netconf`: init applies it), then
//!    `EXEC` (the path to execute) which starts it;
//! 3. both ways concurrently: host → guest `STDIN`… then `STDIN_EOF`;
//!    guest → host `STDOUT`/`STDERR` as the command writes;
//! 4. guest → host `EXIT` (i32 le: exit code, or 128 + signal), or `ERROR`
//!    (UTF-8 message) if the appliance itself failed;
//! 5. host → guest `DONE` once it has read that frame (and so everything
//!    before it); only then does the guest power off. A slow reader holds
//!    the guest's output back in its port's queue (QEMU throttles the port),
//!    and a guest that powered off at once would take that output with it.
//!
//! On a vsock channel (the ember backend) step 3 is not frames: before it
//! starts the command the guest makes three more connections to the same
//! host port, which become the command's stdin, stdout and stderr as they
//! are (no pipe, no copy through init: this guest kernel's copies are its
//! cost). The host half-closes stdin at its end, reads stdout and stderr
//! to theirs, and takes `EXIT` only then; the guest ends those two (a
//! half-close) when the command exits and holds them open until `DONE`.
//!
//! Kernel messages never travel here: the kernel's console is another device.

pub use ember_frames::{HEADER_LEN, MAX_PAYLOAD};
use std::io::{self, Write};
use thiserror::Error;

/// A frame's meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Guest ready for the command.
    Ready,
    /// Command stdout bytes.
    Stdout,
    /// Command stderr bytes.
    Stderr,
    /// Command exit code.
    Exit,
    /// Appliance failure message.
    Error,
    /// One argv element.
    Arg,
    /// One `NAME=value` environment entry.
    Env,
    /// Working directory.
    Cwd,
    /// Path to execute; starts the command.
    Exec,
    /// Stdin bytes.
    Stdin,
    /// End of stdin.
    StdinEof,
    /// The block device holding the command's root file system.
    Root,
    /// The host has the guest's last frame: it may power off.
    Done,
    /// The guest network's configuration.
    Net,
    /// The virtio-fs tag of the host's root (run on it, overlaid).
    HostRoot,
    /// One more share: `ro|rw TAG GUEST-PATH`.
    Share,
}

impl Kind {
    /// The type byte on the wire.
    pub fn byte(self) -> u8 {
        use ember_frames as t;
        match self {
            Kind::Ready => t::READY,
            Kind::Stdout => t::STDOUT,
            Kind::Stderr => t::STDERR,
            Kind::Exit => t::EXIT,
            Kind::Error => t::ERROR,
            Kind::Arg => t::ARG,
            Kind::Env => t::ENV,
            Kind::Cwd => t::CWD,
            Kind::Exec => t::EXEC,
            Kind::Stdin => t::STDIN,
            Kind::StdinEof => t::STDIN_EOF,
            Kind::Root => t::ROOT,
            Kind::Done => t::DONE,
            Kind::Net => t::NET,
            Kind::HostRoot => t::HOSTROOT,
            Kind::Share => t::SHARE,
        }
    }

    /// The kind of a type byte.
    pub fn from_byte(b: u8) -> Option<Kind> {
        use ember_frames as t;
        Some(match b {
            t::READY => Kind::Ready,
            t::STDOUT => Kind::Stdout,
            t::STDERR => Kind::Stderr,
            t::EXIT => Kind::Exit,
            t::ERROR => Kind::Error,
            t::ARG => Kind::Arg,
            t::ENV => Kind::Env,
            t::CWD => Kind::Cwd,
            t::EXEC => Kind::Exec,
            t::STDIN => Kind::Stdin,
            t::STDIN_EOF => Kind::StdinEof,
            t::ROOT => Kind::Root,
            t::DONE => Kind::Done,
            t::NET => Kind::Net,
            t::HOSTROOT => Kind::HostRoot,
            t::SHARE => Kind::Share,
            _ => return None,
        })
    }
}

/// Protocol errors.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// A type byte no side sends.
    #[error("unknown frame type {0:#04x}")]
    UnknownType(u8),
    /// A length beyond [`MAX_PAYLOAD`].
    #[error("frame of {0} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLong(usize),
    /// The stream ended inside a frame.
    #[error("the channel closed in the middle of a frame ({0} bytes left over)")]
    Truncated(usize),
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its type.
    pub kind: Kind,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// Encodes frames of `kind` carrying `payload` (split at [`MAX_PAYLOAD`];
/// an empty payload is one empty frame) into `out`.
pub fn encode(out: &mut Vec<u8>, kind: Kind, payload: &[u8]) {
    let mut chunks = payload.chunks(MAX_PAYLOAD).peekable();
    if chunks.peek().is_none() {
        out.push(kind.byte());
        out.extend_from_slice(&0u32.to_le_bytes());
        return;
    }
    for chunk in chunks {
        out.push(kind.byte());
        // Chunks are at most MAX_PAYLOAD (64 KiB), which fits a u32.
        out.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
        out.extend_from_slice(chunk);
    }
}

/// Writes frames of `kind` with `payload` to `w`.
pub fn write_frame(w: &mut impl Write, kind: Kind, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    encode(&mut buf, kind, payload);
    w.write_all(&buf)
}

/// Incremental decoder: feed it bytes as they arrive, in pieces of any size.
///
/// It holds at most one partial frame ([`HEADER_LEN`] + [`MAX_PAYLOAD`] bytes) plus the
/// last piece fed, and decodes in time linear in the bytes fed: taking a frame moves a
/// cursor, and what is left is moved to the front once per [`Decoder::feed`] (taking
/// each frame off the front instead made a guest's 64 KiB of empty frames cost 400 MB
/// of copying).
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`.
    start: usize,
}

impl Decoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.drain(..self.start);
        self.start = 0;
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtocolError> {
        let rest = &self.buf[self.start..];
        if rest.len() < HEADER_LEN {
            return Ok(None);
        }
        let kind = Kind::from_byte(rest[0]).ok_or(ProtocolError::UnknownType(rest[0]))?;
        let len = u32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(ProtocolError::TooLong(len));
        }
        let Some(payload) = rest.get(HEADER_LEN..HEADER_LEN + len) else {
            return Ok(None);
        };
        let payload = payload.to_vec();
        self.start += HEADER_LEN + len;
        Ok(Some(Frame { kind, payload }))
    }

    /// Call at end of stream: an error if a partial frame is left.
    pub fn finish(&self) -> Result<(), ProtocolError> {
        match self.buf.len() - self.start {
            0 => Ok(()),
            n => Err(ProtocolError::Truncated(n)),
        }
    }
}

/// Decodes an `EXIT` payload.
pub fn exit_code(payload: &[u8]) -> Option<i32> {
    Some(i32::from_le_bytes(payload.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(bytes: &[u8], piece: usize) -> Result<Vec<Frame>, ProtocolError> {
        let mut d = Decoder::new();
        let mut frames = Vec::new();
        for p in bytes.chunks(piece.max(1)) {
            d.feed(p);
            while let Some(f) = d.next_frame()? {
                frames.push(f);
            }
        }
        d.finish()?;
        Ok(frames)
    }

    #[test]
    fn round_trip_every_kind_and_binary_payloads() {
        let binary: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut wire = Vec::new();
        encode(&mut wire, Kind::Ready, b"");
        encode(&mut wire, Kind::Stdout, &binary);
        encode(&mut wire, Kind::Stderr, b"\r\n\x00\x03\x11\x13");
        encode(&mut wire, Kind::Exit, &7i32.to_le_bytes());
        let frames = decode_all(&wire, wire.len()).unwrap();
        assert_eq!(frames.len(), 4);
        assert_eq!(frames[0].kind, Kind::Ready);
        assert_eq!(frames[1].payload, binary);
        assert_eq!(frames[2].payload, b"\r\n\x00\x03\x11\x13");
        assert_eq!(exit_code(&frames[3].payload), Some(7));
        for b in 0..=255u8 {
            if let Some(k) = Kind::from_byte(b) {
                assert_eq!(k.byte(), b);
            }
        }
    }

    #[test]
    fn frames_split_at_every_boundary_decode_the_same() {
        let mut wire = Vec::new();
        encode(&mut wire, Kind::Arg, b"sh");
        encode(&mut wire, Kind::Env, b"A=b");
        encode(&mut wire, Kind::Exec, b"/bin/sh");
        let whole = decode_all(&wire, wire.len()).unwrap();
        for piece in 1..wire.len() {
            assert_eq!(decode_all(&wire, piece).unwrap(), whole, "piece {piece}");
        }
    }

    #[test]
    fn long_payloads_are_split_into_max_size_frames() {
        let data = vec![0xa5u8; MAX_PAYLOAD * 2 + 3];
        let mut wire = Vec::new();
        encode(&mut wire, Kind::Stdin, &data);
        let frames = decode_all(&wire, 4096).unwrap();
        let lens: Vec<_> = frames.iter().map(|f| f.payload.len()).collect();
        assert_eq!(lens, [MAX_PAYLOAD, MAX_PAYLOAD, 3]);
        assert_eq!(frames.concat_payloads(), data);
    }

    /// 1 MiB of empty frames fed at once (209715 frames) decode in linear time: about
    /// 50 ms in a debug build. Taking each frame off the front of the buffer copied the
    /// rest every time: 110 GB of copying for this input, 10 s or more.
    #[test]
    fn many_small_frames_decode_in_linear_time() {
        let mut wire = Vec::new();
        encode(&mut wire, Kind::Stdout, b"");
        let wire = wire.repeat((1 << 20) / HEADER_LEN);
        let started = std::time::Instant::now();
        let mut d = Decoder::new();
        d.feed(&wire);
        let mut n = 0usize;
        while d.next_frame().unwrap().is_some() {
            n += 1;
        }
        d.finish().unwrap();
        assert_eq!(n, (1 << 20) / HEADER_LEN);
        let took = started.elapsed();
        assert!(took.as_secs() < 2, "decoding took {took:?}");
    }

    trait Concat {
        fn concat_payloads(&self) -> Vec<u8>;
    }
    impl Concat for Vec<Frame> {
        fn concat_payloads(&self) -> Vec<u8> {
            self.iter().flat_map(|f| f.payload.clone()).collect()
        }
    }

    #[test]
    fn truncated_unknown_and_oversized_frames_are_errors() {
        let mut wire = Vec::new();
        encode(&mut wire, Kind::Stdout, b"hello");
        assert_eq!(
            decode_all(&wire[..wire.len() - 2], 3),
            Err(ProtocolError::Truncated(HEADER_LEN + 3))
        );
        assert_eq!(
            decode_all(&[0x7f, 0, 0, 0, 0], 5),
            Err(ProtocolError::UnknownType(0x7f))
        );
        let mut big = vec![ember_frames::STDOUT];
        big.extend_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert_eq!(
            decode_all(&big, 5),
            Err(ProtocolError::TooLong(MAX_PAYLOAD + 1))
        );
        assert_eq!(exit_code(b"abc"), None);
    }
}
