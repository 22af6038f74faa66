//! Seccomp: every thread of `ember boot` runs under an allow-list of the
//! system calls it needs, installed before the guest runs its first
//! instruction, with `no_new_privs` set.
//!
//! How it fits together:
//! - The lists are in `seccomp/lists.rs`. The crate's build script runs
//!   them through seccompiler, so the BPF programs (one per [`Thread`] kind
//!   and mode) are static data: nothing is compiled at start-up (compiling
//!   all twelve cost 0.6-1 ms, BENCHMARKS.md §10), and a unit test checks the
//!   built programs against the lists as compiled at run time.
//! - [`init`] (once per process, before any thread starts) installs the
//!   SIGSYS handler. The device manager starts the *spawner* when it
//!   attaches the first virtio device (`start_spawner`): a VM without one
//!   needs none.
//! - Each thread installs its own filter with [`confine`] before it does
//!   anything the guest can reach: a vCPU as soon as it is set up, while the
//!   rest of the VM is built (`Vcpu::confine`), a device I/O thread first
//!   thing on its thread, the main thread just before step 8 of the boot
//!   (`builder::build`, `snapshot::restore`), after it has started every
//!   thread it will start but the keeper. Installing a filter costs kernel
//!   time in proportion to the program's length (~0.1 ms for a device's,
//!   checking, JIT-compiling and caching it), so the installs are kept off
//!   the way to the guest's first instruction where they can be, and the
//!   main thread's list short.
//! - Filters are inherited and stack: a thread made by a filtered thread
//!   runs under its creator's filter *and* its own. So virtio I/O threads,
//!   which a vCPU would otherwise start (a driver activates its device by an
//!   MMIO write), are started by the spawner instead, a thread whose list is
//!   just the union of the device lists plus thread creation. The vCPU list
//!   then needs neither `clone` nor any device's I/O calls. The main thread's
//!   list is, for the same reason, a superset of the list of the one thread
//!   it starts after it is filtered: the keeper.
//! - A call outside the list: with [`Mode::Trap`] (the default of `ember
//!   boot`) the kernel stops it and sends SIGSYS; the handler prints
//!   `ember: seccomp: thread <name> made forbidden syscall <name> (<nr>)` and
//!   ends the process with the status given to [`init`]. [`Mode::Log`] lets the
//!   call through and has the kernel log it (the audit log / dmesg);
//!   [`Mode::Off`] installs nothing.
//!
//! Every list says why each call is there. Lists cover both C
//! libraries ember is built with (glibc for development, musl for the
//! release): e.g. glibc raises a signal with `tgkill`, musl with `tkill`.

mod lists;

pub use lists::Thread;
pub use lists::{Rules, rules};
use seccompiler::{BpfProgram, SeccompAction, sock_filter};
use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{OnceLock, mpsc};
use std::thread::JoinHandle;
use thiserror::Error;

/// Seccomp errors.
#[derive(Debug, Error)]
pub enum SeccompError {
    /// The kernel refused a filter (no seccomp support?).
    #[error("seccomp: cannot install the {0} filter: {1}")]
    Install(&'static str, String),
    /// The SIGSYS handler could not be installed.
    #[error("seccomp: cannot install the SIGSYS handler: {0}")]
    Handler(io::Error),
    /// The spawner thread could not be started.
    #[error("seccomp: cannot start the device-thread spawner: {0}")]
    Spawner(io::Error),
    /// [`init`] was called twice.
    #[error("seccomp: already set up")]
    Twice,
}

/// What a thread outside its list gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No filters at all.
    Off,
    /// The call goes through and the kernel logs it (audit log / dmesg).
    Log,
    /// The call is stopped; ember prints which one and exits.
    Trap,
}

/// The programs the build script compiled from `lists.rs`: `TRAP` and `LOG`
/// (indexed by [`Thread::index`]) and `NO_CLONE3`.
#[allow(clippy::all)]
mod built {
    use seccompiler::sock_filter;
    include!(concat!(env!("OUT_DIR"), "/seccomp_programs.rs"));
}

/// Compiles `thread`'s list for `mode` at run time (the build script did the
/// same for the programs ember installs; tests and the bench use this).
pub fn compile(thread: Thread, mode: Mode) -> BpfProgram {
    lists::program(thread, mismatch(mode))
}

/// What a filter in `mode` does with a call its list lacks.
fn mismatch(mode: Mode) -> SeccompAction {
    match mode {
        Mode::Log => SeccompAction::Log,
        Mode::Trap | Mode::Off => SeccompAction::Trap,
    }
}

/// Any list compiled as ember compiles its own (for benchmarks and
/// experiments: `benches/seccomp.rs` times a variant of a list).
pub fn compile_rules(rules: &Rules, mode: Mode) -> BpfProgram {
    lists::compact(rules, mismatch(mode).into(), SeccompAction::Allow.into())
}

/// The clone3 filter, compiled at run time (see [`compile`]), which the
/// tests hold the build script's against.
#[cfg(test)]
fn no_clone3() -> BpfProgram {
    lists::no_clone3_program()
}

