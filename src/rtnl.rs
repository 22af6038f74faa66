//! The few rtnetlink requests `ember run --netns` makes, in-process: a
//! link's MTU and up flag, an ingress qdisc, a u32 filter whose mirred
//! action redirects everything to another link's egress, and the qdisc's
//! removal — what `ip link set` and `tc qdisc|filter add|del` would do, with
//! no process to spawn (each spawn cost the container's start 2–40 ms on a
//! loaded host).
//!
//! The messages are built with `netlink-packet-route`; the socket is a plain
//! synchronous `NETLINK_ROUTE` one, each request acknowledged before the
//! next is sent, so an error names the request and the link it was about.

use netlink_packet_core::{Emitable, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use netlink_packet_route::tc::{
    TcAction, TcActionAttribute, TcActionGeneric, TcActionMirrorOption, TcActionOption,
    TcActionType, TcAttribute, TcFilterU32Option, TcHandle, TcMessage, TcMirror,
    TcMirrorActionType, TcOption, TcU32Key, TcU32Selector, TcU32SelectorFlags,
};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use thiserror::Error;

/// The ingress qdisc's handle, `ffff:` (its filters' parent).
const INGRESS_HANDLE: TcHandle = TcHandle {
    major: 0xffff,
    minor: 0,
};

/// `ETH_P_ALL` in network order, the filter's protocol (`protocol all`).
const ALL_PROTOCOLS: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Room for a reply: an acknowledgement (capped, with the kernel's
/// extended message) fits many times over.
const REPLY_BUF: usize = 4096;

/// Errors of rtnetlink requests.
#[derive(Debug, Error)]
pub enum RtnlError {
    /// No rtnetlink socket.
    #[error("cannot open an rtnetlink socket")]
    Socket(#[source] io::Error),
    /// No such interface.
    #[error("no interface `{0}`")]
    NoLink(String),
    /// The kernel refused for want of privilege.
    #[error("cannot {what} on `{link}`: not permitted (CAP_NET_ADMIN in its namespace is needed)")]
    Permission {
        /// What was asked.
        what: &'static str,
        /// The interface.
        link: String,
    },
    /// The kernel refused the request, or it could not be sent or answered.
    #[error("cannot {what} on `{link}`{}", detail(.why))]
    Request {
        /// What was asked.
        what: &'static str,
        /// The interface.
        link: String,
        /// The kernel's error number (or the socket's).
        #[source]
        source: io::Error,
        /// The kernel's own words (extended acknowledgement), if any.
        why: Option<String>,
    },
}

fn detail(why: &Option<String>) -> String {
    why.as_ref()
        .map_or_else(String::new, |w| format!(" (the kernel: {w})"))
}

impl RtnlError {
    /// The kernel's error number, if the kernel answered with one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RtnlError::Request { source, .. } => source.raw_os_error(),
            RtnlError::Permission { .. } => Some(libc::EPERM),
            _ => None,
        }
    }
}

/// One request: what it does (for messages), the link it is about, and the
/// message itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    what: &'static str,
    link: String,
    msg: Msg,
    flags: u16,
}

/// A request's body, and for tc the message type.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Msg {
    Link(LinkMessage),
    Tc(u16, TcMessage),
}

impl Request {
    /// `ip link set dev LINK mtu MTU up`.
    pub fn link_up(link: &str, index: u32, mtu: u32) -> Request {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        m.attributes.push(LinkAttribute::Mtu(mtu));
        Request::new("set the MTU and bring it up", link, Msg::Link(m), 0)
    }

    /// `tc qdisc add dev LINK ingress`.
    pub fn add_ingress(link: &str, index: u32) -> Request {
        Request::new(
            "add an ingress qdisc",
            link,
            Msg::Tc(libc::RTM_NEWQDISC, ingress(index)),
            NLM_F_CREATE | NLM_F_EXCL,
        )
    }

    /// `tc qdisc del dev LINK ingress` (its filters go with it).
    pub fn del_ingress(link: &str, index: u32) -> Request {
        Request::new(
            "remove the ingress qdisc",
            link,
            Msg::Tc(libc::RTM_DELQDISC, ingress(index)),
            0,
        )
    }

