//! The guest's network for `ember run --net`: the host sends `eth0`'s
//! configuration in a `NET` frame (layout in `ember_frames::netconf`)
//! and init applies it before the command starts, with the kernel's
//! interface and route ioctls: loopback and `eth0` up with the MTU, the
//! IPv4 and IPv6 addresses and default routes, and `/etc/resolv.conf`.
//! passt, on the host's side, answers ARP and NDP for the gateway, so
//! nothing needs a DHCP client or router advertisements: IPv6 duplicate
//! address detection and autoconfiguration are turned off, and the address
//! is usable at once.

use crate::sys::{self, Fd};
use ember_frames::netconf::{NetConf, V4, V6};

/// Room for the `NET` payload: the header and a resolv.conf.
const NET_LEN: usize = 4096;
/// The interface virtio_net makes (no udev renames it).
const IFNAME: &[u8] = b"eth0";
/// How long to wait for `eth0` to appear (1 ms steps).
const IFACE_TRIES: u32 = 5_000;
/// The guest's resolv.conf in the initramfs root.
const RESOLV_CONF: &[u8] = b"/etc/resolv.conf\0";

const SYS_SOCKET: usize = 41;
const SYS_IOCTL: usize = 16;
const SYS_MKDIR: usize = 83;
const SYS_UNLINK: usize = 87;
const SYS_OPEN: usize = 2;

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const SOCK_DGRAM: usize = 2;
const SOCK_CLOEXEC: usize = 0o2000000;

const SIOCADDRT: usize = 0x890B;
const SIOCGIFFLAGS: usize = 0x8913;
const SIOCSIFFLAGS: usize = 0x8914;
const SIOCSIFADDR: usize = 0x8916;
const SIOCSIFNETMASK: usize = 0x891C;
const SIOCSIFMTU: usize = 0x8922;
const SIOCGIFINDEX: usize = 0x8933;

const IFF_UP: i16 = 0x1;
const RTF_UP: u32 = 0x1;
const RTF_GATEWAY: u32 = 0x2;
const RTF_HOST: u32 = 0x4;

const O_WRONLY: usize = 1;
const O_CREAT: usize = 0o100;
const O_TRUNC: usize = 0o1000;
const MS_BIND: usize = 4096;

/// The payload, kept from its frame until the command's root is mounted.
static mut NET: [u8; NET_LEN] = [0; NET_LEN];
static mut NET_USED: usize = 0;

/// Keeps a `NET` payload for [`configure`].
pub fn keep(payload: &[u8]) -> Result<(), &'static [u8]> {
    if payload.len() > NET_LEN || NetConf::decode(payload).is_none() {
        return Err(b"bad network configuration from the host");
    }
    // SAFETY: init is single-threaded; NET and NET_USED are used only here
    // and in `configure`, never at once.
    unsafe {
        let buf = &mut *core::ptr::addr_of_mut!(NET);
        buf[..payload.len()].copy_from_slice(payload);
        NET_USED = payload.len();
    }
    Ok(())
}

/// Applies the kept configuration, if any; `root` is where the command's
/// root is mounted (NUL-terminated), if it is not the initramfs.
pub fn configure(root: Option<&[u8]>) -> Result<(), &'static [u8]> {
    // SAFETY: as in `keep`.
    let payload = unsafe {
        let buf = &*core::ptr::addr_of!(NET);
        &buf[..NET_USED]
    };
    if payload.is_empty() {
        return Ok(());
    }
    let conf = NetConf::decode(payload).ok_or(&b"bad network configuration"[..])?;
    let s4 = socket(AF_INET)?;
    let up = bring_up(s4, &conf);
    let r = up.and_then(|index| {
        if let Some(v4) = &conf.v4 {
            ipv4(s4, v4)?;
        }
        // A kernel without IPv6 (no AF_INET6 sockets) goes on with IPv4.
        if let (Some(v6), Ok(s6)) = (&conf.v6, socket(AF_INET6)) {
            let r = ipv6(s6, index, v6);
            sys::close(s6);
            r?;
        }
        Ok(())
    });
    sys::close(s4);
    r?;
    write_resolv_conf(conf.resolv_conf, root)
}

/// `struct ifreq` on x86_64: a name and a 24-byte union.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &[u8]) -> IfReq {
        let mut r = IfReq {
            name: [0; 16],
            data: [0; 24],
        };
        r.name[..name.len()].copy_from_slice(name);
        r
    }

    fn set_int(&mut self, v: i32) {
        self.data[..4].copy_from_slice(&v.to_ne_bytes());
    }

    fn int(&self) -> i32 {
        i32::from_ne_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }

    fn set_flags(&mut self, v: i16) {
        self.data[..2].copy_from_slice(&v.to_ne_bytes());
    }

    fn flags(&self) -> i16 {
        i16::from_ne_bytes([self.data[0], self.data[1]])
    }

    /// A `sockaddr_in` of `addr` in the union.
    fn set_v4(&mut self, addr: [u8; 4]) {
        self.data = [0; 24];
        self.data[..16].copy_from_slice(&sockaddr_in(addr));
    }
}

