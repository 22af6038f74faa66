//! The block tests' rig: guest memory, a disk file and handlers over them, shared by the
//! handler's and the event loop's tests.

use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use virtio_bindings::virtio_blk::VIRTIO_BLK_T_FLUSH;
use vm_memory::{Bytes, GuestAddress};

use super::handler::{BlockHandler, DiskParams};
use super::io::{self as bio, Completion, Engine, EngineKind, Op};
use crate::devices::CountingInterrupt;
use crate::devices::virtio::test_utils::*;
use crate::devices::virtio::{GuestMemory, VirtioInterrupt};

pub(super) const QSIZE: u16 = 16;
pub(super) const DISK_SECTORS: u64 = 64;
pub(super) const HDR: u64 = DATA_START;
pub(super) const DATA: u64 = DATA_START + 0x1000;
pub(super) const STATUS: u64 = DATA_START + 0x3000;

pub(super) struct Rig {
    pub(super) mem: GuestMemory,
    pub(super) file: TempFile,
    pub(super) irq: Arc<CountingInterrupt>,
    pub(super) virq: VirtioInterrupt,
}

impl Rig {
    pub(super) fn new() -> Self {
        let pattern: Vec<u8> = (0..DISK_SECTORS * 512).map(|i| (i / 512) as u8).collect();
        let irq = Arc::new(CountingInterrupt::default());
        Self {
            mem: memory(),
            file: TempFile::new(&pattern),
            virq: VirtioInterrupt::new(irq.clone()),
            irq,
        }
    }

    pub(super) fn handler(&self, vq: &TestQueue, kind: EngineKind, ro: bool) -> BlockHandler {
        let mut serial = [0u8; 20];
        serial[..5].copy_from_slice(b"disk0");
        BlockHandler::new(
            self.mem.clone(),
            vq.create_queue().unwrap(),
            self.virq.clone(),
            bio::open(kind, self.file.open()).unwrap(),
            DiskParams {
                capacity: DISK_SECTORS,
                read_only: ro,
                direct: false,
                serial,
            },
        )
    }

    /// A handler over the file opened with `O_DIRECT`.
    pub(super) fn direct_handler(&self, vq: &TestQueue, kind: EngineKind) -> BlockHandler {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&self.file.path)
            .unwrap();
        BlockHandler::new(
            self.mem.clone(),
            vq.create_queue().unwrap(),
            self.virq.clone(),
            bio::open(kind, file).unwrap(),
            DiskParams {
                capacity: DISK_SECTORS,
                read_only: false,
                direct: true,
                serial: [0; 20],
            },
        )
    }

    /// A queue whose every entry is the same flush chain (head 0), published
    /// `QSIZE` times over, as a hostile driver could: a queue's worth of work.
    pub(super) fn queue_full_of_one_flush(&self) -> TestQueue<'_> {
        let vq = TestQueue::new(&self.mem, QSIZE);
        self.header(HDR, VIRTIO_BLK_T_FLUSH, 0);
        add_chain(&vq, 0, &[r(HDR, 16), w(STATUS, 1)]);
        for _ in 1..QSIZE {
            publish(&vq, QSIZE, 0);
        }
        vq
    }

    /// A handler whose engine holds every request until told (`HoldEngine`).
    pub(super) fn hold_handler(&self, vq: &TestQueue) -> BlockHandler {
        BlockHandler::new(
            self.mem.clone(),
            vq.create_queue().unwrap(),
            self.virq.clone(),
            Box::new(HoldEngine::default()),
            DiskParams {
                capacity: DISK_SECTORS,
                read_only: false,
                direct: false,
                serial: [0; 20],
            },
        )
    }

    pub(super) fn header(&self, at: u64, kind: u32, sector: u64) {
        self.mem.write_obj(kind, GuestAddress(at)).unwrap();
        self.mem.write_obj(0u32, GuestAddress(at + 4)).unwrap();
        self.mem.write_obj(sector, GuestAddress(at + 8)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    pub(super) fn status(&self) -> u8 {
        byte(&self.mem, STATUS)
    }
}

pub(super) fn both_engines(f: impl Fn(EngineKind)) {
    f(EngineKind::Sync);
    f(EngineKind::IoUring);
}

pub(super) fn run_all(h: &mut BlockHandler) {
    h.process_queue();
    h.drain();
}

/// An engine that completes nothing until asked to wait.
#[derive(Default)]
pub(super) struct HoldEngine {
    held: Vec<u64>,
    done: Vec<Completion>,
}

impl Engine for HoldEngine {
    unsafe fn push(&mut self, _op: Op, token: u64) -> io::Result<()> {
        self.held.push(token);
        Ok(())
    }
    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.done);
    }
    fn wait(&mut self) -> io::Result<()> {
        self.done.extend(self.held.drain(..).map(|t| (t, Ok(0))));
        Ok(())
    }
    fn notifier(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    fn has_completions(&mut self) -> bool {
        !self.done.is_empty()
    }
    fn name(&self) -> &'static str {
        "hold"
    }
}
