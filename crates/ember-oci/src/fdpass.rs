//! Descriptors over Unix sockets (SCM_RIGHTS) and host terminals: runc's
//! console socket gets a pty's master this way, and `ember-oci exec` hands
//! its stdio to the container's supervisor.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries.
const MAX_FDS: usize = 4;

/// Sends `data` with `fds` attached, in one message.
pub fn send(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS && !data.is_empty());
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: as above.
        let len = unsafe { libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) };
        // SAFETY: as above.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as _;
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: msg_control points at `control`, big enough for one
        // header and MAX_FDS descriptors; CMSG_FIRSTHDR/CMSG_DATA stay in it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = len as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(cmsg).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    let mut sent = 0;
    // SAFETY: msg points at live buffers for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    sent += n as usize;
    if sent < data.len() {
        // The descriptors went with the first bytes; the rest plainly.
        let mut f = std::mem::ManuallyDrop::new(
            // SAFETY: borrowed for the write only (never closed: ManuallyDrop).
            unsafe { std::fs::File::from_raw_fd(sock) },
        );
        io::Write::write_all(&mut *f, &data[sent..])?;
    }
    Ok(())
}

/// Receives into `buf`, with any descriptors attached.
pub fn recv(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at live buffers for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg's control buffer; the CMSG macros walk
    // it within msg_controllen, and each SCM_RIGHTS descriptor is now ours.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let count =
                    ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, fds))
}

/// A new pty pair (master, slave), the slave in raw mode: the guest's
/// terminal does the line discipline, so the host's must not.
pub fn pty() -> io::Result<(OwnedFd, OwnedFd)> {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes the two descriptors; the other arguments may be null.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openpty gave us both descriptors.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    for fd in [&master, &slave] {
        // SAFETY: fcntl on our own descriptor.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    // SAFETY: an all-zero termios is filled by tcgetattr before use.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: t is a valid termios for the calls.
    unsafe {
        if libc::tcgetattr(slave.as_raw_fd(), &mut t) == 0 {
            libc::cfmakeraw(&mut t);
            libc::tcsetattr(slave.as_raw_fd(), libc::TCSANOW, &t);
        }
    }
    Ok((master, slave))
}

/// The pty's size (columns, rows), if it has one.
pub fn window_size(fd: RawFd) -> Option<(u16, u16)> {
    // SAFETY: an all-zero winsize is valid; TIOCGWINSZ fills it.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: ws is a valid winsize for the call.
    let r = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0).then_some((ws.ws_col, ws.ws_row))
}

/// Hands a pty's master to runc's console socket (its name as the data),
/// as containerd's shims expect.
pub fn send_console(socket: &str, master: &OwnedFd) -> io::Result<()> {
    let name = std::fs::read_link(format!("/proc/self/fd/{}", master.as_raw_fd()))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "/dev/ptmx".into());
    let (_dir, short) = crate::state::socket_path(std::path::Path::new(socket))?;
    let s = std::os::unix::net::UnixStream::connect(short)?;
    send(s.as_raw_fd(), name.as_bytes(), &[master.as_raw_fd()])
}