/// A `struct sockaddr_in` (16 bytes) for `addr`, port 0.
fn sockaddr_in(addr: [u8; 4]) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..2].copy_from_slice(&AF_INET.to_ne_bytes());
    s[4..8].copy_from_slice(&addr);
    s
}

/// `struct rtentry` on x86_64.
#[repr(C)]
struct RtEntry {
    pad1: u64,
    dst: [u8; 16],
    gateway: [u8; 16],
    genmask: [u8; 16],
    flags: u16,
    pad2: i16,
    pad3: u64,
    pad4: usize,
    metric: i16,
    dev: *const u8,
    mtu: u64,
    window: u64,
    irtt: u16,
}

/// `struct in6_ifreq`.
#[repr(C)]
struct In6IfReq {
    addr: [u8; 16],
    prefix: u32,
    index: i32,
}

/// `struct in6_rtmsg`.
#[repr(C)]
struct In6RtMsg {
    dst: [u8; 16],
    src: [u8; 16],
    gateway: [u8; 16],
    kind: u32,
    dst_len: u16,
    src_len: u16,
    metric: u32,
    info: u64,
    flags: u32,
    index: i32,
}

fn socket(family: u16) -> Result<Fd, &'static [u8]> {
    sys::call(
        SYS_SOCKET,
        [family as usize, SOCK_DGRAM | SOCK_CLOEXEC, 0, 0, 0, 0],
    )
    .map(|fd| fd as Fd)
    .map_err(|_| &b"cannot open a socket to configure the network"[..])
}

/// `ioctl(fd, request, arg)` with `arg` pointing at a live value of the
/// type `request` reads and writes.
fn ioctl<T>(fd: Fd, request: usize, arg: &mut T) -> Result<usize, sys::Errno> {
    sys::call(
        SYS_IOCTL,
        [fd as usize, request, arg as *mut T as usize, 0, 0, 0],
    )
}

/// Sets interface `name` up (and its MTU first, if given); returns its index.
fn set_up(fd: Fd, name: &[u8], mtu: Option<u32>) -> Result<i32, sys::Errno> {
    let mut r = IfReq::new(name);
    ioctl(fd, SIOCGIFINDEX, &mut r)?;
    let index = r.int();
    if let Some(mtu) = mtu {
        let mut r = IfReq::new(name);
        r.set_int(mtu as i32);
        ioctl(fd, SIOCSIFMTU, &mut r)?;
    }
    let mut r = IfReq::new(name);
    ioctl(fd, SIOCGIFFLAGS, &mut r)?;
    let flags = r.flags() | IFF_UP;
    r.set_flags(flags);
    ioctl(fd, SIOCSIFFLAGS, &mut r)?;
    Ok(index)
}

/// Loopback and `eth0` up (waiting for the driver to make `eth0`), with
/// IPv6 set to take its address as given; returns `eth0`'s index.
fn bring_up(fd: Fd, conf: &NetConf) -> Result<i32, &'static [u8]> {
    set_up(fd, b"lo", None).map_err(|_| &b"cannot bring up lo"[..])?;
    let mut tries = 0;
    loop {
        let mut r = IfReq::new(IFNAME);
        match ioctl(fd, SIOCGIFINDEX, &mut r) {
            Ok(_) => break,
            Err(_) if tries < IFACE_TRIES => {
                tries += 1;
                sys::sleep_ms(1);
            }
            Err(_) => return Err(b"no eth0: the guest has no network device (virtio_net)"),
        }
    }
    // Before the link is up: no duplicate address detection to wait out,
    // no address or route of the guest's own making from advertisements.
    for (file, value) in [
        (&b"/proc/sys/net/ipv6/conf/eth0/accept_dad\0"[..], b"0\n"),
        (b"/proc/sys/net/ipv6/conf/eth0/accept_ra\0", b"0\n"),
        (b"/proc/sys/net/ipv6/conf/eth0/autoconf\0", b"0\n"),
    ] {
        if let Ok(f) = sys::open(file, O_WRONLY) {
            sys::write_all(f, value);
            sys::close(f);
        }
    }
    set_up(fd, IFNAME, Some(conf.mtu)).map_err(|_| &b"cannot bring up eth0"[..])
}

