//! Committing guest memory: `--prefault sync|async`, `--mem-lock`, `--hugepages`.
//!
//! Guest RAM is mapped lazily (`vstate::memory`): a page costs the host nothing
//! until the guest touches it. Some guests want the opposite — no page faults once
//! the workload runs, no overcommit surprise hours later, huge pages, locked
//! memory — and paying for it all before the first guest instruction makes boot
//! time grow with memory size (Alibaba, KVM Forum 2020: ~20 s at 8 GiB).
//!
//! - `sync` commits every page before the guest starts: `MADV_POPULATE_WRITE`
//!   on several threads, split at huge-page boundaries so no huge page is shared
//!   between two threads.
//! - `async` commits a boot window (the low guest-physical memory the kernel is
//!   loaded into) before the guest starts, starts the guest with the balloon's
//!   target set to the rest, and commits the rest on a background thread in
//!   large chunks. After each chunk the target drops by what is now committed;
//!   the driver deflates, and each deflate is acknowledged only after its pages
//!   are committed ([`MemoryFence::commit`]): the balloon is the fence that keeps
//!   the guest off memory that is not ready. The committer prefers memory the
//!   guest already owns (not in the balloon) to memory it does not, so a guest
//!   that inflated other pages than the high ones is covered first.
//!   While the fence is up, inflated pages are kept (they come back committed);
//!   once everything is committed and the driver has deflated to the final
//!   target, what the balloon still holds (a `--balloon-target`) is released.
//! - A guest without a balloon driver cannot be fenced: its memory is committed
//!   in the background all the same, and ember says so once on stderr.
//! - With either mode the balloon offers no free page reporting (`builder`):
//!   reported pages would be dropped from the host, undoing the commitment.
//!   Only a balloon target (`--balloon-target`, the control socket) gives
//!   committed memory back.

use crate::devices::virtio::balloon::MemoryFence;
use crate::devices::virtio::{BalloonHandle, MemHandle};
use crate::events::Recorder;
use crate::ranges::RangeSet;
use crate::vstate::memory::{self, MemoryError};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;
use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress, MmapRegion,
};

/// Page granularity of commitment and of the balloon.
const PAGE: u64 = 4096;
/// Work units of a parallel populate are cut at multiples of this (host
/// address), so a transparent huge page is never populated by two threads.
const HUGE_PAGE: u64 = 2 << 20;
/// One thread's share of a populate, at most (big enough that the madvise
/// call itself is noise, small enough that threads finish together).
const POPULATE_UNIT: u64 = 64 << 20;
/// The boot window of `async` when none is given.
pub(crate) const DEFAULT_WINDOW: u64 = 256 << 20;
/// The background chunk of `async` when none is given.
pub(crate) const DEFAULT_CHUNK: u64 = 256 << 20;
/// How long `async` waits for a balloon driver before saying there is none.
pub(crate) const DEFAULT_DRIVER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long, after everything is committed, the driver may take to deflate
/// before the fence comes down anyway.
const DEFLATE_WAIT: Duration = Duration::from_secs(120);
/// The background commit's nice value (a thread's own; see `start_background`).
const BACKGROUND_NICE: i32 = 10;
/// Event: every page of guest RAM is committed.
pub const EVENT_COMMITTED: &str = "memory_committed";
/// Event: the guest sees all its memory (the balloon is down to its final target).
pub const EVENT_VISIBLE: &str = "memory_visible";

/// Commitment errors.
#[derive(Debug, Error)]
pub enum CommitError {
    /// A malformed `--prefault` value.
    #[error(
        "bad --prefault `{0}`: {1} (expected sync|async[,window=SIZE][,chunk=SIZE][,rate=SIZE][,threads=N])"
    )]
    Parse(String, String),
    /// MADV_POPULATE_WRITE failed.
    #[error("cannot commit guest memory at {addr:#x} (+{len:#x})")]
    Populate {
        /// Guest-physical start.
        addr: u64,
        /// Bytes.
        len: u64,
        /// Why (ENOMEM: the host is out of memory; EINVAL: kernel older than 5.14).
        #[source]
        source: std::io::Error,
    },
    /// mlock failed.
    #[error(
        "--mem-lock: cannot lock {0} MiB of guest memory (needs CAP_IPC_LOCK or a higher RLIMIT_MEMLOCK)"
    )]
    Lock(u64, #[source] std::io::Error),
    /// No huge pages of either kind.
    #[error("--hugepages: {0}")]
    HugePages(String),
    /// Mapping guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// When guest memory is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefault {
    /// Never up front: pages are allocated on the guest's first touch.
    #[default]
    Off,
    /// All of it before the first guest instruction.
    Sync,
    /// A boot window before, the rest in the background, fenced by the balloon.
    Async,
}

