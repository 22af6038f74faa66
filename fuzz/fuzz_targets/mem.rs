//! virtio-mem: plug, unplug, unplug-all and state requests (and garbage) on
//! arbitrary ring contents; a guest's requests must get an answer, never a panic.
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
    ember_vmm::fuzz::mem(mem, common::queue(), irq);
});
