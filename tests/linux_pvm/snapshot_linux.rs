//! End-to-end: the PVM test kernel booted once to a busybox /init that waits
//! for a command on its console, snapshotted there, and restored in a fresh
//! ember process that runs a command at once.
//!
//! Needs EMBER_PVM_KERNEL (scripts/test sets it; see tests/linux_pvm/linux_pvm.rs).

use crate::common;

use common::busybox::{DONE, READY, busybox_initramfs};
use common::console_vm::ConsoleVm as Vm;
use common::{Scratch, ember, pvm_kernel_dir, require_kvm};
use std::io::Write;
use std::time::{Duration, Instant};

#[test]
fn linux_snapshotted_at_init_resumes_in_a_fresh_process_and_runs_a_command() {
    let test = "linux_snapshot";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let dir = Scratch::new(test);
    let initrd = dir.path("initrd.cpio");
    busybox_initramfs(&initrd);
    let sock = dir.path("api.sock");
    let snap = dir.path("snap");
    let os = |s: &str| std::ffi::OsString::from(s);
    let mut vm = Vm::boot_pvm(&kdir, &initrd, &[&os("--api-socket"), sock.as_os_str()]);
    let start = Instant::now();
    vm.wait_for(READY, Duration::from_secs(600));
    let boot = start.elapsed();
    let o = ember()
        .args(["snapshot", "--api-socket"])
        .arg(&sock)
        .arg("--to")
        .arg(&snap)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "snapshot: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let status = vm.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "the snapshot ends the VM");

    // Twice from the same snapshot: each restore is independent of the other.
    for n in [6, 7] {
        let start = Instant::now();
        let mut vm = Vm::spawn(&[&os("--restore"), snap.as_os_str()]);
        writeln!(vm.stdin, "echo answer-$(({n}*7)); uname -r").unwrap();
        vm.wait_for(DONE, Duration::from_secs(120));
        let took = start.elapsed();
        let status = vm.child.wait().unwrap();
        assert!(
            vm.log.contains(&format!("answer-{}", n * 7)),
            "the command did not run:\n{}",
            vm.log
        );
        assert!(vm.log.contains("6.1."), "uname -r:\n{}", vm.log);
        assert!(
            !vm.log.contains(READY),
            "the guest booted again:\n{}",
            vm.log
        );
        // `reboot -f` with reboot=k: a keyboard-controller reset, status 2.
        assert_eq!(
            status.code(),
            Some(ember::exit::EXIT_GUEST_RESET),
            "{}",
            vm.log
        );
        eprintln!("linux_snapshot: boot to /init {boot:?}; restore to the command's end {took:?}");
        assert!(
            took * 5 < boot,
            "a restore ({took:?}) should be far quicker than the boot ({boot:?})"
        );
    }
}
