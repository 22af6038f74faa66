//! ember-vmm: ember's virtual machine monitor, with no command line.
//!
//! The boot path, top to bottom, is in [`builder`]; `ARCHITECTURE.md` walks it
//! in numbered steps. The layers, each using only those below it:
//! [`builder`] (the boot order) over [`devices`] (device models, which hold no
//! KVM) over [`vstate`] (KVM, guest memory, vCPUs, the I/O bus and how the
//! guest's end is signalled) over [`arch`] (x86-64 tables, registers and the
//! guest memory layout). [`events`] is the boot timeline every layer records
//! into.

pub mod arch;
pub mod builder;
pub mod device_manager;
pub mod devices;
pub mod events;
pub mod logger;
pub mod ranges;
pub mod seccomp;
pub mod snapshot;
pub mod vstate;
