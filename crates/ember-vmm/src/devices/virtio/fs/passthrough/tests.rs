use super::super::idmap::OVERFLOW_ID;
use super::*;
use std::os::unix::fs::symlink;

/// A scratch tree: `share/` (what is shared) beside `outside/secret`.
struct Tree {
    top: PathBuf,
}

impl Tree {
    fn new() -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let top = std::env::temp_dir().join(format!(
            "ember-fs-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        let share = top.join("share");
        std::fs::create_dir_all(share.join("sub/deeper")).unwrap();
        std::fs::create_dir_all(top.join("outside")).unwrap();
        std::fs::write(top.join("outside/secret"), b"host secret").unwrap();
        std::fs::write(share.join("hello.txt"), b"hello, guest\n").unwrap();
        std::fs::write(share.join("sub/deeper/data"), vec![7u8; 10_000]).unwrap();
        symlink("/", share.join("abs")).unwrap();
        symlink("../outside/secret", share.join("rel")).unwrap();
        symlink("../../outside", share.join("sub/up")).unwrap();
        Tree { top }
    }
    fn share(&self) -> PathBuf {
        self.top.join("share")
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.top);
    }
}

use std::path::PathBuf;

fn hdr(opcode: u32, nodeid: u64) -> InHeader {
    InHeader {
        opcode,
        nodeid,
        unique: 7,
        ..Default::default()
    }
}

fn with_name(prefix: &[u8], name: &str) -> Vec<u8> {
    let mut v = prefix.to_vec();
    v.extend_from_slice(name.as_bytes());
    v.push(0);
    v
}

struct T {
    s: Server,
    out: Vec<u8>,
}

impl T {
    fn new(dir: &Path, ro: bool) -> Self {
        T {
            s: Server::new(dir, ro).unwrap(),
            out: Vec::new(),
        }
    }
    fn call(&mut self, op: u32, node: u64, arg: &[u8]) -> Res<Reply> {
        self.s.handle(&hdr(op, node), arg, &mut self.out, 1 << 21)
    }
    /// A request from the guest's `uid`/`gid`.
    fn call_as(&mut self, (uid, gid): (u32, u32), op: u32, node: u64, arg: &[u8]) -> Res<Reply> {
        let h = InHeader {
            uid,
            gid,
            ..hdr(op, node)
        };
        self.s.handle(&h, arg, &mut self.out, 1 << 21)
    }
    fn lookup(&mut self, parent: u64, name: &str) -> Res<EntryOut> {
        self.call(LOOKUP, parent, &with_name(&[], name))?;
        Ok(EntryOut::read_from_prefix(&self.out).unwrap().0)
    }
    fn open(&mut self, node: u64, flags: i32) -> Res<u64> {
        let arg = OpenIn {
            flags: flags as u32,
            open_flags: 0,
        };
        self.call(OPEN, node, arg.as_bytes())?;
        Ok(OpenOut::read_from_prefix(&self.out).unwrap().0.fh)
    }
    fn read(&mut self, fh: u64, offset: u64, size: u32) -> Res<Vec<u8>> {
        let arg = ReadIn {
            fh,
            offset,
            size,
            ..Default::default()
        };
        self.call(READ, 0, arg.as_bytes())?;
        Ok(self.out.clone())
    }
    fn write(&mut self, fh: u64, offset: u64, data: &[u8]) -> Res<u32> {
        let arg = WriteIn {
            fh,
            offset,
            size: data.len() as u32,
            ..Default::default()
        };
        let mut v = arg.as_bytes().to_vec();
        v.extend_from_slice(data);
        self.call(WRITE, 0, &v)?;
        Ok(WriteOut::read_from_prefix(&self.out).unwrap().0.size)
    }
    fn create(&mut self, parent: u64, name: &str) -> Res<(EntryOut, u64)> {
        let arg = CreateIn {
            flags: libc::O_RDWR as u32,
            // As Linux sends it: the file type too.
            mode: libc::S_IFREG | 0o644,
            umask: 0o022,
            ..Default::default()
        };
        self.call(CREATE, parent, &with_name(arg.as_bytes(), name))?;
        let (e, rest) = EntryOut::read_from_prefix(&self.out).unwrap();
        Ok((e, OpenOut::read_from_prefix(rest).unwrap().0.fh))
    }
    fn readlink(&mut self, node: u64) -> Vec<u8> {
        self.call(READLINK, node, &[]).unwrap();
        self.out.clone()
    }
    fn names(&mut self, dir: u64) -> Vec<String> {
        let arg = OpenIn::default();
        self.call(OPENDIR, dir, arg.as_bytes()).unwrap();
        let fh = OpenOut::read_from_prefix(&self.out).unwrap().0.fh;
        let mut names = Vec::new();
        let mut offset = 0;
        loop {
            // A small buffer, so entries are split over several calls.
            let r = ReadIn {
                fh,
                offset,
                size: 64,
                ..Default::default()
            };
            self.call(READDIR, 0, r.as_bytes()).unwrap();
            if self.out.is_empty() {
                break;
            }
            let mut rest = self.out.as_slice();
            while let Ok((d, tail)) = Dirent::read_from_prefix(rest) {
                let len = d.namelen as usize;
                names.push(String::from_utf8(tail[..len].to_vec()).unwrap());
                offset = d.off;
                let skip = (size_of::<Dirent>() + len).next_multiple_of(8);
                rest = &rest[skip.min(rest.len())..];
            }
        }
        names.sort();
        names
    }
}

