//! The FUSE server behind virtio-fs: a passthrough of one host directory.
//!
//! # Confinement
//!
//! The guest is the adversary; the host tree as the user gave it is not.
//! Every inode the guest knows is an `O_PATH` descriptor, and every name the
//! guest sends is one path component (no `/`, never `.` or `..`) looked up
//! relative to its parent's descriptor with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` and `O_NOFOLLOW`. So the
//! server never follows a symlink: the guest's kernel reads a link's target
//! (READLINK) and resolves it in the guest's own namespace, where an absolute
//! target or a run of `..` stays inside the share as it is mounted there.
//! Data is reached through `/proc/self/fd/N` of an inode already held (the
//! only magic link used, and never one the guest names), and only for
//! regular files and directories, so a guest cannot make the I/O thread
//! open a FIFO or a device node on the host (nor create one: MKNOD makes
//! regular files, FIFOs and sockets only). Mount points inside DIR are the
//! host's own choice and are crossed like directories (virtiofsd does the
//! same); the guest cannot create one.
//!
//! # Whose request
//!
//! Every request carries the uid and gid of the guest process behind it.
//! When ember runs as root, the I/O thread serves each request as that
//! caller: its fsuid and fsgid become the caller's (`setfsuid`/`setfsgid`,
//! which change the calling thread's credentials only), so what the guest
//! creates is owned by the guest's user and the host's own permission checks
//! (modes, ACLs, sticky and setgid directories, clearing set-user-ID bits on
//! a write) are made for that user too. Leaving fsuid 0 drops the thread's
//! file capabilities (`CAP_DAC_OVERRIDE`, `CAP_FOWNER`, `CAP_CHOWN`...), and
//! going back to 0 regains them. The request carries no supplementary
//! groups, so the thread drops its own (ember's) the first time it serves
//! a caller other than root. Creating as root and `fchownat` afterwards would
//! check nothing (root may write anywhere) and leave a moment where the new
//! file is root's; a switch costs two `setfsuid`/`setfsgid` pairs and is
//! made only when the caller differs from the last request's, so a guest
//! whose work is done by one user pays nothing per request. A request whose
//! switch fails (a uid not mapped in ember's user namespace) is refused with
//! `EPERM` rather than served as root. When ember is not root, the thread
//! cannot switch and every request is served as ember's user: files the
//! guest creates belong to the user who started ember, and the guest sees
//! that user as its root and every other owner as the overflow id
//! (`idmap`, the view the QEMU backend's virtiofsd gives).
//!
//! # Node IDs across a snapshot
//!
//! A node ID is the server's, not the kernel's: the guest's FUSE client keeps
//! the IDs it was given in its dentries, and a restored guest still uses them.
//! So each inode remembers the path (relative to DIR) by which it was last
//! reached, kept up to date through RENAME; the snapshot records the table
//! (ID, kind, lookup count, path) and the open handles (ID, node, flags), and
//! a restore rebuilds it without opening anything: each inode and handle is
//! re-opened by its path on its first use, under the same `openat2` rules, and
//! one whose path is gone (or now names a different kind of file) answers
//! `ESTALE`. The restore stays as fast with a share as without.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::abi::{self, *};
use super::idmap::IdMap;

/// The most bytes one READ or WRITE moves (INIT's `max_write`, and
/// `max_pages` × 4 KiB for reads).
pub(crate) const MAX_IO: u32 = 1 << 20;
/// The most inodes and open handles the guest may hold: past them a lookup or
/// an open fails with `ENFILE` instead of growing host memory without end.
pub(crate) const MAX_INODES: usize = 1 << 20;
pub(crate) const MAX_HANDLES: usize = 1 << 16;
/// How long the guest may trust an entry or attributes: a share can change
/// on the host at any time, so not long.
const VALID_SECS: u64 = 1;

const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;
const CONFINED: u64 = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;

/// `struct open_how` (openat2(2)).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

type Errno = i32;
type Res<T> = Result<T, Errno>;

fn last_errno() -> Errno {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// A syscall's `-1` as the errno it set.
fn check(ret: libc::c_long) -> Res<libc::c_long> {
    if ret < 0 { Err(last_errno()) } else { Ok(ret) }
}

fn cstring(b: &[u8]) -> Res<CString> {
    CString::new(b).map_err(|_| libc::EINVAL)
}

/// `openat2(dir, name, how)`: the one way a name from the guest becomes a
/// descriptor.
fn openat2(dir: RawFd, name: &[u8], flags: i32, mode: u32) -> Res<OwnedFd> {
    let name = cstring(name)?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: u64::from(mode),
        resolve: CONFINED,
    };
    // SAFETY: `name` is NUL-terminated and `how` a valid open_how of the size passed.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            name.as_ptr(),
            &how as *const OpenHow,
            size_of::<OpenHow>(),
        )
    })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn fstat(fd: RawFd) -> Res<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: an empty path with AT_EMPTY_PATH stats `fd` itself into `st`.
    check(unsafe {
        libc::fstatat(
            fd,
            c"".as_ptr(),
            st.as_mut_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    } as libc::c_long)?;
    // SAFETY: fstatat succeeded and filled it.
    Ok(unsafe { st.assume_init() })
}

