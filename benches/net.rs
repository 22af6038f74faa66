//! virtio-net benchmark: ember against QEMU microvm (KVM, userspace
//! virtio-net: `vhost=off`, the same kind of tap with its virtio-net header)
//! running the same test guest, in one run, interleaved so both see the same
//! noise. Root only: each run's tap lives in a network namespace the
//! benchmark makes (no traffic leaves it).
//!
//! `cargo bench --bench net` (EMBER_BENCH_RUNS=N rounds, default 5;
//! EMBER_BENCH_SECS=S seconds per phase, default 3). Each round boots each VMM
//! once (the order alternates); the guest, polling, measures four phases:
//!
//! - tx small: 60-byte frames out, as fast as the device takes them (frames/s);
//! - tx 64K: a 65000-byte TCP segment handed to the device whole, again and
//!   again (MiB/s of frames on the tap, unsegmented);
//! - rx small: the host floods 60-byte frames (sendmmsg, 64 a call) into the
//!   tap; frames/s the guest receives, first to last;
//! - rx 64K: the host sends 65000-byte GSO segments; MiB/s the guest receives.
//!
//! The medians, their min–max, and ember/QEMU ratios of the medians (with the
//! ratio's range over the rounds, paired round by round).
//!
//! `EMBER_NET_BASE_BIN=PATH` also runs another ember build (main's, or an older
//! commit's) in each round, in the rotation, and adds its column and the
//! ember/base ratio: a change to the data path is then measured against the
//! build before it in the same run.

use ember::lab::stats::Summary;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const GUEST_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
const TAP_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xaa];
const METRICS: [(&str, &str, &str); 4] = [
    ("tx small", "nettx", "fps"),
    ("tx 64K", "nettso", "mibps"),
    ("rx small", "netrx", "fps"),
    ("rx 64K", "netrx", "mibps"),
];

fn sh(cmd: &mut Command) {
    let st = cmd.status().expect("run");
    assert!(st.success(), "{cmd:?} failed");
}

struct Netns(String);

impl Netns {
    fn new() -> Netns {
        let name = format!("ember-bench-net-{}", std::process::id());
        sh(Command::new("ip").args(["netns", "add", &name]));
        let ns = Netns(name);
        sh(Command::new("ip").args([
            "netns",
            "exec",
            &ns.0,
            "sysctl",
            "-qw",
            "net.ipv6.conf.default.disable_ipv6=1",
        ]));
        sh(Command::new("ip").args(["-n", &ns.0, "tuntap", "add", "tap0", "mode", "tap"]));
        let mac = TAP_MAC.map(|b| format!("{b:02x}")).join(":");
        sh(Command::new("ip").args(["-n", &ns.0, "link", "set", "tap0", "address", &mac, "up"]));
        ns
    }

    /// A packet socket on tap0 with the virtio-net header, for sending only:
    /// bound to no protocol, so the frames the guest sends are not also
    /// queued to it (bound to all, it took ~12 % of the tap's kernel time in
    /// the transmit phases, for either VMM, and dropped every frame unread).
    /// The kernel takes each sent frame's protocol from its Ethernet header.
    fn packet_socket(&self) -> OwnedFd {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap();
            // SAFETY: plain system calls on descriptors and buffers we own.
            unsafe {
                assert_eq!(libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET), 0);
                let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
                assert!(fd >= 0);
                let fd = OwnedFd::from_raw_fd(fd);
                let one: libc::c_int = 1;
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_PACKET,
                    libc::PACKET_VNET_HDR,
                    (&one as *const libc::c_int).cast(),
                    4,
                );
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = 0;
                sll.sll_ifindex = libc::if_nametoindex(c"tap0".as_ptr()) as i32;
                assert_eq!(
                    libc::bind(
                        fd.as_raw_fd(),
                        (&sll as *const libc::sockaddr_ll).cast(),
                        std::mem::size_of::<libc::sockaddr_ll>() as u32
                    ),
                    0
                );
                fd
            }
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn small_frame() -> Vec<u8> {
    let mut f = vec![0u8; 10];
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&TAP_MAC);
    f.extend_from_slice(&0x88b5u16.to_be_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend((18..60).map(|k| k as u8));
    f
}

