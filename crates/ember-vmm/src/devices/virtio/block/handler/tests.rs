use super::*;
use crate::devices::virtio::block::io::EngineKind;
use crate::devices::virtio::block::request::MAX_SEGMENTS;
use crate::devices::virtio::block::test_rig::*;
use crate::devices::virtio::test_utils::*;
use std::time::{Duration, Instant};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::virtio_ring::{
    VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};

#[test]
fn reads_sectors_into_guest_buffers() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_IN, 3);
        add_chain(
            &vq,
            0,
            &[r(HDR, 16), w(DATA, 512), w(DATA + 512, 512), w(STATUS, 1)],
        );
        let mut h = rig.handler(&vq, kind, false);
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(byte(&rig.mem, DATA), 3);
        assert_eq!(byte(&rig.mem, DATA + 1023), 4);
        assert_eq!(used(&vq), [(0, 1025)]);
        assert_eq!(rig.irq.count(), 1);
    });
}

#[test]
fn writes_reach_the_file_only_before_acknowledgement() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_OUT, 1);
        rig.mem
            .write_slice(&[0x5a; 1024], GuestAddress(DATA))
            .unwrap();
        add_chain(&vq, 0, &[r(HDR, 16), r(DATA, 1024), w(STATUS, 1)]);
        let mut h = rig.handler(&vq, kind, false);
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(used(&vq), [(0, 1)]);
        let c = rig.file.contents();
        assert!(c[512..1536].iter().all(|&b| b == 0x5a));
        assert_eq!(c[511], 0);
        assert_eq!(c[1536], 3);
    });
}

#[test]
fn a_batch_raises_one_interrupt_and_flush_follows_writes() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        for i in 0..4u64 {
            let hdr = HDR + i * 16;
            rig.header(hdr, VIRTIO_BLK_T_OUT, i);
            add_chain(
                &vq,
                (i * 3) as u16,
                &[r(hdr, 16), r(DATA, 512), w(STATUS + i, 1)],
            );
        }
        rig.header(HDR + 0x100, VIRTIO_BLK_T_FLUSH, 0);
        add_chain(&vq, 12, &[r(HDR + 0x100, 16), w(STATUS + 8, 1)]);
        rig.mem.write_slice(&[7; 512], GuestAddress(DATA)).unwrap();
        let mut h = rig.handler(&vq, kind, false);
        run_all(&mut h);
        let u = used(&vq);
        assert_eq!(u.len(), 5);
        // The flush is drained behind the writes, so it is acknowledged last.
        assert_eq!(u.last().unwrap().0, 12);
        // Synchronous completions all land in one batch. io_uring's land as
        // the kernel finishes them: one reap may find them all, or (on a
        // loaded host, with the writes punted to kernel workers) each its
        // own; still never more than one interrupt per request.
        match kind {
            EngineKind::Sync => assert_eq!(rig.irq.count(), 1, "one interrupt per batch"),
            _ => assert!((1..=5).contains(&rig.irq.count()), "{}", rig.irq.count()),
        }
        for i in 0..4 {
            assert_eq!(byte(&rig.mem, STATUS + i), 0);
        }
        assert_eq!(byte(&rig.mem, STATUS + 8), 0);
        assert!(rig.file.contents()[..2048].iter().all(|&b| b == 7));
    });
}

#[test]
fn get_id_discard_and_write_zeroes() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_GET_ID, 0);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 20), w(STATUS, 1)]);
        let mut h = rig.handler(&vq, kind, false);
        run_all(&mut h);
        let mut id = [0u8; 20];
        rig.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..6], b"disk0\0");
        assert_eq!(used(&vq), [(0, 21)]);

        for (i, (t, sector)) in [
            (VIRTIO_BLK_T_WRITE_ZEROES, 8u64),
            (VIRTIO_BLK_T_DISCARD, 16),
        ]
        .into_iter()
        .enumerate()
        {
            let hdr = HDR + 0x40 * (i as u64 + 1);
            let seg = DATA + 0x100 * (i as u64 + 1);
            rig.header(hdr, t, 0);
            rig.mem.write_obj(sector, GuestAddress(seg)).unwrap();
            rig.mem.write_obj(8u32, GuestAddress(seg + 8)).unwrap();
            rig.mem.write_obj(0u32, GuestAddress(seg + 12)).unwrap();
            add_chain(
                &vq,
                3 + 3 * i as u16,
                &[r(hdr, 16), r(seg, 16), w(STATUS, 1)],
            );
            run_all(&mut h);
            assert_eq!(rig.status(), 0, "type {t}");
        }
        let c = rig.file.contents();
        assert_eq!(c.len() as u64, DISK_SECTORS * 512, "size kept");
        assert!(c[8 * 512..24 * 512].iter().all(|&b| b == 0));
        assert_eq!(c[7 * 512], 7);
        assert_eq!(c[24 * 512], 24);
    });
}

