//! The virtio-mem request protocol (virtio 1.2 §5.15) as a pure state machine:
//! which blocks of the region are plugged, what the driver is asked to plug,
//! and the answer to each request. No I/O: an unplug returns the ranges the
//! caller discards.

use serde::{Deserialize, Serialize};

/// Request types.
pub(crate) const REQ_PLUG: u16 = 0;
pub(crate) const REQ_UNPLUG: u16 = 1;
pub(crate) const REQ_UNPLUG_ALL: u16 = 2;
pub(crate) const REQ_STATE: u16 = 3;
/// Response types.
pub(crate) const RESP_ACK: u16 = 0;
pub(crate) const RESP_NACK: u16 = 1;
pub(crate) const RESP_ERROR: u16 = 3;
/// Block states a STATE request answers.
pub(crate) const STATE_PLUGGED: u16 = 0;
pub(crate) const STATE_UNPLUGGED: u16 = 1;
pub(crate) const STATE_MIXED: u16 = 2;
/// `struct virtio_mem_req`: type, padding, then addr and nb_blocks.
pub(crate) const REQ_LEN: usize = 24;
/// `struct virtio_mem_resp`: type, padding, then the state.
pub(crate) const RESP_LEN: usize = 10;

/// A driver request, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// Plug `nb_blocks` blocks from `addr`.
    Plug { addr: u64, nb_blocks: u16 },
    /// Unplug them.
    Unplug { addr: u64, nb_blocks: u16 },
    /// Unplug every block.
    UnplugAll,
    /// Whether they are plugged.
    State { addr: u64, nb_blocks: u16 },
    /// A type this device does not know.
    Unknown(u16),
}

impl Request {
    /// Decodes the 24 bytes of a `virtio_mem_req`.
    pub(crate) fn parse(b: &[u8; REQ_LEN]) -> Self {
        let ty = u16::from_le_bytes([b[0], b[1]]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[8..16]);
        let addr = u64::from_le_bytes(a);
        let nb_blocks = u16::from_le_bytes([b[16], b[17]]);
        match ty {
            REQ_PLUG => Request::Plug { addr, nb_blocks },
            REQ_UNPLUG => Request::Unplug { addr, nb_blocks },
            REQ_UNPLUG_ALL => Request::UnplugAll,
            REQ_STATE => Request::State { addr, nb_blocks },
            t => Request::Unknown(t),
        }
    }
}

/// The device's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Response {
    /// Done.
    Ack,
    /// Refused for now (more than requested, or memory not committed yet).
    Nack,
    /// A request no correct driver makes (out of range, unaligned, unplug of
    /// unplugged blocks, unknown type).
    Error,
    /// A STATE answer.
    State(u16),
}

impl Response {
    /// The 10 bytes of a `virtio_mem_resp`.
    pub(crate) fn encode(self) -> [u8; RESP_LEN] {
        let (ty, state) = match self {
            Response::Ack => (RESP_ACK, 0),
            Response::Nack => (RESP_NACK, 0),
            Response::Error => (RESP_ERROR, 0),
            Response::State(s) => (RESP_ACK, s),
        };
        let mut out = [0u8; RESP_LEN];
        out[..2].copy_from_slice(&ty.to_le_bytes());
        out[8..].copy_from_slice(&state.to_le_bytes());
        out
    }
}

/// The region and its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Blocks {
    /// Guest-physical start of the region.
    pub(crate) addr: u64,
    /// Bytes per block.
    pub(crate) block_size: u64,
    /// Blocks in the region.
    pub(crate) blocks: u64,
    /// One bit per block, set when plugged.
    pub(crate) plugged: Vec<u64>,
    /// The user's requested size, bytes.
    pub(crate) user: u64,
    /// The first `committed` bytes of the region are committed on the host:
    /// no block past them is plugged, nor asked for.
    pub(crate) committed: u64,
}

impl Blocks {
    /// A region of `blocks` blocks of `block_size` bytes at `addr`, nothing
    /// plugged, nothing requested, nothing committed.
    pub(crate) fn new(addr: u64, block_size: u64, blocks: u64) -> Self {
        Blocks {
            addr,
            block_size,
            blocks,
            plugged: vec![0; blocks.div_ceil(64) as usize],
            user: 0,
            committed: 0,
        }
    }

    /// Region size, bytes.
    pub(crate) fn region_size(&self) -> u64 {
        self.blocks * self.block_size
    }

    /// Plugged bytes.
    pub(crate) fn plugged_size(&self) -> u64 {
        self.plugged
            .iter()
            .map(|w| u64::from(w.count_ones()))
            .sum::<u64>()
            * self.block_size
    }