#[test]
fn reads_a_tree_and_its_attributes() {
    let tree = Tree::new();
    let mut t = T::new(&tree.share(), false);
    let init = InitIn {
        major: 7,
        minor: 38,
        max_readahead: 1 << 17,
        flags: u32::MAX,
    };
    t.call(INIT, 0, init.as_bytes()).unwrap();
    let out = InitOut::read_from_prefix(&t.out).unwrap().0;
    assert_eq!((out.major, out.minor, out.max_write), (7, 31, MAX_IO));
    let e = t.lookup(ROOT_ID, "hello.txt").unwrap();
    assert_eq!(e.attr.size, 13);
    assert_eq!(e.attr.mode & libc::S_IFMT, libc::S_IFREG);
    let fh = t.open(e.nodeid, libc::O_RDONLY).unwrap();
    assert_eq!(t.read(fh, 0, 4096).unwrap(), b"hello, guest\n");
    assert_eq!(t.read(fh, 7, 5).unwrap(), b"guest");
    // The same file looked up again is the same node.
    assert_eq!(t.lookup(ROOT_ID, "hello.txt").unwrap().nodeid, e.nodeid);
    let sub = t.lookup(ROOT_ID, "sub").unwrap().nodeid;
    let deeper = t.lookup(sub, "deeper").unwrap().nodeid;
    let data = t.lookup(deeper, "data").unwrap();
    let fh = t.open(data.nodeid, libc::O_RDONLY).unwrap();
    assert_eq!(t.read(fh, 0, 1 << 20).unwrap(), vec![7u8; 10_000]);
    assert_eq!(
        t.names(ROOT_ID),
        [".", "..", "abs", "hello.txt", "rel", "sub"]
    );
    assert_eq!(t.lookup(ROOT_ID, "nope").unwrap_err(), libc::ENOENT);
}

