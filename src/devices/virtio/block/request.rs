//! Turning a virtio-blk descriptor chain into a request (virtio 1.x §5.2.6).
//!
//! A request is a 16-byte device-readable header (`type`, reserved, `sector`), a data
//! area, and one device-writable status byte at the very end. With `VIRTIO_F_ANY_LAYOUT`
//! (implied by version 1) the framing into descriptors is the driver's choice, so the
//! parser flattens the chain into readable and writable byte runs and cuts those.
//!
//! Everything here is guest-controlled; parsing never panics and never trusts a length.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::super::GuestMemory;

/// Size of the request header (`struct virtio_blk_outhdr`).
pub const HEADER_LEN: usize = 16;
/// Offset of `sector` in the header.
const HEADER_SECTOR_OFFSET: usize = 8;
/// Size of one discard / write-zeroes segment (`struct virtio_blk_discard_write_zeroes`).
pub const DISCARD_SEGMENT_LEN: usize = 16;

/// What the driver asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestType {
    /// Read sectors into the data area.
    In,
    /// Write the data area to sectors.
    Out,
    /// Make completed writes durable.
    Flush,
    /// Return the device serial (20 bytes).
    GetId,
    /// Drop sectors (hole punching).
    Discard,
    /// Zero sectors.
    WriteZeroes,
    /// Anything else; completes with `VIRTIO_BLK_S_UNSUPP`.
    Unsupported(u32),
}

impl RequestType {
    fn from_raw(raw: u32) -> Self {
        match raw {
            VIRTIO_BLK_T_IN => Self::In,
            VIRTIO_BLK_T_OUT => Self::Out,
            VIRTIO_BLK_T_FLUSH => Self::Flush,
            VIRTIO_BLK_T_GET_ID => Self::GetId,
            VIRTIO_BLK_T_DISCARD => Self::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => Self::WriteZeroes,
            other => Self::Unsupported(other),
        }
    }

    /// Whether the data area is device-writable (the device fills it).
    fn data_is_writable(self) -> bool {
        matches!(self, Self::In | Self::GetId)
    }
}

/// A contiguous piece of guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical start.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// A parsed request: what to do, and where in guest memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Head descriptor index, for the used ring.
    pub head: u16,
    /// The operation.
    pub kind: RequestType,
    /// First sector (512-byte units) for I/O requests.
    pub sector: u64,
    /// The data area, in order.
    pub data: Vec<Segment>,
    /// Total data bytes.
    pub data_len: u32,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// Malformed, but there is a writable status byte to report `IOERR` in.
    Invalid {
        /// Head descriptor index.
        head: u16,
        /// Where the status byte goes.
        status: GuestAddress,
        /// What was wrong, for the log.
        reason: &'static str,
    },
    /// Not even a status byte can be written: the request can only be dropped.
    NoStatus {
        /// Head descriptor index.
        head: u16,
        /// What was wrong, for the log.
        reason: &'static str,
    },
}

/// Parses one descriptor chain.
pub fn parse(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
) -> Result<Request, ParseError> {
    let head = chain.head_index();
    let mut readable: Vec<Segment> = Vec::new();
    let mut writable: Vec<Segment> = Vec::new();
    let mut problem: Option<&'static str> = None;
    let mut ended = false;

    for desc in chain {
        // The iterator stops silently at a loop, a chain longer than the queue, an index
        // out of the table or an unreadable descriptor; the last descriptor it yields then
        // still says "next", which is how we notice.
        ended = !desc.has_next();
        let seg = Segment {
            addr: desc.addr(),
            len: desc.len(),
        };
        if seg.len == 0 {
            continue;
        }
        if !mem.check_range(seg.addr, seg.len as usize) {
            problem.get_or_insert("descriptor outside guest memory");
            // Keep going: a valid status byte at the end still gets an error status.
            if desc.is_write_only() {
                writable.push(Segment {
                    addr: seg.addr,
                    len: 0,
                });
            }
            continue;
        }
        if desc.is_write_only() {
            writable.push(seg);
        } else if writable.is_empty() {
            readable.push(seg);
        } else {
            problem.get_or_insert("device-readable descriptor after a writable one");
        }
    }

    if !ended {
        return Err(ParseError::NoStatus {
            head,
            reason: "descriptor chain loops, is too long or leaves the table",
        });
    }
    // The status byte is the last byte of the last writable descriptor.
    let Some(last) = writable.last_mut() else {
        return Err(ParseError::NoStatus {
            head,
            reason: "no device-writable status byte",
        });
    };
    if last.len == 0 {
        return Err(ParseError::NoStatus {
            head,
            reason: "status byte outside guest memory",
        });
    }
    last.len -= 1;
    let status = last.addr.unchecked_add_len(last.len);
    let invalid = |reason| ParseError::Invalid {
        head,
        status,
        reason,
    };
    if let Some(reason) = problem {
        return Err(invalid(reason));
    }

    let mut header = [0u8; HEADER_LEN];
    let data_readable = gather(mem, &readable, &mut header)
        .ok_or_else(|| invalid("request header shorter than 16 bytes"))?;
    let kind = RequestType::from_raw(u32::from_le_bytes(
        header[..4].try_into().unwrap_or_default(),
    ));
    let sector = u64::from_le_bytes(
        header[HEADER_SECTOR_OFFSET..]
            .try_into()
            .unwrap_or_default(),
    );

    let data: Vec<Segment> = if kind.data_is_writable() {
        writable.into_iter().filter(|s| s.len > 0).collect()
    } else {
        data_readable
    };
    let data_len = data
        .iter()
        .try_fold(0u32, |acc, s| acc.checked_add(s.len))
        .ok_or_else(|| invalid("data area longer than 4 GiB"))?;

    Ok(Request {
        head,
        kind,
        sector,
        data,
        data_len,
        status,
    })
}

/// Copies the first `out.len()` bytes spread over `segs` into `out`; returns the segments
/// that remain after them, or `None` when there are not enough bytes.
fn gather(mem: &GuestMemory, segs: &[Segment], out: &mut [u8]) -> Option<Vec<Segment>> {
    let mut filled = 0usize;
    let mut rest = Vec::new();
    for seg in segs {
        let want = out.len() - filled;
        let take = (seg.len as usize).min(want);
        if take > 0 {
            mem.read_slice(&mut out[filled..filled + take], seg.addr)
                .ok()?;
            filled += take;
        }
        if take < seg.len as usize {
            rest.push(Segment {
                addr: seg.addr.unchecked_add_len(take as u32),
                len: seg.len - take as u32,
            });
        }
    }
    (filled == out.len()).then_some(rest)
}

trait AddLen {
    fn unchecked_add_len(self, len: u32) -> GuestAddress;
}

impl AddLen for GuestAddress {
    /// Only used on ranges `check_range` accepted, so it cannot overflow.
    fn unchecked_add_len(self, len: u32) -> GuestAddress {
        GuestAddress(self.0.wrapping_add(u64::from(len)))
    }
}