#[test]
fn read_only_disks_refuse_writes_and_leave_the_file_identical() {
    both_engines(|kind| {
        let rig = Rig::new();
        let before = rig.file.contents();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        rig.header(HDR, VIRTIO_BLK_T_OUT, 0);
        add_chain(&vq, 0, &[r(HDR, 16), r(DATA, 512), w(STATUS, 1)]);
        rig.header(HDR + 16, VIRTIO_BLK_T_DISCARD, 0);
        add_chain(&vq, 3, &[r(HDR + 16, 16), r(DATA, 16), w(STATUS + 1, 1)]);
        rig.header(HDR + 32, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        add_chain(&vq, 6, &[r(HDR + 32, 16), r(DATA, 16), w(STATUS + 2, 1)]);
        let mut h = rig.handler(&vq, kind, true);
        rig.mem.write_slice(&[0; 16], GuestAddress(DATA)).unwrap();
        rig.mem.write_obj(1u32, GuestAddress(DATA + 8)).unwrap();
        run_all(&mut h);
        for i in 0..3 {
            assert_eq!(byte(&rig.mem, STATUS + i), VIRTIO_BLK_S_IOERR as u8);
        }
        assert_eq!(used(&vq).len(), 3);
        assert_eq!(rig.file.contents(), before);
    });
}

#[test]
fn bad_requests_get_error_statuses() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    let cases: [(u32, u64, Vec<Seg>, u32); 7] = [
        // Past the end of the disk.
        (
            VIRTIO_BLK_T_IN,
            DISK_SECTORS,
            vec![r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            VIRTIO_BLK_S_IOERR,
        ),
        // Sector arithmetic overflowing.
        (
            VIRTIO_BLK_T_IN,
            u64::MAX,
            vec![r(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            VIRTIO_BLK_S_IOERR,
        ),
        // Not a whole sector.
        (
            VIRTIO_BLK_T_OUT,
            0,
            vec![r(HDR, 16), r(DATA, 100), w(STATUS, 1)],
            VIRTIO_BLK_S_IOERR,
        ),
        // Unknown type.
        (99, 0, vec![r(HDR, 16), w(STATUS, 1)], VIRTIO_BLK_S_UNSUPP),
        // Header in a device-writable buffer.
        (
            VIRTIO_BLK_T_IN,
            0,
            vec![w(HDR, 16), w(DATA, 512), w(STATUS, 1)],
            VIRTIO_BLK_S_IOERR,
        ),
        // Data outside guest memory.
        (
            VIRTIO_BLK_T_IN,
            0,
            vec![r(HDR, 16), w(1 << 40, 512), w(STATUS, 1)],
            VIRTIO_BLK_S_IOERR,
        ),
        // Readable after writable.
        (
            VIRTIO_BLK_T_OUT,
            0,
            vec![r(HDR, 16), w(DATA, 512), r(DATA, 512), w(STATUS, 1)],
            VIRTIO_BLK_S_IOERR,
        ),
    ];
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    for (i, (t, sector, segs, want)) in cases.iter().enumerate() {
        rig.header(HDR, *t, *sector);
        add_chain(&vq, 0, segs);
        run_all(&mut h);
        assert_eq!(u32::from(rig.status()), *want, "case {i}");
        assert_eq!(used(&vq).len(), i + 1, "case {i} returned");
    }
    assert!(!rig.virq.needs_reset());
    assert_eq!(rig.file.contents()[0], 0, "nothing written");
}

#[test]
fn chains_without_a_writable_status_are_dropped_with_needs_reset() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    rig.header(HDR, VIRTIO_BLK_T_IN, 0);
    // Status byte device-readable.
    add_chain(&vq, 0, &[r(HDR, 16), r(STATUS, 1)]);
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    run_all(&mut h);
    assert_eq!(rig.status(), 0xff, "nothing written");
    assert!(rig.virq.needs_reset());
    assert_eq!(used(&vq), [(0, 0)], "the chain is still returned");
}

#[test]
fn looping_and_overlong_chains_do_not_hang() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    rig.header(HDR, VIRTIO_BLK_T_IN, 0);
    let next = VRING_DESC_F_NEXT as u16;
    let wr = VRING_DESC_F_WRITE as u16;
    // 0 -> 1 -> 2 -> 1 -> ...
    put_desc(&vq, 0, HDR, 16, next, 1);
    put_desc(&vq, 1, DATA, 512, next | wr, 2);
    put_desc(&vq, 2, STATUS, 1, next | wr, 1);
    publish(&vq, QSIZE, 0);
    // Next index beyond the table.
    put_desc(&vq, 5, HDR, 16, next, 200);
    publish(&vq, QSIZE, 5);
    // Head index beyond the table.
    publish(&vq, QSIZE, 900);
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    run_all(&mut h);
    assert!(rig.virq.needs_reset());
    // The first two come back; the bogus head cannot be put in the used ring.
    assert_eq!(used(&vq), [(0, 0), (5, 0)]);
}

#[test]
fn an_avail_index_far_ahead_breaks_the_queue_not_the_vmm() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    vq.set_avail_idx(QSIZE + 5);
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    assert!(!h.process_queue());
    assert!(rig.virq.needs_reset());
    assert!(used(&vq).is_empty());
    assert!(!h.process_queue(), "stays broken until reset");
}

