//! The allow-lists, one per kind of thread, and their compilation to BPF.
//!
//! This file is shared: `seccomp/mod.rs` uses it at run time (the lists' unit
//! tests, `compile`, the bench), and the crate's build script includes it to
//! compile every list ahead of time, so that ember starts with its BPF
//! programs as static data instead of compiling twelve of them at every
//! start (0.6-1 ms, BENCHMARKS.md §10). It may therefore use only
//! `seccompiler`, `libc` and `std`: nothing from the crate.
//!
//! Two compilers: seccompiler's ([`reference_program`]), and [`program`],
//! which ember installs. Installing a filter costs the thread kernel time in
//! proportion to its length (the program is checked, JIT-compiled, and run
//! for every system call number to cache which ones are always allowed:
//! ~0.7 µs an instruction here, BENCHMARKS.md §10), and seccompiler spends
//! five instructions on each call allowed whatever its arguments (a
//! comparison, two jumps and two returns, one of them unreachable) where one
//! comparison does. [`program`] emits that one, shares the returns, and
//! otherwise checks arguments as seccompiler does; a unit test runs both
//! programs on every system call number with arguments around every value
//! the lists name, and they must agree.

use seccompiler::{BpfProgram, SeccompAction, sock_filter};
use std::collections::BTreeMap;

/// The kinds of thread, each with its own list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thread {
    /// The main thread of `ember boot`, from step 8 on.
    Main,
    /// A vCPU thread.
    Vcpu,
    /// A virtio-blk I/O thread.
    Block,
    /// The virtio-console I/O thread (the appliance's channel).
    Console,
    /// The virtio-rng I/O thread.
    Rng,
    /// A virtio-net I/O thread.
    Net,
    /// A virtio-pmem I/O thread.
    Pmem,
    /// A virtio-fs I/O thread (its FUSE passthrough).
    Fs,
    /// The virtio-balloon I/O thread.
    Balloon,
    /// The virtio-vsock I/O thread.
    Vsock,
    /// The virtio-mem I/O thread.
    Mem,
    /// The thread that starts device I/O threads.
    Spawner,
    /// `--prefault async`'s background commit.
    Committer,
    /// The control socket's threads (`--api-socket`).
    Api,
    /// The thread feeding stdin to COM1.
    Stdin,
    /// The teardown keeper (`vstate::teardown`).
    Keeper,
}

impl Thread {
    /// Every kind, in filter-table order.
    pub const ALL: [Thread; 16] = [
        Thread::Main,
        Thread::Vcpu,
        Thread::Block,
        Thread::Console,
        Thread::Rng,
        Thread::Net,
        Thread::Pmem,
        Thread::Fs,
        Thread::Balloon,
        Thread::Vsock,
        Thread::Mem,
        Thread::Spawner,
        Thread::Committer,
        Thread::Api,
        Thread::Stdin,
        Thread::Keeper,
    ];

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Thread::Main => "main",
            Thread::Vcpu => "vcpu",
            Thread::Block => "block",
            Thread::Console => "console",
            Thread::Rng => "rng",
            Thread::Net => "net",
            Thread::Pmem => "pmem",
            Thread::Fs => "fs",
            Thread::Balloon => "balloon",
            Thread::Vsock => "vsock",
            Thread::Mem => "mem",
            Thread::Spawner => "spawner",
            Thread::Committer => "committer",
            Thread::Api => "api",
            Thread::Stdin => "stdin",
            Thread::Keeper => "keeper",
        }
    }

    /// Its place in [`Thread::ALL`] (and in the built-in program tables).
    pub(crate) fn index(self) -> usize {
        Thread::ALL
            .iter()
            .position(|&t| t == self)
            .unwrap_or_default()
    }
}

/// A condition on one argument: `arg & mask == value & mask`, on the
/// argument's low 32 bits (`wide: false`: seccompiler's `Dword`) or on all
/// 64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cond {
    /// Which argument (0-5).
    pub arg: u8,
    /// All 64 bits, not only the low 32.
    pub wide: bool,
    /// The bits compared.
    pub mask: u64,
    /// What they must be.
    pub value: u64,
}

impl Cond {
    /// The argument's low 32 bits equal `value`'s.
    fn low_eq(arg: u8, value: u64) -> Self {
        Cond {
            arg,
            wide: false,
            mask: u64::from(u32::MAX),
            value,
        }
    }
}

