//! virtio-vsock end to end: the test guest's vsock driver against host
//! programs on the hybrid vsock's Unix sockets (`CONNECT <port>` / `OK`,
//! `PATH_<port>`), data checked byte for byte both ways, credit flow control
//! with a slow reader on either side, RST on close and on a refused
//! connection, a malformed packet refused with a device error, the bad
//! `--vsock` paths refused with one line, and a restore resetting the
//! guest's connections.

use crate::common;
use common::booted::Booted;

use common::{Scratch, ember, output, require_kvm, stderr};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// The test guest's stream bytes (guests/test-guest/src/virtio_vsock.rs).
fn pattern(seed: u32, i: u64) -> u8 {
    let x = i
        .wrapping_mul(0x9e37_79b9)
        .wrapping_add(u64::from(seed) * 7919);
    (x ^ (x >> 13) ^ (i >> 8)) as u8
}
const GUEST_SEED: u32 = 1;
const HOST_SEED: u32 = 2;

/// An ember running the test guest with a vsock device, once its socket is
/// there.
fn start(uds: &Path, cmdline: &str, extra: &[&str]) -> Booted {
    let vm = Booted::spawn(
        ember()
            .arg("boot")
            .arg("--kernel")
            .arg(guest())
            .args(["--timeout", "120", "--cmdline", cmdline])
            .arg("--vsock")
            .arg(format!("cid=42,uds={}", uds.display()))
            .args(extra),
    );
    vm.wait_until("the vsock socket", |_| uds.exists());
    vm
}

/// Connects to the device's socket and asks for guest `port`; returns the
/// stream and the host port from the `OK` line.
fn host_connect(uds: &Path, port: u32) -> (UnixStream, u32) {
    let mut s = UnixStream::connect(uds).expect("connect to the vsock socket");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') {
        assert_eq!(s.read(&mut b).unwrap(), 1, "EOF before the OK line");
        line.push(b[0]);
    }
    let line = String::from_utf8(line).unwrap();
    let host_port = line
        .strip_prefix("OK ")
        .and_then(|p| p.trim_end().parse().ok())
        .unwrap_or_else(|| panic!("not an OK line: {line:?}"));
    (s, host_port)
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Host to guest: `CONNECT 1234` is answered `OK <port>` once the guest
/// accepts; 1 MiB of random bytes comes back byte for byte (the guest echoes
/// after the host's end of file), then the guest closes and gets its RST.
#[test]
fn a_host_connection_is_answered_ok_and_carries_data_both_ways() {
    if !require_kvm("vsock_e2e::a_host_connection") {
        return;
    }
    let dir = Scratch::new("vsock-host");
    let uds = dir.path("v.sock");
    let vm = start(&uds, "vsockport=1234 vsock=serve", &[]);
    vm.wait_until("the guest listening", |c| c.contains("listening"));
    let (mut s, host_port) = host_connect(&uds, 1234);
    assert!(
        host_port >= 1 << 30,
        "host ports start at 2^30: {host_port}"
    );
    let data = random_bytes(1 << 20, 7);
    s.write_all(&data).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    assert!(
        back == data,
        "echo differs ({} of {} bytes)",
        back.len(),
        data.len()
    );
    let (code, console, err) = vm.finish();
    assert_eq!(code, 0, "{console}{err}");
    assert!(
        console.contains(&format!("accepted from host port {host_port}")),
        "{console}"
    );
    assert!(
        console.contains("served received=1048576 echoed=1048576"),
        "{console}"
    );
}

/// Serves one guest connection on `PATH_<port>`: reads `n` bytes checking
/// the guest's pattern (sleeping `pause` between reads: a slow reader),
/// then sends `n` bytes of the host's pattern and closes its writing side.
fn serve_guest(
    l: UnixListener,
    n: u64,
    pause: Duration,
) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut got = 0u64;
        let mut buf = vec![0u8; 16 * 1024];
        while got < n {
            let k = s.read(&mut buf).map_err(|e| e.to_string())?;
            if k == 0 {
                return Err(format!("EOF after {got} of {n} bytes"));
            }
            for (i, &b) in buf[..k].iter().enumerate() {
                let at = got + i as u64;
                if b != pattern(GUEST_SEED, at) {
                    return Err(format!("guest byte {at} differs"));
                }
            }
            got += k as u64;
            std::thread::sleep(pause);
        }
        let back: Vec<u8> = (0..n).map(|i| pattern(HOST_SEED, i)).collect();
        s.write_all(&back).map_err(|e| e.to_string())?;
        s.shutdown(std::net::Shutdown::Write).unwrap();
        // The guest closes after checking; we see its end.
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).map_err(|e| e.to_string())?;
        if !rest.is_empty() {
            return Err(format!("{} bytes after the guest's data", rest.len()));
        }
        Ok(got)
    })
}

