//! Ctrl-C handling: the first SIGINT sets a flag that the boot loop polls, so
//! a long run stops after killing the current boot and still reports what it
//! measured. (A second Ctrl-C finds the default disposition again and ends the
//! process the usual way.)

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_signal: libc::c_int) {
    // Only async-signal-safe work here: an atomic store and resetting the
    // disposition so a second Ctrl-C is not swallowed.
    INTERRUPTED.store(true, Ordering::SeqCst);
    // SAFETY: signal() is async-signal-safe; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Installs the SIGINT handler (idempotent).
pub fn install() {
    let handler: extern "C" fn(libc::c_int) = on_sigint;
    // SAFETY: the handler only touches an atomic and calls signal(), both
    // async-signal-safe; the sigaction struct is zeroed and then filled in.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as libc::sighandler_t;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
    }
}

/// Whether Ctrl-C was pressed since the handler was installed.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The flag itself, for code that takes a cancellation flag (tests pass their own).
pub fn flag() -> &'static AtomicBool {
    &INTERRUPTED
}
