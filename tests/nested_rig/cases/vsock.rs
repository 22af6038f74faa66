//! vsock both ways between Debian's own vsock transport in the L2 and host
//! programs in the L1 on ember's hybrid vsock sockets, with socat on both
//! sides.

use crate::rig::rig;

#[test]
fn vsock_carries_data_both_ways_between_debians_transport_and_the_host() {
    let c = rig().case("vsock");
    let failed = c.facts("insmod-failed");
    assert!(
        failed.is_empty(),
        "modules failed: {failed:?}\n{}",
        c.dump()
    );
    assert_eq!(
        c.fact("vsock-g2h"),
        Some("sent"),
        "guest to host\n{}",
        c.dump()
    );
    let sent = c.fact("vsock-g2h-md5");
    assert!(sent.is_some_and(|m| m.len() == 32), "{}", c.dump());
    assert_eq!(
        c.fact("vsock-g2h-recv-md5"),
        sent,
        "what reached PATH_5000 is what the guest sent\n{}",
        c.dump()
    );
    assert!(
        c.fact("vsock-ok-line").is_some_and(|l| l
            .strip_prefix("OK ")
            .and_then(|p| p.parse::<u32>().ok())
            .is_some()),
        "CONNECT 1234 answered OK <port>\n{}",
        c.dump()
    );
    let src = c.fact("vsock-h2g-src-md5");
    assert!(src.is_some_and(|m| m.len() == 32), "{}", c.dump());
    assert_eq!(
        c.fact("vsock-h2g-md5"),
        src,
        "what the guest received is what the host sent\n{}",
        c.dump()
    );
    assert_eq!(c.rc, Some(0), "ember's exit status\n{}", c.dump());
}
