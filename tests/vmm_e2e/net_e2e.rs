//! End-to-end: the test guest's virtio-net driver against a tap in a network
//! namespace each test makes for itself (no traffic leaves it). The host side
//! is a packet socket on the tap (with the virtio-net header, so offloaded
//! frames show as the kernel holds them): frames both ways with and without
//! offloads (a 64 KiB TCP segment crossing whole), the rate limits, malformed
//! chains, bad options, and a restore onto another tap and MAC.

use crate::common;
use common::booted::Booted;

use common::netns::{Frame, Netns, TAP_MAC, ember_bin, parse_mac, run};
use common::{Scratch, output, require_kvm, stderr, stdout};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const ETHERTYPE_TEST: u16 = 0x88b5;
const GUEST_MAC: &str = "02:00:00:00:00:02";

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// The test guest's byte at offset `k` of test frame `seq` (virtio_net.rs).
fn test_byte(seq: u32, k: usize) -> u8 {
    (seq as u8).wrapping_mul(31).wrapping_add(k as u8)
}

fn test_frame(dst: [u8; 6], seq: u32, len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(len);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&TAP_MAC);
    f.extend_from_slice(&ETHERTYPE_TEST.to_be_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend((18..len).map(|k| test_byte(seq, k)));
    f
}

/// Checks a test frame from the guest; the sum of its payload bytes.
fn check_test_frame(f: &[u8], src: [u8; 6]) -> Option<u64> {
    if f.len() < 18 || f[12..14] != ETHERTYPE_TEST.to_be_bytes() || f[6..12] != src {
        return None;
    }
    let seq = u32::from_le_bytes(f[14..18].try_into().unwrap());
    let ok = (18..f.len()).all(|k| f[k] == test_byte(seq, k));
    assert!(ok, "test frame {seq} from the guest is damaged");
    Some(f[18..].iter().map(|&b| u64::from(b)).sum())
}

fn ip_checksum(b: &[u8]) -> u16 {
    let mut s: u32 = b
        .chunks(2)
        .map(|c| u32::from(c[0]) << 8 | u32::from(c[1]))
        .sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// One TCP/IPv4 segment of `n` payload bytes to the guest, as a GSO frame
/// (10.0.0.1:5001 → 10.0.0.2:1000, sequence numbers from 1000, the stream
/// pattern the guest checks: byte o is o % 251); its header and frame.
fn tcp_gso_frame(dst: [u8; 6], n: usize) -> ([u8; 10], Vec<u8>) {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&TAP_MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (40 + n) as u16;
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&[0, 1, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]);
    let c = ip_checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    let mut tcp = Vec::new();
    tcp.extend_from_slice(&5001u16.to_be_bytes());
    tcp.extend_from_slice(&1000u16.to_be_bytes());
    tcp.extend_from_slice(&1000u32.to_be_bytes());
    tcp.extend_from_slice(&0u32.to_be_bytes());
    tcp.extend_from_slice(&[5 << 4, 0x18, 0xff, 0xff]);
    // The pseudo-header sum, not inverted: the stack completes it (NEEDS_CSUM).
    let pseudo: u32 = 0x0a00 + 0x0001 + 0x0a00 + 0x0002 + 6 + (20 + n) as u32;
    let folded = ((pseudo & 0xffff) + (pseudo >> 16)) as u16;
    tcp.extend_from_slice(&folded.to_be_bytes());
    tcp.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&tcp);
    f.extend((0..n).map(|o| (o % 251) as u8));
    let mut hdr = [0u8; 10];
    hdr[0] = 1; // NEEDS_CSUM
    hdr[1] = 1; // GSO_TCPV4
    hdr[2..4].copy_from_slice(&54u16.to_le_bytes());
    hdr[4..6].copy_from_slice(&1448u16.to_le_bytes());
    hdr[6..8].copy_from_slice(&34u16.to_le_bytes());
    hdr[8..10].copy_from_slice(&16u16.to_le_bytes());
    (hdr, f)
}

