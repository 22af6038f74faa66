//! User-mode networking through `passt`: the guest's frames go to a passt
//! process over a connected stream socket (4-byte big-endian length, then
//! the Ethernet frame: QEMU's `-netdev stream`/`socket` framing), and passt
//! turns them into ordinary sockets of the host. No privileges, no tap.
//!
//! passt gives the guest the host's own addresses (the interface of the
//! default route) and answers ARP/NDP as the host's gateway. ember works that
//! configuration out here, from the host's routing tables, and hands the same
//! values to passt (`-a`, `-n`, `-g`) and to the guest (its init configures
//! `eth0` before the command starts), so the guest needs no DHCP client and
//! both sides agree by construction.
//!
//! passt's end of the socket pair is passed with `--fd`: passt then ends
//! when that connection closes. So it goes with the VMM whatever way the VMM
//! ends; with ember too (`PR_SET_PDEATHSIG`, but passt started as root
//! changes to `nobody`, which clears that: then the closing socket ends it),
//! and the [`Passt`] guard kills and reaps it on every path out of ember.

use crate::cleanup;
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

/// The MTU the guest gets: passt's largest frame (what libvirt and podman
/// give passt guests), so a TCP segment crosses in few frames.
pub const MTU: u32 = 65520;

/// How long passt may take to get ready (bind its forwarded ports and
/// confine itself) before a run goes on without waiting.
const READY_WAIT: Duration = Duration::from_secs(5);

/// passt errors.
#[derive(Debug, Error)]
pub enum PasstError {
    /// No passt binary.
    #[error(
        "--net needs passt (user-mode networking): `{0}` not found (install the `passt` package, or set EMBER_PASST)"
    )]
    Missing(String),
    /// A `--publish` that does not parse.
    #[error("bad --publish `{spec}`: {why} (want [ADDR:]HOST:GUEST[/tcp|/udp])")]
    BadPublish {
        /// What was given.
        spec: String,
        /// What is wrong with it.
        why: String,
    },
    /// Nothing for passt to share.
    #[error(
        "--net: this host has no default route with an address (IPv4 or IPv6) for passt to share"
    )]
    NoRoute,
    /// Reading the host's configuration or making the socket failed.
    #[error("{0}")]
    Io(String, #[source] io::Error),
    /// passt exited before it was ready.
    #[error("passt failed: {0}")]
    Failed(String),
}

/// One IPv4 network as the guest sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Net {
    /// The guest's address (the host's).
    pub addr: Ipv4Addr,
    /// Its prefix length.
    pub prefix: u8,
    /// The default gateway (the host's).
    pub gateway: Ipv4Addr,
}

/// One IPv6 network as the guest sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Net {
    /// The guest's address (the host's global one).
    pub addr: Ipv6Addr,
    /// Its prefix length.
    pub prefix: u8,
    /// The default gateway (the host's, often link-local).
    pub gateway: Ipv6Addr,
}

/// The guest's network configuration under passt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNet {
    /// IPv4, where the host has a default route and an address on its interface.
    pub v4: Option<Ipv4Net>,
    /// IPv6, likewise.
    pub v6: Option<Ipv6Net>,
    /// The interface MTU.
    pub mtu: u32,
    /// Name servers the guest can reach (the host's, loopback ones left out:
    /// the guest's loopback is its own).
    pub dns: Vec<IpAddr>,
    /// The host's search domains.
    pub search: Vec<String>,
    /// The host interface of the default route (IPv4's, else IPv6's).
    pub ifname: String,
}

impl GuestNet {
    /// The host's configuration, as passt would share it.
    pub fn from_host() -> Result<GuestNet, PasstError> {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let route_v4 = default_route_v4(&read("/proc/net/route"));
        let route_v6 = default_route_v6(&read("/proc/net/ipv6_route"));
        let ifname = route_v4
            .as_ref()
            .map(|(i, _)| i)
            .or(route_v6.as_ref().map(|(i, _)| i))
            .cloned()
            .ok_or(PasstError::NoRoute)?;
        let v4 = route_v4.and_then(|(ifname, gateway)| {
            let (addr, prefix) = interface_v4(&ifname)?;
            Some(Ipv4Net {
                addr,
                prefix,
                gateway,
            })
        });
        let v6 = route_v6.and_then(|(ifname, gateway)| {
            let (addr, prefix) = global_v6(&read("/proc/net/if_inet6"), &ifname)?;
            Some(Ipv6Net {
                addr,
                prefix,
                gateway,
            })
        });
        if v4.is_none() && v6.is_none() {
            return Err(PasstError::NoRoute);
        }
        let (dns, search) = resolv_conf(&read("/etc/resolv.conf"));
        let dns = dns
            .into_iter()
            .filter(|a| !a.is_loopback())
            .filter(|a| match a {
                IpAddr::V4(_) => v4.is_some(),
                IpAddr::V6(_) => v6.is_some(),
            })
            .collect();
        Ok(GuestNet {
            v4,
            v6,
            mtu: MTU,
            dns,
            search,
            ifname,
        })
    }