/// How guest memory is backed and committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryOptions {
    /// When memory is committed.
    pub prefault: Prefault,
    /// `async`: bytes committed before boot.
    pub window: u64,
    /// `async`: bytes committed per background step.
    pub chunk: u64,
    /// Populate threads; 0: one per CPU, at most 8 (counted only when memory
    /// is committed: asking costs a dozen system calls on every start).
    pub threads: usize,
    /// `async`: how long a balloon driver may take to show up.
    pub driver_timeout: Duration,
    /// `async`: at most this many bytes a second in the background (0: as fast as
    /// the host goes), so the commit does not starve a busy host.
    pub rate: u64,
    /// mlock guest memory (pages are locked as they are committed).
    pub mem_lock: bool,
    /// Back guest memory with huge pages (hugetlbfs if reserved, else THP).
    pub hugepages: bool,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            prefault: Prefault::Off,
            window: DEFAULT_WINDOW,
            chunk: DEFAULT_CHUNK,
            threads: 0,
            driver_timeout: DEFAULT_DRIVER_TIMEOUT,
            rate: 0,
            mem_lock: false,
            hugepages: false,
        }
    }
}

/// As many populate threads as CPUs, at most 8 (past that, the host's page
/// allocator, not the thread count, is the limit).
fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().min(8))
}

impl MemoryOptions {
    /// Applies a `--prefault` value: `off`, `sync[,threads=N]` or
    /// `async[,window=SIZE][,chunk=SIZE][,rate=SIZE][,threads=N][,driver-timeout=SECS]`
    /// (`rate`: bytes a second).
    pub fn set_prefault(&mut self, spec: &str) -> Result<(), CommitError> {
        let bad = |why: &str| CommitError::Parse(spec.to_owned(), why.to_owned());
        let mut parts = spec.split(',');
        self.prefault = match parts.next().map(str::trim) {
            Some("off") => Prefault::Off,
            Some("sync") => Prefault::Sync,
            Some("async") => Prefault::Async,
            _ => return Err(bad("the mode must be off, sync or async")),
        };
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(&format!("`{part}` is not KEY=VALUE")))?;
            let size = || {
                memory::parse_size(value)
                    .ok()
                    .filter(|&v| v > 0)
                    .ok_or_else(|| bad(&format!("`{value}` is not a size")))
            };
            match key {
                "window" if self.prefault == Prefault::Async => self.window = size()?,
                "rate" if self.prefault == Prefault::Async => self.rate = size()?,
                "chunk" if self.prefault == Prefault::Async => {
                    self.chunk = size()?.next_multiple_of(HUGE_PAGE);
                }
                "driver-timeout" if self.prefault == Prefault::Async => {
                    let secs: f64 = value
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s < 1e6)
                        .ok_or_else(|| bad(&format!("`{value}` is not a number of seconds")))?;
                    self.driver_timeout = Duration::from_secs_f64(secs);
                }
                "threads" if self.prefault != Prefault::Off => {
                    self.threads = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| bad(&format!("`{value}` is not a thread count (1-256)")))?;
                }
                _ => return Err(bad(&format!("unknown option `{key}` here"))),
            }
        }
        Ok(())
    }
}

/// Maps guest memory as `opts` asks: hugetlbfs pages when `--hugepages` and the
/// host has enough reserved, transparent huge pages otherwise (the default
/// advice, `vstate::memory`); locked on fault with `--mem-lock`.
pub fn create_memory(size: u64, opts: &MemoryOptions) -> Result<GuestMemoryMmap, CommitError> {
    memory::check_size(size)?;
    let mem = if opts.hugepages {
        match hugetlb_free()? {
            Some(_) => create_hugetlb(size)?,
            None => memory::create(size)?,
        }
    } else {
        memory::create(size)?
    };
    if opts.mem_lock {
        lock(&mem)?;
    }
    Ok(mem)
}

