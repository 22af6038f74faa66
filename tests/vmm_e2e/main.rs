//! ember's own test guest on KVM, through the `ember` binary: every
//! loader path, the control socket and snapshots, `--prefault`, seccomp, a
//! terminal, the boot lab on `--backend ember`. (`scripts/test` runs the
//! `vmm_e2e` module again against the shipped static binary.)
//!
//! One test binary (one link of ember and the test dependencies) for what
//! were separate ones: each module below is one of them, its tests named
//! `module::test` (`cargo test --test GROUP -- module::` runs one).

#[path = "../common/mod.rs"]
mod common;

mod fs_e2e;
mod lab_ember;
mod mem_e2e;
mod net_e2e;
mod passt_e2e;
mod prefault_e2e;
mod seccomp_e2e;
mod snapshot_e2e;
mod terminal_pty;
mod vmm_e2e;
mod vsock_e2e;
