//! The fuzz targets' door into device internals (`fuzz/`, built by
//! `scripts/fuzz` with `--cfg fuzzing`; absent from every other build).
//!
//! Each function here is one target's body over fuzzer-made guest memory and
//! queues, so the request parser and the queue handlers stay `pub(crate)`.

use virtio_queue::{Queue, QueueOwnedT, QueueT};

use crate::devices::virtio::block::request;
use crate::devices::virtio::{GuestMemory, VirtioInterrupt};

/// Target `blk_request`: parses every chain of `queue` (at most a queue's
/// worth) as a virtio-blk request; a request that parses has at most
/// `MAX_SEGMENTS` data segments, whose lengths add up to its data length.
pub fn blk_request(mem: &GuestMemory, mut queue: Queue) {
    let max = usize::from(queue.size());
    let Ok(iter) = queue.iter(mem) else {
        return;
    };
    let mut segs = request::Segments::new();
    for chain in iter.take(max) {
        if let Ok(req) = request::parse(mem, chain, &mut segs) {
            assert!(segs.len() <= request::MAX_SEGMENTS);
            let sum: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
            assert_eq!(sum, u64::from(req.data_len));
        }
    }
}

/// Target `console`: transmit, receive (with `input` waiting to be
/// delivered), transmit again, on arbitrary memory.
pub fn console(mem: GuestMemory, rx: Queue, tx: Queue, irq: VirtioInterrupt, input: &[u8]) {
    crate::devices::virtio::console::fuzz_queues(mem, rx, tx, irq, input);
}

/// Target `rng`: serves the queue twice on arbitrary memory.
pub fn rng(mem: GuestMemory, queue: Queue, irq: VirtioInterrupt) {
    crate::devices::virtio::rng::fuzz_queue(mem, queue, irq);
}

/// Target `pmem`: serves the queue (flush requests against `file`) on
/// arbitrary memory.
pub fn pmem(mem: GuestMemory, queue: Queue, irq: VirtioInterrupt, file: std::fs::File) {
    crate::devices::virtio::pmem::fuzz_queue(mem, queue, irq, file);
}

/// Target `balloon`: the balloon's queues served in the `order` the fuzzer
/// picks, on arbitrary memory.
pub fn balloon(mem: GuestMemory, queues: Vec<Queue>, irq: VirtioInterrupt, order: &[u8]) {
    crate::devices::virtio::balloon::fuzz_queues(mem, queues, irq, order);
}

/// Target `net`: transmit and receive twice (with `input` waiting as frames in
/// the backend), with or without mergeable buffers, on arbitrary memory.
pub fn net(
    mem: GuestMemory,
    rx: Queue,
    tx: Queue,
    irq: VirtioInterrupt,
    input: &[u8],
    mrg_rxbuf: bool,
) {
    crate::devices::virtio::net::fuzz_queues(mem, rx, tx, irq, input, mrg_rxbuf);
}

/// Target `net_stream`: passt's stream framing (a 4-byte length, then the
/// frame) cut out of arbitrary bytes arriving in arbitrary pieces, and frames
/// sent to a peer that has gone.
pub fn net_stream(input: &[u8]) {
    // Writing to a peer that has gone raises SIGPIPE. ember ignores it, as
    // every Rust program does from its start, so the device sees EPIPE;
    // libFuzzer's C `main` does not, and the signal would end the run.
    static IGNORE_SIGPIPE: std::sync::Once = std::sync::Once::new();
    IGNORE_SIGPIPE.call_once(|| {
        // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    });
    crate::devices::virtio::net::fuzz_stream(input);
}

/// Target `vsock`: a restored device's TRANSPORT_RESET, then the transmit
/// queue twice (answers go to the receive queue), on arbitrary memory.
pub fn vsock(mem: GuestMemory, queues: [Queue; 3], irq: VirtioInterrupt) {
    crate::devices::virtio::vsock::fuzz_queues(mem, queues, irq);
}

/// Target `mem`: virtio-mem requests (plug, unplug, state, anything else)
/// on arbitrary memory, against a region at guest-physical 0 (so the
/// fuzzer's addresses land in it), with a resize between two passes.
pub fn mem(mem: GuestMemory, queue: Queue, irq: VirtioInterrupt) {
    crate::devices::virtio::mem::fuzz_queue(mem, queue, irq, 0);
}

/// Target `fs`: virtio-fs's two queues served twice each on arbitrary
/// memory, its FUSE server sharing `dir` (read-only or not).
pub fn fs(
    mem: GuestMemory,
    queues: Vec<Queue>,
    irq: VirtioInterrupt,
    dir: &std::path::Path,
    read_only: bool,
) {
    crate::devices::virtio::fs::fuzz_queues(mem, queues, irq, dir, read_only);
}