/// Locks guest memory in host RAM (`--mem-lock`), each page as it is
/// committed: a fresh VM's memory (by [`create_memory`]) or a restored one's.
pub fn lock(mem: &GuestMemoryMmap) -> Result<(), CommitError> {
    for (_, len, host) in host_ranges(mem) {
        // SAFETY: `host..host+len` is guest memory vm-memory maps for `mem`'s
        // lifetime; locking changes residency, never contents. MLOCK_ONFAULT
        // locks each page as it is committed (by the prefault or the guest)
        // instead of faulting everything in here.
        let rc = unsafe { libc::mlock2(host as *const _, len as usize, libc::MLOCK_ONFAULT) };
        if rc != 0 {
            let size: u64 = mem.iter().map(|r| r.len()).sum();
            return Err(CommitError::Lock(
                size >> 20,
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

/// `Some(bytes)` of free hugetlbfs pages when there are some, `None` when the
/// host reserved none but has THP; an error when it has neither.
fn hugetlb_free() -> Result<Option<u64>, CommitError> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (free, page_kib) = (field("HugePages_Free:"), field("Hugepagesize:"));
    if free > 0 && page_kib * 1024 == HUGE_PAGE {
        return Ok(Some(free * HUGE_PAGE));
    }
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[always]") || thp.contains("[madvise]") {
        return Ok(None);
    }
    Err(CommitError::HugePages(
        "the host has no free 2 MiB hugetlbfs pages (/proc/sys/vm/nr_hugepages) and transparent huge pages are off".into(),
    ))
}

/// Guest memory on hugetlbfs pages (2 MiB): reserved at map time, so a host
/// without enough free pages fails here with a clear error rather than with a
/// SIGBUS when the guest touches memory.
fn create_hugetlb(size: u64) -> Result<GuestMemoryMmap, CommitError> {
    let ranges = crate::arch::x86_64::layout::ram_ranges(size);
    let mut regions = Vec::new();
    for (start, len) in ranges {
        if len % HUGE_PAGE != 0 {
            return Err(CommitError::HugePages(format!(
                "hugetlbfs pages need guest memory in whole 2 MiB pages ({len:#x} bytes at {start:#x} is not)"
            )));
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB;
        let region = MmapRegion::build(
            None,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
        )
        .map_err(|e| {
            CommitError::HugePages(format!(
                "cannot map {} MiB of hugetlbfs pages: {e}",
                len >> 20
            ))
        })?;
        // SAFETY: the mapping was just made and is owned by `region`; DONTFORK
        // only affects future forks (see `memory::create`).
        unsafe { libc::madvise(region.as_ptr().cast(), len as usize, libc::MADV_DONTFORK) };
        regions
            .push(GuestRegionMmap::new(region, GuestAddress(start)).ok_or(MemoryError::Map(size))?);
    }
    Ok(GuestMemoryMmap::from_regions(regions).map_err(|_| MemoryError::Map(size))?)
}

/// (guest address, length, host address) of each RAM region.
fn host_ranges(mem: &GuestMemoryMmap) -> Vec<(u64, u64, u64)> {
    mem.iter()
        .filter_map(|r| {
            let host = r.get_host_address(MemoryRegionAddress(0)).ok()? as u64;
            Some((r.start_addr().0, r.len(), host))
        })
        .collect()
}

/// Whether every page of `host..host+len` is resident (mincore), for tests and
/// checks: committed memory is resident memory.
pub(crate) fn resident(host: u64, len: u64) -> std::io::Result<bool> {
    let pages = len.div_ceil(PAGE) as usize;
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` has one byte per page of the range, as mincore writes; the
    // range is a mapping the caller owns (mincore fails with ENOMEM otherwise).
    let rc = unsafe { libc::mincore(host as *mut _, len as usize, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(vec.iter().all(|b| b & 1 != 0))
}

/// Commits guest memory and keeps track of what is committed. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Committer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Keeps the mapping alive as long as the committer needs it.
    _mem: GuestMemoryMmap,
    /// (guest, len, host) of each RAM region.
    ram: Vec<(u64, u64, u64)>,
    /// Guest-physical committed ranges.
    committed: Mutex<RangeSet>,
    /// While up, inflated pages are kept (see the module docs).
    fence_up: AtomicBool,
    threads: usize,
}

impl Committer {
    /// A committer for `mem` populating with `threads` threads; nothing is committed yet.
    pub fn new(mem: &GuestMemoryMmap, threads: usize) -> Self {
        Committer {
            inner: Arc::new(Inner {
                _mem: mem.clone(),
                ram: host_ranges(mem),
                committed: Mutex::new(RangeSet::new()),
                fence_up: AtomicBool::new(false),
                threads: if threads == 0 {
                    default_threads()
                } else {
                    threads
                },
            }),
        }
    }

    /// Bytes of guest RAM.
    pub(crate) fn ram_bytes(&self) -> u64 {
        self.inner.ram.iter().map(|r| r.1).sum()
    }

    /// Bytes committed so far.
    pub fn committed_bytes(&self) -> u64 {
        self.inner.lock().total()
    }

    /// Whether all of guest `addr..addr+len` is recorded as committed.
    pub fn is_committed(&self, addr: u64, len: u64) -> bool {
        self.inner.lock().contains(addr, addr + len)
    }

    /// Whether every page of guest `addr..addr+len` is resident on the host.
    pub fn is_resident(&self, addr: u64, len: u64) -> bool {
        self.inner
            .host_pieces(addr, addr + len)
            .iter()
            .all(|&(_, h, l)| resident(h, l).unwrap_or(false))
    }

    /// The hook the balloon calls (see [`MemoryFence`]).
    pub fn fence(&self) -> Arc<dyn MemoryFence> {
        self.inner.clone()
    }

    /// Raises or lowers the fence (while up, inflated pages are kept).
    pub fn set_fence_up(&self, up: bool) {
        self.inner.fence_up.store(up, Ordering::SeqCst);
    }

    /// Commits all guest RAM (`--prefault sync`).
    pub(crate) fn commit_all(&self) -> Result<(), CommitError> {
        let all: Vec<_> = self.inner.ram.iter().map(|r| (r.0, r.0 + r.1)).collect();
        self.inner.commit(&all)
    }

    /// Commits the lowest `bytes` of guest RAM (the `async` boot window).
    pub fn commit_window(&self, bytes: u64) -> Result<(), CommitError> {
        let mut left = bytes;
        let mut ranges = Vec::new();
        for &(guest, len, _) in &self.inner.ram {
            let take = len.min(left).next_multiple_of(PAGE).min(len);
            if take > 0 {
                ranges.push((guest, guest + take));
            }
            left -= take.min(left);
        }
        self.inner.commit(&ranges)
    }

    /// Bytes from the start of guest RAM (the committer's first region)
    /// committed without a gap: for a virtio-mem region's committer, the
    /// part of the region the driver may be given.
    pub(crate) fn committed_prefix(&self) -> u64 {
        let Some(&(start, len, _)) = self.inner.ram.first() else {
            return 0;
        };
        let committed = self.inner.lock();
        let gap = committed.gaps(start, start + len, 1).first().map(|g| g.0);
        gap.unwrap_or(start + len) - start
    }

    /// Commits what is not committed yet of the first RAM region (a
    /// virtio-mem region's committer has just that one), in address order,
    /// streaming: every thread takes the next unit as soon as it is done
    /// with one. Each time the part committed without a gap from the
    /// region's start has grown by `step` bytes (and at the end), it is
    /// recorded and `progress` is told its length. At most `rate` bytes a
    /// second when not 0, a step at a time.
    pub(crate) fn commit_in_order(
        &self,
        step: u64,
        rate: u64,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), CommitError> {
        let Some(&(start, len, _)) = self.inner.ram.first() else {
            return Ok(());
        };
        let todo = self.inner.lock().gaps(start, start + len, u64::MAX);
        // (No unit larger than a step: a step is what `rate` paces.)
        let units = self.inner.units(&todo, POPULATE_UNIT.min(step));
        struct Front {
            /// Units done, by index.
            done: Vec<bool>,
            /// Units done without a gap from the first.
            upto: usize,
            /// The prefix last recorded and reported, guest address.
            reported: u64,
        }
        let front = Mutex::new(Front {
            done: vec![false; units.len()],
            upto: 0,
            reported: start + self.committed_prefix(),
        });
        let next = AtomicUsize::new(0);
        let failure = Mutex::new(None);
        let started = Instant::now();
        // Pacing: a unit starts once its step's first byte is due, so each
        // step of `step` bytes is committed at once, the next no sooner than
        // `step / rate` seconds later (as the chunks of `step`).
        let mut due = Vec::with_capacity(units.len());
        let mut before = 0;
        for u in &units {
            due.push(before / step * step);
            before += u.2;
        }
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(guest, host, n)) = units.get(i) else {
                    return;
                };
                if rate > 0 {
                    let due = Duration::from_secs_f64(due[i] as f64 / rate as f64);
                    if let Some(wait) = due.checked_sub(started.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
                if let Err(source) = crate::vstate::memory::populate(host, n) {
                    let mut f = failure.lock().unwrap_or_else(|p| p.into_inner());
                    f.get_or_insert(CommitError::Populate {
                        addr: guest,
                        len: n,
                        source,
                    });
                    next.store(units.len(), Ordering::Relaxed);
                    return;
                }
                let mut f = front.lock().unwrap_or_else(|p| p.into_inner());
                f.done[i] = true;
                while f.upto < units.len() && f.done[f.upto] {
                    f.upto += 1;
                }
                let Some(&(g, _, l)) = f.upto.checked_sub(1).and_then(|u| units.get(u)) else {
                    continue;
                };
                let end = g + l;
                if end >= f.reported + step || f.upto == units.len() {
                    self.inner.lock().insert(f.reported.min(end), end);
                    f.reported = end;
                    progress(end - start);
                }
            }
        };
        on_threads(self.inner.threads.min(units.len()), work);
        if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        Ok(())
    }

    /// One background step: commits up to `chunk` bytes of what is not committed
    /// yet — memory the guest owns (not held by `balloon`) first — and returns
    /// how much it committed (0: everything is committed).
    pub(crate) fn step(
        &self,
        balloon: Option<&BalloonHandle>,
        chunk: u64,
    ) -> Result<u64, CommitError> {
        let gaps: Vec<(u64, u64)> = {
            let committed = self.inner.lock();
            self.inner
                .ram
                .iter()
                .flat_map(|&(g, len, _)| committed.gaps(g, g + len, u64::MAX))
                .collect()
        };
        let mut next = Vec::new();
        if let Some(b) = balloon {
            let mut left = chunk;
            for &(s, e) in &gaps {
                if left == 0 {
                    break;
                }
                for (a, z) in b.not_held(s, e, left) {
                    left -= z - a;
                    next.push((a, z));
                }
            }
        }
        if next.is_empty() {
            let mut left = chunk;
            for &(s, e) in &gaps {
                let take = (e - s).min(left);
                if take == 0 {
                    break;
                }
                next.push((s, s + take));
                left -= take;
            }
        }
        let bytes = next.iter().map(|r| r.1 - r.0).sum();
        self.inner.commit(&next)?;
        Ok(bytes)
    }

    /// A `Committer::step`, then the balloon's floor (its target, unless the
    /// user asks for more) lowered to what is still not committed: only committed
    /// memory may be handed out. Returns the bytes committed (0: all of it is).
    pub fn advance(&self, balloon: Option<&BalloonHandle>, chunk: u64) -> Result<u64, CommitError> {
        let done = self.step(balloon, chunk)?;
        if let Some(b) = balloon {
            b.set_fence_pages(self.uncommitted_pages());
        }
        Ok(done)
    }

    /// Pages not committed yet, as the balloon's 32-bit count.
    pub(crate) fn uncommitted_pages(&self) -> u32 {
        let bytes = self.ram_bytes().saturating_sub(self.committed_bytes());
        u32::try_from(bytes.div_ceil(PAGE)).unwrap_or(u32::MAX)
    }

    /// `--prefault async` after the window: commits the rest on a thread of its
    /// own, lowering `balloon`'s floor after each chunk, then waits for the driver
    /// to deflate to the user's target and lowers the fence. Records
    /// [`EVENT_COMMITTED`] and [`EVENT_VISIBLE`].
    pub fn start_background(
        &self,
        balloon: Option<BalloonHandle>,
        opts: &MemoryOptions,
        recorder: Arc<Recorder>,
    ) -> std::io::Result<JoinHandle<()>> {
        let this = self.clone();
        let (chunk, timeout, rate) = (opts.chunk, opts.driver_timeout, opts.rate);
        std::thread::Builder::new()
            .name("ember-commit".into())
            .spawn(move || {
                enter_background_commit();
                if let Err(e) = this.background(balloon.as_ref(), chunk, timeout, rate, &recorder) {
                    // Host out of memory: the guest's pages fault in lazily instead.
                    eprintln!(
                        "ember: background commit of guest memory failed: {}",
                        crate::error_chain(&e)
                    );
                }
            })
    }

    fn background(
        &self,
        balloon: Option<&BalloonHandle>,
        chunk: u64,
        timeout: Duration,
        rate: u64,
        recorder: &Recorder,
    ) -> Result<(), CommitError> {
        let started = Instant::now();
        let mut warned = false;
        let mut warn_if_driverless = |b: &BalloonHandle| {
            if !warned && started.elapsed() >= timeout && !b.driver_active() {
                warned = true;
                eprintln!(
                    "ember: the guest has no balloon driver (none within {:.0} s): its memory is committed in the background without the balloon's fence",
                    timeout.as_secs_f64()
                );
            }
        };
        let mut done = 0u64;
        loop {
            let n = self.advance(balloon, chunk)?;
            if n == 0 {
                break;
            }
            if let Some(b) = balloon {
                warn_if_driverless(b);
            }
            done += n;
            if rate > 0 {
                // Pace: `done` bytes may take no less than done/rate seconds.
                let due = Duration::from_secs_f64(done as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        recorder.mark(EVENT_COMMITTED);
        // A long operation says when it is done (and scripts can wait for this line).
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "ember: guest memory committed in the background: {} MiB in {secs:.1} s",
            self.ram_bytes() >> 20
        );
        let Some(b) = balloon else {
            recorder.mark(EVENT_VISIBLE);
            self.set_fence_up(false);
            return Ok(());
        };
        // A driver that is up deflates to the final target: then the guest sees
        // all its memory. Without one, the guest owns all of it already.
        let deadline = Instant::now() + DEFLATE_WAIT;
        while b.driver_active()
            && b.actual_pages() > b.user_target_pages()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        recorder.mark_text(
            EVENT_VISIBLE,
            &format!(
                "driver={} inflated_pages={} deflated_pages={} held_pages={}",
                u8::from(b.driver_active()),
                b.inflated_pages(),
                b.deflated_pages(),
                b.held_bytes() / PAGE
            ),
        );
        self.set_fence_up(false);
        self.release_held(b);
        // Say once if no driver showed up in time, even when the commit was quicker.
        while !b.driver_active() && started.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(5).min(timeout));
        }
        warn_if_driverless(b);
        Ok(())
    }

    /// Once the fence is down: gives the host back what the balloon still holds.
    fn release_held(&self, balloon: &BalloonHandle) {
        balloon.with_held(|held, holes| {
            for (s, e) in held.iter() {
                // Off huge pages first (`vstate::holes`), as the balloon's own discards.
                if let Some(h) = holes {
                    h.punch(s, e);
                }
                self.inner.discard(s, e);
            }
        });
    }
}

/// Event: all of the virtio-mem region is committed (and requested).
pub const EVENT_HOTPLUG_COMMITTED: &str = "hotplug_committed";

/// Event: the virtio-mem region's background commit starts (the guest's
/// driver has the device).
pub const EVENT_HOTPLUG_COMMIT_STARTED: &str = "hotplug_commit_started";

/// Commits a virtio-mem region (the committer `c` is the region's own) from
/// its start, raising the part `handle` may hand the driver each time at
/// least `opts.chunk` more of it is committed: the guest is never asked to
/// plug, and may not plug, memory not committed yet, so no fence is needed.
/// The populate streams on all the committer's threads (no thread waits at
/// a chunk's end for the others): a raise costs the commit nothing, and the
/// guest plugs one part while the next is committed. Returns when all of it
/// is committed.
pub(crate) fn commit_hotplug(
    c: &Committer,
    handle: &MemHandle,
    opts: &MemoryOptions,
) -> Result<(), CommitError> {
    let rate = if opts.prefault == Prefault::Async {
        opts.rate
    } else {
        0
    };
    let result = c.commit_in_order(opts.chunk.max(HUGE_PAGE), rate, &|bytes| {
        handle.set_committed(bytes)
    });
    // (After a failure: what is committed stays offered; the rest is never asked for.)
    handle.set_committed(c.committed_prefix());
    result
}

/// `--prefault async` with a virtio-mem region: [`commit_hotplug`] on a
/// thread of its own, from the moment the guest's `virtio_mem` driver has the
/// device (until then nothing can be plugged, and in a guest that is still
/// booting the commit would only take CPU from the boot). Once started it
/// runs at the VMM's priority: the boot is over, and the guest waits for
/// what it commits. Records [`EVENT_HOTPLUG_COMMIT_STARTED`] and
/// [`EVENT_HOTPLUG_COMMITTED`].
pub(crate) fn start_hotplug_background(
    region: GuestMemoryMmap,
    handle: MemHandle,
    opts: &MemoryOptions,
    recorder: Arc<Recorder>,
) -> std::io::Result<JoinHandle<()>> {
    let opts = opts.clone();
    // Made here: counting CPUs reads files, which the thread's list forbids.
    let c = Committer::new(&region, opts.threads);
    std::thread::Builder::new()
        .name("ember-commit-mem".into())
        .spawn(move || {
            crate::seccomp::confine_or_exit(crate::seccomp::Thread::Committer);
            if !handle.wait_for_driver() {
                return;
            }
            recorder.mark(EVENT_HOTPLUG_COMMIT_STARTED);
            let started = Instant::now();
            match commit_hotplug(&c, &handle, &opts) {
                Ok(()) => {
                    recorder.mark(EVENT_HOTPLUG_COMMITTED);
                    eprintln!(
                        "ember: virtio-mem region committed in the background: {} MiB in {:.1} s",
                        handle.region_size() >> 20,
                        started.elapsed().as_secs_f64()
                    );
                }
                Err(e) => {
                    eprintln!(
                        "ember: background commit of the virtio-mem region failed: {}",
                        crate::error_chain(&e)
                    );
                }
            }
        })
}

/// Event: a restored VM's memory is committed (`--restore … --prefault async`).
pub const EVENT_RESTORED_COMMITTED: &str = "restored_memory_committed";

/// A restored VM's memory, committed (`--restore … --prefault async`;
/// `c` is the committer of all of it): its RAM but what the balloon holds,
/// then the virtio-mem blocks the guest has plugged, a chunk of the region
/// at a time under the device's lock (so no block is unplugged while it is
/// committed). A block not plugged is committed when it is plugged, before
/// the plug is acknowledged ([`MemHandle::keep_committed_restored`]), so
/// growing the region commits as a booted VM's does. Returns the bytes of
/// RAM and of plugged blocks committed.
pub(crate) fn commit_restored(
    c: &Committer,
    balloon: Option<&BalloonHandle>,
    hotplug: Option<&MemHandle>,
    chunk: u64,
) -> Result<(u64, u64), CommitError> {
    let region = hotplug.map(|h| (h.addr(), h.addr() + h.region_size()));
    let ram: Vec<(u64, u64)> = c
        .inner
        .ram
        .iter()
        .map(|&(g, len, _)| (g, g + len))
        .filter(|&(g, _)| region.is_none_or(|(a, _)| g < a))
        .flat_map(|(s, e)| match balloon {
            Some(b) => b.not_held(s, e, u64::MAX),
            None => vec![(s, e)],
        })
        .collect();
    c.inner.commit(&ram)?;
    let ram_bytes = ram.iter().map(|r| r.1 - r.0).sum();
    let mut plugged = 0;
    if let (Some(h), Some((mut at, end))) = (hotplug, region) {
        while at < end {
            let to = (at + chunk.max(HUGE_PAGE)).min(end);
            plugged += h.with_plugged(at, to, |parts| {
                c.inner.commit(parts)?;
                Ok::<_, CommitError>(parts.iter().map(|r| r.1 - r.0).sum::<u64>())
            })?;
            at = to;
        }
    }
    Ok((ram_bytes, plugged))
}

/// Records [`EVENT_RESTORED_COMMITTED`] with what [`commit_restored`] committed.
pub(crate) fn mark_restored_committed(recorder: &Recorder, (ram, plugged): (u64, u64)) {
    recorder.mark_text(
        EVENT_RESTORED_COMMITTED,
        &format!("ram_bytes={ram} plugged_bytes={plugged}"),
    );
}

/// `--restore … --prefault async`: [`commit_restored`] on a thread of its
/// own, below the vCPUs' priority (the restored guest runs meanwhile, on the
/// memory file's pages). Records [`EVENT_RESTORED_COMMITTED`].
pub(crate) fn start_restored_background(
    mem: &GuestMemoryMmap,
    balloon: Option<BalloonHandle>,
    hotplug: Option<MemHandle>,
    opts: &MemoryOptions,
    recorder: Arc<Recorder>,
) -> std::io::Result<JoinHandle<()>> {
    if let Some(h) = &hotplug {
        h.keep_committed_restored();
    }
    // Made here: counting CPUs reads files, which the thread's list forbids.
    let c = Committer::new(mem, opts.threads);
    let chunk = opts.chunk;
    std::thread::Builder::new()
        .name("ember-commit".into())
        .spawn(move || {
            enter_background_commit();
            let started = Instant::now();
            match commit_restored(&c, balloon.as_ref(), hotplug.as_ref(), chunk) {
                Ok((ram, plugged)) => {
                    mark_restored_committed(&recorder, (ram, plugged));
                    eprintln!(
                        "ember: restored memory committed in the background: {} MiB of RAM, {} MiB of plugged virtio-mem blocks in {:.1} s",
                        ram >> 20,
                        plugged >> 20,
                        started.elapsed().as_secs_f64()
                    );
                }
                Err(e) => eprintln!(
                    "ember: background commit of restored memory failed: {}",
                    crate::error_chain(&e)
                ),
            }
        })
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, RangeSet> {
        self.committed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// (guest, host, len) pieces of guest `start..end` that are RAM.
    fn host_pieces(&self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        self.ram
            .iter()
            .filter_map(|&(g, len, host)| {
                let (s, e) = (start.max(g), end.min(g + len));
                (s < e).then(|| (s, host + (s - g), e - s))
            })
            .collect()
    }

    /// (guest, host, len) work units of a populate of the guest ranges, in
    /// their order: at most `max` bytes, cut at huge-page boundaries of
    /// the host address.
    fn units(&self, ranges: &[(u64, u64)], max: u64) -> Vec<(u64, u64, u64)> {
        let mut units = Vec::new();
        for &(s, e) in ranges {
            for (guest, host, len) in self.host_pieces(s, e) {
                let mut at = 0;
                while at < len {
                    let h = host + at;
                    let next_cut = (h / HUGE_PAGE + 1) * HUGE_PAGE;
                    let end_h = (h + max).min(host + len);
                    // Cut at a huge-page boundary unless the piece ends first.
                    let cut = if end_h == host + len {
                        end_h
                    } else {
                        (end_h / HUGE_PAGE * HUGE_PAGE).max(next_cut.min(host + len))
                    };
                    units.push((guest + at, h, cut - h));
                    at = cut - host;
                }
            }
        }
        units
    }

    /// Commits what is not committed yet of the guest ranges, on `threads`
    /// threads, and records it.
    fn commit(&self, ranges: &[(u64, u64)]) -> Result<(), CommitError> {
        // Only this committer's RAM is recorded: the balloon's driver may
        // inflate, and deflate through the fence, pages of a virtio-mem
        // region, which the region's own committer commits.
        let todo: Vec<(u64, u64)> = {
            let committed = self.lock();
            ranges
                .iter()
                .flat_map(|&(s, e)| {
                    self.ram.iter().filter_map(move |&(g, len, _)| {
                        let (a, z) = (s.max(g), e.min(g + len));
                        (a < z).then_some((a, z))
                    })
                })
                .flat_map(|(s, e)| committed.gaps(s, e, u64::MAX))
                .collect()
        };
        let units = self.units(&todo, POPULATE_UNIT);
        let next = AtomicUsize::new(0);
        let failure = Mutex::new(None);
        let workers = self.threads.min(units.len());
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(guest, host, len)) = units.get(i) else {
                    return;
                };
                if let Err(source) = crate::vstate::memory::populate(host, len) {
                    let mut f = failure.lock().unwrap_or_else(|p| p.into_inner());
                    f.get_or_insert(CommitError::Populate {
                        addr: guest,
                        len,
                        source,
                    });
                    // Stop everyone: the host is out of memory or cannot populate.
                    next.store(units.len(), Ordering::Relaxed);
                    return;
                }
            }
        };
        on_threads(workers, work);
        if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        let mut committed = self.lock();
        for (s, e) in todo {
            committed.insert(s, e);
        }
        Ok(())
    }

    /// Drops the host pages of guest `start..end` and forgets they were committed.
    fn discard(&self, start: u64, end: u64) {
        let mut committed = self.lock();
        for (_, host, len) in self.host_pieces(start, end) {
            // SAFETY: a range inside guest memory we keep mapped; the balloon holds
            // these pages, so the guest reads zeroes if it touches them, as it agreed.
            unsafe { libc::madvise(host as *mut _, len as usize, libc::MADV_DONTNEED) };
        }
        committed.remove(start, end);
    }
}

impl MemoryFence for Inner {
    fn discard_inflated(&self) -> bool {
        !self.fence_up.load(Ordering::SeqCst)
    }

    fn discarded(&self, addr: u64, len: u64) {
        self.lock().remove(addr, addr + len);
    }

    fn commit(&self, addr: u64, len: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(Inner::commit(self, &[(addr, addr + len)])?)
    }
}

/// A background committer thread's start: its seccomp list, then a priority
/// below the vCPUs, so that on a busy host the guest wins the CPU over its
/// own background commit (threads the populate spawns inherit both).
fn enter_background_commit() {
    crate::seccomp::confine_or_exit(crate::seccomp::Thread::Committer);
    // SAFETY: setpriority on this thread's own id; no memory is involved.
    unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            BACKGROUND_NICE,
        )
    };
}

/// Runs `work` on `workers` threads, this one among them, until all return.
fn on_threads(workers: usize, work: impl Fn() + Sync) {
    if workers <= 1 {
        return work();
    }
    std::thread::scope(|s| {
        for _ in 1..workers {
            s.spawn(&work);
        }
        work();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prefault_specs() {
        let mut o = MemoryOptions::default();
        o.set_prefault("async,window=64M,chunk=3M,threads=3,driver-timeout=2.5,rate=100M")
            .unwrap();
        assert_eq!(o.rate, 100 << 20);
        assert_eq!(o.prefault, Prefault::Async);
        assert_eq!((o.window, o.chunk, o.threads), (64 << 20, 4 << 20, 3));
        assert_eq!(o.driver_timeout, Duration::from_millis(2500));
        o.set_prefault("sync").unwrap();
        assert_eq!(o.prefault, Prefault::Sync);
        o.set_prefault("off").unwrap();
        assert_eq!(o.prefault, Prefault::Off);
        for bad in [
            "",
            "lazy",
            "async,window",
            "async,window=0",
            "async,window=1.5G",
            "async,driver-timeout=-1",
            "async,driver-timeout=nan",
            "sync,chunk=2M",
            "off,threads=2",
            "async,threads=999",
            "async,colour=blue",
        ] {
            assert!(o.set_prefault(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_window_spans_the_device_hole_and_stops_at_its_size() {
        // 4 GiB of address space; nothing touched but the window and a probe page.
        let mem = memory::create(3 << 30 | 8 << 20).unwrap();
        let c = Committer::new(&mem, 2);
        assert_eq!(c.ram_bytes(), 3 << 30 | 8 << 20);
        c.commit_window(6 << 20).unwrap();
        assert!(c.is_committed(0, 6 << 20) && c.is_resident(0, 6 << 20));
        assert!(!c.is_committed(6 << 20, 4096));
        assert!(!c.is_resident(6 << 20, 4096));
        assert_eq!(c.committed_bytes(), 6 << 20);
        // Steps go in address order and skip the hole.
        let low = crate::arch::x86_64::layout::MMIO_GAP_START;
        let hi = crate::arch::x86_64::layout::MMIO_GAP_END;
        let c2 = Committer::new(&mem, 1);
        c2.commit_window(low - (2 << 20)).unwrap();
        assert_eq!(c2.step(None, 4 << 20).unwrap(), 4 << 20);
        assert!(c2.is_committed(low - (2 << 20), 2 << 20));
        assert!(c2.is_committed(hi, 2 << 20) && c2.is_resident(hi, 2 << 20));
        assert!(!c2.is_committed(hi + (2 << 20), 4096));
        assert_eq!(c2.step(None, 64 << 20).unwrap(), 6 << 20);
        assert_eq!(c2.step(None, 64 << 20).unwrap(), 0);
        assert!(c2.is_resident(hi, 8 << 20));
    }

    /// The balloon's driver may inflate pages of a virtio-mem region and
    /// deflate them through RAM's fence: RAM's committer records none of
    /// them (it once did, counted more committed than RAM, and its floor's
    /// subtraction overflowed in the nested rig).
    #[test]
    fn the_fence_records_only_ram() {
        let ram = memory::create(16 << 20).unwrap();
        let c = Committer::new(&ram, 1);
        c.commit_window(8 << 20).unwrap();
        let (_all, _region) = memory::add_hotplug(&ram, 4 << 30, 128 << 20).unwrap();
        let fence = c.fence();
        fence.commit(4 << 30, 2 << 20).unwrap();
        fence.commit((16 << 20) - 4096, 8192).unwrap();
        assert_eq!(c.committed_bytes(), (8 << 20) + 4096);
        assert_eq!(c.uncommitted_pages(), ((8 << 20) - 4096) / 4096);
    }

    /// A virtio-mem region's commit streams on all threads, and the driver
    /// is offered each part only once every page below its end is
    /// resident, in steps of at least the chunk.
    #[test]
    fn a_region_is_offered_in_steps_as_it_is_committed() {
        use crate::devices::virtio::{MemConfig, VirtioMem};
        let ram = memory::create(16 << 20).unwrap();
        let at = 4u64 << 30;
        let size = 384u64 << 20;
        let (_all, region) = memory::add_hotplug(&ram, at, size).unwrap();
        let c = Committer::new(&region, 3);
        let seen = Mutex::new(Vec::new());
        c.commit_in_order(100 << 20, 0, &|b| {
            assert!(c.is_resident(at, b), "{b:#x} offered before it is resident");
            assert_eq!(c.committed_prefix(), b);
            seen.lock().unwrap().push(b);
        })
        .unwrap();
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.last(), Some(&size), "{seen:x?}");
        assert!(
            seen.windows(2)
                .all(|w| w[1] >= w[0] + (100 << 20) || w[1] == size),
            "{seen:x?}"
        );
        assert!((2..=4).contains(&seen.len()), "{seen:x?}");
        assert!(c.is_resident(at, size));

        // Through the device: the requested size follows the commit, no
        // further; all of it once all is committed.
        let (_all, region) = memory::add_hotplug(&ram, at, size).unwrap();
        let dev = VirtioMem::new(&MemConfig::new(size).unwrap(), at).unwrap();
        let h = dev.handle();
        h.set_requested(size).unwrap();
        assert_eq!(h.requested_bytes(), 0);
        let c = Committer::new(&region, 2);
        let opts = MemoryOptions {
            prefault: Prefault::Async,
            chunk: 128 << 20,
            ..MemoryOptions::default()
        };
        commit_hotplug(&c, &h, &opts).unwrap();
        assert_eq!(h.requested_bytes(), size);
        assert!(c.is_resident(at, size));
    }

    #[test]
    fn mem_lock_locks_what_is_committed() {
        let locked = || {
            std::fs::read_to_string("/proc/self/status")
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("VmLck:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap()
        };
        let opts = MemoryOptions {
            mem_lock: true,
            ..MemoryOptions::default()
        };
        let before = locked();
        let mem = match create_memory(32 << 20, &opts) {
            Ok(m) => m,
            // Without CAP_IPC_LOCK and a small RLIMIT_MEMLOCK: the one-line error.
            Err(e @ CommitError::Lock(..)) => {
                assert!(e.to_string().contains("CAP_IPC_LOCK"));
                return;
            }
            Err(e) => panic!("{e}"),
        };
        // The whole range is locked (on fault: VmLck counts it at once).
        assert!(locked() >= before + (32 << 10), "{before} -> {}", locked());
        let c = Committer::new(&mem, 2);
        c.commit_all().unwrap();
        assert!(c.is_resident(0, 32 << 20));
    }
}
