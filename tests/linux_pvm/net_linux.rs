//! End-to-end: Linux's own virtio_net (the PVM test kernel, on KVM) brings up
//! eth0 on ember's virtio-net, on a tap in a network namespace the test makes:
//! ping, and a TCP transfer each way checked byte for byte against what the
//! host side (sockets in the namespace) sent and received.
//!
//! Needs EMBER_PVM_KERNEL (set by `scripts/test`), /dev/kvm and root. The
//! guest's kernel code is emulated here (~2800x slower than native), so the
//! transfers are small and everything runs in one boot with one /init.

use crate::common;

use common::netns::{Netns, ember_bin};
use common::require_kvm;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Stdio;
use std::time::{Duration, Instant};

const GUEST_MAC: &str = "02:00:00:00:00:42";
/// Bytes each way: one full-sized TSO segment's worth (this guest's kernel
/// code is emulated: 256 KiB each way did not finish in 28 minutes).
const LEN: usize = 64 * 1024;

/// /init: eth0 up with 10.0.0.2, the negotiated features, a ping, then the
/// transfers (the host listens on 5001; the guest on 5002). `T=` lines: the
/// guest's uptime at each step. As few programs as can be: each exec costs
/// the emulated kernel seconds (and every console byte a little), and the
/// initramfs holds busybox alone (unpacking it is emulated too; ethtool's
/// view of the offloads is the nested rig's net case).
const INIT: &str = r#"#!/bin/busybox sh
B=/bin/busybox
t() { read -r up _ </proc/uptime; echo "T=$up $1"; }
$B mkdir -p /proc /sys /tmp
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mknod /dev/urandom c 1 9
t init
$B ip link set eth0 up
$B ip addr add 10.0.0.2/24 dev eth0
for d in /sys/bus/virtio/devices/*; do
  [ "$($B cat $d/device)" = 0x0001 ] && echo "NET-FEATURES=$($B cat $d/features)"
done
echo "ADDR-BEGIN"
$B ip addr show eth0
echo "ADDR-END"
# One echo: this kernel has no POSIX timers, which ping needs between echoes.
$B ping -c 1 10.0.0.1 && echo PING-OK
$B dd if=/dev/urandom of=/tmp/out bs=1024 count=64 2>/dev/null
echo "OUT-MD5=$($B md5sum < /tmp/out)"
$B nc 10.0.0.1 5001 < /tmp/out && echo SENT-OK
$B nc -l -p 5002 > /tmp/in &
echo LISTENING
wait
t download
echo "IN-MD5=$($B md5sum < /tmp/in) IN-LEN=$($B wc -c < /tmp/in)"
S=/sys/class/net/eth0/statistics
# Frames the driver refused: a frame shown without all its buffers counts here.
echo "RX-LENGTH-ERRORS=$($B cat $S/rx_length_errors) RX-PACKETS=$($B cat $S/rx_packets)"
echo NET-LINUX-DONE
$B reboot -f
"#;

fn initramfs(path: &std::path::Path) {
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static is installed");
    let mut w = ember::initramfs::NewcWriter::new(std::fs::File::create(path).unwrap());
    w.dir("bin", 0o755).unwrap();
    w.dir("dev", 0o755).unwrap();
    w.char_dev("dev/console", 0o600, 5, 1).unwrap();
    w.file("bin/busybox", 0o755, &busybox).unwrap();
    w.file("init", 0o755, INIT.as_bytes()).unwrap();
    w.finish().unwrap();
}

/// The VMM, killed if the test fails first.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn md5(data: &[u8]) -> String {
    let mut c = std::process::Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(data).unwrap();
    let o = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

fn value<'a>(console: &'a str, key: &str) -> &'a str {
    console
        .lines()
        .find_map(|l| l.split_once(key).map(|(_, v)| v))
        .unwrap_or_else(|| panic!("no {key}; console:\n{console}"))
        .split_whitespace()
        .next()
        .unwrap_or("")
}

#[test]
fn linux_brings_up_eth0_pings_and_moves_tcp_both_ways_byte_for_byte() {
    let test = "net_linux";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = common::pvm_kernel_dir(test) else {
        return;
    };
    let scratch = common::Scratch::new(test);
    let initrd = scratch.path("initrd.cpio");
    initramfs(&initrd);
    let ns = Netns::new("linux");
    ns.tap("tap0");
    ns.address("tap0", "10.0.0.1/24");

    // The host side: take the guest's upload, then send the download.
    let listener = ns.within(|| TcpListener::bind("10.0.0.1:5001").unwrap());
    let upload = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got
    });

    let mut child = ns
        .exec(ember_bin())
        .arg("boot")
        .arg("--kernel")
        .arg(kdir.join("vmlinux"))
        .arg("--initrd")
        .arg(&initrd)
        .args(["--mem", "128M", "--cmdline", common::PVM_CMDLINE])
        .args(["--net", &format!("tap=tap0,mac={GUEST_MAC}")])
        .args(["--timeout", "1200"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut child = KillOnDrop(child);
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let booted = Instant::now();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            // Progress in the log (a stalled step shows where).
            eprintln!("{:7.1}s| {l}", booted.elapsed().as_secs_f64());
            let _ = tx.send(l);
        }
    });
    let mut console = String::new();
    let mut wait_for = |what: &str| {
        let start = Instant::now();
        while !console.contains(what) {
            let left = Duration::from_secs(900).saturating_sub(start.elapsed());
            match lines.recv_timeout(left) {
                Ok(l) => {
                    console.push_str(&l);
                    console.push('\n');
                }
                Err(_) => panic!("no `{what}`; console:\n{console}"),
            }
        }
        console.clone()
    };
    let c = wait_for("\nLISTENING");
    // The guest's upload has ended by now; should it never have connected,
    // the host side stops waiting for it (and the length check fails).
    let start = Instant::now();
    while !upload.is_finished() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    if !upload.is_finished() {
        let _ = ns.within(|| TcpStream::connect("10.0.0.1:5001"));
    }
    let got = upload.join().unwrap();
    assert_eq!(got.len(), LEN, "the upload's length");
    assert_eq!(md5(&got), value(&c, "OUT-MD5="), "the upload byte for byte");
    assert!(c.contains("PING-OK"), "{c}");
    assert!(c.contains(&format!("link/ether {GUEST_MAC}")), "{c}");

    let download: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    let sum = md5(&download);
    let start = Instant::now();
    let mut s = loop {
        match ns.within(|| TcpStream::connect("10.0.0.2:5002")) {
            Ok(s) => break s,
            Err(e) => {
                assert!(start.elapsed() < Duration::from_secs(120), "connect: {e}");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    };
    s.write_all(&download).unwrap();
    // Half-closed, and held open until the guest is done: a socket closed with
    // bytes of the peer's unread would be reset, losing what it still had to send
    // (once the download ended at 40544 bytes).
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let c = wait_for("NET-LINUX-DONE");
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    eprintln!(
        "net_linux: the guest sent {} bytes on the download's connection",
        back.len()
    );
    let status = child.0.wait().unwrap();
    eprintln!(
        "net_linux: the whole boot took {:.1} s",
        booted.elapsed().as_secs_f64()
    );
    assert_eq!(value(&c, "IN-MD5="), sum, "the download byte for byte");
    assert_eq!(value(&c, "IN-LEN="), LEN.to_string());
    assert_eq!(
        value(&c, "RX-LENGTH-ERRORS="),
        "0",
        "every frame came with all its buffers"
    );
    // The driver took the checksum and segmentation offloads, mergeable
    // buffers and event indices (the features string is bit 0 first).
    let f = value(&c, "NET-FEATURES=").as_bytes();
    for (bit, name) in [
        (0, "CSUM"),
        (1, "GUEST_CSUM"),
        (7, "GUEST_TSO4"),
        (11, "HOST_TSO4"),
        (15, "MRG_RXBUF"),
        (16, "STATUS"),
        (29, "RING_EVENT_IDX"),
    ] {
        assert_eq!(f.get(bit), Some(&b'1'), "{name} negotiated: {c}");
    }
    assert!(status.code().is_some(), "ember ended on its own");
}
