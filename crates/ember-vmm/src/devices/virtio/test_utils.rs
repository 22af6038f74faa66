//! Helpers for device unit tests: a guest memory, a mock driver-side queue, and chains.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::GuestMemory;

/// Size of the test guest memory.
pub(crate) const MEM_SIZE: usize = 0x40_0000;
/// Where test data buffers start (above the rings).
pub(crate) const DATA_START: u64 = 0x10_0000;

/// A fresh guest memory of `MEM_SIZE` bytes at address 0.
pub(crate) fn memory() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// One descriptor of a test chain.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seg {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// A device-readable segment.
pub(crate) fn r(addr: u64, len: u32) -> Seg {
    Seg {
        addr,
        len,
        write: false,
    }
}

/// A device-writable segment.
pub(crate) fn w(addr: u64, len: u32) -> Seg {
    Seg {
        addr,
        len,
        write: true,
    }
}

/// The driver side of a split virtqueue in test memory.
///
/// (virtio-queue 0.18's `MockSplitQueue` sizes its available ring in elements rather than
/// bytes, so its used ring overlaps the second half of the available ring; with more than
/// a few requests in flight the two corrupt each other. This one lays the rings out as the
/// spec does.)
pub(crate) struct TestQueue<'a> {
    mem: &'a GuestMemory,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
}

impl<'a> TestQueue<'a> {
    /// A queue of `size` entries with its rings from address 0.
    pub(crate) fn new(mem: &'a GuestMemory, size: u16) -> Self {
        Self::create(mem, GuestAddress(0), size)
    }

    /// A queue of `size` entries with its rings from `start`.
    pub(crate) fn create(mem: &'a GuestMemory, start: GuestAddress, size: u16) -> Self {
        let desc = start.0;
        let avail = desc + 16 * u64::from(size);
        // flags, idx, ring[size], used_event; the used ring is 4-byte aligned.
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4);
        let q = Self {
            mem,
            size,
            desc,
            avail,
            used,
        };
        let ring_end = used + 6 + 8 * u64::from(size);
        mem.write_slice(&vec![0u8; (ring_end - desc) as usize], GuestAddress(desc))
            .unwrap();
        q
    }

    /// A device-side queue over these rings, ready for use.
    pub(crate) fn create_queue(&self) -> Result<Queue, virtio_queue::Error> {
        let mut q = Queue::new(self.size)?;
        q.try_set_size(self.size)?;
        q.try_set_desc_table_address(GuestAddress(self.desc))?;
        q.try_set_avail_ring_address(GuestAddress(self.avail))?;
        q.try_set_used_ring_address(GuestAddress(self.used))?;
        q.set_ready(true);
        Ok(q)
    }

    /// Sets the available index (to fake a driver that lies about it).
    pub(crate) fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// Sets the available ring's flags (`VRING_AVAIL_F_NO_INTERRUPT`).
    pub(crate) fn set_avail_flags(&self, flags: u16) {
        self.mem.write_obj(flags, GuestAddress(self.avail)).unwrap();
    }

    /// The used ring's flags (`VRING_USED_F_NO_NOTIFY`).
    pub(crate) fn used_flags(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used)).unwrap()
    }

    /// Sets the driver's `used_event` (`VIRTIO_RING_F_EVENT_IDX`): interrupt once the
    /// used index passes it.
    pub(crate) fn set_used_event(&self, idx: u16) {
        let at = self.avail + 4 + 2 * u64::from(self.size);
        self.mem.write_obj(idx, GuestAddress(at)).unwrap();
    }

    /// The device's `avail_event` (`VIRTIO_RING_F_EVENT_IDX`): notify once the
    /// available index passes it.
    pub(crate) fn avail_event(&self) -> u16 {
        let at = self.used + 4 + 8 * u64::from(self.size);
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// Sets the device's `avail_event` (to see that the device writes it).
    pub(crate) fn set_avail_event(&self, idx: u16) {
        let at = self.used + 4 + 8 * u64::from(self.size);
        self.mem.write_obj(idx, GuestAddress(at)).unwrap();
    }

    /// Where the used index is (for a test that watches it from another thread).
    pub(crate) fn used_idx_addr(&self) -> u64 {
        self.used + 2
    }

    /// The used index the device has published.
    pub(crate) fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }
}

