//! `ember run --netns PATH`: the guest on a network namespace's interface,
//! the way Kata Containers joins a pod's CNI-made interface to its VM.
//!
//! ember enters the namespace — the whole process, before it starts any
//! thread or child, so the VMM and every helper run there — makes a tap
//! beside the namespace's interface, and ties the two together with tc:
//! each one's ingress redirected to the other's egress (`mirred`). The
//! guest's virtio-net gets the interface's MAC and MTU, and the guest is
//! configured with its addresses and default routes: to everything outside,
//! the namespace's interface *is* the guest.
//!
//! All in-process: the tap made with TUNSETIFF, its MTU and up flag, the
//! two ingress qdiscs and their mirred filters set over rtnetlink
//! ([`crate::rtnl`]). No `ip` or `tc` process: their five spawns were the
//! largest part of a container's start on a loaded host.
//!
//! The tap is not persistent: it goes with the last process holding it (the
//! VMM), its own filter with it. The interface's ingress qdisc (its filter
//! with it) is removed when the run ends, and on a fatal signal by the
//! cleanup handler ([`crate::cleanup::Undo::Rtnetlink`]). After a SIGKILL of
//! ember it stays, redirecting to a tap that is gone, until the namespace is
//! deleted (CNI's DEL does that); a later run in that namespace is refused
//! (the qdisc exists) rather than take over a qdisc it cannot tell from
//! another tool's.

use crate::cleanup::{self, Undo};
use crate::passt::{self, GuestNet, PasstError};
use crate::rtnl::{self, Request, Rtnl, RtnlError};
use ember_vmm::devices::virtio::net::{self as vnet, MacAddr};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The tap's name in the namespace (as Kata's `tap0_kata`).
pub const TAP: &str = "tap0_ember";

