//! virtio-blk: a disk image file as a guest block device (virtio 1.x §5.2).
//!
//! [`Block`] is the device state; on activation it starts one I/O thread (`ember-blkN`,
//! its loop in `event_loop`) that owns the queue and hands it to a [`BlockHandler`]
//! (`handler`: parsing, submission and completion), which does the I/O through an
//! `io::Engine`.
//!
//! The engines and the handler are this crate's own: an engine's `push` hands raw
//! iovec pointers to the kernel (an `unsafe fn`), and only the handler's per-slot
//! buffers call it. Outside the crate, [`BlockHandler`] (the I/O thread's queue logic,
//! for tests, benchmarks and fuzzing) is the way in; `request` is the pure
//! request parser.

pub(crate) mod event_loop;
pub(crate) mod handler;
pub(crate) mod io;
pub(crate) mod request;
#[cfg(test)]
mod test_rig;

pub use handler::{BlockHandler, DiskParams};
pub use io::EngineKind;

use std::fs::{File, OpenOptions};

use crate::devices::image_lock::{self, LockKind};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO,
    VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;

use super::worker::Worker;
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC,
    VirtioDevice, VirtioInterrupt, check_queues, read_config_bytes,
};

/// Sectors are 512 bytes, whatever the host's block size.
pub(crate) const SECTOR_SHIFT: u32 = 9;
/// Bytes per sector.
pub(crate) const SECTOR_SIZE: u32 = 1 << SECTOR_SHIFT;
/// Entries in the request queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// Largest discard / write-zeroes request we advertise, in sectors (2 GiB).
pub(crate) const MAX_DISCARD_SECTORS: u32 = 1 << 22;
/// Discard alignment we advertise, in sectors (4 KiB: hole punching works in pages).
const DISCARD_ALIGNMENT_SECTORS: u32 = 8;

/// Offsets in `struct virtio_blk_config` (§5.2.4).
mod config_offset {
    pub(super) const CAPACITY: usize = 0;
    pub(super) const SEG_MAX: usize = 12;
    pub(super) const BLK_SIZE: usize = 20;
    pub(super) const MAX_DISCARD_SECTORS: usize = 36;
    pub(super) const MAX_DISCARD_SEG: usize = 40;
    pub(super) const DISCARD_SECTOR_ALIGNMENT: usize = 44;
    pub(super) const MAX_WRITE_ZEROES_SECTORS: usize = 48;
    pub(super) const MAX_WRITE_ZEROES_SEG: usize = 52;
    /// Size of the structure up to and including `write_zeroes_may_unmap` and padding.
    pub(super) const LEN: usize = 60;
}

/// virtio-blk errors.
#[derive(Debug, Error)]
pub enum Error {
    /// `--disk` with no path.
    #[error("disk option is missing a path")]
    MissingPath,
    /// An option we do not know.
    #[error("unknown disk option `{0}` (expected ro, direct, serial=ID or poll=US)")]
    UnknownOption(String),
    /// `poll=` is not a whole number of microseconds up to `MAX_POLL_US`.
    #[error("disk option `poll={0}` is not a number of microseconds up to {MAX_POLL_US}")]
    BadPoll(String),
    /// The serial does not fit `GET_ID`'s 20 bytes.
    #[error("disk serial `{0}` is longer than 20 bytes")]
    SerialTooLong(String),
    /// The image could not be opened.
    #[error("cannot open disk image {path}")]
    Open {
        /// The image.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another VM holds a conflicting lock on the image: a writer, or
    /// (for a read-write image) any user.
    #[error("disk image {path} is in use by another VM{}", if *.read_only { " (which writes it)" } else { "; give it `,ro` to share it read-only" })]
    InUse {
        /// The image.
        path: PathBuf,
        /// Whether this VM asked for it read-only.
        read_only: bool,
    },
    /// Locking the image failed (not a conflict).
    #[error("cannot lock disk image {path}")]
    Lock {
        /// The image.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Its size could not be read.
    #[error("cannot read the size of disk image {path}")]
    Size {
        /// The image.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// How long, at most, the I/O thread busy-polls for more requests before it sleeps
/// (`event_loop::PollWindow`). QEMU's `poll-max-ns` default: far longer than a polling
/// driver takes to answer a completion (~1 µs), short enough that an idle disk costs next
/// to nothing and that polling on the vCPU's own CPU (an overcommitted host) wastes
/// little.
pub(crate) const DEFAULT_POLL: Duration = Duration::from_micros(32);
/// The largest `poll=` accepted, in microseconds.
pub(crate) const MAX_POLL_US: u64 = 1_000_000;

/// A disk as the user configures it: `--disk PATH[,ro][,direct][,serial=ID][,poll=US]`
/// on the command line, the same value in a machine description, a snapshot and the
/// appliance's hand-over to its `ember boot` (see [`crate::machine`] for the rule).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// The image file (or block device), absolute.
    pub path: PathBuf,
    /// Offer the disk read-only and refuse writes.
    #[serde(default)]
    pub read_only: bool,
    /// Bypass the host page cache (`O_DIRECT`; QEMU's `cache=none`).
    #[serde(default)]
    pub direct: bool,
    /// What `GET_ID` returns (at most 20 bytes; `/dev/disk/by-id/virtio-ID`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// The I/O thread's longest busy-poll before sleeping, in microseconds (`poll=US`;
    /// zero: never poll), when given: `DEFAULT_POLL` otherwise, and a backend without
    /// busy-polling refuses a given one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_us: Option<u64>,
}

impl DiskConfig {
    /// A read-write disk on `path` with every option at its default. A relative path is
    /// made absolute here, against the current directory: the configuration means the
    /// same file in another process (a restore, the appliance's VMM) or directory.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DiskConfig {
            path: absolute(path.into()),
            read_only: false,
            direct: false,
            serial: None,
            poll_us: None,
        }
    }

    /// The I/O thread's busy-poll window.
    pub(crate) fn poll(&self) -> Duration {
        self.poll_us.map_or(DEFAULT_POLL, Duration::from_micros)
    }

    /// Checks what the grammar checks, for a configuration that did not come through it
    /// (a snapshot's, the appliance's hand-over).
    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.path.as_os_str().is_empty() {
            return Err(Error::MissingPath);
        }
        if let Some(s) = self
            .serial
            .as_ref()
            .filter(|s| s.len() > VIRTIO_BLK_ID_BYTES as usize)
        {
            return Err(Error::SerialTooLong(s.clone()));
        }
        if let Some(us) = self.poll_us.filter(|&us| us > MAX_POLL_US) {
            return Err(Error::BadPoll(us.to_string()));
        }
        Ok(())
    }
}

