//! virtio-vsock (virtio 1.2 §5.10) in Firecracker's hybrid design: the guest's
//! stream sockets to the host (CID 2) become Unix stream sockets on the host.
//!
//! - [`VsockConfig`]: `--vsock cid=N,uds=PATH`, the one configuration type.
//! - [`Vsock`]: the device the transport sees. It binds `PATH` when it is made
//!   (so a missing directory or a path another VM serves is an error before the
//!   guest runs) and starts its thread when the driver is ready.
//! - `handler`: the thread: guest memory and the three queues (rx, tx, event).
//! - `muxer` and `conn`: the host side and the protocol's state machine, which
//!   never see guest memory.
//!
//! On a restore, connections do not survive (their host sockets belonged to
//! another process): the restored device's first act is a TRANSPORT_RESET
//! event, upon which the guest's driver drops every connection and reads its
//! CID again, as a Firecracker guest does after its snapshot.

mod conn;
pub(crate) mod handler;
mod muxer;
mod packet;

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;

use super::worker::Worker;
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC,
    VirtioDevice, VirtioInterrupt, check_queues, read_config_bytes,
};

/// Entries in each queue.
pub(crate) const QUEUE_SIZE: u16 = 256;

/// Why a vsock device cannot be configured or made.
#[derive(Debug, Error)]
pub enum Error {
    /// `cid=` is missing.
    #[error("--vsock needs cid=N (the guest's CID, 3 or more)")]
    MissingCid,
    /// `uds=` is missing.
    #[error("--vsock needs uds=PATH (the host's Unix socket)")]
    MissingUds,
    /// The CID is not a guest CID.
    #[error("--vsock cid={0}: a guest CID is a number from 3 to 4294967294")]
    BadCid(String),
    /// An option this device does not have.
    #[error("--vsock: unknown option `{0}` (expected cid=N,uds=PATH)")]
    UnknownOption(String),
    /// The socket's directory does not exist.
    #[error("vsock uds {}: directory {} does not exist", .path.display(), .dir.display())]
    NoDirectory {
        /// The socket path.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
    },
    /// Another process (another VM) serves this path.
    #[error("vsock uds {}: the path is in use (another VM listens on it)", .0.display())]
    InUse(PathBuf),
    /// Something other than a socket is there.
    #[error("vsock uds {}: exists and is not a socket", .0.display())]
    NotASocket(PathBuf),
    /// Binding failed otherwise.
    #[error("vsock uds {}: {source}", .path.display())]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// A vsock device as the user configures it (`--vsock cid=N,uds=PATH`; see
/// [`crate::machine`] for the rule).
///
/// ```
/// use ember_vmm::devices::virtio::VsockConfig;
/// let v: VsockConfig = "cid=3,uds=/run/v.sock".parse().unwrap();
/// assert_eq!((v.cid, v.uds.to_str()), (3, Some("/run/v.sock")));
/// assert!("cid=2,uds=/v".parse::<VsockConfig>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context ID (3 or more).
    pub cid: u32,
    /// The host socket, absolute: host programs connect here, and guest
    /// connections to port P go to `uds_P`.
    pub uds: PathBuf,
}

impl FromStr for VsockConfig {
    type Err = Error;

    /// Parses `cid=N,uds=PATH` (either order): the one `--vsock` grammar.
    fn from_str(arg: &str) -> Result<Self, Error> {
        let (mut cid, mut uds) = (None, None);
        for part in arg.split(',') {
            match part.split_once('=') {
                Some(("cid", v)) => {
                    let bad = || Error::BadCid(v.into());
                    let n: u32 = v.parse().map_err(|_| bad())?;
                    if n < 3 || n == u32::MAX {
                        return Err(bad());
                    }
                    cid = Some(n);
                }
                Some(("uds", v)) if !v.is_empty() => {
                    uds = Some(super::block::absolute(PathBuf::from(v)))
                }
                _ => return Err(Error::UnknownOption(part.into())),
            }
        }
        Ok(VsockConfig {
            cid: cid.ok_or(Error::MissingCid)?,
            uds: uds.ok_or(Error::MissingUds)?,
        })
    }
}