/// Writes `segs` as one chain at descriptor-table index `first` and makes it available.
pub(crate) fn add_chain(vq: &TestQueue, first: u16, segs: &[Seg]) {
    for (i, s) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        let mut flags = if s.write { VRING_DESC_F_WRITE } else { 0 };
        if !last {
            flags |= VRING_DESC_F_NEXT;
        }
        let next = if last { 0 } else { first + i as u16 + 1 };
        put_desc(vq, first + i as u16, s.addr, s.len, flags as u16, next);
    }
    publish(vq, vq.size, first);
}

/// Writes one raw descriptor at `index` without touching the available ring.
pub(crate) fn put_desc(vq: &TestQueue, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
    assert!(index < vq.size, "descriptor {index} outside the table");
    let d = Descriptor::new(addr, len, flags, next);
    vq.mem
        .write_obj(d, GuestAddress(vq.desc + 16 * u64::from(index)))
        .unwrap();
}

/// Writes `segs` as an indirect descriptor table at `table` and makes it available as one
/// chain whose head, at descriptor-table index `head`, points at the table. Indirect
/// tables can be far longer than the queue.
pub(crate) fn add_indirect_chain(vq: &TestQueue, head: u16, table: u64, segs: &[Seg]) {
    for (i, s) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        let mut flags = if s.write { VRING_DESC_F_WRITE } else { 0 };
        if !last {
            flags |= VRING_DESC_F_NEXT;
        }
        let next = if last { 0 } else { i as u16 + 1 };
        let d = Descriptor::new(s.addr, s.len, flags as u16, next);
        vq.mem
            .write_obj(d, GuestAddress(table + 16 * i as u64))
            .unwrap();
    }
    let len = 16 * u32::try_from(segs.len()).unwrap();
    put_desc(vq, head, table, len, VRING_DESC_F_INDIRECT as u16, 0);
    publish(vq, vq.size, head);
}

/// Makes the chain starting at `head` available on a queue of `size` entries.
pub(crate) fn publish(vq: &TestQueue, size: u16, head: u16) {
    let idx: u16 = vq.mem.read_obj(GuestAddress(vq.avail + 2)).unwrap();
    let slot = vq.avail + 4 + 2 * u64::from(idx % size);
    vq.mem.write_obj(head, GuestAddress(slot)).unwrap();
    vq.set_avail_idx(idx.wrapping_add(1));
}

/// The used-ring entries so far, as (head, len) (up to one ring's worth).
pub(crate) fn used(vq: &TestQueue) -> Vec<(u32, u32)> {
    let n = vq.used_idx().min(vq.size);
    (0..n)
        .map(|i| {
            let at = vq.used + 4 + 8 * u64::from(i);
            (
                vq.mem.read_obj(GuestAddress(at)).unwrap(),
                vq.mem.read_obj(GuestAddress(at + 4)).unwrap(),
            )
        })
        .collect()
}

/// Reads a byte of guest memory.
pub(crate) fn byte(mem: &GuestMemory, addr: u64) -> u8 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

/// A uniquely named file under the system temp dir, removed on drop.
#[derive(Debug)]
pub(crate) struct TempFile {
    pub path: std::path::PathBuf,
}

impl TempFile {
    /// Creates the file with `contents`.
    pub(crate) fn new(contents: &[u8]) -> Self {
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
    pub(crate) fn open(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .unwrap()
    }

    /// Its current contents.
    pub(crate) fn contents(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The unit tests' allocator: the system's, counting the allocations each thread makes so
/// a test can check that a hot path allocates nothing ([`allocations`]). Per thread, so
/// tests running in parallel do not disturb each other's counts.
struct CountingAlloc;

thread_local! {
    /// Const-initialised and without a destructor, so reading it never allocates.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    /// The largest single allocation this thread made since [`reset_largest_allocation`].
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn count_one(size: usize) {
    // `try_with` rather than `with`: never panic inside the allocator, even while a thread
    // is being torn down.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    let _ = LARGEST.try_with(|n| n.set(n.get().max(size)));
}

// SAFETY: every call is passed straight to `System`, which upholds the contract; counting
// touches only a thread-local integer.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one(layout.size());
        // SAFETY: the caller's guarantees for `layout` are `System`'s preconditions.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one(new_size);
        // SAFETY: `ptr` came from this allocator, that is from `System`, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

/// Heap allocations (and reallocations) made by this thread so far.
pub(crate) fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// The largest single allocation (or reallocation) this thread made since the last
/// [`reset_largest_allocation`]: how a test checks a guest-written length did not size a
/// host buffer.
pub(crate) fn largest_allocation() -> usize {
    LARGEST.with(Cell::get)
}

/// Starts a new [`largest_allocation`] measurement on this thread.
pub(crate) fn reset_largest_allocation() {
    LARGEST.with(|n| n.set(0));
}