/// `path` made absolute against the current directory (left as it is when there is none).
pub(crate) fn absolute(path: PathBuf) -> PathBuf {
    std::path::absolute(&path).unwrap_or(path)
}

impl FromStr for DiskConfig {
    type Err = Error;

    /// Parses `PATH[,ro][,direct][,serial=ID][,poll=US]`: the one `--disk` grammar.
    ///
    /// ```
    /// use ember_vmm::devices::virtio::DiskConfig;
    /// let d: DiskConfig = "/img/root.ext4,ro,serial=root".parse().unwrap();
    /// assert!(d.read_only && !d.direct);
    /// assert_eq!(d.serial.as_deref(), Some("root"));
    /// assert!("x,fast".parse::<DiskConfig>().is_err());
    /// assert_eq!("x,poll=0".parse::<DiskConfig>().unwrap().poll_us, Some(0));
    /// assert!("x".parse::<DiskConfig>().unwrap().path.is_absolute());
    /// ```
    fn from_str(arg: &str) -> Result<Self, Error> {
        let mut parts = arg.split(',');
        let path = parts
            .next()
            .filter(|p| !p.is_empty())
            .ok_or(Error::MissingPath)?;
        let mut config = DiskConfig::new(path);
        for opt in parts {
            match opt {
                "ro" => config.read_only = true,
                "direct" => config.direct = true,
                _ if opt.starts_with("poll=") => {
                    let us = &opt["poll=".len()..];
                    match us.parse::<u64>() {
                        Ok(n) if n <= MAX_POLL_US => config.poll_us = Some(n),
                        _ => return Err(Error::BadPoll(us.to_owned())),
                    }
                }
                _ => match opt.strip_prefix("serial=") {
                    Some(id) if id.len() <= VIRTIO_BLK_ID_BYTES as usize => {
                        config.serial = Some(id.to_owned());
                    }
                    Some(id) => return Err(Error::SerialTooLong(id.to_owned())),
                    None => return Err(Error::UnknownOption(opt.to_owned())),
                },
            }
        }
        Ok(config)
    }
}

/// Names I/O threads `ember-blk0`, `ember-blk1`, … in creation order.
static NEXT_DISK: AtomicUsize = AtomicUsize::new(0);

/// A virtio-blk device over an image file.
///
/// # Example
///
/// ```
/// use std::sync::Arc;
/// use ember_vmm::devices::{CountingInterrupt, virtio::{Block, DiskConfig, MmioTransport}};
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let path = std::env::temp_dir().join(format!("ember-doc-{}.img", std::process::id()));
/// std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
/// let disk = Block::new(&format!("{},ro", path.display()).parse().unwrap()).unwrap();
/// assert_eq!(disk.capacity_sectors(), 2048);
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
/// let transport = MmioTransport::new(disk, mem, Arc::new(CountingInterrupt::default())).unwrap();
/// assert_eq!(transport.queue_evts().len(), 1);
/// # std::fs::remove_file(path).unwrap();
/// ```
pub struct Block {
    file: File,
    params: DiskParams,
    engine: EngineKind,
    poll: Duration,
    config_space: Vec<u8>,
    avail_features: u64,
    thread_name: String,
    worker: Option<Worker>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("file", &self.file)
            .field("params", &self.params)
            .field("engine", &self.engine)
            .finish()
    }
}

