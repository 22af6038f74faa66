//! Ctrl-C handling: the first SIGINT sets a flag that the boot loop polls, so
//! a long run stops after killing the current boot and still reports what it
//! measured. A second Ctrl-C ends the process as any fatal signal does
//! ([`crate::cleanup`] owns the handler).

use std::sync::atomic::{AtomicBool, Ordering};

/// Has the first SIGINT set the flag instead of ending ember (idempotent).
pub fn install() {
    crate::cleanup::soft_interrupt();
}

/// Whether Ctrl-C was pressed since [`install`].
pub fn interrupted() -> bool {
    flag().load(Ordering::SeqCst)
}

/// The flag itself, for code that takes a cancellation flag (tests pass their own).
pub fn flag() -> &'static AtomicBool {
    crate::cleanup::interrupt_flag()
}
