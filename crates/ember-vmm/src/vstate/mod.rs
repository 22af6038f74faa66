//! "Virtual state": thin owners of the KVM file descriptors and guest memory.
//! Its `unsafe` is ioctls and memory mappings; the devices hold the rest of
//! ember-vmm's (guest-memory I/O; see ARCHITECTURE.md for the counts).

pub mod bus;
pub mod control;
pub mod end;
pub mod holes;
pub(crate) mod kvm;
pub mod memory;
pub(crate) mod teardown;
pub(crate) mod vcpu;
pub(crate) mod vcpu_state;
pub(crate) mod vm;
pub(crate) mod vm_state;
