//! virtio-fs: a host directory shared with the guest (virtio 1.x §5.11),
//! served inside ember by a FUSE passthrough on the device's own I/O thread.
//!
//! # Why in-process, not vhost-user
//!
//! QEMU, Cloud Hypervisor and Kata serve virtio-fs from a separate
//! `virtiofsd` over vhost-user: the daemon maps guest memory itself, so that
//! memory must be a shared file (memfd). ember's restore maps the snapshot's
//! memory file privately, copy-on-write (`snapshot::memory`): it reads
//! nothing up front, which is what keeps restore → first instruction under
//! 5 ms. A daemon mapping that file would see the snapshot, not the guest's
//! pages; the guest's memory would have to be a memfd filled from the file at
//! every restore. Measured on this host (the snapshot file in the page cache,
//! 2 vCPUs shared with other work): a private mapping takes 0.004–0.02 ms
//! at 256 MiB and 1 GiB alike; filling a memfd takes 155–250 ms at 256 MiB
//! and 550–1550 ms at 1 GiB (sendfile of the whole file), and 32–52 ms for a
//! sparse 1 GiB file with 64 MiB of data copied by extents — a cost growing
//! with the guest's memory that a restore pays before its first instruction.
//! Mapping the snapshot file itself `MAP_SHARED` instead would cost nothing
//! but let the guest write into the snapshot, so it could be restored once.
//! An in-process device needs no shared memory at all, so prefault, balloon
//! (`MADV_DONTNEED` on private memory) and hugepages work with it unchanged.
//!
//! # Why not fuse-backend-rs
//!
//! Its passthrough file system is what Dragonball's inline virtio-fs uses,
//! but version 0.14 pins `vm-memory =0.17.1` (not optional) and its virtio
//! transport takes `virtio-queue` 0.17 descriptor chains, while ember is on
//! 0.18 of both: using it means a second copy of each, guest memory seen
//! through two crate versions (its zero-copy readers and writers take 0.17
//! `VolatileSlice`s, which could only be made from raw pointers into our
//! 0.18 regions), and the queue walked by a 0.17 `Queue` the transport's
//! snapshot state knows nothing of. Worse for a snapshot: its inode table is
//! private and numbers inodes itself, with no way to save it or to rebuild
//! it with the node IDs a restored guest still holds (its `persist` feature
//! covers the pseudo file system and VFS mounts only). So the server here is
//! a compact passthrough of ember's own (`passthrough`), with node IDs
//! ember controls and confinement rules of its own (see there).

pub(crate) mod abi;
pub mod idmap;
pub(crate) mod passthrough;

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{Address, Bytes, GuestAddress};
use zerocopy::{FromBytes, IntoBytes};

use super::worker::{QueueHandler, Worker, spawn_queue_worker};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC,
    VirtioDevice, VirtioInterrupt, check_queues, read_config_bytes, serve_queue,
};
pub use idmap::IdMap;
pub use passthrough::FsState;
use passthrough::{Reply, Server};

/// `VIRTIO_ID_FS`.
pub(crate) const VIRTIO_ID_FS: u32 = 26;
/// The config space's tag field: at most this many bytes, NUL-padded.
pub const TAG_LEN: usize = 36;
/// Entries in each queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// The high-priority queue (FORGET, INTERRUPT) and one request queue.
const QUEUES: usize = 2;
/// The most descriptors one request may have: a 1 MiB READ or WRITE in
/// 4 KiB pages and its headers, with room to spare.
pub(crate) const MAX_DESCRIPTORS: usize = 1024;
/// The most request bytes read from the guest: a full WRITE and its header,
/// or two names of PATH_MAX.
const MAX_REQUEST: usize = passthrough::MAX_IO as usize + 4096 + 2 * 4096;
const DEVICE: &str = "virtio-fs";

/// virtio-fs errors.
#[derive(Debug, Error)]
pub enum Error {
    /// `--fs` without `tag=`.
    #[error("--fs needs tag=TAG")]
    MissingTag,
    /// `--fs` without `dir=`.
    #[error("--fs needs dir=DIR")]
    MissingDir,
    /// The tag does not fit the config space.
    #[error("fs tag {0:?} is longer than {TAG_LEN} bytes")]
    TagTooLong(String),
    /// An option `--fs` does not know.
    #[error("unknown --fs option {0:?} (tag=TAG,dir=DIR[,ro])")]
    UnknownOption(String),
    /// Two shares with one tag: the guest could mount only one of them.
    #[error("fs tag {0:?} is used twice")]
    DuplicateTag(String),
    /// The directory cannot be shared.
    #[error("cannot share {path}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A snapshot's table cannot be taken over.
    #[error("virtio-fs state")]
    State(#[from] passthrough::StateError),
}

/// A shared directory as the user configures it (`--fs
/// tag=TAG,dir=DIR[,ro]`; see [`crate::machine`] for the rule).
///
/// ```
/// use ember_vmm::devices::virtio::FsConfig;
/// let fs: FsConfig = "tag=src,dir=/srv/src,ro".parse().unwrap();
/// assert_eq!((fs.tag.as_str(), fs.read_only), ("src", true));
/// assert!("tag=x".parse::<FsConfig>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    /// What the guest mounts (`mount -t virtiofs TAG /mnt`).
    pub tag: String,
    /// The host directory, absolute.
    pub dir: PathBuf,
    /// Refuse every write (`EROFS`).
    #[serde(default)]
    pub read_only: bool,
}

