//! `virtiofsd`, the daemon that serves a host directory to a VMM's
//! vhost-user-fs device (QEMU's `vhost-user-fs-pci`): found, started on a
//! socket ember made, and gone however ember ends.
//!
//! ember binds the socket, makes it its owner's only (0600, before it
//! listens: nobody else can connect in between) and hands the listening
//! descriptor to the daemon (`--fd`); the VMM connects to its path. The
//! daemon serves that one connection and exits when the VMM goes; ember
//! kills it when the run ends (a drop guard and [`crate::cleanup`] on a
//! fatal signal) and the kernel kills it when ember is SIGKILLed
//! (`PR_SET_PDEATHSIG`). The socket's path is only the rendezvous: the
//! caller removes it once the VMM is connected, and a killed ember's is
//! swept by the next run ([`crate::cleanup::sweep_dead`]).

use super::Share;
use crate::cleanup::{self, TempPath};
use ember_vmm::devices::virtio::fs::IdMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use thiserror::Error;

/// Where QEMU installs its own (C) daemon on Debian: used when the Rust
/// one is not installed.
const QEMU_VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";

/// virtiofsd errors.
#[derive(Debug, Error)]
pub enum VirtiofsdError {
    /// No daemon installed.
    #[error(
        "no virtiofsd (install it: `cargo install virtiofsd`, or QEMU's at {QEMU_VIRTIOFSD}; \
         or set EMBER_VIRTIOFSD)"
    )]
    NotFound,
    /// QEMU's C daemon needs root (its sandbox and credential switches).
    #[error("{0} (QEMU's virtiofsd) runs only as root: install the Rust virtiofsd")]
    NeedsRoot(PathBuf),
    /// The share's directory is not one.
    #[error("share `{tag}`: `{}` is not a directory", dir.display())]
    NotADirectory {
        /// The share's tag.
        tag: String,
        /// Its directory.
        dir: PathBuf,
    },
    /// Making its socket or starting it failed.
    #[error("virtiofsd for share `{tag}`: {what}")]
    Start {
        /// The share's tag.
        tag: String,
        /// What failed.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Which daemon: their options differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// The maintained Rust daemon (`cargo install virtiofsd`).
    Rust,
    /// QEMU's older C daemon.
    C,
}

/// An installed daemon.
#[derive(Debug, Clone)]
pub struct Virtiofsd {
    /// Its binary.
    pub binary: PathBuf,
    /// Which one it is.
    pub flavour: Flavour,
}

