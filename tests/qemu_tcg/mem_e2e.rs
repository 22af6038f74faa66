//! End-to-end: `ember run --backend qemu --mem 1G --mem-boot 256M` boots
//! the appliance (Debian's cloud kernel under QEMU/TCG) with 256 MiB of RAM
//! and the rest as a `virtio-mem-pci` region, which the guest's `virtio_mem`
//! module (loaded by ember-init) plugs and the kernel onlines by itself, on
//! the initramfs appliance and on the host's root (shared guest memory for
//! virtiofsd). What QEMU cannot do is refused in one line.
//!
//! Needs `ember setup` (the kernel in ember's cache) and QEMU.

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn init_binary() -> PathBuf {
    common::init_binary().unwrap_or_else(|e| panic!("{e}"))
}

fn run(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", init_binary())
        .args(["run", "--backend", "qemu", "--timeout", "120"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("spawn ember");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("no appliance kernel"),
        "run `ember setup` before the e2e tests: {err}"
    );
    out
}

/// The guest waits (at most 30 s) until MemTotal passes 800 MiB, then
/// prints it, the devices bound to virtio_mem and the online policy.
const PROBE: &str = "i=0; mt() { grep MemTotal /proc/meminfo | tr -dc 0-9; }; \
    while [ $(mt) -lt 819200 ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; \
    echo MT=$(mt); echo BOUND=$(ls /sys/bus/virtio/drivers/virtio_mem | grep virtio); \
    echo ONLINE=$(cat /sys/devices/system/memory/auto_online_blocks)";

#[test]
fn mem_boot_plugs_the_rest_of_the_memory_through_virtio_mem_pci() {
    for root in [&["--initramfs"][..], &[][..]] {
        let args = [
            root,
            &["--mem", "1G", "--mem-boot", "256M", "--", "sh", "-c", PROBE],
        ]
        .concat();
        let out = run(&args);
        let (o, e) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(0), "{root:?}: {o}{e}");
        let field = |name: &str| {
            o.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("{root:?}: no {name}= in {o}{e}"))
                .to_string()
        };
        let kib: u64 = field("MT").parse().unwrap();
        // 1 GiB less what the kernel reserves: far more than the boot RAM.
        assert!(kib >= 800 << 10, "{root:?}: MemTotal {kib} kB\n{o}");
        assert!(field("BOUND").starts_with("virtio"), "{root:?}: {o}");
        assert_eq!(field("ONLINE"), "online", "{root:?}: {o}");
    }
}

#[test]
fn what_qemu_cannot_do_with_a_region_is_refused_in_one_line() {
    for (args, says) in [
        (
            &["--machine", "microvm", "--mem", "1G", "--mem-boot", "256M"][..],
            "virtio-mem region on microvm",
        ),
        (
            &["--mem", "512M", "--mem-boot", "512M"][..],
            "must be less than",
        ),
        (&["--mem", "300M", "--mem-boot", "256M"][..], "--mem-boot"),
    ] {
        let out = run(&[args, &["--", "true"]].concat());
        let e = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {e}");
        assert!(e.contains(says), "{args:?}: {e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{args:?}: {e}");
    }
}
