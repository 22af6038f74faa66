//! End-to-end: a real Linux guest (the PVM test kernel, on KVM) drives ember's virtio
//! devices with its own drivers — virtio-blk reads, writes, flushes and the serial
//! (`GET_ID`), and the virtio-console data channel in both directions.
//!
//! Needs EMBER_PVM_KERNEL (set by `scripts/test`) and /dev/kvm; a boot takes ~30 s here.

use crate::common;

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;

use common::{Scratch, ember, output, require_kvm, stderr, stdout};
use ember::initramfs::NewcWriter;

/// Same command line as tests/linux_pvm/linux_pvm.rs: what the PVM test kernel needs, plus a
/// keyboard-controller reboot so `reboot -f` ends the VM.
const PVM_CMDLINE: &str = "console=ttyS0 noxsave noint3selftest nofxsaveleak \
    clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase noinvpcid nopcid nopku \
    mitigations=off reboot=k panic=-1";

/// The guest's /init: no devtmpfs in this kernel, so device nodes are made from sysfs.
const INIT: &str = r#"#!/bin/busybox sh
B=/bin/busybox
$B mkdir -p /proc /sys /dev /tmp
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
set -- $($B tr ':' ' ' < /sys/block/vda/dev)
$B mknod /dev/vda b $1 $2
$B mknod /dev/hvc0 c 229 0
echo "SERIAL=$($B cat /sys/block/vda/serial)"
echo "SECTOR3=$($B dd if=/dev/vda bs=16 skip=96 count=1 2>/dev/null)"
echo "RO=$($B cat /sys/block/vda/ro)"
$B printf 'written-by-linux' > /tmp/w
$B dd if=/tmp/w of=/dev/vda bs=512 seek=7 conv=sync,notrunc 2>/dev/null
$B sync
# Open the port for reading before asking the host to answer: input that reaches hvc
# while no tty has it open waits in the driver until the next interrupt.
$B timeout 60 $B dd if=/dev/hvc0 of=/tmp/in bs=1 count=14 2>/dev/null &
$B sleep 1
$B printf 'hello-from-guest\n' > /dev/hvc0
wait
echo "CHANNEL-GOT=$($B cat /tmp/in)"
echo VIRTIO-E2E-DONE
$B reboot -f
"#;

fn initramfs(path: &std::path::Path) {
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static is installed");
    let mut w = NewcWriter::new(std::fs::File::create(path).unwrap());
    w.dir("bin", 0o755).unwrap();
    w.dir("dev", 0o755).unwrap();
    w.char_dev("dev/console", 0o600, 5, 1).unwrap();
    w.file("bin/busybox", 0o755, &busybox).unwrap();
    w.file("init", 0o755, INIT.as_bytes()).unwrap();
    w.finish().unwrap();
}

#[test]
fn linux_drives_virtio_blk_and_the_console_channel() {
    let test = "virtio_linux";
    if !require_kvm(test) {
        return;
    }
    let Some(dir) = std::env::var_os("EMBER_PVM_KERNEL") else {
        ember_testing::skip(
            test,
            "EMBER_PVM_KERNEL is not set (scripts/test builds the kernel and sets it)",
        );
        return;
    };
    let scratch = Scratch::new(test);
    let initrd = scratch.path("initrd.cpio");
    initramfs(&initrd);
    // Sector n is filled with letter n (mod 26), so the guest can print what it reads.
    let img = scratch.path("disk.img");
    let pattern: Vec<u8> = (0..2048 * 512)
        .map(|i| b'A' + (i / 512 % 26) as u8)
        .collect();
    std::fs::write(&img, &pattern).unwrap();

    let sock = scratch.path("channel.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        // Answer once the guest has spoken, then collect until the VMM hangs up.
        while !String::from_utf8_lossy(&got).contains("hello-from-guest") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "channel closed early: {got:?}");
            got.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"ping-from-host\n").unwrap();
        let _ = s.read_to_end(&mut got);
        got
    });

    let o = output(
        ember()
            .arg("boot")
            .arg("--kernel")
            .arg(std::path::Path::new(&dir).join("vmlinux"))
            .arg("--initrd")
            .arg(&initrd)
            .args(["--mem", "64M", "--cmdline", PVM_CMDLINE, "--timeout", "120"])
            .arg("--disk")
            .arg(format!("{},serial=ember-e2e", img.display()))
            .arg("--channel")
            .arg(&sock),
    );
    let out = stdout(&o);
    assert!(
        out.contains("VIRTIO-E2E-DONE"),
        "guest did not finish; stderr: {}\n{out}",
        stderr(&o)
    );
    assert!(out.contains("SERIAL=ember-e2e"), "GET_ID:\n{out}");
    assert!(out.contains("SECTOR3=DDDDDDDDDDDDDDDD"), "read:\n{out}");
    assert!(out.contains("RO=0"), "{out}");
    assert!(
        out.contains("CHANNEL-GOT=ping-from-host"),
        "host to guest:\n{out}"
    );
    let heard = peer.join().unwrap();
    assert!(String::from_utf8_lossy(&heard).contains("hello-from-guest"));

    let disk = std::fs::read(&img).unwrap();
    assert_eq!(
        &disk[7 * 512..7 * 512 + 16],
        b"written-by-linux",
        "write + flush"
    );
    assert!(
        disk[7 * 512 + 16..8 * 512].iter().all(|&b| b == 0),
        "rest of the sector zeroed by conv=sync"
    );
    assert_eq!(
        &disk[..7 * 512],
        &pattern[..7 * 512],
        "nothing else changed"
    );
    assert_eq!(
        &disk[8 * 512..],
        &pattern[8 * 512..],
        "nothing else changed"
    );
}
