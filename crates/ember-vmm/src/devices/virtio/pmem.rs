//! virtio-pmem: a host file mapped straight into the guest's physical address space
//! (virtio 1.x §5.19), so the guest can use it with DAX and skip its page cache.
//!
//! The VMM maps the file with [`PmemRegion::map`], registers the mapping as a KVM memory
//! slot at a guest address ≥ `layout::PMEM_START_MIN`, and gives [`Pmem`] that address.
//! The device itself only answers flush requests, with `fsync` of the backing file.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_bindings::virtio_ids::VIRTIO_ID_PMEM;
use virtio_queue::{DescriptorChain, Queue, Reader, Writer};

use super::worker::{QueueHandler, Worker, activate_single_queue};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt,
    read_config_bytes, serve_queue,
};

/// Entries in the request queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// The guest driver hot-adds the region as memory: it must be 2 MiB aligned and sized.
pub(crate) const PMEM_ALIGN: u64 = 2 << 20;
/// `VIRTIO_PMEM_REQ_TYPE_FLUSH`, the only request type.
const REQ_TYPE_FLUSH: u32 = 0;
/// Response codes: zero is success, anything else an I/O error to the guest.
const RESP_OK: u32 = 0;
const RESP_EIO: u32 = 1;
/// The most descriptors a request chain may have. A request is a 4-byte type and a 4-byte
/// response (Linux sends two descriptors); virtio-queue's `Reader` and `Writer` hold a list
/// entry per descriptor, and an indirect table lets the guest ask for 65535 of them.
pub(crate) const MAX_REQUEST_DESCRIPTORS: usize = 16;
const DEVICE: &str = "virtio-pmem";

/// virtio-pmem errors.
#[derive(Debug, Error)]
pub enum Error {
    /// `--pmem` with no path.
    #[error("pmem option is missing a path")]
    MissingPath,
    /// The backing file could not be opened.
    #[error("cannot open pmem backing file {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another VM holds a lock on the file.
    #[error("pmem backing file {0} is in use by another VM")]
    InUse(PathBuf),
    /// Locking the file failed (not a conflict).
    #[error("cannot lock pmem backing file {path}")]
    Lock {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The backing file is empty.
    #[error("pmem backing file {0} is empty")]
    Empty(PathBuf),
    /// Mapping it failed.
    #[error("cannot map pmem backing file {path}")]
    Map {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A pmem device as the user configures it (`--pmem PATH`; see [`crate::machine`] for
/// the rule). Where it sits in guest-physical memory is the device manager's choice, not
/// part of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemConfig {
    /// The backing file, absolute.
    pub path: PathBuf,
}

impl PmemConfig {
    /// A pmem device backed by `path`, made absolute against the current directory.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        PmemConfig {
            path: super::block::absolute(path.into()),
        }
    }
}

impl FromStr for PmemConfig {
    type Err = Error;

