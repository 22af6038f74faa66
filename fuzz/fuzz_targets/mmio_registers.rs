//! The virtio-mmio register interface fed arbitrary reads and writes.
//!
//! Input: a sequence of 8-byte operations `[kind, offset_lo, offset_hi, width, value (4)]`.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::Arc;

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::{MmioTransport, Rng};
use ember_vmm::vstate::bus::BusDevice;
use libfuzzer_sys::fuzz_target;

/// The register window plus a little past the config space.
const WINDOW: u16 = 0x200;

fuzz_target!(|data: &[u8]| {
    let mem = common::memory(&[]);
    let irq = Arc::new(CountingInterrupt::default());
    let mut dev = MmioTransport::new(Rng::new(), mem, irq).unwrap();
    for op in data.chunks_exact(8) {
        let offset = u64::from(u16::from_le_bytes([op[1], op[2]]) % WINDOW);
        let width = [1usize, 2, 4, 8][usize::from(op[3] & 3)];
        let mut value = [0u8; 8];
        value[..4].copy_from_slice(&op[4..8]);
        if op[0] & 1 == 0 {
            dev.read(offset, &mut value[..width]);
        } else {
            dev.write(offset, &value[..width]);
        }
    }
});
