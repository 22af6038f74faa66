//! Leaving quickly: destroying a KVM VM after its vCPUs ran costs several
//! milliseconds where KVM waits out an SRCU grace period and frees shadow page
//! tables (5-25 ms measured on a software-virtualised PVM host), and
//! so does tearing down the address space KVM registered its MMU notifier on.
//! A process that simply exits pays both before its parent sees it exit.
//!
//! So ember's exit frees neither ([`exit`]). When the guest ends, ember
//! clones a *keeper*: a process that shares ember's address space
//! (`CLONE_VM`) and holds a copy of its descriptor table, of which it keeps
//! only the VM's descriptor. ember exits; the address space and the VM are
//! still the keeper's, so the kernel frees neither, and ember's parent sees
//! the exit status at once. Every other descriptor (the terminal, pipes, the
//! appliance's socket, a shared directory) is closed by the keeper before
//! ember exits — ember waits the few microseconds that takes — so whoever
//! reads them sees end-of-file then too, and whoever checks after ember's
//! exit finds nothing of it holding a file. The kernel kills the keeper as ember dies
//! (`PR_SET_PDEATHSIG`), and the keeper's exit — unmapping guest memory,
//! destroying the VM — finishes where nobody waits.
//!
//! The keeper shares memory with a process that is exiting, so it runs no
//! Rust or libc code that could touch shared state: a handful of raw system
//! calls on its own stack, with every signal blocked.

use std::io::Write;
use std::os::fd::RawFd;

/// Ends ember with status `code`, leaving the teardown of the VM whose
/// descriptor is `vm` to a keeper.
pub(crate) fn exit(code: i32, vm: RawFd) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    keep_for_teardown(vm);
    // SAFETY: _exit skips destructors and atexit handlers; the threads
    // still running must not see the process's state torn down under them.
    unsafe { libc::_exit(code) }
}

/// The keeper's seccomp program (pointer, length), set before it is cloned.
static KEEPER_FILTER: std::sync::OnceLock<(usize, u16)> = std::sync::OnceLock::new();

/// Set by the keeper (in the address space both share) once it has closed
/// every descriptor but the VM's; ember waits for it before exiting.
static KEEPER_CLOSED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// How long ember waits for the keeper to close its copies: a bound, not an
/// expected time (it takes microseconds), so a keeper that cannot run never
/// holds ember's exit up.
const KEEPER_CLOSE_WAIT: libc::timespec = libc::timespec {
    tv_sec: 0,
    tv_nsec: 200_000_000,
};

/// The keeper's stack: it makes a few system calls.
const KEEPER_STACK: usize = 16 * 1024;

/// Clones the keeper, which keeps descriptor `vm`. Best effort: without a
/// keeper, ember's exit pays for the teardown itself, which is slower but no
/// less correct.
fn keep_for_teardown(vm: i32) {
    let Ok(vm) = u32::try_from(vm) else { return };
    // SAFETY: a fresh anonymous mapping; nothing else refers to it. It is
    // never unmapped: it lives as long as the shared address space.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            KEEPER_STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        return;
    }
    // The keeper inherits this thread's signal mask. Blocked, no signal can
    // run one of ember's handlers on the keeper's stack; SIGKILL (the death
    // signal) cannot be blocked. This thread keeps them blocked too: it only
    // exits from here.
    // SAFETY: a zeroed sigset_t is a valid argument for sigfillset, which
    // fills it; pthread_sigmask reads it and takes no old-mask pointer.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
    }
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() } as u32;
    let arg = (u64::from(parent) << 32 | u64::from(vm)) as usize;
    // Its seccomp filter is read before the clone: the keeper only makes
    // raw system calls.
    if let Some(p) = crate::seccomp::keeper_program() {
        // SAFETY: a store into a static the keeper reads; nothing else
        // writes it.
        let _ = KEEPER_FILTER.set(p);
    }
    // SAFETY: the stack pointer passed is the top of the mapping above
    // (16-byte aligned, as a page is), which only the keeper uses; `keeper`
    // makes only raw system calls, so sharing this address space with an
    // exiting process is harmless; its argument is a plain integer.
    let pid = unsafe {
        libc::clone(
            keeper,
            stack.cast::<u8>().add(KEEPER_STACK).cast(),
            libc::CLONE_VM | libc::SIGCHLD,
            arg as *mut libc::c_void,
        )
    };
    if pid > 0 {
        wait_for_keeper_close();
    }
}

