//! The virtio-blk request parser on arbitrary descriptor chains.
#![no_main]

#[path = "common.rs"]
mod common;

use ember::devices::virtio::block::request;
use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueOwnedT;

fuzz_target!(|data: &[u8]| {
    let mem = common::memory(data);
    let mut q = common::queue();
    let Ok(iter) = q.iter(&mem) else {
        return;
    };
    for chain in iter.take(usize::from(common::QUEUE_SIZE)) {
        let _ = request::parse(&mem, chain);
    }
});