impl Virtiofsd {
    /// `$EMBER_VIRTIOFSD`, else the Rust daemon (cargo's bin directory, then
    /// PATH), else QEMU's; `Err` says why none will do.
    pub fn find() -> Result<Virtiofsd, VirtiofsdError> {
        let found = if let Some(p) = std::env::var_os("EMBER_VIRTIOFSD") {
            let p = PathBuf::from(p);
            super::is_executable(&p).then_some(p)
        } else {
            let cargo_bin = std::env::var_os("CARGO_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
                .map(|d| d.join("bin/virtiofsd"));
            cargo_bin
                .filter(|p| super::is_executable(p))
                .or_else(|| super::find_binary("virtiofsd"))
                .or_else(|| {
                    let q = Path::new(QEMU_VIRTIOFSD);
                    super::is_executable(q).then(|| q.to_path_buf())
                })
        };
        let binary = found.ok_or(VirtiofsdError::NotFound)?;
        let flavour = flavour_of(&binary);
        // SAFETY: geteuid has no preconditions.
        if flavour == Flavour::C && unsafe { libc::geteuid() } != 0 {
            return Err(VirtiofsdError::NeedsRoot(binary));
        }
        Ok(Virtiofsd { binary, flavour })
    }

    /// The command that serves `share` on the listening socket `fd`, as the
    /// process `marker` names (its argv[0], so `ps` and the tests see whose
    /// daemon it is).
    pub fn command(&self, share: &Share, fd: i32, marker: &str) -> Command {
        self.command_mapping(share, fd, marker, IdMap::of_process())
    }

    /// [`Self::command`] for a daemon whose ids the guest sees through
    /// `ids`: the map ember's own device uses, so the guest sees the same
    /// owners on both backends.
    fn command_mapping(&self, share: &Share, fd: i32, marker: &str, ids: IdMap) -> Command {
        let mut c = Command::new(&self.binary);
        {
            use std::os::unix::process::CommandExt;
            c.arg0(marker);
        }
        match self.flavour {
            Flavour::Rust => {
                c.arg("--shared-dir").arg(&share.dir);
                c.arg(format!("--fd={fd}"));
                // As root, a chroot into the directory is the whole
                // sandbox, in this one process; otherwise a user namespace.
                c.arg(if ids.caller().is_none() {
                    "--sandbox=chroot"
                } else {
                    "--sandbox=namespace"
                });
                // One file system in the guest: the host's mounts below
                // the directory are crossed, not announced as submounts
                // (an overlay over the share would not cross them).
                c.arg("--no-announce-submounts");
                if share.read_only {
                    // Nothing the guest does changes it: its entries and
                    // attributes are cached for good rather than asked
                    // for again every second (a FUSE round trip each, slow
                    // under TCG).
                    c.args(["--readonly", "--cache=always"]);
                }
                if let Some((uid, gid)) = ids.caller() {
                    // The guest's root is the caller: what it creates is
                    // the caller's on the host. The namespace maps no other
                    // host id, so the guest sees those as the overflow id.
                    c.arg(format!("--translate-uid=map:0:{uid}:1"));
                    c.arg(format!("--translate-gid=map:0:{gid}:1"));
                }
                // Keep the file-descriptor limit as it is (raising it
                // warns on stderr when the hard limit is lower).
                c.args(["--rlimit-nofile=0", "--log-level=error"]);
            }
            Flavour::C => {
                c.arg(format!("--fd={fd}"));
                c.arg("-o").arg(format!("source={}", share.dir.display()));
                c.args(["-o", "sandbox=chroot", "-o", "log_level=err"]);
            }
        }
        c
    }
}

/// The Rust daemon takes `--shared-dir`; QEMU's C one does not. Told by
/// its help text, which only the Rust one prints with `--shared-dir` in it;
/// a binary at QEMU's own path is QEMU's.
fn flavour_of(binary: &Path) -> Flavour {
    if binary == Path::new(QEMU_VIRTIOFSD) {
        return Flavour::C;
    }
    let mut probe = Command::new(binary);
    probe.arg("--help").stdin(Stdio::null());
    cleanup::dies_with_ember(&mut probe);
    match probe.output() {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("--shared-dir") => Flavour::Rust,
        _ => Flavour::C,
    }
}

/// A running daemon for one share, with its socket; killed and reaped when
/// dropped.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    /// Kills it on a fatal signal; dropped before it is reaped.
    kill: Option<cleanup::Entry>,
    socket: TempPath,
}