/// The built-in program of `thread` for `mode` (trap for [`Mode::Off`],
/// which installs nothing).
fn built_in(thread: Thread, mode: Mode) -> &'static [sock_filter] {
    match mode {
        Mode::Log => built::LOG[thread.index()],
        Mode::Trap | Mode::Off => built::TRAP[thread.index()],
    }
}

/// The mode [`init`] set.
static MODE: OnceLock<Mode> = OnceLock::new();
/// The exit status after a forbidden call (read by the SIGSYS handler).
static EXIT_STATUS: AtomicI32 = AtomicI32::new(1);
/// Run by the SIGSYS handler before it exits (async-signal-safe).
static ON_VIOLATION: OnceLock<fn()> = OnceLock::new();
/// Where device threads are started once filters are on.
static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();

thread_local! {
    /// This thread's name (as the OS knows it), for the SIGSYS message.
    static NAME: Cell<[u8; 16]> = const { Cell::new([0; 16]) };
}

/// Sets up seccomp for this process for `mode`: installs the SIGSYS handler (a forbidden call ends ember with
/// `exit_status`) and starts the spawner. Call on the main thread before any
/// other starts. With [`Mode::Off`] it installs nothing (only a debug build's
/// test hook is armed).
pub fn init(mode: Mode, exit_status: i32) -> Result<(), SeccompError> {
    // Armed in every mode, so that `off` and `log` really let the hook's
    // call through (tests/vmm_e2e/seccomp_e2e.rs).
    test_hook::init();
    if mode == Mode::Off {
        return Ok(());
    }
    EXIT_STATUS.store(exit_status, Ordering::SeqCst);
    install_sigsys_handler()?;
    fix_malloc_arena_limit();
    MODE.set(mode).map_err(|_| SeccompError::Twice)?;
    Ok(())
}

/// glibc's malloc sizes its arena limit from the CPU count the first time
/// a thread needs a ninth arena, reading `/sys/devices/system/cpu/online`:
/// on a filtered thread (a virtio-mem populate worker, say) that `openat` is
/// a violation that ends ember. Set here, before any filter, to glibc's own
/// default (8 a CPU), it is never read. musl has no arenas.
fn fix_malloc_arena_limit() {
    #[cfg(target_env = "gnu")]
    {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let max = libc::c_int::try_from(cpus.saturating_mul(8)).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only sets a malloc parameter; no filter is in
        // place yet and no pointer is passed.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, max) };
    }
}

/// Has the SIGSYS handler call `f` (async-signal-safe: e.g. put the
/// terminal back) before ember exits.
pub fn on_violation(f: fn()) {
    let _ = ON_VIOLATION.set(f);
}

/// Installs `thread`'s filter on the calling thread (and `no_new_privs`).
/// Does nothing before [`init`] or with [`Mode::Off`]. Every thread but the
/// main one also blocks the fatal signals ember handles, so their handlers
/// run on the main thread.
pub fn confine(thread: Thread) -> Result<(), SeccompError> {
    let Some(&mode) = MODE.get() else {
        return Ok(());
    };
    remember_name();
    if thread != Thread::Main {
        block_fatal_signals();
    }
    let install = |p: &[sock_filter]| {
        seccompiler::apply_filter(p)
            .map_err(|e| SeccompError::Install(thread.name(), e.to_string()))
    };
    if stacks_no_clone3(thread) {
        install(built::NO_CLONE3)?;
    }
    install(built_in(thread, mode))
}

/// Whether `thread`'s list comes with the filter that answers clone3 ENOSYS
/// (the kinds that start threads; their threads inherit it).
fn stacks_no_clone3(thread: Thread) -> bool {
    matches!(
        thread,
        Thread::Spawner | Thread::Api | Thread::Committer | Thread::Balloon
    )
}

/// [`confine`], or end ember with a one-line message: a thread that cannot
/// be filtered must not run unfiltered.
pub fn confine_or_exit(thread: Thread) {
    if let Err(e) = confine(thread) {
        eprintln!("ember: {e}");
        // SAFETY: _exit ends the process at once; nothing is left half-done
        // that the exit status does not already report.
        unsafe { libc::_exit(EXIT_STATUS.load(Ordering::SeqCst)) };
    }
}

/// The keeper's filter as (address, length), for its raw `seccomp` call.
/// The program is static data; `None` before [`init`].
pub(crate) fn keeper_program() -> Option<(usize, u16)> {
    let p = built_in(Thread::Keeper, *MODE.get()?);
    Some((p.as_ptr() as usize, u16::try_from(p.len()).ok()?))
}

fn remember_name() {
    let mut name = [0u8; 16];
    if let Some(n) = std::thread::current().name() {
        let n = n.as_bytes();
        let len = n.len().min(15);
        name[..len].copy_from_slice(&n[..len]);
    }
    NAME.with(|c| c.set(name));
}