/// One rule: allowed when all its conditions hold.
pub(super) type Rule = Vec<Cond>;

/// An allow-list: system call number to the rules under which it is
/// allowed, any of them (none: always).
pub type Rules = BTreeMap<i64, Vec<Rule>>;

/// Adds `calls`, allowed whatever their arguments.
fn allow(r: &mut Rules, calls: &[i64]) {
    for &c in calls {
        r.insert(c, Vec::new());
    }
}

/// Adds `call`, allowed only when argument `arg` is one of `values`. An
/// unconditional entry already there stays unconditional.
fn allow_arg(r: &mut Rules, call: i64, arg: u8, values: &[u64]) {
    // Built only from the constants in this file: a failure is a bug the
    // unit tests catch.
    let new = values.iter().map(|&v| vec![Cond::low_eq(arg, v)]);
    match r.get_mut(&call) {
        None => {
            r.insert(call, new.collect());
        }
        // Already allowed whatever the arguments.
        Some(rules) if rules.is_empty() => {}
        Some(rules) => rules.extend(new),
    }
}

/// The union of two lists (an unconditional entry wins).
fn merge(into: &mut Rules, from: &Rules) {
    for (&call, rules) in from {
        match into.get_mut(&call) {
            None => {
                into.insert(call, rules.clone());
            }
            Some(mine) if mine.is_empty() => {}
            Some(mine) if rules.is_empty() => mine.clear(),
            Some(mine) => mine.extend(rules.iter().cloned()),
        }
    }
}

/// Every thread: what Rust's standard library and the C library do on any
/// thread, and what the SIGSYS handler itself needs.
fn base() -> Rules {
    let mut r = Rules::new();
    allow(
        &mut r,
        &[
            // Log lines and the SIGSYS message go to stderr.
            libc::SYS_write,
            // A thread's end; `_exit` (exit_group) ends ember.
            libc::SYS_exit,
            libc::SYS_exit_group,
            // Returning from a signal handler (the vCPU kick, SIGSYS).
            libc::SYS_rt_sigreturn,
            // The C library masks signals around thread exit and in raise().
            libc::SYS_rt_sigprocmask,
            // Every Mutex, Condvar, channel and join.
            libc::SYS_futex,
            libc::SYS_sched_yield,
            // The memory allocator (the shipped build's dlmalloc maps, remaps
            // and unmaps; glibc's also madvises a dead thread's stack away).
            libc::SYS_mmap,
            libc::SYS_munmap,
            libc::SYS_mremap,
            libc::SYS_mprotect,
            libc::SYS_brk,
            libc::SYS_madvise,
            // Timeouts and sleeps; the vDSO falls back to the system call
            // where the clock source has no vDSO support.
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
            // Thread and process ids (logging, the C library's raise()).
            libc::SYS_gettid,
            libc::SYS_getpid,
            // std seeds each thread's HashMap keys from getrandom.
            libc::SYS_getrandom,
            // Dropping descriptors.
            libc::SYS_close,
            // std's stack-overflow guard: the alternate stack is switched off
            // and unmapped when a thread ends.
            libc::SYS_sigaltstack,
            // The kernel restarts an interrupted call with it.
            libc::SYS_restart_syscall,
        ],
    );
    // Stacking a narrower filter on top (a thread started by a filtered one).
    allow_arg(
        &mut r,
        libc::SYS_prctl,
        0,
        &[libc::PR_SET_NO_NEW_PRIVS as u64],
    );
    allow_arg(
        &mut r,
        libc::SYS_seccomp,
        0,
        &[u64::from(libc::SECCOMP_SET_MODE_FILTER)],
    );
    // std checks, in debug builds, that a descriptor it closes was open.
    allow_arg(&mut r, libc::SYS_fcntl, 1, &[libc::F_GETFD as u64]);
    // The SIGSYS handler (and Ctrl-A x, on the stdin thread) puts a raw
    // terminal back: tcsetattr, which recent glibc starts with a TCGETS.
    allow_arg(
        &mut r,
        libc::SYS_ioctl,
        1,
        &[
            request(libc::TCGETS),
            request(libc::TCSETS),
            request(libc::TCSETSW),
            request(libc::TCSETSF),
        ],
    );
    r
}

