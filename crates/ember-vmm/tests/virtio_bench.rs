//! virtio-blk request throughput, io_uring vs preadv/pwritev, through the real request
//! path (parse, submit, complete into the used ring). A benchmark, not a test: it prints
//! figures and asserts nothing about time.
//!
//! `cargo test --release -p ember-vmm --test virtio_bench -- --ignored --nocapture`

use std::sync::Arc;
use std::time::Instant;

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::VirtioInterrupt;
use ember_vmm::devices::virtio::block::{BlockHandler, DiskParams, EngineKind};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const QSIZE: u16 = 256;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HDRS: u64 = 0x10000;
const STATUS: u64 = 0x20000;
const DATA: u64 = 0x100000;
const BLOCK: u32 = 4096;
const DISK_BYTES: usize = 64 << 20;
const BATCHES: usize = 200;

/// Publishes a full ring of 4 KiB requests (`kind` 0 = read, 1 = write) at pseudo-random
/// offsets, three descriptors each.
fn fill_ring(mem: &GuestMemoryMmap<()>, kind: u32, round: u64, avail_idx: &mut u16) {
    let per_chain = 3u16;
    let chains = QSIZE / per_chain;
    for c in 0..chains {
        let hdr = HDRS + u64::from(c) * 16;
        let sector = ((round * 7919 + u64::from(c) * 104_729) % (DISK_BYTES as u64 / 512 - 8)) & !7;
        mem.write_obj(kind, GuestAddress(hdr)).unwrap();
        mem.write_obj(sector, GuestAddress(hdr + 8)).unwrap();
        let d0 = c * per_chain;
        let descs = [
            (hdr, 16u32, 1u16, d0 + 1),
            (
                DATA + u64::from(c) * u64::from(BLOCK),
                BLOCK,
                1 | if kind == 0 { 2 } else { 0 },
                d0 + 2,
            ),
            (STATUS + u64::from(c), 1, 2, 0),
        ];
        for (i, (addr, len, flags, next)) in descs.into_iter().enumerate() {
            let at = DESC + 16 * u64::from(d0 + i as u16);
            mem.write_obj(addr, GuestAddress(at)).unwrap();
            mem.write_obj(len, GuestAddress(at + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
            mem.write_obj(next, GuestAddress(at + 14)).unwrap();
        }
        let slot = AVAIL + 4 + 2 * u64::from(*avail_idx % QSIZE);
        mem.write_obj(d0, GuestAddress(slot)).unwrap();
        *avail_idx = avail_idx.wrapping_add(1);
    }
    mem.write_obj(*avail_idx, GuestAddress(AVAIL + 2)).unwrap();
}

fn run(engine: EngineKind, kind: u32, path: &std::path::Path, direct: bool) -> Vec<f64> {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
    let mut q = Queue::new(QSIZE).unwrap();
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).write(true);
    if direct {
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut opts, libc::O_DIRECT);
    }
    let file = opts.open(path).unwrap();
    let mut h = BlockHandler::open(
        mem.clone(),
        q,
        VirtioInterrupt::new(Arc::new(CountingInterrupt::default())),
        engine,
        file,
        DiskParams {
            capacity: DISK_BYTES as u64 / 512,
            read_only: false,
            direct,
            serial: [0; 20],
        },
    )
    .unwrap();
    let mut avail_idx = 0u16;
    let mut per_request_us = Vec::with_capacity(BATCHES);
    let chains = f64::from(QSIZE / 3);
    for round in 0..BATCHES as u64 {
        fill_ring(&mem, kind, round, &mut avail_idx);
        let t = Instant::now();
        h.process_queue();
        h.drain();
        per_request_us.push(t.elapsed().as_secs_f64() * 1e6 / chains);
    }
    per_request_us.sort_by(f64::total_cmp);
    per_request_us
}

fn summary(v: &[f64]) -> (f64, f64, f64) {
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn blk_engines_4k_random() {
    let path = ember_testing::TempFile::new("blk-bench", "disk.img");
    std::fs::write(&path, vec![1u8; DISK_BYTES]).unwrap();
    println!(
        "virtio-blk, 4 KiB random requests, {} per batch, {BATCHES} batches",
        QSIZE / 3
    );
    for direct in [false, true] {
        let mode = if direct {
            "O_DIRECT"
        } else {
            "buffered, page cache warm"
        };
        println!("{mode}:");
        for (kind, name) in [(0u32, "read"), (1, "write")] {
            let sync = summary(&run(EngineKind::Sync, kind, &path, direct));
            let uring = summary(&run(EngineKind::IoUring, kind, &path, direct));
            for (engine, (med, min, max)) in [("preadv/pwritev", sync), ("io_uring", uring)] {
                println!(
                    "  {name:5} {engine:14} median {med:7.2} µs/request (min {min:.2}, max {max:.2})"
                );
            }
            println!(
                "  {name:5} io_uring / sync median ratio: {:.2}",
                uring.0 / sync.0
            );
        }
    }
    std::fs::remove_file(path).unwrap();
}
