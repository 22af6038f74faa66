//! The virtio-blk request parser on arbitrary descriptor chains.
#![no_main]

#[path = "common.rs"]
mod common;

use ember_vmm::devices::virtio::block::request;
use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueOwnedT;

fuzz_target!(|data: &[u8]| {
    let mem = common::memory(data);
    let mut q = common::queue();
    let Ok(iter) = q.iter(&mem) else {
        return;
    };
    // One list for every chain, as the device uses it.
    let mut segs = request::Segments::new();
    for chain in iter.take(usize::from(common::QUEUE_SIZE)) {
        if let Ok(req) = request::parse(&mem, chain, &mut segs) {
            assert!(segs.len() <= request::MAX_SEGMENTS);
            let sum: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
            assert_eq!(sum, u64::from(req.data_len));
        }
    }
});
