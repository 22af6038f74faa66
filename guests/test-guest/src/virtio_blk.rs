//! A polling virtio-mmio (version 2, "modern") block driver, and the `blk`
//! benchmark and `blkverify` data check built on it.
//!
//! One split virtqueue lives at fixed guest-physical addresses (identity
//! mapped, so driver addresses are device addresses). Each in-flight request
//! owns a fixed chain of three descriptors — header, data, status — so
//! submitting only rewrites the header and the data direction. We ask the
//! device not to interrupt (we poll the used ring) and skip notifications
//! when it says it doesn't need them.

use crate::io::Clock;
use crate::virtio::{
    DESC_F_NEXT, DESC_F_WRITE, MAGIC, Mmio, Rings, USED_F_NO_NOTIFY, rd8, rd16, rd32, reg, wr8,
    wr16, wr32, wr64,
};
use crate::{io, println};
use core::cell::Cell;
use core::sync::atomic::{Ordering, compiler_fence, fence};

/// Which requests a run issues.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Reads only.
    Read,
    /// Writes only.
    Write,
    /// Reads and writes alternately.
    ReadWrite,
}

/// Where requests go.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Block after block, wrapping at the span's end.
    Sequential,
    /// Uniformly random blocks within the span.
    Random,
}

/// One option token.
pub enum BlkOpt {
    Op(Op),
    Pattern(Pattern),
    BlockSize(u64),
    QueueDepth(u64),
    SpanMib(u64),
    Seconds(u64),
    Ios(u64),
}

/// Settings for the next `blk`/`blkverify`.
pub struct Options {
    op: Op,
    pattern: Pattern,
    block_size: u64,
    queue_depth: u64,
    /// MiB of the disk used from its start; 0 = the whole disk.
    span_mib: u64,
    /// Run for this long, if non-zero (overrides `ios`).
    seconds: u64,
    ios: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            op: Op::Read,
            pattern: Pattern::Sequential,
            block_size: 4096,
            queue_depth: 1,
            span_mib: 0,
            seconds: 0,
            ios: 1000,
        }
    }
}

impl Options {
    /// Applies an option token. `secs=` and `ios=` replace each other.
    pub fn set(&mut self, opt: BlkOpt) {
        match opt {
            BlkOpt::Op(op) => self.op = op,
            BlkOpt::Pattern(p) => self.pattern = p,
            BlkOpt::BlockSize(bs) => self.block_size = bs,
            BlkOpt::QueueDepth(qd) => self.queue_depth = qd,
            BlkOpt::SpanMib(mib) => self.span_mib = mib,
            BlkOpt::Seconds(s) => {
                self.seconds = s;
                self.ios = 0;
            }
            BlkOpt::Ios(n) => {
                self.ios = n;
                self.seconds = 0;
            }
        }
    }
}

const DEVICE_ID_BLOCK: u32 = 2;
/// VIRTIO_BLK_F_RO: accepted, so we can refuse to write.
const F_BLK_RO: u64 = 1 << 5;
/// virtio_blk_config.capacity (u64, 512-byte sectors).
const CONFIG_CAPACITY: u64 = 0;

const REQ_IN: u32 = 0;
const REQ_OUT: u32 = 1;
const REQ_STATUS_OK: u8 = 0;
const SECTOR_SIZE: u64 = 512;
const DESCS_PER_REQUEST: u16 = 3;
/// Our queue size when the device allows it (a power of two, per the spec).
const QUEUE_SIZE_MAX: u16 = 256;

/// Guest memory we own for the driver (below `touch=`'s 16 MiB).
const RINGS: Rings = Rings { desc: 0x80_0000 };
const DESC_TABLE: u64 = RINGS.desc;
const AVAIL_RING: u64 = RINGS.avail();
const USED_RING: u64 = RINGS.used();
const REQ_HEADERS: u64 = 0x80_3000;
const REQ_STATUS: u64 = 0x80_4000;
const DATA_AREA: u64 = 0x90_0000;
const DATA_AREA_END: u64 = 0x100_0000;

/// An initialized device with one queue.
struct Device {
    mmio: Mmio,
    queue_size: u16,
    capacity_sectors: u64,
    read_only: bool,
    /// Our next avail index and the next used entry to take: the queue's
    /// state outlives a pass (the device keeps counting).
    avail_idx: Cell<u16>,
    last_used: Cell<u16>,
}