/// Waits (boundedly) until the keeper has closed its copies of ember's
/// descriptors: otherwise, for a moment after ember's exit, a process of
/// ember's still holds its files, pipes and shared directories.
fn wait_for_keeper_close() {
    use std::sync::atomic::Ordering;
    let mut left = 10;
    while KEEPER_CLOSED.load(Ordering::Acquire) == 0 && left > 0 {
        left -= 1;
        // SAFETY: FUTEX_WAIT reads the static's word and sleeps while it is
        // 0, for at most the timeout, which outlives the call.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                KEEPER_CLOSED.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                0u32,
                &KEEPER_CLOSE_WAIT as *const libc::timespec,
            );
        }
    }
}

/// The keeper: keeps the VM's descriptor (its parent's pid and that
/// descriptor packed in `arg`) and dies with its parent.
extern "C" fn keeper(arg: *mut libc::c_void) -> libc::c_int {
    let arg = arg as usize as u64;
    let (parent, vm) = ((arg >> 32) as libc::c_long, arg as u32);
    // SAFETY: raw system calls with integer arguments only. `syscall` sets
    // errno (the parent's, since the keeper shares its thread pointer) only
    // on failure, which is harmless for a process about to exit.
    unsafe {
        if let Some(&(filter, len)) = KEEPER_FILTER.get() {
            // Narrows what it inherited to its own list (`seccomp::keeper`).
            let prog = libc::sock_fprog {
                len,
                filter: filter as *mut libc::sock_filter,
            };
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                &prog as *const libc::sock_fprog,
            );
        }
        keep_only(vm);
        // A plain store and a futex wake: no Rust runtime needed.
        KEEPER_CLOSED.store(1, std::sync::atomic::Ordering::Release);
        libc::syscall(
            libc::SYS_futex,
            KEEPER_CLOSED.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1u32,
        );
        libc::syscall(
            libc::SYS_prctl,
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
        );
        // Until the death signal was armed, ember may already have died.
        while libc::syscall(libc::SYS_getppid) == parent {
            libc::syscall(libc::SYS_pause);
        }
    }
    0
}

/// Closes every descriptor but `keep`, with raw system calls only. Where
/// close_range(2) is missing (Linux before 5.9) the rest stay open until the
/// process ends: slower for a reader waiting on them, no less correct.
///
/// # Safety
///
/// Every descriptor but `keep` is closed under whatever else in the process
/// uses them: call it only in a process that uses none of them.
unsafe fn keep_only(keep: u32) {
    // SAFETY: close_range takes integers; the caller vouches for the rest.
    unsafe {
        if keep > 0 {
            libc::syscall(libc::SYS_close_range, 0u32, keep - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, keep + 1, u32::MAX, 0u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_keeper_keeps_only_the_vm_descriptor() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let (_a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let keep = file.as_raw_fd();
        // In a child, since it closes everything: the child makes only raw
        // system calls (fork from a threaded test process allows no more)
        // and reports through its exit status.
        // SAFETY: the child runs only async-signal-safe calls, then _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: this child uses no descriptor but `keep` from here on.
            unsafe { keep_only(keep as u32) };
            let mut open = 0;
            let mut kept = false;
            for fd in 0..1024 {
                // SAFETY: F_GETFD only reads a descriptor's flags.
                if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
                    open += 1;
                    kept |= fd == keep;
                }
            }
            // SAFETY: _exit has no preconditions.
            unsafe { libc::_exit(if open == 1 && kept { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "only {keep} stays open");
    }
}
