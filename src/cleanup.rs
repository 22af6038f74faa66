//! What ember undoes when it ends: the one owner of SIGTERM, SIGINT, SIGHUP
//! and SIGQUIT (SIGSYS stays with `ember_vmm::seccomp`, which calls
//! [`run_all`] through its violation hook).
//!
//! Code that makes something to undo registers it here — a path to unlink
//! ([`TempPath`]), a child process to kill, an rtnetlink request to send (a
//! qdisc to remove), an async-signal-safe function to call (the terminal's
//! restore) — and drops the registration when it has
//! undone it itself. A fatal signal runs every registered entry and then ends
//! ember by that same signal with its default action, so the parent sees how
//! ember ended; [`run_all`] does the same before an `exit` that runs no
//! destructors.
//!
//! The handler allocates nothing and takes no lock: entries live in a
//! fixed-size table of pre-built values (C strings made at registration),
//! and each is claimed with one atomic step, by the handler or by its owner,
//! never both. There is one handler for all four signals, installed by
//! [`install`] however often and in whatever order it is called.
//!
//! A signal that was ignored when ember started stays ignored: `nohup ember
//! …` keeps running when its terminal goes (SIGHUP), and a background job of
//! a non-interactive shell keeps ignoring SIGINT and SIGQUIT, as `sh`'s own
//! `trap` rule has it.

use std::cell::UnsafeCell;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use thiserror::Error;

/// The signals whose default action ends ember and which it cleans up after.
pub const FATAL_SIGNALS: [libc::c_int; 4] =
    [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

/// Entries registered at once, at most. A run registers a handful.
const SLOTS: usize = 64;

/// Registration errors.
#[derive(Debug, Error)]
pub enum CleanupError {
    /// Every slot of the table is taken.
    #[error("more than {SLOTS} things to undo at once")]
    Full,
    /// A path with a NUL byte cannot be unlinked by the handler.
    #[error("{0}: a path with a NUL byte")]
    Nul(PathBuf),
}

/// One thing to undo.
#[derive(Debug)]
pub enum Undo {
    /// Unlink this path.
    Unlink(CString),
    /// Send SIGKILL to this process. Drop the [`Entry`] before reaping it, so
    /// a recycled pid is never killed.
    Kill(libc::pid_t),
    /// Send this rtnetlink request on this socket (of the namespace it was
    /// opened in), without waiting for the answer: the kernel has acted on
    /// it when the send returns.
    Rtnetlink(OwnedFd, Box<[u8]>),
    /// Call this function. It must be async-signal-safe.
    Call(fn()),
}

/// A slot is free, being filled or emptied by its owner, registered, or
/// claimed by the handler (for good: the process is ending).
const FREE: u8 = 0;
const BUSY: u8 = 1;
const ARMED: u8 = 2;
const TAKEN: u8 = 3;

struct Slot {
    state: AtomicU8,
    /// Which pass of [`run_all`] undoes it (readable without claiming it).
    pass: AtomicU8,
    undo: UnsafeCell<Option<Undo>>,
}

// SAFETY: `undo` is written only by the thread that moved the slot FREE →
// BUSY, and read only by the one that moved it ARMED → BUSY or → TAKEN; the
// state's compare-exchange (acquire/release) makes each of those exclusive.
unsafe impl Sync for Slot {}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    state: AtomicU8::new(FREE),
    pass: AtomicU8::new(0),
    undo: UnsafeCell::new(None),
};
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];

/// Whether the handler is installed.
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The first SIGINT sets [`INTERRUPTED`] instead of ending ember.
static SOFT_SIGINT: AtomicBool = AtomicBool::new(false);
/// Set by the first SIGINT after [`soft_interrupt`].
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// A registered [`Undo`]. Dropping it unregisters it without undoing
/// anything (its owner has done that, or wants the thing kept).
#[derive(Debug)]
pub struct Entry {
    slot: usize,
}

/// Registers `undo` (and installs the handler, if it is not yet).
pub fn register(undo: Undo) -> Result<Entry, CleanupError> {
    install();
    register_only(undo)
}

