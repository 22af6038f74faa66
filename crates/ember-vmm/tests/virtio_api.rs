//! Drives virtio-mmio devices through their register window, as a guest driver would:
//! probe, negotiate, set up a queue in guest memory, notify, and watch the used ring and
//! the interrupt line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::block::EngineKind;
use ember_vmm::devices::virtio::{Block, DiskConfig, MmioTransport, Rng, VirtioDevice};
use ember_vmm::vstate::bus::BusDevice;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MAGIC: u64 = 0x000;
const VERSION: u64 = 0x004;
const DEVICE_ID: u64 = 0x008;
const DEVICE_FEATURES: u64 = 0x010;
const DEVICE_FEATURES_SEL: u64 = 0x014;
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM_MAX: u64 = 0x034;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const QUEUE_NOTIFY: u64 = 0x050;
const INTERRUPT_STATUS: u64 = 0x060;
const INTERRUPT_ACK: u64 = 0x064;
const STATUS: u64 = 0x070;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_AVAIL_LOW: u64 = 0x090;
const QUEUE_USED_LOW: u64 = 0x0a0;
const CONFIG: u64 = 0x100;

const ACKNOWLEDGE: u32 = 1;
const DRIVER: u32 = 2;
const DRIVER_OK: u32 = 4;
const FEATURES_OK: u32 = 8;

const QSIZE: u16 = 8;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const BUFS: u64 = 0x10000;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

struct Driver {
    dev: MmioTransport,
    mem: GuestMemoryMmap<()>,
    irq: Arc<CountingInterrupt>,
    next_desc: u16,
    avail_idx: u16,
}