/// Errors joining a namespace's interface.
#[derive(Debug, Error)]
pub enum NetnsError {
    /// The namespace file cannot be opened.
    #[error("--netns {}: cannot open it", .0.display())]
    Open(PathBuf, #[source] std::io::Error),
    /// setns refused (not a network namespace, or no CAP_SYS_ADMIN).
    #[error("--netns {}: cannot enter it (a network namespace file, and root, are needed)", .0.display())]
    Enter(PathBuf, #[source] std::io::Error),
    /// Nothing to join.
    #[error("--netns {}: no interface with a default route and an address", .0.display())]
    NoInterface(PathBuf),
    /// The interface's MAC or MTU cannot be read.
    #[error("--netns: cannot read {what} of `{ifname}`")]
    Interface {
        /// The interface.
        ifname: String,
        /// What could not be read.
        what: &'static str,
    },
    /// The tap cannot be made.
    #[error("--netns: cannot make tap `{TAP}`")]
    Tap(#[source] vnet::Error),
    /// The addresses cannot be read.
    #[error("--netns: {0}")]
    Config(#[source] PasstError),
    /// An rtnetlink request (the tap's MTU and up flag, a qdisc, a filter)
    /// failed.
    #[error("--netns")]
    Rtnl(#[from] RtnlError),
}

/// A namespace's interface joined to a tap for the guest.
#[derive(Debug)]
pub struct PodNet {
    /// The guest's configuration: the interface's addresses, routes, MTU.
    pub guest: GuestNet,
    /// The interface's MAC, which the guest's device takes.
    pub mac: MacAddr,
    /// The interface's MTU.
    pub mtu: u16,
    /// The tap (the VMM takes it as `fd=N`).
    pub tap: File,
    /// The redirects, undone when dropped.
    _tie: Tie,
}

/// Enters the network namespace at `path` (this thread: call it before
/// ember starts threads or children, which then inherit it) and joins its
/// interface to a new tap.
pub fn join(path: &Path) -> Result<PodNet, NetnsError> {
    let ns = File::open(path).map_err(|e| NetnsError::Open(path.to_owned(), e))?;
    // SAFETY: setns takes a descriptor this function owns and a flag.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(NetnsError::Enter(
            path.to_owned(),
            std::io::Error::last_os_error(),
        ));
    }
    let mut guest = GuestNet::from_host().map_err(|e| match e {
        PasstError::NoRoute => NetnsError::NoInterface(path.to_owned()),
        e => NetnsError::Config(e),
    })?;
    let (mac, mtu) = mac_and_mtu(&guest.ifname)?;
    guest.mtu = u32::from(mtu);
    let (tap, tie) = tie(&guest.ifname, mtu)?;
    Ok(PodNet {
        guest,
        mac,
        mtu,
        tap,
        _tie: tie,
    })
}

/// The interface's side of the redirects: its ingress qdisc, removed when
/// dropped (the tap's side goes with the tap).
#[derive(Debug)]
struct Tie {
    /// The namespace's interface.
    ifname: String,
    /// Its index.
    index: u32,
    /// The socket it is removed through.
    rtnl: Rtnl,
    /// The removal, registered for a fatal signal.
    undo: Option<cleanup::Entry>,
}

/// Makes tap [`TAP`] (MTU `mtu`, up) in this thread's namespace and ties it
/// to interface `ifname` both ways: each one's ingress redirected to the
/// other's egress.
fn tie(ifname: &str, mtu: u16) -> Result<(File, Tie), NetnsError> {
    let tap = vnet::create_tap(TAP).map_err(NetnsError::Tap)?;
    let mut rtnl = Rtnl::open()?;
    let (index, tap_index) = (rtnl::index(ifname)?, rtnl::index(TAP)?);
    rtnl.ask(&Request::link_up(TAP, tap_index, u32::from(mtu)))?;
    add_ingress_over_stale(&mut rtnl, ifname, index)?;
    let mut tie = Tie {
        ifname: ifname.to_owned(),
        index,
        rtnl,
        undo: None,
    };
    // On a socket of its own, opened here: the handler may run on a thread
    // in another namespace, and the socket keeps the one it was opened in.
    let remove = Request::del_ingress(ifname, index).bytes(0);
    let undo = match rtnl::socket() {
        Ok(fd) => cleanup::register(Undo::Rtnetlink(fd, remove.into())).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    tie.undo = undo
        .inspect_err(|e| log::warn!("--netns: `{ifname}`'s filter stays if ember is killed: {e}"))
        .ok();
    tie.rtnl.ask(&Request::redirect(ifname, index, tap_index))?;
    tie.rtnl.ask(&Request::add_ingress(TAP, tap_index))?;
    tie.rtnl.ask(&Request::redirect(TAP, tap_index, index))?;
    Ok((tap, tie))
}

/// Adds `ifname`'s ingress qdisc. One already there is the one an earlier
/// ember left when it was killed (SIGKILL runs no cleanup): its filter
/// redirects to a tap that went with that process. The namespace's interface
/// is the VM's alone, so it is replaced rather than refusing every later run.
fn add_ingress_over_stale(rtnl: &mut Rtnl, ifname: &str, index: u32) -> Result<(), NetnsError> {
    match rtnl.ask(&Request::add_ingress(ifname, index)) {
        Err(e) if e.errno() == Some(libc::EEXIST) => {
            log::warn!(
                "--netns: replacing the ingress qdisc left on `{ifname}` (by a VM that was killed?)"
            );
            rtnl.ask(&Request::del_ingress(ifname, index))?;
            Ok(rtnl.ask(&Request::add_ingress(ifname, index))?)
        }
        r => Ok(r?),
    }
}

impl Drop for Tie {
    fn drop(&mut self) {
        // Unregistered first: the handler then has nothing to race with.
        self.undo = None;
        if let Err(e) = self
            .rtnl
            .ask(&Request::del_ingress(&self.ifname, self.index))
        {
            // The interface may be gone with its namespace.
            log::debug!("--netns: {}", ember_vmm::error_chain(&e));
        }
    }
}

/// Interface `ifname`'s MAC and MTU.
fn mac_and_mtu(ifname: &str) -> Result<(MacAddr, u16), NetnsError> {
    let bad = |what| NetnsError::Interface {
        ifname: ifname.to_owned(),
        what,
    };
    let req = passt::interface_request(ifname, libc::SIOCGIFHWADDR as libc::Ioctl)
        .ok_or_else(|| bad("the MAC address"))?;
    // SAFETY: SIOCGIFHWADDR fills the union's hardware-address sockaddr.
    let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    let mac = MacAddr(std::array::from_fn(|i| data[i] as u8));
    let req = passt::interface_request(ifname, libc::SIOCGIFMTU as libc::Ioctl)
        .ok_or_else(|| bad("the MTU"))?;
    // SAFETY: SIOCGIFMTU fills the union's mtu member.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    let mtu = u16::try_from(mtu).map_err(|_| bad("a usable MTU"))?;
    Ok((mac, mtu))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A network namespace made for a test, with a veth pair (`eth0` and
    /// `peer0`) in it, deleted when dropped.
    struct TestNs(String);

    impl TestNs {
        /// The namespace, or `None` (a loud skip) where this user cannot
        /// make one.
        fn new(tag: &str) -> Option<TestNs> {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                ember_testing::skip(tag, "network namespaces need root");
                return None;
            }
            let ns = TestNs(format!("ember-rtnl-{tag}-{}", std::process::id()));
            run("ip", &["netns", "add", &ns.0]);
            ns.ip(&[
                "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
            ]);
            ns.ip(&["link", "set", "eth0", "up"]);
            Some(ns)
        }

        /// `ip -n NS ARGS…`'s output.
        fn ip(&self, args: &[&str]) -> String {
            run("ip", &[&["-n", &self.0], args].concat())
        }

        /// `tc -n NS ARGS…`'s output.
        fn tc(&self, args: &[&str]) -> String {
            run("tc", &[&["-n", &self.0], args].concat())
        }

        /// Moves this thread into the namespace (for good: run it in a
        /// thread of its own).
        fn enter(&self) {
            let f = File::open(format!("/run/netns/{}", self.0)).unwrap();
            // SAFETY: setns takes a live descriptor and a flag.
            let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        }
    }

    impl Drop for TestNs {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
        }
    }

    /// Runs a tool the test needs (root, iproute2): its output; failing
    /// loudly if it cannot.
    fn run(prog: &str, args: &[&str]) -> String {
        let out = Command::new(prog)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{prog} (iproute2, and root, are needed): {e}"));
        assert!(
            out.status.success(),
            "{prog} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// In a thread of its own, moved into `ns`.
    fn inside(ns: &TestNs, f: impl FnOnce() + Send) {
        std::thread::scope(|s| {
            s.spawn(move || {
                ns.enter();
                f()
            })
            .join()
            .unwrap()
        });
    }

    fn assert_untied(ns: &TestNs) {
        let qdiscs = ns.tc(&["qdisc", "show", "dev", "eth0"]);
        assert!(
            !qdiscs.contains("ingress"),
            "a qdisc left on eth0:\n{qdiscs}"
        );
        let links = ns.ip(&["-o", "link"]);
        assert!(!links.contains(TAP), "a tap left:\n{links}");
    }

    /// The tap and both redirects, as `tc` lists them; nothing left once
    /// dropped.
    #[test]
    fn the_tap_is_tied_both_ways_and_untied_on_drop() {
        let Some(ns) = TestNs::new("tie") else {
            return;
        };
        inside(&ns, || {
            let (tap, tie) =
                tie("eth0", 1400).unwrap_or_else(|e| panic!("{}", ember_vmm::error_chain(&e)));
            for (dev, to) in [("eth0", TAP), (TAP, "eth0")] {
                let f = ns.tc(&["filter", "show", "dev", dev, "ingress"]);
                for want in [
                    "filter parent ffff: protocol all pref 49152 u32".to_owned(),
                    "match 00000000/00000000 at 0".to_owned(),
                    format!("mirred (Egress Redirect to device {to}) stolen"),
                ] {
                    assert!(f.contains(&want), "{want:?} missing on {dev}:\n{f}");
                }
            }
            let link = ns.ip(&["-o", "link", "show", TAP]);
            assert!(link.contains(",UP") && link.contains("mtu 1400"), "{link}");
            drop(tie);
            drop(tap);
        });
        assert_untied(&ns);
    }

    /// A fatal signal takes the interface's qdisc with it (the tap goes with
    /// the process).
    #[test]
    fn a_fatal_signal_removes_the_interfaces_qdisc() {
        let Some(ns) = TestNs::new("sig") else {
            return;
        };
        inside(&ns, || {
            let (tap, tie) =
                tie("eth0", 1500).unwrap_or_else(|e| panic!("{}", ember_vmm::error_chain(&e)));
            let entry = tie.undo.as_ref().expect("the removal is registered");
            assert!(ns.tc(&["qdisc", "show", "dev", "eth0"]).contains("ingress"));
            // SAFETY: the child only makes async-signal-safe calls (the
            // handler's), and ends.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork");
            if pid == 0 {
                cleanup::forget_all_but(entry);
                // SAFETY: signals this process; _exit if it survives.
                unsafe {
                    libc::raise(libc::SIGTERM);
                    libc::_exit(0);
                }
            }
            let mut status = 0;
            // SAFETY: waits for our own child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGTERM,
                "status {status:#x}"
            );
            // Gone while this process still holds everything.
            let qdiscs = ns.tc(&["qdisc", "show", "dev", "eth0"]);
            assert!(!qdiscs.contains("ingress"), "{qdiscs}");
            drop(tie);
            drop(tap);
        });
        assert_untied(&ns);
    }

    /// What a SIGKILLed run leaves (the interface's ingress qdisc and its
    /// redirect to a tap now gone) does not refuse the next run.
    #[test]
    fn a_killed_runs_leftover_qdisc_is_replaced() {
        let Some(ns) = TestNs::new("stale") else {
            return;
        };
        // As a killed run leaves it: the redirect's tap is gone.
        ns.ip(&["tuntap", "add", "old0", "mode", "tap"]);
        ns.tc(&["qdisc", "add", "dev", "eth0", "ingress"]);
        ns.tc(&[
            "filter", "add", "dev", "eth0", "parent", "ffff:", "protocol", "all", "u32", "match",
            "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "old0",
        ]);
        ns.ip(&["link", "del", "old0"]);
        inside(&ns, || {
            let (tap, tie) =
                tie("eth0", 1500).unwrap_or_else(|e| panic!("{}", ember_vmm::error_chain(&e)));
            let f = ns.tc(&["filter", "show", "dev", "eth0", "ingress"]);
            assert!(
                f.contains(&format!("Egress Redirect to device {TAP}")),
                "{f}"
            );
            assert_eq!(
                f.matches("Egress Redirect").count(),
                1,
                "the old filter stayed:\n{f}"
            );
            drop(tie);
            drop(tap);
        });
        assert_untied(&ns);
    }

    /// Without CAP_NET_ADMIN, the refusal names the link and the request.
    #[test]
    fn a_refusal_names_the_link_and_what_was_asked() {
        let Some(ns) = TestNs::new("perm") else {
            return;
        };
        inside(&ns, || {
            let index = rtnl::index("eth0").unwrap();
            // This thread only (the raw call, not libc's, which would
            // change every thread): nobody, without capabilities.
            // SAFETY: setresuid on the calling thread.
            let rc = unsafe { libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534) };
            assert_eq!(rc, 0);
            let e = Rtnl::open()
                .and_then(|mut r| r.ask(&Request::add_ingress("eth0", index)))
                .unwrap_err();
            assert_eq!(
                e.to_string(),
                "cannot add an ingress qdisc on `eth0`: not permitted (CAP_NET_ADMIN in its namespace is needed)"
            );
        });
        let qdiscs = ns.tc(&["qdisc", "show", "dev", "eth0"]);
        assert!(!qdiscs.contains("ingress"), "{qdiscs}");
    }
}