/// Guest to host: the guest's REQUEST to host port 5000 connects to
/// `PATH_5000`; its bytes arrive in order and the host's reach the guest
/// intact, then the guest closes and gets its RST.
#[test]
fn a_guest_connection_reaches_path_port_and_carries_data_both_ways() {
    if !require_kvm("vsock_e2e::a_guest_connection") {
        return;
    }
    let dir = Scratch::new("vsock-guest");
    let uds = dir.path("v.sock");
    let l = UnixListener::bind(dir.path("v.sock_5000")).unwrap();
    let host = serve_guest(l, 1 << 20, Duration::ZERO);
    let vm = start(&uds, "vsockport=5000 vsockbytes=1m vsock=connect", &[]);
    let served = host.join().unwrap();
    let (code, console, err) = vm.finish();
    assert_eq!(served, Ok(1 << 20), "{console}{err}");
    assert_eq!(code, 0, "{console}{err}");
    assert!(
        console.contains("vsock: sent=1048576 received=1048576 ok"),
        "{console}"
    );
    assert!(console.contains(" rst"), "{console}");
}

/// Credit flow control, guest to host: a host reading slowly makes the guest
/// wait for credit (ember holds no more than the credit it gave) and every
/// byte still arrives in order; host to guest: a guest advertising 4 KiB and
/// reading slowly is never sent past it (its driver fails if it is).
#[test]
fn credit_flow_control_holds_with_a_slow_reader_on_either_side() {
    if !require_kvm("vsock_e2e::credit_flow_control") {
        return;
    }
    let dir = Scratch::new("vsock-credit");
    let uds = dir.path("v.sock");
    let l = UnixListener::bind(dir.path("v.sock_6000")).unwrap();
    let n = 4u64 << 20;
    let host = serve_guest(l, n, Duration::from_millis(2));
    let vm = start(
        &uds,
        "vsockport=6000 vsockbytes=4m vsocksecs=100 vsock=connect",
        &[],
    );
    let served = host.join().unwrap();
    let (code, console, err) = vm.finish();
    assert_eq!(served, Ok(n), "{console}{err}");
    assert_eq!(code, 0, "{console}{err}");
    let waits: u64 = console
        .split("credit_waits=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no credit_waits: {console}"));
    assert!(waits > 0, "the guest never waited for credit:\n{console}");

    let uds = dir.path("w.sock");
    let vm = start(
        &uds,
        "vsockport=7 vsockbuf=4096 vsockslow=100 vsock=serve",
        &[],
    );
    vm.wait_until("the guest listening", |c| c.contains("listening"));
    let (mut s, _) = host_connect(&uds, 7);
    let data = random_bytes(256 * 1024, 3);
    let writer = {
        let mut s = s.try_clone().unwrap();
        let data = data.clone();
        std::thread::spawn(move || {
            s.write_all(&data).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
        })
    };
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    writer.join().unwrap();
    assert!(back == data, "echo differs ({} bytes)", back.len());
    let (code, console, err) = vm.finish();
    assert_eq!(code, 0, "{console}{err}");
    assert!(!console.contains("past our credit"), "{console}");
}

/// A guest connection to a port nobody listens on is answered RST.
#[test]
fn a_connection_to_no_listener_is_reset() {
    if !require_kvm("vsock_e2e::a_connection_to_no_listener") {
        return;
    }
    let dir = Scratch::new("vsock-refused");
    let vm = start(&dir.path("v.sock"), "vsockport=9 vsock=connect", &[]);
    let (code, console, err) = vm.finish();
    assert_eq!(code, 0, "{console}{err}");
    assert!(console.contains("connection refused (rst)"), "{console}");
}

/// A packet whose header claims more bytes than its descriptor holds is a
/// device error the guest sees (DEVICE_NEEDS_RESET); ember goes on and the
/// guest ends normally.
#[test]
fn a_malformed_packet_is_a_device_error_not_a_crash() {
    if !require_kvm("vsock_e2e::a_malformed_packet") {
        return;
    }
    let dir = Scratch::new("vsock-bad");
    let vm = start(
        &dir.path("v.sock"),
        "vsock=malformed print=still_running",
        &[],
    );
    let (code, console, err) = vm.finish();
    assert_eq!(code, 0, "{console}{err}");
    assert!(console.contains("malformed packet refused"), "{console}");
    assert!(console.contains("still running"), "{console}");
    assert!(err.contains("device needs reset"), "{err}");
}

