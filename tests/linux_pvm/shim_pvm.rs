//! End-to-end: `ctr run --runtime io.containerd.ember.v2` on the ember
//! backend (`EMBER_SHIM_BACKEND=ember`), the pod VM the appliance's
//! snapshot of the PVM test kernel with the host's root and the pod's
//! share: the first container's VM boots and makes it, the second's is
//! restored from it. The agent talks over the appliance's channel.
//!
//! The test starts its own containerd (root, state, sockets and ember's
//! cache in its scratch directory) and builds a busybox image with umoci.
//! Needs root, containerd, umoci, busybox (static) and EMBER_PVM_KERNEL.
//! Ignored for now: the first run (the cold boot) passes; in the restored
//! guest the container ran and printed the right lines, then the agent
//! panicked on a String whose pointer was null (the same restored-PVM
//! corruption as the appliance's busybox FS-base faults).

use crate::common;

use common::{PVM_CMDLINE, Scratch, init_binary, pvm_kernel_dir, require_kvm};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const RUNTIME: &str = "io.containerd.ember.v2";
const IMAGE: &str = "localhost/ember-pvm-test:latest";
const MESSAGE: &str = "hello from the image";
/// The snapshot's cold boot of the emulated guest kernel on a loaded host.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

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
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_ember"))
        .parent()
        .expect("ember's directory")
        .to_path_buf();
    for b in ["containerd-shim-ember-v2", "ember-agent"] {
        assert!(dir.join(b).is_file(), "{b} missing in {}", dir.display());
    }
    dir
}

/// The release a kernel image says it is (its `Linux version X` banner).
fn release_of(vmlinux: &Path) -> String {
    let image = std::fs::read(vmlinux).unwrap();
    let mark = b"Linux version ";
    let at = image
        .windows(mark.len())
        .position(|w| w == mark)
        .expect("a Linux version banner in the kernel");
    let rest = &image[at + mark.len()..];
    let end = rest.iter().position(|&b| b == b' ').unwrap();
    text(&rest[..end])
}

/// Every process whose parent chain reaches `pid`, and `pid`.
fn tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let ppid = stat.rsplit(')').next()?.split_whitespace().nth(1)?;
            Some((p, ppid.parse().ok()?))
        })
        .collect();
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == parent).map(|p| p.0));
        i += 1;
    }
    out
}

/// Processes whose command line mentions `needle`.
fn processes_naming(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id())
        .filter_map(|p| {
            let c = text(&std::fs::read(format!("/proc/{p}/cmdline")).ok()?).replace('\0', " ");
            c.contains(needle).then_some(c)
        })
        .collect()
}

/// Mount points below `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .filter(|m| m.starts_with(&dir))
        .map(str::to_owned)
        .collect()
}

/// This test's containerd: stopped, its shims (and their VMs) killed and
/// its mounts undone at drop, however the test ends.
struct Containerd {
    child: Child,
    sock: PathBuf,
    dir: PathBuf,
}

