//! Guests under QEMU/TCG: the appliance with Debian's cloud kernel
//! (`ember setup`), on the host's root (virtiofsd) and from its initramfs,
//! the test guest under QEMU microvm, and the boot lab's real boots. (The
//! boot doctor's A/B timings keep a binary of their own,
//! tests/doctor_qemu.rs, so no other test runs beside them.)
//!
//! One test binary (one link of ember and the test dependencies) for what
//! were separate ones: each module below is one of them, its tests named
//! `module::test` (`cargo test --test GROUP -- module::` runs one).

#[path = "../common/mod.rs"]
mod common;

mod appliance_e2e;
mod docker_e2e;
mod hostroot_e2e;
mod lab_qemu;
mod mem_e2e;
mod net_e2e;
mod shim_e2e;
mod test_guest_qemu;
