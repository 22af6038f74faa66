//! End-to-end: a real Linux kernel booted by ember on KVM, by each of the three
//! loader paths, to an /init that prints a marker and reboots (`reboot=k`: a
//! keyboard-controller reset, which ember reports as status 2).
//!
//! On this workplace's software KVM only a patched minimal kernel can boot
//! (../shared/pvm-test-kernel, built by `scripts/pvm-kernel`); `scripts/test`
//! sets EMBER_PVM_KERNEL to its directory. Each boot takes 20-40 s here.

use crate::common;

use common::{
    PVM_CMDLINE, Scratch, ember, output, pvm_kernel_dir, require_kvm, stderr, stdout,
    tiny_initramfs,
};
use std::path::PathBuf;

const MARKER: &str = "EMBER-INIT-OK";

fn boot_linux(test: &str, kernel_file: impl FnOnce(&PathBuf, &Scratch) -> PathBuf, disk: bool) {
    if !require_kvm(test) {
        return;
    }
    let Some(dir) = pvm_kernel_dir(test) else {
        return;
    };
    let scratch = Scratch::new(test);
    let initrd = scratch.path("initrd.cpio");
    tiny_initramfs(&initrd, &format!("{MARKER}\n"));
    let kernel = kernel_file(&dir, &scratch);
    let mut cmd = ember();
    cmd.arg("boot")
        .arg("--kernel")
        .arg(&kernel)
        .arg("--initrd")
        .arg(&initrd);
    cmd.args(["--mem", "64M", "--cmdline", PVM_CMDLINE, "--timeout", "600"]);
    if disk {
        let img = scratch.path("disk.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        cmd.arg("--disk").arg(&img);
    }
    let o = output(&mut cmd);
    let out = stdout(&o);
    assert!(
        out.contains(&format!("\n{MARKER}")),
        "{test}: no marker; stderr: {}\n{out}",
        stderr(&o)
    );
    assert!(out.contains("Run /init as init process"), "{out}");
    // Linux understood the structures ember wrote: CPUID's KVM leaves, the MP
    // table, the memory map and the command line.
    for seen in [
        "Hypervisor detected: KVM",
        "MPTABLE: OEM ID: EMBER",
        "usable",
        "mitigations=off reboot=k",
    ] {
        assert!(
            out.contains(seen),
            "{test}: `{seen}` missing from the boot log:\n{out}"
        );
    }
    if disk {
        assert!(
            out.contains("[vda] 32768 512-byte logical blocks"),
            "virtio-blk not seen by Linux:\n{out}"
        );
    }
    assert_eq!(
        o.status.code(),
        Some(ember::exit::EXIT_GUEST_RESET),
        "{test}: {}",
        stderr(&o)
    );
}

#[test]
fn linux_boots_through_its_pvh_note_and_sees_a_virtio_disk() {
    boot_linux("linux_pvh", |dir, _| dir.join("vmlinux"), true);
}

#[test]
fn linux_boots_through_the_64bit_entry() {
    boot_linux(
        "linux_64bit",
        |dir, scratch| {
            let plain = scratch.path("vmlinux-nopvh");
            ember_testing::without_pvh_note(&dir.join("vmlinux"), &plain).unwrap();
            plain
        },
        false,
    );
}

#[test]
fn linux_boots_as_a_bzimage() {
    boot_linux("linux_bzimage", |dir, _| dir.join("bzImage"), false);
}