impl Containerd {
    fn start(dir: &Path, bin: &Path, env: &[(&str, &std::ffi::OsStr)]) -> Containerd {
        std::fs::create_dir_all(dir).unwrap();
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
        let mut cmd = Command::new("containerd");
        cmd.arg("--config").arg(&config).env("PATH", path);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let c = Containerd {
            child,
            sock,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c.ctr(&["version"]).output().unwrap().status.success() {
            assert!(Instant::now() < deadline, "no containerd: {}", c.log());
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

    /// Runs ctr to its end (killed after [`RUN_TIMEOUT`]).
    fn run(&self, args: &[&str]) -> Output {
        let child = self
            .ctr(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(child.wait_with_output()));
        match rx.recv_timeout(RUN_TIMEOUT) {
            Ok(out) => out.unwrap(),
            Err(_) => {
                // SAFETY: kill has no memory effects; pid is our child.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                panic!(
                    "ctr {args:?} did not end in {RUN_TIMEOUT:?}: {}",
                    self.log()
                );
            }
        }
    }

    /// The shims started for this containerd (their command lines name its socket).
    fn shims(&self) -> Vec<u32> {
        let want = format!("-address\0{}\0", self.sock.display());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                    let c = text(&c);
                    c.contains("containerd-shim-ember-v2") && c.contains(&want)
                })
            })
            .collect()
    }

    /// Builds a busybox image with umoci and imports it.
    fn import_image(&self) {
        let work = self.dir.join("image");
        let layout = work.join("oci");
        let bundle = work.join("bundle");
        std::fs::create_dir_all(&work).unwrap();
        let image = format!("{}:latest", layout.display());
        let umoci = |args: &[&str]| {
            let out = Command::new("umoci").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "umoci {args:?}: {}",
                text(&out.stderr)
            );
        };
        let (layout_s, bundle_s) = (layout.display().to_string(), bundle.display().to_string());
        umoci(&["init", "--layout", &layout_s]);
        umoci(&["new", "--image", &image]);
        umoci(&["unpack", "--image", &image, &bundle_s]);
        let rootfs = bundle.join("rootfs");
        for d in ["bin", "etc", "tmp"] {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        let busybox = ember::backend::find_binary("busybox").unwrap();
        std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
        for applet in ["sh", "cat", "uname"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        std::fs::write(rootfs.join("etc/message"), format!("{MESSAGE}\n")).unwrap();
        umoci(&["repack", "--image", &image, &bundle_s]);
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
        let out = self
            .ctr(&["images", "import", "--base-name"])
            .arg(IMAGE.trim_end_matches(":latest"))
            .arg(&tar)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ctr images import: {}",
            text(&out.stderr)
        );
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for shim in self.shims() {
            let t = tree(shim);
            // SAFETY: kill has no memory effects; these are this test's shims.
            unsafe { libc::kill(shim as i32, libc::SIGKILL) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while t.iter().any(|p| Path::new(&format!("/proc/{p}")).exists())
                && Instant::now() < deadline
            {
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
        let mut points = mounts_under(&self.dir);
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let c = std::ffi::CString::new(p).unwrap();
            // SAFETY: c is a NUL-terminated path alive for the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// The snapshots in ember's cache `dir`.
fn snapshots(cache: &Path) -> usize {
    std::fs::read_dir(cache.join("snapshots"))
        .map(|d| {
            d.flatten()
                .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                .count()
        })
        .unwrap_or(0)
}

#[test]
#[ignore = "the PVM test kernel has no cgroup v2, which the agent now needs for ctr's \
            default spec (2026-11-29 17:15: `mount cgroup2 on /sys/fs/cgroup: No such file or \
            directory`); the restore's memory faults were glibc's AVX memcpy, fixed in ember-init"]
fn ctr_run_restores_the_pod_vm_from_the_appliance_snapshot() {
    let test = "shim_pvm";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "{test}: containerd needs root");
    for tool in ["containerd", "ctr", "umoci", "busybox"] {
        assert!(
            ember::backend::find_binary(tool).is_some(),
            "{test}: `{tool}` is not installed (scripts/install-deps --test)"
        );
    }
    let init = init_binary().unwrap_or_else(|e| panic!("{test}: {e}"));
    let bin = build_shim();
    let scratch = Scratch::new(test);
    let cache = scratch.path("cache");
    let kernel = kdir.join("vmlinux");
    let release = release_of(&kernel);
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(release, host_release.trim());
    let c = Containerd::start(
        &scratch.path("containerd"),
        &bin,
        &[
            ("EMBER_SHIM_BACKEND", "ember".as_ref()),
            ("EMBER_SHIM_KERNEL", kernel.as_os_str()),
            ("EMBER_SHIM_CMDLINE", PVM_CMDLINE.as_ref()),
            ("EMBER_CACHE", cache.as_os_str()),
            ("EMBER_INIT", init.as_os_str()),
        ],
    );
    c.import_image();

    // The first makes the snapshot (the guest boots), the second restores it.
    for id in ["p1", "p2"] {
        let start = Instant::now();
        let out = c.run(&[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            IMAGE,
            id,
            "sh",
            "-c",
            "cat /etc/message; uname -r; exit 7",
        ]);
        eprintln!("{test}: ctr run {id} took {:?}", start.elapsed());
        let stdout = text(&out.stdout);
        let why = format!(
            "stdout {stdout:?} stderr {}\n{}",
            text(&out.stderr),
            c.log()
        );
        assert_eq!(out.status.code(), Some(7), "{why}");
        assert_eq!(stdout, format!("{MESSAGE}\n{release}\n"), "{why}");
        assert_eq!(c.shims(), Vec::<u32>::new(), "a shim outlived --rm");
        assert_eq!(
            snapshots(&cache),
            1,
            "{id}: the first makes the snapshot, the second restores it"
        );
    }
    // Nothing left behind: no VMM (a restore names the cache), mount or shim.
    let dir = scratch.path("");
    let needle = cache.display().to_string();
    assert_eq!(processes_naming(&needle), Vec::<String>::new());
    let mounts: Vec<String> = mounts_under(&dir)
        .into_iter()
        .filter(|m| !m.contains("/snapshots/"))
        .collect();
    assert_eq!(mounts, Vec::<String>::new(), "mounts left behind");
}