#[test]
fn nothing_leads_out_of_the_share() {
    let tree = Tree::new();
    let mut t = T::new(&tree.share(), false);
    for bad in ["..", ".", "sub/..", "../outside", "/etc", ""] {
        assert_eq!(t.lookup(ROOT_ID, bad).unwrap_err(), libc::EINVAL, "{bad}");
    }
    // Symlinks are handed to the guest as links, never followed here.
    for (name, target) in [("abs", "/"), ("rel", "../outside/secret")] {
        let e = t.lookup(ROOT_ID, name).unwrap();
        assert_eq!(e.attr.mode & libc::S_IFMT, libc::S_IFLNK);
        assert_eq!(t.readlink(e.nodeid), target.as_bytes());
        assert_eq!(t.open(e.nodeid, libc::O_RDONLY).unwrap_err(), libc::ENXIO);
        assert_eq!(t.lookup(e.nodeid, "secret").unwrap_err(), libc::ENOTDIR);
    }
    let sub = t.lookup(ROOT_ID, "sub").unwrap().nodeid;
    let up = t.lookup(sub, "up").unwrap().nodeid;
    assert_eq!(t.lookup(up, "secret").unwrap_err(), libc::ENOTDIR);
    assert_eq!(t.lookup(sub, "..").unwrap_err(), libc::EINVAL);
    // Creating through a symlink (O_NOFOLLOW) or with a path is refused.
    assert_eq!(t.create(ROOT_ID, "rel").unwrap_err(), libc::ELOOP);
    assert_eq!(t.create(ROOT_ID, "../escape").unwrap_err(), libc::EINVAL);
    let arg = MkdirIn {
        mode: 0o755,
        umask: 0,
    };
    assert_eq!(
        t.call(MKDIR, ROOT_ID, &with_name(arg.as_bytes(), ".."))
            .unwrap_err(),
        libc::EINVAL
    );
    // A rename cannot move a file out.
    let mut arg = RenameIn { newdir: ROOT_ID }.as_bytes().to_vec();
    arg.extend_from_slice(b"hello.txt\0../moved\0");
    assert_eq!(t.call(RENAME, ROOT_ID, &arg).unwrap_err(), libc::EINVAL);
    // Device nodes are not the guest's to make.
    let arg = MknodIn {
        mode: libc::S_IFBLK | 0o600,
        rdev: 0x800,
        ..Default::default()
    };
    assert_eq!(
        t.call(MKNOD, ROOT_ID, &with_name(arg.as_bytes(), "sda"))
            .unwrap_err(),
        libc::EPERM
    );
    // A node ID the server never gave out is nothing.
    assert_eq!(t.call(GETATTR, 999, &[]).unwrap_err(), libc::ESTALE);
    assert!(tree.top.join("outside/secret").exists());
    assert!(!tree.top.join("moved").exists());
}

#[test]
fn writes_and_a_read_only_share_refuses_them() {
    let tree = Tree::new();
    let mut t = T::new(&tree.share(), false);
    let (e, fh) = t.create(ROOT_ID, "new.txt").unwrap();
    assert_eq!(t.write(fh, 0, b"written by the guest").unwrap(), 20);
    assert_eq!(
        std::fs::read(tree.share().join("new.txt")).unwrap(),
        b"written by the guest"
    );
    let arg = SetattrIn {
        valid: FATTR_SIZE,
        size: 7,
        ..Default::default()
    };
    t.call(SETATTR, e.nodeid, arg.as_bytes()).unwrap();
    assert_eq!(AttrOut::read_from_prefix(&t.out).unwrap().0.attr.size, 7);
    t.call(UNLINK, ROOT_ID, b"new.txt\0").unwrap();
    assert!(!tree.share().join("new.txt").exists());

    let mut ro = T::new(&tree.share(), true);
    let e = ro.lookup(ROOT_ID, "hello.txt").unwrap();
    assert_eq!(ro.open(e.nodeid, libc::O_RDWR).unwrap_err(), libc::EROFS);
    assert_eq!(
        ro.open(e.nodeid, libc::O_RDONLY | libc::O_TRUNC)
            .unwrap_err(),
        libc::EROFS
    );
    assert_eq!(ro.create(ROOT_ID, "x").unwrap_err(), libc::EROFS);
    assert_eq!(
        ro.call(UNLINK, ROOT_ID, b"hello.txt\0").unwrap_err(),
        libc::EROFS
    );
    let arg = SetattrIn {
        valid: FATTR_MODE,
        mode: 0o777,
        ..Default::default()
    };
    assert_eq!(
        ro.call(SETATTR, e.nodeid, arg.as_bytes()).unwrap_err(),
        libc::EROFS
    );
    let fh = ro.open(e.nodeid, libc::O_RDONLY).unwrap();
    assert_eq!(ro.write(fh, 0, b"x").unwrap_err(), libc::EROFS);
    assert_eq!(
        std::fs::read(tree.share().join("hello.txt")).unwrap(),
        b"hello, guest\n"
    );
}