    /// `tc filter add dev LINK parent ffff: protocol all u32 match u32 0 0
    /// action mirred egress redirect dev TO`: all of LINK's ingress to the
    /// egress of the link with index `to`.
    pub fn redirect(link: &str, index: u32, to: u32) -> Request {
        let mut m = TcMessage::with_index(index_i32(index));
        m.header.parent = INGRESS_HANDLE;
        // Priority 0: the kernel picks one (49152, as for tc).
        m.header.info = u32::from(ALL_PROTOCOLS);
        let mut sel = TcU32Selector::default();
        // Terminal: a match ends the lookup (tc sets it when a filter has
        // an action). One key matching anything: mask 0 at offset 0.
        sel.flags = TcU32SelectorFlags::Terminal;
        sel.nkeys = 1;
        sel.keys = vec![TcU32Key::default()];
        let mut generic = TcActionGeneric::default();
        // The packet leaves this pipeline for TO's.
        generic.action = TcActionType::Stolen;
        let mut mirror = TcMirror::default();
        mirror.generic = generic;
        mirror.eaction = TcMirrorActionType::EgressRedir;
        mirror.ifindex = to;
        let mut action = TcAction::default();
        action.attributes = vec![
            TcActionAttribute::Kind("mirred".into()),
            TcActionAttribute::Options(vec![TcActionOption::Mirror(TcActionMirrorOption::Parms(
                mirror,
            ))]),
        ];
        m.attributes = vec![
            TcAttribute::Kind("u32".into()),
            TcAttribute::Options(vec![
                TcOption::U32(TcFilterU32Option::Selector(sel)),
                TcOption::U32(TcFilterU32Option::Action(vec![action])),
            ]),
        ];
        Request::new(
            "add the redirect filter",
            link,
            Msg::Tc(libc::RTM_NEWTFILTER, m),
            NLM_F_CREATE | NLM_F_EXCL,
        )
    }

    fn new(what: &'static str, link: &str, msg: Msg, flags: u16) -> Request {
        Request {
            what,
            link: link.to_owned(),
            msg,
            flags,
        }
    }

    /// The message's bytes, with sequence number `seq`.
    pub fn bytes(&self, seq: u32) -> Vec<u8> {
        // The header by hand, the body by the crate: emitting through its
        // RouteNetlinkMessage would link in every message kind's code
        // (150 KB of text).
        let (kind, len) = match &self.msg {
            Msg::Link(m) => (libc::RTM_SETLINK, m.buffer_len()),
            Msg::Tc(kind, m) => (*kind, m.buffer_len()),
        };
        let total = NLMSG_HDR + len;
        let mut buf = vec![0; total];
        buf[0..4].copy_from_slice(&(total as u32).to_ne_bytes());
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        buf[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_ACK | self.flags).to_ne_bytes());
        buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        match &self.msg {
            Msg::Link(m) => m.emit(&mut buf[NLMSG_HDR..]),
            Msg::Tc(_, m) => m.emit(&mut buf[NLMSG_HDR..]),
        }
        buf
    }
}

/// The ingress qdisc of link `index`.
fn ingress(index: u32) -> TcMessage {
    let mut m = TcMessage::with_index(index_i32(index));
    m.header.parent = TcHandle::INGRESS;
    m.header.handle = INGRESS_HANDLE;
    m.attributes.push(TcAttribute::Kind("ingress".into()));
    m
}

fn index_i32(index: u32) -> i32 {
    // Interface indices are positive ints in the kernel.
    i32::try_from(index).unwrap_or(i32::MAX)
}

/// Link `name`'s index.
pub fn index(name: &str) -> Result<u32, RtnlError> {
    let c = std::ffi::CString::new(name).map_err(|_| RtnlError::NoLink(name.to_owned()))?;
    // SAFETY: a NUL-terminated string the call only reads.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(RtnlError::NoLink(name.to_owned())),
        i => Ok(i),
    }
}

/// An rtnetlink socket in this thread's network namespace.
#[derive(Debug)]
pub struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

