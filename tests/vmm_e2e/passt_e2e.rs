//! End-to-end: ember's virtio-net device on passt's stream socket (`--net
//! socket=N`, QEMU's framing: a 4-byte big-endian length before each frame,
//! no virtio-net header) with the test guest's driver, the test playing
//! passt's part on its end of a socket pair; and `--net passt`, ember boot
//! starting passt itself, in a network namespace the test makes (no traffic
//! leaves it), and passt gone however ember ends.

use crate::common;
use common::booted::Booted;

use common::require_kvm;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const ETHERTYPE_TEST: u16 = 0x88b5;
const PEER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xbb];
const GUEST_MAC: [u8; 6] = [2, 0, 0, 0, 0, 3];

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

fn ember_bin() -> OsString {
    std::env::var_os("EMBER_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_ember").into())
}

/// The test guest's byte at offset `k` of test frame `seq` (its virtio_net.rs).
fn test_byte(seq: u32, k: usize) -> u8 {
    (seq as u8).wrapping_mul(31).wrapping_add(k as u8)
}

fn test_frame(seq: u32, len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(len);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&PEER_MAC);
    f.extend_from_slice(&ETHERTYPE_TEST.to_be_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend((18..len).map(|k| test_byte(seq, k)));
    f
}

/// Checks a test frame from the guest; the sum of its payload bytes.
fn check_test_frame(f: &[u8]) -> Option<u64> {
    if f.len() < 18 || f[12..14] != ETHERTYPE_TEST.to_be_bytes() || f[6..12] != GUEST_MAC {
        return None;
    }
    let seq = u32::from_le_bytes(f[14..18].try_into().unwrap());
    let ok = (18..f.len()).all(|k| f[k] == test_byte(seq, k));
    assert!(ok, "test frame {seq} from the guest is damaged");
    Some(f[18..].iter().map(|&b| u64::from(b)).sum())
}