#[test]
fn node_ids_and_open_files_survive_a_snapshot() {
    let tree = Tree::new();
    let mut t = T::new(&tree.share(), false);
    let sub = t.lookup(ROOT_ID, "sub").unwrap().nodeid;
    let deeper = t.lookup(sub, "deeper").unwrap().nodeid;
    let data = t.lookup(deeper, "data").unwrap().nodeid;
    let fh = t.open(data, libc::O_RDONLY).unwrap();
    let hello = t.lookup(ROOT_ID, "hello.txt").unwrap().nodeid;
    // A rename moves what is beneath it.
    let mut arg = RenameIn { newdir: ROOT_ID }.as_bytes().to_vec();
    arg.extend_from_slice(b"sub\0moved\0");
    t.call(RENAME, ROOT_ID, &arg).unwrap();
    let state = t.s.state();
    let json = serde_json::to_string(&state).unwrap();
    assert!(json.contains("moved/deeper/data"), "{json}");

    let mut r = T::new(&tree.share(), false);
    r.s.restore(&serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(r.read(fh, 0, 3).unwrap(), [7, 7, 7]);
    r.call(GETATTR, hello, &[]).unwrap();
    assert_eq!(AttrOut::read_from_prefix(&r.out).unwrap().0.attr.size, 13);
    // Looked up again: the node the guest already holds.
    let again = r.lookup(ROOT_ID, "hello.txt").unwrap().nodeid;
    assert_eq!(again, hello);
    assert!(r.lookup(ROOT_ID, "moved").unwrap().nodeid == sub);
    // A path gone since is stale, not something else.
    std::fs::remove_file(tree.share().join("moved/deeper/data")).unwrap();
    let mut r2 = T::new(&tree.share(), false);
    r2.s.restore(&state).unwrap();
    assert_eq!(r2.call(GETATTR, data, &[]).unwrap_err(), libc::ESTALE);

    // A snapshot file naming paths outside is refused.
    let mut bad = state.clone();
    bad.inodes[0].path = Some("../outside".into());
    assert!(r2.s.restore(&bad).is_err());
}

#[test]
fn forgotten_nodes_are_dropped_and_bad_input_is_an_error() {
    let tree = Tree::new();
    let mut t = T::new(&tree.share(), false);
    let e = t.lookup(ROOT_ID, "hello.txt").unwrap();
    t.lookup(ROOT_ID, "hello.txt").unwrap();
    let forget = ForgetIn { nlookup: 1 };
    assert_eq!(
        t.call(FORGET, e.nodeid, forget.as_bytes()).unwrap(),
        Reply::None
    );
    t.call(GETATTR, e.nodeid, &[]).unwrap();
    let mut batch = BatchForgetIn {
        count: 1000,
        dummy: 0,
    }
    .as_bytes()
    .to_vec();
    batch.extend_from_slice(
        ForgetOne {
            nodeid: e.nodeid,
            nlookup: 1,
        }
        .as_bytes(),
    );
    assert_eq!(t.call(BATCH_FORGET, 0, &batch).unwrap(), Reply::None);
    assert_eq!(t.call(GETATTR, e.nodeid, &[]).unwrap_err(), libc::ESTALE);
    assert_eq!(t.s.inodes.len(), 1, "only the root is left");
    // Truncated arguments, unknown opcodes, missing NULs.
    assert_eq!(t.call(READ, 0, &[1, 2]).unwrap_err(), libc::EINVAL);
    assert_eq!(t.call(9999, 0, &[]).unwrap_err(), libc::ENOSYS);
    assert_eq!(
        t.call(LOOKUP, ROOT_ID, b"no-nul").unwrap_err(),
        libc::EINVAL
    );
    assert_eq!(t.read(12345, 0, 10).unwrap_err(), libc::EBADF);
}

#[test]
fn mkdir_create_and_rename_a_directory() {
    let tree = Tree::new();
    let mut t = T::new(&tree.share(), false);
    let arg = MkdirIn {
        mode: libc::S_IFDIR | 0o755,
        umask: 0o022,
    };
    t.call(MKDIR, ROOT_ID, &with_name(arg.as_bytes(), "d"))
        .unwrap();
    let d = EntryOut::read_from_prefix(&t.out).unwrap().0.nodeid;
    let (_, fh) = t.create(d, "f").unwrap();
    t.write(fh, 0, b"guest-data\n").unwrap();
    let mut arg = RenameIn { newdir: ROOT_ID }.as_bytes().to_vec();
    arg.extend_from_slice(b"d\0e\0");
    t.call(RENAME, ROOT_ID, &arg).unwrap();
    assert_eq!(
        std::fs::read(tree.share().join("e/f")).unwrap(),
        b"guest-data\n"
    );
}

/// Root, or a loud skip.
fn root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        ember_testing::skip(test, "needs root (CI runs as root)");
    }
    root
}