/// Bad paths get one line each: a missing directory, and a path another VM
/// serves. A socket left behind by a VM that ended is reused.
#[test]
fn bad_vsock_paths_are_refused_with_one_line() {
    if !require_kvm("vsock_e2e::bad_vsock_paths") {
        return;
    }
    let dir = Scratch::new("vsock-paths");
    let boot = |uds: &Path| {
        output(
            ember()
                .arg("boot")
                .arg("--kernel")
                .arg(guest())
                .args(["--timeout", "60", "--cmdline", "print=up"])
                .arg("--vsock")
                .arg(format!("cid=3,uds={}", uds.display())),
        )
    };
    let o = boot(&dir.path("missing/v.sock"));
    let err = stderr(&o);
    assert!(!o.status.success());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("does not exist"), "{err}");

    let uds = dir.path("v.sock");
    let vm = start(&uds, "vsock=serve vsocksecs=60", &[]);
    vm.wait_until("the guest listening", |c| c.contains("listening"));
    let o = boot(&uds);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("in use"), "{err}");
    let mut vm = vm;
    vm.child.kill().unwrap();
    vm.child.wait().unwrap();
    // The first VM is gone; its socket file is not, and is replaced.
    assert!(uds.exists());
    let o = boot(&uds);
    assert!(o.status.success(), "{}", stderr(&o));

    let o = output(
        ember()
            .arg("boot")
            .arg("--kernel")
            .arg(guest())
            .args(["--vsock", "cid=2,uds=/tmp/x"]),
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("a guest CID is a number from 3"),
        "{}",
        stderr(&o)
    );
}

/// A snapshot taken while the guest has a connection open, restored in a
/// fresh ember: the restored device's first act is a TRANSPORT_RESET event,
/// the guest drops its connection; the host side of the old one has ended
/// with the old process. The restore is a clone's beside a live original:
/// the recorded socket is refused as in use, and `--vsock` puts the device
/// on another.
#[test]
fn a_restore_resets_the_guests_connections() {
    if !require_kvm("vsock_e2e::a_restore_resets") {
        return;
    }
    let dir = Scratch::new("vsock-restore");
    let uds = dir.path("v.sock");
    let api = dir.path("api.sock");
    let snap = dir.path("snap");
    let l = UnixListener::bind(dir.path("v.sock_77")).unwrap();
    let vm = start(
        &uds,
        "vsockport=77 vsockbytes=1000 vsocksecs=300 vsock=waitreset",
        &["--api-socket", api.to_str().unwrap()],
    );
    let (mut s, _) = l.accept().unwrap();
    let mut got = vec![0u8; 1000];
    s.read_exact(&mut got).unwrap();
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(GUEST_SEED, i as u64))
    );
    vm.wait_until("the connection", |c| c.contains("connected, sent=1000"));
    let o = output(
        ember()
            .args(["snapshot", "--api-socket"])
            .arg(&api)
            .arg("--to")
            .arg(&snap),
    );
    assert!(o.status.success(), "snapshot: {}", stderr(&o));
    let (code, console, err) = vm.finish();
    assert_eq!(code, 0, "the snapshot ends the VM: {err}");
    assert!(!console.contains("transport reset"), "{console}");
    // The old process took its end of the connection with it.
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());

    // A clone beside its original: the recorded socket is live (a listener
    // here stands for the original VM), so the restore must be told another.
    std::fs::remove_file(&uds).unwrap();
    let _original = UnixListener::bind(&uds).unwrap();
    let o = output(
        ember()
            .args(["boot", "--timeout", "120", "--restore"])
            .arg(&snap),
    );
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(err.contains("in use"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let clone = dir.path("clone.sock");
    let vm = Booted::spawn(
        ember()
            .args(["boot", "--timeout", "120", "--restore"])
            .arg(&snap)
            .arg("--vsock")
            .arg(format!("cid=42,uds={}", clone.display())),
    );
    vm.wait_until("the clone's vsock socket", |_| clone.exists());
    let (code, console, err) = vm.finish();
    assert_eq!(code, 0, "{console}{err}");
    assert!(
        console.contains("vsock: transport reset (connections dropped)"),
        "{console}{err}"
    );
}
