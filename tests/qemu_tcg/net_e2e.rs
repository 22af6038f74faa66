//! End-to-end: `ember run --net` (user-mode networking through passt) on
//! the QEMU backend, with Debian's cloud kernel and its `virtio_net`.
//!
//! Traffic stays inside network namespaces each test makes: namespace A
//! (where ember, passt and so the guest's "host side" live) has a veth to
//! namespace B, where the test's servers run; A's default routes go to B.
//! So passt shares A's addresses with the guest, and what the guest reaches
//! is B. Needs root (network namespaces), passt, QEMU and `ember setup`.

use crate::common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A's side of the veth, and the gateway and servers in B.
const A4: &str = "10.77.0.1";
const GW4: &str = "10.77.0.2";
const SERVER4: &str = "10.77.0.3";
const DNS4: &str = "10.77.0.53";
const A6: &str = "fd77::1";
const GW6: &str = "fd77::2";
const SERVER6: &str = "fd77::3";

/// Two namespaces joined by a veth, removed when dropped.
struct Netns {
    a: String,
    b: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    /// A and B, or `None` (a loud skip) where this user cannot make them.
    fn new(test: &str) -> Option<Netns> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            ember_testing::skip(test, "network namespaces need root");
            return None;
        }
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tag = format!("{}{n}", std::process::id());
        let ns = Netns {
            a: format!("ember-na{tag}"),
            b: format!("ember-nb{tag}"),
        };
        let (va, vb) = (format!("ea{tag}"), format!("eb{tag}"));
        ip(&["netns", "add", &ns.a]);
        ip(&["netns", "add", &ns.b]);
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &ns.a]);
        ip(&["link", "set", &vb, "netns", &ns.b]);
        for (n, dev, addrs) in [
            (&ns.a, &va, &[A4][..]),
            (&ns.b, &vb, &[GW4, SERVER4, DNS4][..]),
        ] {
            for a in addrs {
                ip(&["-n", n, "addr", "add", &format!("{a}/24"), "dev", dev]);
            }
            ip(&["-n", n, "link", "set", "lo", "up"]);
            ip(&["-n", n, "link", "set", dev, "up"]);
        }
        for (n, dev, addrs) in [(&ns.a, &va, &[A6][..]), (&ns.b, &vb, &[GW6, SERVER6][..])] {
            for a in addrs {
                let a = format!("{a}/64");
                ip(&["-n", n, "-6", "addr", "add", &a, "dev", dev, "nodad"]);
            }
        }
        ip(&["-n", &ns.a, "route", "add", "default", "via", GW4]);
        ip(&["-n", &ns.a, "-6", "route", "add", "default", "via", GW6]);
        // `ip netns exec A` shows this as A's /etc/resolv.conf.
        std::fs::create_dir_all(ns.etc()).unwrap();
        std::fs::write(
            ns.etc().join("resolv.conf"),
            format!("nameserver {DNS4}\nnameserver 127.0.0.53\nsearch ember.test\n"),
        )
        .unwrap();
        Some(ns)
    }

    fn etc(&self) -> PathBuf {
        Path::new("/etc/netns").join(&self.a)
    }

    /// `cmd` run in namespace `ns`.
    fn exec(ns: &str, cmd: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(cmd);
        c
    }

    /// `ember run --backend qemu ARGS` in A.
    fn ember(&self, args: &[&str]) -> Command {
        let ember = common::ember();
        let mut c = Netns::exec(&self.a, &[ember.get_program().to_str().unwrap()]);
        c.env(
            "EMBER_INIT",
            common::init_binary().unwrap_or_else(|e| panic!("{e}")),
        );
        // The initramfs appliance: the scripts use busybox's applets
        // (`wget`, `nslookup`, `httpd`, `nc`), which the host may lack.
        c.args([
            "run",
            "--backend",
            "qemu",
            "--initramfs",
            "--timeout",
            "120",
        ])
        .args(args);
        c
    }

    /// An HTTP server in B on `port` (both families) serving `dir`.
    fn serve_in_b(&self, port: u16, dir: &Path) -> Server {
        let child = Netns::exec(&self.b, &["busybox", "httpd", "-f"])
            .args(["-p", &port.to_string(), "-h", dir.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_listening(&self.b, port);
        Server(child)
    }

    /// The passt processes in A.
    fn passts(&self) -> Vec<u32> {
        let Ok(netns) = std::fs::metadata(Path::new("/run/netns").join(&self.a)) else {
            return Vec::new();
        };
        use std::os::unix::fs::MetadataExt;
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let ns = std::fs::metadata(format!("/proc/{pid}/ns/net"));
                comm.starts_with("passt") && ns.is_ok_and(|m| m.ino() == netns.ino())
            })
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        let _ = std::fs::remove_dir_all(self.etc());
    }
}