    /// The guest's `/etc/resolv.conf`.
    pub fn resolv_conf(&self) -> String {
        let mut s = String::from("# ember run --net: the host's name servers, through passt\n");
        for a in &self.dns {
            s.push_str(&format!("nameserver {a}\n"));
        }
        if !self.search.is_empty() {
            s.push_str(&format!("search {}\n", self.search.join(" ")));
        }
        s
    }

    /// passt's options that give the guest this configuration.
    fn passt_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(n) = &self.v4 {
            a.extend([
                "-a".into(),
                n.addr.to_string(),
                "-n".into(),
                n.prefix.to_string(),
                "-g".into(),
                n.gateway.to_string(),
            ]);
        } else {
            a.push("--ipv6-only".into());
        }
        if let Some(n) = &self.v6 {
            a.extend([
                "-a".into(),
                n.addr.to_string(),
                "-g".into(),
                n.gateway.to_string(),
            ]);
        } else {
            a.push("--ipv4-only".into());
        }
        a
    }
}

/// The interface and gateway of the IPv4 default route with the lowest
/// metric, from `/proc/net/route` (addresses in the kernel's byte order,
/// as hex).
fn default_route_v4(table: &str) -> Option<(String, Ipv4Addr)> {
    const RTF_UP: u32 = 0x1;
    const RTF_GATEWAY: u32 = 0x2;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (dest, gw, flags, metric, mask) = (
                hex(f.get(1)?)?,
                hex(f.get(2)?)?,
                hex(f.get(3)?)?,
                f.get(6)?,
                hex(f.get(7)?)?,
            );
            let default = dest == 0 && mask == 0 && flags & (RTF_UP | RTF_GATEWAY) == 3;
            let metric: u32 = metric.parse().ok()?;
            default.then(|| (metric, f[0].to_owned(), Ipv4Addr::from(gw.to_le_bytes())))
        })
        .min_by_key(|(metric, ..)| *metric)
        .map(|(_, ifname, gw)| (ifname, gw))
}

/// The interface and gateway of the IPv6 default route with the lowest
/// metric, from `/proc/net/ipv6_route`; one without a gateway is left out.
fn default_route_v6(table: &str) -> Option<(String, Ipv6Addr)> {
    const RTF_UP: u32 = 0x1;
    const RTF_GATEWAY: u32 = 0x2;
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 10 || f[1] != "00" || f[0].bytes().any(|b| b != b'0') {
                return None;
            }
            let gw = hex_v6(f[4])?;
            let metric = u32::from_str_radix(f[5], 16).ok()?;
            let flags = u32::from_str_radix(f[8], 16).ok()?;
            let usable = flags & (RTF_UP | RTF_GATEWAY) == 3 && !gw.is_unspecified();
            usable.then(|| (metric, f[9].to_owned(), gw))
        })
        .min_by_key(|(metric, ..)| *metric)
        .map(|(_, ifname, gw)| (ifname, gw))
}

/// The first global IPv6 address of `ifname` and its prefix length, from
/// `/proc/net/if_inet6`: not tentative, deprecated or failed duplicate
/// detection.
fn global_v6(table: &str, ifname: &str) -> Option<(Ipv6Addr, u8)> {
    const UNUSABLE: u32 = 0x01 /* temporary */ | 0x08 /* dadfailed */ | 0x20 /* deprecated */ | 0x40 /* tentative */;
    table.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 6 || f[5] != ifname || f[3] != "00" {
            return None;
        }
        let flags = u32::from_str_radix(f[4], 16).ok()?;
        let prefix = u8::from_str_radix(f[2], 16).ok()?;
        (flags & UNUSABLE == 0).then_some((hex_v6(f[0])?, prefix))
    })
}