impl Device {
    /// Virtio 1.x initialization (§3.1.1), queue 0 set up, DRIVER_OK.
    fn init(mmio: Mmio) -> Result<Device, &'static str> {
        if mmio.read(reg::MAGIC) != MAGIC {
            return Err("no virtio-mmio device there");
        }
        if mmio.read(reg::DEVICE_ID) != DEVICE_ID_BLOCK {
            return Err("not a block device");
        }
        let accepted = mmio.negotiate(F_BLK_RO)?;
        let queue_size = mmio.setup_queue(0, RINGS, DESCS_PER_REQUEST, QUEUE_SIZE_MAX)?;
        let capacity_sectors = mmio.config64(CONFIG_CAPACITY);
        mmio.driver_ok();
        Ok(Device {
            mmio,
            queue_size,
            capacity_sectors,
            read_only: accepted & F_BLK_RO != 0,
            avail_idx: Cell::new(0),
            last_used: Cell::new(0),
        })
    }

    fn notify(&self) {
        self.mmio.write(reg::QUEUE_NOTIFY, 0);
    }
}

impl Drop for Device {
    /// A reset leaves the device ready for the next run's initialization.
    fn drop(&mut self) {
        self.mmio.write(reg::STATUS, 0);
    }
}

/// What one pass does.
struct Job {
    op: Op,
    pattern: Pattern,
    block_size: u64,
    queue_depth: u16,
    /// Blocks of `block_size` in the span used.
    span_blocks: u64,
    /// Requests to complete, or `None` for a time limit.
    ios: Option<u64>,
    deadline_ticks: u64,
    /// Fill written blocks with / check read blocks against this seed's pattern.
    verify_seed: Option<u64>,
}

/// Latency histogram: exact below 32 ns, then 32 buckets per power of two (≈3%).
struct Histogram {
    buckets: [u32; HISTOGRAM_BUCKETS],
    count: u64,
    max: u64,
}

const SUB_BUCKET_BITS: u32 = 5;
const SUB_BUCKETS: u64 = 1 << SUB_BUCKET_BITS;
const HISTOGRAM_BUCKETS: usize = ((64 - SUB_BUCKET_BITS as usize) + 1) * SUB_BUCKETS as usize;

impl Histogram {
    fn new() -> Self {
        Histogram {
            buckets: [0; HISTOGRAM_BUCKETS],
            count: 0,
            max: 0,
        }
    }

    fn index(v: u64) -> usize {
        if v < SUB_BUCKETS {
            return v as usize;
        }
        let e = 63 - v.leading_zeros();
        let sub = (v >> (e - SUB_BUCKET_BITS)) & (SUB_BUCKETS - 1);
        ((e - SUB_BUCKET_BITS + 1) as u64 * SUB_BUCKETS + sub) as usize
    }

    /// The smallest value that lands in bucket `i`.
    fn lower_bound(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB_BUCKETS {
            return i;
        }
        let e = i / SUB_BUCKETS + u64::from(SUB_BUCKET_BITS) - 1;
        (SUB_BUCKETS + i % SUB_BUCKETS) << (e - u64::from(SUB_BUCKET_BITS))
    }

    fn record(&mut self, v: u64) {
        self.buckets[Self::index(v)] += 1;
        self.count += 1;
        self.max = self.max.max(v);
    }

    /// The `pct`th percentile (bucket lower bound), 0 if empty.
    fn percentile(&self, pct: u64) -> u64 {
        let target = (self.count * pct).div_ceil(100).max(1);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += u64::from(n);
            if seen >= target {
                return Self::lower_bound(i);
            }
        }
        0
    }
}

/// Totals of one pass.
struct Stats {
    ios: u64,
    ns: u64,
    latency: Histogram,
}

