//! "Virtual state": thin owners of the KVM file descriptors and guest memory.
//! This is where ember's `unsafe` lives (ioctls and memory mappings).

pub mod kvm;
pub mod memory;
pub mod teardown;
pub mod vcpu;
pub mod vm;