impl FsConfig {
    /// A share of `dir` (made absolute) as `tag`.
    pub fn new(tag: &str, dir: impl Into<PathBuf>, read_only: bool) -> Result<Self, Error> {
        if tag.is_empty() {
            return Err(Error::MissingTag);
        }
        if tag.len() > TAG_LEN {
            return Err(Error::TagTooLong(tag.into()));
        }
        Ok(FsConfig {
            tag: tag.into(),
            dir: super::block::absolute(dir.into()),
            read_only,
        })
    }

    /// Refuses two shares with one tag.
    pub fn check_tags(shares: &[FsConfig]) -> Result<(), Error> {
        for (i, s) in shares.iter().enumerate() {
            if shares[..i].iter().any(|o| o.tag == s.tag) {
                return Err(Error::DuplicateTag(s.tag.clone()));
            }
        }
        Ok(())
    }
}

impl FromStr for FsConfig {
    type Err = Error;

    /// Parses `tag=TAG,dir=DIR[,ro]`: the one `--fs` grammar.
    fn from_str(arg: &str) -> Result<Self, Error> {
        let (mut tag, mut dir, mut ro) = (None, None, false);
        for part in arg.split(',') {
            match part.split_once('=') {
                Some(("tag", v)) => tag = Some(v),
                Some(("dir", v)) if !v.is_empty() => dir = Some(v),
                None if part == "ro" => ro = true,
                _ => return Err(Error::UnknownOption(part.into())),
            }
        }
        let tag = tag.ok_or(Error::MissingTag)?;
        FsConfig::new(tag, dir.ok_or(Error::MissingDir)?, ro)
    }
}

/// The server's table, shared by the device, its I/O thread and a snapshot.
#[derive(Debug, Clone)]
pub struct FsHandle(Arc<Mutex<Server>>);

impl FsHandle {
    /// The table as a snapshot records it (the VM paused, its queues drained).
    pub fn state(&self) -> FsState {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).state()
    }
}

/// A virtio-fs device.
#[derive(Debug)]
pub struct Fs {
    config_space: [u8; TAG_LEN + 4],
    server: FsHandle,
    worker: Option<Worker>,
}

impl Fs {
    /// A device sharing `config.dir`; fails (one line) if it is not a
    /// directory ember can open.
    pub fn new(config: &FsConfig) -> Result<Self, Error> {
        if config.tag.is_empty() || config.tag.len() > TAG_LEN {
            return Err(Error::TagTooLong(config.tag.clone()));
        }
        let server = Server::new(&config.dir, config.read_only).map_err(|source| Error::Dir {
            path: config.dir.clone(),
            source,
        })?;
        let mut config_space = [0u8; TAG_LEN + 4];
        config_space[..config.tag.len()].copy_from_slice(config.tag.as_bytes());
        // num_request_queues.
        config_space[TAG_LEN..].copy_from_slice(&1u32.to_le_bytes());
        Ok(Fs {
            config_space,
            server: FsHandle(Arc::new(Mutex::new(server))),
            worker: None,
        })
    }

    /// A device that takes over a snapshot's table.
    pub fn from_state(config: &FsConfig, state: &FsState) -> Result<Self, Error> {
        let dev = Fs::new(config)?;
        dev.server
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restore(state)?;
        Ok(dev)
    }

    /// Its table's handle, for snapshots.
    pub fn handle(&self) -> FsHandle {
        self.server.clone()
    }
}

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; QUEUES]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC
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
        check_queues(&queues, QUEUES)?;
        let (queues, evts): (Vec<_>, Vec<_>) = queues.into_iter().map(|q| (q.queue, q.evt)).unzip();
        let handler = FsHandler {
            mem,
            queues,
            irq,
            server: self.server.clone(),
            buffers: Buffers::default(),
        };
        self.worker = Some(spawn_queue_worker(
            "ember-fs".into(),
            crate::seccomp::Thread::Fs,
            handler,
            evts,
            None,
        )?);
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
        self.server
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .forget_all();
    }
}

/// The I/O thread's reusable request and reply buffers.
#[derive(Default)]
struct Buffers {
    request: Vec<u8>,
    reply: Vec<u8>,
    writable: Vec<(GuestAddress, u32)>,
}

