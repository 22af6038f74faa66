//! virtio-fs: its high-priority and request queues on arbitrary ring contents,
//! the FUSE passthrough behind them sharing a scratch directory (read-only when
//! the last byte is even; a writable one is made afresh for each input, so
//! nothing one input writes grows into the next).
#![no_main]

#[path = "common.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::VirtioInterrupt;
use libfuzzer_sys::fuzz_target;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-fuzz-fs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("file"), b"some bytes to read").unwrap();
    std::fs::write(dir.join("sub/inner"), vec![7u8; 5000]).unwrap();
    let _ = std::os::unix::fs::symlink("/", dir.join("out"));
    dir
}

fuzz_target!(|data: &[u8]| {
    static RO: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let read_only = data.last().is_none_or(|b| b % 2 == 0);
    let dir = if read_only {
        RO.get_or_init(|| scratch("ro")).clone()
    } else {
        scratch("rw")
    };
    let mem = common::memory(data);
    let irq = VirtioInterrupt::new(Arc::new(CountingInterrupt::default()));
    let queues = (0..2).map(common::queue_n).collect();
    ember_vmm::fuzz::fs(mem, queues, irq, &dir, read_only);
});