/// An ioctl request number as a filter compares it. (glibc types them
/// `c_ulong`, musl `c_int`: the cast is needed on one of the two.)
#[allow(clippy::unnecessary_cast)]
pub(super) fn request(r: libc::Ioctl) -> u64 {
    r as u64
}

/// KVM's ioctl type (`KVMIO` in linux/kvm.h): bits 8-15 of every request
/// on /dev/kvm, a VM or a vCPU.
const KVMIO: u64 = 0xAE;

/// KVM's requests, any of them, and no other ioctl: not a terminal's
/// (TIOCSTI would type into ember's terminal), a block device's, a
/// filesystem's (FICLONE) or a socket's. The vCPU and control-socket threads
/// make dozens of KVM requests (creating, configuring, running, saving and
/// restoring vCPUs; memory slots; irq lines); they are told apart by their
/// type byte, not one by one (RELIABILITY.md, "Not done").
fn kvm_ioctls() -> Rules {
    let mut r = Rules::new();
    r.insert(
        libc::SYS_ioctl,
        vec![vec![Cond {
            arg: 1,
            wide: false,
            mask: 0xff00,
            value: KVMIO << 8,
        }]],
    );
    r
}

/// Starting threads: the creator's calls, and what the new thread runs
/// (under its creator's filter) before it installs its own.
fn thread_start() -> Rules {
    let mut r = Rules::new();
    allow(
        &mut r,
        &[
            // glibc's thread start.
            libc::SYS_rseq,
            libc::SYS_set_robust_list,
            // glibc reads the new thread's CPU set for its attributes (std
            // asks for the stack bounds).
            libc::SYS_sched_getaffinity,
        ],
    );
    // pthread_create. clone3's flags live in memory a filter cannot read:
    // it is allowed here only for a second filter (`no_clone3`, installed
    // with every list that has this group) to answer it ENOSYS — a trap would
    // take precedence over the errno — and glibc then falls back to clone,
    // whose flags must include CLONE_THREAD: a thread, never a new process.
    allow(&mut r, &[libc::SYS_clone3]);
    r.insert(
        libc::SYS_clone,
        vec![vec![Cond {
            arg: 0,
            wide: true,
            mask: libc::CLONE_THREAD as u64,
            value: libc::CLONE_THREAD as u64,
        }]],
    );
    // The thread's name (std sets it on the new thread).
    allow_arg(&mut r, libc::SYS_prctl, 0, &[libc::PR_SET_NAME as u64]);
    r
}

/// The keeper's own list: it keeps the VM's descriptor until ember is gone
/// (`vstate::teardown`), with raw system calls only.
fn keeper() -> Rules {
    let mut r = Rules::new();
    allow(
        &mut r,
        &[
            // Closing every descriptor but the VM's, then telling ember so.
            libc::SYS_close_range,
            libc::SYS_futex,
            // Waiting for its parent to go.
            libc::SYS_getppid,
            libc::SYS_pause,
            libc::SYS_rt_sigreturn,
            libc::SYS_exit,
            libc::SYS_exit_group,
            // Its own filter is installed under the inherited one.
            libc::SYS_seccomp,
        ],
    );
    // Dying with ember.
    allow_arg(
        &mut r,
        libc::SYS_prctl,
        0,
        &[
            libc::PR_SET_PDEATHSIG as u64,
            libc::PR_SET_NO_NEW_PRIVS as u64,
        ],
    );
    r
}

/// Ending ember from this thread (`teardown::exit`): clone the keeper (which
/// runs under this thread's filter until it installs its own).
fn ending() -> Rules {
    let mut r = keeper();
    // The keeper's stack (mmap), the signal mask, the parent's pid: in base.
    // clone for the keeper: exactly CLONE_VM | SIGCHLD, a process sharing
    // ember's memory, nothing else.
    let flags = (libc::CLONE_VM | libc::SIGCHLD) as u64;
    r.entry(libc::SYS_clone).or_default().push(vec![Cond {
        arg: 0,
        wide: true,
        mask: u64::MAX,
        value: flags,
    }]);
    r
}

/// What ember's SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers do: put a raw
/// terminal back, remove the control socket, restore the default action and
/// re-raise. They run on the main thread: [`confine`] blocks these signals
/// on every other thread.
fn fatal_signals() -> Rules {
    let mut r = Rules::new();
    allow(
        &mut r,
        &[
            libc::SYS_unlink,
            libc::SYS_unlinkat,
            libc::SYS_rt_sigaction,
            // raise(): glibc uses tgkill, musl tkill.
            libc::SYS_tgkill,
            libc::SYS_tkill,
        ],
    );
    r
}

