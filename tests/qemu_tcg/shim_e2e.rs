//! End-to-end: containerd's `ctr run --runtime io.containerd.ember.v2`
//! through `containerd-shim-ember-v2`, each container in an ember VM on the
//! QEMU backend (Debian's cloud kernel under TCG, the host's root over
//! virtio-fs, the container's snapshot shared read-write).
//!
//! The test starts its own containerd (root, state and sockets in a temp
//! directory; stopped, its shims killed and its mounts undone whatever
//! happens), builds a busybox image with umoci (no registry) and imports
//! it. Needs root, containerd, umoci, busybox (static), QEMU, a virtiofsd
//! and `ember setup`'s kernel (`scripts/install-deps --test`).

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const RUNTIME: &str = "io.containerd.ember.v2";
const IMAGE: &str = "localhost/ember-shim-test:latest";
const MESSAGE: &str = "hello from the image";
/// A VM's cold boot under TCG on a loaded host, and then some.
const VM_TIMEOUT: Duration = Duration::from_secs(240);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Builds the shim and the agent (debug, beside the test's `ember`).
fn build_shim() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "containerd-shim-ember-v2",
            "-p",
            "ember-agent",
        ])
        .current_dir(&root)
        .status()
        .expect("run cargo");
    assert!(status.success(), "building the shim and the agent failed");
    let ember = PathBuf::from(env!("CARGO_BIN_EXE_ember"));
    let dir = ember.parent().expect("ember's directory").to_path_buf();
    for b in ["containerd-shim-ember-v2", "ember-agent"] {
        assert!(dir.join(b).is_file(), "{b} missing in {}", dir.display());
    }
    dir
}

/// What this test needs, or why it cannot run.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("containerd and its shims need root".into());
    }
    for tool in [
        "containerd",
        "ctr",
        "umoci",
        "busybox",
        "qemu-system-x86_64",
    ] {
        if ember::backend::find_binary(tool).is_none() {
            return Some(format!(
                "`{tool}` is not installed (scripts/install-deps --test)"
            ));
        }
    }
    None
}

/// Every process below `pid` (and `pid`), by their parent links.
fn tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let ppid = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    out
}

/// Those of `pids` still alive (zombies count as gone).
fn alive(pids: &[u32]) -> Vec<u32> {
    pids.iter()
        .copied()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
        })
        .collect()
}

fn wait_gone(pids: &[u32], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !alive(pids).is_empty() {
        assert!(
            Instant::now() < deadline,
            "{what}: processes left behind: {:?}",
            alive(pids)
                .iter()
                .map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                    .unwrap_or_default()
                    .replace('\0', " "))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A containerd of the test's own.
struct Containerd {
    child: Child,
    sock: PathBuf,
    bin: PathBuf,
    dir: ember_testing::TempDir,
}

impl Containerd {
    fn start(bin: &Path) -> Containerd {
        let dir = ember_testing::TempDir::new("containerd");
        let sock = dir.join("containerd.sock");
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{sock}\"\n[ttrpc]\n  address = \"{sock}.ttrpc\"\n",
                root = dir.join("root").display(),
                state = dir.join("state").display(),
                sock = sock.display(),
            ),
        )
        .unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .env("PATH", path)
            .env(
                "EMBER_INIT",
                common::init_binary().unwrap_or_else(|e| panic!("{e}")),
            )
            .env("EMBER_SHIM_BACKEND", "qemu")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let c = Containerd {
            child,
            sock,
            bin: bin.to_path_buf(),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c.ctr(&["version"]).output().unwrap().status.success() {
            assert!(
                Instant::now() < deadline,
                "containerd did not come up: {}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        c
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    fn ctr(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address").arg(&self.sock).args(args);
        c
    }

    /// Runs ctr to its end (killed after `VM_TIMEOUT`), with `stdin` as its input.
    fn run(&self, args: &[&str], stdin: &[u8]) -> Output {
        let mut child = self
            .ctr(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin).unwrap();
        drop(input);
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(child.wait_with_output()));
        match rx.recv_timeout(VM_TIMEOUT) {
            Ok(out) => out.unwrap(),
            Err(_) => {
                // SAFETY: kill has no memory effects; pid is our child.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                panic!("ctr {args:?} did not end in {VM_TIMEOUT:?}: {}", self.log());
            }
        }
    }

    /// The shim serving container `id`, if one runs.
    fn shim(&self, id: &str) -> Option<u32> {
        let want = format!("-id\0{id}\0-address\0{}\0", self.sock.display());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .find(|p| {
                std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                    let c = text(&c);
                    c.contains("containerd-shim-ember-v2") && c.contains(&want)
                })
            })
    }

    /// Mounts below the test's directory (the containers' rootfs).
    fn mounts(&self) -> Vec<String> {
        let dir = self.dir.display().to_string();
        std::fs::read_to_string("/proc/mounts")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(1))
            .filter(|m| m.starts_with(&dir) && !m.contains("/snapshots/"))
            .map(str::to_owned)
            .collect()
    }

    /// Every shim started for this containerd (their command lines name its socket).
    fn all_shims(&self) -> Vec<u32> {
        let want = format!("-address\0{}\0", self.sock.display());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                    text(&c).contains("containerd-shim-ember-v2") && text(&c).contains(&want)
                })
            })
            .collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Shims outlive containerd by design: each, with its VM, goes here.
        for shim in self.all_shims() {
            let t = tree(shim);
            // SAFETY: kill has no memory effects; these are this test's shims.
            unsafe { libc::kill(shim as i32, libc::SIGKILL) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while !alive(&t).is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        // SAFETY: as above; containerd is our child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Every mount below the directory (deepest first), before it is removed.
        let dir = self.dir.display().to_string();
        let mut points: Vec<String> = std::fs::read_to_string("/proc/mounts")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(1))
            .filter(|m| m.starts_with(&dir))
            .map(str::to_owned)
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let c = std::ffi::CString::new(p).unwrap();
            // SAFETY: c is a NUL-terminated path alive for the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = &self.bin;
    }
}

