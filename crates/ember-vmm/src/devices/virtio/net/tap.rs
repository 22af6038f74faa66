//! The tap backend: a tap interface's queue (`/dev/net/tun`), opened with
//! `IFF_VNET_HDR` so that every frame carries the 12-byte virtio-net header and
//! checksum and segmentation offloads cross it unchanged.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
    VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_GUEST_UFO,
};

use super::backend::Backend;
use super::{Error, HDR_LEN};

/// An open tap queue.
#[derive(Debug)]
pub(crate) struct Tap {
    file: File,
    /// Whether the queue was opened with `IFF_VNET_HDR` (ours always are; a passed
    /// descriptor may not be).
    vnet_hdr: bool,
}

fn ifreq(name: &str, flags: i32) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = flags as libc::c_short;
    req
}

/// Whether an interface `name` exists in this thread's network namespace.
fn exists(name: &str) -> Result<bool, Error> {
    let cname = CString::new(name).map_err(|_| Error::BadTapName(name.to_owned()))?;
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(Error::BadTapName(name.to_owned()));
    }
    // SAFETY: a valid NUL-terminated string.
    Ok(unsafe { libc::if_nametoindex(cname.as_ptr()) } != 0)
}

/// Makes tap `name` in the calling thread's network namespace, for a caller
/// that joins it to something before a VMM takes it as `fd=N` (`ember run
/// --netns` ties it to a pod's interface). It has the virtio-net header on,
/// and is not persistent: it goes when its last descriptor is closed, so
/// nothing of it outlives the VM however that ends. An interface already
/// called `name` is an error.
pub fn create_tap(name: &str) -> Result<File, Error> {
    if exists(name)? {
        return Err(Error::InterfaceExists(name.to_owned()));
    }
    Tap::attach(name).map(|t| t.file)
}

impl Tap {
    /// Opens the existing tap interface `name` (in this process's network namespace).
    /// A missing one is an error, not created: a tap ember made would vanish with it
    /// and be configured by nobody.
    pub(crate) fn open(name: &str) -> Result<Self, Error> {
        if !exists(name)? {
            return Err(Error::NoSuchTap(name.to_owned()));
        }
        Self::attach(name)
    }

    /// TUNSETIFF on a fresh `/dev/net/tun` descriptor: attaches to tap `name`,
    /// or makes it (not persistent) if there is none.
    fn attach(name: &str) -> Result<Self, Error> {
        // SAFETY: a valid path; the descriptor is checked and owned at once.
        let fd = unsafe {
            libc::open(
                c"/dev/net/tun".as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(Error::OpenTun(io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        let mut req = ifreq(name, libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR);
        // SAFETY: TUNSETIFF reads (and fills in) an ifreq, which `req` is.
        if unsafe { libc::ioctl(fd, libc::TUNSETIFF, &mut req) } < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::EACCES) => Error::TapPermission(name.to_owned()),
                Some(libc::EBUSY) => Error::TapBusy(name.to_owned()),
                Some(libc::EINVAL) => Error::NotATap(name.to_owned()),
                _ => Error::Tap(name.to_owned(), e),
            });
        }
        let tap = Tap {
            file,
            vnet_hdr: true,
        };
        tap.set_vnet_hdr_size()
            .map_err(|e| Error::Tap(name.to_owned(), e))?;
        Ok(tap)
    }

