//! A hostile guest's virtio-console transmit chains against the real device and its
//! thread, in a 64 MiB guest; prints this process's peak resident memory (VmHWM).
//!
//! ```text
//! cargo run --release -p ember-vmm --example console_flood -- baseline   # no chain: the floor
//! cargo run --release -p ember-vmm --example console_flood -- outside    # one 16-byte descriptor of length 0xFFFFFFFF outside guest memory
//! cargo run --release -p ember-vmm --example console_flood -- big        # 16 descriptors of 60 MiB inside guest memory
//! ```
//!
//! RELIABILITY.md quotes the figures before and after the console streamed its output.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::{ActiveQueue, Console, VirtioDevice, VirtioInterrupt};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const MEM: u64 = 64 << 20;
const SIZE: u16 = 16;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const RX_BASE: u64 = 0x4000;
const NEXT: u16 = 1;

fn queue(base: u64) -> Queue {
    let mut q = Queue::new(SIZE).unwrap();
    q.set_size(SIZE);
    q.set_desc_table_address(Some(base as u32), Some(0));
    q.set_avail_ring_address(Some((base + 0x1000) as u32), Some(0));
    q.set_used_ring_address(Some((base + 0x2000) as u32), Some(0));
    q.set_ready(true);
    q
}

fn vm_hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn main() {
    let case = std::env::args().nth(1).unwrap_or_else(|| "outside".into());
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    // The descriptors of one chain: (address, length).
    let descs: Vec<(u64, u32)> = match case.as_str() {
        "baseline" => vec![],
        "outside" => vec![(MEM + 0x1000, u32::MAX)],
        "big" => (0..16).map(|_| (2 << 20, 60 << 20)).collect(),
        other => panic!("unknown case {other}: baseline, outside or big"),
    };
    for (i, &(addr, len)) in descs.iter().enumerate() {
        let at = GuestAddress(DESC + 16 * i as u64);
        let flags: u16 = if i + 1 < descs.len() { NEXT } else { 0 };
        mem.write_obj(addr, at).unwrap();
        mem.write_obj(len, at.unchecked_add(8)).unwrap();
        mem.write_obj(flags, at.unchecked_add(12)).unwrap();
        mem.write_obj(i as u16 + 1, at.unchecked_add(14)).unwrap();
    }
    if !descs.is_empty() {
        // avail ring: flags 0, idx 1, ring[0] = head 0.
        mem.write_obj(0u16, GuestAddress(AVAIL + 4)).unwrap();
        mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
    }
    let sink = Box::new(std::io::sink());
    let mut console = Console::new(None, sink);
    let evts: Vec<EventFd> = (0..2)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    let queues = vec![
        ActiveQueue {
            queue: queue(RX_BASE),
            evt: evts[0].try_clone().unwrap(),
        },
        ActiveQueue {
            queue: queue(DESC),
            evt: evts[1].try_clone().unwrap(),
        },
    ];
    let irq = VirtioInterrupt::new(Arc::new(CountingInterrupt::default()));
    console.activate(mem.clone(), irq, queues).unwrap();
    let before = vm_hwm_kib();
    evts[1].write(1).unwrap();
    let start = Instant::now();
    if !descs.is_empty() {
        while mem.read_obj::<u16>(GuestAddress(USED + 2)).unwrap() == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "chain never returned"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    console.reset();
    println!(
        "case={case} peak_rss_before_kick_kib={before} peak_rss_kib={} elapsed_ms={}",
        vm_hwm_kib(),
        start.elapsed().as_millis()
    );
}