/// A device I/O thread's loop (`devices::virtio::worker`, block's `event_loop`):
/// epoll over the queue eventfds and the kill eventfd.
fn device_loop() -> Rules {
    let mut r = base();
    allow(
        &mut r,
        &[
            libc::SYS_epoll_create1,
            libc::SYS_epoll_ctl,
            // glibc's epoll_wait is epoll_wait; musl's is epoll_pwait.
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            // Eventfds: reading a queue notification, writing an interrupt
            // (irqfd) or a VM-end notice.
            libc::SYS_read,
            libc::SYS_write,
        ],
    );
    r
}

/// The list of one kind of thread.
///
/// One function, as a table with one arm per kind of thread; the longer lists
/// are functions of their own below, in the same order.
pub fn rules(thread: Thread) -> Rules {
    match thread {
        Thread::Keeper => keeper(),
        Thread::Block => block_thread(),
        Thread::Console => {
            let mut r = device_loop();
            // The channel is a unix stream: plain read/write (device_loop),
            // and its reads back off with poll when it would block.
            allow(
                &mut r,
                &[libc::SYS_recvfrom, libc::SYS_sendto, libc::SYS_poll],
            );
            r
        }
        Thread::Rng => {
            let mut r = device_loop();
            // The entropy (already in base; named here for the reader).
            allow(&mut r, &[libc::SYS_getrandom]);
            r
        }
        Thread::Net => {
            let mut r = device_loop();
            // Frames are read and written (device_loop); the rate limits' and the
            // link's timer; the tap's offloads, set from the thread once the
            // driver has chosen its features.
            allow(
                &mut r,
                &[libc::SYS_timerfd_create, libc::SYS_timerfd_settime],
            );
            // A tap's frames go straight between guest memory and the tap.
            allow(&mut r, &[libc::SYS_readv, libc::SYS_writev]);
            // passt's stream socket: a frame waits a little for room
            // (glibc's poll is poll, musl's ppoll where poll is missing).
            allow(&mut r, &[libc::SYS_poll, libc::SYS_ppoll]);
            allow_arg(&mut r, libc::SYS_ioctl, 1, &[request(libc::TUNSETOFFLOAD)]);
            r
        }
        Thread::Pmem => {
            let mut r = device_loop();
            // FLUSH: the backing file's data to its disk.
            allow(
                &mut r,
                &[libc::SYS_fsync, libc::SYS_fdatasync, libc::SYS_msync],
            );
            r
        }
        Thread::Fs => fs_thread(),
        Thread::Balloon => {
            // Discarding inflated and reported pages is madvise (in base).
            // With --prefault async, a deflate first commits the pages it
            // hands back (MADV_POPULATE_WRITE, madvise again) on the
            // committer's worker threads, started from this thread.
            let mut r = device_loop();
            merge(&mut r, &thread_start());
            r
        }
        Thread::Vsock => vsock_thread(),
        Thread::Mem => {
            // Discarding unplugged blocks is madvise (in base); locked
            // memory (--mem-lock) is unlocked for it and locked again.
            let mut r = device_loop();
            allow(&mut r, &[libc::SYS_munlock, libc::SYS_mlock2]);
            r
        }
        Thread::Spawner => {
            let mut r = base();
            merge(&mut r, &thread_start());
            for t in [
                Thread::Block,
                Thread::Console,
                Thread::Rng,
                Thread::Net,
                Thread::Pmem,
                Thread::Fs,
                Thread::Balloon,
                Thread::Vsock,
                Thread::Mem,
            ] {
                merge(&mut r, &rules(t));
            }
            r
        }
        Thread::Vcpu => vcpu_thread(),
        Thread::Committer => committer_thread(),
        Thread::Stdin => {
            let mut r = base();
            merge(&mut r, &ending());
            // stdin (a terminal, a pipe).
            allow(&mut r, &[libc::SYS_read]);
            r
        }
        Thread::Api => api_thread(),
        Thread::Main => main_thread(),
    }
}

