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

use common::containers::{
    Containerd, MESSAGE, RUNTIME, alive, build_companions, mounts_under, tree,
};

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const IMAGE: &str = "localhost/ember-shim-test:latest";
/// The busybox applets the test image links.
const APPLETS: &[&str] = &[
    "sh", "cat", "echo", "env", "uname", "sleep", "id", "ls", "grep", "wc", "dd", "nproc", "tty",
    "stty", "touch", "cut", "tr",
];
/// A VM's cold boot under TCG on a loaded host, and then some.
const VM_TIMEOUT: Duration = Duration::from_secs(240);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
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

/// Mounts below the test's containerd's directory but its snapshots' (the
/// containers' roots).
fn root_mounts(c: &Containerd) -> Vec<String> {
    mounts_under(c.dir())
        .into_iter()
        .filter(|m| !m.contains("/snapshots/"))
        .collect()
}

/// This test's containerd: the shim first on its PATH, on the QEMU backend.
fn start_containerd(bin: &Path) -> Containerd {
    let init = common::init_binary().unwrap_or_else(|e| panic!("{e}"));
    let c = Containerd::start(
        None,
        bin,
        &[
            ("EMBER_INIT", init.as_os_str()),
            ("EMBER_SHIM_BACKEND", "qemu".as_ref()),
        ],
    );
    c.import_image(IMAGE, APPLETS);
    c
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

/// `ctr task metrics ID`'s figures by name.
fn metrics(c: &Containerd, id: &str) -> std::collections::HashMap<String, u64> {
    let out = c.run(&["task", "metrics", id], b"", VM_TIMEOUT);
    assert!(out.status.success(), "metrics: {}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_owned(), w.next()?.parse().ok()?))
        })
        .collect()
}