impl Daemon {
    /// The socket the VMM connects to.
    pub fn socket(&self) -> &Path {
        self.socket.path()
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Removes the socket's path (the VMM is connected: nothing else may).
    pub fn forget_socket(&self) {
        let _ = std::fs::remove_file(self.socket.path());
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        self.kill = None;
        let _ = self.child.wait();
    }
}

/// Starts `daemon` for `share` on a fresh socket `socket`.
pub fn start(daemon: &Virtiofsd, share: &Share, socket: PathBuf) -> Result<Daemon, VirtiofsdError> {
    if !share.dir.is_dir() {
        return Err(VirtiofsdError::NotADirectory {
            tag: share.tag.clone(),
            dir: share.dir.clone(),
        });
    }
    let err = |what: &str| {
        let (tag, what) = (share.tag.clone(), what.to_owned());
        move |source| VirtiofsdError::Start { tag, what, source }
    };
    let _ = std::fs::remove_file(&socket);
    let socket = TempPath::new(socket);
    let listener = listen_private(socket.path()).map_err(err("cannot make its socket"))?;
    let fd = listener.as_raw_fd();
    let marker = format!("ember-{}-virtiofsd", std::process::id());
    let mut cmd = daemon.command(share, fd, &marker);
    cmd.stdin(Stdio::null());
    cleanup::dies_with_ember(&mut cmd);
    cleanup::inherit(&mut cmd, vec![fd]);
    let child = cmd
        .spawn()
        .map_err(err(&format!("cannot run {}", daemon.binary.display())))?;
    let kill = libc::pid_t::try_from(child.id())
        .ok()
        .and_then(|pid| cleanup::register(cleanup::Undo::Kill(pid)).ok());
    // The daemon has its own copy of the listening socket.
    drop(listener);
    Ok(Daemon {
        child,
        kill,
        socket,
    })
}

/// A unix socket at `path` that only its owner can connect to: made 0600
/// between `bind` and `listen`, while a connection is still refused.
fn listen_private(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: socket makes a new descriptor, owned by the OwnedFd below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: addr is a valid sockaddr_un of `len` bytes; fd is ours.
    if unsafe { libc::bind(fd, (&raw const addr).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    // SAFETY: fd is ours, bound.
    if unsafe { libc::listen(fd, 1) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(UnixListener::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(dir: &str, ro: bool) -> Share {
        Share {
            tag: "t".into(),
            dir: dir.into(),
            read_only: ro,
            socket: None,
        }
    }

    #[test]
    fn the_rust_daemon_serves_read_only_and_confined() {
        let d = Virtiofsd {
            binary: "/v".into(),
            flavour: Flavour::Rust,
        };
        let c = d.command(&share("/srv", true), 7, "ember-1-virtiofsd");
        let args: Vec<_> = c.get_args().map(|a| a.to_string_lossy()).collect();
        let s = args.join(" ");
        assert!(s.starts_with("--shared-dir /srv --fd=7 --sandbox="), "{s}");
        assert!(s.contains("--readonly") && s.contains("--no-announce-submounts"));
        let rw = d.command(&share("/srv", false), 7, "m");
        assert!(!rw.get_args().any(|a| a == "--readonly"));
        // Its ids are those ember's own device shows the guest.
        let args = |ids| {
            let c = d.command_mapping(&share("/srv", false), 7, "m", ids);
            c.get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let user = args(IdMap::for_caller(1000, 100));
        assert!(user.contains("--sandbox=namespace"), "{user}");
        assert!(
            user.contains("--translate-uid=map:0:1000:1 --translate-gid=map:0:100:1"),
            "{user}"
        );
        let root = args(IdMap::Identity);
        assert!(root.contains("--sandbox=chroot"), "{root}");
        assert!(!root.contains("translate"), "{root}");
        let c = Virtiofsd {
            binary: QEMU_VIRTIOFSD.into(),
            flavour: Flavour::C,
        }
        .command(&share("/srv", false), 3, "m");
        let s: Vec<_> = c.get_args().map(|a| a.to_string_lossy()).collect();
        assert_eq!(
            s.join(" "),
            "--fd=3 -o source=/srv -o sandbox=chroot -o log_level=err"
        );
    }

    #[test]
    fn the_socket_is_its_owners_only_and_listening() {
        use std::os::unix::fs::PermissionsExt;
        let dir = ember_testing::TempDir::new("virtiofsd-sock");
        let path = dir.join("s.sock");
        let l = listen_private(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let _c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        l.accept().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_directory_is_refused_before_anything_starts() {
        let d = Virtiofsd {
            binary: "/nonexistent/virtiofsd".into(),
            flavour: Flavour::Rust,
        };
        let e = start(&d, &share("/nonexistent-ember-dir", true), "/tmp/x".into()).unwrap_err();
        assert!(e.to_string().contains("is not a directory"), "{e}");
    }
}
