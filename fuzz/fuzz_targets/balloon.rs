//! virtio-balloon: inflate, deflate, statistics and free-page reporting queues on
//! arbitrary ring contents, served in an order the fuzzer picks (the last bytes).
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
    let queues = (0..4).map(common::queue_n).collect();
    let order = &data[data.len().saturating_sub(8)..];
    let order = if order.is_empty() {
        &[0, 1, 2, 3][..]
    } else {
        order
    };
    ember_vmm::fuzz::balloon(mem, queues, irq, order);
});
