//! The virtio-vsock packet header (virtio 1.2 §5.10.6) and its constants.

/// `struct virtio_vsock_hdr`, little-endian, packed: 44 bytes.
pub(crate) const HDR_LEN: usize = 44;

/// The host's CID, the only peer this device serves.
pub(crate) const HOST_CID: u64 = 2;

/// `VIRTIO_VSOCK_TYPE_STREAM`, the only socket type served.
pub(crate) const TYPE_STREAM: u16 = 1;

/// Operations.
pub(crate) mod op {
    pub(crate) const REQUEST: u16 = 1;
    pub(crate) const RESPONSE: u16 = 2;
    pub(crate) const RST: u16 = 3;
    pub(crate) const SHUTDOWN: u16 = 4;
    pub(crate) const RW: u16 = 5;
    pub(crate) const CREDIT_UPDATE: u16 = 6;
    pub(crate) const CREDIT_REQUEST: u16 = 7;
}

/// `VIRTIO_VSOCK_SHUTDOWN_RCV`: the sender will receive no more data.
pub(crate) const SHUTDOWN_RCV: u32 = 1;
/// `VIRTIO_VSOCK_SHUTDOWN_SEND`: the sender will send no more data.
pub(crate) const SHUTDOWN_SEND: u32 = 2;

/// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`: the driver drops every connection and re-reads
/// the CID.
pub(crate) const EVENT_TRANSPORT_RESET: u32 = 0;

/// A packet header, decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) src_cid: u64,
    pub(crate) dst_cid: u64,
    pub(crate) src_port: u32,
    pub(crate) dst_port: u32,
    pub(crate) len: u32,
    pub(crate) kind: u16,
    pub(crate) op: u16,
    pub(crate) flags: u32,
    pub(crate) buf_alloc: u32,
    pub(crate) fwd_cnt: u32,
}

impl Header {
    /// Decodes the wire form.
    pub(crate) fn decode(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            kind: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// The wire form.
    pub(crate) fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_round_trips_in_its_wire_layout() {
        let h = Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 0x1234,
            dst_port: 52,
            len: 7,
            kind: TYPE_STREAM,
            op: op::RW,
            flags: SHUTDOWN_SEND,
            buf_alloc: 65536,
            fwd_cnt: 9,
        };
        let b = h.encode();
        assert_eq!(b[0], 3);
        assert_eq!(b[8], 2);
        assert_eq!(&b[16..18], &[0x34, 0x12]);
        assert_eq!(b[30], op::RW as u8);
        assert_eq!(Header::decode(&b), h);
    }
}