    /// What the driver is asked to plug: the user's size, but no more than
    /// the committed part, in whole blocks.
    pub(crate) fn requested_size(&self) -> u64 {
        let r = self.user.min(self.committed).min(self.region_size());
        r - r % self.block_size
    }

    fn is_plugged(&self, i: u64) -> bool {
        self.plugged[(i / 64) as usize] & 1 << (i % 64) != 0
    }

    fn set(&mut self, i: u64, on: bool) {
        let w = &mut self.plugged[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }

    /// The first block index and the count of `addr`/`nb_blocks`, if they are
    /// whole blocks inside the region.
    fn range(&self, addr: u64, nb_blocks: u16) -> Option<(u64, u64)> {
        let n = u64::from(nb_blocks);
        let off = addr.checked_sub(self.addr)?;
        if n == 0 || off % self.block_size != 0 {
            return None;
        }
        let first = off / self.block_size;
        (first.checked_add(n)? <= self.blocks).then_some((first, n))
    }

    /// Answers `req`; the guest-physical ranges an unplug freed (to discard
    /// on the host) go to `freed`.
    pub(crate) fn handle(&mut self, req: Request, freed: &mut Vec<(u64, u64)>) -> Response {
        match req {
            Request::Plug { addr, nb_blocks } => {
                let Some((first, n)) = self.range(addr, nb_blocks) else {
                    return Response::Error;
                };
                if (first..first + n).any(|i| self.is_plugged(i)) {
                    return Response::Error;
                }
                let end = (first + n) * self.block_size;
                if self.plugged_size() + n * self.block_size > self.requested_size()
                    || end > self.committed
                {
                    return Response::Nack;
                }
                (first..first + n).for_each(|i| self.set(i, true));
                Response::Ack
            }
            Request::Unplug { addr, nb_blocks } => {
                let Some((first, n)) = self.range(addr, nb_blocks) else {
                    return Response::Error;
                };
                if !(first..first + n).all(|i| self.is_plugged(i)) {
                    return Response::Error;
                }
                (first..first + n).for_each(|i| self.set(i, false));
                let start = self.addr + first * self.block_size;
                freed.push((start, start + n * self.block_size));
                Response::Ack
            }
            Request::UnplugAll => {
                let mut run: Option<u64> = None;
                for i in 0..=self.blocks {
                    let on = i < self.blocks && self.is_plugged(i);
                    match (on, run) {
                        (true, None) => run = Some(i),
                        (false, Some(s)) => {
                            let a = self.addr + s * self.block_size;
                            freed.push((a, self.addr + i * self.block_size));
                            run = None;
                        }
                        _ => {}
                    }
                }
                self.plugged.iter_mut().for_each(|w| *w = 0);
                Response::Ack
            }
            Request::State { addr, nb_blocks } => {
                let Some((first, n)) = self.range(addr, nb_blocks) else {
                    return Response::Error;
                };
                let on = (first..first + n).filter(|&i| self.is_plugged(i)).count() as u64;
                Response::State(match on {
                    0 => STATE_UNPLUGGED,
                    x if x == n => STATE_PLUGGED,
                    _ => STATE_MIXED,
                })
            }
            Request::Unknown(_) => Response::Error,
        }
    }

    /// Plugged blocks as merged guest-physical ranges.
    pub(crate) fn plugged_ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut copy = self.clone();
        copy.handle(Request::UnplugAll, &mut out);
        out
    }