impl Driver {
    fn new(device: impl VirtioDevice + 'static) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let irq = Arc::new(CountingInterrupt::default());
        let dev = MmioTransport::new(device, mem.clone(), irq.clone()).unwrap();
        Self {
            dev,
            mem,
            irq,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    fn read(&mut self, reg: u64) -> u32 {
        let mut d = [0u8; 4];
        self.dev.read(reg, &mut d);
        u32::from_le_bytes(d)
    }

    fn write(&mut self, reg: u64, v: u32) {
        self.dev.write(reg, &v.to_le_bytes());
    }

    fn device_features(&mut self) -> u64 {
        self.write(DEVICE_FEATURES_SEL, 0);
        let lo = self.read(DEVICE_FEATURES);
        self.write(DEVICE_FEATURES_SEL, 1);
        u64::from(self.read(DEVICE_FEATURES)) << 32 | u64::from(lo)
    }

    /// The whole init sequence of §3.1.1, accepting every offered feature.
    fn bring_up(&mut self) {
        assert_eq!(self.read(MAGIC), 0x7472_6976);
        assert_eq!(self.read(VERSION), 2);
        self.write(STATUS, 0);
        self.write(STATUS, ACKNOWLEDGE);
        self.write(STATUS, ACKNOWLEDGE | DRIVER);
        let features = self.device_features();
        assert_ne!(features & 1 << 32, 0, "VIRTIO_F_VERSION_1 offered");
        self.write(DRIVER_FEATURES_SEL, 0);
        self.write(DRIVER_FEATURES, features as u32);
        self.write(DRIVER_FEATURES_SEL, 1);
        self.write(DRIVER_FEATURES, (features >> 32) as u32);
        self.write(STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
        assert_ne!(self.read(STATUS) & FEATURES_OK, 0, "features accepted");
        self.write(QUEUE_SEL, 0);
        assert_eq!(self.read(QUEUE_READY), 0);
        assert!(self.read(QUEUE_NUM_MAX) >= u32::from(QSIZE));
        self.write(QUEUE_NUM, QSIZE.into());
        self.write(QUEUE_DESC_LOW, DESC as u32);
        self.write(QUEUE_AVAIL_LOW, AVAIL as u32);
        self.write(QUEUE_USED_LOW, USED as u32);
        self.write(QUEUE_READY, 1);
        self.write(STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
        assert_eq!(self.read(STATUS), 0xf, "device is live");
        assert!(self.dev.is_active());
    }

    /// Brings up a two-queue device accepting only `VIRTIO_F_VERSION_1`, each
    /// queue's rings at the Driver's ring addresses plus its offset in `bases`
    /// (the one at offset 0 is the queue `add` and `wait_used` work on).
    fn bring_up_version_1_only(&mut self, bases: [(u32, u64); 2]) {
        self.write(STATUS, ACKNOWLEDGE);
        self.write(STATUS, ACKNOWLEDGE | DRIVER);
        self.write(DRIVER_FEATURES_SEL, 1);
        self.write(DRIVER_FEATURES, 1);
        self.write(STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
        for (q, base) in bases {
            self.write(QUEUE_SEL, q);
            self.write(QUEUE_NUM, QSIZE.into());
            self.write(QUEUE_DESC_LOW, (DESC + base) as u32);
            self.write(QUEUE_AVAIL_LOW, (AVAIL + base) as u32);
            self.write(QUEUE_USED_LOW, (USED + base) as u32);
            self.write(QUEUE_READY, 1);
        }
        self.write(STATUS, 0xf);
    }

    /// Adds a chain of (addr, len, writable) buffers and returns its head.
    fn add(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let idx = (self.next_desc % QSIZE) as u64;
            let last = i + 1 == bufs.len();
            let mut flags = if writable { F_WRITE } else { 0 };
            if !last {
                flags |= F_NEXT;
            }
            let at = DESC + idx * 16;
            self.mem.write_obj(addr, GuestAddress(at)).unwrap();
            self.mem.write_obj(len, GuestAddress(at + 8)).unwrap();
            self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
            self.mem
                .write_obj((self.next_desc + 1) % QSIZE, GuestAddress(at + 14))
                .unwrap();
            self.next_desc = (self.next_desc + 1) % QSIZE;
        }
        let slot = AVAIL + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(AVAIL + 2))
            .unwrap();
        head
    }

    /// Kicks queue 0 through the eventfd the VMM would register as an ioeventfd.
    fn kick_eventfd(&self) {
        self.dev.queue_evts()[0].write(1).unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    fn used_elem(&self, i: u16) -> (u32, u32) {
        let at = USED + 4 + 8 * u64::from(i % QSIZE);
        (
            self.mem.read_obj(GuestAddress(at)).unwrap(),
            self.mem.read_obj(GuestAddress(at + 4)).unwrap(),
        )
    }

    fn wait_used(&self, n: u16) {
        let start = Instant::now();
        while self.used_idx() < n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "device completed {} of {n}",
                self.used_idx()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[test]
fn rng_fills_a_buffer_after_an_eventfd_kick() {
    let mut d = Driver::new(Rng::new());
    assert_eq!(d.read(DEVICE_ID), 4);
    d.bring_up();
    let head = d.add(&[(BUFS, 64, true)]);
    d.kick_eventfd();
    d.wait_used(1);
    assert_eq!(d.used_elem(0), (u32::from(head), 64));
    assert_eq!(
        d.read(INTERRUPT_STATUS) & 1,
        1,
        "used-buffer interrupt pending"
    );
    assert!(d.irq.count() >= 1);
    d.write(INTERRUPT_ACK, 1);
    assert_eq!(d.read(INTERRUPT_STATUS), 0);
    let mut buf = [0u8; 64];
    d.mem.read_slice(&mut buf, GuestAddress(BUFS)).unwrap();
    assert!(buf.iter().any(|&b| b != 0));
    // A notify that reaches the vCPU thread (no ioeventfd) works the same way.
    d.add(&[(BUFS + 0x100, 32, true)]);
    d.write(QUEUE_NOTIFY, 0);
    d.wait_used(2);
    d.write(STATUS, 0);
    assert_eq!(d.read(STATUS), 0);
}

fn disk_image(sectors: usize) -> ember_testing::TempFile {
    let path = ember_testing::TempFile::new("virtio-api", "disk.img");
    let data: Vec<u8> = (0..sectors * 512).map(|i| (i / 512) as u8).collect();
    std::fs::write(&path, data).unwrap();
    path
}

/// Writes a 16-byte virtio-blk header at `at`.
fn blk_header(mem: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) {
    mem.write_obj(kind, GuestAddress(at)).unwrap();
    mem.write_obj(0u32, GuestAddress(at + 4)).unwrap();
    mem.write_obj(sector, GuestAddress(at + 8)).unwrap();
}

fn block_round_trip(engine: EngineKind, options: &str) {
    let path = disk_image(32);
    let cfg = format!("{}{options}", path.display())
        .parse::<DiskConfig>()
        .unwrap();
    let mut d = Driver::new(Block::new(&cfg).unwrap().with_engine(engine));
    assert_eq!(d.read(DEVICE_ID), 2);
    let mut cap = [0u8; 8];
    d.dev.read(CONFIG, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 32);
    d.bring_up();

    // OUT: sector 5 <- 0xee.
    blk_header(&d.mem, BUFS, 1, 5);
    d.mem
        .write_slice(&[0xee; 512], GuestAddress(BUFS + 0x1000))
        .unwrap();
    d.add(&[
        (BUFS, 16, false),
        (BUFS + 0x1000, 512, false),
        (BUFS + 0x100, 1, true),
    ]);
    d.kick_eventfd();
    d.wait_used(1);
    assert_eq!(d.mem.read_obj::<u8>(GuestAddress(BUFS + 0x100)).unwrap(), 0);
    // IN: sectors 4..6.
    blk_header(&d.mem, BUFS + 0x20, 0, 4);
    d.add(&[
        (BUFS + 0x20, 16, false),
        (BUFS + 0x2000, 1024, true),
        (BUFS + 0x101, 1, true),
    ]);
    d.kick_eventfd();
    d.wait_used(2);
    assert_eq!(d.used_elem(1).1, 1025);
    let mut back = [0u8; 1024];
    d.mem
        .read_slice(&mut back, GuestAddress(BUFS + 0x2000))
        .unwrap();
    assert!(back[..512].iter().all(|&b| b == 4));
    assert!(back[512..].iter().all(|&b| b == 0xee));
    assert!(d.irq.count() >= 2);

    // Reset stops the I/O thread; dropping the transport afterwards is clean too.
    d.write(STATUS, 0);
    assert!(!d.dev.is_active());
    drop(d);
    let file = std::fs::read(&path).unwrap();
    assert!(file[5 * 512..6 * 512].iter().all(|&b| b == 0xee));
    std::fs::remove_file(path).unwrap();
}

#[test]
fn block_io_thread_round_trip_with_io_uring() {
    block_round_trip(EngineKind::IoUring, ",serial=api");
}

#[test]
fn block_io_thread_round_trip_with_preadv() {
    block_round_trip(EngineKind::Sync, ",serial=api");
}

#[test]
fn block_io_thread_round_trip_with_o_direct() {
    // The data buffers are page-aligned, so they go to the disk without bouncing (the
    // unaligned case is a unit test of the request handler).
    block_round_trip(EngineKind::Auto, ",direct");
}

#[test]
fn acknowledged_writes_survive_a_reset_in_the_middle_of_io() {
    let path = disk_image(256);
    let cfg = path.to_str().unwrap().parse::<DiskConfig>().unwrap();
    let mut d = Driver::new(Block::new(&cfg).unwrap());
    d.bring_up();
    // The data first: the I/O thread may poll the ring and take a request as
    // soon as it is added, before any kick (a request added before its
    // buffer was filled wrote zeroes: "acknowledged request 0 missing").
    d.mem
        .write_slice(&vec![0x77; 0x10000], GuestAddress(0x40000))
        .unwrap();
    // Fill the ring with 64 KiB writes, kick, and reset right away.
    for i in 0..QSIZE as u64 / 4 {
        let hdr = BUFS + i * 0x20;
        blk_header(&d.mem, hdr, 1, i * 128);
        d.add(&[
            (hdr, 16, false),
            (0x40000, 0x10000, false),
            (BUFS + 0x800 + i, 1, true),
        ]);
    }
    d.kick_eventfd();
    std::thread::sleep(Duration::from_millis(2));
    d.write(STATUS, 0);
    // Every write the device acknowledged is in the file.
    let done = d.used_idx();
    let file = std::fs::read(&path).unwrap();
    for i in 0..done {
        let (head, _) = d.used_elem(i);
        let req = u64::from(head) / 3;
        let at = (req * 128 * 512) as usize;
        assert!(
            file[at..at + 0x10000].iter().all(|&b| b == 0x77),
            "acknowledged request {req} missing"
        );
    }
    // The device works again after a fresh bring-up.
    d.next_desc = 0;
    d.avail_idx = 0;
    d.mem.write_obj(0u16, GuestAddress(AVAIL + 2)).unwrap();
    d.mem.write_obj(0u16, GuestAddress(USED + 2)).unwrap();
    d.bring_up();
    blk_header(&d.mem, BUFS, 4, 0); // FLUSH
    d.add(&[(BUFS, 16, false), (BUFS + 0x900, 1, true)]);
    d.kick_eventfd();
    d.wait_used(1);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn balloon_target_change_raises_a_config_interrupt() {
    use ember_vmm::devices::virtio::Balloon;
    let balloon = Balloon::new(0).unwrap();
    let handle = balloon.handle();
    let mut d = Driver::new(balloon);
    assert_eq!(d.read(DEVICE_ID), 5);
    // Accept only VERSION_1: inflate and deflate queues, no stats or reporting.
    d.bring_up_version_1_only([(0, 0), (1, 0x8000)]);
    assert_eq!(d.read(STATUS), 0xf);
    let generation = d.read(0x0fc);
    handle.set_target_pages(64);
    assert_eq!(d.read(INTERRUPT_STATUS), 2, "configuration change");
    assert_ne!(d.read(0x0fc), generation, "ConfigGeneration moved");
    assert_eq!(d.read(CONFIG), 64, "num_pages");
    d.write(CONFIG + 4, 64);
    assert_eq!(handle.actual_pages(), 64);
    // Inflate one page.
    d.mem.write_obj(0x50u32, GuestAddress(BUFS)).unwrap();
    d.mem
        .write_slice(&[9; 4096], GuestAddress(0x50 << 12))
        .unwrap();
    d.add(&[(BUFS, 4, false)]);
    d.kick_eventfd();
    d.wait_used(1);
    assert_eq!(d.mem.read_obj::<u8>(GuestAddress(0x50 << 12)).unwrap(), 0);
    assert_eq!(handle.discarded_pages(), 1);
}

#[test]
fn console_carries_bytes_between_guest_and_a_unix_socket() {
    use ember_vmm::devices::virtio::Console;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let (vmm_end, mut app_end) = UnixStream::pair().unwrap();
    let mut d = Driver::new(Console::from_unix_stream(vmm_end).unwrap());
    assert_eq!(d.read(DEVICE_ID), 3);
    d.bring_up_version_1_only([(0, 0x8000), (1, 0)]);
    // Guest -> socket through the transmit queue (queue 1, the Driver's rings).
    d.mem
        .write_slice(b"\x00\x01ok\xff", GuestAddress(BUFS))
        .unwrap();
    d.add(&[(BUFS, 5, false)]);
    d.write(QUEUE_NOTIFY, 1);
    let mut got = [0u8; 5];
    app_end.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"\x00\x01ok\xff");
    d.wait_used(1);
    // Socket -> guest through the receive queue (queue 0): post one buffer by hand.
    let (desc, avail, used) = (DESC + 0x8000, AVAIL + 0x8000, USED + 0x8000);
    d.mem.write_obj(BUFS + 0x3000, GuestAddress(desc)).unwrap();
    d.mem.write_obj(64u32, GuestAddress(desc + 8)).unwrap();
    d.mem.write_obj(F_WRITE, GuestAddress(desc + 12)).unwrap();
    d.mem.write_obj(0u16, GuestAddress(avail + 4)).unwrap();
    d.mem.write_obj(1u16, GuestAddress(avail + 2)).unwrap();
    d.write(QUEUE_NOTIFY, 0);
    app_end.write_all(b"re\x00ply").unwrap();
    let start = Instant::now();
    while d.mem.read_obj::<u16>(GuestAddress(used + 2)).unwrap() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "input never arrived"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.mem.read_obj::<u32>(GuestAddress(used + 8)).unwrap(), 6);
    let mut got = [0u8; 6];
    d.mem
        .read_slice(&mut got, GuestAddress(BUFS + 0x3000))
        .unwrap();
    assert_eq!(&got, b"re\x00ply");
    drop(d); // shuts the device thread down
}