#[test]
fn one_wakeup_takes_at_most_a_queue_worth() {
    let rig = Rig::new();
    let vq = rig.queue_full_of_one_flush();
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    assert!(h.process_queue(), "a full ring may have more");
    h.drain();
    assert_eq!(vq.used_idx(), QSIZE);
    assert!(!h.process_queue());
}

#[test]
fn indirect_chains_are_followed() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    rig.header(HDR, VIRTIO_BLK_T_IN, 2);
    let table = DATA_START + 0x8000;
    let descs = [
        (HDR, 16, VRING_DESC_F_NEXT),
        (DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE),
        (STATUS, 1, VRING_DESC_F_WRITE),
    ];
    for (i, (a, l, f)) in descs.into_iter().enumerate() {
        let d = virtio_queue::desc::split::Descriptor::new(a, l, f as u16, i as u16 + 1);
        rig.mem
            .write_obj(d, GuestAddress(table + 16 * i as u64))
            .unwrap();
    }
    put_desc(
        &vq,
        0,
        table,
        48,
        virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16,
        0,
    );
    publish(&vq, QSIZE, 0);
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    run_all(&mut h);
    assert_eq!(rig.status(), 0);
    assert_eq!(byte(&rig.mem, DATA), 2);
}

/// A batch of unaligned O_DIRECT requests bigger than the bounce budget: every one is
/// served, but never more bounce memory at once than the budget.
#[test]
fn direct_io_bounce_memory_stays_within_the_budget() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    let mut h = rig.direct_handler(&vq, EngineKind::IoUring);
    h.set_bounce_budget(2048);
    // Five unaligned 1 KiB writes, all available at once: 5 KiB if all bounced together.
    for i in 0..5u64 {
        let at = DATA + i * 0x400 + 1;
        let hdr = HDR + i * 16;
        let status = STATUS + i;
        rig.mem
            .write_obj(VIRTIO_BLK_T_OUT, GuestAddress(hdr))
            .unwrap();
        rig.mem.write_obj(i * 2, GuestAddress(hdr + 8)).unwrap();
        rig.mem
            .write_slice(&[i as u8 + 1; 1024], GuestAddress(at))
            .unwrap();
        add_chain(
            &vq,
            (i * 3) as u16,
            &[r(hdr, 16), r(at, 1024), w(status, 1)],
        );
    }
    run_all(&mut h);
    for i in 0..5u64 {
        assert_eq!(byte(&rig.mem, STATUS + i), 0, "request {i}");
        let at = (i * 2 * 512) as usize;
        assert!(
            rig.file.contents()[at..at + 1024]
                .iter()
                .all(|&b| b == i as u8 + 1)
        );
    }
    assert!(h.peak_bounced() > 0);
    assert!(h.peak_bounced() <= 2048, "peak {}", h.peak_bounced());
}