/// Puts the test thread back as root when the test ends, passed or not
/// (before its scratch tree is removed).
struct AsSelf;

impl Drop for AsSelf {
    fn drop(&mut self) {
        serve_as_self();
    }
}

fn owner(p: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.uid(), m.gid())
}

#[test]
fn requests_are_served_as_their_guest_caller() {
    use std::os::unix::fs::PermissionsExt;
    if !root("requests_are_served_as_their_guest_caller") {
        return;
    }
    let tree = Tree::new();
    let share = tree.share();
    std::fs::set_permissions(&share, std::fs::Permissions::from_mode(0o777)).unwrap();
    let _as_self = AsSelf;
    let mut t = T::new(&share, false);
    let user = (1000, 1000);

    // What the guest's user makes is the user's.
    let c = CreateIn {
        flags: libc::O_RDWR as u32,
        mode: libc::S_IFREG | 0o644,
        umask: 0o022,
        ..Default::default()
    };
    t.call_as(user, CREATE, ROOT_ID, &with_name(c.as_bytes(), "mine"))
        .unwrap();
    let m = MkdirIn {
        mode: 0o755,
        umask: 0o022,
    };
    t.call_as(user, MKDIR, ROOT_ID, &with_name(m.as_bytes(), "dir"))
        .unwrap();
    t.call_as(user, SYMLINK, ROOT_ID, b"link\0mine\0").unwrap();
    for name in ["mine", "dir", "link"] {
        assert_eq!(owner(&share.join(name)), user, "{name}");
    }

    // It cannot write root's 0644 file, nor change its mode or owner...
    let e = t.lookup(ROOT_ID, "hello.txt").unwrap();
    let o = OpenIn {
        flags: libc::O_WRONLY as u32,
        open_flags: 0,
    };
    assert_eq!(
        t.call_as(user, OPEN, e.nodeid, o.as_bytes()).unwrap_err(),
        libc::EACCES
    );
    let chmod = SetattrIn {
        valid: FATTR_MODE,
        mode: 0o666,
        ..Default::default()
    };
    assert_eq!(
        t.call_as(user, SETATTR, e.nodeid, chmod.as_bytes())
            .unwrap_err(),
        libc::EPERM
    );
    let chown = SetattrIn {
        valid: FATTR_UID,
        uid: 1000,
        ..Default::default()
    };
    assert_eq!(
        t.call_as(user, SETATTR, e.nodeid, chown.as_bytes())
            .unwrap_err(),
        libc::EPERM
    );
    // ...nor make a file in a directory of root's (not the guest kernel's
    // check: this is the host's).
    let sub = t.lookup(ROOT_ID, "sub").unwrap();
    assert_eq!(
        t.call_as(user, CREATE, sub.nodeid, &with_name(c.as_bytes(), "x"))
            .unwrap_err(),
        libc::EACCES
    );
    // Reading is allowed, as the mode says.
    let o = OpenIn {
        flags: libc::O_RDONLY as u32,
        open_flags: 0,
    };
    t.call_as(user, OPEN, e.nodeid, o.as_bytes()).unwrap();

    // Another user, then root again: each request as its own caller.
    t.call_as((1001, 1002), SYMLINK, ROOT_ID, b"other\0mine\0")
        .unwrap();
    assert_eq!(owner(&share.join("other")), (1001, 1002));
    let o = OpenIn {
        flags: libc::O_WRONLY as u32,
        open_flags: 0,
    };
    t.call_as((0, 0), OPEN, e.nodeid, o.as_bytes()).unwrap();
    t.call_as((0, 0), SETATTR, e.nodeid, chown.as_bytes())
        .unwrap();
    assert_eq!(owner(&share.join("hello.txt")).0, 1000);
    t.call_as((0, 0), SYMLINK, ROOT_ID, b"roots\0mine\0")
        .unwrap();
    assert_eq!(owner(&share.join("roots")), (0, 0));
}

