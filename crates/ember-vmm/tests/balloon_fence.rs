//! The balloon as the fence of `--prefault async`, driven through its MMIO window
//! by a fake guest driver (as Linux's virtio_balloon does it: 4 KiB frame numbers,
//! up to 256 per buffer, deflates acknowledged before the pages are reused), on
//! real guest memory whose residency is checked from the host with mincore.
//!
//! The invariant under test: every page the guest owns (not in the balloon) after
//! it inflated, and every page it gets back by a deflate, is committed. And the
//! converse: a page the balloon holds, once discarded, stays off the host even
//! when the kernel collapses huge pages (`MADV_COLLAPSE`, as khugepaged does)
//! or a neighbour faults in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_vmm::devices::CountingInterrupt;
use ember_vmm::devices::virtio::{Balloon, BalloonHandle, MmioTransport};
use ember_vmm::events::Recorder;
use ember_vmm::prefault::{self, Committer, MemoryOptions};
use ember_vmm::vstate::bus::BusDevice;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

const PAGE: u64 = 4096;
/// Not a multiple of the chunk (nor of 2 MiB): the last step is a short one.
const SIZE: u64 = (60 << 20) + 3 * PAGE;
const WINDOW: u64 = 8 << 20;
const CHUNK: u64 = 16 << 20;
/// Frame numbers per buffer, as Linux sends them.
const BATCH: usize = 256;

const STATUS: u64 = 0x070;
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_AVAIL_LOW: u64 = 0x090;
const QUEUE_USED_LOW: u64 = 0x0a0;
const CONFIG_NUM_PAGES: u64 = 0x100;
const CONFIG_ACTUAL: u64 = 0x104;
const QSIZE: u16 = 16;
/// Queue rings (desc, avail +0x1000, used +0x2000) and each queue's frame buffer.
const RINGS: [u64; 2] = [0x1_0000, 0x2_0000];
const BUFS: [u64; 2] = [0x3_0000, 0x3_1000];

struct Queue {
    next_desc: u16,
    avail_idx: u16,
}

/// A balloon driver living in guest memory.
struct Driver {
    dev: MmioTransport,
    mem: GuestMemoryMmap,
    queues: [Queue; 2],
    /// Frames in the balloon, last inflated last.
    held: Vec<u32>,
}