    /// Parses `PATH`: the one `--pmem` grammar.
    fn from_str(arg: &str) -> Result<Self, Error> {
        if arg.is_empty() {
            return Err(Error::MissingPath);
        }
        Ok(PmemConfig::new(arg))
    }
}

/// A backing file mapped shared into the VMM, ready to become a KVM memory slot.
///
/// The mapping is rounded up to [`PMEM_ALIGN`]; the part past the end of the file is
/// anonymous memory, so the guest touching it cannot fault the VMM with `SIGBUS`.
#[derive(Debug)]
pub(crate) struct PmemRegion {
    file: File,
    host_addr: *mut libc::c_void,
    len: u64,
}

// SAFETY: the mapping is plain shared memory owned by this value; it is only unmapped on
// drop, and concurrent access to it is the guest's business as with any guest RAM.
unsafe impl Send for PmemRegion {}
// SAFETY: as above; `&PmemRegion` only exposes the address and sizes.
unsafe impl Sync for PmemRegion {}

impl PmemRegion {
    /// Opens `path` read-write and maps it.
    pub(crate) fn map(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| Error::Open {
            path: path.clone(),
            source,
        };
        let file = crate::files::open(
            OpenOptions::new().read(true).write(true),
            0,
            &path,
            crate::files::Want::File,
        )
        .map_err(open_err)?;
        // The guest writes the mapping: one VM per file.
        crate::devices::image_lock::lock(&file, crate::devices::image_lock::LockKind::Exclusive)
            .map_err(|source| {
                if source.kind() == std::io::ErrorKind::WouldBlock {
                    Error::InUse(path.clone())
                } else {
                    Error::Lock {
                        path: path.clone(),
                        source,
                    }
                }
            })?;
        let file_len = file.metadata().map_err(open_err)?.len();
        if file_len == 0 {
            return Err(Error::Empty(path));
        }
        let map_err = |source| Error::Map {
            path: path.clone(),
            source,
        };
        let len = file_len
            .checked_next_multiple_of(PMEM_ALIGN)
            .ok_or_else(|| map_err(std::io::ErrorKind::InvalidInput.into()))?;
        let len_usize =
            usize::try_from(len).map_err(|_| map_err(std::io::ErrorKind::InvalidInput.into()))?;
        let file_len_usize = file_len as usize;
        // Reserve the whole aligned range as anonymous memory first…
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        // …then put the file over its start.
        // SAFETY: MAP_FIXED replaces part of the anonymous mapping we just created and own;
        // the fd is open and `file_len` fits inside it.
        let mapped = unsafe {
            libc::mmap(
                base,
                file_len_usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: unmapping the range we mapped above and nobody else uses.
            unsafe { libc::munmap(base, len_usize) };
            return Err(map_err(e));
        }
        Ok(Self {
            file,
            host_addr: base,
            len,
        })
    }

    /// Host virtual address of the mapping (KVM's `userspace_addr`).
    pub(crate) fn host_addr(&self) -> u64 {
        self.host_addr as u64
    }

    /// Length of the mapping: the file size rounded up to [`PMEM_ALIGN`].
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for PmemRegion {
    fn drop(&mut self) {
        // SAFETY: the range was mapped in `map` and is unmapped exactly once, here. The VMM
        // must have removed the KVM slot (or torn down the VM) first.
        unsafe { libc::munmap(self.host_addr, self.len as usize) };
    }
}

/// A virtio-pmem device describing a region at `guest_addr`.
///
/// How the builder uses it (crate-internal, so not a doctest):
///
/// ```text
/// use crate::devices::virtio::{Pmem, PmemRegion};
/// let region = PmemRegion::map("/var/lib/ember/root.img").unwrap();
/// let guest_addr = 0x10_0000_0000; // layout::PMEM_START_MIN
/// // vm.set_user_memory_region(slot, guest_addr, region.len(), region.host_addr())
/// let pmem = Pmem::new(&region, guest_addr).unwrap();
/// ```
#[derive(Debug)]
pub(crate) struct Pmem {
    file: File,
    config_space: [u8; 16],
    worker: Option<Worker>,
}

impl Pmem {
    /// A device for `region`, which the VMM maps at guest-physical `guest_addr`.
    pub(crate) fn new(region: &PmemRegion, guest_addr: u64) -> std::io::Result<Self> {
        let mut config_space = [0u8; 16];
        config_space[..8].copy_from_slice(&guest_addr.to_le_bytes());
        config_space[8..].copy_from_slice(&region.len().to_le_bytes());
        Ok(Self {
            file: region.file.try_clone()?,
            config_space,
            worker: None,
        })
    }
}

impl VirtioDevice for Pmem {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_PMEM
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn ack_features(&mut self, _features: u64) {}

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        irq: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        let file = self.file.try_clone().map_err(ActivateError::Backend)?;
        self.worker = Some(activate_single_queue(
            "ember-pmem",
            crate::seccomp::Thread::Pmem,
            queues,
            |queue| PmemHandler {
                mem,
                queue,
                irq,
                file,
            },
        )?);
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
    }
}

/// Answers flush requests.
pub(crate) struct PmemHandler {
    pub(crate) mem: GuestMemory,
    pub(crate) queue: Queue,
    pub(crate) irq: VirtioInterrupt,
    pub(crate) file: File,
}

impl PmemHandler {
    /// Handles one request; returns the used length.
    fn handle(mem: &GuestMemory, file: &File, chain: DescriptorChain<&GuestMemory>) -> u32 {
        // Counted first (walking a chain allocates nothing): one past the cap refuses it.
        if chain.clone().take(MAX_REQUEST_DESCRIPTORS + 1).count() > MAX_REQUEST_DESCRIPTORS {
            crate::guest_warn!(
                "{DEVICE}: request of more than {MAX_REQUEST_DESCRIPTORS} descriptors dropped"
            );
            return 0;
        }
        let req = Reader::<()>::new(mem, chain.clone()).and_then(|mut r| {
            r.read_obj::<u32>()
                .map_err(|_| virtio_queue::Error::InvalidChain)
        });
        let resp = match req {
            Ok(REQ_TYPE_FLUSH) => match file.sync_all() {
                Ok(()) => RESP_OK,
                Err(e) => {
                    crate::guest_warn!("{DEVICE}: fsync failed: {e}");
                    RESP_EIO
                }
            },
            Ok(other) => {
                crate::guest_warn!("{DEVICE}: unknown request type {other}");
                RESP_EIO
            }
            Err(e) => {
                crate::guest_warn!("{DEVICE}: unreadable request: {e}");
                RESP_EIO
            }
        };
        let written = Writer::<()>::new(mem, chain).and_then(|mut w| {
            w.write_obj(resp)
                .map_err(|_| virtio_queue::Error::InvalidChain)
        });
        match written {
            Ok(()) => std::mem::size_of::<u32>() as u32,
            Err(e) => {
                crate::guest_warn!("{DEVICE}: cannot write the response: {e}");
                0
            }
        }
    }
}

impl QueueHandler for PmemHandler {
    fn process_queue(&mut self, _index: usize) {
        let Self {
            mem,
            queue,
            irq,
            file,
        } = self;
        serve_queue(queue, mem, irq, DEVICE, |chain| {
            Self::handle(mem, file, chain)
        });
    }
}

/// For the fuzz target `pmem` (fuzz/, built by scripts/fuzz with `--cfg fuzzing`): serves
/// the queue twice on arbitrary memory, with `file` as the backing file.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queue(mem: GuestMemory, queue: Queue, irq: VirtioInterrupt, file: File) {
    let mut h = PmemHandler {
        mem,
        queue,
        irq,
        file,
    };
    h.process_queue(0);
    h.process_queue(0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::test_utils::*;
    use std::sync::Arc;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn maps_the_file_shared_and_pads_to_2mib() {
        let tmp = TempFile::new(&[0x11u8; 5000]);
        let region = PmemRegion::map(&tmp.path).unwrap();
        assert_eq!(region.len(), PMEM_ALIGN);
        // The padding is anonymous: the file keeps its size.
        assert_eq!(std::fs::metadata(&tmp.path).unwrap().len(), 5000);
        assert_eq!(region.host_addr() % 4096, 0);
        let p = region.host_addr() as *mut u8;
        // SAFETY: inside the live mapping of `region.len()` bytes.
        unsafe {
            assert_eq!(*p, 0x11);
            *p = 0x22;
            // Past the end of the file: anonymous padding, no SIGBUS.
            *p.add(PMEM_ALIGN as usize - 1) = 1;
        }
        let pmem = Pmem::new(&region, 0x100_0000_0000).unwrap();
        let mut cfg = [0u8; 16];
        pmem.read_config(0, &mut cfg);
        assert_eq!(
            u64::from_le_bytes(cfg[..8].try_into().unwrap()),
            0x100_0000_0000
        );
        assert_eq!(u64::from_le_bytes(cfg[8..].try_into().unwrap()), PMEM_ALIGN);
        drop(region);
        assert_eq!(tmp.contents()[0], 0x22, "writes reach the file");
        assert_eq!(tmp.contents().len(), 5000, "file not resized");
    }

    #[test]
    fn refuses_missing_and_empty_files() {
        assert!(matches!(
            PmemRegion::map("/nonexistent/pmem"),
            Err(Error::Open { .. })
        ));
        let tmp = TempFile::new(&[]);
        assert!(matches!(PmemRegion::map(&tmp.path), Err(Error::Empty(_))));
    }

    /// A pmem file is the guest's writable memory: a second VM cannot map it while the
    /// first holds it, and can once it is gone.
    #[test]
    fn one_vm_per_pmem_file() {
        let tmp = TempFile::new(&[0u8; 4096]);
        let first = PmemRegion::map(&tmp.path).unwrap();
        let second = PmemRegion::map(&tmp.path).unwrap_err();
        assert!(matches!(second, Error::InUse(_)), "{second}");
        assert!(second.to_string().contains("in use by another VM"));
        drop(first);
        PmemRegion::map(&tmp.path).unwrap();
    }

    #[test]
    fn flush_requests_get_a_response() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        let tmp = TempFile::new(&[0u8; 512]);
        mem.write_obj(REQ_TYPE_FLUSH, GuestAddress(DATA_START))
            .unwrap();
        mem.write_obj(7u32, GuestAddress(DATA_START + 0x10))
            .unwrap();
        mem.write_obj(0xffu32, GuestAddress(DATA_START + 0x100))
            .unwrap();
        mem.write_obj(0xffu32, GuestAddress(DATA_START + 0x110))
            .unwrap();
        add_chain(&vq, 0, &[r(DATA_START, 4), w(DATA_START + 0x100, 4)]);
        // Unknown type.
        add_chain(&vq, 2, &[r(DATA_START + 0x10, 4), w(DATA_START + 0x110, 4)]);
        // No room for a response.
        add_chain(&vq, 4, &[r(DATA_START, 4)]);
        let irq = Arc::new(CountingInterrupt::default());
        let mut h = PmemHandler {
            mem: mem.clone(),
            queue: vq.create_queue().unwrap(),
            irq: VirtioInterrupt::new(irq.clone()),
            file: tmp.open(),
        };
        h.process_queue(0);
        assert_eq!(used(&vq), [(0, 4), (2, 4), (4, 0)]);
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(DATA_START + 0x100))
                .unwrap(),
            RESP_OK
        );
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(DATA_START + 0x110))
                .unwrap(),
            RESP_EIO
        );
        assert_eq!(irq.count(), 1);
    }

    /// A request whose indirect table claims 4096 descriptors is dropped before anything
    /// is allocated per descriptor (virtio-queue's `Reader`/`Writer` held 32 bytes for each:
    /// 2 MiB for a full 65535-entry table); one at the cap is still answered.
    #[test]
    fn requests_with_too_many_descriptors_are_dropped() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        let tmp = TempFile::new(&[0u8; 512]);
        mem.write_obj(REQ_TYPE_FLUSH, GuestAddress(DATA_START))
            .unwrap();
        let resp = DATA_START + 0x100;
        mem.write_obj(0xffu32, GuestAddress(resp)).unwrap();
        let mut many = vec![r(DATA_START, 4)];
        many.extend((0..4095).map(|_| w(resp, 4)));
        add_indirect_chain(&vq, 0, DATA_START + 0x1_0000, &many);
        let mut at_cap = vec![r(DATA_START, 4)];
        at_cap.extend((1..MAX_REQUEST_DESCRIPTORS).map(|_| w(resp + 0x10, 4)));
        add_indirect_chain(&vq, 1, DATA_START + 0x2_0000, &at_cap);
        let mut h = PmemHandler {
            mem: mem.clone(),
            queue: vq.create_queue().unwrap(),
            irq: VirtioInterrupt::new(Arc::new(CountingInterrupt::default())),
            file: tmp.open(),
        };
        reset_largest_allocation();
        h.process_queue(0);
        let largest = largest_allocation();
        assert_eq!(used(&vq), [(0, 0), (1, 4)]);
        assert_eq!(mem.read_obj::<u32>(GuestAddress(resp)).unwrap(), 0xff);
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(resp + 0x10)).unwrap(),
            RESP_OK
        );
        assert!(largest <= 4096, "a request allocated {largest} bytes");
    }
}