    /// Takes over a tap queue the caller opened (`fd=N`): it must be a tap without
    /// packet information; its header is used if it was opened with one.
    pub(crate) fn from_fd(fd: RawFd) -> Result<Self, Error> {
        let bad = |why: &str| Error::BadTapFd(fd, why.to_owned());
        // SAFETY: F_GETFD only asks about the descriptor number.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(bad("not an open descriptor"));
        }
        let mut req = ifreq("", 0);
        // SAFETY: TUNGETIFF fills in an ifreq, which `req` is.
        if unsafe { libc::ioctl(fd, libc::TUNGETIFF, &mut req) } < 0 {
            return Err(bad("not a tap interface (TUNGETIFF failed)"));
        }
        // SAFETY: TUNGETIFF set the flags member of the union.
        let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags }) & 0xffff;
        if flags & libc::IFF_TAP == 0 {
            return Err(bad("a tun, not a tap, interface"));
        }
        if flags & libc::IFF_NO_PI == 0 {
            return Err(bad("opened without IFF_NO_PI"));
        }
        // SAFETY: the caller handed this descriptor to ember to own.
        let file = unsafe { File::from_raw_fd(fd) };
        // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
        unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
        let tap = Tap {
            file,
            vnet_hdr: flags & libc::IFF_VNET_HDR != 0,
        };
        if tap.vnet_hdr {
            tap.set_vnet_hdr_size().map_err(|e| bad(&e.to_string()))?;
        }
        Ok(tap)
    }

    fn set_vnet_hdr_size(&self) -> io::Result<()> {
        let size = HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &size) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The `TUN_F_*` offloads matching the driver's receive features: what the tap may
/// hand us unchecksummed or unsegmented.
pub(crate) fn tun_offloads(guest_features: u64) -> libc::c_uint {
    let has = |bit: u32| guest_features & (1 << bit) != 0;
    if !has(VIRTIO_NET_F_GUEST_CSUM) {
        return 0;
    }
    let mut f = libc::TUN_F_CSUM;
    for (bit, flag) in [
        (VIRTIO_NET_F_GUEST_TSO4, libc::TUN_F_TSO4),
        (VIRTIO_NET_F_GUEST_TSO6, libc::TUN_F_TSO6),
        (VIRTIO_NET_F_GUEST_ECN, libc::TUN_F_TSO_ECN),
        (VIRTIO_NET_F_GUEST_UFO, libc::TUN_F_UFO),
    ] {
        if has(bit) {
            f |= flag;
        }
    }
    f
}

impl Backend for Tap {
    fn vnet_hdr(&self) -> bool {
        self.vnet_hdr
    }

    fn set_offloads(&self, guest_features: u64) -> io::Result<()> {
        if !self.vnet_hdr {
            return Ok(());
        }
        let flags = tun_offloads(guest_features);
        // SAFETY: TUNSETOFFLOAD takes its flags by value.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNSETOFFLOAD, flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe { libc::read(self.file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: `frame` is valid for reads of its length.
        let n = unsafe { libc::write(self.file.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn scatters(&self) -> bool {
        true
    }

    unsafe fn send_gather(&self, iov: &[libc::iovec]) -> io::Result<()> {
        // SAFETY: as the caller promised; a tap takes one frame a writev.
        unsafe { super::backend::writev(self.file.as_raw_fd(), iov) }
    }

    unsafe fn recv_scatter(&self, iov: &[libc::iovec]) -> io::Result<usize> {
        // SAFETY: as the caller promised; a tap hands over one frame a readv.
        unsafe { super::backend::readv(self.file.as_raw_fd(), iov) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloads_follow_the_guests_receive_features() {
        let bit = |b: u32| 1u64 << b;
        assert_eq!(
            tun_offloads(bit(VIRTIO_NET_F_GUEST_TSO4)),
            0,
            "no csum, no tso"
        );
        assert_eq!(tun_offloads(bit(VIRTIO_NET_F_GUEST_CSUM)), libc::TUN_F_CSUM);
        assert_eq!(
            tun_offloads(
                bit(VIRTIO_NET_F_GUEST_CSUM)
                    | bit(VIRTIO_NET_F_GUEST_TSO4)
                    | bit(VIRTIO_NET_F_GUEST_TSO6)
            ),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6
        );
    }

    #[test]
    fn an_absent_tap_and_a_bad_fd_are_refused() {
        let e = Tap::open("ember-no-such0").unwrap_err().to_string();
        assert!(e.contains("no network interface `ember-no-such0`"), "{e}");
        let e = Tap::from_fd(9999).unwrap_err().to_string();
        assert!(e.contains("not an open descriptor"), "{e}");
        let f = File::open("/dev/null").unwrap();
        let e = Tap::from_fd(f.as_raw_fd()).unwrap_err().to_string();
        assert!(e.contains("not a tap"), "{e}");
    }
}
