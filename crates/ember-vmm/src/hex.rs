//! KVM structures in a snapshot's state file as hex strings of their bytes
//! (`#[serde(with = "crate::hex")]`).
//!
//! serde's derived form of a KVM structure is a JSON array of numbers (an
//! XSAVE area is 4096 of them, a LAPIC page 1024): decoding them took most
//! of a restore's ~0.3 ms of state parsing. A hex string is one token, and
//! decoding it is a table lookup a byte. The structures' byte layout is
//! KVM's own (kvm-bindings derives zerocopy's traits for them), and a string
//! of the wrong length is refused.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serializer};
use std::borrow::Cow;
use zerocopy::{FromBytes, Immutable, IntoBytes};

fn encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

fn decode(s: &str) -> Option<Vec<u8>> {
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if s.len() % 2 != 0 {
        return None;
    }
    s.as_bytes()
        .chunks_exact(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

fn hex_string<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = Cow::<str>::deserialize(d)?;
    decode(&s).ok_or_else(|| D::Error::custom("not a hex string"))
}

/// One structure (`#[serde(with = "hex")]`).
pub(crate) fn serialize<T: IntoBytes + Immutable, S: Serializer>(
    v: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&encode(v.as_bytes()))
}

/// One structure (`#[serde(with = "hex")]`).
pub(crate) fn deserialize<'de, T: FromBytes, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    let bytes = hex_string(d)?;
    T::read_from_bytes(&bytes).map_err(|_| {
        D::Error::custom(format!(
            "{} bytes where {} are expected",
            bytes.len(),
            std::mem::size_of::<T>()
        ))
    })
}

/// A list of structures, their bytes back to back (`#[serde(with =
/// "hex::vec")]`).
pub(crate) mod vec {
    use super::*;

    /// Serializes the list.
    pub(crate) fn serialize<T: IntoBytes + Immutable, S: Serializer>(
        v: &[T],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(v.as_bytes()))
    }

    /// Deserializes the list; its length must be a whole number of entries.
    pub(crate) fn deserialize<'de, T: FromBytes, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        let bytes = hex_string(d)?;
        let size = std::mem::size_of::<T>();
        if size == 0 || bytes.len() % size != 0 {
            return Err(D::Error::custom(format!(
                "{} bytes are not a whole number of {size}-byte entries",
                bytes.len()
            )));
        }
        bytes
            .chunks_exact(size)
            .map(|c| T::read_from_bytes(c).map_err(|_| D::Error::custom("a bad entry")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::{kvm_cpuid_entry2, kvm_xsave};
    use serde::Serialize;

    #[derive(Serialize, serde::Deserialize)]
    struct S {
        #[serde(with = "super")]
        x: kvm_xsave,
        #[serde(with = "super::vec")]
        c: Vec<kvm_cpuid_entry2>,
    }

    #[test]
    fn round_trip_and_refusals() {
        let mut x = kvm_xsave::default();
        x.region[0] = 0x37f;
        x.region[1023] = 0xdead_beef;
        let c = vec![
            kvm_cpuid_entry2 {
                function: 7,
                ebx: 0xf1bf_2ffb,
                ..Default::default()
            };
            3
        ];
        let s = S { x, c };
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.len() < 8500 + 3 * 80 + 40, "{}", json.len());
        let back: S = serde_json::from_str(&json).unwrap();
        assert_eq!(back.x.as_bytes(), s.x.as_bytes());
        assert_eq!(back.c.as_bytes(), s.c.as_bytes());
        // Odd length, a bad digit, upper case, the wrong size: refused.
        for bad in [
            json.replacen("\"7f03", "\"7f0", 1),
            json.replacen("\"7f03", "\"7g03", 1),
            json.replacen("\"7f03", "\"7F03", 1),
            json.replacen("\"7f03", "\"7f0300", 1),
        ] {
            assert!(serde_json::from_str::<S>(&bad).is_err(), "{}", &bad[..30]);
        }
        let short_list = json.replace(&encode(s.c[2].as_bytes()), "00");
        assert!(serde_json::from_str::<S>(&short_list).is_err());
    }
}