fn stat_at(dir: RawFd, name: &[u8]) -> Res<libc::stat> {
    let name = cstring(name)?;
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `name` is NUL-terminated; `st` is written on success.
    check(unsafe {
        libc::fstatat(
            dir,
            name.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    } as libc::c_long)?;
    // SAFETY: fstatat succeeded and filled it.
    Ok(unsafe { st.assume_init() })
}

/// The guest's view of `st`: its owner and group through `map`.
fn attr(st: &libc::stat, map: IdMap) -> Attr {
    Attr {
        ino: st.st_ino,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: st.st_atime as u64,
        mtime: st.st_mtime as u64,
        ctime: st.st_ctime as u64,
        atimensec: st.st_atime_nsec as u32,
        mtimensec: st.st_mtime_nsec as u32,
        ctimensec: st.st_ctime_nsec as u32,
        mode: st.st_mode,
        nlink: st.st_nlink as u32,
        uid: map.uid_to_guest(st.st_uid),
        gid: map.gid_to_guest(st.st_gid),
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

fn push<T: IntoBytes + Immutable>(out: &mut Vec<u8>, v: &T) {
    out.extend_from_slice(v.as_bytes());
}

/// The struct at the start of `arg`, and what follows it.
fn take<T: FromBytes + KnownLayout + Immutable>(arg: &[u8]) -> Res<(T, &[u8])> {
    T::read_from_prefix(arg).map_err(|_| libc::EINVAL)
}

/// A NUL-terminated name at the start of `arg`, and what follows it.
fn name(arg: &[u8]) -> Res<(&[u8], &[u8])> {
    let end = arg.iter().position(|&b| b == 0).ok_or(libc::EINVAL)?;
    Ok((&arg[..end], &arg[end + 1..]))
}

/// One path component, nothing that could climb or descend further.
fn component(name: &[u8]) -> Res<&[u8]> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return Err(libc::EINVAL);
    }
    if name.len() > 255 {
        return Err(libc::ENAMETOOLONG);
    }
    Ok(name)
}

fn join(parent: &str, name: &[u8]) -> Option<String> {
    let name = std::str::from_utf8(name).ok()?;
    Some(if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}/{name}")
    })
}

struct Inode {
    /// `None` after a restore, until first used.
    fd: Option<OwnedFd>,
    /// (st_dev, st_ino), once opened.
    id: Option<(u64, u64)>,
    /// `st_mode & S_IFMT`.
    kind: u32,
    lookups: u64,
    /// Relative to DIR (empty for DIR itself); `None` once unlinked or when
    /// not UTF-8: such an inode does not survive a restore.
    path: Option<String>,
}

struct Handle {
    node: u64,
    /// `None` after a restore, until first used.
    file: Option<File>,
    flags: i32,
}

/// Why a snapshot's table is refused.
#[derive(Debug, Error)]
pub enum StateError {
    /// More than the server would ever hold.
    #[error("too many inodes or handles")]
    TooMany,
    /// A node ID or file handle the server could not have given out.
    #[error("node ID or file handle {0} out of range")]
    OutOfRange(u64),
    /// A path that leads out of the share.
    #[error("inode path {0:?} is not beneath the share")]
    Escapes(String),
}

/// What a snapshot records of the server (see the module's doc).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsState {
    inodes: Vec<InodeState>,
    handles: Vec<HandleState>,
    next_node: u64,
    next_fh: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct InodeState {
    node: u64,
    kind: u32,
    lookups: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandleState {
    fh: u64,
    node: u64,
    flags: i32,
}

impl FsState {
    /// Checks what a snapshot file could hold wrong.
    pub(crate) fn check(&self) -> Result<(), StateError> {
        if self.inodes.len() > MAX_INODES || self.handles.len() > MAX_HANDLES {
            return Err(StateError::TooMany);
        }
        for i in &self.inodes {
            if i.node <= ROOT_ID || i.node >= self.next_node {
                return Err(StateError::OutOfRange(i.node));
            }
            if let Some(p) = &i.path {
                if p.starts_with('/') || p.split('/').any(|c| c == ".." || c == ".") {
                    return Err(StateError::Escapes(p.clone()));
                }
            }
        }
        if let Some(h) = self.handles.iter().find(|h| h.fh >= self.next_fh) {
            return Err(StateError::OutOfRange(h.fh));
        }
        Ok(())
    }
}

/// What one request produced: a reply (its payload in the caller's buffer),
/// or none (FORGET, INTERRUPT).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    Payload,
    None,
}

/// The identity a request is served as: (fsuid, fsgid).
type Ids = (u32, u32);

thread_local! {
    /// The caller this thread now serves requests as (`None`: its own
    /// identity), and whether it has dropped its supplementary groups.
    static SERVING_AS: std::cell::Cell<(Option<Ids>, bool)> =
        const { std::cell::Cell::new((None, false)) };
}

/// The calling thread's file-system identity becomes `ids` (`None`: `own`,
/// ember's). Checked: a switch the kernel refused is `EPERM`.
fn serve_as(ids: Option<Ids>, own: Ids) -> Res<()> {
    let (current, groups_dropped) = SERVING_AS.get();
    if current == ids {
        return Ok(());
    }
    let (uid, gid) = ids.unwrap_or(own);
    if !groups_dropped && ids.is_some_and(|(u, _)| u != 0) {
        // The raw syscall, not libc's setgroups: that one changes every
        // thread of the process.
        // SAFETY: an empty list (no pointer read).
        check(unsafe { libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) })
            .map_err(|_| libc::EPERM)?;
        SERVING_AS.set((current, true));
    }
    // Neither call reports failure: each returns the previous value, so
    // the result is read back with an invalid id (which changes nothing).
    // SAFETY: plain syscalls changing this thread's credentials only.
    let (u, g) = unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
        (
            libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32,
            libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32,
        )
    };
    let (_, groups_dropped) = SERVING_AS.get();
    if (u, g) != (uid, gid) {
        // Whatever it is now, it is not what was asked.
        SERVING_AS.set((Some((u, g)), groups_dropped));
        return Err(libc::EPERM);
    }
    SERVING_AS.set((ids, groups_dropped));
    Ok(())
}

/// The calling thread serves as ember's own user again (after a run of
/// requests on a thread that goes on doing other things: the fuzz target,
/// the unit tests).
#[cfg(any(test, fuzzing))]
pub(crate) fn serve_as_self() {
    // SAFETY: geteuid/getegid cannot fail.
    let own = unsafe { (libc::geteuid(), libc::getegid()) };
    let _ = serve_as(None, own);
}

