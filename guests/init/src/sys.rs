//! Raw x86_64 Linux system calls, and the C-library symbols the compiler
//! expects (`memcpy` and friends), for a binary linked without libc.

use core::arch::asm;

/// A file descriptor.
pub type Fd = i32;
/// A negative errno, as returned by the kernel.
pub type Errno = isize;

pub const O_RDONLY: usize = 0;
pub const O_RDWR: usize = 2;
pub const O_NOCTTY: usize = 0o400;
pub const O_NONBLOCK: usize = 0o4000;
pub const O_CLOEXEC: usize = 0o2000000;

pub const ENOENT: Errno = 2;
pub const EINTR: Errno = 4;
pub const EAGAIN: Errno = 11;
pub const EACCES: Errno = 13;
pub const EEXIST: Errno = 17;
pub const EPERM: Errno = 1;
pub const EKEYREJECTED: Errno = 129;
pub const ENOEXEC: Errno = 8;
pub const ENOTTY: Errno = 25;
pub const EAFNOSUPPORT: Errno = 97;

/// `mount` flags.
pub const MS_RDONLY: usize = 1;
pub const MS_NOSUID: usize = 2;
pub const MS_NODEV: usize = 4;
pub const MS_REMOUNT: usize = 32;
pub const MS_BIND: usize = 4096;

pub const POLLIN: i16 = 0x1;
pub const POLLOUT: i16 = 0x4;

// x86_64 system call numbers.
const SYS_READ: usize = 0;
const SYS_WRITE: usize = 1;
const SYS_OPEN: usize = 2;
const SYS_CLOSE: usize = 3;
const SYS_LSEEK: usize = 8;
const SYS_MMAP: usize = 9;
const SYS_MUNMAP: usize = 11;
const SYS_POLL: usize = 7;
const SYS_IOCTL: usize = 16;
const SYS_NANOSLEEP: usize = 35;
const SYS_DUP2: usize = 33;
const SYS_FORK: usize = 57;
const SYS_EXECVE: usize = 59;
const SYS_EXIT: usize = 60;
const SYS_WAIT4: usize = 61;
const SYS_FCNTL: usize = 72;
const SYS_CHDIR: usize = 80;
const SYS_MKDIR: usize = 83;
const SYS_SYMLINK: usize = 88;
const SYS_ARCH_PRCTL: usize = 158;
const SYS_CHROOT: usize = 161;
const SYS_SYNC: usize = 162;
const SYS_MOUNT: usize = 165;
const SYS_REBOOT: usize = 169;
const SYS_INIT_MODULE: usize = 175;
const SYS_NEWFSTATAT: usize = 262;
const SYS_PIPE2: usize = 293;
const SYS_FINIT_MODULE: usize = 313;

// ioctls and their arguments.
const TCGETS: usize = 0x5401;
const TCSETS: usize = 0x5402;
const TCSBRK: usize = 0x5409;
/// Drop a block device's buffer cache (`_IO(0x12, 97)`).
const BLKFLSBUF: usize = 0x1261;
const F_GETFL: usize = 3;
const F_SETFL: usize = 4;

// termios flag bits (asm-generic/termbits.h).
const IGNBRK: u32 = 0o1;
const BRKINT: u32 = 0o2;
const PARMRK: u32 = 0o10;
const ISTRIP: u32 = 0o40;
const INLCR: u32 = 0o100;
const IGNCR: u32 = 0o200;
const ICRNL: u32 = 0o400;
const IXON: u32 = 0o2000;
const OPOST: u32 = 0o1;
const CBAUD: u32 = 0o10017;
const B115200: u32 = 0o10002;
const CSIZE: u32 = 0o60;
const CS8: u32 = 0o60;
const CREAD: u32 = 0o200;
const PARENB: u32 = 0o400;
const CLOCAL: u32 = 0o4000;
const ISIG: u32 = 0o1;
const ICANON: u32 = 0o2;
const ECHO: u32 = 0o10;
const ECHONL: u32 = 0o100;
const IEXTEN: u32 = 0o100000;
const VTIME: usize = 5;
const VMIN: usize = 6;

// reboot(2) magic numbers.
const REBOOT_MAGIC1: usize = 0xfee1_dead;
const REBOOT_MAGIC2: usize = 672_274_793;
const REBOOT_CMD_POWER_OFF: usize = 0x4321_fedc;