fn mac_text(m: [u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

fn num(line: &[(String, String)], key: &str) -> u64 {
    line.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.parse().unwrap())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

fn field<'a>(line: &'a [(String, String)], key: &str) -> &'a str {
    line.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// Frames both ways over the socket, checked byte for byte: the guest sends
/// 200 test frames (each length-prefixed on the socket), the test sends 100
/// back, some in one write and one split byte by byte; no offloads offered.
#[test]
fn frames_cross_a_passt_socket_both_ways_byte_for_byte() {
    if !require_kvm("passt_e2e::frames_cross") {
        return;
    }
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let g = guest();
    let mut cmd = Command::new(ember_bin());
    cmd.args(["boot", "--kernel", g.to_str().unwrap(), "--mem", "128M"])
        .arg("--net")
        .arg(format!("socket={fd},mac={}", mac_text(GUEST_MAC)))
        .args(["--timeout", "60", "--cmdline"])
        .arg("netinfo netcount=200 netlen=1000 nettx print=send_now netcount=100 netrx exit=0");
    ember::cleanup::inherit(&mut cmd, vec![fd]);
    let vm = Booted::spawn(&mut cmd);
    drop(theirs);

    // Guest to host: 200 frames, each after its length.
    ours.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let (mut frames, mut sum) = (0, 0u64);
    let mut vm = Some(vm);
    let mut read = |buf: &mut [u8]| {
        if let Err(e) = ours.read_exact(buf) {
            let (code, c, err) = vm.take().unwrap().finish();
            panic!("reading frames: {e}; ember: {code}, {err}\n{c}");
        }
    };
    while frames < 200 {
        let mut len = [0u8; 4];
        read(&mut len);
        let mut f = vec![0u8; u32::from_be_bytes(len) as usize];
        read(&mut f);
        if let Some(s) = check_test_frame(&f) {
            frames += 1;
            sum += s;
        }
    }
    let vm = vm.unwrap();
    let c = vm.wait_for("\nsend now");
    let tx = ember_testing::guest_results(&c, "nettx");
    assert_eq!(num(&tx[0], "frames"), 200);
    assert_eq!(num(&tx[0], "sum"), sum, "the payload's checksum");
    let info = &ember_testing::guest_results(&c, "net")[0];
    assert_eq!(field(info, "mac"), mac_text(GUEST_MAC));
    for k in ["csum", "guest_csum", "tso4", "guest_tso4"] {
        assert_eq!(field(info, k), "0", "no offloads on a socket: {k}");
    }

    // Host to guest: 99 frames in one write, the last byte by byte.
    let mut wire = Vec::new();
    let mut sent = 0u64;
    for seq in 0..100 {
        let f = test_frame(seq, 1000);
        sent += f[18..].iter().map(|&b| u64::from(b)).sum::<u64>();
        wire.extend_from_slice(&(f.len() as u32).to_be_bytes());
        wire.extend_from_slice(&f);
    }
    let last = wire.len() - (4 + 1000);
    ours.write_all(&wire[..last]).unwrap();
    for b in &wire[last..] {
        ours.write_all(&[*b]).unwrap();
    }
    let (code, c, err) = vm.finish();
    assert_eq!(
        code,
        ember::exit::guest_end_status(ember_vmm::vstate::end::GuestEnd::ExitCode(0)),
        "stderr: {err}\nconsole:\n{c}"
    );
    let rx = ember_testing::guest_results(&c, "netrx");
    assert_eq!(num(&rx[0], "frames"), 100, "{c}");
    assert_eq!(num(&rx[0], "bad"), 0);
    assert_eq!(num(&rx[0], "sum"), sent, "the payload's checksum");
}

/// A namespace with a veth and a default route, for passt to share;
/// removed at drop.
struct Netns(String);

impl Netns {
    fn new(test: &str) -> Option<Netns> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            ember_testing::skip(test, "network namespaces need root");
            return None;
        }
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tag = format!("{}{n}", std::process::id());
        let ns = Netns(format!("ember-pa{tag}"));
        let (va, vb) = (format!("pa{tag}"), format!("pb{tag}"));
        let ip = |args: &[&str]| {
            let o = Command::new("ip").args(args).output().unwrap();
            assert!(o.status.success(), "ip {args:?}: {o:?}");
        };
        ip(&["netns", "add", &ns.0]);
        // The veth's other end stays in the namespace, down: nothing answers.
        ip(&[
            "-n", &ns.0, "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ]);
        ip(&["-n", &ns.0, "addr", "add", "10.78.0.1/24", "dev", &va]);
        ip(&["-n", &ns.0, "link", "set", &va, "up"]);
        ip(&["-n", &ns.0, "link", "set", &vb, "up"]);
        ip(&["-n", &ns.0, "route", "add", "default", "via", "10.78.0.2"]);
        Some(ns)
    }

    /// The passt processes in the namespace.
    fn passts(&self) -> Vec<u32> {
        let Ok(netns) = std::fs::metadata(Path::new("/run/netns").join(&self.0)) else {
            return Vec::new();
        };
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let ns = std::fs::metadata(format!("/proc/{pid}/ns/net"));
                comm.starts_with("passt") && ns.is_ok_and(|m| m.ino() == netns.ino())
            })
            .collect()
    }

    fn gone_within(&self, limit: Duration, what: &str) {
        let start = Instant::now();
        while !self.passts().is_empty() {
            assert!(
                start.elapsed() < limit,
                "{what}: passt left behind: {:?}",
                self.passts()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// `ember boot --net passt`: ember starts passt for the device (the guest
/// sees a network device with no offloads) and passt ends with ember: a
/// normal end, and SIGKILL while the guest waits for frames.
#[test]
fn boot_net_passt_starts_passt_and_it_goes_with_ember() {
    if !require_kvm("passt_e2e::boot_net_passt") {
        return;
    }
    let Some(ns) = Netns::new("passt_e2e::boot_net_passt") else {
        return;
    };
    let g = guest();
    let boot = |cmdline: &str| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &ns.0])
            .arg(ember_bin())
            .args(["boot", "--kernel", g.to_str().unwrap(), "--mem", "128M"])
            .args(["--net", "passt", "--publish", "18099:99", "--timeout", "60"])
            .args(["--cmdline", cmdline]);
        c
    };
    let vm = Booted::spawn(&mut boot("netinfo exit=0"));
    let (code, c, err) = vm.finish();
    assert_eq!(
        code,
        ember::exit::guest_end_status(ember_vmm::vstate::end::GuestEnd::ExitCode(0)),
        "stderr: {err}\nconsole:\n{c}"
    );
    let info = &ember_testing::guest_results(&c, "net")[0];
    assert_eq!(field(info, "csum"), "0", "{c}");
    ns.gone_within(Duration::from_secs(10), "normal end");

    // The guest waits for frames that never come; ember is killed.
    let vm = Booted::spawn(&mut boot("netinfo print=waiting netcount=1 netrx exit=0"));
    vm.wait_for("waiting");
    assert!(!ns.passts().is_empty(), "passt runs while the VM does");
    // `ip netns exec` execs ember: the child is ember.
    let pid = vm.child.id() as libc::pid_t;
    // SAFETY: kill has no memory preconditions; pid is our unreaped child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let _ = vm.finish();
    ns.gone_within(Duration::from_secs(15), "SIGKILL");
}

/// `ember boot --net passt` without passt: one line saying so, and nothing
/// left behind — no passt, no control socket, no vsock socket, nothing in
/// its temporary directory, no process.
#[test]
fn boot_net_passt_without_passt_fails_in_one_line_and_leaves_nothing() {
    let Some(ns) = Netns::new("passt_e2e::without_passt") else {
        return;
    };
    let dir = common::Scratch::new("passt-missing");
    let tmp = dir.path("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let g = guest();
    let o = common::output(
        Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(ember_bin())
            .args(["boot", "--kernel", g.to_str().unwrap(), "--timeout", "30"])
            .args(["--net", "passt", "--publish", "18098:98"])
            .arg("--api-socket")
            .arg(dir.path("api.sock"))
            .arg("--vsock")
            .arg(format!("cid=3,uds={}", dir.path("v.sock").display()))
            .env("EMBER_PASST", "/nonexistent/passt")
            .env("TMPDIR", &tmp),
    );
    let err = common::stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(o.stdout.is_empty(), "the guest ran: {}", common::stdout(&o));
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    assert!(
        err.contains("--net needs passt") && err.contains("/nonexistent/passt"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path(""))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["tmp"], "left behind");
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "left in TMPDIR"
    );
    assert!(ns.passts().is_empty());
    // `ip netns exec` execs ember, which has ended: nothing of it in the
    // namespace.
    let netns = std::fs::metadata(Path::new("/run/netns").join(&ns.0)).unwrap();
    let in_ns: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == netns.ino())
        })
        .collect();
    assert!(
        in_ns.is_empty(),
        "processes left in the namespace: {in_ns:?}"
    );
}
