//! Helpers for device unit tests: a guest memory, a mock driver-side queue, and chains.

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{RawDescriptor, split::Descriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};

use super::GuestMemory;

/// Size of the test guest memory.
pub const MEM_SIZE: usize = 0x40_0000;
/// Where test data buffers start (above the rings).
pub const DATA_START: u64 = 0x10_0000;

/// A fresh guest memory of `MEM_SIZE` bytes at address 0.
pub fn memory() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// One descriptor of a test chain.
#[derive(Clone, Copy, Debug)]
pub struct Seg {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// A device-readable segment.
pub fn r(addr: u64, len: u32) -> Seg {
    Seg {
        addr,
        len,
        write: false,
    }
}

/// A device-writable segment.
pub fn w(addr: u64, len: u32) -> Seg {
    Seg {
        addr,
        len,
        write: true,
    }
}

/// Writes `segs` as one chain at descriptor-table index `first` and makes it available.
pub fn add_chain(vq: &MockSplitQueue<GuestMemory>, first: u16, segs: &[Seg]) {
    let descs: Vec<RawDescriptor> = segs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let last = i + 1 == segs.len();
            let mut flags = if s.write { VRING_DESC_F_WRITE } else { 0 };
            if !last {
                flags |= VRING_DESC_F_NEXT;
            }
            let next = if last { 0 } else { first + i as u16 + 1 };
            RawDescriptor::from(Descriptor::new(s.addr, s.len, flags as u16, next))
        })
        .collect();
    vq.add_desc_chains(&descs, first).unwrap();
}

/// Writes one raw descriptor at `index` without touching the available ring.
pub fn put_desc(
    vq: &MockSplitQueue<GuestMemory>,
    index: u16,
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
) {
    vq.desc_table()
        .store(
            index,
            RawDescriptor::from(Descriptor::new(addr, len, flags, next)),
        )
        .unwrap();
}

/// Makes the chain starting at `head` available on a queue of `size` entries.
pub fn publish(vq: &MockSplitQueue<GuestMemory>, size: u16, head: u16) {
    let idx: u16 = vq.avail().idx().load();
    vq.avail()
        .ring()
        .ref_at(usize::from(idx % size))
        .unwrap()
        .store(head);
    vq.avail().idx().store(idx.wrapping_add(1));
}

/// The used-ring entries so far, as (head, len).
pub fn used(vq: &MockSplitQueue<GuestMemory>) -> Vec<(u32, u32)> {
    let n = vq.used().idx().load();
    (0..n)
        .map(|i| {
            let e = vq.used().ring().ref_at(usize::from(i)).unwrap().load();
            (e.id(), e.len())
        })
        .collect()
}

/// Reads a byte of guest memory.
pub fn byte(mem: &GuestMemory, addr: u64) -> u8 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

/// A uniquely named file under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempFile {
    pub path: std::path::PathBuf,
}

impl TempFile {
    /// Creates the file with `contents`.
    pub fn new(contents: &[u8]) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "ember-virtio-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::write(&path, contents).unwrap();
        Self { path }
    }

    /// Opens it read-write.
    pub fn open(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .unwrap()
    }

    /// Its current contents.
    pub fn contents(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