/// The task API's Update, straight to the shim (ctr 1.6 has no `task
/// update`): a new memory limit, as containerd sends it (the OCI
/// resources as JSON).
fn update_memory(c: &Containerd, id: &str, bytes: u64) {
    use containerd_shim_protos::protobuf::MessageField;
    use containerd_shim_protos::protobuf::well_known_types::any::Any;
    use containerd_shim_protos::shim::shim::UpdateTaskRequest;
    let address_file = c
        .dir()
        .join("state/io.containerd.runtime.v2.task/default")
        .join(id)
        .join("address");
    let address = std::fs::read_to_string(&address_file).expect("the shim's address");
    let client = containerd_shim_protos::ttrpc::Client::connect(address.trim()).expect("connect");
    let task = containerd_shim_protos::TaskClient::new(client);
    let req = UpdateTaskRequest {
        id: id.to_owned(),
        resources: MessageField::some(Any {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources".into(),
            value: format!(r#"{{"memory":{{"limit":{bytes}}}}}"#).into_bytes(),
            ..Default::default()
        }),
        ..Default::default()
    };
    task.update(
        containerd_shim_protos::ttrpc::context::with_timeout(0),
        &req,
    )
    .expect("update");
}

/// The guest's MemTotal in kB, from `MemTotal: N kB` among `lines`.
fn mem_total(lines: &[&str]) -> u64 {
    lines
        .iter()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no MemTotal in {lines:?}"))
}

/// QEMU processes among `pids`: the VMs.
fn vms(pids: &[u32]) -> usize {
    alive(pids)
        .iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let argv0 = text(&c).split('\0').next().unwrap_or("").to_owned();
                argv0
                    .rsplit('/')
                    .next()
                    .unwrap_or("")
                    .starts_with("qemu-system")
            })
        })
        .count()
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
    let bin = build_companions(&["containerd-shim-ember-v2", "ember-agent"]);
    let c = start_containerd(&bin);
    // A host directory bound into c1 read-write.
    let host_dir = c.dir().join("hostdir");
    std::fs::create_dir_all(&host_dir).unwrap();
    std::fs::write(host_dir.join("in"), "from the host\n").unwrap();
    let bind = format!(
        "type=bind,src={},dst=/hostdir,options=rbind:rw",
        host_dir.display()
    );

    // 1. A file from the image, the guest's kernel, the environment, stdin
    // and the exit status; a read-only root with a tmpfs and a bind mount
    // of a host directory in it; the VM sized by the limits (64 MiB on top
    // of the base, 2 vCPUs for `--cpus 2`); nothing left after --rm.
    let out = c.run(
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--env",
            "GREETING=hi",
            "--read-only",
            "--mount",
            "type=tmpfs,src=tmpfs,dst=/scratch,options=size=1m",
            "--mount",
            &bind,
            "--memory-limit",
            "67108864",
            "--cpus",
            "2",
            IMAGE,
            "c1",
            "sh",
            "-c",
            "cat /etc/message; uname -r; env; read l; echo got:$l; ulimit -n; \
             grep -E 'NoNewPrivs|CapBnd' /proc/self/status; cat /proc/kcore | wc -c; \
             (echo x > /proc/sys/kernel/domainname) 2>/dev/null || echo read-only; \
             touch /rootfile 2>/dev/null || echo root-read-only; \
             echo scratch-ok > /scratch/f && cat /scratch/f; grep ' /scratch ' /proc/mounts | cut -d' ' -f3; \
             cat /hostdir/in; echo from the guest > /hostdir/out; nproc; grep MemTotal /proc/meminfo; exit 7",
        ],
        b"hello stdin\n", VM_TIMEOUT,
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
    // /proc/kcore masked, /proc/sys read-only; then the root read-only,
    // the tmpfs, the host directory, the vCPUs.
    let after: Vec<&str> = lines
        .iter()
        .skip_while(|l| !l.starts_with("got:"))
        .skip(1)
        .map(|l| l.trim())
        .collect();
    assert_eq!(after.len(), 11, "{stdout}");
    assert_eq!(
        after[..10],
        [
            "1024",
            "CapBnd:\t00000000a80425fb",
            "NoNewPrivs:\t1",
            "0",
            "read-only",
            "root-read-only",
            "scratch-ok",
            "tmpfs",
            "from the host",
            "2",
        ],
        "{stdout}"
    );
    let c1_mem = mem_total(&after);
    assert_eq!(
        std::fs::read_to_string(host_dir.join("out")).unwrap(),
        "from the guest\n",
        "the bind mount's write reaches the host"
    );
    assert_eq!(c.shim("c1"), None, "the shim outlived --rm");
    assert_eq!(
        root_mounts(&c),
        Vec::<String>::new(),
        "mounts left after --rm"
    );

    // 2. A pod's sandbox: exec, ps, pause/resume, metrics, update and an
    // OOM, a terminal, a stalled stdin, a second container in its VM, and
    // a signal the process traps.
    let mut events = c
        .ctr(&["events"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let event_lines = lines_of(&mut events);
    let mut run = c
        .ctr(&[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--annotation",
            "io.kubernetes.cri.container-type=sandbox",
            "--annotation",
            "io.kubernetes.cri.sandbox-id=c2",
            IMAGE,
            "c2",
            "sh",
            "-c",
            "trap 'echo trapped; exit 42' USR1; echo ready; grep MemTotal /proc/meminfo; \
             while :; do echo tick; sleep 1; done",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut run);
    expect_line(&lines, "ready", &c);
    let c2_mem = mem_total(&[lines.recv_timeout(VM_TIMEOUT).unwrap().as_str()]);
    // The VM of c1 has its 64 MiB limit on top of c2's base.
    let grown = c1_mem.abs_diff(c2_mem + 64 * 1024);
    assert!(
        grown < 4096,
        "MemTotal {c1_mem} kB with the limit, {c2_mem} kB without"
    );
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
        VM_TIMEOUT,
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
        VM_TIMEOUT,
    );
    assert_eq!(out.status.code(), Some(5), "an exec's exit status");
    let out = c.run(&["task", "ps", "c2"], b"", VM_TIMEOUT);
    let pids = text(&out.stdout).lines().skip(1).count();
    assert!(pids >= 2, "ctr task ps: {}", text(&out.stdout));

    // Pause: the ticks stop (the cgroup freezer), the task says PAUSED;
    // resume: they go on.
    let out = c.run(&["task", "pause", "c2"], b"", VM_TIMEOUT);
    assert!(out.status.success(), "pause: {}", text(&out.stderr));
    let ls = text(&c.run(&["task", "ls"], b"", VM_TIMEOUT).stdout);
    assert!(
        ls.lines()
            .any(|l| l.starts_with("c2 ") && l.contains("PAUSED")),
        "{ls}"
    );
    std::thread::sleep(Duration::from_millis(1500));
    while lines.try_recv().is_ok() {}
    std::thread::sleep(Duration::from_secs(3));
    assert!(lines.try_recv().is_err(), "a paused container ticked");
    let out = c.run(&["task", "resume", "c2"], b"", VM_TIMEOUT);
    assert!(out.status.success(), "resume: {}", text(&out.stderr));
    expect_line(&lines, "tick", &c);

    // Metrics from the guest's cgroup; an update of its memory limit
    // shows in them; an allocation beyond it is an OOM kill, and an event.
    let m = metrics(&c, "c2");
    assert!(m.get("pids.current").is_some_and(|&n| n >= 2), "{m:?}");
    assert!(m.get("memory.usage").is_some_and(|&n| n > 0), "{m:?}");
    assert!(m.get("cpu.usage_usec").is_some_and(|&n| n > 0), "{m:?}");
    update_memory(&c, "c2", 48 << 20);
    let m = metrics(&c, "c2");
    assert_eq!(m.get("memory.usage_limit"), Some(&(48 << 20)), "{m:?}");
    let out = c.run(
        &[
            "task",
            "exec",
            "--exec-id",
            "oom",
            "c2",
            "dd",
            "if=/dev/zero",
            "of=/dev/null",
            "bs=64M",
            "count=1",
        ],
        b"",
        VM_TIMEOUT,
    );
    assert_eq!(
        out.status.code(),
        Some(137),
        "dd beyond the limit: {}",
        text(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|l: &String| l.contains("/tasks/oom") && l.contains("c2"))
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match event_lines.recv_timeout(left) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("no /tasks/oom event for c2: {seen:?}"),
        }
    }
    assert!(seen.iter().any(|l| l.contains("/tasks/paused")), "{seen:?}");
    assert!(
        seen.iter().any(|l| l.contains("/tasks/resumed")),
        "{seen:?}"
    );
    let _ = events.kill();
    let _ = events.wait();

    // A terminal (`-t`, under `script` for a pty of ctr's own), sized
    // 33x101: ctr sends the size (resize-pty) once the process has
    // started, so the process waits for it (up to 30 s).
    let cmd = format!(
        "stty rows 33 cols 101; ctr --address {} task exec -t --exec-id t1 c2 \
         sh -c 'tty; i=0; while [ \"$(stty size)\" = \"0 0\" ] && [ $i -lt 300 ]; \
         do sleep 0.1; i=$((i+1)); done; echo size $(stty size)'",
        c.sock().display()
    );
    let mut tty = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let tty_in = tty.stdin.take();
    let tty_lines = lines_of(&mut tty);
    assert_eq!(wait_child(&mut tty), 0, "ctr task exec -t");
    drop(tty_in);
    let said: Vec<String> = tty_lines.try_iter().map(|l| l.trim().to_owned()).collect();
    assert!(
        said.iter().any(|l| l.starts_with("/dev/pts/")),
        "no terminal: {said:?}"
    );
    assert!(
        said.iter().any(|l| l == "size 33 101"),
        "the terminal's size did not reach the guest: {said:?}"
    );

    // A process that does not read its stdin while 1 MiB waits for it:
    // the agent still answers (ps, another exec), and every byte arrives.
    let mut slow = c
        .ctr(&[
            "task",
            "exec",
            "--exec-id",
            "slow",
            "c2",
            "sh",
            "-c",
            "while [ ! -e /tmp/go ]; do sleep 1; done; wc -c",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut slow_in = slow.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        slow_in.write_all(&vec![b'x'; 1 << 20]).unwrap();
    });
    let slow_lines = lines_of(&mut slow);
    std::thread::sleep(Duration::from_secs(3));
    let out = c.run(&["task", "ps", "c2"], b"", VM_TIMEOUT);
    assert!(
        out.status.success(),
        "ps beside a stalled stdin: {}",
        text(&out.stderr)
    );
    let out = c.run(
        &["task", "exec", "--exec-id", "go", "c2", "touch", "/tmp/go"],
        b"",
        VM_TIMEOUT,
    );
    assert!(
        out.status.success(),
        "exec beside a stalled stdin: {}",
        text(&out.stderr)
    );
    feeder.join().unwrap();
    assert_eq!(wait_child(&mut slow), 0);
    assert_eq!(
        slow_lines
            .recv_timeout(VM_TIMEOUT)
            .ok()
            .map(|l| l.trim().to_owned()),
        Some("1048576".to_owned())
    );

    // A second container of the pod: the same shim and VM (one guest
    // kernel), which sees the sandbox's processes.
    let out = c.run(
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            "--annotation",
            "io.kubernetes.cri.container-type=container",
            "--annotation",
            "io.kubernetes.cri.sandbox-id=c2",
            IMAGE,
            "p1",
            "sleep",
            "1000",
        ],
        b"",
        VM_TIMEOUT,
    );
    assert!(out.status.success(), "run p1: {}", text(&out.stderr));
    let out = c.run(
        &[
            "task",
            "exec",
            "--exec-id",
            "p1x",
            "p1",
            "sh",
            "-c",
            "uname -r; cat /proc/[0-9]*/cmdline | tr '\\0' ' '",
        ],
        b"",
        VM_TIMEOUT,
    );
    assert!(out.status.success(), "exec in p1: {}", text(&out.stderr));
    let seen = text(&out.stdout);
    assert!(seen.starts_with(&format!("{guest_release}\n")), "{seen}");
    assert!(
        seen.contains("echo trapped"),
        "p1 sees c2's processes: {seen}"
    );
    assert_eq!(c.shims(), [shim], "one shim for the pod");
    assert_eq!(vms(&tree(shim)), 1, "one VM for the pod");
    let out = c.run(&["task", "kill", "-s", "KILL", "p1"], b"", VM_TIMEOUT);
    assert!(out.status.success(), "kill p1: {}", text(&out.stderr));
    let deadline = Instant::now() + VM_TIMEOUT;
    while !c
        .run(&["task", "rm", "p1"], b"", VM_TIMEOUT)
        .status
        .success()
    {
        assert!(Instant::now() < deadline, "p1 never stopped");
        std::thread::sleep(Duration::from_millis(500));
    }
    let out = c.run(&["containers", "rm", "p1"], b"", VM_TIMEOUT);
    assert!(
        out.status.success(),
        "containers rm p1: {}",
        text(&out.stderr)
    );

    let out = c.run(&["task", "kill", "-s", "SIGUSR1", "c2"], b"", VM_TIMEOUT);
    assert!(out.status.success(), "kill: {}", text(&out.stderr));
    expect_line(&lines, "trapped", &c);
    assert_eq!(wait_child(&mut run), 42);
    wait_gone(&procs, "after the trapped signal and --rm");
    assert_eq!(root_mounts(&c), Vec::<String>::new());

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
    let out = c.run(&["task", "kill", "-s", "KILL", "c3"], b"", VM_TIMEOUT);
    assert!(out.status.success(), "kill: {}", text(&out.stderr));
    assert_eq!(wait_child(&mut run), 137);
    wait_gone(&procs, "after kill -s KILL and --rm");
    assert_eq!(root_mounts(&c), Vec::<String>::new());

    // 4. Without --rm: the container's writes land in its snapshot's
    // upper layer; the shim itself killed: its VM goes with it,
    // containerd cleans up.
    let out = c.run(
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            IMAGE,
            "c4",
            "sh",
            "-c",
            "echo kept > /written; sleep 1000",
        ],
        b"",
        VM_TIMEOUT,
    );
    assert!(out.status.success(), "run -d: {}", text(&out.stderr));
    let out = c.run(&["snapshots", "mounts", "/mnt", "c4"], b"", VM_TIMEOUT);
    let mounts = text(&out.stdout);
    let upper = mounts
        .split(|ch: char| ch == ',' || ch.is_whitespace())
        .find_map(|o| o.strip_prefix("upperdir="))
        .unwrap_or_else(|| panic!("no upperdir in `ctr snapshots mounts`: {mounts}"))
        .to_owned();
    let written = Path::new(&upper).join("written");
    let deadline = Instant::now() + VM_TIMEOUT;
    while std::fs::read_to_string(&written).ok().as_deref() != Some("kept\n") {
        assert!(
            Instant::now() < deadline,
            "c4's write never reached {}: {}",
            written.display(),
            c.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let shim = c.shim("c4").expect("c4's shim");
    let procs = tree(shim);
    // SAFETY: kill has no memory effects; this is the test's shim.
    unsafe { libc::kill(shim as i32, libc::SIGKILL) };
    wait_gone(&procs, "after the shim was killed");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !root_mounts(&c).is_empty() {
        assert!(
            Instant::now() < deadline,
            "containerd's cleanup left {:?}",
            root_mounts(&c)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = c.run(&["task", "rm", "c4"], b"", VM_TIMEOUT);
    let out = c.run(&["containers", "rm", "c4"], b"", VM_TIMEOUT);
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

    let bin = build_companions(&["containerd-shim-ember-v2", "ember-agent"]);
    let c = start_containerd(&bin);
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
        VM_TIMEOUT,
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