/// A server process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something in namespace `ns` listens on TCP `port`.
fn wait_listening(ns: &str, port: u16) {
    let start = Instant::now();
    loop {
        let out = Netns::exec(ns, &["ss", "-Htln", &format!("sport = :{port}")])
            .output()
            .unwrap();
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nothing listens on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn checked(out: Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {}\nstderr: {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The guest is configured before its command starts (address, prefix,
/// MTU, default routes, name servers, IPv4 and IPv6) and reaches servers
/// in B over both; a datagram to the name server arrives.
#[test]
fn the_guest_reaches_servers_in_the_test_namespace_over_ipv4_and_ipv6() {
    let Some(ns) = Netns::new("net_e2e::the_guest_reaches_servers") else {
        return;
    };
    let web = common::Scratch::new("net-web");
    let md5 = common::pattern_file(&web.path("blob"), 1 << 20);
    let _web = ns.serve_in_b(7001, &web.0);
    // The "name server": whatever datagram reaches port 53 on DNS4.
    let mut dns = Netns::exec(
        &ns.b,
        &["socat", "-u", &format!("UDP-RECV:53,bind={DNS4}"), "STDOUT"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    // A 1 MiB file fetched over each family, checked byte for byte; a name
    // looked up through resolv.conf (no answer: the query's arrival is
    // what counts).
    let script = format!(
        "ip -o addr show dev eth0; ip -o link show dev eth0; ip route; ip -6 route; \
         cat /etc/resolv.conf; \
         echo v4 $(wget -q -O - http://{SERVER4}:7001/blob | md5sum); \
         echo v6 $(wget -q -O - 'http://[{SERVER6}]:7001/blob' | md5sum); \
         timeout 3 nslookup dns-probe.ember.test >/dev/null 2>&1; true"
    );
    let start = Instant::now();
    let out = checked(
        ns.ember(&["--net", "--", "sh", "-c", &script])
            .output()
            .unwrap(),
    );
    let took = start.elapsed();
    eprintln!("ember run --net took {took:?}; the guest saw:\n{out}");
    for want in [
        format!("inet {A4}/24"),
        format!("inet6 {A6}/64"),
        "mtu 65520".into(),
        format!("default via {GW4} dev eth0"),
        format!("default via {GW6} dev eth0"),
        format!("nameserver {DNS4}\n"),
        "search ember.test".into(),
        format!("v4 {md5}"),
        format!("v6 {md5}"),
    ] {
        assert!(out.contains(&want), "{want:?} missing from:\n{out}");
    }
    // The host's loopback resolver is the host's own, not the guest's.
    assert!(!out.contains("127.0.0.53"), "{out}");
    let _ = dns.kill();
    let mut got = Vec::new();
    dns.stdout.take().unwrap().read_to_end(&mut got).unwrap();
    // The query's name, in DNS's length-prefixed labels.
    let got = text(&got);
    let _ = dns.wait();
    assert!(got.contains("dns-probe"), "the name server got {got:?}");
}

/// Without `--net` the guest has no network device.
#[test]
fn without_net_the_guest_has_no_network() {
    let Some(ns) = Netns::new("net_e2e::without_net") else {
        return;
    };
    let out = checked(
        ns.ember(&["--", "sh", "-c", "ls /sys/class/net"])
            .output()
            .unwrap(),
    );
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["lo"], "{out}");
}

/// `--publish HOST:GUEST` forwards a port of A (where ember runs) to a
/// server in the guest: a 1 MiB file made in the guest arrives whole.
#[test]
fn publish_reaches_a_server_in_the_guest() {
    let Some(ns) = Netns::new("net_e2e::publish") else {
        return;
    };
    // The guest serves its file until something connects to port 81.
    let script = "mkdir /tmp/w; head -c 1048576 /dev/urandom > /tmp/w/blob; \
                  echo guest $(md5sum < /tmp/w/blob); httpd -p 80 -h /tmp/w; \
                  nc -l -p 81 </dev/null; echo guest-done";
    let run = ns
        .ember(&[
            "--publish",
            "18080:80",
            "--publish",
            "127.0.0.1:18081:81/tcp",
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    // passt listens at once; until the guest's server does, a connection
    // is refused inside the guest and wget fails.
    let fetched = loop {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "no answer through --publish"
        );
        std::thread::sleep(Duration::from_millis(300));
        let out = Netns::exec(&ns.a, &["bash", "-c"])
            .arg("set -o pipefail; busybox wget -q -O - http://127.0.0.1:18080/blob | md5sum")
            .output()
            .unwrap();
        if out.status.success() {
            break text(&out.stdout)
                .split_whitespace()
                .next()
                .unwrap()
                .to_owned();
        }
    };
    let done = Netns::exec(&ns.a, &["busybox", "nc", "127.0.0.1", "18081"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(done.status.success());
    let out = run.wait_with_output().unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!("guest {fetched}")),
        "fetched {fetched}, guest: {stdout}"
    );
    assert!(stdout.contains("guest-done"), "{stdout}");
}

/// passt ends with the run: after a normal end, a guest that crashes, and
/// SIGTERM and SIGKILL of ember while the command runs.
#[test]
fn passt_goes_with_every_ending() {
    let Some(ns) = Netns::new("net_e2e::passt_goes") else {
        return;
    };
    let gone_within = |limit: Duration, what: &str| {
        let start = Instant::now();
        while !ns.passts().is_empty() {
            assert!(
                start.elapsed() < limit,
                "{what}: passt left behind: {:?}",
                ns.passts()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // A normal end.
    checked(ns.ember(&["--net", "--", "true"]).output().unwrap());
    gone_within(Duration::ZERO, "normal end");
    // The guest's kernel crashes (panic=-1: the VM resets, QEMU exits).
    let out = ns
        .ember(&["--net", "--", "sh", "-c", "echo c > /proc/sysrq-trigger"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    gone_within(Duration::ZERO, "guest crash");
    // ember killed while the command runs.
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        let mut run = ns
            .ember(&["--net", "--", "sleep", "100"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while ns.passts().is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "passt never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Let the VM get going, so the VMM holds passt's socket.
        std::thread::sleep(Duration::from_secs(2));
        // `ip netns exec` runs ember in its own process (it execs).
        let pid = run.id() as libc::pid_t;
        // SAFETY: kill has no memory preconditions; pid is our child, unreaped.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let _ = run.wait();
        gone_within(Duration::from_secs(15), &format!("signal {signal}"));
    }
}

/// Bad input gets one line and exit status 125: passt missing, a bad
/// `--publish`, a port already taken, a host without a default route.
#[test]
fn bad_network_input_is_one_line() {
    let Some(ns) = Netns::new("net_e2e::bad_input") else {
        return;
    };
    let one_line = |out: Output, want: &str| {
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{err}");
        assert!(err.contains(want), "{want:?} not in {err:?}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    };
    let out = ns
        .ember(&["--net", "--", "true"])
        .env("EMBER_PASST", "/nonexistent/passt")
        .output()
        .unwrap();
    one_line(out, "--net needs passt");
    for (bad, why) in [
        ("8080", "no guest port"),
        ("8080:0", "not a guest port"),
        ("8080:80/sctp", "tcp or udp"),
    ] {
        let out = ns
            .ember(&["--publish", bad, "--", "true"])
            .output()
            .unwrap();
        one_line(out, why);
    }
    let taken = Netns::exec(&ns.a, &["busybox", "nc", "-l", "-p", "18090"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _taken = Server(taken);
    wait_listening(&ns.a, 18090);
    let out = ns
        .ember(&["--publish", "18090:80", "--", "true"])
        .output()
        .unwrap();
    one_line(out, "passt failed: Failed to bind");
    ip(&["-n", &ns.a, "route", "del", "default"]);
    ip(&["-n", &ns.a, "-6", "route", "del", "default"]);
    let out = ns.ember(&["--net", "--", "true"]).output().unwrap();
    one_line(out, "no default route");
}

/// `--netns A`, ember started outside A: the guest takes A's interface —
/// its address, MAC, MTU and default routes — its traffic redirected to and
/// from a tap in A with tc (as Kata does for a CNI-made pod namespace), and
/// reaches B's server through it. ember makes the tap and the redirects
/// itself: an `ip` or `tc` on its PATH fails and leaves a mark. Afterwards A
/// has no tap and no filter left.
#[test]
fn netns_gives_the_guest_the_namespaces_interface() {
    let Some(ns) = Netns::new("net_e2e::netns") else {
        return;
    };
    let va = format!("ea{}", &ns.a["ember-na".len()..]);
    ip(&["-n", &ns.a, "link", "set", &va, "mtu", "1400"]);
    let show = |args: &[&str]| text(&Netns::exec(&ns.a, args).output().unwrap().stdout);
    let mac = show(&["cat", &format!("/sys/class/net/{va}/address")])
        .trim()
        .to_owned();
    let web = common::Scratch::new("netns-web");
    let md5 = common::pattern_file(&web.path("blob"), 1 << 20);
    let _web = ns.serve_in_b(7002, &web.0);
    let script = format!(
        "ip -o addr show dev eth0; ip -o link show dev eth0; ip route; \
         echo v4 $(wget -q -O - http://{SERVER4}:7002/blob | md5sum); \
         echo v6 $(wget -q -O - 'http://[{SERVER6}]:7002/blob' | md5sum)"
    );
    let tools = common::Scratch::new("netns-tools");
    let ran = tools.path("ran");
    for tool in ["ip", "tc"] {
        use std::os::unix::fs::PermissionsExt;
        let p = tools.path(tool);
        let script = format!("#!/bin/sh\necho \"$0 $*\" >> '{}'\nexit 1\n", ran.display());
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = std::env::var("PATH").unwrap_or_default();
    let mut run = common::ember();
    run.env(
        "EMBER_INIT",
        common::init_binary().unwrap_or_else(|e| panic!("{e}")),
    )
    .env("PATH", format!("{}:{path}", tools.0.display()))
    .args([
        "run",
        "--backend",
        "qemu",
        "--initramfs",
        "--timeout",
        "120",
    ])
    .arg("--netns")
    .arg(Path::new("/run/netns").join(&ns.a))
    .args(["--", "sh", "-c", &script]);
    let out = run.output().unwrap();
    let spawned = std::fs::read_to_string(&ran).unwrap_or_default();
    assert!(spawned.is_empty(), "ember spawned iproute2:\n{spawned}");
    let out = checked(out);
    eprintln!("ember run --netns: the guest saw:\n{out}");
    for want in [
        format!("inet {A4}/24"),
        format!("inet6 {A6}/64"),
        "mtu 1400".into(),
        format!("link/ether {mac}"),
        format!("default via {GW4} dev eth0"),
        format!("v4 {md5}"),
        format!("v6 {md5}"),
    ] {
        assert!(out.contains(&want), "{want:?} missing from:\n{out}");
    }
    let links = show(&["ip", "-o", "link"]);
    assert!(!links.contains("tap0_ember"), "a tap left in A:\n{links}");
    let qdiscs = show(&["tc", "qdisc", "show", "dev", &va]);
    assert!(
        !qdiscs.contains("ingress"),
        "a filter left on {va}:\n{qdiscs}"
    );
    // A bad namespace is one line.
    let o = common::ember()
        .args([
            "run",
            "--backend",
            "qemu",
            "--netns",
            "/nonexistent/ns",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("--netns /nonexistent/ns: cannot open it"),
        "{err}"
    );
}
