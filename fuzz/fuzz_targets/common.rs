#![allow(dead_code)] // each target uses a different part
//! Shared set-up: a small guest memory filled with fuzzer bytes, and a queue over it.

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};

/// Small, so random descriptor addresses often land inside it.
pub const MEM_SIZE: usize = 0x1_0000;
/// Queue size used by the targets.
pub const QUEUE_SIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x200;
const USED: u64 = 0x300;

/// A guest memory whose first bytes are `data` (the rest zero).
pub fn memory(data: &[u8]) -> GuestMemoryMmap<()> {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    let n = data.len().min(MEM_SIZE);
    vm_memory::Bytes::write_slice(&mem, &data[..n], GuestAddress(0)).unwrap();
    mem
}

/// A ready queue whose rings live in the fuzzer-controlled bytes.
pub fn queue() -> Queue {
    let mut q = Queue::new(QUEUE_SIZE).unwrap();
    q.set_size(QUEUE_SIZE);
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    q
}

/// Queue `n` of a multi-queue device: each queue's rings in their own 1 KiB of the
/// fuzzer-controlled memory (descriptors, then available, then used ring).
pub fn queue_n(n: u64) -> Queue {
    let base = n * 0x400;
    let mut q = Queue::new(QUEUE_SIZE).unwrap();
    q.set_size(QUEUE_SIZE);
    q.set_desc_table_address(Some(base as u32), Some(0));
    q.set_avail_ring_address(Some((base + 0x100) as u32), Some(0));
    q.set_used_ring_address(Some((base + 0x200) as u32), Some(0));
    q.set_ready(true);
    q
}