impl Block {
    /// Opens the image `config` names (read-only if `ro`, with `O_DIRECT` if `direct`).
    pub fn new(config: &DiskConfig) -> Result<Self, Error> {
        config.validate()?;
        let mut opts = OpenOptions::new();
        opts.read(true).write(!config.read_only);
        let flags = if config.direct { libc::O_DIRECT } else { 0 };
        let file = crate::files::open(
            &opts,
            flags,
            &config.path,
            crate::files::Want::FileOrBlockDevice,
        )
        .map_err(|source| Error::Open {
            path: config.path.clone(),
            source,
        })?;
        let kind = if config.read_only {
            LockKind::Shared
        } else {
            LockKind::Exclusive
        };
        image_lock::lock(&file, kind).map_err(|source| {
            if source.kind() == std::io::ErrorKind::WouldBlock {
                Error::InUse {
                    path: config.path.clone(),
                    read_only: config.read_only,
                }
            } else {
                Error::Lock {
                    path: config.path.clone(),
                    source,
                }
            }
        })?;
        // Seeking to the end also sizes block devices, where metadata says 0.
        let bytes = {
            use std::io::Seek;
            (&file)
                .seek(std::io::SeekFrom::End(0))
                .map_err(|source| Error::Size {
                    path: config.path.clone(),
                    source,
                })?
        };
        let mut serial = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        if let Some(s) = &config.serial {
            serial[..s.len()].copy_from_slice(s.as_bytes());
        }
        let params = DiskParams {
            // A partial last sector is not addressable.
            capacity: bytes >> SECTOR_SHIFT,
            read_only: config.read_only,
            direct: config.direct,
            serial,
        };
        let mut avail_features = VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_FLUSH;
        if config.read_only {
            avail_features |= 1 << VIRTIO_BLK_F_RO;
        } else {
            avail_features |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        Ok(Self {
            file,
            config_space: config_space(params.capacity),
            params,
            engine: EngineKind::Auto,
            poll: config.poll(),
            avail_features,
            thread_name: format!("ember-blk{}", NEXT_DISK.fetch_add(1, Ordering::Relaxed)),
            worker: None,
        })
    }

    /// Chooses the I/O engine (default [`EngineKind::Auto`]: io_uring for `direct` disks
    /// when the host has it, `preadv`/`pwritev` otherwise).
    pub fn with_engine(mut self, engine: EngineKind) -> Self {
        self.engine = engine;
        self
    }

    /// Disk size in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.params.capacity
    }

    /// The name its I/O thread gets.
    #[cfg(test)]
    pub(crate) fn thread_name(&self) -> &str {
        &self.thread_name
    }
}

