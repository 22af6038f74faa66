//! virtio-rng: an entropy source backed by the host's getrandom(2) (virtio 1.x §5.4).

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::Queue;
use vm_memory::Bytes;

use super::worker::{QueueHandler, Worker, activate_single_queue};
use super::{
    ActivateError, ActiveQueue, GuestMemory, VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC,
    VirtioDevice, VirtioInterrupt, serve_queue,
};

/// Entries in the request queue.
pub(crate) const QUEUE_SIZE: u16 = 256;
/// Most bytes one request gets: the guest asks for little at a time, and a bound keeps a
/// huge buffer from stalling the thread.
pub(crate) const MAX_BYTES_PER_REQUEST: usize = 64 * 1024;
const DEVICE: &str = "virtio-rng";

/// An entropy device as the user configures it (`--rng`; see [`crate::machine`] for the
/// rule): nothing to choose yet, but a type of its own, so a rate limit or another
/// source has its place.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngConfig {}

/// A virtio entropy device.
///
/// ```
/// use ember_vmm::devices::virtio::{Rng, VirtioDevice};
/// let rng = Rng::new();
/// assert_eq!(rng.device_type(), 4);
/// assert_eq!(rng.queue_max_sizes(), &[256]);
/// ```
#[derive(Debug, Default)]
pub struct Rng {
    worker: Option<Worker>,
}

impl Rng {
    /// A new, inactive device.
    pub fn new() -> Self {
        Self::default()
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC
    }

    fn ack_features(&mut self, _features: u64) {}

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        // No configuration space.
        data.fill(0);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        irq: VirtioInterrupt,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        self.worker = Some(activate_single_queue(
            "ember-rng",
            crate::seccomp::Thread::Rng,
            queues,
            |queue| RngHandler { mem, queue, irq },
        )?);
        Ok(())
    }

    fn reset(&mut self) {
        self.worker = None;
    }
}

/// Fills every device-writable buffer the driver offers with random bytes.
pub(crate) struct RngHandler {
    pub(crate) mem: GuestMemory,
    pub(crate) queue: Queue,
    pub(crate) irq: VirtioInterrupt,
}

impl RngHandler {
    fn fill(mem: &GuestMemory, chain: virtio_queue::DescriptorChain<&GuestMemory>) -> u32 {
        let mut written = 0usize;
        let mut buf = Vec::new();
        for desc in chain.writable() {
            let want = (desc.len() as usize).min(MAX_BYTES_PER_REQUEST - written);
            if want == 0 {
                break;
            }
            buf.resize(want, 0);
            if let Err(e) = getrandom(&mut buf) {
                crate::guest_warn!("{DEVICE}: getrandom failed: {e}");
                break;
            }
            if mem.write_slice(&buf, desc.addr()).is_err() {
                crate::guest_warn!(
                    "{DEVICE}: buffer at {:#x} is outside guest memory",
                    desc.addr().0
                );
                break;
            }
            written += want;
        }
        written as u32
    }
}

impl QueueHandler for RngHandler {
    fn process_queue(&mut self, _index: usize) {
        let Self { mem, queue, irq } = self;
        serve_queue(queue, mem, irq, DEVICE, |chain| Self::fill(mem, chain));
    }
}

/// Fills `buf` from the kernel's CSPRNG (also the VM generation ID's source).
pub(crate) fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// For the fuzz target `rng` (fuzz/, built by scripts/fuzz with `--cfg fuzzing`): serves
/// the queue twice on arbitrary memory.
#[cfg(fuzzing)]
pub(crate) fn fuzz_queue(mem: GuestMemory, queue: Queue, irq: VirtioInterrupt) {
    let mut h = RngHandler { mem, queue, irq };
    h.process_queue(0);
    h.process_queue(0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;
    use crate::devices::virtio::test_utils::*;
    use std::sync::Arc;
    use vm_memory::GuestAddress;

    #[test]
    fn fills_writable_buffers_and_skips_readable_ones() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        add_chain(
            &vq,
            0,
            &[
                r(DATA_START, 64),
                w(DATA_START + 0x100, 64),
                w(DATA_START + 0x200, 32),
            ],
        );
        add_chain(&vq, 3, &[w(1 << 40, 16)]);
        let irq = Arc::new(CountingInterrupt::default());
        let mut h = RngHandler {
            mem: mem.clone(),
            queue: vq.create_queue().unwrap(),
            irq: VirtioInterrupt::new(irq.clone()),
        };
        h.process_queue(0);
        assert_eq!(used(&vq), [(0, 96), (3, 0)]);
        assert_eq!(irq.count(), 1);
        let mut out = [0u8; 96];
        mem.read_slice(&mut out[..64], GuestAddress(DATA_START + 0x100))
            .unwrap();
        mem.read_slice(&mut out[64..], GuestAddress(DATA_START + 0x200))
            .unwrap();
        assert!(out.iter().filter(|&&b| b == 0).count() < 16, "looks random");
        let mut untouched = [1u8; 64];
        mem.read_slice(&mut untouched, GuestAddress(DATA_START))
            .unwrap();
        assert!(untouched.iter().all(|&b| b == 0));
    }

    #[test]
    fn huge_requests_are_capped() {
        let mem = memory();
        let vq = TestQueue::new(&mem, 16);
        add_chain(&vq, 0, &[w(DATA_START, 0x20_0000)]);
        let mut h = RngHandler {
            mem: mem.clone(),
            queue: vq.create_queue().unwrap(),
            irq: VirtioInterrupt::new(Arc::new(CountingInterrupt::default())),
        };
        h.process_queue(0);
        assert_eq!(used(&vq), [(0, MAX_BYTES_PER_REQUEST as u32)]);
    }
}
