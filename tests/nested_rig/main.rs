//! End-to-end tests of ember's Linux paths with Debian's UNMODIFIED cloud
//! kernel (what `ember setup` fetched), in the nested rig: ONE L1 guest
//! (`ember run --backend qemu --nested-kvm`, QEMU/TCG emulating AMD SVM,
//! kvm-amd loaded) runs `tests/rig/suite.sh`, which boots the kernel with
//! ember once per case (L2) and prints structured `@@ CASE …` lines; each
//! test in `cases` judges one case. Entry paths (bzImage, vmlinux via PVH, vmlinux
//! via the 64-bit boot protocol) with 1 and 2 vCPUs; virtio devices found
//! through ACPI alone and driven by Debian's own modules; the appliance,
//! `ember analyze` and containers (containerd with ember's shim) on the
//! ember backend.
//!
//! Where the rig cannot start (no QEMU, no SVM, no cached kernel) every test
//! FAILS with the reason. Each case has its own time limit in the suite: a
//! hung case is killed there and named (its test fails), and the next case
//! runs. Should the L1 itself die or time out, the cases it finished are
//! still judged, the rest fail naming the case the L1 was running, and
//! `the_l1_runs_the_whole_suite` fails with the L1's reason. `EMBER_RIG_L2_ARGS` adds ember arguments to every
//! L2 boot (e.g. `--no-acpi`, to see the virtio tests fail); `EMBER_RIG_CASES`
//! runs only some cases (space-separated names).
//!
//! Modules: `stage` makes the L1's files, `l1` runs one L1 (and its hang
//! watchdog), `rig` runs L1s until one finishes the suite (retries) and holds
//! what it printed, `case` reads the suite's lines, `cases` judges them.
//! `rig_clean_boot` is another test in an L1 of its own (it shares this
//! binary, not the suite's L1).

#[path = "../common/mod.rs"]
mod common;

mod case;
mod cases;
mod l1;
mod rig;
mod rig_clean_boot;
mod stage;

use std::sync::{Mutex, MutexGuard, PoisonError};

/// One L1 at a time: each keeps QEMU/TCG busy for minutes (the suite's and
/// rig_clean_boot's ran one after the other as separate test binaries), and
/// two at once would stretch both towards their limits.
fn one_l1() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(PoisonError::into_inner)
}
