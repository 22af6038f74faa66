//! ember: a small microVM monitor for Linux/KVM, and the tools that show where
//! every millisecond of a boot goes.
//!
//! The boot path, top to bottom, is in [`builder`]; `ARCHITECTURE.md` walks it
//! in numbered steps.

pub mod appliance;
pub mod arch;
pub mod backend;
pub mod builder;
pub mod devices;
pub mod events;
pub mod initramfs;
pub mod lab;
pub mod run;
pub mod testing;
pub mod vstate;
