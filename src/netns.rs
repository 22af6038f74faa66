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
//! The tap is not persistent: it goes with the last process holding it (the
//! VMM), its own filter with it. The interface's ingress filter is removed
//! when the run ends; after a SIGKILL of ember it stays, redirecting to a
//! tap that is gone, until the namespace is deleted (CNI's DEL does that).

use crate::passt::{self, GuestNet, PasstError};
use crate::tool::ToolError;
use ember_vmm::devices::virtio::net::{self as vnet, MacAddr};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
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
    /// `ip` or `tc` failed.
    #[error("--netns: {0}")]
    Tool(#[from] ToolError),
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
    /// The namespace's interface.
    ifname: String,
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
    let ifname = guest.ifname.clone();
    let (mac, mtu) = mac_and_mtu(&ifname)?;
    guest.mtu = u32::from(mtu);
    let tap = vnet::create_tap(TAP).map_err(NetnsError::Tap)?;
    let pod = PodNet {
        guest,
        mac,
        mtu,
        tap,
        ifname,
    };
    let mtu = mtu.to_string();
    tool("ip", &["link", "set", "dev", TAP, "mtu", &mtu, "up"])?;
    for (from, to) in [(pod.ifname.as_str(), TAP), (TAP, pod.ifname.as_str())] {
        tool("tc", &["qdisc", "add", "dev", from, "ingress"])?;
        tool(
            "tc",
            &[
                "filter", "add", "dev", from, "parent", "ffff:", "protocol", "all", "u32", "match",
                "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", to,
            ],
        )?;
    }
    Ok(pod)
}

impl Drop for PodNet {
    /// The interface's filter goes (the tap's goes with the tap).
    fn drop(&mut self) {
        let _ = tool("tc", &["qdisc", "del", "dev", &self.ifname, "ingress"]);
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

/// Runs `prog args…` (iproute2).
fn tool(prog: &str, args: &[&str]) -> Result<(), NetnsError> {
    crate::tool::run(Command::new(prog).args(args))?;
    Ok(())
}