/// The block device's thread: its I/O engines.
fn block_thread() -> Rules {
    let mut r = device_loop();
    allow(
        &mut r,
        &[
            // The synchronous engine.
            libc::SYS_preadv,
            libc::SYS_pwritev,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            // The io_uring engine (set up on activation, by the vCPU).
            libc::SYS_io_uring_enter,
            // FLUSH.
            libc::SYS_fdatasync,
            libc::SYS_fsync,
            // DISCARD and WRITE_ZEROES (punch hole, zero range).
            libc::SYS_fallocate,
        ],
    );
    r
}

/// The virtio-fs device's thread: the passthrough's file system calls.
fn fs_thread() -> Rules {
    let mut r = device_loop();
    // The passthrough (`devices::virtio::fs::passthrough`): every
    // name the guest sends is opened with openat2 beneath a
    // descriptor it already holds, and file data is reached by
    // reopening an inode's /proc/self/fd link (openat).
    allow(
        &mut r,
        &[
            libc::SYS_openat2,
            libc::SYS_openat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_fstat,
            libc::SYS_fstatfs,
            libc::SYS_readlinkat,
            libc::SYS_symlinkat,
            libc::SYS_mknodat,
            libc::SYS_mkdirat,
            libc::SYS_unlinkat,
            libc::SYS_renameat2,
            libc::SYS_linkat,
            libc::SYS_fchmodat,
            libc::SYS_fchownat,
            libc::SYS_utimensat,
            libc::SYS_ftruncate,
            libc::SYS_fallocate,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            libc::SYS_lseek,
            libc::SYS_getdents64,
            libc::SYS_fsync,
            libc::SYS_fdatasync,
        ],
    );
    // Each request is served as its guest caller when ember is
    // root: this thread's fsuid/fsgid, and its supplementary
    // groups dropped (to none: the only list it ever sets).
    allow(&mut r, &[libc::SYS_setfsuid, libc::SYS_setfsgid]);
    allow_arg(&mut r, libc::SYS_setgroups, 0, &[0]);
    r
}

/// The vsock device's thread: Unix stream sockets only.
fn vsock_thread() -> Rules {
    let mut r = device_loop();
    allow(
        &mut r,
        &[
            // Host programs connecting to the device's socket.
            libc::SYS_accept4,
            // Guest connections to PATH_<port> (on the Unix
            // sockets below, the only ones it can make).
            libc::SYS_connect,
            // Stream data (send/recv, MSG_NOSIGNAL and MSG_PEEK).
            libc::SYS_recvfrom,
            libc::SYS_sendto,
            // A guest's half-close.
            libc::SYS_shutdown,
        ],
    );
    // Unix stream sockets only: no network.
    r.insert(
        libc::SYS_socket,
        vec![vec![
            Cond::low_eq(0, libc::AF_UNIX as u64),
            Cond::low_eq(
                1,
                (libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) as u64,
            ),
        ]],
    );
    r
}

/// A vCPU's thread: KVM_RUN and what a driver's activation does on it.
fn vcpu_thread() -> Rules {
    let mut r = base();
    // KVM_RUN, memory slots registered on first touch, the vCPU's
    // state for a snapshot, irq lines.
    merge(&mut r, &kvm_ioctls());
    allow(
        &mut r,
        &[
            // COM1 to stdout, eventfds.
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_writev,
            // A driver activating its device, on this thread: the
            // queue and kill eventfds, a duplicate of the backing
            // file, block's io_uring.
            libc::SYS_eventfd2,
            libc::SYS_fcntl,
            libc::SYS_dup,
            libc::SYS_io_uring_setup,
            libc::SYS_io_uring_register,
        ],
    );
    r
}

/// The prefault committer's threads.
fn committer_thread() -> Rules {
    let mut r = base();
    merge(&mut r, &thread_start());
    allow(
        &mut r,
        &[
            // Its own priority (nice 10).
            libc::SYS_setpriority,
            // MADV_POPULATE_WRITE is madvise (base); --mem-lock.
            libc::SYS_mlock2,
            libc::SYS_mincore,
        ],
    );
    r
}