fn stream_sum(n: usize) -> u64 {
    (0..n).map(|o| (o % 251) as u64).sum()
}

/// An ember running in the namespace.
fn start(ns: &Netns, args: &[&str]) -> Booted {
    Booted::spawn(ns.exec(ember_bin()).arg("boot").args(args))
}

fn field<'a>(line: &'a [(String, String)], key: &str) -> &'a str {
    line.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

fn num(line: &[(String, String)], key: &str) -> u64 {
    field(line, key).parse().unwrap()
}

fn guest_status(n: u8) -> i32 {
    ember::exit::guest_end_status(ember_vmm::vstate::end::GuestEnd::ExitCode(n))
}

/// Frames both ways, checked byte for byte, with the offloads negotiated
/// (`offload`) or not: the guest sends 200 test frames and (with offloads)
/// one 65000-byte TCP segment, which must reach the tap whole; the host
/// sends 100 test frames and one 65000-byte GSO segment, which the guest
/// must get whole with offloads and in MSS-sized pieces without. With
/// offloads the guest's driver negotiates event indices (as Linux's does);
/// without, it leaves them off, so both ways of asking for notifications are
/// crossed.
fn exchange(offload: bool) {
    let ns = Netns::new(if offload { "off1" } else { "off0" });
    ns.tap("tap0");
    let sock = ns.packet_socket("tap0");
    let g = guest();
    let net = format!("tap=tap0,mac={GUEST_MAC}");
    let tso = if offload {
        "netcount=1 nettso=65000"
    } else {
        ""
    };
    let cmdline = format!(
        "netoffload={0} netevent={0} netinfo netcount=200 netlen=1000 nettx {tso} print=send_now netcount=100 netrx \
         print=send_tso netbytes=65000 netrx exit=0",
        u8::from(offload)
    );
    let vm = start(
        &ns,
        &[
            "--kernel",
            g.to_str().unwrap(),
            "--mem",
            "128M",
            "--net",
            &net,
            "--cmdline",
            &cmdline,
            "--timeout",
            "60",
        ],
    );
    let guest_mac = parse_mac(GUEST_MAC);
    // Guest to host.
    let want = 200 + usize::from(offload);
    let frames = sock.collect(Duration::from_secs(30), |got| {
        got.iter().filter(|f| f.data[6..12] == guest_mac).count() >= want
    });
    let mine: Vec<&Frame> = frames
        .iter()
        .filter(|f| f.data.len() >= 14 && f.data[6..12] == guest_mac)
        .collect();
    let test_sum: u64 = mine
        .iter()
        .filter_map(|f| check_test_frame(&f.data, guest_mac))
        .sum();
    assert_eq!(
        mine.iter()
            .filter(|f| f.data[12..14] == ETHERTYPE_TEST.to_be_bytes())
            .count(),
        200
    );
    if offload {
        let tcp: Vec<&&Frame> = mine.iter().filter(|f| f.data[12..14] == [8, 0]).collect();
        assert_eq!(tcp.len(), 1, "the segment crossed the tap whole");
        assert_eq!(tcp[0].data.len(), 54 + 65_000);
        assert_eq!(tcp[0].gso_type, 1, "still a TCPv4 GSO frame on the tap");
        assert!(
            tcp[0].data[54..]
                .iter()
                .enumerate()
                .all(|(o, &b)| b == (o % 251) as u8)
        );
    }
    let c = vm.wait_for("\nsend now");
    let tx = ember_testing::guest_results(&c, "nettx");
    assert_eq!(num(&tx[0], "frames"), 200);
    assert_eq!(num(&tx[0], "sum"), test_sum, "the payload's checksum");
    let info = &ember_testing::guest_results(&c, "net")[0];
    assert_eq!(field(info, "mac"), GUEST_MAC);
    assert_eq!(field(info, "status"), "1");
    for k in [
        "csum",
        "guest_csum",
        "tso4",
        "tso6",
        "guest_tso4",
        "guest_tso6",
        "event_idx",
    ] {
        assert_eq!(field(info, k), if offload { "1" } else { "0" }, "{k}");
    }
    if offload {
        let t = &ember_testing::guest_results(&c, "nettso")[0];
        assert_eq!(num(t, "sum"), stream_sum(65_000));
    }

    // Host to guest.
    let mut sum = 0u64;
    for seq in 0..100 {
        let f = test_frame(guest_mac, seq, 1000);
        sum += f[18..].iter().map(|&b| u64::from(b)).sum::<u64>();
        sock.send([0; 10], &f);
    }
    vm.wait_for("\nsend tso");
    let (hdr, f) = tcp_gso_frame(guest_mac, 65_000);
    sock.send(hdr, &f);
    let (code, c, err) = vm.finish();
    assert_eq!(code, guest_status(0), "stderr: {err}\nconsole:\n{c}");
    let rx = ember_testing::guest_results(&c, "netrx");
    assert_eq!(num(&rx[0], "frames"), 100, "{c}");
    assert_eq!(num(&rx[0], "bad"), 0);
    assert_eq!(num(&rx[0], "sum"), sum, "the payload's checksum");
    assert_eq!(num(&rx[1], "payload"), 65_000, "{c}");
    assert_eq!(num(&rx[1], "bad"), 0);
    assert_eq!(num(&rx[1], "sum"), stream_sum(65_000));
    if offload {
        assert_eq!(num(&rx[1], "frames"), 1, "one frame: {c}");
        assert_eq!(num(&rx[1], "gso"), 1);
        assert_eq!(num(&rx[1], "max"), 54 + 65_000);
    } else {
        assert_eq!(num(&rx[1], "frames"), 65_000_u64.div_ceil(1448), "{c}");
        assert_eq!(num(&rx[1], "gso"), 0);
        assert_eq!(num(&rx[1], "max"), 54 + 1448);
    }
}

