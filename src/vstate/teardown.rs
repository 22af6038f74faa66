//! Leaving quickly: destroying a KVM VM after its vCPUs ran costs several
//! milliseconds on this host (an SRCU grace period, shadow page tables), and
//! so does tearing down the address space KVM registered its MMU notifier on.
//! A process that simply exits pays both before its parent sees it exit.
//!
//! So ember does not let its exit free either ([`exit`]). When the guest
//! ends, it releases everything an observer could be waiting on (the
//! terminal, pipes, the appliance's socket), then clones a *keeper*: a
//! process that shares ember's address space and descriptor table
//! (`CLONE_VM | CLONE_FILES`) and only waits to die. ember exits; since the
//! keeper still holds both, the kernel frees neither, and ember's parent sees
//! the exit status at once. The kernel kills the keeper as ember dies
//! (`PR_SET_PDEATHSIG`), and the keeper's exit — closing the VM's
//! descriptors, unmapping guest memory — finishes where nobody waits.
//!
//! The keeper shares memory with a process that is exiting, so it runs no
//! Rust or libc code that could touch shared state: a handful of raw system
//! calls on its own stack, with every signal blocked.

use std::io::Write;
use std::os::fd::AsRawFd;

/// Ends ember with status `code`: flushes output, lets go of every pipe,
/// socket and terminal (so whoever reads them sees end-of-file now), hands
/// the VM's teardown to a keeper and exits.
pub fn exit(code: i32) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    release_descriptors();
    keep_for_teardown();
    // SAFETY: _exit skips destructors and atexit handlers; the threads
    // still running must not see the process's state torn down under them.
    unsafe { libc::_exit(code) }
}

/// Device and vCPU threads still run, so no descriptor is closed under them:
/// a pipe or terminal is replaced by /dev/null (their writes go nowhere, reads
/// see end-of-file), a socket is shut down. Eventfds, KVM's descriptors and
/// disk files stay: the keeper holds them until it dies.
fn release_descriptors() {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null");
    for fd in open_fds() {
        match release_kind(fd) {
            Release::Shutdown => {
                // SAFETY: shutting down a socket this process owns; the
                // descriptor stays valid for any thread still using it.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
            Release::Replace => {
                if let Ok(null) = &null {
                    // SAFETY: dup2 atomically points `fd` at /dev/null, so a
                    // thread using it never sees a closed or reused descriptor.
                    unsafe { libc::dup2(null.as_raw_fd(), fd) };
                }
            }
            Release::Keep => {}
        }
    }
}

/// The keeper's stack: it makes three system calls.
const KEEPER_STACK: usize = 16 * 1024;

/// Clones the keeper. Best effort: without one, ember's exit pays for the
/// teardown itself, which is slower but no less correct.
fn keep_for_teardown() {
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
    // SAFETY: the stack pointer passed is the top of the mapping above
    // (16-byte aligned, as a page is), which only the keeper uses; `keeper`
    // makes only raw system calls, so sharing this address space with an
    // exiting process is harmless; its argument is a plain integer.
    unsafe {
        libc::clone(
            keeper,
            stack.cast::<u8>().add(KEEPER_STACK).cast(),
            libc::CLONE_VM | libc::CLONE_FILES | libc::SIGCHLD,
            libc::getpid() as usize as *mut libc::c_void,
        );
    }
}

/// The keeper: dies with its parent, holding ember's memory and descriptors
/// until then.
extern "C" fn keeper(parent: *mut libc::c_void) -> libc::c_int {
    // SAFETY: raw system calls with integer arguments only. `syscall` sets
    // errno (the parent's, since the keeper shares its thread pointer) only
    // on failure, and neither of these fails.
    unsafe {
        libc::syscall(
            libc::SYS_prctl,
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
        );
        // Until the death signal was armed, ember may already have died.
        while libc::syscall(libc::SYS_getppid) == parent as usize as libc::c_long {
            libc::syscall(libc::SYS_pause);
        }
    }
    0
}

/// What [`exit`] does with a descriptor.
#[derive(Debug, PartialEq, Eq)]
enum Release {
    /// A socket: shut it down.
    Shutdown,
    /// A pipe or terminal (a FIFO or character device): point it at /dev/null.
    Replace,
    /// Anything else: leave it to the exit.
    Keep,
}

fn release_kind(fd: i32) -> Release {
    // SAFETY: a zeroed stat is a valid out-parameter for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into `st`, which lives for the call.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Release::Keep;
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFSOCK => Release::Shutdown,
        libc::S_IFIFO | libc::S_IFCHR => Release::Replace,
        _ => Release::Keep,
    }
}

/// The process's open descriptors (a dozen or so), from /proc. (A poll(2)
/// over every number the descriptor limit allows, telling closed ones by
/// `POLLNVAL`, was slower here: 60 µs for 1024 numbers, 400 µs for 20000.)
fn open_fds() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    // Collected first: the directory's own descriptor is among them, and
    // it closes when `dir` drops.
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::net::UnixStream;

    #[test]
    fn pipes_and_terminals_are_replaced_sockets_shut_down_the_rest_kept() {
        let mut fds = [0; 2];
        // SAFETY: `fds` is a valid array for pipe to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: pipe succeeded; these descriptors are ours to own.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        assert_eq!(release_kind(r.as_raw_fd()), Release::Replace);
        assert_eq!(release_kind(w.as_raw_fd()), Release::Replace);
        let null = File::open("/dev/null").unwrap();
        assert_eq!(release_kind(null.as_raw_fd()), Release::Replace);
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(release_kind(a.as_raw_fd()), Release::Shutdown);
        let file = File::open("/proc/self/status").unwrap();
        assert_eq!(release_kind(file.as_raw_fd()), Release::Keep);
        let evt = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
        assert_eq!(release_kind(evt.as_raw_fd()), Release::Keep);
        assert_eq!(release_kind(-1), Release::Keep, "a closed descriptor");
        if let Ok(kvm) = kvm_ioctls::Kvm::new() {
            let vm = kvm.create_vm().unwrap();
            assert_eq!(release_kind(vm.as_raw_fd()), Release::Keep);
        }
        let open = open_fds();
        assert!(open.contains(&file.as_raw_fd()) && open.contains(&a.as_raw_fd()));
        // A number far past the others (no test opens hundreds), open then closed.
        const HIGH: i32 = 700;
        // SAFETY: dup2 onto a number nothing else in this process uses.
        assert_eq!(unsafe { libc::dup2(file.as_raw_fd(), HIGH) }, HIGH);
        assert!(open_fds().contains(&HIGH));
        // SAFETY: closing the duplicate made above.
        unsafe { libc::close(HIGH) };
        assert!(!open_fds().contains(&HIGH));
    }
}