/// A busybox image built with umoci and imported.
fn import_image(c: &Containerd) {
    let work = c.dir.join("image");
    let layout = work.join("oci");
    let bundle = work.join("bundle");
    std::fs::create_dir_all(&work).unwrap();
    let umoci = |args: &[&std::ffi::OsStr]| {
        let out = Command::new("umoci").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "umoci {args:?}: {}",
            text(&out.stderr)
        );
    };
    let image = format!("{}:latest", layout.display());
    let image = std::ffi::OsStr::new(&image);
    umoci(&["init".as_ref(), "--layout".as_ref(), layout.as_os_str()]);
    umoci(&["new".as_ref(), "--image".as_ref(), image]);
    umoci(&[
        "unpack".as_ref(),
        "--image".as_ref(),
        image,
        bundle.as_os_str(),
    ]);
    let rootfs = bundle.join("rootfs");
    for d in ["bin", "etc", "tmp"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    let busybox = ember::backend::find_binary("busybox").unwrap();
    std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "cat", "echo", "env", "uname", "sleep", "id", "ls", "grep", "wc",
    ] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(rootfs.join("etc/message"), format!("{MESSAGE}\n")).unwrap();
    umoci(&[
        "repack".as_ref(),
        "--image".as_ref(),
        image,
        bundle.as_os_str(),
    ]);
    let tar = work.join("image.tar");
    let out = Command::new("tar")
        .arg("-C")
        .arg(&layout)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .output()
        .unwrap();
    assert!(out.status.success(), "tar: {}", text(&out.stderr));
    let base = IMAGE.trim_end_matches(":latest");
    let out = c
        .ctr(&["images", "import", "--base-name", base])
        .arg(&tar)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ctr images import: {}",
        text(&out.stderr)
    );
}

/// Lines of a child's stdout, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

fn expect_line(rx: &mpsc::Receiver<String>, want: &str, c: &Containerd) -> Vec<String> {
    let deadline = Instant::now() + VM_TIMEOUT;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l == want => return seen,
            Ok(l) => seen.push(l),
            Err(_) => panic!("no `{want}` line (saw {seen:?}): {}", c.log()),
        }
    }
}