#[test]
fn direct_io_bounces_unaligned_guest_buffers() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    let mut h = rig.direct_handler(&vq, EngineKind::IoUring);
    // Write from an odd address, then read back into another odd address.
    rig.header(HDR, VIRTIO_BLK_T_OUT, 4);
    rig.mem
        .write_slice(&[0x33; 512], GuestAddress(DATA + 3))
        .unwrap();
    add_chain(
        &vq,
        0,
        &[
            r(HDR, 16),
            r(DATA + 3, 300),
            r(DATA + 303, 212),
            w(STATUS, 1),
        ],
    );
    run_all(&mut h);
    assert_eq!(rig.status(), 0);
    assert!(rig.file.contents()[2048..2560].iter().all(|&b| b == 0x33));
    rig.header(HDR, VIRTIO_BLK_T_IN, 4);
    add_chain(&vq, 4, &[r(HDR, 16), w(DATA + 0x801, 512), w(STATUS, 1)]);
    run_all(&mut h);
    assert_eq!(rig.status(), 0);
    assert_eq!(byte(&rig.mem, DATA + 0x801), 0x33);
    assert_eq!(byte(&rig.mem, DATA + 0x800 + 512), 0x33);
}

#[test]
fn a_chain_at_the_segment_cap_is_served_and_one_past_it_fails_alone() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.handler(&vq, kind, false);
        // Only an indirect table can carry this many descriptors.
        let table = DATA_START + 0x2_0000;
        let mut h_chain = |head, sector, data: &[Seg]| {
            rig.header(HDR, VIRTIO_BLK_T_IN, sector);
            let mut segs = vec![r(HDR, 16)];
            segs.extend_from_slice(data);
            segs.push(w(STATUS, 1));
            add_indirect_chain(&vq, head, table, &segs);
            run_all(&mut h);
        };
        // At the cap: one sector in 2-byte pieces.
        let pieces: Vec<Seg> = (0..MAX_SEGMENTS as u64)
            .map(|i| w(DATA + 2 * i, 2))
            .collect();
        assert_eq!(pieces.len() * 2, 512);
        h_chain(0, 3, &pieces);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        let mut got = [0u8; 512];
        rig.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got.iter().all(|&b| b == 3));
        assert_eq!(used(&vq), [(0, 513)]);

        // One past: still whole sectors, so only the count is wrong.
        rig.mem
            .write_slice(&[0xee; 1024], GuestAddress(DATA))
            .unwrap();
        let mut pieces = pieces;
        pieces.push(w(DATA + 512, 512));
        h_chain(1, 5, &pieces);
        assert_eq!(rig.status(), VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(used(&vq)[1], (1, 1));
        let mut got = [0u8; 1024];
        rig.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got.iter().all(|&b| b == 0xee), "nothing read");
        assert!(!rig.virq.needs_reset());

        // The device goes on.
        rig.header(HDR, VIRTIO_BLK_T_IN, 7);
        add_chain(&vq, 2, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(byte(&rig.mem, DATA), 7);
        assert_eq!(used(&vq).len(), 3);
    });
}

#[test]
fn slot_buffers_carry_nothing_over_to_the_next_request() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.handler(&vq, kind, false);
        // Two sectors into two buffers, then one sector into one: the second request
        // gets the same slot and must use one iovec, not the first's two.
        rig.header(HDR, VIRTIO_BLK_T_IN, 3);
        add_chain(
            &vq,
            0,
            &[r(HDR, 16), w(DATA, 256), w(DATA + 0x400, 768), w(STATUS, 1)],
        );
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(byte(&rig.mem, DATA + 0x400 + 767), 4);
        rig.mem
            .write_slice(&[0xee; 0x800], GuestAddress(DATA))
            .unwrap();
        rig.header(HDR, VIRTIO_BLK_T_IN, 9);
        add_chain(&vq, 4, &[r(HDR, 16), w(DATA + 0x1000, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
        assert_eq!(h.slots.len(), 1, "the slot was reused");
        assert_eq!(byte(&rig.mem, DATA + 0x1000), 9);
        assert_eq!(byte(&rig.mem, DATA + 0x1000 + 511), 9);
        let mut old = [0u8; 0x800];
        rig.mem.read_slice(&mut old, GuestAddress(DATA)).unwrap();
        assert!(old.iter().all(|&b| b == 0xee), "old buffers untouched");
        assert_eq!(used(&vq), [(0, 1025), (4, 513)]);
    });

    // O_DIRECT: a bounced read leaves copy-back segments in its slot; an aligned read
    // in the same slot must not copy anything to them.
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    let mut h = rig.direct_handler(&vq, EngineKind::IoUring);
    rig.header(HDR, VIRTIO_BLK_T_IN, 4);
    add_chain(&vq, 0, &[r(HDR, 16), w(DATA + 1, 512), w(STATUS, 1)]);
    run_all(&mut h);
    assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
    assert_eq!(byte(&rig.mem, DATA + 512), 4);
    rig.mem
        .write_slice(&[0xee; 0x400], GuestAddress(DATA))
        .unwrap();
    rig.header(HDR, VIRTIO_BLK_T_IN, 6);
    add_chain(&vq, 3, &[r(HDR, 16), w(DATA + 0x1000, 512), w(STATUS, 1)]);
    run_all(&mut h);
    assert_eq!(rig.status(), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.slots.len(), 1, "the slot was reused");
    assert_eq!(byte(&rig.mem, DATA + 0x1000), 6);
    let mut old = [0u8; 0x400];
    rig.mem.read_slice(&mut old, GuestAddress(DATA)).unwrap();
    assert!(old.iter().all(|&b| b == 0xee), "no stale copy-back");
}

