//! What the container tests share: ember's companions built beside it,
//! the host's processes and mounts as `/proc` shows them, and a containerd
//! of the test's own with a busybox image imported.

use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// containerd's name for ember's shim.
pub const RUNTIME: &str = "io.containerd.ember.v2";
/// The content of `/etc/message` in the test images.
pub const MESSAGE: &str = "hello from the image";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Builds a busybox image with umoci in `work` (`applets` linked to
/// busybox, and [`MESSAGE`] in /etc/message): its OCI layout as a tar,
/// for `ctr images import`.
pub fn image_tar(work: &Path, applets: &[&str]) -> PathBuf {
    let layout = work.join("oci");
    let bundle = work.join("bundle");
    std::fs::create_dir_all(work).unwrap();
    let umoci = |args: &[&OsStr]| {
        let out = Command::new("umoci")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("umoci (scripts/install-deps --test): {e}"));
        assert!(
            out.status.success(),
            "umoci {args:?}: {}",
            text(&out.stderr)
        );
    };
    let tagged = format!("{}:latest", layout.display());
    let tagged = OsStr::new(&tagged);
    umoci(&["init".as_ref(), "--layout".as_ref(), layout.as_os_str()]);
    umoci(&["new".as_ref(), "--image".as_ref(), tagged]);
    umoci(&[
        "unpack".as_ref(),
        "--image".as_ref(),
        tagged,
        bundle.as_os_str(),
    ]);
    let rootfs = bundle.join("rootfs");
    for d in ["bin", "etc", "tmp"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    let busybox = ember::backend::find_binary("busybox").unwrap();
    std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
    for applet in applets {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(rootfs.join("etc/message"), format!("{MESSAGE}\n")).unwrap();
    umoci(&[
        "repack".as_ref(),
        "--image".as_ref(),
        tagged,
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
    tar
}

/// Builds `packages` (debug, beside the test's `ember`); their directory.
pub fn build_companions(packages: &[&str]) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut cargo = Command::new(env!("CARGO"));
    cargo.args(["build", "--quiet"]);
    for p in packages {
        cargo.args(["-p", p]);
    }
    let status = cargo.current_dir(&root).status().expect("run cargo");
    assert!(status.success(), "building {packages:?} failed");
    let ember = PathBuf::from(env!("CARGO_BIN_EXE_ember"));
    let dir = ember.parent().expect("ember's directory").to_path_buf();
    for b in packages {
        assert!(dir.join(b).is_file(), "{b} missing in {}", dir.display());
    }
    dir
}

/// The host's processes: (pid, parent pid, zombie).
fn processes() -> Vec<(u32, u32, bool)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let mut rest = stat.rsplit(')').next()?.split_whitespace();
            let zombie = rest.next()? == "Z";
            Some((p, rest.next()?.parse().ok()?, zombie))
        })
        .collect()
}

/// Every process below `pid` (and `pid`), by their parent links.
pub fn tree(pid: u32) -> Vec<u32> {
    let all = processes();
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(all.iter().filter(|p| p.1 == parent).map(|p| p.0));
        i += 1;
    }
    out
}

/// Those of `pids` still alive (zombies count as gone).
pub fn alive(pids: &[u32]) -> Vec<u32> {
    let living: Vec<u32> = processes()
        .into_iter()
        .filter(|p| !p.2)
        .map(|p| p.0)
        .collect();
    pids.iter()
        .copied()
        .filter(|p| living.contains(p))
        .collect()
}

/// Live processes whose command line mentions `needle`, but not this one:
/// (pid, command line).
pub fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    processes()
        .into_iter()
        .filter(|&(p, _, zombie)| p != me && !zombie)
        .filter_map(|(p, _, _)| {
            let cmd = text(&std::fs::read(format!("/proc/{p}/cmdline")).ok()?).replace('\0', " ");
            cmd.contains(needle).then_some((p, cmd))
        })
        .collect()
}

/// Mount points below `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&prefix))
        .map(str::to_owned)
        .collect()
}

/// A containerd of the test's own (CRI off), in `dir`: stopped, its shims
/// (and their VMs) killed and its mounts undone when dropped, however the
/// test ends.
pub struct Containerd {
    child: Child,
    sock: PathBuf,
    dir: PathBuf,
    /// The directory, when the test did not bring one.
    _own: Option<ember_testing::TempDir>,
}

impl Containerd {
    /// Starts containerd in `dir` (a new temporary directory if `None`),
    /// with `bin` first on its PATH (where the shim is) and `env` set.
    pub fn start(dir: Option<&Path>, bin: &Path, env: &[(&str, &OsStr)]) -> Containerd {
        let own = dir
            .is_none()
            .then(|| ember_testing::TempDir::new("containerd"));
        let dir = match (&own, dir) {
            (Some(t), _) => t.to_path_buf(),
            (None, Some(d)) => d.to_path_buf(),
            (None, None) => unreachable!(),
        };
        std::fs::create_dir_all(&dir).unwrap();
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
            dir,
            _own: own,
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

    /// Its directory (root, state, socket and log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its socket.
    pub fn sock(&self) -> &Path {
        &self.sock
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// `ctr ARGS…` against it.
    pub fn ctr(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address").arg(&self.sock).args(args);
        c
    }

    /// Runs ctr to its end with `stdin` as its input; killed, failing the
    /// test, after `limit`.
    pub fn run(&self, args: &[&str], stdin: &[u8], limit: Duration) -> Output {
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
        match rx.recv_timeout(limit) {
            Ok(out) => out.unwrap(),
            Err(_) => {
                // SAFETY: kill has no memory effects; pid is our child.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                panic!("ctr {args:?} did not end in {limit:?}: {}", self.log());
            }
        }
    }

    /// ember's shims started for this containerd whose command line holds
    /// `also` (their command lines name its socket).
    fn shims_with(&self, also: &str) -> Vec<u32> {
        let want = format!("-address {} ", self.sock.display());
        processes_mentioning("containerd-shim-ember-v2")
            .into_iter()
            .filter(|(_, c)| c.contains(&want) && c.contains(also))
            .map(|(p, _)| p)
            .collect()
    }

    /// Every shim started for this containerd.
    pub fn shims(&self) -> Vec<u32> {
        self.shims_with("")
    }

    /// The shim serving container `id`, if one runs.
    pub fn shim(&self, id: &str) -> Option<u32> {
        self.shims_with(&format!("-id {id} ")).first().copied()
    }

    /// Builds a busybox image with umoci (`applets` linked to busybox, and
    /// [`MESSAGE`] in /etc/message) and imports it as `image`.
    pub fn import_image(&self, image: &str, applets: &[&str]) {
        let tar = image_tar(&self.dir.join("image"), applets);
        let out = self
            .ctr(&["images", "import", "--base-name"])
            .arg(image.trim_end_matches(":latest"))
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
        // Shims outlive containerd by design: each, with its VM, goes here.
        for shim in self.shims() {
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
        let mut points = mounts_under(&self.dir);
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let c = std::ffi::CString::new(p).unwrap();
            // SAFETY: c is a NUL-terminated path alive for the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}
