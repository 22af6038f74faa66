//! virtio-fs between Debian's own `virtiofs` driver in the L2 and a
//! directory of the L1: reading and writing a share byte for byte, a
//! read-only share refusing a write, and a snapshot taken with the shares
//! mounted restoring in a fresh ember and still reading (and writing) them.

use crate::rig::rig;

#[test]
fn debians_virtiofs_reads_writes_and_restores_with_its_share_mounted() {
    let c = rig().case("fs");
    let failed = c.facts("insmod-failed");
    assert!(
        failed.is_empty(),
        "modules failed: {failed:?}\n{}",
        c.dump()
    );
    assert!(c.facts("fs-mount-failed").is_empty(), "{}", c.dump());
    let src = c.fact("fs-h2g-src-md5");
    assert!(src.is_some_and(|m| m.len() == 32), "{}", c.dump());
    assert_eq!(
        c.fact("fs-h2g-md5"),
        src,
        "what the guest read is the host's file\n{}",
        c.dump()
    );
    let wrote = c.fact("fs-g2h-md5");
    assert!(wrote.is_some_and(|m| m.len() == 32), "{}", c.dump());
    assert_eq!(
        c.fact("fs-g2h-host-md5"),
        wrote,
        "what the host finds is what the guest wrote\n{}",
        c.dump()
    );
    assert_eq!(c.fact("fs-before"), Some("from the host"), "{}", c.dump());
    assert!(
        c.fact("fs-ro-refused").is_some() && c.fact("fs-ro-written").is_none(),
        "the read-only share refused the write\n{}",
        c.dump()
    );
    assert_eq!(c.fact("fs-ro-read"), Some("read only"), "{}", c.dump());
    assert_eq!(
        c.fact("fs-snapshot-rc"),
        Some("0 boot-rc 0"),
        "snapshot with the shares mounted\n{}",
        c.dump()
    );
    // After the restore, in a fresh ember.
    assert_eq!(c.fact("fs-again"), Some("from the host"), "{}", c.dump());
    assert_eq!(
        c.fact("fs-after"),
        Some("written while saved"),
        "a file the host made while the guest was saved\n{}",
        c.dump()
    );
    assert_eq!(
        c.fact("fs-held"),
        Some("from the host"),
        "a file held open across the snapshot\n{}",
        c.dump()
    );
    assert_eq!(c.fact("fs-restored-host"), Some("restored"), "{}", c.dump());
    assert_eq!(c.fact("fs-restore-rc"), Some("0"), "{}", c.dump());
    assert_eq!(c.rc, Some(0), "{}", c.dump());
}