/// A 65000-byte TCP/IPv4 GSO segment, with its 10-byte header.
fn big_frame() -> Vec<u8> {
    let n = 65_000usize;
    let mut f = vec![1, 1];
    f.extend_from_slice(&54u16.to_le_bytes());
    f.extend_from_slice(&1448u16.to_le_bytes());
    f.extend_from_slice(&34u16.to_le_bytes());
    f.extend_from_slice(&16u16.to_le_bytes());
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&TAP_MAC);
    f.extend_from_slice(&[8, 0, 0x45, 0]);
    f.extend_from_slice(&((40 + n) as u16).to_be_bytes());
    let mut ip = [0, 1, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
    let mut s: u32 = 0x4500 + (40 + n) as u32;
    for c in ip.chunks(2) {
        s += u32::from(c[0]) << 8 | u32::from(c[1]);
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    ip[6..8].copy_from_slice(&(!(s as u16)).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&5001u16.to_be_bytes());
    f.extend_from_slice(&1000u16.to_be_bytes());
    f.extend_from_slice(&1000u32.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0, 5 << 4, 0x18, 0xff, 0xff]);
    let p: u32 = 0x0a00 + 1 + 0x0a00 + 2 + 6 + (20 + n) as u32;
    f.extend_from_slice(&(((p & 0xffff) + (p >> 16)) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend((0..n).map(|o| (o % 251) as u8));
    f
}

/// What the host sends: nothing, small frames, big segments, or stop.
const IDLE: u8 = 0;
const SMALL: u8 = 1;
const BIG: u8 = 2;
const STOP: u8 = 3;

fn flood(fd: &OwnedFd, mode: &AtomicU8) {
    let small = small_frame();
    let big = big_frame();
    const BATCH: usize = 64;
    loop {
        match mode.load(Ordering::Relaxed) {
            STOP => return,
            IDLE => std::thread::sleep(Duration::from_millis(1)),
            m => {
                let f = if m == SMALL { &small } else { &big };
                let mut iov = libc::iovec {
                    iov_base: f.as_ptr() as *mut _,
                    iov_len: f.len(),
                };
                // SAFETY: zeroed mmsghdr is valid; each points at `iov`, which lives
                // through the call, and the frame it points at is only read.
                unsafe {
                    let mut msgs: [libc::mmsghdr; BATCH] = std::mem::zeroed();
                    for m in &mut msgs {
                        m.msg_hdr.msg_iov = &mut iov;
                        m.msg_hdr.msg_iovlen = 1;
                    }
                    let n = if m == SMALL { BATCH } else { 4 };
                    if libc::sendmmsg(fd.as_raw_fd(), msgs.as_mut_ptr(), n as u32, 0) < 0 {
                        // The tap's queue is full (the guest is slower): let it drain.
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
    }
}

/// One VM run; the guest's four figures, in METRICS order.
/// Who runs the guest: this build, another ember build, or QEMU.
enum Vmm {
    Ember(std::path::PathBuf),
    Qemu,
}

fn run_once(ns: &Netns, vmm: &Vmm, name: &str, guest: &std::path::Path, secs: u64) -> Vec<f64> {
    let mac = GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
    let cmdline = format!(
        "console=ttyS0 netinfo netlen=60 netsecs={secs} nettx netsecs={secs} nettso=65000 \
         print=rx_small netsecs={secs} netrx print=rx_big netsecs={secs} netrx exit=0"
    );
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.0]);
    if let Vmm::Ember(ember) = vmm {
        cmd.arg(ember).arg("boot").arg("--kernel").arg(guest).args([
            "--mem",
            "128M",
            "--net",
            &format!("tap=tap0,mac={mac}"),
            "--cmdline",
            &cmdline,
        ]);
    } else {
        cmd.arg(std::env::var_os("EMBER_QEMU").unwrap_or("qemu-system-x86_64".into()))
            .args([
                "-M",
                "microvm,x-option-roms=off,rtc=off",
                "-accel",
                "kvm",
                "-cpu",
                if std::path::Path::new("/sys/module/kvm_amd").exists()
                    || std::path::Path::new("/sys/module/kvm_intel").exists()
                {
                    "host"
                } else {
                    "qemu64"
                },
                "-m",
                "128",
                "-nodefaults",
                "-nographic",
                "-no-reboot",
                "-serial",
                "stdio",
                "-device",
                "isa-debug-exit,iobase=0x501,iosize=1",
                "-global",
                "virtio-mmio.force-legacy=false",
                "-netdev",
                "tap,id=n0,ifname=tap0,script=no,downscript=no,vhost=off,vnet_hdr=on",
                "-device",
                &format!("virtio-net-device,netdev=n0,mac={mac}"),
                "-kernel",
            ])
            .arg(guest)
            .args(["-append", &cmdline]);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the VMM");
    let fd = Arc::new(ns.packet_socket());
    let mode = Arc::new(AtomicU8::new(IDLE));
    let sender = {
        let (fd, mode) = (fd.clone(), mode.clone());
        std::thread::spawn(move || flood(&fd, &mode))
    };
    let console = Arc::new(Mutex::new(String::new()));
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if line == "rx small" {
            mode.store(SMALL, Ordering::Relaxed);
        } else if line == "rx big" {
            mode.store(BIG, Ordering::Relaxed);
        }
        let mut c = console.lock().unwrap();
        c.push_str(&line);
        c.push('\n');
    }
    mode.store(STOP, Ordering::Relaxed);
    sender.join().unwrap();
    let _ = child.wait();
    let c = console.lock().unwrap().clone();
    let get = |prefix: &str, i: usize, key: &str| -> f64 {
        let lines = ember_testing::guest_results(&c, prefix);
        let line = lines
            .get(i)
            .unwrap_or_else(|| panic!("{name}: no {prefix} line {i}; console:\n{c}"));
        line.iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no {key} in {line:?}"))
    };
    vec![
        get("nettx", 0, "fps"),
        get("nettso", 0, "mibps"),
        get("netrx", 0, "fps"),
        get("netrx", 1, "mibps"),
    ]
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let runs: usize = std::env::var("EMBER_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let secs: u64 = std::env::var("EMBER_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let guest = ember_testing::test_guest().expect("build the test guest");
    let ns = Netns::new();
    let mut vmms = vec![
        ("ember", Vmm::Ember(env!("CARGO_BIN_EXE_ember").into())),
        ("qemu", Vmm::Qemu),
    ];
    if let Some(base) = std::env::var_os("EMBER_NET_BASE_BIN") {
        vmms.push(("base", Vmm::Ember(base.into())));
    }
    // samples[vmm][metric][round]
    let mut samples = vec![vec![Vec::new(); METRICS.len()]; vmms.len()];
    for r in 0..runs {
        for k in 0..vmms.len() {
            let v = (r + k) % vmms.len();
            let (name, vmm) = &vmms[v];
            let got = run_once(&ns, vmm, name, &guest, secs);
            eprintln!("round {} {name}: {got:?}", r + 1);
            for (m, x) in got.into_iter().enumerate() {
                samples[v][m].push(x);
            }
        }
    }
    println!(
        "virtio-net, the test guest polling, {runs} rounds of {secs} s phases, ember vs QEMU microvm (vhost=off)"
    );
    let base = vmms.len() > 2;
    if base {
        println!(
            "| phase | ember median (min–max) | QEMU median (min–max) | ember/QEMU (range) | base median (min–max) | ember/base (range) |"
        );
        println!("|---|---|---|---|---|---|");
    } else {
        println!("| phase | ember median (min–max) | QEMU median (min–max) | ember/QEMU (range) |");
        println!("|---|---|---|---|");
    }
    // The median of `a`, its range, and a/b's medians' ratio with its range over
    // the rounds, paired round by round.
    let ratio = |a: &[f64], b: &[f64]| {
        let ratios: Vec<f64> = a.iter().zip(b).map(|(a, b)| a / b).collect();
        let r = Summary::of(&ratios).unwrap();
        let (x, y) = (Summary::of(a).unwrap(), Summary::of(b).unwrap());
        format!("{:.2}× ({:.2}–{:.2})", x.median / y.median, r.min, r.max)
    };
    let cell = |a: &[f64]| {
        let s = Summary::of(a).unwrap();
        format!("{:.0} ({:.0}–{:.0})", s.median, s.min, s.max)
    };
    for (m, (name, _, unit)) in METRICS.iter().enumerate() {
        let unit = if *unit == "fps" { "frames/s" } else { "MiB/s" };
        let (e, q) = (&samples[0][m], &samples[1][m]);
        let mut row = format!(
            "| {name} ({unit}) | {} | {} | {} |",
            cell(e),
            cell(q),
            ratio(e, q)
        );
        if base {
            let b = &samples[2][m];
            row += &format!(" {} | {} |", cell(b), ratio(e, b));
        }
        println!("{row}");
    }
}