/// The passthrough file system over one directory.
pub(crate) struct Server {
    root: OwnedFd,
    proc_fd: OwnedFd,
    read_only: bool,
    /// ember's (euid, egid) when it is root: requests are served as their
    /// guest caller (see the module's doc); `None` when it is not.
    switch_from: Option<Ids>,
    /// How owners appear in the guest (see `idmap`).
    id_map: IdMap,
    inodes: HashMap<u64, Inode>,
    ids: HashMap<(u64, u64), u64>,
    next_node: u64,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    /// Restored inodes not opened yet, by path: a lookup that reaches one
    /// answers with its node ID, not a second one for the same file.
    pending: HashMap<String, u64>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("inodes", &self.inodes.len())
            .field("handles", &self.handles.len())
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Server {
    /// A server for `dir` (a directory), nothing looked up yet.
    pub(crate) fn new(dir: &Path, read_only: bool) -> std::io::Result<Self> {
        Self::with_id_map(dir, read_only, IdMap::of_process())
    }

    /// A server for `dir` showing owners through `id_map`; requests are
    /// served as their callers only when it is the identity and ember root.
    pub(crate) fn with_id_map(dir: &Path, read_only: bool, id_map: IdMap) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let open_path = |p: &Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
                .open(p)
                .map(OwnedFd::from)
        };
        let root = open_path(dir)?;
        let proc_fd = open_path(Path::new("/proc/self/fd"))?;
        let st = fstat(root.as_raw_fd()).map_err(std::io::Error::from_raw_os_error)?;
        let id = (st.st_dev, st.st_ino);
        // SAFETY: geteuid/getegid cannot fail.
        let own = unsafe { (libc::geteuid(), libc::getegid()) };
        let mut server = Server {
            root,
            proc_fd,
            read_only,
            switch_from: (own.0 == 0 && id_map == IdMap::Identity).then_some(own),
            id_map,
            inodes: HashMap::new(),
            ids: HashMap::new(),
            next_node: ROOT_ID + 1,
            handles: HashMap::new(),
            next_fh: 1,
            pending: HashMap::new(),
        };
        let fd = server.root.try_clone()?;
        server.inodes.insert(
            ROOT_ID,
            Inode {
                fd: Some(fd),
                id: Some(id),
                kind: libc::S_IFDIR,
                lookups: 1,
                path: Some(String::new()),
            },
        );
        server.ids.insert(id, ROOT_ID);
        Ok(server)
    }

    /// The server as a snapshot records it.
    pub(crate) fn state(&self) -> FsState {
        let mut inodes: Vec<_> = self
            .inodes
            .iter()
            .filter(|(n, _)| **n != ROOT_ID)
            .map(|(&node, i)| InodeState {
                node,
                kind: i.kind,
                lookups: i.lookups,
                path: i.path.clone(),
            })
            .collect();
        inodes.sort_by_key(|i| i.node);
        let mut handles: Vec<_> = self
            .handles
            .iter()
            .map(|(&fh, h)| HandleState {
                fh,
                node: h.node,
                flags: h.flags,
            })
            .collect();
        handles.sort_by_key(|h| h.fh);
        FsState {
            inodes,
            handles,
            next_node: self.next_node,
            next_fh: self.next_fh,
        }
    }

    /// Takes a snapshot's table over; nothing is opened until used.
    pub(crate) fn restore(&mut self, state: &FsState) -> Result<(), StateError> {
        state.check()?;
        self.forget_all();
        for i in &state.inodes {
            self.inodes.insert(
                i.node,
                Inode {
                    fd: None,
                    id: None,
                    kind: i.kind,
                    lookups: i.lookups,
                    path: i.path.clone(),
                },
            );
        }
        for h in &state.handles {
            self.handles.insert(
                h.fh,
                Handle {
                    node: h.node,
                    file: None,
                    flags: h.flags,
                },
            );
        }
        self.next_node = state.next_node;
        self.next_fh = state.next_fh;
        self.index_pending();
        Ok(())
    }

    /// Drops every inode but the root and every handle (the driver reset the
    /// device, or the guest unmounted).
    pub(crate) fn forget_all(&mut self) {
        self.pending.clear();
        self.handles.clear();
        self.inodes.retain(|&n, _| n == ROOT_ID);
        self.ids.retain(|_, n| *n == ROOT_ID);
    }

    /// Serves one request: `arg` is what follows its header. A reply's
    /// payload (after the out header) goes into `out`, at most `out_cap`
    /// bytes of it.
    ///
    /// One function: the dispatch on the opcode, one short arm per FUSE
    /// request, with who may do it (writable, may_create) checked in the arm.
    pub(crate) fn handle(
        &mut self,
        h: &InHeader,
        arg: &[u8],
        out: &mut Vec<u8>,
        out_cap: usize,
    ) -> Res<Reply> {
        out.clear();
        let node = h.nodeid;
        let touches_files = !matches!(
            h.opcode,
            abi::INIT
                | abi::DESTROY
                | abi::FORGET
                | abi::BATCH_FORGET
                | abi::INTERRUPT
                | abi::RELEASE
                | abi::RELEASEDIR
                | abi::FLUSH
        );
        if let (Some(own), true) = (self.switch_from, touches_files) {
            let caller = (h.uid, h.gid);
            serve_as((caller != own).then_some(caller), own)?;
        }
        match h.opcode {
            abi::INIT => self.init(arg, out)?,
            abi::DESTROY => self.forget_all(),
            abi::LOOKUP => {
                let (n, _) = name(arg)?;
                let e = self.lookup(node, n)?;
                push(out, &e);
            }
            abi::FORGET => {
                let (f, _) = take::<ForgetIn>(arg)?;
                self.forget(node, f.nlookup);
                return Ok(Reply::None);
            }
            abi::BATCH_FORGET => {
                self.batch_forget(arg)?;
                return Ok(Reply::None);
            }
            abi::INTERRUPT => return Ok(Reply::None),
            abi::GETATTR => {
                let fd = self.inode_fd(node)?;
                push(out, &attr_out(&fstat(fd)?, self.id_map));
            }
            abi::SETATTR => {
                let (s, _) = take::<SetattrIn>(arg)?;
                self.setattr(node, &s)?;
                let fd = self.inode_fd(node)?;
                push(out, &attr_out(&fstat(fd)?, self.id_map));
            }
            abi::READLINK => self.readlink(node, out)?,
            abi::SYMLINK => {
                self.may_create(h)?;
                self.symlink(node, arg, out)?;
            }
            abi::MKNOD => {
                self.may_create(h)?;
                self.mknod(node, arg, out)?;
            }
            abi::MKDIR => {
                self.may_create(h)?;
                self.mkdir(node, arg, out)?;
            }
            abi::UNLINK | abi::RMDIR => {
                self.writable()?;
                self.unlink(node, arg, h.opcode == abi::RMDIR)?;
            }
            abi::RENAME => {
                let (r, rest) = take::<RenameIn>(arg)?;
                self.rename(node, r.newdir, rest, 0)?;
            }
            abi::RENAME2 => {
                let (r, rest) = take::<Rename2In>(arg)?;
                self.rename(node, r.newdir, rest, r.flags)?;
            }
            abi::LINK => {
                self.writable()?;
                self.link(node, arg, out)?;
            }
            abi::OPEN | abi::OPENDIR => {
                self.open_request(node, arg, h.opcode == abi::OPENDIR, out)?
            }
            abi::CREATE => {
                self.may_create(h)?;
                self.create(node, arg, out)?;
            }
            abi::READ => self.read(arg, out, out_cap)?,
            abi::WRITE => {
                self.writable()?;
                self.write(arg, out)?;
            }
            abi::STATFS => self.statfs(node, out)?,
            abi::RELEASE | abi::RELEASEDIR => {
                let (r, _) = take::<ReleaseIn>(arg)?;
                self.handles.remove(&r.fh);
            }
            abi::FLUSH => {}
            abi::FSYNC | abi::FSYNCDIR => self.fsync(arg)?,
            abi::READDIR => {
                let (r, _) = take::<ReadIn>(arg)?;
                let size = (r.size.min(MAX_IO) as usize).min(out_cap);
                let fd = self.handle_fd(r.fh)?;
                readdir(fd, r.offset, size, out)?;
            }
            abi::FALLOCATE => {
                self.writable()?;
                self.fallocate(arg)?;
            }
            abi::LSEEK => self.lseek(arg, out)?,
            // ACCESS never comes (virtio-fs mounts with default_permissions);
            // ENOSYS makes the kernel stop asking for the rest.
            _ => return Err(libc::ENOSYS),
        }
        Ok(Reply::Payload)
    }

    fn batch_forget(&mut self, arg: &[u8]) -> Res<()> {
        let (b, mut rest) = take::<BatchForgetIn>(arg)?;
        for _ in 0..b.count {
            let Ok((f, r)) = take::<ForgetOne>(rest) else {
                break;
            };
            self.forget(f.nodeid, f.nlookup);
            rest = r;
        }
        Ok(())
    }

    fn readlink(&mut self, node: u64, out: &mut Vec<u8>) -> Res<()> {
        let fd = self.inode_fd(node)?;
        out.resize(libc::PATH_MAX as usize, 0);
        // SAFETY: `out` has room for the length passed; "" with an
        // O_PATH descriptor of a symlink reads that link.
        let n =
            check(
                unsafe { libc::readlinkat(fd, c"".as_ptr(), out.as_mut_ptr().cast(), out.len()) }
                    as libc::c_long,
            )?;
        out.truncate(n as usize);
        Ok(())
    }

    fn symlink(&mut self, node: u64, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (n, rest) = name(arg)?;
        let (target, _) = name(rest)?;
        let dir = self.inode_fd(node)?;
        let (n_c, t_c) = (cstring(component(n)?)?, cstring(target)?);
        // SAFETY: both strings are NUL-terminated.
        check(unsafe { libc::symlinkat(t_c.as_ptr(), dir, n_c.as_ptr()) }.into())?;
        push(out, &self.lookup(node, n)?);
        Ok(())
    }

    fn mknod(&mut self, node: u64, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (m, rest) = take::<MknodIn>(arg)?;
        let (n, _) = name(rest)?;
        let kind = m.mode & libc::S_IFMT;
        // Device nodes on the host are not the guest's to make.
        if ![libc::S_IFREG, libc::S_IFIFO, libc::S_IFSOCK, 0].contains(&kind) {
            return Err(libc::EPERM);
        }
        let dir = self.inode_fd(node)?;
        let n_c = cstring(component(n)?)?;
        // SAFETY: `n_c` is NUL-terminated.
        check(unsafe { libc::mknodat(dir, n_c.as_ptr(), m.mode & !m.umask, 0) }.into())?;
        push(out, &self.lookup(node, n)?);
        Ok(())
    }

    fn mkdir(&mut self, node: u64, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (m, rest) = take::<MkdirIn>(arg)?;
        let (n, _) = name(rest)?;
        let dir = self.inode_fd(node)?;
        let n_c = cstring(component(n)?)?;
        // SAFETY: `n_c` is NUL-terminated.
        check(unsafe { libc::mkdirat(dir, n_c.as_ptr(), m.mode & !m.umask) }.into())?;
        push(out, &self.lookup(node, n)?);
        Ok(())
    }

    fn unlink(&mut self, node: u64, arg: &[u8], rmdir: bool) -> Res<()> {
        let (n, _) = name(arg)?;
        let dir = self.inode_fd(node)?;
        let n = component(n)?;
        let gone = stat_at(dir, n).ok();
        let n_c = cstring(n)?;
        let flags = if rmdir { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: `n_c` is NUL-terminated.
        check(unsafe { libc::unlinkat(dir, n_c.as_ptr(), flags) }.into())?;
        if let Some(st) = gone {
            self.unlinked(&st);
        }
        Ok(())
    }

    fn link(&mut self, node: u64, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (l, rest) = take::<LinkIn>(arg)?;
        let (n, _) = name(rest)?;
        let src = self.inode_fd(l.oldnodeid)?;
        let dir = self.inode_fd(node)?;
        let n_c = cstring(component(n)?)?;
        let src_c = cstring(src.to_string().as_bytes())?;
        // SAFETY: both names are NUL-terminated; following the
        // /proc/self/fd magic link reaches the inode we hold.
        let r = unsafe {
            libc::linkat(
                self.proc_fd.as_raw_fd(),
                src_c.as_ptr(),
                dir,
                n_c.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        check(r.into())?;
        push(out, &self.lookup(node, n)?);
        Ok(())
    }

    /// OPEN and OPENDIR: a directory is opened read-only, whatever the flags.
    fn open_request(&mut self, node: u64, arg: &[u8], dir: bool, out: &mut Vec<u8>) -> Res<()> {
        let (o, _) = take::<OpenIn>(arg)?;
        let flags = if dir {
            libc::O_RDONLY | libc::O_DIRECTORY
        } else {
            o.flags as i32
        };
        let fh = self.open(node, flags, dir)?;
        push(out, &open_out(fh));
        Ok(())
    }

    fn create(&mut self, node: u64, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (c, rest) = take::<CreateIn>(arg)?;
        let (n, _) = name(rest)?;
        let dir = self.inode_fd(node)?;
        let flags = open_flags(c.flags as i32) | libc::O_CREAT | libc::O_NOFOLLOW;
        // The guest's mode carries S_IFREG; openat2 takes permission bits only.
        let mode = c.mode & !c.umask & 0o7777;
        let file = File::from(openat2(dir, component(n)?, flags, mode)?);
        let entry = self.lookup(node, n)?;
        let fh = self.add_handle(entry.nodeid, Some(file), flags & !libc::O_CREAT)?;
        push(out, &entry);
        push(out, &open_out(fh));
        Ok(())
    }

    fn read(&mut self, arg: &[u8], out: &mut Vec<u8>, out_cap: usize) -> Res<()> {
        let (r, _) = take::<ReadIn>(arg)?;
        let size = (r.size.min(MAX_IO) as usize).min(out_cap);
        let fd = self.handle_fd(r.fh)?;
        out.resize(size, 0);
        let mut done = 0;
        while done < size {
            // SAFETY: `out[done..size]` is writable and in bounds.
            let n = check(unsafe {
                libc::pread(
                    fd,
                    out[done..].as_mut_ptr().cast(),
                    size - done,
                    (r.offset + done as u64) as libc::off_t,
                )
            } as libc::c_long);
            match n {
                Ok(0) => break,
                Ok(n) => done += n as usize,
                Err(libc::EINTR) => {}
                Err(e) if done == 0 => return Err(e),
                Err(_) => break,
            }
        }
        out.truncate(done);
        Ok(())
    }

    fn write(&mut self, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (w, data) = take::<WriteIn>(arg)?;
        let size = (w.size as usize).min(data.len());
        let fd = self.handle_fd(w.fh)?;
        let mut done = 0;
        while done < size {
            // SAFETY: `data[done..size]` is readable and in bounds.
            let n = check(unsafe {
                libc::pwrite(
                    fd,
                    data[done..size].as_ptr().cast(),
                    size - done,
                    (w.offset + done as u64) as libc::off_t,
                )
            } as libc::c_long);
            match n {
                Ok(n) => done += n as usize,
                Err(libc::EINTR) => {}
                Err(e) if done == 0 => return Err(e),
                Err(_) => break,
            }
        }
        push(
            out,
            &WriteOut {
                size: done as u32,
                padding: 0,
            },
        );
        Ok(())
    }

    fn statfs(&mut self, node: u64, out: &mut Vec<u8>) -> Res<()> {
        let fd = self.inode_fd(node)?;
        let mut s = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: `s` is written on success.
        check(unsafe { libc::fstatfs(fd, s.as_mut_ptr()) }.into())?;
        // SAFETY: fstatfs succeeded and filled it.
        let s = unsafe { s.assume_init() };
        push(
            out,
            &StatfsOut {
                blocks: s.f_blocks,
                bfree: s.f_bfree,
                bavail: s.f_bavail,
                files: s.f_files,
                ffree: s.f_ffree,
                bsize: s.f_bsize as u32,
                namelen: s.f_namelen as u32,
                frsize: s.f_frsize as u32,
                ..Default::default()
            },
        );
        Ok(())
    }

    fn fsync(&mut self, arg: &[u8]) -> Res<()> {
        let (f, _) = take::<FsyncIn>(arg)?;
        let fd = self.handle_fd(f.fh)?;
        // SAFETY: plain syscalls on a descriptor we hold.
        let r = unsafe {
            if f.fsync_flags & 1 != 0 {
                libc::fdatasync(fd)
            } else {
                libc::fsync(fd)
            }
        };
        check(r.into())?;
        Ok(())
    }

    fn lseek(&mut self, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (l, _) = take::<LseekIn>(arg)?;
        let fd = self.handle_fd(l.fh)?;
        // SAFETY: a plain syscall on a descriptor we hold.
        let off = check(unsafe { libc::lseek(fd, l.offset as libc::off_t, l.whence as i32) })?;
        push(out, &LseekOut { offset: off as u64 });
        Ok(())
    }

    fn fallocate(&mut self, arg: &[u8]) -> Res<()> {
        let (f, _) = take::<FallocateIn>(arg)?;
        let fd = self.handle_fd(f.fh)?;
        // SAFETY: a plain syscall on a descriptor we hold.
        let r = unsafe {
            libc::fallocate(
                fd,
                f.mode as i32,
                f.offset as libc::off_t,
                f.length as libc::off_t,
            )
        };
        check(r.into())?;
        Ok(())
    }

    fn init(&mut self, arg: &[u8], out: &mut Vec<u8>) -> Res<()> {
        let (i, _) = take::<InitIn>(arg)?;
        if i.major < KERNEL_VERSION {
            return Err(libc::EPROTO);
        }
        // A new session: whatever the last one held is gone.
        self.forget_all();
        let wanted = ASYNC_READ
            | ATOMIC_O_TRUNC
            | BIG_WRITES
            | AUTO_INVAL_DATA
            | PARALLEL_DIROPS
            | MAX_PAGES
            | CACHE_SYMLINKS;
        push(
            out,
            &InitOut {
                major: KERNEL_VERSION,
                minor: KERNEL_MINOR_VERSION,
                max_readahead: i.max_readahead,
                flags: i.flags & wanted,
                max_background: 64,
                congestion_threshold: 48,
                max_write: MAX_IO,
                time_gran: 1,
                max_pages: (MAX_IO / 4096) as u16,
                ..Default::default()
            },
        );
        Ok(())
    }

    /// A new file made for `h`'s caller must be one the guest can see as
    /// the caller's: one of the map's (see `idmap`).
    fn may_create(&self, h: &InHeader) -> Res<()> {
        self.writable()?;
        match (
            self.id_map.uid_to_host(h.uid),
            self.id_map.gid_to_host(h.gid),
        ) {
            (Some(_), Some(_)) => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }

    fn writable(&self) -> Res<()> {
        if self.read_only {
            Err(libc::EROFS)
        } else {
            Ok(())
        }
    }

    /// The `O_PATH` descriptor of `node`, opened by its path first if a
    /// restore left it closed.
    fn inode_fd(&mut self, node: u64) -> Res<RawFd> {
        let inode = self.inodes.get(&node).ok_or(libc::ESTALE)?;
        if let Some(fd) = &inode.fd {
            return Ok(fd.as_raw_fd());
        }
        let path = inode.path.clone().ok_or(libc::ESTALE)?;
        let fd = if path.is_empty() {
            self.root.try_clone().map_err(|_| libc::EMFILE)?
        } else {
            openat2(
                self.root.as_raw_fd(),
                path.as_bytes(),
                libc::O_PATH | libc::O_NOFOLLOW,
                0,
            )
            .map_err(|_| libc::ESTALE)?
        };
        let st = fstat(fd.as_raw_fd())?;
        let inode = self.inodes.get_mut(&node).ok_or(libc::ESTALE)?;
        if st.st_mode & libc::S_IFMT != inode.kind {
            return Err(libc::ESTALE);
        }
        let raw = fd.as_raw_fd();
        inode.fd = Some(fd);
        inode.id = Some((st.st_dev, st.st_ino));
        self.ids.entry((st.st_dev, st.st_ino)).or_insert(node);
        self.pending.remove(&path);
        Ok(raw)
    }

    /// `/proc/self/fd/N` of `node`, for the calls that take no `O_PATH`
    /// descriptor.
    fn proc_name(&mut self, node: u64) -> Res<CString> {
        let fd = self.inode_fd(node)?;
        cstring(fd.to_string().as_bytes())
    }

    fn lookup(&mut self, parent: u64, name: &[u8]) -> Res<EntryOut> {
        let name = component(name)?;
        let dir = self.inode_fd(parent)?;
        if self.inodes[&parent].kind != libc::S_IFDIR {
            return Err(libc::ENOTDIR);
        }
        let fd = openat2(dir, name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let st = fstat(fd.as_raw_fd())?;
        let id = (st.st_dev, st.st_ino);
        let path = self.inodes[&parent]
            .path
            .as_deref()
            .and_then(|p| join(p, name));
        let restored = path
            .as_ref()
            .and_then(|p| self.pending.get(p).copied())
            .filter(|n| {
                self.inodes
                    .get(n)
                    .is_some_and(|i| i.kind == st.st_mode & libc::S_IFMT)
            });
        if let (Some(node), None) = (restored, self.ids.get(&id)) {
            if let Some(p) = &path {
                self.pending.remove(p);
            }
            if let Some(inode) = self.inodes.get_mut(&node) {
                inode.fd = Some(fd);
                inode.id = Some(id);
                inode.lookups += 1;
                self.ids.insert(id, node);
                return Ok(entry(node, &st, self.id_map));
            }
        }
        let node = match self.ids.get(&id).copied() {
            Some(node) if self.inodes.contains_key(&node) => {
                let inode = self.inodes.get_mut(&node).ok_or(libc::ESTALE)?;
                if node != ROOT_ID {
                    inode.lookups += 1;
                }
                if inode.path.is_none() {
                    inode.path = path;
                }
                node
            }
            _ => {
                if self.inodes.len() >= MAX_INODES {
                    return Err(libc::ENFILE);
                }
                let node = self.next_node;
                self.next_node += 1;
                self.inodes.insert(
                    node,
                    Inode {
                        fd: Some(fd),
                        id: Some(id),
                        kind: st.st_mode & libc::S_IFMT,
                        lookups: 1,
                        path,
                    },
                );
                self.ids.insert(id, node);
                node
            }
        };
        Ok(entry(node, &st, self.id_map))
    }

    /// Indexes the inodes a restore left closed by their paths.
    fn index_pending(&mut self) {
        self.pending = self
            .inodes
            .iter()
            .filter(|(_, i)| i.fd.is_none())
            .filter_map(|(&n, i)| Some((i.path.clone()?, n)))
            .collect();
    }

    fn forget(&mut self, node: u64, n: u64) {
        if node == ROOT_ID {
            return;
        }
        let Some(inode) = self.inodes.get_mut(&node) else {
            return;
        };
        inode.lookups = inode.lookups.saturating_sub(n);
        if inode.lookups == 0 {
            let id = inode.id;
            if let Some(p) = &inode.path {
                if self.pending.get(p) == Some(&node) {
                    self.pending.remove(p);
                }
            }
            self.inodes.remove(&node);
            if let Some(id) = id {
                if self.ids.get(&id) == Some(&node) {
                    self.ids.remove(&id);
                }
            }
        }
    }

    /// The file at `st` lost a name: its path may now lead nowhere.
    fn unlinked(&mut self, st: &libc::stat) {
        if st.st_nlink > 1 && st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return;
        }
        if let Some(node) = self.ids.get(&(st.st_dev, st.st_ino)) {
            if let Some(inode) = self.inodes.get_mut(node) {
                inode.path = None;
            }
        }
    }

    fn rename(&mut self, old_dir: u64, new_dir: u64, arg: &[u8], flags: u32) -> Res<()> {
        self.writable()?;
        const NOREPLACE: u32 = 1;
        const EXCHANGE: u32 = 2;
        if flags & !(NOREPLACE | EXCHANGE) != 0 {
            return Err(libc::EINVAL);
        }
        let (old, rest) = name(arg)?;
        let (new, _) = name(rest)?;
        let (old, new) = (component(old)?, component(new)?);
        let from = self.inode_fd(old_dir)?;
        let to = self.inode_fd(new_dir)?;
        let (old_c, new_c) = (cstring(old)?, cstring(new)?);
        let replaced = stat_at(to, new).ok();
        // SAFETY: both names are NUL-terminated.
        check(unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                from,
                old_c.as_ptr(),
                to,
                new_c.as_ptr(),
                flags,
            )
        })?;
        let old_path = self.inodes[&old_dir]
            .path
            .as_deref()
            .and_then(|p| join(p, old));
        let new_path = self.inodes[&new_dir]
            .path
            .as_deref()
            .and_then(|p| join(p, new));
        if flags & EXCHANGE != 0 {
            // Both names still exist; swap what they lead to.
            let tmp = "\0".to_string();
            self.move_paths(old_path.as_deref(), Some(&tmp));
            self.move_paths(new_path.as_deref(), old_path.as_deref());
            self.move_paths(Some(&tmp), new_path.as_deref());
        } else {
            if let Some(st) = replaced {
                self.unlinked(&st);
            }
            self.move_paths(old_path.as_deref(), new_path.as_deref());
        }
        Ok(())
    }

    /// Every inode whose path is `from` or beneath it now lives at `to`
    /// (`None`: somewhere not known).
    fn move_paths(&mut self, from: Option<&str>, to: Option<&str>) {
        let Some(from) = from else { return };
        for inode in self.inodes.values_mut() {
            let Some(p) = &inode.path else { continue };
            let rest = if p == from {
                Some("")
            } else {
                p.strip_prefix(from).filter(|r| r.starts_with('/'))
            };
            if let Some(rest) = rest {
                inode.path = to.map(|t| format!("{t}{rest}"));
            }
        }
        if !self.pending.is_empty() {
            self.index_pending();
        }
    }

    fn setattr(&mut self, node: u64, s: &SetattrIn) -> Res<()> {
        self.writable()?;
        // An owner the map has no host id for is refused as chown(2)
        // refuses an id its user namespace does not map, before anything
        // else in the request is changed.
        let uid = if s.valid & FATTR_UID != 0 {
            self.id_map.uid_to_host(s.uid).ok_or(libc::EINVAL)?
        } else {
            u32::MAX
        };
        let gid = if s.valid & FATTR_GID != 0 {
            self.id_map.gid_to_host(s.gid).ok_or(libc::EINVAL)?
        } else {
            u32::MAX
        };
        let fd = self.inode_fd(node)?;
        let kind = self.inodes[&node].kind;
        let proc = self.proc_name(node)?;
        let proc_fd = self.proc_fd.as_raw_fd();
        let link = kind == libc::S_IFLNK;
        if s.valid & FATTR_MODE != 0 {
            if link {
                return Err(libc::EOPNOTSUPP);
            }
            // SAFETY: `proc` is NUL-terminated.
            check(unsafe { libc::fchmodat(proc_fd, proc.as_ptr(), s.mode & 0o7777, 0) }.into())?;
        }
        if s.valid & (FATTR_UID | FATTR_GID) != 0 {
            // SAFETY: "" with AT_EMPTY_PATH changes `fd` itself.
            let r = unsafe {
                libc::fchownat(
                    fd,
                    c"".as_ptr(),
                    uid,
                    gid,
                    libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
                )
            };
            check(r.into())?;
        }
        if s.valid & FATTR_SIZE != 0 {
            if kind != libc::S_IFREG {
                return Err(libc::EINVAL);
            }
            let handle = (s.valid & FATTR_FH != 0)
                .then(|| self.handle_fd(s.fh).ok())
                .flatten();
            let owned;
            let target = match handle {
                Some(h) => h,
                None => {
                    // SAFETY: `proc` is NUL-terminated.
                    let f = check(unsafe {
                        libc::openat(proc_fd, proc.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC)
                    } as libc::c_long)?;
                    // SAFETY: just opened, owned here.
                    owned = unsafe { OwnedFd::from_raw_fd(f as RawFd) };
                    owned.as_raw_fd()
                }
            };
            // SAFETY: a plain syscall on a descriptor we hold.
            check(unsafe { libc::ftruncate(target, s.size as libc::off_t) }.into())?;
        }
        if s.valid & (FATTR_ATIME | FATTR_MTIME) != 0 {
            if link {
                return Err(libc::EOPNOTSUPP);
            }
            let ts = |set: u32, now: u32, sec: u64, nsec: u32| libc::timespec {
                // `_`: time_t is deprecated as a name on musl (it is 64-bit there too).
                tv_sec: sec as _,
                tv_nsec: if s.valid & set == 0 {
                    libc::UTIME_OMIT
                } else if s.valid & now != 0 {
                    libc::UTIME_NOW
                } else {
                    i64::from(nsec)
                },
            };
            let times = [
                ts(FATTR_ATIME, FATTR_ATIME_NOW, s.atime, s.atimensec),
                ts(FATTR_MTIME, FATTR_MTIME_NOW, s.mtime, s.mtimensec),
            ];
            // SAFETY: `proc` is NUL-terminated and `times` two timespecs.
            check(unsafe { libc::utimensat(proc_fd, proc.as_ptr(), times.as_ptr(), 0) }.into())?;
        }
        Ok(())
    }

    fn open(&mut self, node: u64, flags: i32, dir: bool) -> Res<u64> {
        let kind = self.inodes.get(&node).ok_or(libc::ESTALE)?.kind;
        match (dir, kind) {
            (true, libc::S_IFDIR) | (false, libc::S_IFREG) => {}
            (false, libc::S_IFDIR) => return Err(libc::EISDIR),
            (true, _) => return Err(libc::ENOTDIR),
            // FIFOs, sockets and device nodes are the guest's own kernel's to open.
            _ => return Err(libc::ENXIO),
        }
        let flags = open_flags(flags);
        if !dir
            && (flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0)
            && self.read_only
        {
            return Err(libc::EROFS);
        }
        let file = self.reopen(node, flags)?;
        self.add_handle(node, Some(file), flags & !libc::O_TRUNC)
    }

    /// A new descriptor for `node` itself (through its /proc/self/fd link).
    fn reopen(&mut self, node: u64, flags: i32) -> Res<File> {
        let proc = self.proc_name(node)?;
        // SAFETY: `proc` is NUL-terminated.
        let fd = check(unsafe {
            libc::openat(
                self.proc_fd.as_raw_fd(),
                proc.as_ptr(),
                flags | libc::O_CLOEXEC,
            )
        } as libc::c_long)?;
        // SAFETY: just opened, owned by the File.
        Ok(unsafe { File::from_raw_fd(fd as RawFd) })
    }

    fn add_handle(&mut self, node: u64, file: Option<File>, flags: i32) -> Res<u64> {
        if self.handles.len() >= MAX_HANDLES {
            return Err(libc::ENFILE);
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle { node, file, flags });
        Ok(fh)
    }

    /// The descriptor of open handle `fh`, opened again if a restore left it
    /// closed.
    fn handle_fd(&mut self, fh: u64) -> Res<RawFd> {
        let h = self.handles.get(&fh).ok_or(libc::EBADF)?;
        if let Some(f) = &h.file {
            return Ok(f.as_raw_fd());
        }
        let (node, flags) = (h.node, h.flags);
        let kind = self.inodes.get(&node).ok_or(libc::ESTALE)?.kind;
        if kind != libc::S_IFREG && kind != libc::S_IFDIR {
            return Err(libc::ESTALE);
        }
        let file = self.reopen(
            node,
            flags & !(libc::O_TRUNC | libc::O_CREAT | libc::O_EXCL),
        )?;
        let raw = file.as_raw_fd();
        if let Some(h) = self.handles.get_mut(&fh) {
            h.file = Some(file);
        }
        Ok(raw)
    }
}

/// The open flags passed through to the host: access mode and data
/// semantics only (no creation, no following, no controlling terminal, no
/// O_DIRECT alignment rules the guest does not know about).
fn open_flags(flags: i32) -> i32 {
    flags
        & (libc::O_ACCMODE
            | libc::O_APPEND
            | libc::O_TRUNC
            | libc::O_SYNC
            | libc::O_DSYNC
            | libc::O_DIRECTORY
            | libc::O_EXCL)
}

fn entry(node: u64, st: &libc::stat, map: IdMap) -> EntryOut {
    EntryOut {
        nodeid: node,
        generation: 0,
        entry_valid: VALID_SECS,
        attr_valid: VALID_SECS,
        attr: attr(st, map),
        ..Default::default()
    }
}

fn attr_out(st: &libc::stat, map: IdMap) -> AttrOut {
    AttrOut {
        attr_valid: VALID_SECS,
        attr: attr(st, map),
        ..Default::default()
    }
}

/// READDIR: the entries of `fd` from `offset` (a `d_off` the guest was
/// given), as many whole `fuse_dirent`s as fit in `size` bytes.
fn readdir(fd: RawFd, offset: u64, size: usize, out: &mut Vec<u8>) -> Res<()> {
    // SAFETY: a plain syscall on a descriptor we hold.
    check(unsafe { libc::lseek(fd, offset as libc::off_t, libc::SEEK_SET) })?;
    // A linux_dirent64 is never larger than the fuse_dirent it becomes, so
    // `size` bytes of them are enough to fill the reply.
    let mut buf = vec![0u8; size.max(512)];
    // SAFETY: `buf` has room for the length passed.
    let n = check(unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) })?
        as usize;
    let mut pos = 0;
    while pos + 19 <= n {
        let ino = u64::from_ne_bytes(buf[pos..pos + 8].try_into().unwrap_or_default());
        let off = u64::from_ne_bytes(buf[pos + 8..pos + 16].try_into().unwrap_or_default());
        let reclen = usize::from(u16::from_ne_bytes([buf[pos + 16], buf[pos + 17]]));
        let typ = buf[pos + 18];
        if reclen < 19 || pos + reclen > n {
            break;
        }
        let name_bytes = &buf[pos + 19..pos + reclen];
        let name_len = name_bytes
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(name_bytes.len());
        let entry_len = (size_of::<Dirent>() + name_len).next_multiple_of(8);
        if out.len() + entry_len > size {
            break;
        }
        push(
            out,
            &Dirent {
                ino,
                off,
                namelen: name_len as u32,
                typ: u32::from(typ),
            },
        );
        out.extend_from_slice(&name_bytes[..name_len]);
        out.resize(out.len().next_multiple_of(8), 0);
        pos += reclen;
    }
    Ok(())
}

/// An OPEN or CREATE reply's open part for handle `fh`.
fn open_out(fh: u64) -> OpenOut {
    OpenOut {
        fh,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests;
