//! The boot with every virtio device, found through ACPI alone and driven
//! by Debian's own modules.

use crate::case::Case;
use crate::rig::rig;

/// The boot with every virtio device; each test below judges one device
/// (so a broken device names itself), this one the boot as a whole.
fn virtio() -> &'static Case {
    rig().case("virtio")
}

#[test]
fn virtio_boot_loads_debians_modules_and_powers_off() {
    let c = virtio();
    let failed = c.facts("insmod-failed");
    assert!(
        failed.is_empty(),
        "modules failed to load: {failed:?}\n{}",
        c.dump()
    );
    assert!(
        c.fact("done").is_some(),
        "the virtio boot did not finish\n{}",
        c.dump()
    );
    assert_eq!(c.fact("cpus"), Some("0-1"), "CPUs online\n{}", c.dump());
    assert_eq!(
        c.rc,
        Some(0),
        "virtio boot: ember's exit status\n{}",
        c.dump()
    );
}

#[test]
fn virtio_devices_are_found_through_acpi_alone() {
    let c = virtio();
    // Debian's kernel lacks VIRTIO_MMIO_CMDLINE_DEVICES: only ember's DSDT
    // can have told virtio_mmio about these. IDs: 2 blk, 4 rng, 5 balloon, 27 pmem.
    let mut ids: Vec<&str> = c.facts("virtio-device");
    ids.sort();
    assert_eq!(
        ids,
        ["0x0002", "0x0002", "0x0004", "0x0005", "0x001b"],
        "virtio devices the guest found\n{}",
        c.dump()
    );
}

#[test]
fn virtio_blk_writes_reach_the_image_and_ro_refuses() {
    let c = virtio();
    let r = rig();
    assert_eq!(
        c.fact("blk-write"),
        Some("ok"),
        "ext4 write+fsync on the data disk\n{}",
        c.dump()
    );
    assert_eq!(c.fact("blk-readback"), Some(r.token.as_str()));
    let host = r.case("virtio-host");
    let copies: u32 = host
        .fact("token-copies")
        .or_else(|| {
            host.out
                .iter()
                .find_map(|l| l.strip_prefix("token-copies="))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        copies >= 1,
        "the guest's write is not in the image file\n{}",
        host.dump()
    );
    assert_eq!(
        c.fact("blk-ro-flag"),
        Some("1"),
        "the ro disk is read-only\n{}",
        c.dump()
    );
    assert_eq!(c.fact("blk-ro-write"), Some("refused"), "{}", c.dump());
    assert_eq!(
        c.fact("blk-ro-marker"),
        Some("rig-ro-marker"),
        "{}",
        c.dump()
    );
    assert!(
        host.out.iter().any(|l| l == "ro-unchanged=yes"),
        "the ro image changed\n{}",
        host.dump()
    );
}

#[test]
fn virtio_rng_feeds_hwrng() {
    let c = virtio();
    assert!(
        c.fact("rng-current")
            .is_some_and(|v| v.starts_with("virtio_rng")),
        "hw_random's current source\n{}",
        c.dump()
    );
    assert_eq!(
        c.fact("rng-bytes"),
        Some("64"),
        "/dev/hwrng read\n{}",
        c.dump()
    );
    let samples = c.facts("rng-sample");
    assert_eq!(samples.len(), 2, "{}", c.dump());
    assert!(samples.iter().all(|s| s.len() == 32), "{samples:?}");
    assert_ne!(samples[0], samples[1], "two reads gave the same bytes");
}

#[test]
fn virtio_pmem_is_an_ext4_root_with_dax() {
    let c = virtio();
    assert_eq!(
        c.fact("pmem-queue-dax"),
        Some("1"),
        "pmem0 supports DAX\n{}",
        c.dump()
    );
    let mount = c.fact("pmem-mount").unwrap_or_default();
    assert!(
        mount.contains("ext4") && mount.contains("dax"),
        "mounted as ext4 with DAX: `{mount}`\n{}",
        c.dump()
    );
    assert_eq!(c.fact("pmem-root"), Some("rig-pmem-root"), "{}", c.dump());
}

#[test]
fn virtio_balloon_binds_with_stats_and_free_page_reporting() {
    let c = virtio();
    let bound = c.fact("balloon-bound").unwrap_or_default();
    let features = bound.split("features=").nth(1).unwrap_or_default();
    // The driver acks bit 1 (stats queue) and bit 5 (free page reporting)
    // only when ember offers them. (Inflate and deflate: the balloon-socket
    // case below.)
    let bit = |n: usize| features.as_bytes().get(n) == Some(&b'1');
    assert!(
        bit(1) && bit(5),
        "balloon features `{features}`\n{}",
        c.dump()
    );
}