#[test]
fn frames_cross_both_ways_with_offloads_and_a_64k_segment_stays_whole() {
    if require_kvm("net_offloads") {
        exchange(true);
    }
}

#[test]
fn frames_cross_both_ways_without_offloads_and_big_segments_arrive_cut() {
    if require_kvm("net_no_offloads") {
        exchange(false);
    }
}

/// The guest sends as fast as it can for 3 s under `tx_bytes` and receives
/// for 3 s under `rx_ops` while the host floods it: both rates within 10 %.
#[test]
fn rate_limits_hold_within_ten_percent_over_three_seconds() {
    if !require_kvm("net_rate") {
        return;
    }
    let ns = Netns::new("rate");
    ns.tap("tap0");
    let sock = Arc::new(ns.packet_socket("tap0"));
    let g = guest();
    // 4 MiB/s out in 100 ms buckets, 2000 frames/s in.
    let net = format!("tap=tap0,mac={GUEST_MAC},tx_bytes=400K/100,rx_ops=200/100");
    let vm = start(
        &ns,
        &[
            "--kernel",
            g.to_str().unwrap(),
            "--mem",
            "128M",
            "--net",
            &net,
            "--cmdline",
            "netinfo netlen=1500 netsecs=3 nettx print=flood_now netsecs=3 netrx exit=0",
            "--timeout",
            "60",
        ],
    );
    // Drain what the guest sends, so the tap never backs up.
    let stop = Arc::new(AtomicBool::new(false));
    let drain = {
        let (sock, stop) = (sock.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if sock.recv().is_some() {
                    n += 1;
                }
            }
            n
        })
    };
    vm.wait_for("\nflood now");
    stop.store(true, Ordering::Relaxed);
    let host_got = drain.join().unwrap();
    let guest_mac = parse_mac(GUEST_MAC);
    let frame = test_frame(guest_mac, 1, 200);
    let flood_stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let (sock, stop) = (sock.clone(), flood_stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // About 5000 frames/s offered, more than the limit lets through.
                for _ in 0..50 {
                    sock.send([0; 10], &frame);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let (code, c, err) = vm.finish();
    flood_stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    assert_eq!(code, guest_status(0), "stderr: {err}\nconsole:\n{c}");
    let tx = &ember_testing::guest_results(&c, "nettx")[0];
    let rate = num(tx, "bytes") as f64 * 1e9 / num(tx, "ns") as f64;
    let want = 400.0 * 1024.0 * 10.0;
    eprintln!("tx: {rate:.0} B/s, limit {want:.0}; host saw {host_got} frames");
    assert!(
        (rate / want - 1.0).abs() < 0.10,
        "tx {rate:.0} B/s against {want:.0}"
    );
    assert!(
        host_got + 10 >= num(tx, "frames"),
        "the host got what was sent"
    );
    let rx = &ember_testing::guest_results(&c, "netrx")[0];
    let fps = num(rx, "frames") as f64 * 1e9 / num(rx, "ns") as f64;
    eprintln!("rx: {fps:.0} frames/s, limit 2000");
    assert!(
        (fps / 2000.0 - 1.0).abs() < 0.10,
        "rx {fps:.0} frames/s against 2000"
    );
}

/// Malformed transmit chains are a device error (`DEVICE_NEEDS_RESET`), the
/// VMM lives on, and the device works again after a reset.
#[test]
fn malformed_chains_are_refused_with_a_device_error() {
    if !require_kvm("net_malformed") {
        return;
    }
    let ns = Netns::new("bad");
    ns.tap("tap0");
    let sock = ns.packet_socket("tap0");
    let g = guest();
    let vm = start(
        &ns,
        &[
            "--kernel",
            g.to_str().unwrap(),
            "--mem",
            "128M",
            "--net",
            "tap=tap0",
            "--cmdline",
            "netbad=oob netbad=write netbad=long netcount=3 nettx exit=0",
            "--timeout",
            "60",
        ],
    );
    let (code, c, err) = vm.finish();
    assert_eq!(code, guest_status(0), "stderr: {err}\nconsole:\n{c}");
    let bad = ember_testing::guest_results(&c, "netbad");
    assert_eq!(bad.len(), 3, "{c}");
    for b in &bad {
        assert_eq!(field(b, "needs_reset"), "1", "{b:?}");
    }
    assert!(err.contains("device needs reset"), "{err}");
    let frames = sock.collect(Duration::from_secs(2), |_| false);
    let test: Vec<_> = frames
        .iter()
        .filter(|f| f.data.len() >= 14 && f.data[12..14] == ETHERTYPE_TEST.to_be_bytes())
        .collect();
    assert_eq!(test.len(), 3, "after a reset the device sends again");
}

/// Bad `--net` values end ember with one line naming what is wrong.
#[test]
fn bad_net_options_get_one_line_errors() {
    if !require_kvm("net_bad_options") {
        return;
    }
    let ns = Netns::new("opts");
    ns.tap("tap0");
    // A tap of another user's: refused to anyone but its owner and root.
    run(Command::new("ip").args([
        "-n", &ns.0, "tuntap", "add", "theirs0", "mode", "tap", "user", "54321",
    ]));
    let g = guest();
    let kvm_gid = std::fs::metadata("/dev/kvm")
        .map(|m| std::os::unix::fs::MetadataExt::gid(&m))
        .unwrap();
    for (net, as_nobody, want) in [
        ("tap=nosuch0", false, "no network interface `nosuch0`"),
        ("tap=tap0,mac=01:00:00:00:00:01", false, "bad MAC address"),
        ("tap=tap0,mac=02:00:00:00:00", false, "bad MAC address"),
        ("fd=77", false, "fd=77: not an open descriptor"),
        ("fd=0", false, "fd=0: not a tap interface"),
        ("tap=lo", false, "`lo` is not a tap interface"),
        (
            "tap=theirs0",
            true,
            "no permission to attach to tap `theirs0`",
        ),
    ] {
        let mut cmd = if as_nobody {
            let mut c = ns.exec("setpriv");
            c.args([
                "--reuid=65534",
                &format!("--regid={kvm_gid}"),
                "--clear-groups",
            ])
            .arg(ember_bin());
            c
        } else {
            ns.exec(ember_bin())
        };
        let o = output(
            cmd.args(["boot", "--kernel"])
                .arg(&g)
                .args(["--net", net, "--cmdline", "exit=0"])
                .stdin(Stdio::null()),
        );
        let err = stderr(&o);
        assert!(!o.status.success(), "{net}: {}", stdout(&o));
        assert!(err.contains(want), "{net}: {err}");
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.contains("For more information"))
            .collect();
        assert_eq!(lines.len(), 1, "{net}: one line: {err}");
    }
}