/// 32 hex digits as an IPv6 address.
fn hex_v6(s: &str) -> Option<Ipv6Addr> {
    (s.len() == 32)
        .then(|| u128::from_str_radix(s, 16).ok())
        .flatten()
        .map(Ipv6Addr::from)
}

/// The name servers and search domains of a `resolv.conf`.
fn resolv_conf(text: &str) -> (Vec<IpAddr>, Vec<String>) {
    let (mut dns, mut search) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let mut w = line.split_whitespace();
        match w.next() {
            // A scoped address (`fe80::1%eth0`) names a host interface.
            Some("nameserver") => dns.extend(w.next().and_then(|a| a.parse::<IpAddr>().ok())),
            Some("search") | Some("domain") => search = w.map(str::to_owned).collect(),
            _ => {}
        }
    }
    (dns, search)
}

/// The primary IPv4 address and prefix length of host interface `ifname`.
fn interface_v4(ifname: &str) -> Option<(Ipv4Addr, u8)> {
    let ask = |request: libc::Ioctl| -> Option<Ipv4Addr> {
        let req = interface_request(ifname, request)?;
        // SAFETY: both requests fill the union's sockaddr member, which for
        // an AF_INET interface address is a sockaddr_in.
        let sin: libc::sockaddr_in =
            unsafe { std::ptr::read_unaligned(std::ptr::addr_of!(req.ifr_ifru.ifru_addr).cast()) };
        Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
    };
    // The request constants are u64 in libc while ioctl takes `Ioctl`, which
    // is i32 on musl: the cast is what lets the shipped static build compile.
    let addr = ask(libc::SIOCGIFADDR as libc::Ioctl)?;
    let mask = ask(libc::SIOCGIFNETMASK as libc::Ioctl)?;
    Some((addr, u32::from(mask).count_ones() as u8))
}

/// Interface `ifname`'s answer to a SIOCGIF* `request` (in the calling
/// thread's network namespace); `None` if it has none.
pub(crate) fn interface_request(ifname: &str, request: libc::Ioctl) -> Option<libc::ifreq> {
    if ifname.len() >= libc::IFNAMSIZ {
        return None;
    }
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIF* requests read the name and write into the ifreq this
    // call owns; the socket is open.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), request, &mut req) };
    (r == 0).then_some(req)
}

/// A transport protocol a port is forwarded for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// TCP (passt `-t`).
    Tcp,
    /// UDP (passt `-u`).
    Udp,
}

/// `--publish [ADDR:]HOST:GUEST[/tcp|/udp]`: the host's port HOST (on ADDR
/// only, if given) forwarded to the guest's port GUEST.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// The host address to bind, if not all.
    pub addr: Option<IpAddr>,
    /// The host port.
    pub host: u16,
    /// The guest port.
    pub guest: u16,
    /// TCP or UDP.
    pub proto: Proto,
}

impl std::str::FromStr for Publish {
    type Err = PasstError;

    fn from_str(spec: &str) -> Result<Publish, PasstError> {
        let bad = |why: &str| PasstError::BadPublish {
            spec: spec.to_owned(),
            why: why.to_owned(),
        };
        let (rest, proto) = match spec.rsplit_once('/') {
            Some((r, "tcp")) => (r, Proto::Tcp),
            Some((r, "udp")) => (r, Proto::Udp),
            Some(_) => return Err(bad("the protocol is tcp or udp")),
            None => (spec, Proto::Tcp),
        };
        let (rest, guest) = rest.rsplit_once(':').ok_or_else(|| bad("no guest port"))?;
        let (addr, host) = match rest.rsplit_once(':') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let port = |p: &str, which: &str| match p.parse::<u16>() {
            Ok(0) | Err(_) => Err(bad(&format!("`{p}` is not a {which} port (1-65535)"))),
            Ok(n) => Ok(n),
        };
        let addr = addr
            .map(|a| {
                a.trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<IpAddr>()
                    .map_err(|_| bad(&format!("`{a}` is not an IP address")))
            })
            .transpose()?;
        Ok(Publish {
            addr,
            host: port(host, "host")?,
            guest: port(guest, "guest")?,
            proto,
        })
    }
}

