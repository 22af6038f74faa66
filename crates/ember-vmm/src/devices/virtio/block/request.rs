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
use super::QUEUE_SIZE;

/// Size of the request header (`struct virtio_blk_outhdr`).
pub(crate) const HEADER_LEN: usize = 16;
/// Offset of `sector` in the header.
const HEADER_SECTOR_OFFSET: usize = 8;
/// Size of one discard / write-zeroes segment (`struct virtio_blk_discard_write_zeroes`).
pub(crate) const DISCARD_SEGMENT_LEN: usize = 16;

/// What the driver asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestType {
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
pub(crate) struct Segment {
    /// Guest-physical start.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// Most data segments one request may have. Every chain that fits the ring without
/// indirect descriptors fits (it has at most [`QUEUE_SIZE`] descriptors, header and
/// status included), and Linux never sends more than the `seg_max` we advertise (two
/// fewer). A longer chain, only possible through an indirect table, completes with
/// `VIRTIO_BLK_S_IOERR`.
pub(crate) const MAX_SEGMENTS: usize = QUEUE_SIZE as usize;

/// The data area of one request: up to [`MAX_SEGMENTS`] segments, in order.
///
/// Room for all of them is reserved once, by [`new`](Self::new), and [`parse`] clears and
/// refills the list for each request, so a steady stream of requests costs no heap
/// allocation (musl's allocator made per-request `Vec`s a visible share of a 4 KiB read).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Segments {
    /// Never longer than `MAX_SEGMENTS`; `new` reserves that much, so pushing never
    /// reallocates. (`Default` reserves nothing: it is a placeholder to swap with.)
    segs: Vec<Segment>,
}

impl Segments {
    /// An empty list with room for [`MAX_SEGMENTS`] segments.
    pub(crate) fn new() -> Self {
        Self {
            segs: Vec::with_capacity(MAX_SEGMENTS),
        }
    }

    /// Appends `seg`; `None` when the list is full.
    fn push(&mut self, seg: Segment) -> Option<()> {
        if self.segs.len() == MAX_SEGMENTS {
            return None;
        }
        self.segs.push(seg);
        Some(())
    }

    fn clear(&mut self) {
        self.segs.clear();
    }
}

impl std::ops::Deref for Segments {
    type Target = [Segment];

    fn deref(&self) -> &[Segment] {
        &self.segs
    }
}

