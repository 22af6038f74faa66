//! virtio-vsock: its transmit, receive and event queues on arbitrary ring contents
//! (packets for connections that do not exist, REQUESTs to host ports nobody listens
//! on, headers that lie about their length). The host must neither crash nor allocate
//! by a guest length.
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
    let queues = [common::queue_n(0), common::queue_n(1), common::queue_n(2)];
    ember_vmm::fuzz::vsock(mem, queues, irq);
});