fn block_fatal_signals() {
    // SAFETY: a zeroed sigset_t is valid input for sigemptyset/sigaddset,
    // which only edit it; pthread_sigmask reads it and takes no old mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// The SIGSYS part of `siginfo_t` on x86-64 (`_sigsys` in the kernel's
/// union, after signo, errno, code and padding to 8 bytes).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

fn install_sigsys_handler() -> Result<(), SeccompError> {
    // SAFETY: a zeroed sigaction is valid; the handler only formats into a
    // stack buffer and makes async-signal-safe calls (write, _exit, and the
    // registered on_violation hook, which must be async-signal-safe too).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigsys as *const () as libc::sighandler_t;
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// A fixed buffer that `write!` can fill without allocating.
struct StackBuf {
    buf: [u8; 192],
    len: usize,
}

impl std::fmt::Write for StackBuf {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// The message of a forbidden call `nr` on the thread called `name`; for an
/// ioctl, its `request` (the lists allow some ioctls and not others).
fn violation_message(name: &[u8], nr: i32, request: Option<u64>, out: &mut StackBuf) {
    use std::fmt::Write;
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let name = std::str::from_utf8(&name[..end]).unwrap_or("?");
    let name = if name.is_empty() { "?" } else { name };
    let _ = match syscall_name(nr) {
        Some(call) => write!(
            out,
            "ember: seccomp: thread {name} made forbidden syscall {call} ({nr})"
        ),
        None => write!(
            out,
            "ember: seccomp: thread {name} made forbidden syscall {nr}"
        ),
    };
    // The kernel takes an ioctl's request as 32 bits.
    let _ = match request {
        Some(r) => writeln!(out, " request {:#x}", r as u32),
        None => writeln!(out),
    };
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler,
    // and for a seccomp SIGSYS it fills the `_sigsys` member read here.
    let nr = unsafe { (*info.cast::<SigsysInfo>()).syscall };
    // A trapped call's arguments are still in the registers the kernel
    // saved for the handler: the request is the second (rsi).
    let request = (i64::from(nr) == libc::SYS_ioctl && !ctx.is_null()).then(|| {
        // SAFETY: for an SA_SIGINFO handler the third argument is the
        // interrupted thread's ucontext_t, valid for the handler's duration.
        unsafe {
            (*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_RSI as usize] as u64
        }
    });
    // A const-initialised thread-local without a destructor: a plain load.
    let name = NAME.with(|c| c.get());
    let mut out = StackBuf {
        buf: [0; 192],
        len: 0,
    };
    violation_message(&name, nr, request, &mut out);
    if let Some(f) = ON_VIOLATION.get() {
        f();
    }
    // SAFETY: write and _exit are async-signal-safe; the buffer is ours.
    unsafe {
        libc::write(libc::STDERR_FILENO, out.buf.as_ptr().cast(), out.len);
        libc::_exit(EXIT_STATUS.load(Ordering::SeqCst));
    }
}

/// The name of x86-64 system call `nr`.
pub(crate) fn syscall_name(nr: i32) -> Option<&'static str> {
    let n = usize::try_from(nr).ok()?;
    let name = if n < SYSCALLS_LOW.len() {
        SYSCALLS_LOW[n]
    } else {
        *SYSCALLS_HIGH.get(n.checked_sub(SYSCALLS_HIGH_START)?)?
    };
    (!name.is_empty()).then_some(name)
}

type SpawnJob = (
    std::thread::Builder,
    Box<dyn FnOnce() + Send>,
    mpsc::Sender<io::Result<JoinHandle<()>>>,
);

/// Starts the spawner, which starts every device I/O thread from then on
/// (see the module docs), unless it runs or no filters are on. Call on the
/// thread that builds the VM, before any vCPU runs.
pub(crate) fn start_spawner() -> Result<(), SeccompError> {
    if MODE.get().is_none() || SPAWNER.get().is_some() {
        return Ok(());
    }
    let (tx, rx) = mpsc::channel::<SpawnJob>();
    std::thread::Builder::new()
        .name("ember-spawner".into())
        .spawn(move || {
            confine_or_exit(Thread::Spawner);
            for (builder, body, reply) in rx {
                let _ = reply.send(builder.spawn(body));
            }
        })
        .map_err(SeccompError::Spawner)?;
    SPAWNER.set(tx).map_err(|_| SeccompError::Twice)
}

/// Starts `body` on a thread called `name` under `thread`'s filter. Once
/// filters are on, the spawner starts it (see the module docs: a thread made
/// by a vCPU would inherit the vCPU's filter).
pub(crate) fn spawn<F>(name: String, thread: Thread, body: F) -> io::Result<JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    let builder = std::thread::Builder::new().name(name);
    let body = move || {
        confine_or_exit(thread);
        body()
    };
    let Some(spawner) = SPAWNER.get() else {
        return builder.spawn(body);
    };
    let (reply, answer) = mpsc::channel();
    spawner
        .send((builder, Box::new(body), reply))
        .map_err(|_| io::Error::other("the device-thread spawner is gone"))?;
    answer
        .recv()
        .map_err(|_| io::Error::other("the device-thread spawner is gone"))?
}

/// A test-only way to make a thread break its list
/// (`tests/vmm_e2e/seccomp_e2e.rs`): in debug builds, with
/// `EMBER_TEST_SECCOMP_VIOLATION` in the environment, `block` makes the
/// first virtio-blk request's I/O thread call `socket(2)`, which no device
/// list allows; `vcpu-ioctl` makes the first vCPU thread, before its first
/// `KVM_RUN`, ask a terminal ioctl (TIOCSTI, on no descriptor), which its
/// list refuses as it allows only KVM's. Release builds have no such hook.
pub(crate) mod test_hook {
    #[cfg(debug_assertions)]
    use std::sync::atomic::{AtomicU8, Ordering};

    #[cfg(debug_assertions)]
    const BLOCK: u8 = 1;
    #[cfg(debug_assertions)]
    const VCPU_IOCTL: u8 = 2;
    #[cfg(debug_assertions)]
    static ARMED: AtomicU8 = AtomicU8::new(0);

    /// Reads the environment once, at [`super::init`].
    pub(crate) fn init() {
        #[cfg(debug_assertions)]
        ARMED.store(
            match std::env::var_os("EMBER_TEST_SECCOMP_VIOLATION") {
                Some(v) if v == "block" => BLOCK,
                Some(v) if v == "vcpu-ioctl" => VCPU_IOCTL,
                _ => 0,
            },
            Ordering::SeqCst,
        );
    }

    /// Disarms the hook if it is armed for `which`; says whether it was.
    #[cfg(debug_assertions)]
    fn fire(which: u8) -> bool {
        ARMED
            .compare_exchange(which, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Called by the block I/O thread on each request batch.
    #[inline]
    pub(crate) fn block_request() {
        #[cfg(debug_assertions)]
        if fire(BLOCK) {
            // SAFETY: socket takes integers; the descriptor, if any, is closed.
            unsafe {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                if fd >= 0 {
                    libc::close(fd);
                }
            }
        }
    }

    /// Called by each vCPU thread once it is filtered, before it runs.
    #[inline]
    pub(crate) fn vcpu_start() {
        #[cfg(debug_assertions)]
        if fire(VCPU_IOCTL) {
            // SAFETY: an invalid descriptor and a null argument: the call
            // fails with EBADF when it is let through (--seccomp off or log).
            unsafe { libc::ioctl(-1, libc::TIOCSTI, std::ptr::null::<u8>()) };
        }
    }
}

/// x86-64 system call names by number, 0 to 334 (from the kernel's
/// `asm/unistd_64.h`; empty where no call has the number).
#[rustfmt::skip]
const SYSCALLS_LOW: [&str; 335] = [
    "read", "write", "open", "close", "stat", "fstat", "lstat", "poll", "lseek", "mmap",
    "mprotect", "munmap", "brk", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "ioctl",
    "pread64", "pwrite64", "readv", "writev", "access", "pipe", "select", "sched_yield", "mremap",
    "msync", "mincore", "madvise", "shmget", "shmat", "shmctl", "dup", "dup2", "pause",
    "nanosleep", "getitimer", "alarm", "setitimer", "getpid", "sendfile", "socket", "connect",
    "accept", "sendto", "recvfrom", "sendmsg", "recvmsg", "shutdown", "bind", "listen",
    "getsockname", "getpeername", "socketpair", "setsockopt", "getsockopt", "clone", "fork",
    "vfork", "execve", "exit", "wait4", "kill", "uname", "semget", "semop", "semctl", "shmdt",
    "msgget", "msgsnd", "msgrcv", "msgctl", "fcntl", "flock", "fsync", "fdatasync", "truncate",
    "ftruncate", "getdents", "getcwd", "chdir", "fchdir", "rename", "mkdir", "rmdir", "creat",
    "link", "unlink", "symlink", "readlink", "chmod", "fchmod", "chown", "fchown", "lchown",
    "umask", "gettimeofday", "getrlimit", "getrusage", "sysinfo", "times", "ptrace", "getuid",
    "syslog", "getgid", "setuid", "setgid", "geteuid", "getegid", "setpgid", "getppid", "getpgrp",
    "setsid", "setreuid", "setregid", "getgroups", "setgroups", "setresuid", "getresuid",
    "setresgid", "getresgid", "getpgid", "setfsuid", "setfsgid", "getsid", "capget", "capset",
    "rt_sigpending", "rt_sigtimedwait", "rt_sigqueueinfo", "rt_sigsuspend", "sigaltstack", "utime",
    "mknod", "uselib", "personality", "ustat", "statfs", "fstatfs", "sysfs", "getpriority",
    "setpriority", "sched_setparam", "sched_getparam", "sched_setscheduler", "sched_getscheduler",
    "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval", "mlock",
    "munlock", "mlockall", "munlockall", "vhangup", "modify_ldt", "pivot_root", "_sysctl", "prctl",
    "arch_prctl", "adjtimex", "setrlimit", "chroot", "sync", "acct", "settimeofday", "mount",
    "umount2", "swapon", "swapoff", "reboot", "sethostname", "setdomainname", "iopl", "ioperm",
    "create_module", "init_module", "delete_module", "get_kernel_syms", "query_module", "quotactl",
    "nfsservctl", "getpmsg", "putpmsg", "afs_syscall", "tuxcall", "security", "gettid",
    "readahead", "setxattr", "lsetxattr", "fsetxattr", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr", "fremovexattr",
    "tkill", "time", "futex", "sched_setaffinity", "sched_getaffinity", "set_thread_area",
    "io_setup", "io_destroy", "io_getevents", "io_submit", "io_cancel", "get_thread_area",
    "lookup_dcookie", "epoll_create", "epoll_ctl_old", "epoll_wait_old", "remap_file_pages",
    "getdents64", "set_tid_address", "restart_syscall", "semtimedop", "fadvise64", "timer_create",
    "timer_settime", "timer_gettime", "timer_getoverrun", "timer_delete", "clock_settime",
    "clock_gettime", "clock_getres", "clock_nanosleep", "exit_group", "epoll_wait", "epoll_ctl",
    "tgkill", "utimes", "vserver", "mbind", "set_mempolicy", "get_mempolicy", "mq_open",
    "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr", "kexec_load",
    "waitid", "add_key", "request_key", "keyctl", "ioprio_set", "ioprio_get", "inotify_init",
    "inotify_add_watch", "inotify_rm_watch", "migrate_pages", "openat", "mkdirat", "mknodat",
    "fchownat", "futimesat", "newfstatat", "unlinkat", "renameat", "linkat", "symlinkat",
    "readlinkat", "fchmodat", "faccessat", "pselect6", "ppoll", "unshare", "set_robust_list",
    "get_robust_list", "splice", "tee", "sync_file_range", "vmsplice", "move_pages", "utimensat",
    "epoll_pwait", "signalfd", "timerfd_create", "eventfd", "fallocate", "timerfd_settime",
    "timerfd_gettime", "accept4", "signalfd4", "eventfd2", "epoll_create1", "dup3", "pipe2",
    "inotify_init1", "preadv", "pwritev", "rt_tgsigqueueinfo", "perf_event_open", "recvmmsg",
    "fanotify_init", "fanotify_mark", "prlimit64", "name_to_handle_at", "open_by_handle_at",
    "clock_adjtime", "syncfs", "sendmmsg", "setns", "getcpu", "process_vm_readv",
    "process_vm_writev", "kcmp", "finit_module", "sched_setattr", "sched_getattr", "renameat2",
    "seccomp", "getrandom", "memfd_create", "kexec_file_load", "bpf", "execveat", "userfaultfd",
    "membarrier", "mlock2", "copy_file_range", "preadv2", "pwritev2", "pkey_mprotect",
    "pkey_alloc", "pkey_free", "statx", "io_pgetevents", "rseq",
];

/// Where [`SYSCALLS_HIGH`] starts (the numbers after 334 are unused until 424).
const SYSCALLS_HIGH_START: usize = 424;

/// x86-64 system call names from 424 on.
#[rustfmt::skip]
const SYSCALLS_HIGH: [&str; 27] = [
    "pidfd_send_signal", "io_uring_setup", "io_uring_enter", "io_uring_register", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "pidfd_open", "clone3", "close_range",
    "openat2", "pidfd_getfd", "faccessat2", "process_madvise", "epoll_pwait2", "mount_setattr",
    "quotactl_fd", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    "memfd_secret", "process_mrelease", "futex_waitv", "set_mempolicy_home_node",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_list_compiles_in_every_mode() {
        for t in Thread::ALL {
            for mode in [Mode::Trap, Mode::Log] {
                let p = compile(t, mode);
                assert!(!p.is_empty(), "{t:?}");
                // A classic BPF program has at most 4096 instructions.
                assert!(p.len() <= 4096, "{t:?}: {} instructions", p.len());
            }
        }
        assert!(!no_clone3().is_empty());
    }

    /// The programs ember installs (compiled by the build script) are the
    /// lists as they stand, in both modes.
    #[test]
    fn the_built_in_programs_are_the_lists_compiled() {
        for t in Thread::ALL {
            for mode in [Mode::Trap, Mode::Log] {
                assert_eq!(
                    built_in(t, mode),
                    compile(t, mode).as_slice(),
                    "{t:?} {mode:?}"
                );
            }
        }
        assert_eq!(built::NO_CLONE3, no_clone3().as_slice());
        // Trap and log differ (the action on a mismatch).
        assert_ne!(
            built_in(Thread::Vcpu, Mode::Trap),
            built_in(Thread::Vcpu, Mode::Log)
        );
    }

    /// Nothing that could run another program, trace or debug another
    /// process, open a network socket or load kernel code is on any list;
    /// and `clone` is only allowed with checked flags.
    #[test]
    fn no_list_allows_dangerous_calls() {
        let forbidden = [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_kexec_load,
            libc::SYS_bpf,
            libc::SYS_mount,
            libc::SYS_setuid,
            libc::SYS_chroot,
            libc::SYS_personality,
        ];
        for t in Thread::ALL {
            let r = rules(t);
            for call in forbidden {
                // vsock connects guest streams to the host's Unix sockets
                // (and the spawner, which starts its thread, allows as much).
                let vsock = matches!(t, Thread::Vsock | Thread::Spawner);
                if vsock && call == libc::SYS_connect {
                    continue;
                }
                if vsock && call == libc::SYS_socket {
                    let only_unix = &r[&call];
                    assert!(only_unix.len() == 1 && only_unix[0][0].value == libc::AF_UNIX as u64);
                    continue;
                }
                assert!(
                    !r.contains_key(&call),
                    "{t:?} allows {}",
                    syscall_name(call as i32).unwrap()
                );
            }
            if let Some(clone) = r.get(&libc::SYS_clone) {
                assert!(!clone.is_empty(), "{t:?} allows clone with any flags");
            }
            // clone3 only where the ENOSYS filter is installed with the list.
            if r.contains_key(&libc::SYS_clone3) {
                assert!(stacks_no_clone3(t), "{t:?} allows clone3 without no_clone3");
            }
        }
    }

    /// Lists that must stay narrow: no vCPU or device thread may open or
    /// remove files, none but the balloon (whose deflate commits memory on
    /// worker threads) create threads; only block does disk I/O.
    #[test]
    fn vcpu_and_device_lists_stay_narrow() {
        for t in [
            Thread::Vcpu,
            Thread::Block,
            Thread::Console,
            Thread::Rng,
            Thread::Net,
            Thread::Pmem,
            Thread::Balloon,
            Thread::Vsock,
            Thread::Mem,
        ] {
            let r = rules(t);
            let mut forbidden = vec![libc::SYS_openat, libc::SYS_open, libc::SYS_unlink];
            if t != Thread::Balloon {
                forbidden.extend([libc::SYS_clone, libc::SYS_clone3]);
            }
            for call in forbidden {
                assert!(
                    !r.contains_key(&call),
                    "{t:?} allows {}",
                    syscall_name(call as i32).unwrap()
                );
            }
        }
        // virtio-fs is a file server: it opens and removes files, beneath
        // the share only (`devices::virtio::fs::passthrough`), but it too
        // starts nothing, runs nothing and reaches no network.
        let fs = rules(Thread::Fs);
        for call in [
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_execve,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_open,
            libc::SYS_mount,
        ] {
            assert!(!fs.contains_key(&call), "fs allows {call}");
        }
        assert!(rules(Thread::Block).contains_key(&libc::SYS_io_uring_enter));
        assert!(!rules(Thread::Rng).contains_key(&libc::SYS_pwritev));
        assert!(!rules(Thread::Vcpu).contains_key(&libc::SYS_pwritev));
    }

    /// Filters stack: whatever a thread needs must also pass the filter of
    /// the thread that starts it.
    #[test]
    fn a_creator_allows_what_its_threads_need() {
        let covers = |outer: Thread, inner: Thread| {
            let (o, i) = (rules(outer), rules(inner));
            for (call, conds) in &i {
                let Some(oc) = o.get(call) else {
                    panic!(
                        "{outer:?} starts {inner:?} threads but does not allow {}",
                        syscall_name(*call as i32).unwrap_or("?")
                    );
                };
                assert!(
                    oc.is_empty() || !conds.is_empty(),
                    "{outer:?} restricts {} which {inner:?} allows freely",
                    syscall_name(*call as i32).unwrap_or("?")
                );
            }
        };
        for device in [
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
            covers(Thread::Spawner, device);
        }
        // The main thread starts every other thread before it takes its
        // filter (`builder::BeforeGo`), so its list covers none of theirs:
        // its one clone is the keeper's (a process, no thread).
        let main = rules(Thread::Main);
        assert!(!main.contains_key(&libc::SYS_clone3));
        assert_eq!(
            main[&libc::SYS_clone].len(),
            1,
            "main's clone: the keeper's only"
        );
        for t in [Thread::Main, Thread::Api, Thread::Stdin] {
            for call in rules(Thread::Keeper).keys() {
                assert!(rules(t).contains_key(call), "{t:?} cannot start the keeper");
            }
        }
    }

    /// Runs classic BPF as seccomp does: the action `p` returns for a call.
    fn run_bpf(p: &[sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let word = |off: u32| -> u32 {
            match off {
                0 => nr,
                4 => arch,
                8 | 12 => 0,
                16..=63 => {
                    let a = args[((off - 16) / 8) as usize];
                    if off % 8 == 0 {
                        a as u32
                    } else {
                        (a >> 32) as u32
                    }
                }
                _ => panic!("load from offset {off}"),
            }
        };
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let i = &p[pc];
            pc += 1;
            let skip = |t: bool| usize::from(if t { i.jt } else { i.jf });
            match i.code {
                0x20 => a = word(i.k),
                0x54 => a &= i.k,
                0x05 => pc += i.k as usize,
                0x15 => pc += skip(a == i.k),
                0x25 => pc += skip(a > i.k),
                0x35 => pc += skip(a >= i.k),
                0x45 => pc += skip(a & i.k != 0),
                0x06 => return i.k,
                c => panic!("opcode {c:#x} at {}", pc - 1),
            }
        }
    }

    /// Arguments that probe a call's rules: every value they name, near
    /// misses in its low and its high half, and the extremes, one argument
    /// at a time.
    fn probes(rules: &[lists::Rule]) -> Vec<[u64; 6]> {
        let mut out = vec![[0u64; 6], [u64::MAX; 6]];
        for c in rules.iter().flatten() {
            for v in [
                c.value,
                c.value ^ 1,
                c.value ^ (1 << 40),
                c.value | 0xffff_ffff_0000_0000,
                c.value & 0xffff_ffff,
                !c.value,
                c.mask,
                !c.mask,
                0,
                u64::MAX,
            ] {
                let mut a = [0u64; 6];
                a[usize::from(c.arg)] = v;
                out.push(a);
            }
        }
        out
    }

    /// ember's compact programs allow, trap and log exactly what
    /// seccompiler's programs for the same lists do, on every system call
    /// number with arguments around every value the lists name, and kill a
    /// foreign architecture's calls as they do; and they are shorter.
    #[test]
    fn compact_programs_agree_with_seccompilers() {
        let check = |name: &str, ours: &[sock_filter], theirs: &[sock_filter], rules: &Rules| {
            assert!(
                ours.len() < theirs.len(),
                "{name}: {} ≥ {}",
                ours.len(),
                theirs.len()
            );
            assert!(ours.len() <= 4096, "{name}: too long for the kernel");
            for nr in (0..=1000u32).chain([0x4000_0000, u32::MAX]) {
                let rs = rules.get(&i64::from(nr)).map_or(&[][..], Vec::as_slice);
                for args in probes(rs) {
                    for arch in [0xc000_003e, 0x4000_0003] {
                        assert_eq!(
                            run_bpf(ours, nr, arch, args),
                            run_bpf(theirs, nr, arch, args),
                            "{name}: {} ({nr}) {args:x?} arch {arch:#x}",
                            syscall_name(nr as i32).unwrap_or("?")
                        );
                    }
                }
            }
        };
        for t in Thread::ALL {
            for mode in [SeccompAction::Trap, SeccompAction::Log] {
                let ours = lists::program(t, mode.clone());
                let theirs = lists::reference::program(t, mode).unwrap();
                check(t.name(), &ours, &theirs, &rules(t));
            }
        }
        // Conditions the lists do not use yet: a value with bits outside its
        // mask (masked too, as seccompiler does), a mask leaving a half out,
        // several conditions in a rule.
        let mut odd = Rules::new();
        let c = |arg, wide, mask, value| lists::Cond {
            arg,
            wide,
            mask,
            value,
        };
        odd.insert(1, vec![vec![c(0, true, 0x10000, 0x10001)]]);
        odd.insert(
            2,
            vec![
                vec![c(1, true, 0xff, 1 << 33)],
                vec![c(2, false, 0xf0, 0x30)],
            ],
        );
        odd.insert(
            3,
            vec![vec![
                c(0, true, u64::MAX, 7),
                c(5, false, u64::from(u32::MAX), 9),
            ]],
        );
        for mode in [SeccompAction::Trap, SeccompAction::Log] {
            let ours = lists::compact(&odd, mode.clone().into(), SeccompAction::Allow.into());
            let theirs = lists::reference::compile(&odd, mode).unwrap();
            check("odd", &ours, &theirs, &odd);
        }
        let mut clone3 = Rules::new();
        clone3.insert(libc::SYS_clone3, Vec::new());
        check(
            "clone3",
            &lists::no_clone3_program(),
            &lists::reference::no_clone3_program().unwrap(),
            &clone3,
        );
    }

    /// Runs `call` in a forked child under `thread`'s compiled filter (trap,
    /// no handler: SIGSYS kills it); returns the child's wait status.
    fn in_filtered_child(thread: Thread, call: fn()) -> libc::c_int {
        let prog = built_in(thread, Mode::Trap);
        // SAFETY: the child makes only raw system calls (no allocation,
        // which fork from a threaded test process does not allow), then _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // The filter and the call, then status 0.
            if seccompiler::apply_filter(prog).is_err() {
                // SAFETY: _exit has no preconditions.
                unsafe { libc::_exit(2) };
            }
            call();
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    #[test]
    fn a_compiled_filter_stops_what_its_list_lacks() {
        fn socket() {
            // SAFETY: socket takes integers.
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        }
        fn entropy() {
            let mut b = [0u8; 8];
            // SAFETY: a valid buffer of that length.
            unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        }
        fn pwrite() {
            // SAFETY: an invalid descriptor: the call fails, if allowed.
            unsafe { libc::pwrite(-1, std::ptr::null(), 0, 0) };
        }
        let killed_by_sigsys =
            |s: libc::c_int| libc::WIFSIGNALED(s) && libc::WTERMSIG(s) == libc::SIGSYS;
        let exited_0 = |s: libc::c_int| libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0;
        assert!(killed_by_sigsys(in_filtered_child(Thread::Block, socket)));
        assert!(killed_by_sigsys(in_filtered_child(Thread::Rng, pwrite)));
        assert!(killed_by_sigsys(in_filtered_child(Thread::Vcpu, pwrite)));
        assert!(exited_0(in_filtered_child(Thread::Rng, entropy)));
        assert!(exited_0(in_filtered_child(Thread::Block, pwrite)));
        // The vCPU thread: KVM's requests, not a terminal's.
        fn kvm_request() {
            // SAFETY: an invalid descriptor: the call fails, if allowed.
            unsafe { libc::ioctl(-1, KVM_CHECK_EXTENSION as _, 0) };
        }
        fn tiocsti() {
            // SAFETY: as above.
            unsafe { libc::ioctl(-1, libc::TIOCSTI, std::ptr::null::<u8>()) };
        }
        assert!(exited_0(in_filtered_child(Thread::Vcpu, kvm_request)));
        assert!(killed_by_sigsys(in_filtered_child(Thread::Vcpu, tiocsti)));
        assert!(killed_by_sigsys(in_filtered_child(Thread::Api, tiocsti)));
    }

    /// `_IO(KVMIO, 0x03)`, linux/kvm.h.
    const KVM_CHECK_EXTENSION: u64 = 0xAE03;

    /// The threads that talk to KVM may make any KVM request and no other
    /// ioctl but the terminal's few (base); the others make no KVM request.
    #[test]
    fn only_kvm_threads_make_kvm_requests_and_no_other_ioctl() {
        const KVM_RUN: u64 = 0xAE80;
        // _IOR(KVMIO, 0x81, struct kvm_regs) and _IOW(KVMIO, 0x46, struct
        // kvm_userspace_memory_region): sizes and directions vary.
        const KVM_GET_REGS: u64 = 0x8090_AE81;
        const KVM_SET_USER_MEMORY_REGION: u64 = 0x4020_AE46;
        const FICLONE: u64 = 0x4004_9409;
        let allowed = |t: Thread, request: u64| {
            let p = built_in(t, Mode::Trap);
            let mut args = [0u64; 6];
            args[1] = request;
            run_bpf(p, libc::SYS_ioctl as u32, 0xc000_003e, args) == libc::SECCOMP_RET_ALLOW
        };
        for t in [Thread::Vcpu, Thread::Api] {
            for r in [
                KVM_RUN,
                KVM_GET_REGS,
                KVM_SET_USER_MEMORY_REGION,
                KVM_CHECK_EXTENSION,
            ] {
                assert!(allowed(t, r), "{t:?} refuses KVM request {r:#x}");
                // The kernel compares 32 bits (the upper half is not looked at).
                assert!(allowed(t, r | 0xffff_ffff_0000_0000), "{t:?} {r:#x}");
            }
            for r in [
                lists::request(libc::TIOCSTI),
                lists::request(libc::FIONBIO),
                lists::request(libc::TIOCGWINSZ),
                FICLONE,
                // KVM's type in another byte.
                0xAE00_0003,
                0x00AE_0003,
            ] {
                assert!(!allowed(t, r), "{t:?} allows ioctl {r:#x}");
            }
            assert!(
                allowed(t, lists::request(libc::TCGETS)),
                "{t:?}: base's TCGETS"
            );
        }
        for t in Thread::ALL {
            if !matches!(t, Thread::Vcpu | Thread::Api) {
                assert!(!allowed(t, KVM_RUN), "{t:?} allows KVM_RUN");
            }
        }
    }

    #[test]
    fn syscall_names() {
        assert_eq!(syscall_name(0), Some("read"));
        assert_eq!(syscall_name(libc::SYS_socket as i32), Some("socket"));
        assert_eq!(syscall_name(libc::SYS_clone3 as i32), Some("clone3"));
        assert_eq!(
            syscall_name(libc::SYS_io_uring_enter as i32),
            Some("io_uring_enter")
        );
        assert_eq!(syscall_name(400), None);
        assert_eq!(syscall_name(-1), None);
        assert_eq!(syscall_name(100_000), None);
    }

    #[test]
    fn the_message_names_thread_and_call() {
        let mut out = StackBuf {
            buf: [0; 192],
            len: 0,
        };
        let mut name = [0u8; 16];
        name[..10].copy_from_slice(b"ember-blk0");
        violation_message(&name, libc::SYS_socket as i32, None, &mut out);
        assert_eq!(
            std::str::from_utf8(&out.buf[..out.len]).unwrap(),
            "ember: seccomp: thread ember-blk0 made forbidden syscall socket (41)\n"
        );
        out.len = 0;
        violation_message(
            b"ember-vcpu0\0",
            libc::SYS_ioctl as i32,
            Some(0xffff_ffff_0000_5412),
            &mut out,
        );
        assert_eq!(
            std::str::from_utf8(&out.buf[..out.len]).unwrap(),
            "ember: seccomp: thread ember-vcpu0 made forbidden syscall ioctl (16) request 0x5412\n"
        );
    }
}