/// A parsed request: what to do, and where in guest memory. Its data area is in the
/// [`Segments`] given to [`parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    /// Head descriptor index, for the used ring.
    pub head: u16,
    /// The operation.
    pub kind: RequestType,
    /// First sector (512-byte units) for I/O requests.
    pub sector: u64,
    /// Total data bytes.
    pub data_len: u32,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ParseError {
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

/// Parses one descriptor chain, putting its data area in `data` (cleared first; on error
/// its contents mean nothing).
///
/// One pass, nothing stored but the data: the header is copied out as its bytes go by,
/// which also tells, before the first device-writable descriptor, which side of the chain
/// the data is on; the last writable descriptor is held back, since its last byte is the
/// status. One function because the pass's state (the header so far, the data's side, the
/// held-back descriptor) lives across the whole chain.
pub(crate) fn parse(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    data: &mut Segments,
) -> Result<Request, ParseError> {
    let head = chain.head_index();
    data.clear();
    let mut header = [0u8; HEADER_LEN];
    let mut header_len = 0usize;
    // Known once the header is complete.
    let mut kind: Option<RequestType> = None;
    let mut data_len = 0u32;
    // The last device-writable descriptor so far: the status byte is its last byte.
    let mut last_writable: Option<Segment> = None;
    let mut problem: Option<&'static str> = None;
    let mut ended = false;

    // Adds `seg` to the data area if the data is on its side of the chain.
    let mut add_data =
        |seg: Segment, writable: bool, kind: Option<RequestType>, problem: &mut Option<_>| {
            if seg.len == 0 || kind.is_none_or(|k| k.data_is_writable() != writable) {
                return;
            }
            let Some(sum) = data_len.checked_add(seg.len) else {
                problem.get_or_insert("data area longer than 4 GiB");
                return;
            };
            data_len = sum;
            if data.push(seg).is_none() {
                problem.get_or_insert("more data segments than the device supports");
            }
        };

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
        let in_memory = mem.check_range(seg.addr, seg.len as usize);
        if !in_memory {
            // Keep going: a valid status byte at the end still gets an error status.
            problem.get_or_insert("descriptor outside guest memory");
        }
        if desc.is_write_only() {
            // Zero length marks a status byte outside guest memory.
            let seg = if in_memory {
                seg
            } else {
                Segment { len: 0, ..seg }
            };
            if let Some(prev) = last_writable.replace(seg) {
                add_data(prev, true, kind, &mut problem);
            }
        } else if last_writable.is_some() {
            problem.get_or_insert("device-readable descriptor after a writable one");
        } else if in_memory {
            // The header comes first; what follows it is data.
            let take = (seg.len as usize).min(HEADER_LEN - header_len);
            if take > 0 {
                if mem
                    .read_slice(&mut header[header_len..header_len + take], seg.addr)
                    .is_err()
                {
                    problem.get_or_insert("unreadable request header");
                }
                header_len += take;
                if header_len == HEADER_LEN {
                    kind = Some(RequestType::from_raw(u32::from_le_bytes(
                        header[..4].try_into().unwrap_or_default(),
                    )));
                }
            }
            let rest = Segment {
                addr: seg.addr.unchecked_add_len(take as u32),
                len: seg.len - take as u32,
            };
            add_data(rest, false, kind, &mut problem);
        }
    }

    let last = status_segment(head, ended, last_writable)?;
    let status = last.addr.unchecked_add_len(last.len - 1);
    let invalid = |reason| ParseError::Invalid {
        head,
        status,
        reason,
    };
    // The writable bytes before the status are data too.
    add_data(
        Segment {
            addr: last.addr,
            len: last.len - 1,
        },
        true,
        kind,
        &mut problem,
    );
    if let Some(reason) = problem {
        return Err(invalid(reason));
    }
    let Some(kind) = kind else {
        return Err(invalid("request header shorter than 16 bytes"));
    };
    let sector = u64::from_le_bytes(
        header[HEADER_SECTOR_OFFSET..]
            .try_into()
            .unwrap_or_default(),
    );
    Ok(Request {
        head,
        kind,
        sector,
        data_len,
        status,
    })
}

