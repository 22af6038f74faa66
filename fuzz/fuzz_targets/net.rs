//! virtio-net: both queues on arbitrary ring contents, with the first bytes of the
//! input also waiting in the backend as frames to deliver, with and without
//! mergeable buffers, with and without `VIRTIO_RING_F_EVENT_IDX`. Descriptors may point anywhere and claim any length; the host
//! must neither crash nor allocate by a guest length.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::Arc;

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::VirtioInterrupt;
use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueT;

fuzz_target!(|data: &[u8]| {
    let mem = common::memory(data);
    let irq = VirtioInterrupt::new(Arc::new(CountingInterrupt::default()));
    let input = &data[..data.len().min(4096)];
    let mrg_rxbuf = data.first().is_some_and(|b| b & 1 == 1);
    let event_idx = data.first().is_some_and(|b| b & 4 == 4);
    let (mut rx, mut tx) = (common::queue_n(0), common::queue_n(1));
    rx.set_event_idx(event_idx);
    tx.set_event_idx(event_idx);
    ember_vmm::fuzz::net(
        mem,
        rx,
        tx,
        irq,
        input,
        mrg_rxbuf,
    );
});
