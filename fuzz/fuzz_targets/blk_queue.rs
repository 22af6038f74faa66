//! virtio-blk queue processing, end to end with the synchronous engine, on arbitrary ring
//! contents: descriptors, available ring, headers and data all come from the fuzzer.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::{Arc, OnceLock};

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::VirtioInterrupt;
use ember_vmm::devices::virtio::block::{BlockHandler, DiskParams, EngineKind};
use libfuzzer_sys::fuzz_target;

/// A 64 KiB scratch disk shared by all runs, unlinked once open (nothing
/// is left behind however the fuzzer ends).
fn disk() -> &'static std::fs::File {
    static FILE: OnceLock<std::fs::File> = OnceLock::new();
    FILE.get_or_init(|| {
        let p = std::env::temp_dir().join(format!("ember-fuzz-disk-{}", std::process::id()));
        std::fs::write(&p, vec![0u8; 0x1_0000]).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let _ = std::fs::remove_file(&p);
        f
    })
}

fuzz_target!(|data: &[u8]| {
    let mem = common::memory(data);
    let file = disk().try_clone().unwrap();
    let irq = VirtioInterrupt::new(Arc::new(CountingInterrupt::default()));
    let mut handler = BlockHandler::open(
        mem,
        common::queue(),
        irq,
        EngineKind::Sync,
        file,
        DiskParams {
            capacity: 0x1_0000 >> 9,
            read_only: data.first().is_some_and(|b| b & 1 == 1),
            direct: false,
            serial: *b"fuzz-serial-00000000",
        },
    )
    .unwrap();
    // Two wake-ups: the second sees whatever the first left (or a broken queue).
    handler.process_queue();
    handler.process_queue();
    handler.drain();
});