#[test]
fn steady_state_requests_allocate_nothing() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.handler(&vq, kind, false);
        // Eight requests in flight at once, each in three descriptors or more.
        let reads: Vec<u16> = (0..8).map(|i| i * 2).collect();
        for (i, &head) in reads.iter().enumerate() {
            let i = i as u64;
            let hdr = HDR + 16 * i;
            let buf = DATA + 0x200 * i;
            rig.header(hdr, VIRTIO_BLK_T_IN, i);
            let data = [w(buf, 100), w(buf + 100, 412)];
            let table = DATA_START + 0x2_0000 + 0x100 * i;
            add_indirect_chain(
                &vq,
                head,
                table,
                &[r(hdr, 16), data[0], data[1], w(STATUS + i, 1)],
            );
        }
        // Mixed work for the measured rounds: writes, a flush, a discard and GET_ID.
        let mixed: Vec<u16> = (0..8).map(|i| i * 2 + 1).collect();
        let mixed_hdr = HDR + 0x200;
        for (i, &head) in mixed.iter().enumerate() {
            let i = i as u64;
            let hdr = mixed_hdr + 16 * i;
            let buf = DATA + 0x200 * i;
            let table = DATA_START + 0x3_0000 + 0x100 * i;
            let status = w(STATUS + 16 + i, 1);
            let segs = match i {
                0 => {
                    rig.mem
                        .write_obj(VIRTIO_BLK_T_FLUSH, GuestAddress(hdr))
                        .unwrap();
                    vec![r(hdr, 16), status]
                }
                1 => {
                    rig.mem
                        .write_obj(VIRTIO_BLK_T_GET_ID, GuestAddress(hdr))
                        .unwrap();
                    vec![r(hdr, 16), w(buf, 20), status]
                }
                2 => {
                    let seg = DATA_START + 0x4_0000;
                    rig.mem
                        .write_obj(VIRTIO_BLK_T_DISCARD, GuestAddress(hdr))
                        .unwrap();
                    rig.mem.write_obj(32u64, GuestAddress(seg)).unwrap();
                    rig.mem.write_obj(8u32, GuestAddress(seg + 8)).unwrap();
                    rig.mem.write_obj(0u32, GuestAddress(seg + 12)).unwrap();
                    vec![r(hdr, 16), r(seg, 16), status]
                }
                _ => {
                    rig.mem
                        .write_obj(VIRTIO_BLK_T_OUT, GuestAddress(hdr))
                        .unwrap();
                    rig.mem.write_obj(40 + i, GuestAddress(hdr + 8)).unwrap();
                    vec![r(hdr, 16), r(buf, 300), r(buf + 300, 212), status]
                }
            };
            add_indirect_chain(&vq, head, table, &segs);
        }
        // Warm-up: the helpers published every request once; then the reads twice over,
        // so that every slot has held a two-iovec request, whichever slot a request
        // lands in later.
        run_all(&mut h);
        for &head in reads.iter().chain(&reads) {
            publish(&vq, QSIZE, head);
        }
        run_all(&mut h);
        assert_eq!(vq.used_idx(), 32);
        let mut allocated = 0;
        for round in 0..20 {
            let heads = if round % 2 == 0 { &reads } else { &mixed };
            for &head in heads {
                publish(&vq, QSIZE, head);
            }
            let before = allocations();
            run_all(&mut h);
            allocated += allocations() - before;
        }
        assert_eq!(vq.used_idx(), 32 + 20 * 8);
        assert!(!rig.virq.needs_reset());
        for i in 0..8 {
            assert_eq!(byte(&rig.mem, STATUS + i), 0, "read {i}");
            assert_eq!(byte(&rig.mem, STATUS + 16 + i), 0, "mixed {i}");
        }
        assert_eq!(
            allocated, 0,
            "{kind:?}: heap allocations while serving requests"
        );
    });
}

