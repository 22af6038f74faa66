//! ember-vmm: ember's virtual machine monitor, with no command line.
//!
//! The boot path, top to bottom, is in [`builder`]; `ARCHITECTURE.md` walks it
//! in numbered steps. The layers, each using only those below it (no module
//! depends on one above it):
//! [`snapshot`] (saving a VM, and [`snapshot::restore`] building one from a
//! snapshot) over [`builder`] (the boot order) over `device_manager`
//! (placing devices) and [`machine`] (the running VM, and the one
//! configuration type per device), over [`prefault`] (`--prefault`:
//! committing guest memory, fenced by the balloon) over [`devices`] (device
//! models, which hold no KVM) over
//! [`vstate`] (KVM, guest memory, vCPUs, the I/O bus and how the guest's end
//! is signalled) over [`arch`] (x86-64 tables, registers and the guest
//! memory layout). [`events`], [`logger`], `ranges`, [`seccomp`] and
//! [`error_chain`] serve every layer.

// The crate exports an API, not its insides: what is `pub` is documented,
// and nothing is `pub` that no caller outside can reach.
#![deny(missing_docs, unreachable_pub)]

pub mod arch;
pub mod builder;
pub(crate) mod device_manager;
pub mod devices;
pub mod events;
pub(crate) mod files;
#[cfg(fuzzing)]
pub mod fuzz;
pub(crate) mod hex;
pub mod logger;
pub mod machine;
pub mod prefault;
pub(crate) mod ranges;
pub mod seccomp;
pub mod snapshot;
pub mod vstate;

/// Formats an error and its sources on one line (every layer reports
/// errors this way; it depends on none of them).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}