fn ipv4(fd: Fd, v4: &V4) -> Result<(), &'static [u8]> {
    let mut r = IfReq::new(IFNAME);
    r.set_v4(v4.addr);
    ioctl(fd, SIOCSIFADDR, &mut r).map_err(|_| &b"cannot set eth0's IPv4 address"[..])?;
    let mask = match v4.prefix {
        0 => 0u32,
        p => u32::MAX << (32 - p as u32),
    };
    let mut r = IfReq::new(IFNAME);
    r.set_v4(mask.to_be_bytes());
    ioctl(fd, SIOCSIFNETMASK, &mut r).map_err(|_| &b"cannot set eth0's IPv4 netmask"[..])?;
    let dev = b"eth0\0";
    let route = |dst: [u8; 4], gateway: Option<[u8; 4]>, genmask: [u8; 4], flags: u32| RtEntry {
        pad1: 0,
        dst: sockaddr_in(dst),
        gateway: sockaddr_in(gateway.unwrap_or([0; 4])),
        genmask: sockaddr_in(genmask),
        flags: flags as u16,
        pad2: 0,
        pad3: 0,
        pad4: 0,
        metric: 0,
        dev: dev.as_ptr(),
        mtu: 0,
        window: 0,
        irtt: 0,
    };
    // A gateway outside the prefix (a /32 address) is reached on the link.
    let gw = u32::from_be_bytes(v4.gateway);
    if gw & mask != u32::from_be_bytes(v4.addr) & mask {
        let mut host = route(v4.gateway, None, [255; 4], RTF_UP | RTF_HOST);
        ioctl(fd, SIOCADDRT, &mut host).map_err(|_| &b"cannot add the route to the gateway"[..])?;
    }
    let mut default = route([0; 4], Some(v4.gateway), [0; 4], RTF_UP | RTF_GATEWAY);
    ioctl(fd, SIOCADDRT, &mut default).map_err(|_| &b"cannot add the IPv4 default route"[..])?;
    Ok(())
}

fn ipv6(fd: Fd, index: i32, v6: &V6) -> Result<(), &'static [u8]> {
    let mut a = In6IfReq {
        addr: v6.addr,
        prefix: v6.prefix as u32,
        index,
    };
    ioctl(fd, SIOCSIFADDR, &mut a).map_err(|_| &b"cannot set eth0's IPv6 address"[..])?;
    let mut route = In6RtMsg {
        dst: [0; 16],
        src: [0; 16],
        gateway: v6.gateway,
        kind: 0,
        dst_len: 0,
        src_len: 0,
        metric: 1024,
        info: 0,
        flags: RTF_UP | RTF_GATEWAY,
        index,
    };
    ioctl(fd, SIOCADDRT, &mut route).map_err(|_| &b"cannot add the IPv6 default route"[..])?;
    Ok(())
}

/// Writes `text` as the initramfs's `/etc/resolv.conf` and shows it at
/// `root`'s `/etc/resolv.conf` too: bind-mounted over the file there, so
/// the root's own is hidden, never changed.
fn write_resolv_conf(text: &[u8], root: Option<&[u8]>) -> Result<(), &'static [u8]> {
    let _ = sys::call(SYS_MKDIR, [c"/etc".as_ptr() as usize, 0o755, 0, 0, 0, 0]);
    let _ = sys::call(SYS_UNLINK, [RESOLV_CONF.as_ptr() as usize, 0, 0, 0, 0, 0]);
    let f = sys::call(
        SYS_OPEN,
        [
            RESOLV_CONF.as_ptr() as usize,
            O_WRONLY | O_CREAT | O_TRUNC | sys::O_CLOEXEC,
            0o644,
            0,
            0,
            0,
        ],
    )
    .map_err(|_| &b"cannot write /etc/resolv.conf"[..])? as Fd;
    sys::write_all(f, text);
    sys::close(f);
    let Some(root) = root else {
        return Ok(());
    };
    // ROOT/etc/resolv.conf, NUL-terminated.
    let root = &root[..root.len() - 1];
    let tail = b"/etc/resolv.conf\0";
    let mut target = [0u8; 256];
    if root.len() + tail.len() > target.len() {
        return Ok(());
    }
    target[..root.len()].copy_from_slice(root);
    target[root.len()..root.len() + tail.len()].copy_from_slice(tail);
    let target = &target[..root.len() + tail.len()];
    // A root without the file gets an empty one to mount over.
    if sys::open(target, sys::O_RDONLY | sys::O_CLOEXEC)
        .map(sys::close)
        .is_err()
    {
        let mut etc = [0u8; 256];
        let n = root.len() + 4;
        etc[..n].copy_from_slice(&target[..n]);
        let _ = sys::call(SYS_MKDIR, [etc.as_ptr() as usize, 0o755, 0, 0, 0, 0]);
        if let Ok(f) = sys::call(
            SYS_OPEN,
            [
                target.as_ptr() as usize,
                O_WRONLY | O_CREAT | sys::O_CLOEXEC,
                0o644,
                0,
                0,
                0,
            ],
        ) {
            sys::close(f as Fd);
        }
    }
    sys::mount_with(RESOLV_CONF, target, b"\0", MS_BIND, b"\0")
        .map(|_| ())
        .map_err(|_| &b"cannot put resolv.conf in the command's root"[..])
}