fn config_space(capacity: u64) -> Vec<u8> {
    use config_offset as o;
    let mut c = vec![0u8; o::LEN];
    let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
    put(o::CAPACITY, &capacity.to_le_bytes());
    // Two descriptors of every request are header and status.
    put(o::SEG_MAX, &(u32::from(QUEUE_SIZE) - 2).to_le_bytes());
    put(o::BLK_SIZE, &SECTOR_SIZE.to_le_bytes());
    put(o::MAX_DISCARD_SECTORS, &MAX_DISCARD_SECTORS.to_le_bytes());
    put(o::MAX_DISCARD_SEG, &1u32.to_le_bytes());
    put(
        o::DISCARD_SECTOR_ALIGNMENT,
        &DISCARD_ALIGNMENT_SECTORS.to_le_bytes(),
    );
    put(
        o::MAX_WRITE_ZEROES_SECTORS,
        &MAX_DISCARD_SECTORS.to_le_bytes(),
    );
    put(o::MAX_WRITE_ZEROES_SEG, &1u32.to_le_bytes());
    c
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn ack_features(&mut self, _features: u64) {
        // Nothing changes with the features: every request type we offer is always
        // handled, and one not negotiated simply never arrives.
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: VirtioInterrupt,
        mut queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        check_queues(&queues, 1)?;
        let ActiveQueue { queue, evt } = queues.remove(0);
        let file = self.file.try_clone().map_err(ActivateError::Backend)?;
        // Buffered I/O completes from the page cache without blocking for long, and there
        // the plain syscalls beat io_uring (which punts buffered writes to worker threads);
        // io_uring pays off when requests really wait for the device.
        let kind = match self.engine {
            EngineKind::Auto if !self.params.direct => EngineKind::Sync,
            kind => kind,
        };
        let engine = io::open(kind, file).map_err(ActivateError::Backend)?;
        log::debug!(
            "virtio-blk: {} uses the {} engine",
            self.thread_name,
            engine.name()
        );
        let handler = BlockHandler::new(mem, queue, interrupt, engine, self.params.clone());
        let poll = self.poll;
        let worker = Worker::spawn(
            self.thread_name.clone(),
            crate::seccomp::Thread::Block,
            move |kill| event_loop::run(handler, evt, kill, poll),
        )
        .map_err(ActivateError::Spawn)?;
        self.worker = Some(worker);
        Ok(())
    }

    fn reset(&mut self) {
        // Stopping joins the thread, which first completes everything in flight.
        self.worker = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(arg: &str) -> Result<DiskConfig, Error> {
        arg.parse()
    }

    #[test]
    fn parses_disk_options() {
        assert_eq!(
            parse("/a/b.img").unwrap(),
            DiskConfig {
                path: "/a/b.img".into(),
                read_only: false,
                direct: false,
                serial: None,
                poll_us: None,
            }
        );
        assert_eq!(parse("/a/b.img").unwrap().poll(), DEFAULT_POLL);
        let d = parse("x,direct,ro,serial=12345678901234567890").unwrap();
        assert!(d.read_only && d.direct);
        assert_eq!(d.path, std::env::current_dir().unwrap().join("x"));
        assert_eq!(d.serial.unwrap().len(), 20);
        assert!(matches!(parse(""), Err(Error::MissingPath)));
        assert!(matches!(parse(",ro"), Err(Error::MissingPath)));
        assert!(matches!(
            parse("x,serial=123456789012345678901"),
            Err(Error::SerialTooLong(_))
        ));
        assert!(matches!(parse("x,rw"), Err(Error::UnknownOption(o)) if o == "rw"));
        assert_eq!(
            parse("x,poll=20").unwrap().poll(),
            Duration::from_micros(20)
        );
        assert_eq!(parse("x,poll=0").unwrap().poll(), Duration::ZERO);
        for bad in ["x,poll=", "x,poll=-1", "x,poll=1000001", "x,poll=5us"] {
            assert!(matches!(parse(bad), Err(Error::BadPoll(_))), "{bad}");
        }
        assert!(matches!(parse("x,"), Err(Error::UnknownOption(_))));
    }

    #[test]
    fn a_configuration_from_elsewhere_is_checked_as_the_grammar_checks() {
        let mut d = DiskConfig::new("/x");
        d.serial = Some("s".repeat(21));
        assert!(matches!(Block::new(&d), Err(Error::SerialTooLong(_))));
        d.serial = None;
        d.poll_us = Some(MAX_POLL_US + 1);
        assert!(matches!(Block::new(&d), Err(Error::BadPoll(_))));
        let json = serde_json::to_string(&parse("/a,ro,poll=3").unwrap()).unwrap();
        assert_eq!(
            json,
            r#"{"path":"/a","read_only":true,"direct":false,"poll_us":3}"#
        );
        assert_eq!(
            serde_json::from_str::<DiskConfig>(&json).unwrap(),
            parse("/a,ro,poll=3").unwrap()
        );
    }

    #[test]
    fn missing_image_is_a_clear_error() {
        let e = Block::new(&parse("/nonexistent/ember.img").unwrap()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot open disk image /nonexistent/ember.img"
        );
    }

    #[test]
    fn config_space_and_features_follow_the_options() {
        let tmp = super::super::test_utils::TempFile::new(&[0u8; 4096 + 100]);
        let rw = Block::new(&parse(tmp.path.to_str().unwrap()).unwrap()).unwrap();
        assert_eq!(rw.capacity_sectors(), 8);
        let mut cap = [0u8; 8];
        rw.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 8);
        let mut word = [0u8; 4];
        rw.read_config(config_offset::BLK_SIZE as u64, &mut word);
        assert_eq!(u32::from_le_bytes(word), 512);
        assert_eq!(rw.avail_features() & 1 << VIRTIO_BLK_F_RO, 0);
        assert_ne!(rw.avail_features() & 1 << VIRTIO_BLK_F_DISCARD, 0);
        assert!(rw.thread_name().starts_with("ember-blk"));
        // The read-write open holds the image's exclusive lock until it goes.
        drop(rw);

        let ro = Block::new(&parse(&format!("{},ro", tmp.path.display())).unwrap()).unwrap();
        assert_ne!(ro.avail_features() & 1 << VIRTIO_BLK_F_RO, 0);
        assert_eq!(ro.avail_features() & 1 << VIRTIO_BLK_F_WRITE_ZEROES, 0);
    }
}
