//! virtio-blk benchmark: the test guest's polling driver under ember and under QEMU microvm
//! (KVM, iothread, aio=io_uring), against the host doing the same I/O on the same file with
//! the same engine as ember: ember's `Auto` engine is io_uring (Readv/Writev, the guest's
//! queue depth in flight) for `direct` disks and preadv/pwritev on its I/O thread (one
//! request at a time, whatever the guest's queue depth) for page-cache disks. The host with
//! the other engine is measured too, for reference.
//!
//! `cargo bench --bench blk`. Environment:
//! - `EMBER_BLK_ROUNDS` (default 5): rounds; each runs every workload on every subject,
//!   interleaved so all subjects see the same machine noise.
//! - `EMBER_BLK_SECS` (default 2): guest seconds per run (the guest's `secs=`).
//! - `EMBER_BLK_DISK_MIB` (default 256): disk file size; every workload spans all of it.
//! - `EMBER_BLK_DIR` (default /var/tmp): where the disk file goes.
//! - `EMBER_BLK_DIRECT=1`: O_DIRECT everywhere (ember `,direct`, QEMU `cache=none`, host
//!   `O_DIRECT`) instead of the page cache (ember default, QEMU `cache=writeback`).
//! - `EMBER_BLK_SEQ_QD` (default 4): queue depth of the 1 MiB sequential rows.
//! - `EMBER_BLK_SECCOMP_OFF=1`: also ember with `--seccomp off` (what the filters cost).
//! - `EMBER_BLK_BASE_BIN=PATH`: also another ember build (an older commit's, to check a
//!   change cost nothing); one that predates `ember boot` is run as `ember run --kernel`.
//!
//! The guest times itself with the TSC at the rate it believes; the rate is calibrated
//! here against the host clock (`spin=` runs) and every guest figure is corrected by it.
//! CPU per GiB is the subject's user+sys (wait4; for ember, plus the keeper process that
//! tears its VM down after it exits, which this bench adopts as a subreaper) minus the same
//! VMM's CPU for a boot without I/O; "excl. vCPU" leaves out the vCPU threads (the guest busy-polls, so
//! they are always ~100% busy), sampled from /proc/PID/task every 20 ms.
//!
//! The same binary is its own host runner: `blk host-run PATH OP PATTERN BS QD SECS DIRECT`.

use ember::lab::stats::Summary;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};

/// Guest memory for both VMMs.
const GUEST_MEM_MIB: u64 = 256;
/// /proc sampling period for per-thread CPU.
const SAMPLE_PERIOD: Duration = Duration::from_millis(20);
/// A run that takes longer than this is killed.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);
const GIB: f64 = (1u64 << 30) as f64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Subject {
    Ember,
    Host,
    Qemu,
    /// The host with the engine ember does not use for this cache mode, for reference.
    HostOther,
    /// ember with `--seccomp off`.
    EmberNoSeccomp,
    /// Another ember build (`EMBER_BLK_BASE_BIN`).
    EmberBase,
}

impl Subject {
    fn name(self) -> &'static str {
        match self {
            Subject::Ember => "ember",
            Subject::Host => "host",
            Subject::Qemu => "QEMU",
            Subject::HostOther => "host, other engine",
            Subject::EmberNoSeccomp => "ember, seccomp off",
            Subject::EmberBase => "ember-base",
        }
    }
    fn is_vmm(self) -> bool {
        !matches!(self, Subject::Host | Subject::HostOther)
    }
    /// ember under another name: measured alongside, reported against ember.
    fn is_ember_variant(self) -> bool {
        matches!(self, Subject::EmberNoSeccomp | Subject::EmberBase)
    }
}

#[derive(Clone, Copy)]
struct Workload {
    label: &'static str,
    op: &'static str,
    pattern: &'static str,
    bs: u64,
    qd: u64,
}

impl Workload {
    fn small(&self) -> bool {
        self.bs < 1 << 20
    }
}

