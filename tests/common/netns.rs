//! A network namespace a test makes for itself (no traffic leaves it), taps
//! in it, and a packet socket on a tap with the virtio-net header, so
//! offloaded frames show as the kernel holds them.

use super::{output, stderr};
use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

/// The host side's MAC on every test tap.
pub const TAP_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xaa];

/// The ember binary under test (as `super::ember()` runs it).
pub fn ember_bin() -> OsString {
    std::env::var_os("EMBER_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_ember").into())
}

/// Runs `cmd`, failing the test with its stderr if it fails.
pub fn run(cmd: &mut Command) {
    let o = output(cmd);
    assert!(o.status.success(), "{cmd:?}: {}", stderr(&o));
}

/// A network namespace of the test's own, deleted at drop.
pub struct Netns(pub String);

/// Deletes the namespaces of test processes that are gone: a run killed
/// before its drops ran (a CI job stopped mid-test) leaves `ember-PID-TAG`
/// behind, and the next run takes it away.
fn sweep_dead() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("ember-")
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok());
        if let Some(pid) = pid
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = output(Command::new("ip").args(["netns", "del", &name]));
        }
    }
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        sweep_dead();
        let name = format!("ember-{}-{tag}", std::process::id());
        let o = output(Command::new("ip").args(["netns", "add", &name]));
        assert!(
            o.status.success(),
            "the network tests make their own namespace (as root): ip netns add: {}",
            stderr(&o)
        );
        let ns = Netns(name);
        // No IPv6 chatter (router solicitations) on the taps.
        run(ns
            .exec("sysctl")
            .args(["-qw", "net.ipv6.conf.default.disable_ipv6=1"]));
        ns
    }

    pub fn exec(&self, program: impl Into<OsString>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).arg(program.into());
        c
    }

    /// A tap `name` with the host-side MAC, up.
    pub fn tap(&self, name: &str) {
        run(Command::new("ip").args(["-n", &self.0, "tuntap", "add", name, "mode", "tap"]));
        let mac = mac_text(TAP_MAC);
        run(Command::new("ip").args(["-n", &self.0, "link", "set", name, "address", &mac, "up"]));
    }

    /// A packet socket on `ifname` in the namespace, with the virtio-net header.
    pub fn packet_socket(&self, ifname: &str) -> PacketSocket {
        let path = format!("/run/netns/{}", self.0);
        let ifname = std::ffi::CString::new(ifname).unwrap();
        // setns on a thread of its own: the socket keeps the namespace it was made in.
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap();
            // SAFETY: plain system calls on descriptors and buffers we own.
            unsafe {
                assert_eq!(libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET), 0);
                let proto = (libc::ETH_P_ALL as u16).to_be();
                let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto));
                assert!(
                    fd >= 0,
                    "packet socket: {}",
                    std::io::Error::last_os_error()
                );
                let fd = OwnedFd::from_raw_fd(fd);
                let one: libc::c_int = 1;
                assert_eq!(
                    libc::setsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_PACKET,
                        libc::PACKET_VNET_HDR,
                        (&one as *const libc::c_int).cast(),
                        4
                    ),
                    0
                );
                let index = libc::if_nametoindex(ifname.as_ptr());
                assert!(index > 0);
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = proto;
                sll.sll_ifindex = index as i32;
                assert_eq!(
                    libc::bind(
                        fd.as_raw_fd(),
                        (&sll as *const libc::sockaddr_ll).cast(),
                        std::mem::size_of::<libc::sockaddr_ll>() as u32
                    ),
                    0
                );
                // Room for a burst of frames the test reads only afterwards.
                let size: libc::c_int = 32 << 20;
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUFFORCE,
                    (&size as *const libc::c_int).cast(),
                    4,
                );
                let tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 100_000,
                };
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&tv as *const libc::timeval).cast(),
                    std::mem::size_of::<libc::timeval>() as u32,
                );
                PacketSocket(fd)
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

pub fn mac_text(m: [u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

pub fn parse_mac(s: &str) -> [u8; 6] {
    let v: Vec<u8> = s
        .split(':')
        .map(|p| u8::from_str_radix(p, 16).unwrap())
        .collect();
    v.try_into().unwrap()
}

/// A frame as the packet socket saw it: its virtio-net header's GSO type and
/// the frame.
pub struct Frame {
    /// The header's GSO type.
    pub gso_type: u8,
    /// The frame.
    pub data: Vec<u8>,
}

pub struct PacketSocket(OwnedFd);

impl PacketSocket {
    pub fn recv(&self) -> Option<Frame> {
        let mut buf = vec![0u8; 70_000];
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 10 {
            return None;
        }
        buf.truncate(n as usize);
        Some(Frame {
            gso_type: buf[1],
            data: buf.split_off(10),
        })
    }

    /// Sends a frame with a 10-byte virtio-net header.
    pub fn send(&self, hdr: [u8; 10], frame: &[u8]) {
        let mut b = hdr.to_vec();
        b.extend_from_slice(frame);
        // SAFETY: `b` is valid for reads of its length.
        let n = unsafe { libc::send(self.0.as_raw_fd(), b.as_ptr().cast(), b.len(), 0) };
        assert_eq!(n, b.len() as isize, "{}", std::io::Error::last_os_error());
    }

    /// Collects frames until `done` says so or `timeout` passes.
    pub fn collect(&self, timeout: Duration, mut done: impl FnMut(&[Frame]) -> bool) -> Vec<Frame> {
        let start = Instant::now();
        let mut got = Vec::new();
        while start.elapsed() < timeout && !done(&got) {
            if let Some(f) = self.recv() {
                got.push(f);
            }
        }
        got
    }
}

impl Netns {
    /// Runs `f` on a thread inside the namespace (sockets it makes stay there).
    pub fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap();
            // SAFETY: setns on a descriptor we own; it affects this thread only.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap()
    }

    /// Gives the tap `name` an IPv4 address (a /24).
    pub fn address(&self, name: &str, cidr: &str) {
        run(Command::new("ip").args(["-n", &self.0, "addr", "add", cidr, "dev", name]));
    }
}