/// The kernel's `struct termios` (TCGETS/TCSETS layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct Termios {
    iflag: u32,
    oflag: u32,
    cflag: u32,
    lflag: u32,
    line: u8,
    cc: [u8; 19],
}

/// `struct pollfd`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PollFd {
    fd: i32,
    events: i16,
    pub revents: i16,
}

impl PollFd {
    /// Watches `fd` for `events` (a negative fd is ignored by poll).
    pub const fn new(fd: Fd, events: i16) -> Self {
        PollFd {
            fd,
            events,
            revents: 0,
        }
    }
}

/// A six-argument system call.
///
/// # Safety
/// The arguments must be valid for system call `n` (pointers to live memory of
/// the sizes the kernel will access).
unsafe fn syscall(n: usize, a: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the caller guarantees the arguments; `syscall` clobbers rcx/r11 only.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a[0], in("rsi") a[1], in("rdx") a[2],
            in("r10") a[3], in("r8") a[4], in("r9") a[5],
            lateout("rcx") _, lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

fn result(r: isize) -> Result<usize, Errno> {
    if r < 0 { Err(-r) } else { Ok(r as usize) }
}

/// Calls `n` with arguments that carry no pointers, or pointers the caller
/// made valid (each wrapper below documents its own).
pub fn call(n: usize, a: [usize; 6]) -> Result<usize, Errno> {
    // SAFETY: every caller passes either plain integers or pointers to live
    // buffers of the size given alongside.
    result(unsafe { syscall(n, a) })
}

pub fn read(fd: Fd, buf: &mut [u8]) -> Result<usize, Errno> {
    call(
        SYS_READ,
        [fd as usize, buf.as_mut_ptr() as usize, buf.len(), 0, 0, 0],
    )
}

pub fn write(fd: Fd, buf: &[u8]) -> Result<usize, Errno> {
    call(
        SYS_WRITE,
        [fd as usize, buf.as_ptr() as usize, buf.len(), 0, 0, 0],
    )
}

/// Writes everything (or gives up on a hard error).
pub fn write_all(fd: Fd, mut buf: &[u8]) {
    while !buf.is_empty() {
        match write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(EINTR) | Err(EAGAIN) => {}
            Err(_) => return,
        }
    }
}

/// Reads until EOF or the buffer is full; returns the byte count.
pub fn read_full(fd: Fd, buf: &mut [u8]) -> usize {
    let mut len = 0;
    while len < buf.len() {
        match read(fd, &mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(EINTR) => {}
            Err(_) => break,
        }
    }
    len
}

/// `path` must be NUL-terminated.
pub fn open(path: &[u8], flags: usize) -> Result<Fd, Errno> {
    debug_assert_eq!(path.last(), Some(&0));
    call(SYS_OPEN, [path.as_ptr() as usize, flags, 0, 0, 0, 0]).map(|fd| fd as Fd)
}

pub fn close(fd: Fd) {
    let _ = call(SYS_CLOSE, [fd as usize, 0, 0, 0, 0, 0]);
}

pub fn poll(fds: &mut [PollFd]) -> Result<usize, Errno> {
    call(
        SYS_POLL,
        [fds.as_mut_ptr() as usize, fds.len(), usize::MAX, 0, 0, 0],
    )
}

pub fn dup2(from: Fd, to: Fd) {
    let _ = call(SYS_DUP2, [from as usize, to as usize, 0, 0, 0, 0]);
}

/// Returns 0 in the child.
pub fn fork() -> Result<usize, Errno> {
    call(SYS_FORK, [0; 6])
}

/// `path`, `argv` and `envp` are NUL-terminated strings / NULL-terminated
/// arrays. Returns the errno (execve only returns on failure).
pub fn execve(path: *const u8, argv: *const *const u8, envp: *const *const u8) -> Errno {
    match call(
        SYS_EXECVE,
        [path as usize, argv as usize, envp as usize, 0, 0, 0],
    ) {
        Err(e) => e,
        Ok(_) => 0,
    }
}

pub fn exit(code: i32) -> ! {
    loop {
        // exit(2) does not return; loop only to satisfy the type.
        let _ = call(SYS_EXIT, [code as usize, 0, 0, 0, 0, 0]);
    }
}