/// The last device-writable descriptor of a chain that ended, whose last byte is the
/// status; why no status can be written otherwise.
#[inline]
fn status_segment(
    head: u16,
    ended: bool,
    last_writable: Option<Segment>,
) -> Result<Segment, ParseError> {
    let no_status = |reason| ParseError::NoStatus { head, reason };
    if !ended {
        return Err(no_status(
            "descriptor chain loops, is too long or leaves the table",
        ));
    }
    let Some(last) = last_writable else {
        return Err(no_status("no device-writable status byte"));
    };
    if last.len == 0 {
        return Err(no_status("status byte outside guest memory"));
    }
    Ok(last)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::test_utils::*;
    use virtio_queue::{Queue, QueueOwnedT};

    const HDR: u64 = DATA_START;
    const DATA: u64 = DATA_START + 0x1000;
    const STATUS: u64 = DATA_START + 0x3000;
    const TABLE: u64 = DATA_START + 0x2_0000;

    /// Parses the next available chain of `q` into `segs`.
    fn next(mem: &GuestMemory, q: &mut Queue, segs: &mut Segments) -> Result<Request, ParseError> {
        let chain = q.iter(mem).unwrap().next().expect("a chain");
        parse(mem, chain, segs)
    }

    fn header(mem: &GuestMemory, kind: u32, sector: u64) {
        mem.write_obj(kind, GuestAddress(HDR)).unwrap();
        mem.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
    }

    fn seg(addr: u64, len: u32) -> Segment {
        Segment {
            addr: GuestAddress(addr),
            len,
        }
    }

    #[test]
    fn the_framing_is_the_drivers_choice() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        let mut q = vq.create_queue().unwrap();
        let mut segs = Segments::new();
        // A write whose header is split over two descriptors and whose first data shares
        // the second one.
        header(&mem, VIRTIO_BLK_T_OUT, 7);
        add_chain(
            &vq,
            0,
            &[r(HDR, 10), r(HDR + 10, 6 + 100), r(DATA, 412), w(STATUS, 1)],
        );
        let req = next(&mem, &mut q, &mut segs).unwrap();
        assert_eq!(
            (req.kind, req.sector, req.data_len),
            (RequestType::Out, 7, 512)
        );
        assert_eq!(req.status, GuestAddress(STATUS));
        assert_eq!(*segs, [seg(HDR + 16, 100), seg(DATA, 412)]);
        // A read whose last data shares the descriptor with the status byte.
        header(&mem, VIRTIO_BLK_T_IN, 1);
        add_chain(&vq, 4, &[r(HDR, 16), w(DATA, 100), w(DATA + 100, 413)]);
        let req = next(&mem, &mut q, &mut segs).unwrap();
        assert_eq!((req.kind, req.data_len), (RequestType::In, 512));
        assert_eq!(req.status, GuestAddress(DATA + 512));
        assert_eq!(*segs, [seg(DATA, 100), seg(DATA + 100, 412)]);
    }

    #[test]
    fn a_reused_list_holds_only_the_latest_request() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        let mut q = vq.create_queue().unwrap();
        let mut segs = Segments::new();
        header(&mem, VIRTIO_BLK_T_IN, 0);
        add_chain(
            &vq,
            0,
            &[
                r(HDR, 16),
                w(DATA, 512),
                w(DATA + 512, 512),
                w(DATA + 1024, 512),
                w(STATUS, 1),
            ],
        );
        assert_eq!(next(&mem, &mut q, &mut segs).unwrap().data_len, 1536);
        assert_eq!(segs.len(), 3);
        // A flush has no data at all.
        header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        add_chain(&vq, 5, &[r(HDR, 16), w(STATUS, 1)]);
        assert_eq!(next(&mem, &mut q, &mut segs).unwrap().data_len, 0);
        assert!(segs.is_empty());
        // Nor does a rejected chain leave its segments for the next request to find.
        header(&mem, VIRTIO_BLK_T_IN, 0);
        add_chain(&vq, 7, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        header(&mem, VIRTIO_BLK_T_GET_ID, 0);
        add_chain(&vq, 10, &[r(HDR, 16), w(DATA, 20), w(STATUS, 1)]);
        next(&mem, &mut q, &mut segs).unwrap();
        let req = next(&mem, &mut q, &mut segs).unwrap();
        assert_eq!((req.kind, req.data_len), (RequestType::GetId, 20));
        assert_eq!(*segs, [seg(DATA, 20)]);
    }

    #[test]
    fn data_segments_are_capped() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        let mut q = vq.create_queue().unwrap();
        let mut segs = Segments::new();
        let chain = |n: usize, write: bool| {
            let mut c = vec![r(HDR, 16)];
            c.extend((0..n as u64).map(|i| {
                if write {
                    w(DATA + 2 * i, 2)
                } else {
                    r(DATA + 2 * i, 2)
                }
            }));
            c.push(w(STATUS, 1));
            c
        };
        for (kind, write) in [(VIRTIO_BLK_T_IN, true), (VIRTIO_BLK_T_OUT, false)] {
            header(&mem, kind, 0);
            add_indirect_chain(&vq, 0, TABLE, &chain(MAX_SEGMENTS, write));
            let req = next(&mem, &mut q, &mut segs).unwrap();
            assert_eq!(req.data_len as usize, 2 * MAX_SEGMENTS);
            assert_eq!(segs.len(), MAX_SEGMENTS);
            // Capacity was reserved up front: the list never reallocates.
            assert_eq!(segs.segs.capacity(), MAX_SEGMENTS);

            add_indirect_chain(&vq, 1, TABLE, &chain(MAX_SEGMENTS + 1, write));
            assert_eq!(
                next(&mem, &mut q, &mut segs),
                Err(ParseError::Invalid {
                    head: 1,
                    status: GuestAddress(STATUS),
                    reason: "more data segments than the device supports",
                })
            );
        }
        // The last descriptor may hold data and the status byte: the data counts, the
        // status byte does not.
        header(&mem, VIRTIO_BLK_T_IN, 0);
        let mut c = chain(MAX_SEGMENTS - 1, true);
        c.pop();
        c.push(w(STATUS - 2, 3));
        add_indirect_chain(&vq, 2, TABLE, &c);
        let req = next(&mem, &mut q, &mut segs).unwrap();
        assert_eq!(segs.len(), MAX_SEGMENTS);
        assert_eq!(req.status, GuestAddress(STATUS));
    }
}
