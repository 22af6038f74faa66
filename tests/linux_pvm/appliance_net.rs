//! End-to-end: `ember run --netns` on the ember backend (the PVM test
//! kernel): the guest takes namespace A's interface and fetches a file from
//! a server in namespace B, both made by the test, in a loop of pipelines.
//!
//! The loop is the command shape that used to segfault here about once in
//! 6–8 runs (two busybox processes starting at once): this host's PVM runs
//! guest user mode on the host CPU with the host's AVX/AVX-512 state, which
//! the `noxsave` test kernel does not switch between processes, so glibc's
//! vector `memcpy` mixed two processes' registers. ember-init now keeps glibc
//! off those registers (guests/init/src/vector.rs); the command sees the
//! tunables it set, and no process of the loop dies.
//!
//! Needs EMBER_PVM_KERNEL, /dev/kvm, root (network namespaces) and busybox
//! (the server).

use crate::common;

use common::netns::{Netns, run};
use common::{PVM_CMDLINE, Scratch, ember, init_binary, pvm_kernel_dir, require_kvm};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const GUEST_ADDR: &str = "10.78.0.1";
const SERVER: &str = "10.78.0.2";
const PORT: u16 = 8078;
/// Fetches in the loop, each two busybox processes starting at once (each
/// exec costs the emulated kernel seconds: CI's budget allows a few).
const FETCHES: usize = 2;

/// The server, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Whether the host CPU has AVX: then the test kernel (`noxsave`) leaves
/// vector state unswitched and the command must get the tunables.
fn host_has_avx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "avx"))
}

#[test]
fn the_ember_backend_reaches_a_server_in_the_tests_namespace_in_a_loop() {
    let test = "appliance_net";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    let init = init_binary().unwrap_or_else(|e| panic!("{test}: {e}"));
    let scratch = Scratch::new(test);
    let (a, b) = (Netns::new("apa"), Netns::new("apb"));
    let tag = std::process::id();
    let (va, vb) = (format!("apa{tag}"), format!("apb{tag}"));
    run(Command::new("ip").args([
        "link", "add", &va, "netns", &a.0, "type", "veth", "peer", "name", &vb, "netns", &b.0,
    ]));
    for (ns, dev, addr) in [(&a, &va, GUEST_ADDR), (&b, &vb, SERVER)] {
        let cidr = format!("{addr}/24");
        run(Command::new("ip").args(["-n", &ns.0, "addr", "add", &cidr, "dev", dev]));
        run(Command::new("ip").args(["-n", &ns.0, "link", "set", dev, "up"]));
        run(Command::new("ip").args(["-n", &ns.0, "link", "set", "lo", "up"]));
    }
    run(Command::new("ip").args(["-n", &a.0, "route", "add", "default", "via", SERVER]));

    let web = scratch.path("web");
    std::fs::create_dir(&web).unwrap();
    let md5 = common::pattern_file(&web.join("blob"), 16 * 1024);
    let _server = Server(
        b.exec("busybox")
            .args(["httpd", "-f", "-p", &PORT.to_string(), "-h"])
            .arg(&web)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("busybox httpd (the test's server) must be installed"),
    );
    let start = Instant::now();
    while text(
        &b.exec("ss")
            .args(["-Htln", &format!("sport = :{PORT}")])
            .output()
            .unwrap()
            .stdout,
    )
    .trim()
    .is_empty()
    {
        assert!(start.elapsed() < Duration::from_secs(10), "no server");
        std::thread::sleep(Duration::from_millis(20));
    }

    let script = format!(
        "echo \"tunables=$GLIBC_TUNABLES\"; ip -o addr show dev eth0; i=0; \
         while [ $i -lt {FETCHES} ]; do \
           echo \"get$i $(wget -q -O - http://{SERVER}:{PORT}/blob | md5sum)\"; i=$((i+1)); \
         done; echo \"segfaults=$(dmesg | grep -c segfault)\""
    );
    let started = Instant::now();
    let out = ember()
        .env("EMBER_CACHE", scratch.path("cache"))
        .env("EMBER_INIT", &init)
        .env_remove("EMBER_LOG")
        .args(["run", "--backend", "ember", "--initramfs", "--mem", "128M"])
        .args(["--timeout", "900", "--kernel"])
        .arg(kdir.join("vmlinux"))
        .args(["--cmdline", PVM_CMDLINE, "--netns"])
        .arg(format!("/run/netns/{}", a.0))
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    eprintln!(
        "{test}: {:?}, the guest said:\n{stdout}{stderr}",
        started.elapsed()
    );
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stdout.contains(&format!("inet {GUEST_ADDR}/24")),
        "eth0 lacks A's address:\n{stdout}"
    );
    for i in 0..FETCHES {
        let want = format!("get{i} {md5}");
        assert!(stdout.contains(&want), "{want:?} missing:\n{stdout}");
    }
    assert!(stdout.contains("segfaults=0"), "{stdout}");
    if host_has_avx() {
        assert!(
            stdout.contains("tunables=glibc.cpu.hwcaps=-AVX_Fast_Unaligned_Load,-OSXSAVE"),
            "the command was not kept off the vector registers:\n{stdout}"
        );
    }
}
