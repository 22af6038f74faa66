//! Leaving quickly: destroying a KVM VM after its vCPUs ran costs several
//! milliseconds on this host (an SRCU grace period, shadow page tables), and a
//! process that simply exits pays that before its parent sees it exit.
//!
//! Instead, once the result is reported, ember forks a child that inherits the
//! VM's file descriptors and exits at once; the parent's exit then drops only
//! its own references, and the VM is destroyed when the child exits, on
//! another core, while nobody waits.

use std::io::Write;

/// Flushes our output and exits with `code`, leaving VM teardown to a detached
/// child. Falls back to a plain exit if fork fails.
pub fn exit_leaving_teardown(code: i32) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: after fork in a multi-threaded process the child may only call
    // async-signal-safe functions; it calls nothing but close(2) and _exit(2).
    // The parent continues normally.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // Child: keep only the KVM descriptors. Everything else (the terminal,
        // pipes, the appliance's channel socket, disk files) is released at once,
        // so nobody waiting for end-of-file on them waits for the teardown.
        for fd in 0..MAX_FD {
            if !is_kvm_fd(fd) {
                // SAFETY: closing a descriptor this child owns and no longer uses.
                unsafe { libc::close(fd) };
            }
        }
        // SAFETY: _exit ends the child without running any Rust or libc
        // destructors (which could take locks another thread held at fork).
        unsafe { libc::_exit(0) };
    }
    std::process::exit(code)
}

/// Descriptors above this are not expected (ember opens a few dozen).
const MAX_FD: i32 = 1024;

/// Whether `fd` is a KVM VM or vCPU descriptor (`anon_inode:kvm-…`). Uses only
/// async-signal-safe calls and no allocation, as the forked child must.
fn is_kvm_fd(fd: i32) -> bool {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    const KVM_LINK: &[u8] = b"anon_inode:kvm-";
    let mut path = [0u8; 32];
    path[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let (mut n, mut len) = (fd.unsigned_abs(), 0);
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for (i, d) in digits[..len].iter().rev().enumerate() {
        path[PREFIX.len() + i] = *d;
    }
    // `path` stays NUL-terminated: it was zeroed and holds at most 24 bytes.
    let mut link = [0u8; 64];
    // SAFETY: `path` is a NUL-terminated string and `link` a buffer of the given length.
    let n = unsafe { libc::readlink(path.as_ptr().cast(), link.as_mut_ptr().cast(), link.len()) };
    n > 0 && link[..n as usize].starts_with(KVM_LINK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_kvm_descriptors_only() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert!(!is_kvm_fd(std::os::fd::AsRawFd::as_raw_fd(&file)));
        assert!(!is_kvm_fd(MAX_FD - 1), "a closed descriptor is not KVM");
        if let Ok(kvm) = kvm_ioctls::Kvm::new() {
            let vm = kvm.create_vm().unwrap();
            assert!(is_kvm_fd(std::os::fd::AsRawFd::as_raw_fd(&vm)));
        }
    }
}
