//! The virtio-blk request parser on arbitrary descriptor chains.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ember_vmm::fuzz::blk_request(&common::memory(data), common::queue());
});
