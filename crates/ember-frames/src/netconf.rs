//! The `NET` frame's payload: how `eth0` is configured in the guest (`ember
//! run --net`). The host works the configuration out (see ember's `passt` module)
//! and init applies it before the command starts: no DHCP client in the
//! guest, and nothing to wait for.
//!
//! Layout (all fixed, [`HEADER_LEN`] bytes, then the rest):
//!
//! ```text
//! 0      flags u8: bit 0 IPv4 present, bit 1 IPv6 present
//! 1..5   MTU u32 (le)
//! 5..9   IPv4 address   9 prefix length   10..14 IPv4 gateway
//! 14..30 IPv6 address  30 prefix length   31..47 IPv6 gateway
//! 47..   the guest's /etc/resolv.conf, as it is written
//! ```
//!
//! Addresses are in network byte order; an absent family's bytes are zero.
//! The guest init (`guests/init`) is `no_std`: no allocation, no std.

/// Bytes before the resolv.conf text.
pub const HEADER_LEN: usize = 47;

const HAS_V4: u8 = 1;
const HAS_V6: u8 = 2;

/// An IPv4 configuration: address, prefix length, gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V4 {
    /// The interface's address.
    pub addr: [u8; 4],
    /// Its prefix length.
    pub prefix: u8,
    /// The default route's gateway.
    pub gateway: [u8; 4],
}

/// An IPv6 configuration: address, prefix length, gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V6 {
    /// The interface's address.
    pub addr: [u8; 16],
    /// Its prefix length.
    pub prefix: u8,
    /// The default route's gateway.
    pub gateway: [u8; 16],
}

/// A decoded `NET` payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConf<'a> {
    /// The interface's MTU.
    pub mtu: u32,
    /// IPv4, if the guest gets it.
    pub v4: Option<V4>,
    /// IPv6, if the guest gets it.
    pub v6: Option<V6>,
    /// `/etc/resolv.conf`'s contents.
    pub resolv_conf: &'a [u8],
}

impl<'a> NetConf<'a> {
    /// Decodes a payload; `None` if it is shorter than the header, or its
    /// prefix lengths are out of range.
    #[inline]
    pub fn decode(p: &'a [u8]) -> Option<NetConf<'a>> {
        if p.len() < HEADER_LEN {
            return None;
        }
        let mut a4 = [0u8; 4];
        let mut g4 = [0u8; 4];
        let mut a6 = [0u8; 16];
        let mut g6 = [0u8; 16];
        a4.copy_from_slice(&p[5..9]);
        g4.copy_from_slice(&p[10..14]);
        a6.copy_from_slice(&p[14..30]);
        g6.copy_from_slice(&p[31..47]);
        let v4 = V4 {
            addr: a4,
            prefix: p[9],
            gateway: g4,
        };
        let v6 = V6 {
            addr: a6,
            prefix: p[30],
            gateway: g6,
        };
        if v4.prefix > 32 || v6.prefix > 128 {
            return None;
        }
        Some(NetConf {
            mtu: u32::from_le_bytes([p[1], p[2], p[3], p[4]]),
            v4: (p[0] & HAS_V4 != 0).then_some(v4),
            v6: (p[0] & HAS_V6 != 0).then_some(v6),
            resolv_conf: &p[HEADER_LEN..],
        })
    }

    /// The header of this configuration's payload (the resolv.conf text
    /// follows it).
    #[inline]
    pub fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[1..5].copy_from_slice(&self.mtu.to_le_bytes());
        if let Some(v4) = &self.v4 {
            h[0] |= HAS_V4;
            h[5..9].copy_from_slice(&v4.addr);
            h[9] = v4.prefix;
            h[10..14].copy_from_slice(&v4.gateway);
        }
        if let Some(v6) = &self.v6 {
            h[0] |= HAS_V6;
            h[14..30].copy_from_slice(&v6.addr);
            h[30] = v6.prefix;
            h[31..47].copy_from_slice(&v6.gateway);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_survives_the_trip_and_damage_is_refused() {
        let conf = NetConf {
            mtu: 65520,
            v4: Some(V4 {
                addr: [10, 0, 0, 2],
                prefix: 24,
                gateway: [10, 0, 0, 1],
            }),
            v6: Some(V6 {
                addr: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
                prefix: 64,
                gateway: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            }),
            resolv_conf: b"nameserver 10.0.0.53\n",
        };
        let mut p = conf.header().to_vec();
        p.extend_from_slice(conf.resolv_conf);
        assert_eq!(NetConf::decode(&p), Some(conf));
        let only6 = NetConf { v4: None, ..conf };
        let h = only6.header();
        assert_eq!(NetConf::decode(&h).unwrap().v4, None);
        assert_eq!(NetConf::decode(&h).unwrap().v6, conf.v6);
        assert_eq!(NetConf::decode(&p[..HEADER_LEN - 1]), None);
        p[9] = 33;
        assert_eq!(NetConf::decode(&p), None);
    }
}