/// xorshift64: cheap, good enough to scatter offsets.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The verify pattern's word at a disk byte offset: a misplaced or stale
/// block can't match.
fn pattern_word(seed: u64, disk_offset: u64) -> u64 {
    seed ^ disk_offset.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn fill_pattern(buf: u64, len: u64, seed: u64, disk_offset: u64) {
    for w in (0..len).step_by(8) {
        wr64(buf + w, pattern_word(seed, disk_offset + w));
    }
}

/// The first mismatching byte offset within the block, if any.
fn check_pattern(buf: u64, len: u64, seed: u64, disk_offset: u64) -> Option<u64> {
    (0..len).step_by(8).find(|&w| {
        // SAFETY: inside the slot's data buffer, 8-byte aligned.
        let got = unsafe { ((buf + w) as *const u64).read_volatile() };
        got != pattern_word(seed, disk_offset + w)
    })
}

/// One pass of a job: the queue state and the requests in flight.
struct Pass<'a> {
    dev: &'a Device,
    job: &'a Job,
    slots: [Slot; (QUEUE_SIZE_MAX / DESCS_PER_REQUEST) as usize],
    rng: Rng,
    next_block: u64,
    avail_idx: u16,
    last_used: u16,
    submitted: u64,
    in_flight: u16,
}

impl<'a> Pass<'a> {
    fn new(dev: &'a Device, job: &'a Job) -> Self {
        for slot in 0..job.queue_depth {
            chain_descriptors(slot, job.block_size);
        }
        Pass {
            dev,
            job,
            slots: [Slot::default(); (QUEUE_SIZE_MAX / DESCS_PER_REQUEST) as usize],
            rng: Rng(io::rdtsc() | 1),
            next_block: 0,
            avail_idx: dev.avail_idx.get(),
            last_used: dev.last_used.get(),
            submitted: 0,
            in_flight: 0,
        }
    }

    /// Whether to submit another request.
    fn more(&self) -> bool {
        match self.job.ios {
            Some(n) => self.submitted < n,
            None => io::rdtsc() < self.job.deadline_ticks,
        }
    }

    /// Fills the slot's request and puts it in the avail ring (unpublished).
    fn submit(&mut self, slot: u16) {
        let job = self.job;
        let block = match job.pattern {
            Pattern::Sequential => {
                let b = self.next_block;
                self.next_block = (b + 1) % job.span_blocks;
                b
            }
            Pattern::Random => self.rng.next() % job.span_blocks,
        };
        let write = match job.op {
            Op::Read => false,
            Op::Write => true,
            Op::ReadWrite => self.submitted % 2 == 1,
        };
        let disk_offset = block * job.block_size;
        if let (true, Some(seed)) = (write, job.verify_seed) {
            fill_pattern(
                data_buffer(slot, job.block_size),
                job.block_size,
                seed,
                disk_offset,
            );
        }
        prepare_request(slot, write, disk_offset / SECTOR_SIZE);
        let q = self.dev.queue_size;
        let entry = AVAIL_RING + 4 + 2 * u64::from(self.avail_idx % q);
        wr16(entry, slot * DESCS_PER_REQUEST);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.slots[usize::from(slot)] = Slot {
            started: io::rdtsc(),
            disk_offset,
            write,
        };
        self.submitted += 1;
        self.in_flight += 1;
    }

    /// Makes submitted requests visible and notifies if the device wants it.
    fn publish(&self) {
        // Ring entries and buffers before the index (x86 keeps store order;
        // this stops the compiler reordering).
        compiler_fence(Ordering::Release);
        wr16(AVAIL_RING + 2, self.avail_idx);
        // The index store before reading the device's flag (store→load: mfence).
        fence(Ordering::SeqCst);
        if rd16(USED_RING) & USED_F_NO_NOTIFY == 0 {
            self.dev.notify();
        }
    }

    /// Takes one used entry: checks it, returns (slot, its bookkeeping).
    fn complete(&mut self) -> Result<(u16, Slot), &'static str> {
        let q = self.dev.queue_size;
        let id = rd32(USED_RING + 4 + 8 * u64::from(self.last_used % q));
        self.last_used = self.last_used.wrapping_add(1);
        let per = u32::from(DESCS_PER_REQUEST);
        let slot = u16::try_from(id / per).unwrap_or(u16::MAX);
        if slot >= self.job.queue_depth || id % per != 0 {
            return Err("the device returned a descriptor we never submitted");
        }
        self.in_flight -= 1;
        let s = self.slots[usize::from(slot)];
        let status = rd8(REQ_STATUS + u64::from(slot));
        if status != REQ_STATUS_OK {
            println!(
                "blk: request failed: status={status} offset={}",
                s.disk_offset
            );
            return Err("i/o error");
        }
        if let (false, Some(seed)) = (s.write, self.job.verify_seed) {
            let buf = data_buffer(slot, self.job.block_size);
            if let Some(at) = check_pattern(buf, self.job.block_size, seed, s.disk_offset) {
                println!(
                    "blkverify: mismatch at disk offset {} (block at {})",
                    s.disk_offset + at,
                    s.disk_offset
                );
                return Err("data verification failed");
            }
        }
        Ok((slot, s))
    }
}