#[test]
fn no_interrupt_flag_is_honoured() {
    both_engines(|kind| {
        let rig = Rig::new();
        let vq = TestQueue::new(&rig.mem, QSIZE);
        let mut h = rig.handler(&vq, kind, false);
        // A polling driver: no interrupts, please.
        vq.set_avail_flags(VRING_AVAIL_F_NO_INTERRUPT as u16);
        rig.header(HDR, VIRTIO_BLK_T_IN, 1);
        add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(used(&vq), [(0, 513)], "completed all the same");
        assert_eq!(rig.irq.count(), 0, "no interrupt with NO_INTERRUPT set");
        // The driver wants them again.
        vq.set_avail_flags(0);
        rig.header(HDR, VIRTIO_BLK_T_IN, 2);
        add_chain(&vq, 3, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
        run_all(&mut h);
        assert_eq!(used(&vq).len(), 2);
        assert_eq!(rig.irq.count(), 1);
    });
}

#[test]
fn polling_sets_no_notify_and_clears_it_after() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    assert_eq!(vq.used_flags(), 0);
    h.suppress_notifications();
    assert_eq!(vq.used_flags(), VRING_USED_F_NO_NOTIFY as u16);
    assert!(!h.has_work());
    assert!(!h.resume_notifications(), "nothing arrived");
    assert_eq!(vq.used_flags(), 0);
}

#[test]
fn a_request_published_as_polling_ends_is_not_lost() {
    let rig = Rig::new();
    let vq = TestQueue::new(&rig.mem, QSIZE);
    let mut h = rig.handler(&vq, EngineKind::Sync, false);
    h.suppress_notifications();
    assert!(!h.has_work());
    // The driver publishes while the flag is still set, so it does not notify; the
    // device gives up polling right after.
    rig.header(HDR, VIRTIO_BLK_T_IN, 5);
    add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
    assert!(
        h.resume_notifications(),
        "the late request must be reported"
    );
    assert_eq!(vq.used_flags(), 0);
    h.process_queue();
    assert_eq!(used(&vq), [(0, 513)]);
    assert_eq!(byte(&rig.mem, DATA), 5);
    assert!(!h.resume_notifications());
}

#[test]
fn has_work_sees_requests_only_with_room_and_io_uring_completions() {
    let rig = Rig::new();
    let vq = rig.queue_full_of_one_flush();
    let mut h = rig.hold_handler(&vq);
    assert!(h.has_work());
    h.process_queue();
    publish(&vq, QSIZE, 0);
    assert!(
        !h.has_work(),
        "a full queue in flight: nothing can be taken"
    );
    h.drain();
    assert!(h.has_work(), "room again");

    // io_uring: a finished request is work before anyone reaps it.
    let vq = TestQueue::create(&rig.mem, GuestAddress(0x8_0000), QSIZE);
    let mut h = rig.handler(&vq, EngineKind::IoUring, false);
    rig.header(HDR, VIRTIO_BLK_T_IN, 1);
    add_chain(&vq, 0, &[r(HDR, 16), w(DATA, 512), w(STATUS, 1)]);
    h.process_queue();
    let start = Instant::now();
    while vq.used_idx() == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "never completed");
        if h.has_work() {
            h.process_completions();
        }
    }
    assert!(!h.has_work());
    assert_eq!(used(&vq), [(0, 513)]);
}

#[test]
fn in_flight_work_is_capped_at_the_queue_size() {
    let rig = Rig::new();
    let vq = rig.queue_full_of_one_flush();
    let mut h = rig.hold_handler(&vq);
    assert!(h.process_queue());
    assert_eq!(h.in_flight(), usize::from(QSIZE));
    for _ in 0..QSIZE {
        publish(&vq, QSIZE, 0);
    }
    assert!(!h.process_queue(), "no room: nothing taken");
    assert!(h.take_throttled());
    assert_eq!(h.in_flight(), usize::from(QSIZE));
    h.drain();
    assert_eq!(h.in_flight(), 0);
    assert_eq!(vq.used_idx(), QSIZE);
    assert!(h.process_queue());
    h.drain();
    assert_eq!(vq.used_idx(), 2 * QSIZE);
}