/// Waits for `pid` (reaping any other child on the way); returns a shell-style
/// exit code: the status, or 128 + the signal number.
pub fn wait_for(pid: usize) -> Result<i32, Errno> {
    loop {
        let mut status: i32 = 0;
        match call(
            SYS_WAIT4,
            [usize::MAX, &mut status as *mut i32 as usize, 0, 0, 0, 0],
        ) {
            Ok(p) if p == pid => {
                let signal = status & 0x7f;
                return Ok(if signal == 0 {
                    (status >> 8) & 0xff
                } else {
                    128 + signal
                });
            }
            Ok(_) | Err(EINTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// `path` is a NUL-terminated string.
pub fn chdir(path: *const u8) -> Result<usize, Errno> {
    call(SYS_CHDIR, [path as usize, 0, 0, 0, 0, 0])
}

/// Makes `link` a symlink to `target`; both NUL-terminated.
pub fn symlink(target: &[u8], link: &[u8]) -> Result<usize, Errno> {
    call(
        SYS_SYMLINK,
        [target.as_ptr() as usize, link.as_ptr() as usize, 0, 0, 0, 0],
    )
}

/// Whether `path` (NUL-terminated) can be stat'ed; its attributes are
/// thrown away.
pub fn stat(path: &[u8]) -> Result<usize, Errno> {
    const AT_FDCWD: isize = -100;
    // Larger than x86-64's `struct stat` (144 bytes).
    let mut buf = [0u8; 256];
    call(
        SYS_NEWFSTATAT,
        [
            AT_FDCWD as usize,
            path.as_ptr() as usize,
            buf.as_mut_ptr() as usize,
            0,
            0,
            0,
        ],
    )
}

/// Makes directory `path` (NUL-terminated).
pub fn mkdir(path: &[u8], mode: usize) -> Result<usize, Errno> {
    call(SYS_MKDIR, [path.as_ptr() as usize, mode, 0, 0, 0, 0])
}

pub fn sync() {
    let _ = call(SYS_SYNC, [0; 6]);
}

/// The extended CPU state components the kernel saves and restores for a
/// process (`arch_prctl(ARCH_GET_XCOMP_SUPP)`, Linux 5.16 and later), as an
/// XCR0 bit mask; `None` from an older kernel.
pub fn kernel_xfeatures() -> Option<u64> {
    const ARCH_GET_XCOMP_SUPP: usize = 0x1021;
    let mut mask = 0u64;
    let arg = core::ptr::addr_of_mut!(mask) as usize;
    call(SYS_ARCH_PRCTL, [ARCH_GET_XCOMP_SUPP, arg, 0, 0, 0, 0]).ok()?;
    Some(mask)
}

/// All arguments NUL-terminated.
pub fn mount(source: &[u8], target: &[u8], fstype: &[u8]) -> Result<usize, Errno> {
    call(
        SYS_MOUNT,
        [
            source.as_ptr() as usize,
            target.as_ptr() as usize,
            fstype.as_ptr() as usize,
            0,
            0,
            0,
        ],
    )
}

/// `mount` with flags and file-system options (`data`); all strings
/// NUL-terminated.
pub fn mount_with(
    source: &[u8],
    target: &[u8],
    fstype: &[u8],
    flags: usize,
    data: &[u8],
) -> Result<usize, Errno> {
    call(
        SYS_MOUNT,
        [
            source.as_ptr() as usize,
            target.as_ptr() as usize,
            fstype.as_ptr() as usize,
            flags,
            data.as_ptr() as usize,
            0,
        ],
    )
}

/// `path` is a NUL-terminated string.
pub fn chroot(path: *const u8) -> Result<usize, Errno> {
    call(SYS_CHROOT, [path as usize, 0, 0, 0, 0, 0])
}

/// Drops whatever the kernel cached of block device `fd`.
pub fn flush_block_cache(fd: Fd) -> Result<usize, Errno> {
    call(SYS_IOCTL, [fd as usize, BLKFLSBUF, 0, 0, 0, 0])
}

pub fn power_off() -> ! {
    let _ = call(
        SYS_REBOOT,
        [REBOOT_MAGIC1, REBOOT_MAGIC2, REBOOT_CMD_POWER_OFF, 0, 0, 0],
    );
    exit(1)
}

/// Returns (read end, write end), both close-on-exec.
pub fn pipe() -> Result<(Fd, Fd), Errno> {
    let mut fds = [0i32; 2];
    call(
        SYS_PIPE2,
        [fds.as_mut_ptr() as usize, O_CLOEXEC, 0, 0, 0, 0],
    )?;
    Ok((fds[0], fds[1]))
}

/// `params` must be NUL-terminated (`a=1 b=2\0`).
pub fn finit_module(fd: Fd, params: &[u8]) -> Result<usize, Errno> {
    debug_assert_eq!(params.last(), Some(&0));
    call(
        SYS_FINIT_MODULE,
        [fd as usize, params.as_ptr() as usize, 0, 0, 0, 0],
    )
}

/// Loads a module from memory (`init_module`); `params` NUL-terminated.
pub fn init_module(image: &[u8], params: &[u8]) -> Result<usize, Errno> {
    debug_assert_eq!(params.last(), Some(&0));
    call(
        SYS_INIT_MODULE,
        [
            image.as_ptr() as usize,
            image.len(),
            params.as_ptr() as usize,
            0,
            0,
            0,
        ],
    )
}

/// A read-only private mapping of a whole file; unmapped when dropped.
pub struct Mapped {
    addr: usize,
    len: usize,
}

impl Mapped {
    /// Maps all of `fd` (an empty file cannot be mapped).
    pub fn file(fd: Fd) -> Result<Mapped, Errno> {
        const SEEK_END: usize = 2;
        const PROT_READ: usize = 1;
        const MAP_PRIVATE: usize = 2;
        let len = call(SYS_LSEEK, [fd as usize, 0, SEEK_END, 0, 0, 0])?;
        if len == 0 {
            return Err(ENOEXEC);
        }
        let addr = call(SYS_MMAP, [0, len, PROT_READ, MAP_PRIVATE, fd as usize, 0])?;
        Ok(Mapped { addr, len })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the kernel mapped `len` readable bytes at `addr`, which stay
        // mapped until drop; nothing writes to a private read-only mapping.
        unsafe { core::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let _ = call(SYS_MUNMAP, [self.addr, self.len, 0, 0, 0, 0]);
    }
}

pub fn set_nonblocking(fd: Fd) -> Result<usize, Errno> {
    let flags = call(SYS_FCNTL, [fd as usize, F_GETFL, 0, 0, 0, 0])?;
    call(
        SYS_FCNTL,
        [fd as usize, F_SETFL, flags | O_NONBLOCK, 0, 0, 0],
    )
}

pub fn sleep_ms(ms: u64) {
    let ts = [0u64, ms * 1_000_000];
    let _ = call(SYS_NANOSLEEP, [ts.as_ptr() as usize, 0, 0, 0, 0, 0]);
}

/// cfmakeraw: 8-bit clean, no echo, no line editing, no signals, no CR/LF mangling.
pub fn make_raw(fd: Fd) -> Result<usize, Errno> {
    let mut t = Termios {
        iflag: 0,
        oflag: 0,
        cflag: 0,
        lflag: 0,
        line: 0,
        cc: [0; 19],
    };
    call(
        SYS_IOCTL,
        [
            fd as usize,
            TCGETS,
            &mut t as *mut Termios as usize,
            0,
            0,
            0,
        ],
    )?;
    t.iflag &= !(IGNBRK | BRKINT | PARMRK | ISTRIP | INLCR | IGNCR | ICRNL | IXON);
    t.oflag &= !OPOST;
    t.lflag &= !(ECHO | ECHONL | ICANON | ISIG | IEXTEN);
    t.cflag &= !(CSIZE | PARENB | CBAUD);
    t.cflag |= CS8 | CREAD | CLOCAL | B115200;
    t.cc[VMIN] = 1;
    t.cc[VTIME] = 0;
    call(
        SYS_IOCTL,
        [fd as usize, TCSETS, &t as *const Termios as usize, 0, 0, 0],
    )
}

/// Blocks until everything written to the tty has been transmitted.
pub fn tcdrain(fd: Fd) {
    let _ = call(SYS_IOCTL, [fd as usize, TCSBRK, 1, 0, 0, 0]);
}

/// The bytes of a NUL-terminated string, without the NUL.
///
/// # Safety
/// `p` must point to a NUL-terminated string that outlives the result.
pub unsafe fn cstr<'a>(p: *const u8) -> &'a [u8] {
    // SAFETY: the caller guarantees a NUL terminator and the lifetime.
    unsafe { core::slice::from_raw_parts(p, strlen(p)) }
}

/// # Safety
/// C `strlen` contract. (The compiler turns length loops into calls to it.)
#[unsafe(no_mangle)]
pub unsafe extern "C" fn strlen(p: *const u8) -> usize {
    let mut n = 0;
    // SAFETY: the caller guarantees a NUL terminator, so every read is in
    // bounds; volatile keeps this loop from being turned into a strlen call.
    while unsafe { p.add(n).read_volatile() } != 0 {
        n += 1;
    }
    n
}

/// A short name for the errno values exec commonly fails with.
pub fn errno_name(e: Errno) -> &'static [u8] {
    match e {
        ENOENT => b"no such file or directory",
        EACCES => b"permission denied",
        ENOEXEC => b"exec format error",
        _ => b"exec failed",
    }
}

// The compiler lowers copies and fills to these C functions; without libc we
// provide them. `rep movsb`/`rep stosb` keep them from compiling into calls
// to themselves.

/// # Safety
/// C `memcpy` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees both ranges are valid and disjoint.
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _,
             options(nostack, preserves_flags));
    }
    dst
}

/// # Safety
/// C `memmove` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) <= (src as usize) || (dst as usize) >= (src as usize) + n {
        // SAFETY: a forward copy is correct when dst does not start inside src.
        return unsafe { memcpy(dst, src, n) };
    }
    // SAFETY: copy backwards (direction flag set, then restored) for overlap.
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
             options(nostack));
    }
    dst
}