/// Binds the device's socket. A socket left behind by a VM that is gone is
/// replaced; one a live process answers on is refused, as is anything else.
fn bind(path: &Path) -> Result<UnixListener, Error> {
    let dir = match path.parent() {
        Some(d) if d.as_os_str().is_empty() => Path::new("."),
        Some(d) => d,
        None => Path::new("/"),
    };
    if !dir.is_dir() {
        return Err(Error::NoDirectory {
            path: path.into(),
            dir: dir.into(),
        });
    }
    let bind_err = |source| Error::Bind {
        path: path.into(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => return Err(Error::InUse(path.into())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(bind_err)?;
            }
            Err(e) => return Err(bind_err(e)),
        },
        Ok(_) => return Err(Error::NotASocket(path.into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let l = UnixListener::bind(path).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => Error::InUse(path.into()),
        _ => bind_err(e),
    })?;
    // Here, not on the device thread: its filter allows no ioctl.
    l.set_nonblocking(true).map_err(bind_err)?;
    Ok(l)
}

/// An anonymous private mapping: buffers the device thread fills and empties
/// without the allocator (see `conn::TxBuf` for why).
#[derive(Debug)]
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone and unmapped on drop.
unsafe impl Send for Region {}

impl Region {
    /// `len` zeroed bytes (pages are only made resident as they are written).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Region {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl std::ops::Deref for Region {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for Region {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for deref; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made; no slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A virtio vsock device.
#[derive(Debug)]
pub struct Vsock {
    config: VsockConfig,
    listener: UnixListener,
    worker: Option<Worker>,
    /// Send TRANSPORT_RESET on the next activation (a restored device).
    reset_event: bool,
}

impl Vsock {
    /// The device for `config`, its socket bound.
    pub fn new(config: &VsockConfig) -> Result<Self, Error> {
        Ok(Vsock {
            listener: bind(&config.uds)?,
            config: config.clone(),
            worker: None,
            reset_event: false,
        })
    }

    /// Marks a restored device: its guest is told that its connections are gone.
    pub(crate) fn reset_guest_connections(&mut self) {
        self.reset_event = true;
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC
    }

    fn ack_features(&mut self, _features: u64) {}

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // `le64 guest_cid`.
        read_config_bytes(&u64::from(self.config.cid).to_le_bytes(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        irq: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        check_queues(&queues, 3)?;
        let listener = self.listener.try_clone().map_err(ActivateError::Backend)?;
        let (mut qs, mut evts) = (Vec::new(), Vec::new());
        for q in queues {
            qs.push(q.queue);
            evts.push(q.evt);
        }
        let queues: [virtio_queue::Queue; 3] =
            qs.try_into().map_err(|_| ActivateError::QueueCount {
                expected: 3,
                got: 0,
            })?;
        let (cid, uds) = (u64::from(self.config.cid), self.config.uds.clone());
        let reset_event = std::mem::take(&mut self.reset_event);
        let worker = Worker::spawn(
            "ember-vsock".into(),
            crate::seccomp::Thread::Vsock,
            move |kill| {
                // The epoll is made here: the activating vCPU's filter has no epoll_create1.
                let made = muxer::Muxer::new(cid, uds, listener)
                    .and_then(|m| handler::Handler::new(mem, queues, irq.clone(), m, reset_event));
                match made {
                    Ok(h) => h.run(evts, kill),
                    Err(e) => {
                        crate::guest_warn!("virtio-vsock: cannot start: {e}; device needs reset");
                        irq.set_needs_reset();
                    }
                }
            },
        )
        .map_err(ActivateError::Spawn)?;
        self.worker = Some(worker);
        Ok(())
    }

    fn reset(&mut self) {
        // Dropping the thread's muxer closes every connection's host socket.
        self.worker = None;
    }

    fn holds_buffers(&self, queue: usize) -> bool {
        // Receive buffers wait for host data; event buffers for an event.
        queue == handler::RX || queue == handler::EVENT
    }
}

/// For the fuzz target `vsock` (fuzz/, built by scripts/fuzz with `--cfg fuzzing`):
/// a restored device's TRANSPORT_RESET, then the transmit queue twice (whose packets
/// may answer on the receive queue), on arbitrary memory. Guest REQUESTs go to
/// `PATH_<port>` sockets nobody listens on, so each is answered RST.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queues(
    mem: GuestMemory,
    queues: [virtio_queue::Queue; 3],
    irq: VirtioInterrupt,
) {
    use std::sync::OnceLock;
    // One listener for the whole run (binding is a file-system operation).
    static LISTENER: OnceLock<Option<(PathBuf, UnixListener)>> = OnceLock::new();
    let Some((uds, l)) = LISTENER.get_or_init(|| {
        let uds = std::env::temp_dir().join(format!("ember-fuzz-vsock-{}", std::process::id()));
        let l = bind(&uds).ok()?;
        Some((uds, l))
    }) else {
        return;
    };
    let Ok(listener) = l.try_clone() else { return };
    let Ok(m) = muxer::Muxer::new(3, uds.clone(), listener) else {
        return;
    };
    let Ok(mut h) = handler::Handler::new(mem, queues, irq, m, true) else {
        return;
    };
    h.process_event();
    h.process_tx();
    h.process_tx();
    h.process_rx();
}

#[cfg(test)]
mod tests;
