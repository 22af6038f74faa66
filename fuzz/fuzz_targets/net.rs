//! virtio-net: both queues on arbitrary ring contents, with the first bytes of the
//! input also waiting in the backend as frames to deliver, with and without
//! mergeable buffers. Descriptors may point anywhere and claim any length; the host
//! must neither crash nor allocate by a guest length.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::Arc;

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::VirtioInterrupt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mem = common::memory(data);
    let irq = VirtioInterrupt::new(Arc::new(CountingInterrupt::default()));
    let input = &data[..data.len().min(4096)];
    let mrg_rxbuf = data.first().is_some_and(|b| b & 1 == 1);
    ember_vmm::fuzz::net(
        mem,
        common::queue_n(0),
        common::queue_n(1),
        irq,
        input,
        mrg_rxbuf,
    );
});