/// # Safety
/// C `memset` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees the range is valid.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8,
             options(nostack, preserves_flags));
    }
    dst
}

/// # Safety
/// C `memcmp` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    for i in 0..n {
        // SAFETY: the caller guarantees both ranges hold n bytes; volatile
        // keeps this loop from being turned into a memcmp call.
        let (x, y) = unsafe { (a.add(i).read_volatile(), b.add(i).read_volatile()) };
        if x != y {
            return x as i32 - y as i32;
        }
    }
    0
}

/// # Safety
/// C `bcmp` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}

const SYS_SOCKET: usize = 41;
const SYS_CONNECT: usize = 42;
const SYS_SHUTDOWN: usize = 48;
const SHUT_WR: usize = 1;
const AF_VSOCK: usize = 40;
const SOCK_STREAM: usize = 1;
const SOCK_CLOEXEC: usize = 0o2000000;
/// The host's context ID: where a guest's vsock connections go.
const VMADDR_CID_HOST: u32 = 2;

/// `struct sockaddr_vm`.
#[repr(C)]
struct SockaddrVm {
    family: u16,
    reserved1: u16,
    port: u32,
    cid: u32,
    flags: u8,
    zero: [u8; 3],
}

/// A vsock stream connected to the host's `port`.
pub fn vsock_connect(port: u32) -> Result<Fd, Errno> {
    let fd = call(
        SYS_SOCKET,
        [AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0, 0, 0, 0],
    )? as Fd;
    let addr = SockaddrVm {
        family: AF_VSOCK as u16,
        reserved1: 0,
        port,
        cid: VMADDR_CID_HOST,
        flags: 0,
        zero: [0; 3],
    };
    let len = core::mem::size_of::<SockaddrVm>();
    // The address is a live value of the size given.
    match call(
        SYS_CONNECT,
        [
            fd as usize,
            &addr as *const SockaddrVm as usize,
            len,
            0,
            0,
            0,
        ],
    ) {
        Ok(_) => Ok(fd),
        Err(e) => {
            close(fd);
            Err(e)
        }
    }
}

/// Ends what this side of socket `fd` sends (its peer reads an end), for
/// every descriptor of it.
pub fn shutdown_write(fd: Fd) {
    let _ = call(SYS_SHUTDOWN, [fd as usize, SHUT_WR, 0, 0, 0, 0]);
}