/// A guest snapshotted while it watches its link, restored onto another tap
/// with another MAC: it sees the link go down and up with the new MAC, and
/// its frames leave by the new tap with the new address.
#[test]
fn a_restore_onto_another_tap_and_mac_shows_a_link_change_and_passes_traffic() {
    if !require_kvm("net_restore") {
        return;
    }
    let ns = Netns::new("snap");
    ns.tap("tap0");
    ns.tap("tap1");
    let dir = Scratch::new("net-snap");
    let sock = dir.path("api.sock");
    let snap = dir.path("snap");
    let g = guest();
    let vm = start(
        &ns,
        &[
            "--kernel",
            g.to_str().unwrap(),
            "--mem",
            "128M",
            "--net",
            &format!("tap=tap0,mac={GUEST_MAC}"),
            "--cmdline",
            "netinfo netwatch=120 netinfo netcount=10 nettx exit=0",
            "--api-socket",
            sock.to_str().unwrap(),
        ],
    );
    vm.wait_for("(watching)");
    let o = output(
        ns.exec(ember_bin())
            .args(["snapshot", "--api-socket"])
            .arg(&sock)
            .arg("--to")
            .arg(&snap),
    );
    assert!(o.status.success(), "snapshot: {}", stderr(&o));
    let (code, before, err) = vm.finish();
    assert_eq!(code, 0, "{err}");
    assert!(!before.contains("nettx:"), "{before}");

    let new_mac = "02:00:00:00:00:03";
    let tap1 = ns.packet_socket("tap1");
    let vm = start(
        &ns,
        &[
            "--restore",
            snap.to_str().unwrap(),
            "--net",
            &format!("tap=tap1,mac={new_mac}"),
            "--timeout",
            "60",
        ],
    );
    let frames = tap1.collect(Duration::from_secs(30), |got| {
        got.iter()
            .filter(|f| f.data.len() >= 14 && f.data[12..14] == ETHERTYPE_TEST.to_be_bytes())
            .count()
            >= 10
    });
    let (code, c, err) = vm.finish();
    assert_eq!(code, guest_status(0), "stderr: {err}\nconsole:\n{c}");
    let links = ember_testing::guest_results(&c, "netlink");
    assert!(links.len() >= 2, "{c}");
    let down = &links[links.len() - 2];
    let up = &links[links.len() - 1];
    assert_eq!(field(down, "status"), "0", "{c}");
    assert_eq!(field(up, "status"), "1", "{c}");
    assert_eq!(field(up, "mac"), new_mac);
    assert!(
        num(up, "config_irqs") >= 1,
        "a configuration interrupt: {c}"
    );
    let infos = ember_testing::guest_results(&c, "net");
    assert_eq!(field(infos.last().unwrap(), "mac"), new_mac);
    let new = parse_mac(new_mac);
    let test: Vec<_> = frames
        .iter()
        .filter(|f| f.data.len() >= 14 && f.data[12..14] == ETHERTYPE_TEST.to_be_bytes())
        .collect();
    assert_eq!(test.len(), 10, "the frames left by the new tap");
    for f in test {
        assert_eq!(f.data[6..12], new, "from the new MAC");
    }
}