/// Serves both queues: each chain is one FUSE request (device-readable
/// part) and room for its reply (device-writable part).
pub(crate) struct FsHandler {
    mem: GuestMemory,
    queues: Vec<Queue>,
    irq: VirtioInterrupt,
    server: FsHandle,
    buffers: Buffers,
}

impl FsHandler {
    /// Answers one chain; returns the bytes written to it.
    fn serve(
        server: &mut Server,
        mem: &GuestMemory,
        bufs: &mut Buffers,
        chain: DescriptorChain<&GuestMemory>,
    ) -> u32 {
        match Self::try_serve(server, mem, bufs, chain) {
            Ok(n) => n,
            Err(why) => {
                crate::guest_warn!("{DEVICE}: bad request: {why}");
                0
            }
        }
    }

    fn try_serve(
        server: &mut Server,
        mem: &GuestMemory,
        bufs: &mut Buffers,
        chain: DescriptorChain<&GuestMemory>,
    ) -> Result<u32, &'static str> {
        let Buffers {
            request,
            reply,
            writable,
        } = bufs;
        request.clear();
        writable.clear();
        for (i, d) in chain.enumerate() {
            if i >= MAX_DESCRIPTORS {
                return Err("too many descriptors");
            }
            if d.is_write_only() {
                writable.push((d.addr(), d.len()));
                continue;
            }
            if !writable.is_empty() {
                return Err("a readable descriptor after a writable one");
            }
            let start = request.len();
            let len = d.len() as usize;
            if start + len > MAX_REQUEST {
                return Err("request too large");
            }
            request.resize(start + len, 0);
            mem.read_slice(&mut request[start..], d.addr())
                .map_err(|_| "request outside guest memory")?;
        }
        let Ok((header, _)) = abi::InHeader::read_from_prefix(request) else {
            return Err("request shorter than its header");
        };
        let hdr_len = size_of::<abi::InHeader>();
        let end = (header.len as usize).clamp(hdr_len, request.len());
        let arg = &request[hdr_len..end];
        let room: usize = writable.iter().map(|w| w.1 as usize).sum();
        let out_cap = room.saturating_sub(size_of::<abi::OutHeader>());
        let error = match server.handle(&header, arg, reply, out_cap) {
            Ok(Reply::None) => return Ok(0),
            Ok(Reply::Payload) if reply.len() <= out_cap => 0,
            Ok(Reply::Payload) => {
                reply.clear();
                -libc::ERANGE
            }
            Err(e) => {
                reply.clear();
                -e
            }
        };
        let out = abi::OutHeader {
            len: (size_of::<abi::OutHeader>() + reply.len()) as u32,
            error,
            unique: header.unique,
        };
        if room < size_of::<abi::OutHeader>() {
            return Err("no room for the reply");
        }
        let hdr = out.as_bytes();
        let total = hdr.len() + reply.len();
        let mut pos = 0usize;
        for &(addr, len) in writable.iter() {
            let end = total.min(pos + len as usize);
            let mut at = addr;
            while pos < end {
                let src = if pos < hdr.len() {
                    &hdr[pos..]
                } else {
                    &reply[pos - hdr.len()..]
                };
                let n = src.len().min(end - pos);
                mem.write_slice(&src[..n], at)
                    .map_err(|_| "reply buffer outside guest memory")?;
                at = at.checked_add(n as u64).ok_or("reply buffer wraps")?;
                pos += n;
            }
            if pos == total {
                break;
            }
        }
        let written = pos as u32;
        Ok(written)
    }
}

impl QueueHandler for FsHandler {
    fn process_queue(&mut self, index: usize) {
        let Self {
            mem,
            queues,
            irq,
            server,
            buffers,
        } = self;
        let Some(queue) = queues.get_mut(index) else {
            return;
        };
        let mut server = server.0.lock().unwrap_or_else(|p| p.into_inner());
        serve_queue(queue, mem, irq, DEVICE, |chain| {
            Self::serve(&mut server, mem, buffers, chain)
        });
    }
}

/// For the fuzz target `fs` (fuzz/, built by scripts/fuzz with `--cfg
/// fuzzing`): serves both queues twice on arbitrary memory, sharing `dir`.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queues(
    mem: GuestMemory,
    queues: Vec<Queue>,
    irq: VirtioInterrupt,
    dir: &std::path::Path,
    read_only: bool,
) {
    let Ok(server) = Server::new(dir, read_only) else {
        return;
    };
    let mut h = FsHandler {
        mem,
        queues,
        irq,
        server: FsHandle(Arc::new(Mutex::new(server))),
        buffers: Buffers::default(),
    };
    for _ in 0..2 {
        h.process_queue(0);
        h.process_queue(1);
    }
    // The requests' callers are arbitrary: the harness's own files are root's.
    passthrough::serve_as_self();
}

#[cfg(test)]
mod tests;