/// Bind mounts made in this thread's own mount namespace, undone when
/// dropped (and gone with the thread in any case).
struct Binds(Vec<PathBuf>);

impl Binds {
    /// This thread in a mount namespace of its own, with no propagation to
    /// the host's: nothing mounted here is seen outside the test.
    fn new() -> Self {
        // SAFETY: plain syscalls; unshare(CLONE_NEWNS) gives the calling
        // thread its own copy of the namespace (and of its fs_struct).
        unsafe {
            assert_eq!(libc::unshare(libc::CLONE_NEWNS), 0, "unshare");
            let r = libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            );
            assert_eq!(r, 0, "mount --make-rprivate /");
        }
        Binds(Vec::new())
    }
    fn bind(&mut self, from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        let (f, t) = (
            CString::new(from.as_os_str().as_encoded_bytes()).unwrap(),
            CString::new(to.as_os_str().as_encoded_bytes()).unwrap(),
        );
        // SAFETY: both paths are NUL-terminated.
        let r = unsafe {
            libc::mount(
                f.as_ptr(),
                t.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "bind {from:?} on {to:?}");
        self.0.push(to.to_owned());
    }
}

impl Drop for Binds {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            let p = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: NUL-terminated.
            unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

#[test]
fn bind_mounts_in_a_share_and_a_share_of_one() {
    if !root("bind_mounts_in_a_share_and_a_share_of_one") {
        return;
    }
    let tree = Tree::new();
    let share = tree.share();
    let mut binds = Binds::new();
    // The host puts `outside/` into the share: its choice, crossed like a
    // directory (the guest cannot mount anything on the host).
    binds.bind(&tree.top.join("outside"), &share.join("sub/bound"));
    // The share bound inside itself: one directory, so one node.
    binds.bind(&share, &share.join("sub/loop"));
    // A share whose directory is itself a bind mount (of `share/sub`).
    binds.bind(&share.join("sub"), &tree.top.join("view"));

    let mut t = T::new(&share, false);
    let sub = t.lookup(ROOT_ID, "sub").unwrap();
    let bound = t.lookup(sub.nodeid, "bound").unwrap();
    assert_eq!(bound.attr.mode & libc::S_IFMT, libc::S_IFDIR);
    let secret = t.lookup(bound.nodeid, "secret").unwrap();
    let fh = t.open(secret.nodeid, libc::O_RDONLY).unwrap();
    assert_eq!(t.read(fh, 0, 100).unwrap(), b"host secret");
    // Still one component at a time: `..` of the mount is not a name.
    assert_eq!(t.lookup(bound.nodeid, "..").unwrap_err(), libc::EINVAL);
    let lp = t.lookup(sub.nodeid, "loop").unwrap();
    assert_eq!(lp.nodeid, ROOT_ID, "the share inside itself is its root");
    assert!(t.names(lp.nodeid).contains(&"hello.txt".to_string()));

    let mut v = T::new(&tree.top.join("view"), false);
    assert_eq!(
        v.names(ROOT_ID),
        [".", "..", "bound", "deeper", "loop", "up"]
    );
    let up = v.lookup(ROOT_ID, "up").unwrap();
    // The link's text as it is; never followed here.
    assert_eq!(v.readlink(up.nodeid), b"../../outside");
    assert_eq!(v.lookup(up.nodeid, "secret").unwrap_err(), libc::ENOTDIR);
    assert_eq!(v.lookup(ROOT_ID, "..").unwrap_err(), libc::EINVAL);
    let (_, fh) = v.create(ROOT_ID, "via-view").unwrap();
    assert_eq!(v.write(fh, 0, b"seen in sub").unwrap(), 11);
    assert_eq!(
        std::fs::read(share.join("sub/via-view")).unwrap(),
        b"seen in sub"
    );
    drop(binds);
    assert!(!share.join("sub/bound/secret").exists(), "unmounted");
}

/// `nobody`: the unprivileged caller of the id-map tests.
const NOBODY: u32 = OVERFLOW_ID;

/// Runs `f` on a thread of its own that has become `nobody` for good (the
/// raw syscalls change the calling thread's credentials only), as an
/// unprivileged ember's I/O thread is.
fn as_nobody<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    std::thread::spawn(move || {
        // SAFETY: plain syscalls changing this thread's credentials only.
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<u32>()),
                0
            );
            assert_eq!(
                libc::syscall(libc::SYS_setresgid, NOBODY, NOBODY, NOBODY),
                0
            );
            assert_eq!(
                libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY),
                0
            );
        }
        f()
    })
    .join()
    .unwrap()
}