impl Publish {
    /// passt's option for this forward.
    fn passt_args(&self) -> [String; 2] {
        let flag = match self.proto {
            Proto::Tcp => "-t",
            Proto::Udp => "-u",
        };
        let addr = self.addr.map(|a| format!("{a}/")).unwrap_or_default();
        [flag.into(), format!("{addr}{}:{}", self.host, self.guest)]
    }
}

/// The passt binary: `$EMBER_PASST`, else `passt` on PATH.
pub fn binary() -> Result<PathBuf, PasstError> {
    let name = std::env::var("EMBER_PASST").unwrap_or_else(|_| "passt".into());
    crate::backend::find_binary(&name).ok_or(PasstError::Missing(name))
}

/// A running passt, killed and reaped when dropped.
#[derive(Debug)]
pub struct Passt {
    /// `None` once detached.
    child: Option<Child>,
    /// Kills passt on a fatal signal; dropped before it is reaped.
    kill: Option<cleanup::Entry>,
    /// The last of passt's stderr.
    said: Arc<Mutex<String>>,
}

impl Passt {
    /// Starts passt for `net` with `publish`'s forwards; returns it and the
    /// VMM's end of its socket (close-on-exec: pass it to the VMM).
    pub fn start(net: &GuestNet, publish: &[Publish]) -> Result<(Passt, OwnedFd), PasstError> {
        let binary = binary()?;
        let (ours, theirs) = UnixStream::pair()
            .map_err(|e| PasstError::Io("cannot make passt's socket".into(), e))?;
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(&binary);
        // In the foreground (a child ember can reap), quiet, its log to
        // stderr only (no syslog).
        cmd.args(["--foreground", "--quiet", "--fd", &fd.to_string()]);
        cmd.args(net.passt_args());
        for p in publish {
            cmd.args(p.passt_args());
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cleanup::dies_with_ember(&mut cmd);
        cleanup::inherit(&mut cmd, vec![fd]);
        let mut child = cmd
            .spawn()
            .map_err(|e| PasstError::Io(format!("cannot run passt ({})", binary.display()), e))?;
        // Only passt holds its end now: it sees the VMM go.
        drop(theirs);
        let kill = libc::pid_t::try_from(child.id())
            .ok()
            .and_then(|pid| cleanup::register(cleanup::Undo::Kill(pid)).ok());
        let said = Arc::new(Mutex::new(String::new()));
        if let Some(mut err) = child.stderr.take() {
            let said = said.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n) = err.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let mut s = said.lock().unwrap_or_else(|e| e.into_inner());
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if s.len() > 4096 {
                        let cut = s.len() - 4096;
                        let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                        s.drain(..cut);
                    }
                }
            });
        }
        let child = Some(child);
        Ok((Passt { child, kill, said }, ours.into()))
    }

    /// Waits until passt has set itself up (its forwarded ports bound, its
    /// seccomp filter on, which it installs last), or fails with its own
    /// words if it exits first. One that takes longer than [`READY_WAIT`]
    /// is left to get on with it.
    pub fn wait_ready(&mut self) -> Result<(), PasstError> {
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        let status = format!("/proc/{}/status", child.id());
        let until = Instant::now() + READY_WAIT;
        while Instant::now() < until {
            if let Ok(Some(st)) = child.try_wait() {
                // Let the stderr thread take its last words.
                std::thread::sleep(Duration::from_millis(20));
                return Err(PasstError::Failed(self.last_words(st)));
            }
            let ready = std::fs::read_to_string(&status).is_ok_and(|s| {
                s.lines()
                    .any(|l| l.starts_with("Seccomp:") && l.ends_with('2'))
            });
            if ready {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Leaves passt to end by itself, when the VMM's socket closes (and by
    /// `PR_SET_PDEATHSIG` with ember): for `ember boot`, whose confined main
    /// thread may not kill or reap it.
    pub fn detach(mut self) {
        self.kill = None;
        // Dropping a `Child` neither kills nor waits for it.
        self.child = None;
    }

    /// passt's process id.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// If passt has ended: why, in its own words.
    pub fn ended(&mut self) -> Option<String> {
        let st = self.child.as_mut()?.try_wait().ok()??;
        std::thread::sleep(Duration::from_millis(20));
        Some(self.last_words(st))
    }

    /// passt's last error line, or its exit status.
    fn last_words(&self, status: std::process::ExitStatus) -> String {
        let said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        said.lines()
            .rev()
            .map(str::trim)
            .find(|l| {
                !l.is_empty()
                    && !l.starts_with("Failed to send")
                    && !l.starts_with("Don't run as root")
            })
            .map(str::to_owned)
            .unwrap_or_else(|| format!("passt {status}"))
    }
}

impl Drop for Passt {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            self.kill = None;
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_routes_and_addresses_come_from_the_kernels_tables() {
        let route = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            eth1\t00000000\t0102A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0\n\
            eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(
            default_route_v4(route),
            Some(("eth0".into(), Ipv4Addr::new(192, 0, 2, 1)))
        );
        assert_eq!(default_route_v4(&route.replace("0003", "0001")), None);

        let v6 = "fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0\n\
            00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000001 00000000 00000003     eth0\n\
            00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n";
        assert_eq!(
            default_route_v6(v6),
            Some(("eth0".into(), "fd00::1".parse().unwrap()))
        );
        let inet6 = "fe800000000000000000000000000001 02 40 20 80     eth0\n\
            fd000000000000000000000000000009 02 40 00 c0     eth0\n\
            fd000000000000000000000000000002 02 40 00 80     eth0\n\
            00000000000000000000000000000001 01 80 10 80       lo\n";
        assert_eq!(
            global_v6(inet6, "eth0"),
            Some(("fd00::2".parse().unwrap(), 64)),
            "the link-local and the tentative address are passed over"
        );
        assert_eq!(global_v6(inet6, "eth9"), None);
    }

    #[test]
    fn resolv_conf_gives_servers_and_search_domains() {
        let (dns, search) = resolv_conf(
            "# x\nnameserver 10.0.0.53\nnameserver fd00::53\nnameserver fe80::1%eth0\n\
             nameserver 127.0.0.53\nsearch a.example b.example\n",
        );
        assert_eq!(
            dns,
            ["10.0.0.53", "fd00::53", "127.0.0.53"].map(|a| a.parse::<IpAddr>().unwrap())
        );
        assert_eq!(search, ["a.example", "b.example"]);
        let net = GuestNet {
            v4: None,
            v6: None,
            mtu: MTU,
            dns: vec!["10.0.0.53".parse().unwrap()],
            search,
            ifname: "eth0".into(),
        };
        assert!(
            net.resolv_conf()
                .ends_with("nameserver 10.0.0.53\nsearch a.example b.example\n")
        );
    }

    #[test]
    fn publish_parses_and_bad_ones_say_why_in_one_line() {
        let p = |s: &str| s.parse::<Publish>();
        assert_eq!(
            p("8080:80").unwrap(),
            Publish {
                addr: None,
                host: 8080,
                guest: 80,
                proto: Proto::Tcp
            }
        );
        let udp = p("127.0.0.1:5353:53/udp").unwrap();
        assert_eq!(udp.passt_args(), ["-u", "127.0.0.1/5353:53"]);
        assert_eq!(
            p("[::1]:8080:80").unwrap().addr,
            Some("::1".parse().unwrap())
        );
        for (bad, why) in [
            ("80", "no guest port"),
            ("0:80", "not a host port"),
            ("8080:70000", "not a guest port"),
            ("x:8080:80", "not an IP address"),
            ("8080:80/sctp", "tcp or udp"),
        ] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains(why) && !e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn passt_is_told_the_configuration_the_guest_gets() {
        let mut net = GuestNet {
            v4: Some(Ipv4Net {
                addr: Ipv4Addr::new(10, 1, 0, 2),
                prefix: 24,
                gateway: Ipv4Addr::new(10, 1, 0, 1),
            }),
            v6: None,
            mtu: MTU,
            dns: Vec::new(),
            search: Vec::new(),
            ifname: "eth0".into(),
        };
        assert_eq!(
            net.passt_args().join(" "),
            "-a 10.1.0.2 -n 24 -g 10.1.0.1 --ipv4-only"
        );
        net.v6 = Some(Ipv6Net {
            addr: "fd00::2".parse().unwrap(),
            prefix: 64,
            gateway: "fe80::1".parse().unwrap(),
        });
        assert_eq!(
            net.passt_args().join(" "),
            "-a 10.1.0.2 -n 24 -g 10.1.0.1 -a fd00::2 -g fe80::1"
        );
    }
}
