//! Networking with Debian's own virtio_net on ember's virtio-net, between
//! the L2 and taps in the L1 (the L1 has no other network): eth0 up, ping
//! and TCP both ways over IPv4 and IPv6 checked byte for byte, then a
//! snapshot restored onto another tap and MAC, the guest seeing the link
//! change and passing traffic again.

use crate::case::Case;
use crate::rig::rig;

/// The device's feature bits Debian's driver must have taken (the sysfs
/// string is bit 0 first).
const FEATURES: &[(usize, &str)] = &[
    (0, "CSUM"),
    (1, "GUEST_CSUM"),
    (5, "MAC"),
    (7, "GUEST_TSO4"),
    (8, "GUEST_TSO6"),
    (11, "HOST_TSO4"),
    (12, "HOST_TSO6"),
    (15, "MRG_RXBUF"),
    (16, "STATUS"),
];

/// A checksum fact, which must be a whole md5. Its first 32 characters: the
/// L2's console line can run into the next output (CI saw
/// `@net-down6r-md5 91d4…5ca5a0end`), and what follows is not the sum.
fn md5<'a>(c: &'a Case, key: &str) -> &'a str {
    let m = c.fact(key).unwrap_or("");
    let m = m
        .get(..32)
        .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or(m);
    assert_eq!(m.len(), 32, "@{key} is an md5\n{}", c.dump());
    m
}

/// What the sender and the receiver of transfer `tag` saw agree.
fn same_bytes(c: &Case, tag: &str, guest_sends: bool) {
    let (sent, got) = if guest_sends {
        (format!("net-{tag}-md5"), format!("net-host-{tag}-md5"))
    } else {
        (format!("net-host-{tag}-src-md5"), format!("net-{tag}-md5"))
    };
    assert_eq!(
        md5(c, &got),
        md5(c, &sent),
        "transfer {tag}: what arrived is what was sent\n{}",
        c.dump()
    );
}

#[test]
fn debians_virtio_net_moves_tcp_both_ways_over_ipv4_and_ipv6_and_after_a_restore_onto_another_tap_and_mac()
 {
    let c = rig().case("net");
    let failed = c.facts("insmod-failed");
    assert!(
        failed.is_empty(),
        "modules failed: {failed:?}\n{}",
        c.dump()
    );
    for l in c.facts("net-addr") {
        eprintln!("nested rig: net: L2 ip addr| {l}");
    }
    for l in c.facts("net-addr-restored") {
        eprintln!("nested rig: net: L2 ip addr after the restore| {l}");
    }
    let features = c.fact("net-features").unwrap_or("");
    eprintln!("nested rig: net: L2 virtio-net features {features}");
    for &(bit, name) in FEATURES {
        assert_eq!(
            features.as_bytes().get(bit),
            Some(&b'1'),
            "{name} negotiated\n{}",
            c.dump()
        );
    }
    let addr = c.facts("net-addr").join("\n");
    for want in [
        "link/ether 02:00:00:00:00:01",
        "inet 10.0.2.2/24",
        "inet6 fd00:2::2/64",
        "LOWER_UP",
    ] {
        assert!(addr.contains(want), "eth0 has `{want}`\n{}", c.dump());
    }
    let ethtool = c.facts("net-ethtool");
    for l in &ethtool {
        eprintln!("nested rig: net: L2 ethtool -k eth0| {l}");
    }
    for on in [
        "rx-checksumming: on",
        "tx-checksumming: on",
        "scatter-gather: on",
        "tcp-segmentation-offload: on",
        "tx-tcp-segmentation: on",
        "tx-tcp6-segmentation: on",
        "generic-receive-offload: on",
    ] {
        assert!(
            ethtool.iter().any(|l| l.starts_with(on)),
            "ethtool -k eth0 shows `{on}`\n{}",
            c.dump()
        );
    }
    for fact in ["net-ping", "net-ping6"] {
        assert_eq!(c.fact(fact), Some("ok"), "{fact}\n{}", c.dump());
    }
    for tag in ["up4", "up6"] {
        assert_eq!(c.fact(&format!("net-{tag}")), Some("sent"), "{}", c.dump());
        same_bytes(c, tag, true);
    }
    for tag in ["down4", "down6"] {
        same_bytes(c, tag, false);
    }
    assert_eq!(
        c.fact("net-snapshot-rc"),
        Some("0 boot-rc=0"),
        "the snapshot ends the VM with status 0\n{}",
        c.dump()
    );

    // The restore, on tap1 with MAC 02:00:00:00:00:02.
    let link = c.fact("net-link").unwrap_or("");
    let changes = link
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("carrier_changes="))
        .and_then(|v| v.split_once("->"))
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)));
    assert!(
        changes.is_some_and(|(before, after)| after > before) && link.contains("carrier=1"),
        "the guest saw its link go down and up: {link}\n{}",
        c.dump()
    );
    assert!(
        c.facts("net-addr-restored")
            .iter()
            .any(|l| l.contains("link/ether 02:00:00:00:00:02")),
        "{}",
        c.dump()
    );
    for fact in ["net-ping-restored", "net-ping6-restored"] {
        assert_eq!(c.fact(fact), Some("ok"), "{fact}\n{}", c.dump());
    }
    assert_eq!(c.fact("net-up4r"), Some("sent"), "{}", c.dump());
    same_bytes(c, "up4r", true);
    same_bytes(c, "down6r", false);
    // The L1 reached the guest at its new MAC, on the new tap.
    let neigh = c.fact("net-host-neigh").unwrap_or("");
    assert!(
        neigh.contains("lladdr 02:00:00:00:00:02"),
        "tap1's neighbour is the new MAC: {neigh}\n{}",
        c.dump()
    );
    assert_eq!(c.fact("net-restore-rc"), Some("0"), "{}", c.dump());
    assert_eq!(c.rc, Some(0), "the case's status\n{}", c.dump());
}