fn attr_of(t: &mut T, node: u64) -> Attr {
    t.call(GETATTR, node, &[]).unwrap();
    AttrOut::read_from_prefix(&t.out).unwrap().0.attr
}

#[test]
fn an_unprivileged_caller_is_the_guests_root_and_owns_nothing_else() {
    use std::os::unix::fs::PermissionsExt;
    if !root("an_unprivileged_caller_is_the_guests_root_and_owns_nothing_else") {
        return;
    }
    let tree = Tree::new();
    let share = tree.share();
    // The share and a file in it are the caller's; hello.txt stays root's.
    std::os::unix::fs::chown(&share, Some(NOBODY), Some(NOBODY)).unwrap();
    std::fs::write(share.join("mine"), b"x").unwrap();
    std::os::unix::fs::chown(share.join("mine"), Some(NOBODY), Some(NOBODY)).unwrap();
    std::fs::set_permissions(share.join("mine"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let dir = share.clone();
    let mine_mode = as_nobody(move || {
        let mut t = T::new(&dir, false);
        assert_eq!(t.s.id_map, IdMap::for_caller(NOBODY, NOBODY));
        // Host to guest: the caller's files are root's, root's are nobody's.
        let share_attr = attr_of(&mut t, ROOT_ID);
        assert_eq!((share_attr.uid, share_attr.gid), (0, 0));
        let mine = t.lookup(ROOT_ID, "mine").unwrap();
        assert_eq!((mine.attr.uid, mine.attr.gid), (0, 0));
        let hello = t.lookup(ROOT_ID, "hello.txt").unwrap();
        assert_eq!((hello.attr.uid, hello.attr.gid), (NOBODY, NOBODY));

        // What the guest's root makes is the caller's, and shown as root's.
        let c = CreateIn {
            flags: libc::O_RDWR as u32,
            mode: libc::S_IFREG | 0o644,
            umask: 0o022,
            ..Default::default()
        };
        t.call_as((0, 0), CREATE, ROOT_ID, &with_name(c.as_bytes(), "made"))
            .unwrap();
        let made = EntryOut::read_from_prefix(&t.out).unwrap().0;
        assert_eq!((made.attr.uid, made.attr.gid), (0, 0));
        let m = MkdirIn {
            mode: 0o755,
            umask: 0o022,
        };
        t.call_as((0, 0), MKDIR, ROOT_ID, &with_name(m.as_bytes(), "d"))
            .unwrap();
        t.call_as((0, 0), SYMLINK, ROOT_ID, b"l\0made\0").unwrap();
        // Another guest user has no host id to own a file.
        for (who, op, arg) in [
            ((1000, 1000), CREATE, with_name(c.as_bytes(), "u")),
            ((0, 1000), MKDIR, with_name(m.as_bytes(), "g")),
            ((NOBODY, NOBODY), SYMLINK, b"n\0made\0".to_vec()),
        ] {
            assert_eq!(t.call_as(who, op, ROOT_ID, &arg).unwrap_err(), libc::EINVAL);
        }

        // The guest's root may chown within the map (to itself)...
        let chown = |uid, gid, extra| SetattrIn {
            valid: FATTR_UID | FATTR_GID | extra,
            uid,
            gid,
            mode: 0o600,
            ..Default::default()
        };
        t.call_as((0, 0), SETATTR, mine.nodeid, chown(0, 0, 0).as_bytes())
            .unwrap();
        let a = AttrOut::read_from_prefix(&t.out).unwrap().0.attr;
        assert_eq!((a.uid, a.gid), (0, 0));
        // ...not to an id outside it, and then changes nothing else of the
        // request (the mode asked for with it).
        for (uid, gid) in [(5, 0), (0, 5), (NOBODY, 0), (0, NOBODY)] {
            let s = chown(uid, gid, FATTR_MODE);
            assert_eq!(
                t.call_as((0, 0), SETATTR, mine.nodeid, s.as_bytes())
                    .unwrap_err(),
                libc::EINVAL,
                "{uid}:{gid}"
            );
        }
        // A chown the map allows but the host does not (root's file).
        assert_eq!(
            t.call_as((0, 0), SETATTR, hello.nodeid, chown(0, 0, 0).as_bytes())
                .unwrap_err(),
            libc::EPERM
        );
        attr_of(&mut t, mine.nodeid).mode & 0o7777
    });
    assert_eq!(mine_mode, 0o644, "a refused chown changed the mode");
    for name in ["mine", "made", "d", "l"] {
        assert_eq!(owner(&share.join(name)), (NOBODY, NOBODY), "{name}");
    }
    assert_eq!(owner(&share.join("hello.txt")), (0, 0));
    for name in ["u", "g", "n"] {
        assert!(!share.join(name).exists(), "{name}");
    }
}

#[test]
fn a_restore_shows_the_restoring_users_view_not_the_snapshots() {
    if !root("a_restore_shows_the_restoring_users_view_not_the_snapshots") {
        return;
    }
    let tree = Tree::new();
    let share = tree.share();
    std::os::unix::fs::chown(share.join("hello.txt"), Some(NOBODY), Some(NOBODY)).unwrap();
    // Taken by root: the identity.
    let mut t = T::new(&share, false);
    let hello = t.lookup(ROOT_ID, "hello.txt").unwrap();
    assert_eq!((hello.attr.uid, hello.attr.gid), (NOBODY, NOBODY));
    let sub = t.lookup(ROOT_ID, "sub").unwrap().nodeid;
    let state = t.s.state();
    let json = serde_json::to_string(&state).unwrap();
    assert!(!json.contains("uid") && !json.contains("map"), "{json}");
    // Restored by nobody: its files are root's, root's are nobody's.
    let node = hello.nodeid;
    let (h, s) = as_nobody(move || {
        let mut r = T::new(&share, false);
        r.s.restore(&state).unwrap();
        let (h, s) = (attr_of(&mut r, node), attr_of(&mut r, sub));
        ((h.uid, h.gid), (s.uid, s.gid))
    });
    assert_eq!(h, (0, 0));
    assert_eq!(s, (NOBODY, NOBODY));
    // And back by root: the identity again.
    let mut r = T::new(&tree.share(), false);
    r.s.restore(&t.s.state()).unwrap();
    let a = attr_of(&mut r, node);
    assert_eq!((a.uid, a.gid), (NOBODY, NOBODY));
    assert_eq!(attr_of(&mut r, sub).uid, 0);
}