impl Rtnl {
    /// Opens one.
    pub fn open() -> Result<Rtnl, RtnlError> {
        let fd = socket()?;
        // Acknowledgements without the request copied back, and with the
        // kernel's own words on a refusal. Both are hints: older kernels
        // lack them, and the numbers alone still say what failed.
        for opt in [libc::NETLINK_CAP_ACK, libc::NETLINK_EXT_ACK] {
            let on: libc::c_int = 1;
            // SAFETY: setsockopt reads an int from a live local.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_NETLINK,
                    opt,
                    (&on as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
        Ok(Rtnl { fd, seq: 0 })
    }

    /// Sends `req` and waits for its acknowledgement.
    pub fn ask(&mut self, req: &Request) -> Result<(), RtnlError> {
        self.seq = self.seq.wrapping_add(1);
        let fail = |source: io::Error, why| RtnlError::Request {
            what: req.what,
            link: req.link.clone(),
            source,
            why,
        };
        send(self.fd.as_raw_fd(), &req.bytes(self.seq)).map_err(|e| fail(e, None))?;
        let mut buf = [0u8; REPLY_BUF];
        loop {
            // SAFETY: recv writes at most `buf.len()` bytes into `buf`.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(fail(e, None));
            }
            match ack(&buf[..n as usize], self.seq) {
                // Not ours (a late answer to an earlier request): next.
                None => continue,
                Some(Ok(())) => return Ok(()),
                Some(Err((errno, _))) if errno == libc::EPERM => {
                    return Err(RtnlError::Permission {
                        what: req.what,
                        link: req.link.clone(),
                    });
                }
                Some(Err((errno, why))) => {
                    return Err(fail(io::Error::from_raw_os_error(errno), why));
                }
            }
        }
    }
}

/// A `NETLINK_ROUTE` socket in this thread's network namespace (which it
/// keeps, whichever thread uses it).
pub fn socket() -> Result<OwnedFd, RtnlError> {
    // SAFETY: plain socket(2); the descriptor is checked and owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(RtnlError::Socket(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `msg` to the kernel on `fd`. Async-signal-safe (no allocation).
pub fn send(fd: libc::c_int, msg: &[u8]) -> io::Result<()> {
    // SAFETY: a zeroed sockaddr_nl is valid; the family makes it the kernel's.
    let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: sendto reads `msg` and the address, both live.
    let n = unsafe {
        libc::sendto(
            fd,
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&to as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize != msg.len() => Err(io::Error::from(io::ErrorKind::WriteZero)),
        _ => Ok(()),
    }
}

/// The acknowledgement of request `seq` in datagram `buf`: `None` if it
/// holds none, else `Ok` or the error number and the kernel's message.
fn ack(buf: &[u8], seq: u32) -> Option<Result<(), (i32, Option<String>)>> {
    let mut rest = buf;
    while rest.len() >= NLMSG_HDR {
        let len = u32_at(rest, 0) as usize;
        if len < NLMSG_HDR || len > rest.len() {
            return None;
        }
        let (msg, next) = rest.split_at(align(len).min(rest.len()));
        rest = next;
        let kind = u16::from_ne_bytes([msg[4], msg[5]]);
        let flags = u16::from_ne_bytes([msg[6], msg[7]]);
        if kind != libc::NLMSG_ERROR as u16 || u32_at(msg, 8) != seq || len < NLMSG_HDR + 4 {
            continue;
        }
        let code = u32_at(msg, NLMSG_HDR) as i32;
        if code == 0 {
            return Some(Ok(()));
        }
        return Some(Err((-code, ext_ack_message(&msg[..len], flags))));
    }
    None
}

const NLMSG_HDR: usize = 16;
/// `NLM_F_CAPPED`: the request is not copied back, only its header.
const NLM_F_CAPPED: u16 = 0x100;
/// `NLM_F_ACK_TLVS`: attributes follow (the extended acknowledgement).
const NLM_F_ACK_TLVS: u16 = 0x200;
/// `NLMSGERR_ATTR_MSG`: the kernel's message, a C string.
const NLMSGERR_ATTR_MSG: u16 = 1;

/// The kernel's message in an error reply `msg` (flags `flags`), if it
/// gave one.
fn ext_ack_message(msg: &[u8], flags: u16) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 || msg.len() < 2 * NLMSG_HDR + 4 {
        return None;
    }
    // The error number, then the request's header (and its payload, unless
    // capped), then the attributes.
    let request = if flags & NLM_F_CAPPED != 0 {
        NLMSG_HDR
    } else {
        align(u32_at(msg, NLMSG_HDR + 4) as usize)
    };
    let mut at = NLMSG_HDR + 4 + request;
    while at + 4 <= msg.len() {
        let len = usize::from(u16::from_ne_bytes([msg[at], msg[at + 1]]));
        let kind = u16::from_ne_bytes([msg[at + 2], msg[at + 3]]) & 0x3fff;
        if len < 4 || at + len > msg.len() {
            return None;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let text = &msg[at + 4..at + len];
            let text = text.split(|&b| b == 0).next().unwrap_or_default();
            return Some(String::from_utf8_lossy(text).into_owned());
        }
        at += align(len);
    }
    None
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn align(len: usize) -> usize {
    (len + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The attributes in `b`: (type, payload).
    fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
        let mut out = Vec::new();
        while b.len() >= 4 {
            let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
            let kind = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
            out.push((kind, &b[4..len]));
            b = &b[align(len).min(b.len())..];
        }
        out
    }

    fn attr(b: &[u8], kind: u16) -> &[u8] {
        attrs(b)
            .into_iter()
            .find(|(k, _)| *k == kind)
            .unwrap_or_else(|| panic!("no attribute {kind} in {b:?}"))
            .1
    }

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_ne_bytes([b[at], b[at + 1]])
    }

    /// The netlink header's type, flags and sequence number, and the rest.
    fn split(m: &[u8]) -> (u16, u16, u32, &[u8]) {
        assert_eq!(u32_at(m, 0) as usize, m.len());
        (u16_at(m, 4), u16_at(m, 6), u32_at(m, 8), &m[NLMSG_HDR..])
    }

    const NEW: u16 = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;

    /// The filter is what `tc filter add dev X parent ffff: protocol all
    /// u32 match u32 0 0 action mirred egress redirect dev Y` sends.
    #[test]
    fn the_redirect_is_tcs_u32_filter_with_a_mirred_egress_redirect() {
        let m = Request::redirect("eth0", 5, 9).bytes(7);
        let (kind, flags, seq, tcm) = split(&m);
        assert_eq!((kind, flags, seq), (libc::RTM_NEWTFILTER, NEW, 7));
        // struct tcmsg: family, pads, ifindex, handle, parent, info.
        assert_eq!(u32_at(tcm, 4), 5, "ifindex");
        assert_eq!(u32_at(tcm, 8), 0, "handle: the kernel's choice");
        assert_eq!(u32_at(tcm, 12), 0xffff_0000, "parent ffff:");
        assert_eq!(
            u32_at(tcm, 16),
            0x0300,
            "priority 0, ETH_P_ALL in network order"
        );
        let a = &tcm[20..];
        assert_eq!(attr(a, 1), b"u32\0", "TCA_KIND");
        let opts = attr(a, 2);
        // TCA_U32_SEL: struct tc_u32_sel, flags first; one key matching
        // anything (mask 0, value 0, offset 0).
        let sel = attr(opts, 5);
        assert_eq!((sel[0], sel[2]), (1, 1), "TC_U32_TERMINAL, nkeys 1");
        assert_eq!(&sel[16..], &[0u8; 16], "the key");
        // TCA_U32_ACT → action 1 → TCA_ACT_KIND, TCA_ACT_OPTIONS →
        // TCA_MIRRED_PARMS: struct tc_mirred.
        let act = attr(attr(opts, 7), 1);
        assert_eq!(attr(act, 1), b"mirred\0");
        let parms = attr(attr(act, 2), 2);
        assert_eq!(parms.len(), 28);
        assert_eq!(u32_at(parms, 8), 4, "action: TC_ACT_STOLEN");
        assert_eq!(u32_at(parms, 20), 1, "eaction: TCA_EGRESS_REDIR");
        assert_eq!(u32_at(parms, 24), 9, "ifindex");
    }

    /// `tc qdisc add|del dev X ingress`: handle ffff:, parent ffff:fff1.
    #[test]
    fn the_ingress_qdisc_is_added_exclusively_and_removed() {
        for (req, want_kind, want_flags) in [
            (Request::add_ingress("eth0", 3), libc::RTM_NEWQDISC, NEW),
            (
                Request::del_ingress("eth0", 3),
                libc::RTM_DELQDISC,
                NLM_F_REQUEST | NLM_F_ACK,
            ),
        ] {
            let m = req.bytes(1);
            let (kind, flags, _, tcm) = split(&m);
            assert_eq!((kind, flags), (want_kind, want_flags));
            assert_eq!(u32_at(tcm, 4), 3);
            assert_eq!(u32_at(tcm, 8), 0xffff_0000);
            assert_eq!(u32_at(tcm, 12), 0xffff_fff1);
            assert_eq!(attr(&tcm[20..], 1), b"ingress\0");
        }
    }

    /// `ip link set dev X mtu M up`: only the up flag changes.
    #[test]
    fn the_link_request_sets_the_mtu_and_only_the_up_flag() {
        let m = Request::link_up("tap0", 4, 1400).bytes(1);
        let (kind, flags, _, ifi) = split(&m);
        assert_eq!(
            (kind, flags),
            (libc::RTM_SETLINK, NLM_F_REQUEST | NLM_F_ACK)
        );
        // struct ifinfomsg: family, pad, type, index, flags, change.
        assert_eq!(u32_at(ifi, 4), 4);
        assert_eq!(u32_at(ifi, 8), libc::IFF_UP as u32);
        assert_eq!(u32_at(ifi, 12), libc::IFF_UP as u32);
        assert_eq!(attr(&ifi[16..], libc::IFLA_MTU), 1400u32.to_ne_bytes());
    }

    /// An error reply as the kernel sends it on a capped socket: the error,
    /// the request's header, then the extended acknowledgement's message.
    fn reply(seq: u32, error: i32, message: Option<&str>) -> Vec<u8> {
        let mut tlvs = Vec::new();
        if let Some(m) = message {
            let len = 4 + m.len() + 1;
            tlvs.extend((len as u16).to_ne_bytes());
            tlvs.extend(NLMSGERR_ATTR_MSG.to_ne_bytes());
            tlvs.extend(m.as_bytes());
            tlvs.push(0);
            tlvs.resize(align(tlvs.len()), 0);
        }
        let len = NLMSG_HDR + 4 + NLMSG_HDR + tlvs.len();
        let flags = NLM_F_CAPPED | if message.is_some() { NLM_F_ACK_TLVS } else { 0 };
        let mut m = Vec::new();
        m.extend((len as u32).to_ne_bytes());
        m.extend((libc::NLMSG_ERROR as u16).to_ne_bytes());
        m.extend(flags.to_ne_bytes());
        m.extend(seq.to_ne_bytes());
        m.extend(0u32.to_ne_bytes());
        m.extend(error.to_ne_bytes());
        m.extend([0u8; NLMSG_HDR]);
        m.extend(tlvs);
        m
    }

    #[test]
    fn acknowledgements_are_read_with_the_kernels_words() {
        assert_eq!(ack(&reply(3, 0, None), 3), Some(Ok(())));
        assert_eq!(
            ack(
                &reply(3, -libc::EEXIST, Some("Exclusivity flag on, cannot modify")),
                3
            ),
            Some(Err((
                libc::EEXIST,
                Some("Exclusivity flag on, cannot modify".into())
            )))
        );
        assert_eq!(
            ack(&reply(3, -libc::EPERM, None), 3),
            Some(Err((libc::EPERM, None)))
        );
        // Another request's answer, then ours, in one datagram.
        let mut two = reply(2, -libc::EINVAL, None);
        two.extend(reply(3, 0, None));
        assert_eq!(ack(&two, 3), Some(Ok(())));
        assert_eq!(ack(&reply(2, 0, None), 3), None);
        // Truncated: nothing, not a panic.
        let r = reply(3, -1, Some("x"));
        for n in 0..r.len() {
            let _ = ack(&r[..n], 3);
        }
    }

    /// The message names the link and what was asked, and says why.
    #[test]
    fn errors_say_which_link_and_what() {
        let e = RtnlError::Permission {
            what: "add an ingress qdisc",
            link: "eth0".into(),
        };
        assert_eq!(
            e.to_string(),
            "cannot add an ingress qdisc on `eth0`: not permitted (CAP_NET_ADMIN in its namespace is needed)"
        );
        let e = RtnlError::Request {
            what: "add the redirect filter",
            link: "tap0".into(),
            source: io::Error::from_raw_os_error(libc::ENOENT),
            why: Some("Unknown filter".into()),
        };
        assert_eq!(
            e.to_string(),
            "cannot add the redirect filter on `tap0` (the kernel: Unknown filter)"
        );
        assert_eq!(e.errno(), Some(libc::ENOENT));
    }
}