/// Runs one pass of `job` on `dev`, keeping `queue_depth` requests in flight.
fn run_job(dev: &Device, job: &Job, clock: &Clock) -> Result<Stats, &'static str> {
    let mut pass = Pass::new(dev, job);
    let mut stats = Stats {
        ios: 0,
        ns: 0,
        latency: Histogram::new(),
    };
    let start = io::rdtsc();
    for slot in 0..job.queue_depth {
        if !pass.more() {
            break;
        }
        pass.submit(slot);
    }
    pass.publish();
    while pass.in_flight > 0 {
        let used_idx = rd16(USED_RING + 2);
        if used_idx == pass.last_used {
            core::hint::spin_loop();
            continue;
        }
        // The used index before the entries and data it covers.
        fence(Ordering::Acquire);
        let mut resubmitted = false;
        while pass.last_used != used_idx {
            let (slot, s) = pass.complete()?;
            let done = io::rdtsc();
            stats.latency.record(clock.ns(done - s.started));
            stats.ios += 1;
            stats.ns = clock.ns(done - start);
            if pass.more() {
                pass.submit(slot);
                resubmitted = true;
            }
        }
        if resubmitted {
            pass.publish();
        }
    }
    dev.avail_idx.set(pass.avail_idx);
    dev.last_used.set(pass.last_used);
    Ok(stats)
}

/// Bookkeeping for one in-flight request.
#[derive(Clone, Copy, Default)]
struct Slot {
    started: u64,
    disk_offset: u64,
    write: bool,
}

fn data_buffer(slot: u16, block_size: u64) -> u64 {
    DATA_AREA + u64::from(slot) * block_size
}

fn descriptor(index: u16) -> u64 {
    DESC_TABLE + 16 * u64::from(index)
}

/// The slot's fixed chain: header → data → status.
fn chain_descriptors(slot: u16, block_size: u64) {
    let head = slot * DESCS_PER_REQUEST;
    let parts = [
        (REQ_HEADERS + 16 * u64::from(slot), 16),
        (data_buffer(slot, block_size), block_size as u32),
        (REQ_STATUS + u64::from(slot), 1),
    ];
    for (i, (addr, len)) in parts.into_iter().enumerate() {
        let d = descriptor(head + i as u16);
        wr64(d, addr);
        wr32(d + 8, len);
        let last = i == parts.len() - 1;
        wr16(d + 12, if last { DESC_F_WRITE } else { DESC_F_NEXT });
        wr16(d + 14, if last { 0 } else { head + i as u16 + 1 });
    }
}

/// Header type and sector, the data buffer's direction, a not-done status.
fn prepare_request(slot: u16, write: bool, sector: u64) {
    let header = REQ_HEADERS + 16 * u64::from(slot);
    wr32(header, if write { REQ_OUT } else { REQ_IN });
    wr32(header + 4, 0);
    wr64(header + 8, sector);
    let data_flags = if write {
        DESC_F_NEXT
    } else {
        DESC_F_NEXT | DESC_F_WRITE
    };
    wr16(descriptor(slot * DESCS_PER_REQUEST + 1) + 12, data_flags);
    wr8(REQ_STATUS + u64::from(slot), 0xff);
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
        Op::ReadWrite => "rw",
    }
}

fn pattern_name(p: Pattern) -> &'static str {
    match p {
        Pattern::Sequential => "seq",
        Pattern::Random => "rand",
    }
}

