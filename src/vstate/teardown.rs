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
        // Child: release the terminal and pipes at once so nobody waiting for
        // end-of-file on our output waits for the teardown.
        for fd in 0..3 {
            // SAFETY: closing descriptors we own; the child uses none of them.
            unsafe { libc::close(fd) };
        }
        // SAFETY: _exit ends the child without running any Rust or libc
        // destructors (which could take locks another thread held at fork).
        unsafe { libc::_exit(0) };
    }
    std::process::exit(code)
}
