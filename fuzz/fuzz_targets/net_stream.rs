//! virtio-net's stream backend (passt's framing: a 4-byte big-endian length, then
//! the Ethernet frame): arbitrary bytes as what passt sent, arriving in pieces of
//! every size, with any length prefix; and frames sent to a peer that has gone.
//! The host must neither crash nor hold more than two frames' worth.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ember_vmm::fuzz::net_stream(data);
});