    /// Checks what a snapshot's checksum cannot: a bitmap of the region's
    /// size, no bit past its end, sizes that fit.
    pub(crate) fn check(&self) -> bool {
        self.block_size.is_power_of_two()
            && self.blocks.checked_mul(self.block_size).is_some()
            && self.plugged.len() as u64 == self.blocks.div_ceil(64)
            && (self.blocks % 64 == 0
                || self
                    .plugged
                    .last()
                    .is_none_or(|w| w >> (self.blocks % 64) == 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u64 = 2 << 20;
    const BASE: u64 = 1 << 32;

    fn blocks() -> Blocks {
        let mut b = Blocks::new(BASE, BS, 100);
        b.user = 10 * BS;
        b.committed = b.region_size();
        b
    }

    fn plug(addr: u64, nb_blocks: u16) -> Request {
        Request::Plug { addr, nb_blocks }
    }

    fn unplug(addr: u64, nb_blocks: u16) -> Request {
        Request::Unplug { addr, nb_blocks }
    }

    #[test]
    fn plug_up_to_the_requested_size_then_nack() {
        let mut b = blocks();
        let mut freed = vec![];
        assert_eq!(b.handle(plug(BASE, 8), &mut freed), Response::Ack);
        assert_eq!(b.plugged_size(), 8 * BS);
        assert_eq!(b.handle(plug(BASE + 8 * BS, 3), &mut freed), Response::Nack);
        assert_eq!(b.handle(plug(BASE + 8 * BS, 2), &mut freed), Response::Ack);
        assert_eq!(
            b.handle(plug(BASE + 50 * BS, 1), &mut freed),
            Response::Nack
        );
        assert!(freed.is_empty());
        assert_eq!(b.plugged_ranges(), [(BASE, BASE + 10 * BS)]);
    }

    #[test]
    fn guest_garbage_is_an_error_never_a_panic() {
        let mut b = blocks();
        let mut freed = vec![];
        for req in [
            plug(BASE + 1, 1),
            plug(BASE - BS, 1),
            plug(BASE + 99 * BS, 2),
            plug(BASE, 0),
            plug(u64::MAX - BS + 1, 1),
            plug(0, 1),
            unplug(BASE, 1),
            Request::State {
                addr: BASE + 100 * BS,
                nb_blocks: 1,
            },
            Request::Unknown(9),
        ] {
            assert_eq!(b.handle(req, &mut freed), Response::Error, "{req:?}");
        }
        assert_eq!(b.handle(plug(BASE, 2), &mut freed), Response::Ack);
        assert_eq!(b.handle(plug(BASE + BS, 1), &mut freed), Response::Error);
        assert_eq!(b.handle(unplug(BASE, 3), &mut freed), Response::Error);
        assert_eq!(b.plugged_size(), 2 * BS, "a refused unplug unplugs nothing");
        assert!(freed.is_empty());
    }

    #[test]
    fn unplug_frees_and_state_reports() {
        let mut b = blocks();
        let mut freed = vec![];
        b.handle(plug(BASE, 4), &mut freed);
        let state = |b: &mut Blocks, a, n| {
            b.handle(
                Request::State {
                    addr: a,
                    nb_blocks: n,
                },
                &mut vec![],
            )
        };
        assert_eq!(state(&mut b, BASE, 4), Response::State(STATE_PLUGGED));
        assert_eq!(
            state(&mut b, BASE + 3 * BS, 2),
            Response::State(STATE_MIXED)
        );
        assert_eq!(b.handle(unplug(BASE + BS, 2), &mut freed), Response::Ack);
        assert_eq!(freed, [(BASE + BS, BASE + 3 * BS)]);
        assert_eq!(
            state(&mut b, BASE + BS, 2),
            Response::State(STATE_UNPLUGGED)
        );
        freed.clear();
        assert_eq!(b.handle(Request::UnplugAll, &mut freed), Response::Ack);
        assert_eq!(freed, [(BASE, BASE + BS), (BASE + 3 * BS, BASE + 4 * BS)]);
        assert_eq!(b.plugged_size(), 0);
    }

    #[test]
    fn nothing_past_the_committed_part_is_requested_or_plugged() {
        let mut b = blocks();
        b.user = b.region_size();
        b.committed = 5 * BS + 7;
        assert_eq!(b.requested_size(), 5 * BS);
        let mut freed = vec![];
        assert_eq!(b.handle(plug(BASE + 4 * BS, 2), &mut freed), Response::Nack);
        assert_eq!(b.handle(plug(BASE + 6 * BS, 1), &mut freed), Response::Nack);
        assert_eq!(b.handle(plug(BASE, 5), &mut freed), Response::Ack);
        b.committed = 7 * BS;
        assert_eq!(b.handle(plug(BASE + 6 * BS, 1), &mut freed), Response::Ack);
    }

    #[test]
    fn wire_formats() {
        let mut raw = [0u8; REQ_LEN];
        raw[0] = 1;
        raw[8..16].copy_from_slice(&BASE.to_le_bytes());
        raw[16] = 3;
        assert_eq!(Request::parse(&raw), unplug(BASE, 3));
        raw[0] = 2;
        assert_eq!(Request::parse(&raw), Request::UnplugAll);
        let r = Response::State(STATE_MIXED).encode();
        assert_eq!(r, [0, 0, 0, 0, 0, 0, 0, 0, 2, 0]);
        assert_eq!(Response::Nack.encode()[0], 1);
    }

    #[test]
    fn a_saved_bitmap_is_checked() {
        let mut b = Blocks::new(BASE, BS, 65);
        assert!(b.check());
        b.plugged[1] = 2;
        assert!(!b.check(), "a bit past the region");
        b.plugged.pop();
        assert!(!b.check(), "a bitmap too short");
        assert!(!Blocks::new(BASE, 3 << 20, 4).check());
    }
}
