//! `--net`: what the user configures of a network device, and its one grammar.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::Error;
use super::rate_limiter::{BucketConfig, RateLimit};

/// An Ethernet address, written `aa:bb:cc:dd:ee:ff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// A random locally administered unicast address (for a device given none, so that
    /// a snapshot records the one its guest saw).
    pub fn random() -> Self {
        let mut b = [0u8; 6];
        // A failure leaves zeros: still a valid address once the bits below are set.
        let _ = crate::devices::virtio::rng::getrandom(&mut b);
        b[0] = (b[0] & !0x01) | 0x02;
        MacAddr(b)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl FromStr for MacAddr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::BadMac(s.to_owned());
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 {
                return Err(bad());
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        // A multicast address cannot be a station's.
        if out[0] & 1 != 0 {
            return Err(bad());
        }
        Ok(MacAddr(out))
    }
}

impl Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Where the device's frames go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum NetBackendConfig {
    /// An existing tap interface, opened by name (`tap=NAME`).
    Tap(String),
    /// A tap the caller opened and passed down as this descriptor (`fd=N`), as
    /// orchestrators do.
    Fd(i32),
    /// A connected stream socket the caller passed down (`socket=N`) with QEMU's
    /// stream-netdev framing, as passt speaks it (`passt --fd`): user-mode
    /// networking, no offloads.
    Socket(i32),
    /// User-mode networking through a passt that ember boot starts (`passt`): it
    /// becomes a [`Socket`](Self::Socket) before the device is made.
    Passt,
}

impl fmt::Display for NetBackendConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetBackendConfig::Tap(n) => write!(f, "tap {n}"),
            NetBackendConfig::Fd(fd) => write!(f, "tap descriptor {fd}"),
            NetBackendConfig::Socket(fd) => write!(f, "socket descriptor {fd}"),
            NetBackendConfig::Passt => f.write_str("passt"),
        }
    }
}

/// A network device as the user configures it:
/// `--net tap=NAME|fd=N[,mac=MAC][,mtu=N][,rx_bytes=…][,rx_ops=…][,tx_bytes=…][,tx_ops=…]`
/// (see [`crate::machine`] for the one-type rule). A rate is
/// `SIZE[/MS][+BURST]`: a bucket of SIZE tokens (bytes or frames) refilled over MS
/// milliseconds (1000 unless given), with a one-time BURST on top, as Firecracker's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Where frames go.
    pub backend: NetBackendConfig,
    /// The guest's address; a random local one when not given (the builder fixes it,
    /// so a snapshot records what the guest saw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<MacAddr>,
    /// The MTU offered to the guest (`VIRTIO_NET_F_MTU`), when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u16>,
    /// Limits on what the guest receives.
    #[serde(default, skip_serializing_if = "RateLimit::is_none")]
    pub rx_rate: RateLimit,
    /// Limits on what the guest sends.
    #[serde(default, skip_serializing_if = "RateLimit::is_none")]
    pub tx_rate: RateLimit,
}

/// The smallest MTU a guest may be offered (IPv4's minimum) and the largest (a
/// 64 KiB frame less its Ethernet header).
pub(crate) const MIN_MTU: u16 = 68;
pub(crate) const MAX_MTU: u16 = 65_521;

impl NetConfig {
    /// A device on tap `name` with every option at its default.
    pub fn tap(name: impl Into<String>) -> Self {
        NetConfig {
            backend: NetBackendConfig::Tap(name.into()),
            mac: None,
            mtu: None,
            rx_rate: RateLimit::default(),
            tx_rate: RateLimit::default(),
        }
    }

    /// Checks what the grammar checks, for a configuration that did not come through it.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        match &self.backend {
            NetBackendConfig::Tap(n) if n.is_empty() || n.len() >= libc::IFNAMSIZ => {
                return Err(Error::BadTapName(n.clone()));
            }
            NetBackendConfig::Fd(fd) | NetBackendConfig::Socket(fd) if *fd < 0 => {
                return Err(Error::BadFd(fd.to_string()));
            }
            _ => {}
        }
        if let Some(m) = self.mtu.filter(|m| !(MIN_MTU..=MAX_MTU).contains(m)) {
            return Err(Error::BadMtu(m.to_string()));
        }
        for b in [
            &self.rx_rate.bytes,
            &self.rx_rate.ops,
            &self.tx_rate.bytes,
            &self.tx_rate.ops,
        ]
        .into_iter()
        .flatten()
        {
            b.validate()?;
        }
        Ok(())
    }
}