/// The control socket's thread: its clients, and writing a snapshot.
fn api_thread() -> Rules {
    let mut r = base();
    merge(&mut r, &thread_start());
    merge(&mut r, &ending());
    // The VM's and vCPUs' state for a snapshot.
    merge(&mut r, &kvm_ioctls());
    allow(
        &mut r,
        &[
            // Clients and their requests.
            libc::SYS_accept4,
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_recvfrom,
            libc::SYS_sendto,
            libc::SYS_setsockopt,
            libc::SYS_fcntl,
            // Kicking vCPUs out of KVM_RUN (pthread_kill).
            libc::SYS_tgkill,
            libc::SYS_tkill,
            // Writing a snapshot: its directory and files, durably;
            // pagemap tells which pages to write. (musl opens with
            // open, glibc with openat.)
            libc::SYS_open,
            // musl's stat and lstat of a path are stat and lstat.
            libc::SYS_stat,
            libc::SYS_lstat,
            libc::SYS_access,
            libc::SYS_readlink,
            libc::SYS_openat,
            libc::SYS_mkdir,
            libc::SYS_mkdirat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_fstat,
            libc::SYS_statx,
            libc::SYS_fstat,
            libc::SYS_lseek,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            libc::SYS_writev,
            libc::SYS_ftruncate,
            libc::SYS_fsync,
            libc::SYS_fdatasync,
            libc::SYS_rename,
            libc::SYS_renameat,
            libc::SYS_renameat2,
            libc::SYS_unlink,
            libc::SYS_unlinkat,
            // The replaced snapshot's directory (musl's remove_dir
            // is rmdir, glibc's unlinkat).
            libc::SYS_rmdir,
            libc::SYS_getdents64,
            libc::SYS_fchmod,
            libc::SYS_mincore,
        ],
    );
    r
}

/// The main thread, once the VM runs: waiting for its end.
fn main_thread() -> Rules {
    // Every thread it starts is started before it is filtered
    // (`builder::BeforeGo`), but the keeper.
    let mut r = base();
    merge(&mut r, &ending());
    merge(&mut r, &fatal_signals());
    allow(
        &mut r,
        &[
            // Waiting for the guest's end (eventfd) with a timeout.
            libc::SYS_poll,
            libc::SYS_ppoll,
            libc::SYS_read,
            libc::SYS_writev,
            // The --events file and /proc/self/status and smaps at
            // the end (musl's open is open, glibc's openat).
            libc::SYS_open,
            // musl's stat and lstat of a path are stat and lstat.
            libc::SYS_stat,
            libc::SYS_lstat,
            libc::SYS_access,
            libc::SYS_readlink,
            libc::SYS_openat,
            libc::SYS_fstat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_fstat,
            libc::SYS_statx,
            libc::SYS_lseek,
            libc::SYS_fcntl,
        ],
    );
    // The terminal: musl's isatty asks for the window size (raw
    // mode's TCGETS and TCSETS are in base).
    allow_arg(&mut r, libc::SYS_ioctl, 1, &[request(libc::TIOCGWINSZ)]);
    r
}

// Classic BPF, as seccomp runs it (linux/filter.h, linux/seccomp.h).
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_ALU_AND_K: u16 = 0x54;
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
/// `struct seccomp_data`: the call's number, its architecture, its arguments.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARGS: u32 = 16;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const RET_KILL_PROCESS: u32 = 0x8000_0000;

/// Where a jump of [`compact`]'s goes before it is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum To {
    /// The next instruction.
    Next,
    /// `k` instructions on, inside the same block.
    Skip(u8),
    /// The block after this one: the next call's comparison.
    NextCall,
    /// The `matched` return.
    Matched,
    /// The `mismatch` return.
    Mismatch,
}

/// An instruction with symbolic jump targets.
#[derive(Debug, Clone, Copy)]
enum Op {
    Load(u32),
    And(u32),
    /// Compare A with `k`: on true and on false go to …
    Jeq(u32, To, To),
    Jump(To),
}