fn wait_child(child: &mut Child) -> i32 {
    let deadline = Instant::now() + VM_TIMEOUT;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("ctr run did not end");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn ctr_run_in_ember_vms() {
    if let Some(why) = missing() {
        ember_testing::skip("shim_e2e::ctr_run_in_ember_vms", &why);
        return;
    }
    let guest_release = {
        let image = common::debian_bzimage();
        // …/boot/vmlinuz-VERSION
        image.rsplit("vmlinuz-").next().unwrap().to_owned()
    };
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap()
        .trim()
        .to_owned();
    let bin = build_shim();
    let c = Containerd::start(&bin);
    import_image(&c);

    // 1. A file from the image, the guest's kernel, the environment, stdin
    // and the exit status; nothing left after --rm.
    let out = c.run(
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--env",
            "GREETING=hi",
            IMAGE,
            "c1",
            "sh",
            "-c",
            "cat /etc/message; uname -r; env; read l; echo got:$l; ulimit -n; \
             grep -E 'NoNewPrivs|CapBnd' /proc/self/status; cat /proc/kcore | wc -c; \
             (echo x > /proc/sys/kernel/domainname) 2>/dev/null || echo read-only; exit 7",
        ],
        b"hello stdin\n",
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(7),
        "stdout {stdout} stderr {}",
        text(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.first(), Some(&MESSAGE), "{stdout}");
    assert_eq!(lines.get(1), Some(&guest_release.as_str()), "{stdout}");
    assert_ne!(guest_release, host_release);
    assert!(lines.contains(&"GREETING=hi"), "{stdout}");
    assert!(lines.iter().any(|l| l.starts_with("PATH=")), "{stdout}");
    assert!(lines.contains(&"got:hello stdin"), "{stdout}");
    // ctr's default spec, applied in the guest as runc applies it: its
    // rlimit, no_new_privs, capability bounding set (runc's: a80425fb),
    // /proc/kcore masked, /proc/sys read-only.
    let after: Vec<&str> = lines
        .iter()
        .skip_while(|l| !l.starts_with("got:"))
        .skip(1)
        .map(|l| l.trim())
        .collect();
    assert_eq!(
        after,
        [
            "1024",
            "CapBnd:\t00000000a80425fb",
            "NoNewPrivs:\t1",
            "0",
            "read-only"
        ],
        "{stdout}"
    );
    assert_eq!(c.shim("c1"), None, "the shim outlived --rm");
    assert_eq!(c.mounts(), Vec::<String>::new(), "mounts left after --rm");

    // 2. exec, ps, and a signal the process traps.
    let mut run = c
        .ctr(&[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            IMAGE,
            "c2",
            "sh",
            "-c",
            "trap 'echo trapped; exit 42' USR1; echo ready; while :; do sleep 1; done",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut run);
    expect_line(&lines, "ready", &c);
    let shim = c.shim("c2").expect("c2's shim");
    let procs = tree(shim);
    assert!(procs.len() > 2, "the shim runs its VM: {procs:?}");
    let out = c.run(
        &[
            "task",
            "exec",
            "--exec-id",
            "x1",
            "c2",
            "sh",
            "-c",
            "echo from-exec; cat /etc/message; uname -r",
        ],
        b"",
    );
    assert!(out.status.success(), "exec: {}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!("from-exec\n{MESSAGE}\n{guest_release}\n")
    );
    let out = c.run(
        &[
            "task",
            "exec",
            "--exec-id",
            "x2",
            "c2",
            "sh",
            "-c",
            "exit 5",
        ],
        b"",
    );
    assert_eq!(out.status.code(), Some(5), "an exec's exit status");
    let out = c.run(&["task", "ps", "c2"], b"");
    let pids = text(&out.stdout).lines().skip(1).count();
    assert!(pids >= 2, "ctr task ps: {}", text(&out.stdout));
    let out = c.run(&["task", "kill", "-s", "SIGUSR1", "c2"], b"");
    assert!(out.status.success(), "kill: {}", text(&out.stderr));
    expect_line(&lines, "trapped", &c);
    assert_eq!(wait_child(&mut run), 42);
    wait_gone(&procs, "after the trapped signal and --rm");
    assert_eq!(c.mounts(), Vec::<String>::new());

    // 3. ctr task kill -s KILL.
    let mut run = c
        .ctr(&[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            IMAGE,
            "c3",
            "sh",
            "-c",
            "echo ready; sleep 1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut run);
    expect_line(&lines, "ready", &c);
    let procs = tree(c.shim("c3").expect("c3's shim"));
    let out = c.run(&["task", "kill", "-s", "KILL", "c3"], b"");
    assert!(out.status.success(), "kill: {}", text(&out.stderr));
    assert_eq!(wait_child(&mut run), 137);
    wait_gone(&procs, "after kill -s KILL and --rm");
    assert_eq!(c.mounts(), Vec::<String>::new());

    // 4. The shim itself killed: its VM goes with it, containerd cleans up.
    let out = c.run(
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            IMAGE,
            "c4",
            "sleep",
            "1000",
        ],
        b"",
    );
    assert!(out.status.success(), "run -d: {}", text(&out.stderr));
    let deadline = Instant::now() + VM_TIMEOUT;
    while !text(&c.run(&["task", "ls"], b"").stdout).contains("RUNNING") {
        assert!(Instant::now() < deadline, "c4 never ran: {}", c.log());
        std::thread::sleep(Duration::from_millis(500));
    }
    let shim = c.shim("c4").expect("c4's shim");
    let procs = tree(shim);
    // SAFETY: kill has no memory effects; this is the test's shim.
    unsafe { libc::kill(shim as i32, libc::SIGKILL) };
    wait_gone(&procs, "after the shim was killed");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !c.mounts().is_empty() {
        assert!(
            Instant::now() < deadline,
            "containerd's cleanup left {:?}",
            c.mounts()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = c.run(&["task", "rm", "c4"], b"");
    let out = c.run(&["containers", "rm", "c4"], b"");
    assert!(out.status.success(), "containers rm: {}", text(&out.stderr));
}

/// A network namespace made by a test, and deleted with it.
struct TestNetns(String);

impl TestNetns {
    fn new(name: String) -> TestNetns {
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .unwrap();
        assert!(out.status.success(), "ip netns add: {}", text(&out.stderr));
        TestNetns(name)
    }
    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.0)
    }
    fn exec(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).args(args);
        c
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// A container in a pod network namespace CNI's bridge plugin made (the
/// bridge in a "host" namespace the test also made, where its server runs)
/// gets that namespace's interface in its VM — the address CNI gave it, its
/// MAC — and fetches a file from the server, byte for byte.
#[test]
fn a_container_in_a_cni_namespace_reaches_a_server_in_another() {
    let test = "shim_e2e::a_container_in_a_cni_namespace";
    if let Some(why) = missing() {
        ember_testing::skip(test, &why);
        return;
    }
    let plugins = Path::new("/usr/lib/cni");
    assert!(
        plugins.join("bridge").exists(),
        "{test}: CNI's bridge plugin is missing (containernetworking-plugins: scripts/install-deps --test)"
    );
    let tag = std::process::id() % 100_000;
    let host = TestNetns::new(format!("ember-cnih{tag}"));
    let pod = TestNetns::new(format!("ember-cnip{tag}"));
    let dir = common::Scratch::new("cni");
    let conf = format!(
        r#"{{"cniVersion": "0.4.0", "name": "ember-test", "type": "bridge",
            "bridge": "embr{tag}", "isGateway": true, "ipMasq": false,
            "ipam": {{"type": "host-local", "subnet": "10.99.0.0/24",
                     "dataDir": "{}", "routes": [{{"dst": "0.0.0.0/0"}}]}}}}"#,
        dir.path("ipam").display()
    );
    let cni = |command: &str| {
        let mut child = host
            .exec(&[plugins.join("bridge").to_str().unwrap()])
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", format!("ember-test-{tag}"))
            .env("CNI_NETNS", pod.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", plugins)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let added = cni("ADD");
    assert!(
        added.status.success(),
        "CNI ADD: {}{}",
        text(&added.stdout),
        text(&added.stderr)
    );
    let result: serde_json::Value = serde_json::from_slice(&added.stdout).unwrap();
    let address = result["ips"][0]["address"].as_str().unwrap().to_owned();
    let mac = text(
        &pod.exec(&["cat", "/sys/class/net/eth0/address"])
            .output()
            .unwrap()
            .stdout,
    )
    .trim()
    .to_owned();
    let web = dir.path("web");
    std::fs::create_dir_all(&web).unwrap();
    let md5 = common::pattern_file(&web.join("blob"), 256 << 10);
    let mut server = host
        .exec(&["busybox", "httpd", "-f", "-p", "10.99.0.1:8099", "-h"])
        .arg(&web)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let bin = build_shim();
    let c = Containerd::start(&bin);
    import_image(&c);
    let with_ns = format!("network:{}", pod.path().display());
    let out = c.run(
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--with-ns",
            &with_ns,
            IMAGE,
            "c-net",
            "sh",
            "-c",
            "ip addr show eth0; echo got $(wget -q -O - http://10.99.0.1:8099/blob | md5sum)",
        ],
        b"",
    );
    let _ = server.kill();
    let _ = server.wait();
    let stdout = text(&out.stdout);
    let deleted = cni("DEL");
    assert!(
        out.status.success(),
        "stdout {stdout} stderr {}\n{}",
        text(&out.stderr),
        c.log()
    );
    eprintln!("{test}: CNI gave {address}; the container saw:\n{stdout}");
    assert!(stdout.contains(&format!("inet {address}")), "{stdout}");
    assert!(stdout.contains(&mac), "the interface's MAC {mac}: {stdout}");
    assert!(stdout.contains(&format!("got {md5}")), "{stdout}");
    assert!(
        deleted.status.success(),
        "CNI DEL: {}",
        text(&deleted.stderr)
    );
    let links = text(&pod.exec(&["ip", "-o", "link"]).output().unwrap().stdout);
    assert!(!links.contains("tap0_ember"), "a tap left: {links}");
}