/// One run's results, in host time.
#[derive(Clone, Copy, Default)]
struct Sample {
    mibps: f64,
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    /// CPU seconds per GiB moved, whole process (minus the boot baseline for VMMs).
    cpu_per_gib: f64,
    /// The same without the vCPU threads (VMMs only).
    cpu_excl_vcpu_per_gib: Option<f64>,
    /// Percent of samples with the I/O thread on the vCPU's CPU (VMMs only).
    same_cpu_pct: Option<f64>,
}

/// What a `blk:` line says.
#[derive(Default, Debug)]
struct BlkLine {
    ios: u64,
    bytes: u64,
    ns: u64,
    p50_ns: u64,
    p99_ns: u64,
}

fn parse_blk_line(out: &str) -> Option<BlkLine> {
    let line = out.lines().find(|l| l.starts_with("blk: op="))?;
    let field = |k: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
    };
    Some(BlkLine {
        ios: field("ios")?,
        bytes: field("bytes")?,
        ns: field("ns")?,
        p50_ns: field("lat_p50_ns")?,
        p99_ns: field("lat_p99_ns")?,
    })
}

/// A finished child: its stdout, CPU seconds, and CPU seconds outside vCPU threads.
struct Finished {
    stdout: String,
    cpu_s: f64,
    cpu_excl_vcpu_s: f64,
    wall_s: f64,
    /// Share of samples in which the I/O thread last ran on the vCPU thread's CPU.
    same_cpu: Option<f64>,
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no memory effects.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// Records utime+stime ticks of every thread of `pid` (and whether it is a vCPU thread);
/// returns whether the device I/O thread last ran on the vCPU thread's CPU, if both exist.
fn sample_threads(pid: u32, last: &mut HashMap<String, (bool, u64)>) -> Option<bool> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return None;
    };
    let (mut vcpu_cpu, mut io_cpu) = (None, None);
    for t in tasks.flatten() {
        let dir = t.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue;
        };
        // Fields after the parenthesised comm: state is field 3, utime 14, stime 15.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| {
            f.get(i - 3)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let comm = comm.trim();
        let vcpu = comm.starts_with("ember-vcpu") || comm.starts_with("CPU ");
        let key = format!("{}:{}", t.file_name().to_string_lossy(), comm);
        last.insert(key, (vcpu, ticks(14) + ticks(15)));
        // Field 39: the CPU the thread last ran on.
        if vcpu {
            vcpu_cpu = Some(ticks(39));
        } else if comm.starts_with("ember-blk") || comm.starts_with("IO ") {
            io_cpu = Some(ticks(39));
        }
    }
    Some(vcpu_cpu? == io_cpu?)
}