/// The instructions that test one call's number (A holds it) and, for a
/// call with rules, its arguments; every path ends in `Matched`,
/// `Mismatch` or (the number differs) `NextCall`.
fn call_block(nr: i64, rules: &[Rule]) -> Vec<Op> {
    let nr = nr as u32;
    if rules.is_empty() {
        return vec![Op::Jeq(nr, To::Matched, To::NextCall)];
    }
    let mut body = Vec::new();
    for rule in rules {
        // Each condition: load the word, mask it, compare; a miss goes to
        // the next rule (patched below, once this rule's length is known).
        let start = body.len();
        for c in rule {
            let off = DATA_ARGS + 8 * u32::from(c.arg);
            let mut halves = vec![(off, c.mask as u32, c.value as u32)];
            if c.wide {
                halves.push((off + 4, (c.mask >> 32) as u32, (c.value >> 32) as u32));
            }
            // A half the mask leaves out always holds (seccompiler's masked
            // comparison masks the value too).
            for (off, mask, value) in halves.into_iter().filter(|h| h.1 != 0) {
                body.push(Op::Load(off));
                if mask != u32::MAX {
                    body.push(Op::And(mask));
                }
                body.push(Op::Jeq(value & mask, To::Next, To::Mismatch));
            }
        }
        body.push(Op::Jump(To::Matched));
        let end = body.len();
        for (i, op) in body.iter_mut().enumerate().take(end).skip(start) {
            if let Op::Jeq(k, t, To::Mismatch) = *op {
                // To the first instruction after this rule.
                let skip = u8::try_from(end - i - 1).expect("a rule fits a short jump");
                *op = Op::Jeq(k, t, To::Skip(skip));
            }
        }
    }
    body.push(Op::Jump(To::Mismatch));
    let mut block = vec![Op::Jeq(nr, To::Next, To::NextCall)];
    block.extend(body);
    block
}

/// Compiles `rules` compactly (see the module docs): check the
/// architecture, then one comparison per allowed call, argument checks only
/// where a call has rules, and the two returns shared (repeated every ~200
/// instructions, as a conditional jump reaches at most 255 on).
pub(crate) fn compact(rules: &Rules, mismatch: u32, matched: u32) -> BpfProgram {
    let stmt = |code, k| sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    // Laid out from the end, so every target's position is known.
    let mut rev: Vec<sock_filter> = vec![stmt(BPF_RET_K, matched), stmt(BPF_RET_K, mismatch)];
    // Positions counted from the end: index i of `rev` is i from the end.
    let (mut at_matched, mut at_mismatch) = (0usize, 1usize);
    for (&nr, rs) in rules.iter().rev() {
        let block = call_block(nr, rs);
        // A fresh pair of returns when the shared ones would be out of reach.
        if rev.len() + block.len() - at_matched.min(at_mismatch) > 250 {
            rev.push(stmt(BPF_RET_K, matched));
            at_matched = rev.len() - 1;
            rev.push(stmt(BPF_RET_K, mismatch));
            at_mismatch = rev.len() - 1;
            // Falling through from the block above jumps over them.
            rev.push(stmt(BPF_JMP_JA, 2));
        }
        // The next call's first instruction (or the island's jump over its
        // returns, or at the very end the mismatch return): laid out last.
        let next_call = rev.len() - 1;
        let base = rev.len() + block.len() - 1;
        let off = |i: usize, to: To| -> u8 {
            // Instruction i of the block sits at `base - i` from the end;
            // a jump of k lands at `base - i - 1 - k`.
            let here = base - i;
            let target = match to {
                To::Next => here - 1,
                To::Skip(k) => here - 1 - usize::from(k),
                To::NextCall => next_call,
                To::Matched => at_matched,
                To::Mismatch => at_mismatch,
            };
            u8::try_from(here - 1 - target).expect("jump within reach")
        };
        let mut laid: Vec<sock_filter> = block
            .iter()
            .enumerate()
            .map(|(i, op)| match *op {
                Op::Load(k) => stmt(BPF_LD_W_ABS, k),
                Op::And(k) => stmt(BPF_ALU_AND_K, k),
                Op::Jeq(k, t, f) => sock_filter {
                    code: BPF_JMP_JEQ_K,
                    jt: off(i, t),
                    jf: off(i, f),
                    k,
                },
                Op::Jump(t) => stmt(BPF_JMP_JA, u32::from(off(i, t))),
            })
            .collect();
        laid.reverse();
        rev.extend(laid);
    }
    rev.extend([
        stmt(BPF_LD_W_ABS, DATA_NR),
        stmt(BPF_RET_K, RET_KILL_PROCESS),
        sock_filter {
            code: BPF_JMP_JEQ_K,
            jt: 1,
            jf: 0,
            k: AUDIT_ARCH_X86_64,
        },
        stmt(BPF_LD_W_ABS, DATA_ARCH),
    ]);
    rev.reverse();
    rev
}