/// Checks the options against the device and our memory; builds the job.
fn plan(opts: &Options, dev: &Device, clock: &Clock) -> Result<Job, &'static str> {
    let bs = opts.block_size;
    if bs == 0 || bs % SECTOR_SIZE != 0 || bs > u64::from(u32::MAX) {
        return Err("bs must be a non-zero multiple of 512");
    }
    let max_qd = dev.queue_size / DESCS_PER_REQUEST;
    let qd = u16::try_from(opts.queue_depth)
        .ok()
        .filter(|&qd| (1..=max_qd).contains(&qd))
        .ok_or("qd must be between 1 and the queue size / 3")?;
    if u64::from(qd) * bs > DATA_AREA_END - DATA_AREA {
        return Err("qd × bs must fit in 7 MiB of buffers");
    }
    let disk_bytes = dev.capacity_sectors * SECTOR_SIZE;
    let span_bytes = match opts.span_mib {
        0 => disk_bytes,
        mib => mib.saturating_mul(1 << 20),
    };
    if span_bytes > disk_bytes {
        return Err("blkmib is larger than the disk");
    }
    let span_blocks = span_bytes / bs;
    if span_blocks == 0 {
        return Err("the span holds no block of this size");
    }
    if opts.op != Op::Read && dev.read_only {
        return Err("the device is read-only");
    }
    let (ios, deadline_ticks) = match opts.seconds {
        0 => (Some(opts.ios), 0),
        s => (
            None,
            io::rdtsc() + clock.ticks(s.saturating_mul(1_000_000_000)),
        ),
    };
    Ok(Job {
        op: opts.op,
        pattern: opts.pattern,
        block_size: bs,
        queue_depth: qd,
        span_blocks,
        ios,
        deadline_ticks,
        verify_seed: None,
    })
}

/// `blk[=BASE]` (benchmark, one result line) or `blkverify[=BASE]` (write a
/// pattern over the span with the current bs/qd/pattern, read it all back).
pub fn run(
    opts: &Options,
    base: Option<u64>,
    verify: bool,
    clock: &Clock,
) -> Result<(), &'static str> {
    let mmio = match base {
        Some(b) => Mmio(b),
        None => Mmio::find(DEVICE_ID_BLOCK).ok_or("no virtio-blk device found")?,
    };
    let dev = Device::init(mmio)?;
    let mut job = plan(opts, &dev, clock)?;
    if verify {
        return verify_span(&dev, &mut job, clock);
    }
    let stats = run_job(&dev, &job, clock)?;
    let bytes = stats.ios * job.block_size;
    let ns = stats.ns.max(1);
    let iops = u128::from(stats.ios) * 1_000_000_000 / u128::from(ns);
    // MiB/s with two decimals, in integers.
    let mibps_x100 = u128::from(bytes) * 100 * 1_000_000_000 / (u128::from(ns) << 20);
    println!(
        "blk: op={} bs={} qd={} pattern={} ios={} bytes={bytes} ns={} iops={iops} mibps={}.{:02} lat_p50_ns={} lat_p99_ns={} lat_max_ns={} dev={:#x}",
        op_name(job.op),
        job.block_size,
        job.queue_depth,
        pattern_name(job.pattern),
        stats.ios,
        stats.ns,
        mibps_x100 / 100,
        mibps_x100 % 100,
        stats.latency.percentile(50),
        stats.latency.percentile(99),
        stats.latency.max,
        dev.mmio.0,
    );
    Ok(())
}

/// Writes every block of the span (sequentially, with the job's bs and qd) with a pattern seeded
/// from the TSC — so stale data from an earlier run can't pass — then reads
/// every block back and compares.
fn verify_span(dev: &Device, job: &mut Job, clock: &Clock) -> Result<(), &'static str> {
    if dev.read_only {
        return Err("the device is read-only");
    }
    let seed = io::rdtsc();
    job.verify_seed = Some(seed);
    job.ios = Some(job.span_blocks);
    // Sequential passes cover every block exactly once.
    job.pattern = Pattern::Sequential;
    job.op = Op::Write;
    let written = run_job(dev, job, clock)?;
    job.op = Op::Read;
    let read = run_job(dev, job, clock)?;
    println!(
        "blkverify: ok blocks={} bytes={} bs={} qd={} write_ns={} read_ns={} dev={:#x}",
        read.ios,
        read.ios * job.block_size,
        job.block_size,
        job.queue_depth,
        written.ns,
        read.ns,
        dev.mmio.0,
    );
    Ok(())
}