/// [`register`] without installing: no allocation and no system call, for a
/// forked child.
fn register_only(undo: Undo) -> Result<Entry, CleanupError> {
    for (slot, s) in TABLE.iter().enumerate() {
        if s.state
            .compare_exchange(FREE, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            s.pass.store(pass(&undo), Ordering::Relaxed);
            // SAFETY: this thread moved the slot to BUSY: nobody else reads
            // or writes `undo` until it is ARMED.
            unsafe { *s.undo.get() = Some(undo) };
            s.state.store(ARMED, Ordering::Release);
            return Ok(Entry { slot });
        }
    }
    Err(CleanupError::Full)
}

impl Drop for Entry {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        // TAKEN instead: the handler has it; the process is ending.
        if s.state
            .compare_exchange(ARMED, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: this thread moved the slot ARMED → BUSY (see `Slot`).
            let undo = unsafe { (*s.undo.get()).take() };
            s.state.store(FREE, Ordering::Release);
            drop(undo);
        }
    }
}

/// Functions first (the terminal, so what follows reads right), then
/// processes and network objects, then paths.
fn pass(undo: &Undo) -> u8 {
    match undo {
        Undo::Call(_) => 0,
        Undo::Kill(_) | Undo::Rtnetlink(..) => 1,
        Undo::Unlink(_) => 2,
    }
}