/// The action code the kernel reads for `a`.
fn code(a: SeccompAction) -> u32 {
    a.into()
}

/// Compiles `thread`'s list ([`compact`]): a call on it is allowed, any
/// other gets `mismatch` (trap or log).
pub(crate) fn program(thread: Thread, mismatch: SeccompAction) -> BpfProgram {
    compact(&rules(thread), code(mismatch), code(SeccompAction::Allow))
}

/// clone3 alone, for [`no_clone3_program`].
#[cfg_attr(not(test), allow(dead_code))] // the build script's (build.rs includes this file)
fn clone3_only() -> Rules {
    let mut r = Rules::new();
    allow(&mut r, &[libc::SYS_clone3]);
    r
}

/// The second filter of threads that create threads: clone3 fails with
/// ENOSYS (its flags cannot be checked), so the C library uses clone.
#[cfg_attr(not(test), allow(dead_code))] // the build script's (build.rs includes this file)
pub(crate) fn no_clone3_program() -> BpfProgram {
    compact(
        &clone3_only(),
        code(SeccompAction::Allow),
        code(SeccompAction::Errno(libc::ENOSYS as u32)),
    )
}

/// seccompiler's compilation of the same lists, which [`program`] and
/// [`no_clone3_program`] must agree with (the unit tests run both).
#[cfg(test)]
pub(super) mod reference {
    use super::{Cond, Rules, Thread, clone3_only, rules};
    use seccompiler::{
        BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
        SeccompFilter, SeccompRule, TargetArch,
    };
    use std::collections::BTreeMap;

    /// seccompiler refused a list.
    #[derive(Debug, thiserror::Error)]
    #[error("seccompiler refused the {list} list: {source}")]
    pub(crate) struct ReferenceError {
        /// The list's name.
        list: &'static str,
        /// seccompiler's complaint.
        source: BackendError,
    }

    /// `rules` as seccompiler's rules.
    fn seccompiler_rules(rules: &Rules) -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
        let cond = |c: &Cond| {
            let len = if c.wide {
                SeccompCmpArgLen::Qword
            } else {
                SeccompCmpArgLen::Dword
            };
            let full = if c.wide {
                u64::MAX
            } else {
                u64::from(u32::MAX)
            };
            let op = if c.mask == full {
                SeccompCmpOp::Eq
            } else {
                SeccompCmpOp::MaskedEq(c.mask)
            };
            SeccompCondition::new(c.arg, len, op, c.value)
        };
        rules
            .iter()
            .map(|(&call, rs)| {
                let rs = rs
                    .iter()
                    .map(|r| SeccompRule::new(r.iter().map(cond).collect::<Result<_, _>>()?))
                    .collect::<Result<_, _>>()?;
                Ok((call, rs))
            })
            .collect()
    }

    /// seccompiler's program for `rules`: a call on the list (and its rules
    /// holding) gets `matched`, any other `mismatch`.
    /// seccompiler's program for any `rules` (allowed, or `mismatch`).
    pub(crate) fn compile(
        rules: &Rules,
        mismatch: SeccompAction,
    ) -> Result<BpfProgram, ReferenceError> {
        seccompiler_program(rules, mismatch, SeccompAction::Allow).map_err(|source| {
            ReferenceError {
                list: "given",
                source,
            }
        })
    }

    fn seccompiler_program(
        rules: &Rules,
        mismatch: SeccompAction,
        matched: SeccompAction,
    ) -> Result<BpfProgram, BackendError> {
        SeccompFilter::new(
            seccompiler_rules(rules)?,
            mismatch,
            matched,
            TargetArch::x86_64,
        )?
        .try_into()
    }

    /// seccompiler's program for `thread`'s list.
    pub(crate) fn program(
        thread: Thread,
        mismatch: SeccompAction,
    ) -> Result<BpfProgram, ReferenceError> {
        seccompiler_program(&rules(thread), mismatch, SeccompAction::Allow).map_err(|source| {
            ReferenceError {
                list: thread.name(),
                source,
            }
        })
    }

    /// seccompiler's clone3 filter.
    pub(crate) fn no_clone3_program() -> Result<BpfProgram, ReferenceError> {
        seccompiler_program(
            &clone3_only(),
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
        )
        .map_err(|source| ReferenceError {
            list: "clone3",
            source,
        })
    }
}
