//! Leaving quickly: destroying a KVM VM after its vCPUs ran costs several
//! milliseconds on this host (an SRCU grace period, shadow page tables), and
//! so does tearing down the address space KVM registered its MMU notifier on.
//! A process that simply exits pays both before its parent sees it exit.
//!
//! So ember splits in two before it creates the VM ([`split`]): the process
//! the user started becomes a *waiter* that only waits for the result, and a
//! forked child becomes the VMM. When the guest ends, the VMM releases
//! everything an observer could be waiting on (the terminal, pipes, the
//! appliance's socket), reports the exit status to the waiter
//! ([`Reporter::exit`]) and exits; the waiter exits with that status at once,
//! while the VMM's exit (VM destruction and all) finishes where nobody waits.
//!
//! If the VMM dies without reporting (an error, a signal), the waiter reaps
//! it and ends the same way. If the waiter is killed, the kernel kills the VMM
//! (`PR_SET_PDEATHSIG`), so killing ember's pid always stops the VM.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    /// The report pipe couldn't be made.
    #[error("cannot create a pipe")]
    Pipe(#[source] std::io::Error),
    /// The VMM process couldn't be forked.
    #[error("cannot fork the VMM process")]
    Fork(#[source] std::io::Error),
    /// The VMM couldn't ask to die with the waiter.
    #[error("cannot tie the VMM to its waiter")]
    DeathSignal(#[source] std::io::Error),
}

/// The VMM's end of the report pipe.
#[derive(Debug)]
pub struct Reporter {
    pipe: File,
}

/// Splits into waiter and VMM. Returns in the VMM (the child); in the
/// waiter it never returns: it exits the way the VMM ended.
///
/// Call it while the process has a single thread: the child continues
/// running ordinary Rust code, which is only safe after fork from a
/// single-threaded process.
pub fn split() -> Result<Reporter, TeardownError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(TeardownError::Pipe(std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and now owned here.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // Whatever is buffered must not be written twice, once by each process.
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let waiter = std::process::id();
    // SAFETY: the caller guarantees a single-threaded process, so the child
    // may go on running any code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(TeardownError::Fork(std::io::Error::last_os_error()));
    }
    if pid > 0 {
        drop(write_end);
        wait_for_vmm(File::from(read_end), pid);
    }
    drop(read_end);
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and no pointers.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
        return Err(TeardownError::DeathSignal(std::io::Error::last_os_error()));
    }
    // The waiter may have died before the death signal was armed.
    if std::os::unix::process::parent_id() != waiter {
        // SAFETY: _exit has no preconditions.
        unsafe { libc::_exit(EXIT_WAITER_GONE) };
    }
    Ok(Reporter {
        pipe: File::from(write_end),
    })
}

/// Status of a VMM whose waiter vanished before it started (nobody sees it).
const EXIT_WAITER_GONE: i32 = 1;

/// The waiter: exit with the status the VMM reports, or the way it died.
fn wait_for_vmm(mut pipe: File, vmm: libc::pid_t) -> ! {
    let mut code = [0u8; 4];
    if pipe.read_exact(&mut code).is_ok() {
        // The VMM is still exiting; it is reparented and reaped by init.
        // SAFETY: _exit has no preconditions; the waiter has nothing to flush.
        unsafe { libc::_exit(i32::from_ne_bytes(code)) };
    }
    let mut status = 0;
    loop {
        // SAFETY: waiting for our own child; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(vmm, &mut status, 0) };
        if r == vmm || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        // Die of the same signal, so our parent sees what happened. Core
        // dumps are the VMM's business, not the waiter's.
        // SAFETY: resetting a signal's disposition and raising it in our own
        // (single-threaded) process.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            let limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &limit);
            libc::raise(sig);
        }
        // SAFETY: _exit has no preconditions.
        unsafe { libc::_exit(128 + sig) };
    }
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(libc::WEXITSTATUS(status)) }
}

impl Reporter {
    /// Ends the VMM: flushes output, lets go of every pipe, socket and
    /// terminal (so whoever reads them sees end-of-file now), reports `code`
    /// to the waiter and exits. The VM is destroyed by this process's exit,
    /// after the waiter has gone.
    pub fn exit(self, code: i32) -> ! {
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        let report = self.pipe.as_raw_fd();
        // Device and vCPU threads still run, so no descriptor is closed under
        // them: a pipe or terminal is replaced by /dev/null (their writes go
        // nowhere, reads see end-of-file), a socket is shut down. Eventfds,
        // KVM's descriptors and disk files stay; the exit closes them, and
        // closing the last VM descriptor here would destroy the VM before the
        // report.
        let null = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null");
        for fd in open_fds() {
            if fd == report {
                continue;
            }
            match release_kind(fd) {
                Release::Shutdown => {
                    // SAFETY: shutting down a socket this process owns; the
                    // descriptor stays valid for any thread still using it.
                    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                }
                Release::Replace => {
                    if let Ok(null) = &null {
                        // SAFETY: dup2 atomically points `fd` at /dev/null,
                        // so a thread using it never sees a closed or reused
                        // descriptor.
                        unsafe { libc::dup2(null.as_raw_fd(), fd) };
                    }
                }
                Release::Keep => {}
            }
        }
        let bytes = code.to_ne_bytes();
        // SAFETY: writing 4 bytes from a valid buffer to our pipe; a 4-byte
        // pipe write is atomic. If the waiter is gone there is nobody to tell.
        unsafe { libc::write(report, bytes.as_ptr().cast(), bytes.len()) };
        // SAFETY: _exit skips destructors and atexit handlers; the threads
        // still running must not see the process's state torn down under them.
        unsafe { libc::_exit(code) }
    }
}

/// What [`Reporter::exit`] does with a descriptor.
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

/// The process's open descriptors (a few dozen), from /proc.
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
    }
}