impl Driver {
    fn new(mem: &GuestMemoryMmap, balloon: Balloon) -> Self {
        let irq = Arc::new(CountingInterrupt::default());
        let dev = MmioTransport::new(balloon, mem.clone(), irq).unwrap();
        Driver {
            dev,
            mem: mem.clone(),
            queues: [0, 1].map(|_| Queue {
                next_desc: 0,
                avail_idx: 0,
            }),
            held: Vec::new(),
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

    /// VERSION_1 and MUST_TELL_HOST: the inflate and deflate queues only.
    fn bring_up(&mut self) {
        self.write(STATUS, 1);
        self.write(STATUS, 3);
        self.write(DRIVER_FEATURES_SEL, 0);
        self.write(DRIVER_FEATURES, 1);
        self.write(DRIVER_FEATURES_SEL, 1);
        self.write(DRIVER_FEATURES, 1);
        self.write(STATUS, 0xb);
        for (q, base) in RINGS.iter().enumerate() {
            self.write(QUEUE_SEL, q as u32);
            self.write(QUEUE_NUM, QSIZE.into());
            self.write(QUEUE_DESC_LOW, *base as u32);
            self.write(QUEUE_AVAIL_LOW, (base + 0x1000) as u32);
            self.write(QUEUE_USED_LOW, (base + 0x2000) as u32);
            self.write(QUEUE_READY, 1);
        }
        self.write(STATUS, 0xf);
        assert_eq!(self.read(STATUS), 0xf, "the balloon is live");
    }

    fn target(&mut self) -> u32 {
        self.read(CONFIG_NUM_PAGES)
    }

    /// Sends one buffer (addr, len) on queue `q` and waits until the device returns it.
    fn send_raw(&mut self, q: usize, addr: u64, len: u32) {
        let base = RINGS[q];
        let queue = &mut self.queues[q];
        let d = base + u64::from(queue.next_desc % QSIZE) * 16;
        self.mem.write_obj(addr, GuestAddress(d)).unwrap();
        self.mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        self.mem.write_obj(0u16, GuestAddress(d + 12)).unwrap();
        let slot = base + 0x1000 + 4 + 2 * u64::from(queue.avail_idx % QSIZE);
        self.mem
            .write_obj(queue.next_desc % QSIZE, GuestAddress(slot))
            .unwrap();
        queue.next_desc = queue.next_desc.wrapping_add(1);
        queue.avail_idx = queue.avail_idx.wrapping_add(1);
        let want = queue.avail_idx;
        self.mem
            .write_obj(want, GuestAddress(base + 0x1000 + 2))
            .unwrap();
        self.dev.queue_evts()[q].write(1).unwrap();
        let start = Instant::now();
        while self
            .mem
            .read_obj::<u16>(GuestAddress(base + 0x2000 + 2))
            .unwrap()
            != want
        {
            assert!(start.elapsed() < Duration::from_secs(10), "queue {q} stuck");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn send(&mut self, q: usize, pfns: &[u32]) {
        for batch in pfns.chunks(BATCH) {
            let bytes: Vec<u8> = batch.iter().flat_map(|p| p.to_le_bytes()).collect();
            self.mem.write_slice(&bytes, GuestAddress(BUFS[q])).unwrap();
            self.send_raw(q, BUFS[q], bytes.len() as u32);
        }
    }

    fn inflate(&mut self, pfns: &[u32]) {
        self.send(0, pfns);
        self.held.extend_from_slice(pfns);
        let n = self.held.len() as u32;
        self.write(CONFIG_ACTUAL, n);
    }

    /// Deflates the most recently inflated `n` pages (Linux's order) and returns them.
    fn deflate(&mut self, n: usize) -> Vec<u32> {
        let back = self
            .held
            .split_off(self.held.len() - n.min(self.held.len()));
        self.send(1, &back);
        let n = self.held.len() as u32;
        self.write(CONFIG_ACTUAL, n);
        back
    }

    /// Follows the target: deflates (or inflates from `spare`) until the balloon
    /// matches it; returns the pages deflated.
    fn follow(&mut self, spare: &mut Vec<u32>) -> Vec<u32> {
        let target = self.target() as usize;
        if self.held.len() > target {
            self.deflate(self.held.len() - target)
        } else {
            let take = (target - self.held.len()).min(spare.len());
            let pfns = spare.split_off(spare.len() - take);
            self.inflate(&pfns);
            Vec::new()
        }
    }

    /// The guest uses a page: writes a pattern and reads it back.
    fn touch(&self, pfn: u32) {
        let at = GuestAddress(u64::from(pfn) * PAGE);
        self.mem.write_obj(pfn ^ 0x5a5a_5a5a, at).unwrap();
        assert_eq!(self.mem.read_obj::<u32>(at).unwrap(), pfn ^ 0x5a5a_5a5a);
    }
}

const HUGE: u64 = 2 << 20;
/// `MADV_COLLAPSE` (Linux 6.1), not in every libc crate release.
const MADV_COLLAPSE: i32 = 25;

fn host(mem: &GuestMemoryMmap, addr: u64) -> u64 {
    mem.get_host_address(GuestAddress(addr)).unwrap() as u64
}

/// How many pages of guest `addr..addr+len` are resident on the host.
fn resident_pages(mem: &GuestMemoryMmap, addr: u64, len: u64) -> usize {
    let mut vec = vec![0u8; len.div_ceil(PAGE) as usize];
    // SAFETY: `addr..addr+len` is guest memory, mapped; mincore only reads
    // the page tables into `vec`, one byte a page.
    let rc = unsafe { libc::mincore(host(mem, addr) as *mut _, len as usize, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

/// Asks the kernel to collapse the 2 MiB range of guest memory at `at` into
/// one huge page, as khugepaged would (filling holes with zeroes); the error
/// when it refuses.
fn collapse(mem: &GuestMemoryMmap, at: u64) -> Result<(), std::io::Error> {
    let at = at / HUGE * HUGE;
    // SAFETY: a 2 MiB range of guest memory (host-aligned with it); collapsing
    // moves pages into a huge page without changing what they read.
    let rc = unsafe { libc::madvise(host(mem, at) as *mut _, HUGE as usize, MADV_COLLAPSE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Collapses every 2 MiB range around `ranges` (guest-physical), whatever
/// the kernel says: a range it refuses stays as it was.
fn collapse_around(mem: &GuestMemoryMmap, ranges: &[(u64, u64)]) {
    let mut done = std::collections::BTreeSet::new();
    for &(s, e) in ranges {
        for at in (s / HUGE * HUGE..e).step_by(HUGE as usize) {
            if done.insert(at) {
                let _ = collapse(mem, at);
            }
        }
    }
}

/// Whether the collapse these tests rely on works here: a 2 MiB range of
/// `mem` with one page touched must become one huge page. Fails loudly on a
/// kernel without `MADV_COLLAPSE`; false (said on stderr) when no huge page
/// can be had for seconds (the host's memory fragmented, or khugepaged
/// contending): then only the fault half of a test proves anything.
fn collapse_works(mem: &GuestMemoryMmap, at: u64) -> bool {
    mem.write_obj(1u8, GuestAddress(at)).unwrap();
    let mut last = None;
    for _ in 0..100 {
        match collapse(mem, at) {
            Ok(()) => {
                assert_eq!(resident_pages(mem, at, HUGE), 512);
                return true;
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM)) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!(
                "MADV_COLLAPSE does not work on this host (Linux 6.1+ with transparent huge pages is needed): {e}"
            ),
        }
    }
    eprintln!(
        "warning: MADV_COLLAPSE got no huge page in 5 s ({last:?}): collapses prove nothing in this run"
    );
    false
}

/// The huge-page advice of the mapping holding guest `addr`: `Some(true)`
/// for MADV_HUGEPAGE, `Some(false)` for MADV_NOHUGEPAGE (smaps' `hg`, `nh`).
fn huge_advice(mem: &GuestMemoryMmap, addr: u64) -> Option<bool> {
    let at = host(mem, addr);
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut ours = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            ours = (a..b).contains(&at);
            continue;
        }
        if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| ours) {
            let f: Vec<_> = flags.split_whitespace().collect();
            return match (f.contains(&"hg"), f.contains(&"nh")) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            };
        }
    }
    panic!("guest address {addr:#x} is not mapped");
}

/// A balloon fenced by a committer over `SIZE` bytes with the window committed.
fn setup() -> (GuestMemoryMmap, Committer, BalloonHandle, Driver) {
    let mem = prefault::create_memory(SIZE, &MemoryOptions::default()).unwrap();
    let committer = Committer::new(&mem, 2);
    committer.set_fence_up(true);
    committer.commit_window(WINDOW).unwrap();
    let balloon = Balloon::new(0).unwrap();
    let handle = balloon.handle();
    handle.set_fence_pages(((SIZE - WINDOW) / PAGE) as u32);
    handle.set_fence(committer.fence());
    let driver = Driver::new(&mem, balloon);
    (mem, committer, handle, driver)
}

fn all_pfns() -> Vec<u32> {
    (0..(SIZE / PAGE) as u32).collect()
}

/// A fixed shuffle (an LCG), so runs are repeatable.
fn shuffle(v: &mut [u32], mut seed: u64) {
    for i in (1..v.len()).rev() {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (seed >> 33) as usize % (i + 1));
    }
}

/// Every page the guest owns is committed (recorded, and resident per mincore).
fn assert_fence(committer: &Committer, handle: &BalloonHandle, when: &str) {
    let owned = handle.not_held(0, SIZE, u64::MAX);
    assert!(!owned.is_empty());
    for (s, e) in owned {
        assert!(
            committer.is_committed(s, e - s),
            "{when}: owned {s:#x}..{e:#x} is not recorded as committed"
        );
        assert!(
            committer.is_resident(s, e - s),
            "{when}: owned {s:#x}..{e:#x} is not resident"
        );
    }
}

#[test]
fn a_guest_never_gets_an_uncommitted_page() {
    let (_mem, committer, handle, mut d) = setup();
    // Before anything: the window is committed, the rest is not.
    assert!(committer.is_resident(0, WINDOW));
    assert!(!committer.is_resident(WINDOW, SIZE - WINDOW));
    d.bring_up();
    // The driver inflates to the target with the pages above the window, in a
    // scattered order, as an allocator hands them out.
    let mut high: Vec<u32> = all_pfns()[(WINDOW / PAGE) as usize..].to_vec();
    shuffle(&mut high, 7);
    assert_eq!(d.target() as usize, high.len());
    d.inflate(&high);
    assert_eq!(handle.held_bytes(), SIZE - WINDOW);
    assert_eq!(
        handle.held_ranges(),
        1,
        "adjacent pages merge into one range"
    );
    assert_fence(&committer, &handle, "after inflating");
    let mut spare = Vec::new();
    let mut steps = 0;
    loop {
        let done = committer.advance(Some(&handle), CHUNK).unwrap();
        steps += 1;
        let back = d.follow(&mut spare);
        for &p in &back {
            assert!(
                committer.is_resident(u64::from(p) * PAGE, PAGE),
                "step {steps}: deflated page {p:#x} is not resident"
            );
            d.touch(p);
        }
        assert_fence(&committer, &handle, &format!("step {steps}"));
        if done == 0 {
            break;
        }
        assert!(done <= CHUNK);
    }
    // At most (SIZE - WINDOW) / CHUNK steps, one short one and one that finds
    // nothing left (fewer when deflates committed pages ahead of the chunks).
    assert!((2..=(SIZE - WINDOW).div_ceil(CHUNK) as usize + 1).contains(&steps));
    assert_eq!(committer.committed_bytes(), SIZE);
    assert_eq!(d.target(), 0);
    assert_eq!(handle.held_bytes(), 0);
    assert!(committer.is_resident(0, SIZE));
    for p in all_pfns() {
        d.touch(p);
    }
}

#[test]
fn memory_the_guest_kept_is_committed_before_the_rest() {
    let (_mem, committer, handle, mut d) = setup();
    d.bring_up();
    // This driver inflates pages from anywhere (window included), so it keeps
    // uncommitted pages above the window: the committer must take those first.
    let mut pfns = all_pfns();
    shuffle(&mut pfns, 99);
    let n = d.target() as usize;
    let (inflated, _) = pfns.split_at(n);
    d.inflate(inflated);
    let owned = handle.not_held(0, SIZE, u64::MAX);
    let owned_uncommitted: u64 = owned
        .iter()
        .filter(|&&(s, _)| s >= WINDOW)
        .map(|&(s, e)| e - s)
        .sum();
    assert!(owned_uncommitted > 0);
    let steps = owned_uncommitted.div_ceil(CHUNK);
    for _ in 0..steps {
        committer.advance(Some(&handle), CHUNK).unwrap();
    }
    assert_fence(&committer, &handle, "after the owned pages' steps");
    // The target only dropped by what was committed; deflates follow it.
    let mut spare = Vec::new();
    while committer.advance(Some(&handle), CHUNK).unwrap() > 0 {
        for p in d.follow(&mut spare) {
            assert!(committer.is_resident(u64::from(p) * PAGE, PAGE));
            d.touch(p);
        }
        assert_fence(&committer, &handle, "later");
    }
    d.follow(&mut spare);
    assert_eq!(handle.held_bytes(), 0);
    assert!(committer.is_resident(0, SIZE));
}

#[test]
fn a_hostile_driver_cannot_crash_leak_or_get_uncommitted_memory() {
    let (_mem, committer, handle, mut d) = setup();
    d.bring_up();
    let ram_pages = (SIZE / PAGE) as u32;
    // Out of range, duplicated, and at the top of the 32-bit space.
    d.send(
        0,
        &[ram_pages, ram_pages + 1, u32::MAX, 0xfffff, 42, 42, 42],
    );
    assert_eq!(handle.held_bytes(), PAGE, "only page 42 is RAM");
    d.send(1, &[u32::MAX, ram_pages + 7]);
    // Deflating pages never inflated commits them (and harms nothing).
    let stray = ram_pages - 3;
    d.send(1, &[stray]);
    assert!(committer.is_resident(u64::from(stray) * PAGE, PAGE));
    // Buffers outside guest memory or empty.
    d.send_raw(0, SIZE + 0x1000, 1024);
    d.send_raw(1, u64::MAX - 8, 1024);
    d.send_raw(0, BUFS[0], 0);
    d.send_raw(0, BUFS[0], 3);
    // Inflate and deflate the same scattered pages over and over.
    let mut some: Vec<u32> = (ram_pages / 2..ram_pages / 2 + 1024).collect();
    shuffle(&mut some, 3);
    for round in 0..200 {
        let part = &some[(round % 4) * 256..(round % 4 + 1) * 256];
        d.send(0, part);
        d.send(1, part);
        for &p in part {
            assert!(committer.is_resident(u64::from(p) * PAGE, PAGE));
        }
    }
    assert_eq!(handle.held_bytes(), PAGE, "back to page 42 only");
    assert!(handle.held_ranges() <= 1);
    // Every other page inflated: the worst case for merging stays bounded by RAM.
    let every_other: Vec<u32> = (0..ram_pages).step_by(2).collect();
    d.send(0, &every_other);
    assert_eq!(handle.held_ranges(), every_other.len());
    d.send(1, &every_other);
    d.send(1, &[42]);
    assert_eq!((handle.held_bytes(), handle.held_ranges()), (0, 0));
    // The device still works: a real inflate and deflate go through.
    d.inflate(&[100, 101]);
    assert_eq!(handle.held(), [(100 * PAGE, 102 * PAGE)]);
    assert_eq!(d.deflate(2), [100, 101]);
    assert!(handle.deflated_pages() > 0);
}

#[test]
fn background_commit_completes_and_releases_what_the_user_asked_for() {
    let (mem, committer, handle, mut d) = setup();
    d.bring_up();
    let user_target = 4 << 20;
    let recorder = Arc::new(Recorder::new(true));
    let opts = MemoryOptions {
        chunk: CHUNK,
        driver_timeout: Duration::from_secs(30),
        ..MemoryOptions::default()
    };
    let mut spare: Vec<u32> = all_pfns()[(WINDOW / PAGE) as usize..].to_vec();
    shuffle(&mut spare, 5);
    // The user's target, given while the fence is up (as the control socket may).
    handle.set_target_bytes(user_target);
    assert_eq!(
        u64::from(d.target()) * PAGE,
        SIZE - WINDOW,
        "the fence's floor wins"
    );
    let bg = committer
        .start_background(Some(handle.clone()), &opts, recorder.clone())
        .unwrap();
    // The driver follows the target as a config interrupt would make it do.
    let start = Instant::now();
    while !bg.is_finished() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "background commit stuck"
        );
        for p in d.follow(&mut spare) {
            assert!(committer.is_resident(u64::from(p) * PAGE, PAGE));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    bg.join().unwrap();
    // A driver still inflating towards an older target when the commit finished
    // catches up now (what it inflated since is discarded, what it deflates is
    // committed again).
    for p in d.follow(&mut spare) {
        assert!(committer.is_resident(u64::from(p) * PAGE, PAGE));
    }
    let kinds: Vec<String> = recorder
        .snapshot()
        .events
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, [prefault::EVENT_COMMITTED, prefault::EVENT_VISIBLE]);
    assert_eq!(u64::from(d.target()) * PAGE, user_target);
    assert_eq!(handle.held_bytes(), user_target);
    // What the balloon still holds went back to the host once the fence came
    // down, and stays there when huge pages are collapsed around it.
    collapse_around(&mem, &handle.held());
    for (s, e) in handle.held() {
        assert!(!committer.is_resident(s, e - s), "{s:#x} still resident");
    }
    assert_eq!(committer.committed_bytes(), SIZE - user_target);
    assert_fence(&committer, &handle, "at the end");
    // Now inflates discard at once, and a deflate commits again.
    let more: Vec<u32> = (1000..1016).collect();
    d.inflate(&more);
    collapse_around(&mem, &[(1000 * PAGE, 1016 * PAGE)]);
    for &p in &more {
        assert!(!committer.is_resident(u64::from(p) * PAGE, PAGE));
    }
    d.deflate(16);
    for &p in &more {
        assert!(committer.is_resident(u64::from(p) * PAGE, PAGE));
    }
    // Their 2 MiB range holds no other page of the balloon's: it may be a
    // huge page again.
    assert!(
        handle
            .not_held(1000 * PAGE / HUGE * HUGE, 1016 * PAGE, 0)
            .is_empty()
    );
    assert_eq!(
        huge_advice(&mem, 1000 * PAGE),
        Some(true),
        "given back to huge pages"
    );
}

/// Without a fence (no `--prefault`): inflated pages are discarded at once, and
/// neither a collapse nor a fault next to them brings them back; deflated, their
/// memory goes back to huge pages.
#[test]
fn ballooned_pages_stay_discarded_around_huge_pages() {
    let mem = prefault::create_memory(SIZE, &MemoryOptions::default()).unwrap();
    collapse_works(&mem, 30 << 20);
    let balloon = Balloon::new(0).unwrap();
    let handle = balloon.handle();
    let mut d = Driver::new(&mem, balloon);
    d.bring_up();
    // Guest memory in use (a huge page, as the guest's first touch makes
    // them), and beside it a 2 MiB range the guest never touched.
    let (scattered, whole) = (16u64 << 20, 18u64 << 20);
    for at in (scattered..whole).step_by(PAGE as usize) {
        mem.write_obj(0xa5u8, GuestAddress(at)).unwrap();
    }
    // Every eighth page of the first, and all of the untouched one.
    let page = |a: u64| (a / PAGE) as u32;
    let mut pfns: Vec<u32> = (page(scattered)..page(whole)).step_by(8).collect();
    pfns.extend(page(whole)..page(whole + HUGE));
    d.inflate(&pfns);
    assert_eq!(resident_pages(&mem, scattered, 2 * HUGE), 512 - 64);
    collapse_around(&mem, &[(scattered, whole + HUGE)]);
    for &p in &pfns {
        assert_eq!(
            resident_pages(&mem, u64::from(p) * PAGE, PAGE),
            0,
            "ballooned page {p:#x} is back after a collapse"
        );
    }
    // One page of the untouched range comes back and the guest touches it:
    // that fault must not bring the other 511 in with it as one huge page.
    let back = d.deflate(1);
    assert_eq!(back, [page(whole + HUGE) - 1]);
    d.touch(back[0]);
    assert_eq!(
        resident_pages(&mem, whole, HUGE),
        1,
        "a huge page was faulted in"
    );
    assert_eq!(
        huge_advice(&mem, whole),
        Some(false),
        "still off huge pages"
    );
    // All back: huge pages again (a collapse succeeds), and the guest's data
    // around the holes survived.
    d.deflate(pfns.len());
    assert_eq!(handle.held_bytes(), 0);
    assert_eq!(
        huge_advice(&mem, scattered),
        Some(true),
        "back on huge pages"
    );
    assert_eq!(huge_advice(&mem, whole), Some(true), "back on huge pages");
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(scattered + PAGE)).unwrap(),
        0xa5
    );
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(scattered)).unwrap(),
        0,
        "ballooned"
    );
}

#[test]
fn a_driverless_guest_gets_its_memory_committed_anyway() {
    let (_mem, committer, handle, _d) = setup();
    let recorder = Arc::new(Recorder::new(true));
    // Paced at 64 MiB/s: the 52 MiB above the window take at least ~0.8 s.
    let opts = MemoryOptions {
        chunk: CHUNK,
        driver_timeout: Duration::from_millis(50),
        rate: 64 << 20,
        ..MemoryOptions::default()
    };
    let start = Instant::now();
    committer
        .start_background(Some(handle.clone()), &opts, recorder.clone())
        .unwrap()
        .join()
        .unwrap();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(750), "not paced: {took:?}");
    assert!(committer.is_resident(0, SIZE));
    assert_eq!(committer.committed_bytes(), SIZE);
    assert_eq!(handle.target_pages(), 0);
    assert!(!handle.driver_active());
}
