//! A real Linux guest on ember: the PVM test kernel (`EMBER_PVM_KERNEL`,
//! built by `scripts/pvm-kernel`; without it each test says SKIPPED): the
//! loader paths, disks, virtio drivers, snapshots, the balloon and the
//! appliance's snapshot.
//!
//! One test binary (one link of ember and the test dependencies) for what
//! were separate ones: each module below is one of them, its tests named
//! `module::test` (`cargo test --test GROUP -- module::` runs one).

#[path = "../common/mod.rs"]
mod common;

mod appliance_hostroot;
mod appliance_net;
mod appliance_snapshot;
mod linux_balloon;
mod linux_disk;
mod linux_fs;
mod linux_mem;
mod linux_pvm;
mod net_linux;
mod shim_pvm;
mod snapshot_balloon;
mod snapshot_linux;
mod virtio_linux;
