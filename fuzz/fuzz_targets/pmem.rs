//! virtio-pmem: flush requests (and anything else) on arbitrary ring contents, against a
//! small scratch backing file.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::{Arc, OnceLock};

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::VirtioInterrupt;
use libfuzzer_sys::fuzz_target;

fn backing() -> &'static std::fs::File {
    static FILE: OnceLock<std::fs::File> = OnceLock::new();
    FILE.get_or_init(|| {
        let p = std::env::temp_dir().join(format!("ember-fuzz-pmem-{}", std::process::id()));
        std::fs::write(&p, [0u8; 4096]).unwrap();
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
    let irq = VirtioInterrupt::new(Arc::new(CountingInterrupt::default()));
    let file = backing().try_clone().unwrap();
    ember_vmm::fuzz::pmem(mem, common::queue(), irq, file);
});