impl FromStr for NetConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let mut backend = None;
        let mut cfg = NetConfig::tap("");
        for opt in s.split(',') {
            if opt == "passt" {
                if backend.replace(NetBackendConfig::Passt).is_some() {
                    return Err(Error::TwoBackends);
                }
                continue;
            }
            let (key, value) = opt
                .split_once('=')
                .ok_or_else(|| Error::UnknownOption(opt.to_owned()))?;
            let set_backend = |b: &mut Option<NetBackendConfig>, v| {
                if b.replace(v).is_some() {
                    Err(Error::TwoBackends)
                } else {
                    Ok(())
                }
            };
            match key {
                "tap" => set_backend(&mut backend, NetBackendConfig::Tap(value.to_owned()))?,
                "fd" => {
                    let fd = value
                        .parse::<i32>()
                        .ok()
                        .filter(|&fd| fd >= 0)
                        .ok_or_else(|| Error::BadFd(value.to_owned()))?;
                    set_backend(&mut backend, NetBackendConfig::Fd(fd))?
                }
                "socket" => {
                    let fd = value
                        .parse::<i32>()
                        .ok()
                        .filter(|&fd| fd >= 0)
                        .ok_or_else(|| Error::BadFd(value.to_owned()))?;
                    set_backend(&mut backend, NetBackendConfig::Socket(fd))?
                }
                "mac" => cfg.mac = Some(value.parse()?),
                "mtu" => {
                    cfg.mtu = Some(value.parse().map_err(|_| Error::BadMtu(value.to_owned()))?)
                }
                "rx_bytes" => cfg.rx_rate.bytes = Some(value.parse()?),
                "rx_ops" => cfg.rx_rate.ops = Some(value.parse()?),
                "tx_bytes" => cfg.tx_rate.bytes = Some(value.parse()?),
                "tx_ops" => cfg.tx_rate.ops = Some(value.parse()?),
                _ => return Err(Error::UnknownOption(opt.to_owned())),
            }
        }
        cfg.backend = backend.ok_or(Error::MissingBackend)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

impl FromStr for BucketConfig {
    type Err = Error;
    /// `SIZE[/MS][+BURST]`, SIZE and BURST with an optional K/M/G suffix (powers of 1024).
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::BadRate(s.to_owned());
        let (rest, burst) = match s.split_once('+') {
            Some((r, b)) => (r, parse_count(b).ok_or_else(bad)?),
            None => (s, 0),
        };
        let (size, refill_ms) = match rest.split_once('/') {
            Some((z, ms)) => (z, ms.parse::<u64>().map_err(|_| bad())?),
            None => (rest, 1000),
        };
        let b = BucketConfig {
            size: parse_count(size).ok_or_else(bad)?,
            one_time_burst: burst,
            refill_ms,
        };
        b.validate()?;
        Ok(b)
    }
}

/// A count with an optional K, M or G suffix (powers of 1024).
fn parse_count(s: &str) -> Option<u64> {
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grammar_takes_a_tap_or_an_fd_and_options() {
        let c: NetConfig = "tap=tap0,mac=02:00:00:00:00:01,mtu=9000,tx_bytes=1M/100+64K"
            .parse()
            .unwrap();
        assert_eq!(c.backend, NetBackendConfig::Tap("tap0".into()));
        assert_eq!(c.mac, Some(MacAddr([2, 0, 0, 0, 0, 1])));
        assert_eq!(c.mtu, Some(9000));
        assert_eq!(
            c.tx_rate.bytes,
            Some(BucketConfig {
                size: 1 << 20,
                refill_ms: 100,
                one_time_burst: 64 << 10
            })
        );
        assert!(c.rx_rate.is_none());
        let c: NetConfig = "socket=5,mac=02:00:00:00:00:02".parse().unwrap();
        assert_eq!(c.backend, NetBackendConfig::Socket(5));
        let c: NetConfig = "passt,mtu=65520".parse().unwrap();
        assert_eq!((c.backend, c.mtu), (NetBackendConfig::Passt, Some(65520)));
        assert!("passt,tap=t".parse::<NetConfig>().is_err());
        let c: NetConfig = "fd=7,rx_ops=1000".parse().unwrap();
        assert_eq!(c.backend, NetBackendConfig::Fd(7));
        assert_eq!(c.rx_rate.ops.unwrap().size, 1000);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<NetConfig>(&json).unwrap(), c);
    }

    #[test]
    fn bad_options_are_refused_with_what_is_wrong() {
        for (bad, why) in [
            ("mac=02:00:00:00:00:01", "tap=NAME or fd=N"),
            ("tap=a,fd=3", "only one of"),
            ("tap=a,mac=02:00:00:00:00", "bad MAC"),
            ("tap=a,mac=01:00:00:00:00:01", "bad MAC"),
            ("tap=a,mac=zz:00:00:00:00:01", "bad MAC"),
            ("fd=-1", "bad descriptor"),
            ("fd=x", "bad descriptor"),
            ("tap=a,mtu=20", "MTU"),
            ("tap=a,tx_bytes=0", "rate"),
            ("tap=a,tx_bytes=1M/0", "rate"),
            ("tap=a,speed=1", "unknown"),
            ("tap=", "interface name"),
            ("tap=abcdefghijklmnopq", "interface name"),
        ] {
            let e = bad.parse::<NetConfig>().unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn a_mac_round_trips_and_a_random_one_is_local_unicast() {
        let m: MacAddr = "0a:1B:2c:3d:4e:5f".parse().unwrap();
        assert_eq!(m.to_string(), "0a:1b:2c:3d:4e:5f");
        let r = MacAddr::random();
        assert_eq!(r.0[0] & 3, 2);
    }
}