/// Undoes every registered entry now, in [`pass`] order. Async-signal-safe;
/// an entry is undone once, by whoever claims it first.
pub fn run_all() {
    for pass in 0..3 {
        for s in &TABLE {
            // A slot re-registered meanwhile runs in another pass: harmless.
            if s.pass.load(Ordering::Relaxed) != pass
                || s.state
                    .compare_exchange(ARMED, TAKEN, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            // SAFETY: claimed for good (TAKEN): nobody writes or frees it now.
            match unsafe { &*s.undo.get() } {
                Some(Undo::Call(f)) => f(),
                // SAFETY: kill is async-signal-safe.
                Some(Undo::Kill(pid)) => unsafe {
                    libc::kill(*pid, libc::SIGKILL);
                },
                // SAFETY: unlink is async-signal-safe; the path is a
                // NUL-terminated string nobody frees now.
                Some(Undo::Unlink(path)) => unsafe {
                    libc::unlink(path.as_ptr());
                },
                // The send allocates nothing (see `rtnl::send`).
                Some(Undo::Rtnetlink(fd, msg)) => {
                    let _ = crate::rtnl::send(fd.as_raw_fd(), msg);
                }
                None => {}
            }
        }
    }
}

/// In a forked child: forgets every registration but `keep` (the parent's
/// others are not the child's to undo), without allocating or freeing.
#[cfg(test)]
pub(crate) fn forget_all_but(keep: &Entry) {
    for (slot, s) in TABLE.iter().enumerate() {
        if slot != keep.slot {
            // SAFETY: the child has one thread; the old value is leaked,
            // not dropped (no free in a forked child).
            unsafe { std::ptr::write(s.undo.get(), None) };
            s.state.store(FREE, Ordering::SeqCst);
        }
    }
}

/// Installs the handler for [`FATAL_SIGNALS`] (once; later calls are
/// no-ops), leaving alone a signal that is ignored.
pub fn install() {
    if !INSTALLED.swap(true, Ordering::SeqCst) {
        arm();
    }
}

/// Installs the handler for each fatal signal that is not ignored.
fn arm() {
    for sig in FATAL_SIGNALS {
        // SAFETY: sigaction reads and writes the structs it is given; a
        // zeroed sigaction is a valid value; the handler only makes
        // async-signal-safe calls.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fatal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            // The soft SIGINT returns: calls it interrupted go on.
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

extern "C" fn on_fatal(sig: libc::c_int) {
    if sig == libc::SIGINT
        && SOFT_SIGINT.load(Ordering::SeqCst)
        && !INTERRUPTED.swap(true, Ordering::SeqCst)
    {
        return;
    }
    run_all();
    // SAFETY: sigaction, sigemptyset, sigaddset, pthread_sigmask and raise
    // are async-signal-safe; the structs are ours. The default action, with
    // the signal no longer blocked by this handler, ends ember at `raise`.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
    }
}

/// From now on the first SIGINT (Ctrl-C) only sets [`interrupt_flag`], for
/// a loop that polls it to stop and still report; a second one ends ember as
/// any fatal signal does.
pub fn soft_interrupt() {
    SOFT_SIGINT.store(true, Ordering::SeqCst);
    install();
}

/// The flag the first SIGINT sets after [`soft_interrupt`].
pub fn interrupt_flag() -> &'static AtomicBool {
    &INTERRUPTED
}

/// A path removed when this is dropped, on a fatal signal and by
/// [`run_all`], unless [`kept`](TempPath::keep).
#[derive(Debug)]
pub struct TempPath {
    path: PathBuf,
    /// `None` when it could not be registered (see [`TempPath::new`]).
    entry: Option<Entry>,
}

impl TempPath {
    /// Registers `path` (which need not exist yet). Should the table be
    /// full, the path is still removed on drop, and a warning says a signal
    /// would leave it behind.
    pub fn new(path: impl Into<PathBuf>) -> TempPath {
        let path = path.into();
        let entry = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| CleanupError::Nul(path.clone()))
            .and_then(|c| register(Undo::Unlink(c)));
        let entry = match entry {
            Ok(e) => Some(e),
            Err(e) => {
                log::warn!("{} is not removed if ember is killed: {e}", path.display());
                None
            }
        };
        TempPath { path, entry }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Keeps the path: it is no longer removed, on drop or on a signal.
    pub fn keep(mut self) -> PathBuf {
        self.entry = None;
        std::mem::take(&mut self.path)
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        // Unregistered first: the handler then has nothing to race with.
        self.entry = None;
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A file with no name, 0600: made with `O_TMPFILE` in `dir` (or, where
/// the file system lacks it, created under a fresh name and unlinked at
/// once), so nothing is left behind however ember ends, SIGKILL included.
/// A child reaches it as [`path`](Nameless::path), `/proc/self/fd/N`, once
/// [`inherit`] has passed it the descriptor.
#[derive(Debug)]
pub struct Nameless {
    file: std::fs::File,
}

impl Nameless {
    /// A new empty file in `dir`, open for reading and writing.
    pub fn new(dir: &Path) -> std::io::Result<Nameless> {
        use std::fs::OpenOptions;
        use std::os::unix::fs::OpenOptionsExt;
        let tmpfile = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(dir);
        let file = match tmpfile {
            Ok(f) => f,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) =>
            {
                named_then_unlinked(dir)?
            }
            Err(e) => return Err(e),
        };
        Ok(Nameless { file })
    }

    /// The open file.
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The open file, for good.
    pub fn into_file(self) -> std::fs::File {
        self.file
    }

    /// Its descriptor, for [`inherit`].
    pub fn fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.file)
    }

    /// The path that opens it, in this process and in a child it was
    /// passed to.
    pub fn path(&self) -> PathBuf {
        fd_path(self.fd())
    }
}

/// The path that opens descriptor `fd` of the process that opens it.
pub fn fd_path(fd: std::os::fd::RawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{fd}"))
}

/// [`Nameless`] without `O_TMPFILE`: a fresh 0600 name, unlinked as soon as
/// it is open (a signal in between removes it: it is registered).
fn named_then_unlinked(dir: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    loop {
        let path = dir.join(format!(
            "ember-nameless-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let guard = TempPath::new(&path);
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(guard.path())
        {
            // The guard unlinks it.
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                drop(guard.keep());
                continue;
            }
            Err(e) => {
                drop(guard.keep());
                return Err(e);
            }
        }
    }
}

/// Makes `cmd`'s process die with ember, SIGKILL included
/// (`PR_SET_PDEATHSIG`), and refuse to start if ember is already gone.
pub fn dies_with_ember(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is async-signal-safe.
    let ember = unsafe { libc::getpid() };
    // SAFETY: prctl and getppid are async-signal-safe; they only set and
    // read the child's own attributes.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Ember died before the flag was set: nobody would kill it.
            if libc::getppid() != ember {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Passes descriptors `fds` to `cmd`'s process (they are close-on-exec in
/// ember, so no other child gets them), at the same numbers.
pub fn inherit(cmd: &mut std::process::Command, fds: Vec<std::os::fd::RawFd>) {
    use std::os::unix::process::CommandExt;
    // SAFETY: fcntl is async-signal-safe; the Vec was allocated before the
    // fork and is only read in the child.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Removes what killed embers of this user left in `dir`: their per-run
/// files and sockets (`ember-root-PID-…`, `ember-api-PID-…`,
/// `ember-appliance-PID-…`, `ember-PID-N.sock`, a root image's staging
/// directory). An entry is touched only if it is this user's and its PID
/// is no live process: a live run's files stay.
pub fn sweep_dead(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(dead_owner) else {
            continue;
        };
        let Ok(m) = e.path().symlink_metadata() else {
            continue;
        };
        if m.uid() != me || alive(pid) {
            continue;
        }
        let _ = if m.is_dir() {
            std::fs::remove_dir_all(e.path())
        } else {
            std::fs::remove_file(e.path())
        };
    }
}

/// The PID in the name of a per-run file of ember's.
fn dead_owner(name: &str) -> Option<libc::pid_t> {
    let rest = name.strip_prefix("ember-")?;
    let rest = ["root-", "api-", "appliance-", "nameless-", "vsock-"]
        .iter()
        .find_map(|p| rest.strip_prefix(p))
        .or_else(|| rest.ends_with(".sock").then_some(rest))?;
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok().filter(|&p: &libc::pid_t| p > 0)
}

/// Whether process `pid` exists (of any user).
fn alive(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a forked child: forgets what the parent registered (other tests'
    /// files, which the child must not remove), without allocating.
    fn forget_inherited() {
        for s in &TABLE {
            // SAFETY: the child has one thread; the old value is leaked,
            // not dropped (no free in a forked child).
            unsafe { std::ptr::write(s.undo.get(), None) };
            s.state.store(FREE, Ordering::SeqCst);
        }
    }

    /// Forks a child that runs `child` (which must not allocate) and then
    /// exits 0; returns its wait status.
    fn in_child(child: impl FnOnce()) -> libc::c_int {
        // SAFETY: the child only runs `child`, which makes async-signal-safe
        // calls, and `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            forget_inherited();
            child();
            // SAFETY: ends the child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    fn scratch(name: &str) -> PathBuf {
        let p =
            std::env::temp_dir().join(format!("ember-cleanup-test-{}-{name}", std::process::id()));
        std::fs::write(&p, b"x").unwrap();
        p
    }

    fn c(p: &Path) -> CString {
        CString::new(p.as_os_str().as_bytes()).unwrap()
    }

    /// Each fatal signal removes a registered path and still ends the
    /// process by that signal.
    #[test]
    fn each_fatal_signal_removes_the_registered_path_and_ends_by_it() {
        for sig in FATAL_SIGNALS {
            let path = scratch(&format!("sig{sig}"));
            let cpath = c(&path);
            let status = in_child(|| {
                // SAFETY: default dispositions, as a fresh ember finds them.
                unsafe { libc::signal(sig, libc::SIG_DFL) };
                arm();
                std::mem::forget(register_only(Undo::Unlink(cpath)).unwrap());
                // SAFETY: signals this process.
                unsafe { libc::raise(sig) };
            });
            let gone = !path.exists();
            let _ = std::fs::remove_file(&path);
            assert!(
                libc::WIFSIGNALED(status),
                "signal {sig}: status {status:#x}"
            );
            assert_eq!(libc::WTERMSIG(status), sig);
            assert!(gone, "signal {sig}: {} left behind", path.display());
        }
    }

    /// A signal ignored when ember starts stays ignored: nothing is removed
    /// and the process lives on.
    #[test]
    fn an_inherited_ignore_is_kept() {
        for sig in [libc::SIGHUP, libc::SIGINT] {
            let path = scratch(&format!("ign{sig}"));
            let cpath = c(&path);
            let status = in_child(|| {
                // SAFETY: as `nohup` leaves it.
                unsafe { libc::signal(sig, libc::SIG_IGN) };
                arm();
                std::mem::forget(register_only(Undo::Unlink(cpath)).unwrap());
                // SAFETY: signals this process.
                unsafe { libc::raise(sig) };
            });
            let kept = path.exists();
            let _ = std::fs::remove_file(&path);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "signal {sig}: status {status:#x}"
            );
            assert!(kept, "signal {sig}: removed although ignored");
        }
    }

    /// A registered child process is killed; a dropped entry is not undone.
    #[test]
    fn a_signal_kills_registered_children_and_skips_dropped_entries() {
        let sleep = || {
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap()
        };
        let (mut registered, mut dropped) = (sleep(), sleep());
        let (kill, keep) = (registered.id() as libc::pid_t, dropped.id() as libc::pid_t);
        let status = in_child(|| {
            // SAFETY: default disposition.
            unsafe { libc::signal(libc::SIGTERM, libc::SIG_DFL) };
            arm();
            std::mem::forget(register_only(Undo::Kill(kill)).unwrap());
            drop(register_only(Undo::Kill(keep)).unwrap());
            // SAFETY: signals this process.
            unsafe { libc::raise(libc::SIGTERM) };
        });
        assert!(libc::WIFSIGNALED(status), "status {status:#x}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(registered.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(
            dropped.try_wait().unwrap().is_none(),
            "a dropped entry was undone"
        );
        dropped.kill().unwrap();
        dropped.wait().unwrap();
    }

    /// The soft SIGINT sets the flag once; the second ends the process.
    #[test]
    fn the_first_sigint_only_interrupts_when_asked() {
        let path = scratch("soft");
        let cpath = c(&path);
        let status = in_child(|| {
            // SAFETY: default disposition.
            unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
            SOFT_SIGINT.store(true, Ordering::SeqCst);
            INTERRUPTED.store(false, Ordering::SeqCst);
            arm();
            std::mem::forget(register_only(Undo::Unlink(cpath)).unwrap());
            // SAFETY: signals this process.
            unsafe { libc::raise(libc::SIGINT) };
            if !INTERRUPTED.load(Ordering::SeqCst) {
                // SAFETY: ends the child with a status the parent reads.
                unsafe { libc::_exit(3) };
            }
            // SAFETY: as above.
            unsafe { libc::raise(libc::SIGINT) };
        });
        let gone = !path.exists();
        let _ = std::fs::remove_file(&path);
        assert!(libc::WIFSIGNALED(status), "status {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGINT);
        assert!(gone);
    }

    /// A TempPath removes its file on drop, not once kept.
    #[test]
    fn a_temp_path_goes_on_drop_unless_kept() {
        let a = scratch("drop");
        drop(TempPath::new(&a));
        assert!(!a.exists());
        let b = scratch("keep");
        let kept = TempPath::new(&b).keep();
        assert_eq!(kept, b);
        assert!(b.exists());
        std::fs::remove_file(&b).unwrap();
    }

    /// A nameless file has no name in its directory and reopens through
    /// its descriptor path.
    #[test]
    fn a_nameless_file_leaves_no_name_and_reopens_by_descriptor() {
        let dir =
            std::env::temp_dir().join(format!("ember-cleanup-nameless-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = Nameless::new(&dir).unwrap();
        std::io::Write::write_all(&mut n.file(), b"held").unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        assert_eq!(std::fs::read(n.path()).unwrap(), b"held");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            n.file().metadata().unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::remove_dir(&dir).unwrap();
    }

    /// The sweep removes a dead ember's files and keeps a live one's and
    /// names that are not a run's.
    #[test]
    fn the_sweep_takes_only_dead_runs_files() {
        let dir = std::env::temp_dir().join(format!("ember-cleanup-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let me = std::process::id();
        let names = [
            format!("ember-root-{dead_pid}-0.img"),
            format!("ember-{dead_pid}-0.sock"),
            format!("ember-root-{me}-0.img"),
            format!("ember-test-{dead_pid}-x"),
            // A vsock channel's device socket and its port's.
            format!("ember-vsock-{dead_pid}-0.sock"),
            format!("ember-vsock-{dead_pid}-0.sock_1024"),
        ];
        for n in &names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        std::fs::create_dir(dir.join(format!("ember-root-{dead_pid}-1.d"))).unwrap();
        sweep_dead(&dir);
        let mut left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![names[2].clone(), names[3].clone()];
        want.sort();
        assert_eq!(left, want);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