/// Runs `cmd` to completion, sampling per-thread CPU, reaping with wait4 for rusage.
// Reaped with wait4(2) rather than `Child::wait`, for its resource usage.
#[allow(clippy::zombie_processes)]
fn run_measured(cmd: &mut Command) -> Finished {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("spawn a subject");
    let pid = child.id();
    let mut out = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let mut threads = HashMap::new();
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid out-parameter for wait4.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let (mut shared, mut placed) = (0u32, 0u32);
    loop {
        if let Some(same) = sample_threads(pid, &mut threads) {
            placed += 1;
            shared += u32::from(same);
        }
        // SAFETY: polling our own child; `status` and `ru` are valid out-pointers.
        let r = unsafe { libc::wait4(pid as i32, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid as i32 {
            break;
        }
        if t0.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
        }
        std::thread::sleep(SAMPLE_PERIOD);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let mut cpu_s = tv(ru.ru_utime) + tv(ru.ru_stime);
    // ember exits before its VM is torn down (see `vstate::teardown`): the
    // keeper process that tears it down is ours to reap once ember is gone
    // (we are a subreaper, see `main`), and its CPU time is ember's too.
    loop {
        // SAFETY: a zeroed rusage is a valid out-parameter for wait4.
        let mut kru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: reaping our own (adopted) children with valid out-pointers;
        // subjects run one at a time, so any child left is this one's.
        if unsafe { libc::wait4(-1, &mut status, 0, &mut kru) } <= 0 {
            break;
        }
        cpu_s += tv(kru.ru_utime) + tv(kru.ru_stime);
    }
    let hz = clock_ticks();
    let excl: u64 = threads.values().filter(|(v, _)| !v).map(|(_, t)| t).sum();
    Finished {
        stdout: reader.join().unwrap_or_default(),
        cpu_s,
        cpu_excl_vcpu_s: excl as f64 / hz,
        wall_s,
        same_cpu: (placed > 0).then(|| f64::from(shared) / f64::from(placed)),
    }
}

struct Setup {
    ember: PathBuf,
    /// `EMBER_BLK_BASE_BIN`'s subcommand for booting a kernel, and the binary.
    base: Option<(&'static str, PathBuf)>,
    qemu: PathBuf,
    guest: PathBuf,
    disk: PathBuf,
    direct: bool,
    secs: u64,
}

impl Setup {
    fn vmm_command(&self, who: Subject, cmdline: &str) -> Command {
        match who {
            Subject::Ember | Subject::EmberNoSeccomp | Subject::EmberBase => {
                let (bin, sub) = match (&self.base, who) {
                    (Some((sub, b)), Subject::EmberBase) => (b, *sub),
                    _ => (&self.ember, "boot"),
                };
                let mut c = Command::new(bin);
                let disk = format!(
                    "{}{}",
                    self.disk.display(),
                    if self.direct { ",direct" } else { "" }
                );
                if who == Subject::EmberNoSeccomp {
                    c.args(["boot", "--seccomp", "off"]);
                } else {
                    c.arg(sub);
                }
                c.args(["--mem", &format!("{GUEST_MEM_MIB}M"), "--disk", &disk])
                    .args(["--cmdline", cmdline, "--kernel"])
                    .arg(&self.guest);
                c
            }
            Subject::Qemu => {
                let mut c = Command::new(&self.qemu);
                let cache = if self.direct { "none" } else { "writeback" };
                c.args(["-name", "blkbench,debug-threads=on", "-M", "microvm"])
                    .args(["-enable-kvm", "-cpu", "qemu64", "-smp", "1"])
                    .args(["-m", &format!("{GUEST_MEM_MIB}M")])
                    .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
                    .args(["-serial", "stdio"])
                    .args(["-device", "isa-debug-exit,iobase=0x501,iosize=1"])
                    .args(["-global", "virtio-mmio.force-legacy=false"])
                    .args(["-object", "iothread,id=io0"])
                    .arg("-drive")
                    .arg(format!(
                        "file={},format=raw,if=none,id=d0,cache={cache},aio=io_uring",
                        self.disk.display()
                    ))
                    .args(["-device", "virtio-blk-device,drive=d0,iothread=io0"])
                    .args(["-append", cmdline, "-kernel"])
                    .arg(&self.guest);
                c
            }
            _ => unreachable!("not a VMM"),
        }
    }

    /// Host seconds per guest-reported second: two `spin=` runs, the difference.
    fn calibrate(&self, who: Subject) -> f64 {
        let (short, long) = (300u64, 1300u64);
        let mut ratios: Vec<f64> = (0..3)
            .map(|_| {
                let a = run_measured(&mut self.vmm_command(who, &format!("spin={short} exit=0")));
                let b = run_measured(&mut self.vmm_command(who, &format!("spin={long} exit=0")));
                (b.wall_s - a.wall_s) / ((long - short) as f64 / 1e3)
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios[1]
    }

    /// CPU seconds (total, excluding vCPU) of a boot that does no I/O.
    fn boot_cpu(&self, who: Subject) -> (f64, f64) {
        let mut runs: Vec<(f64, f64)> = (0..3)
            .map(|_| {
                let f = run_measured(&mut self.vmm_command(who, "print=idle exit=0"));
                (f.cpu_s, f.cpu_excl_vcpu_s)
            })
            .collect();
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        runs[1]
    }

    /// The host runner's engine for `who`: ember's (see the module doc), or the other one.
    fn host_engine(&self, who: Subject) -> &'static str {
        if self.direct == (who == Subject::Host) {
            "uring"
        } else {
            "sync"
        }
    }

    fn guest_cmdline(&self, w: &Workload) -> String {
        format!(
            "bs={} qd={} pattern={} blkop={} secs={} blk exit=0",
            w.bs, w.qd, w.pattern, w.op, self.secs
        )
    }
}

/// Per-VMM corrections: host s per guest s, boot CPU (total, excl. vCPU).
struct Correction {
    clock: f64,
    boot_cpu: (f64, f64),
}

fn sample_from(line: &BlkLine, clock: f64, cpu: f64, excl: Option<f64>) -> Sample {
    assert!(line.bytes > 0 && line.ns > 0, "no I/O was done: {line:?}");
    let secs = line.ns as f64 * clock / 1e9;
    let gib = line.bytes as f64 / GIB;
    Sample {
        mibps: line.bytes as f64 / secs / (1 << 20) as f64,
        iops: line.ios as f64 / secs,
        p50_us: line.p50_ns as f64 * clock / 1e3,
        p99_us: line.p99_ns as f64 * clock / 1e3,
        cpu_per_gib: cpu.max(0.0) / gib,
        cpu_excl_vcpu_per_gib: excl.map(|e| e.max(0.0) / gib),
        same_cpu_pct: None,
    }
}

fn run_one(setup: &Setup, who: Subject, w: &Workload, corr: &HashMap<&str, Correction>) -> Sample {
    if who.is_vmm() {
        let c = &corr[who.name()];
        let f = run_measured(&mut setup.vmm_command(who, &setup.guest_cmdline(w)));
        let line = parse_blk_line(&f.stdout)
            .unwrap_or_else(|| panic!("{}: no blk line; console:\n{}", who.name(), f.stdout));
        Sample {
            same_cpu_pct: f.same_cpu.map(|x| 100.0 * x),
            ..sample_from(
                &line,
                c.clock,
                f.cpu_s - c.boot_cpu.0,
                Some(f.cpu_excl_vcpu_s - c.boot_cpu.1),
            )
        }
    } else {
        let exe = std::env::current_exe().expect("own path");
        let mut cmd = Command::new(exe);
        cmd.arg("host-run")
            .arg(&setup.disk)
            .args([w.op, w.pattern])
            .arg(w.bs.to_string())
            .arg(w.qd.to_string())
            .arg(setup.secs.to_string())
            .arg(if setup.direct { "direct" } else { "cached" })
            .arg(setup.host_engine(who));
        let f = run_measured(&mut cmd);
        let line = parse_blk_line(&f.stdout)
            .unwrap_or_else(|| panic!("host runner: no blk line:\n{}", f.stdout));
        sample_from(&line, 1.0, f.cpu_s, None)
    }
}

// ---------------------------------------------------------------- host runner

/// xorshift64, as the guest uses.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Buffers for every queue slot, backed by transparent huge pages like ember's and QEMU's
/// guest memory (so O_DIRECT bios see the same physically contiguous segments).
struct Buffers {
    map: *mut u8,
    map_len: usize,
    base: *mut u8,
    bs: usize,
}

/// A transparent huge page.
const HUGE_PAGE: usize = 2 << 20;

impl Buffers {
    fn new(qd: usize, bs: usize) -> Self {
        let len = (qd * bs).next_multiple_of(HUGE_PAGE);
        let map_len = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(map != libc::MAP_FAILED, "mmap buffers");
        let map = map.cast::<u8>();
        let base = map.wrapping_add(map.align_offset(HUGE_PAGE));
        // SAFETY: `base..base + len` lies inside the mapping (we mapped a huge page extra).
        // MADV_HUGEPAGE only changes how the first touch below faults pages in.
        unsafe {
            libc::madvise(base.cast(), len, libc::MADV_HUGEPAGE);
            std::ptr::write_bytes(base, 0, len);
        }
        Buffers {
            map,
            map_len,
            base,
            bs,
        }
    }
    fn iovec(&self, slot: usize) -> libc::iovec {
        libc::iovec {
            iov_base: self.base.wrapping_add(slot * self.bs).cast(),
            iov_len: self.bs,
        }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; nothing borrows it any more.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

struct HostJob {
    write: bool,
    random: bool,
    bs: u64,
    qd: usize,
    blocks: u64,
    deadline: Instant,
}

struct Offsets {
    rng: Rng,
    next: u64,
}

impl Offsets {
    fn next(&mut self, job: &HostJob) -> u64 {
        let block = if job.random {
            self.rng.next() % job.blocks
        } else {
            let b = self.next;
            self.next = (b + 1) % job.blocks;
            b
        };
        block * job.bs
    }
}

fn percentile(sorted: &[u64], pct: usize) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() * pct).div_ceil(100)).max(1) - 1]
}

/// The guest's loop on the host: keep `qd` requests in flight until the deadline.
fn host_uring(file: &File, job: &HostJob, lat: &mut Vec<u64>) -> std::io::Result<u64> {
    let mut ring = IoUring::new(256)?;
    let bufs = Buffers::new(job.qd, job.bs as usize);
    let iovecs: Vec<libc::iovec> = (0..job.qd).map(|s| bufs.iovec(s)).collect();
    let mut started = vec![Instant::now(); job.qd];
    let mut offs = Offsets {
        rng: Rng(0x9e37_79b9_7f4a_7c15),
        next: 0,
    };
    let fd = types::Fd(file.as_raw_fd());
    let mut push = |ring: &mut IoUring, slot: usize, started: &mut [Instant]| {
        let off = offs.next(job);
        let iov = &iovecs[slot] as *const libc::iovec;
        let e = if job.write {
            opcode::Writev::new(fd, iov, 1).offset(off).build()
        } else {
            opcode::Readv::new(fd, iov, 1).offset(off).build()
        };
        started[slot] = Instant::now();
        // SAFETY: the iovec and its buffer live until this function returns, after every
        // submitted entry has completed.
        unsafe { ring.submission().push(&e.user_data(slot as u64)) }.expect("sq has room");
    };
    for slot in 0..job.qd {
        push(&mut ring, slot, &mut started);
    }
    let mut in_flight = job.qd;
    let mut bytes = 0;
    while in_flight > 0 {
        ring.submit_and_wait(1)?;
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        let now = Instant::now();
        for (slot, res) in done {
            in_flight -= 1;
            if res != job.bs as i32 {
                return Err(std::io::Error::other(format!("request returned {res}")));
            }
            bytes += job.bs;
            lat.push((now - started[slot]).as_nanos() as u64);
            if now < job.deadline {
                push(&mut ring, slot, &mut started);
                in_flight += 1;
            }
        }
    }
    Ok(bytes)
}

/// QD1 with preadv/pwritev.
fn host_sync(file: &File, job: &HostJob, lat: &mut Vec<u64>) -> std::io::Result<u64> {
    let bufs = Buffers::new(1, job.bs as usize);
    let iov = bufs.iovec(0);
    let mut offs = Offsets {
        rng: Rng(0x9e37_79b9_7f4a_7c15),
        next: 0,
    };
    let mut bytes = 0;
    while Instant::now() < job.deadline {
        let off = offs.next(job) as i64;
        let t = Instant::now();
        // SAFETY: one iovec over our own live buffer.
        let n = unsafe {
            if job.write {
                libc::pwritev(file.as_raw_fd(), &iov, 1, off)
            } else {
                libc::preadv(file.as_raw_fd(), &iov, 1, off)
            }
        };
        if n != job.bs as isize {
            return Err(std::io::Error::last_os_error());
        }
        lat.push(t.elapsed().as_nanos() as u64);
        bytes += job.bs;
    }
    Ok(bytes)
}

/// `host-run PATH OP PATTERN BS QD SECS direct|cached uring|sync`: prints a `blk:` line.
fn host_run(args: &[String]) -> Result<(), String> {
    let [path, op, pattern, bs, qd, secs, cache, engine] = args else {
        return Err("usage: host-run PATH OP PATTERN BS QD SECS CACHE ENGINE".into());
    };
    let num = |s: &str| s.parse::<u64>().map_err(|e| format!("{s}: {e}"));
    let (bs, qd, secs) = (num(bs)?, num(qd)?, num(secs)?);
    let write = op == "write";
    let mut opts = OpenOptions::new();
    opts.read(true).write(write);
    if cache == "direct" {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = opts.open(path).map_err(|e| format!("{path}: {e}"))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let job = HostJob {
        write,
        random: pattern == "rand",
        bs,
        qd: qd as usize,
        blocks: len / bs,
        deadline: Instant::now() + Duration::from_secs(secs),
    };
    let mut lat = Vec::with_capacity(1 << 20);
    let t0 = Instant::now();
    let bytes = if engine == "sync" {
        host_sync(&file, &job, &mut lat)
    } else {
        host_uring(&file, &job, &mut lat)
    }
    .map_err(|e| e.to_string())?;
    let ns = t0.elapsed().as_nanos() as u64;
    lat.sort_unstable();
    println!(
        "blk: op={op} bs={bs} qd={qd} pattern={pattern} ios={} bytes={bytes} ns={ns} lat_p50_ns={} lat_p99_ns={}",
        lat.len(),
        percentile(&lat, 50),
        percentile(&lat, 99)
    );
    Ok(())
}

// ---------------------------------------------------------------- disk and report

/// Writes the whole file with non-zero data (no holes, blocks allocated), syncs it, and
/// reads it back so the page cache holds it for every subject.
fn prepare_disk(path: &Path, mib: u64) {
    let mut f = File::create(path).expect("create the disk file");
    let mut chunk = vec![0u8; 1 << 20];
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for _ in 0..mib {
        for w in chunk.chunks_mut(8) {
            w.copy_from_slice(&rng.next().to_le_bytes());
        }
        f.write_all(&chunk).expect("write the disk file");
    }
    f.sync_all().expect("sync the disk file");
    let mut f = File::open(path).expect("reopen the disk file");
    while f.read(&mut chunk).expect("read the disk file") > 0 {}
}

/// Median and range of `v` (the lab's summary; empty input gives zeros).
fn stats(v: Vec<f64>) -> Summary {
    Summary::of(&v).unwrap_or_default()
}

fn cell(v: Vec<f64>, digits: usize) -> (String, f64) {
    if v.is_empty() {
        return ("–".into(), f64::NAN);
    }
    let s = stats(v);
    (
        format!("{:.d$} ({:.d$}–{:.d$})", s.median, s.min, s.max, d = digits),
        s.median,
    )
}

type Results = HashMap<(usize, &'static str), Vec<Sample>>;

/// A sample's figure, where it has one.
type Metric = fn(&Sample) -> Option<f64>;

/// How a workload's throughput is reported: unit, decimals, and the figure
/// of a sample (kIOPS for small requests, MiB/s for large ones).
fn throughput(w: &Workload) -> (&'static str, usize, Metric) {
    if w.small() {
        ("kIOPS", 1, |s| Some(s.iops / 1e3))
    } else {
        ("MiB/s", 0, |s| Some(s.mibps))
    }
}

fn collect(r: &Results, w: usize, who: Subject, f: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
    r.get(&(w, who.name()))
        .map(|v| v.iter().filter_map(&f).collect())
        .unwrap_or_default()
}

fn print_report(workloads: &[Workload], subjects: &[Subject], r: &Results) {
    println!(
        "\n### Throughput (median (min–max) over rounds; ratios of medians, and of the best \
         runs — noise only ever slows a run down)\n"
    );
    println!(
        "| workload | ember | host | QEMU | ember/host | ember/QEMU | \
         best ember/host | best ember/QEMU |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (i, w) in workloads.iter().enumerate() {
        let (unit, digits, metric) = throughput(w);
        let best = |s| {
            collect(r, i, s, metric)
                .into_iter()
                .fold(f64::NAN, f64::max)
        };
        let (e, em) = cell(collect(r, i, Subject::Ember, metric), digits);
        let (h, hm) = cell(collect(r, i, Subject::Host, metric), digits);
        let (q, qm) = cell(collect(r, i, Subject::Qemu, metric), digits);
        let (eb, hb, qb) = (
            best(Subject::Ember),
            best(Subject::Host),
            best(Subject::Qemu),
        );
        println!(
            "| {} ({unit}) | {e} | {h} | {q} | {:.0}% | {:.2}× | {:.0}% | {:.2}× |",
            w.label,
            100.0 * em / hm,
            em / qm,
            100.0 * eb / hb,
            eb / qb
        );
    }
    let variants: Vec<Subject> = subjects
        .iter()
        .copied()
        .filter(|s| s.is_ember_variant())
        .collect();
    if !variants.is_empty() {
        println!(
            "\nember variants, measured in the same rounds (median (min–max); ratio to ember):"
        );
        for (i, w) in workloads.iter().enumerate() {
            let (unit, digits, metric) = throughput(w);
            let (_, em) = cell(collect(r, i, Subject::Ember, metric), digits);
            for &v in &variants {
                let (c, m) = cell(collect(r, i, v, metric), digits);
                println!("- {}, {}: {c} {unit}, {:.2}×", w.label, v.name(), m / em);
            }
        }
    }
    if subjects.contains(&Subject::HostOther) {
        println!("\nReference, the host with the other engine:");
        for (i, w) in workloads.iter().enumerate() {
            let (unit, digits, metric) = throughput(w);
            let (o, _) = cell(collect(r, i, Subject::HostOther, metric), digits);
            println!("- {}: {o} {unit}", w.label);
        }
    }
    println!("\n### Latency per 4 KiB request, µs: p50 / p99 (medians over rounds)\n");
    let header: Vec<&str> = subjects.iter().map(|s| s.name()).collect();
    println!("| workload | {} |", header.join(" | "));
    println!("| --- |{}", " --- |".repeat(subjects.len()));
    for (i, w) in workloads.iter().enumerate().filter(|(_, w)| w.small()) {
        let cells: Vec<String> = subjects
            .iter()
            .map(|&s| {
                let p50 = collect(r, i, s, |x| Some(x.p50_us));
                let p99 = collect(r, i, s, |x| Some(x.p99_us));
                if p50.is_empty() {
                    return "–".into();
                }
                format!(
                    "{:.1} / {:.1} (p50 {:.1}–{:.1})",
                    stats(p50.clone()).median,
                    stats(p99).median,
                    stats(p50.clone()).min,
                    stats(p50).max
                )
            })
            .collect();
        println!("| {} | {} |", w.label, cells.join(" | "));
    }
    println!(
        "\n### Device I/O thread on the vCPU thread's CPU (% of 20 ms samples; \
         the guest busy-polls, so sharing a CPU serialises them)\n"
    );
    println!("| workload | ember | QEMU |");
    println!("| --- | --- | --- |");
    for (i, w) in workloads.iter().enumerate() {
        let pct = |s| cell(collect(r, i, s, |x| x.same_cpu_pct), 0).0;
        println!(
            "| {} | {} | {} |",
            w.label,
            pct(Subject::Ember),
            pct(Subject::Qemu)
        );
    }
    println!("\n### Host CPU seconds per GiB moved (median (min–max))\n");
    println!("| workload | ember total | ember excl. vCPU | host | QEMU total | QEMU excl. vCPU |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (i, w) in workloads.iter().enumerate() {
        let total = |s| cell(collect(r, i, s, |x| Some(x.cpu_per_gib)), 2).0;
        let excl = |s| cell(collect(r, i, s, |x| x.cpu_excl_vcpu_per_gib), 2).0;
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            w.label,
            total(Subject::Ember),
            excl(Subject::Ember),
            total(Subject::Host),
            total(Subject::Qemu),
            excl(Subject::Qemu)
        );
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "host-run") {
        if let Err(e) = host_run(&args[pos + 1..]) {
            eprintln!("host-run: {e}");
            std::process::exit(1);
        }
        return;
    }
    // Orphaned descendants (the keeper ember leaves to tear its VM down)
    // become our children, so their CPU time can be collected (`run_measured`).
    // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer flag and no pointers.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    let rounds = env_u64("EMBER_BLK_ROUNDS", 5).max(1);
    let secs = env_u64("EMBER_BLK_SECS", 2).max(1);
    let disk_mib = env_u64("EMBER_BLK_DISK_MIB", 256).max(8);
    let seq_qd = env_u64("EMBER_BLK_SEQ_QD", 4).clamp(1, 7);
    let direct = std::env::var("EMBER_BLK_DIRECT").is_ok_and(|v| v == "1");
    let dir = PathBuf::from(std::env::var("EMBER_BLK_DIR").unwrap_or_else(|_| "/var/tmp".into()));
    let qemu = ember::backend::find_binary("qemu-system-x86_64")
        .expect("qemu-system-x86_64 must be installed for this benchmark");
    let base = std::env::var_os("EMBER_BLK_BASE_BIN")
        .map(PathBuf::from)
        .map(|b| (ember_testing::boot_subcommand(&b), b));
    let setup = Setup {
        ember: PathBuf::from(env!("CARGO_BIN_EXE_ember")),
        base,
        qemu,
        guest: ember_testing::test_guest().expect("build the test guest"),
        disk: dir.join(format!("ember-blkbench-{}.img", std::process::id())),
        direct,
        secs,
    };
    let workloads = [
        Workload {
            label: "4K randread QD1",
            op: "read",
            pattern: "rand",
            bs: 4096,
            qd: 1,
        },
        Workload {
            label: "4K randread QD32",
            op: "read",
            pattern: "rand",
            bs: 4096,
            qd: 32,
        },
        Workload {
            label: "1M seq read",
            op: "read",
            pattern: "seq",
            bs: 1 << 20,
            qd: seq_qd,
        },
        Workload {
            label: "1M seq write",
            op: "write",
            pattern: "seq",
            bs: 1 << 20,
            qd: seq_qd,
        },
    ];
    let mut subjects = vec![
        Subject::Ember,
        Subject::Qemu,
        Subject::Host,
        Subject::HostOther,
    ];
    if std::env::var("EMBER_BLK_SECCOMP_OFF").is_ok_and(|v| v == "1") {
        subjects.push(Subject::EmberNoSeccomp);
    }
    if setup.base.is_some() {
        subjects.push(Subject::EmberBase);
    }
    eprintln!(
        "disk {} ({disk_mib} MiB, {}), {rounds} rounds × {secs} s, 1 MiB rows at QD{seq_qd}",
        setup.disk.display(),
        if direct {
            "O_DIRECT"
        } else {
            "page cache, warmed"
        }
    );
    let load_before = load_average();
    prepare_disk(&setup.disk, disk_mib);
    let mut corr = HashMap::new();
    for &who in subjects.iter().filter(|s| s.is_vmm()) {
        let c = Correction {
            clock: setup.calibrate(who),
            boot_cpu: setup.boot_cpu(who),
        };
        eprintln!(
            "{}: 1 guest s = {:.4} host s; boot without I/O: {:.3} CPU s ({:.3} excl. vCPU)",
            who.name(),
            c.clock,
            c.boot_cpu.0,
            c.boot_cpu.1
        );
        corr.insert(who.name(), c);
    }
    let mut results: Results = HashMap::new();
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        for (i, w) in workloads.iter().enumerate() {
            for &who in &subjects {
                let s = run_one(&setup, who, w, &corr);
                results.entry((i, who.name())).or_default().push(s);
            }
        }
    }
    let _ = std::fs::remove_file(&setup.disk);
    println!(
        "virtio-blk: {rounds} rounds × {secs} s per run, disk {disk_mib} MiB on {} ({}), \
         1 MiB rows at QD{seq_qd}; ember and host use {}; QEMU microvm KVM, iothread, \
         aio=io_uring, cache={}",
        dir.display(),
        if direct { "O_DIRECT" } else { "page cache" },
        if direct {
            "io_uring Readv/Writev, the guest's QD in flight"
        } else {
            "preadv/pwritev, one request at a time"
        },
        if direct { "none" } else { "writeback" }
    );
    println!(
        "host: {} CPUs, load average before {load_before}, after {}; figures are corrected for \
         the guest's TSC-rate assumption (ember ×{:.4}, QEMU ×{:.4})",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        corr["ember"].clock,
        corr["QEMU"].clock
    );
    print_report(&workloads, &subjects, &results);
}

/// The 1-minute load average, to tell a quiet machine from a busy one.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}
