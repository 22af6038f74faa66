//! Disk I/O engines: io_uring when the host offers it, plain `preadv`/`pwritev` otherwise.
//!
//! Both take operations with a token and hand back `(token, result)` completions; the
//! synchronous engine simply completes each operation before `push` returns. Buffers an
//! operation points at must stay valid until its completion has been reaped: the kernel
//! reads and writes them behind the compiler's back, so [`Engine::push`] is an `unsafe fn`
//! whose contract says so, and only the block handler's per-slot iovecs call it.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{IoUring, Probe, opcode, squeue, types};

/// One disk operation. Offsets and lengths are in bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// Read into the iovecs.
    Read {
        /// File offset.
        offset: u64,
        /// Start of an iovec array that outlives the operation.
        iovecs: *const libc::iovec,
        /// Number of iovecs.
        count: usize,
    },
    /// Write from the iovecs.
    Write {
        /// File offset.
        offset: u64,
        /// Start of an iovec array that outlives the operation.
        iovecs: *const libc::iovec,
        /// Number of iovecs.
        count: usize,
    },
    /// `fdatasync`: ordered after every operation pushed before it.
    Flush,
    /// Punch a hole (the range reads back as zeroes).
    Discard {
        /// File offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Zero a range, keeping it allocated.
    WriteZeroes {
        /// File offset.
        offset: u64,
        /// Length.
        len: u64,
    },
}

/// A finished operation: its token and the bytes transferred (0 for non-data ops).
pub(crate) type Completion = (u64, io::Result<usize>);

/// What the I/O thread needs from an engine.
pub(crate) trait Engine: Send {
    /// Queues `op`; its completion carries `token`.
    ///
    /// # Safety
    ///
    /// For [`Op::Read`] and [`Op::Write`], `iovecs` must point at `count` initialised
    /// iovecs, and each iovec at memory valid for writes (`Read`) or reads (`Write`) of
    /// its length. The iovec array and that memory must stay valid, and must not be
    /// accessed other than through the operation, until this token's completion has been
    /// reaped (or the engine dropped): the kernel may use them until then.
    unsafe fn push(&mut self, op: Op, token: u64) -> io::Result<()>;
    /// Starts everything queued.
    fn submit(&mut self) -> io::Result<()>;
    /// Moves finished operations into `out`.
    fn reap(&mut self, out: &mut Vec<Completion>);
    /// Blocks until at least one more operation has finished (used when draining).
    fn wait(&mut self) -> io::Result<()>;
    /// An eventfd that becomes readable when completions are ready, if the engine is
    /// asynchronous. `None` means every operation has completed by the time `push`
    /// returns.
    fn notifier(&self) -> Option<RawFd>;
    /// Whether `reap` would find something, checked without a syscall: the I/O thread asks
    /// this while it busy-polls.
    fn has_completions(&mut self) -> bool;
    /// A short name for logs.
    fn name(&self) -> &'static str;
}

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// io_uring if the host kernel supports the opcodes we need, else synchronous.
    /// [`Block`](super::Block) narrows this to `O_DIRECT` disks: on buffered ones the
    /// synchronous engine is as fast for reads and ~2x faster for writes, while with
    /// `O_DIRECT` io_uring is 4-5x faster (`crates/ember-vmm/tests/virtio_bench.rs`).
    #[default]
    Auto,
    /// io_uring or fail.
    IoUring,
    /// `preadv`/`pwritev`/`fdatasync`/`fallocate` on the I/O thread.
    Sync,
}

/// Opens the engine `kind` asks for over `file`.
pub(crate) fn open(kind: EngineKind, file: File) -> io::Result<Box<dyn Engine>> {
    match kind {
        EngineKind::Sync => Ok(Box::new(SyncEngine::new(file))),
        EngineKind::IoUring => Ok(Box::new(UringEngine::new(file)?)),
        EngineKind::Auto => match file.try_clone().and_then(UringEngine::new) {
            Ok(e) => Ok(Box::new(e)),
            Err(err) => {
                log::info!("virtio-blk: io_uring unavailable ({err}); using preadv/pwritev");
                Ok(Box::new(SyncEngine::new(file)))
            }
        },
    }
}

/// `fallocate` mode for a discard.
const DISCARD_MODE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
/// `fallocate` mode for write-zeroes.
const WRITE_ZEROES_MODE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

/// The synchronous engine.
#[derive(Debug)]
pub(crate) struct SyncEngine {
    file: File,
    done: VecDeque<Completion>,
}

impl SyncEngine {
    /// An engine doing blocking syscalls on `file`.
    pub(crate) fn new(file: File) -> Self {
        Self {
            file,
            done: VecDeque::new(),
        }
    }

    /// Does `op` now.
    ///
    /// # Safety
    ///
    /// As [`Engine::push`]; the memory need only stay valid until this returns.
    unsafe fn run(&self, op: Op) -> io::Result<usize> {
        let fd = self.file.as_raw_fd();
        match op {
            Op::Read {
                offset,
                iovecs,
                count,
            } => {
                // SAFETY: this function's contract covers the iovecs.
                unsafe { transfer_all(fd, offset, iovecs, count, false) }
            }
            Op::Write {
                offset,
                iovecs,
                count,
            } => {
                // SAFETY: as above.
                unsafe { transfer_all(fd, offset, iovecs, count, true) }
            }
            Op::Flush => {
                // SAFETY: fdatasync on an fd we own; no memory is involved.
                cvt(unsafe { libc::fdatasync(fd) }).map(|_| 0)
            }
            Op::Discard { offset, len } => fallocate(fd, DISCARD_MODE, offset, len),
            Op::WriteZeroes { offset, len } => write_zeroes(fd, offset, len),
        }
    }
}

impl Engine for SyncEngine {
    unsafe fn push(&mut self, op: Op, token: u64) -> io::Result<()> {
        // SAFETY: `push`'s contract is `run`'s, and stronger (until reaped, not returned).
        let result = unsafe { self.run(op) };
        self.done.push_back((token, result));
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.extend(self.done.drain(..));
    }

    fn wait(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn notifier(&self) -> Option<RawFd> {
        None
    }

    fn has_completions(&mut self) -> bool {
        !self.done.is_empty()
    }

    fn name(&self) -> &'static str {
        "sync"
    }
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<usize> {
    let offset = i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let len = i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate on an fd we own; no memory is involved.
    cvt(unsafe { libc::fallocate(fd, mode, offset, len) }).map(|_| 0)
}

/// Bytes of zeroes written per `pwrite` where `fallocate` cannot zero a range.
const ZERO_CHUNK: usize = 64 * 1024;

/// Zeroes a range, keeping it allocated: `FALLOC_FL_ZERO_RANGE`, or, on a file system
/// without it (tmpfs, some network file systems answer `EOPNOTSUPP`), written zeroes.
/// The device offers WRITE_ZEROES whatever the backing file is, so it must work on all.
fn write_zeroes(fd: RawFd, offset: u64, len: u64) -> io::Result<usize> {
    match fallocate(fd, WRITE_ZEROES_MODE, offset, len) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => pwrite_zeroes(fd, offset, len),
        other => other,
    }
}

/// Writes `len` zero bytes at `offset`, a bounded chunk at a time. The buffer is page
/// aligned and the range sector aligned (the request's), so this works on `O_DIRECT` files.
fn pwrite_zeroes(fd: RawFd, offset: u64, len: u64) -> io::Result<usize> {
    let chunk = usize::try_from(len).map_or(ZERO_CHUNK, |l| l.min(ZERO_CHUNK));
    let buf = AlignedBuf::new(chunk)?;
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(chunk as u64) as usize;
        let at = i64::try_from(offset + done)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `buf` is a live allocation of at least `n` bytes; the kernel only reads it.
        let wrote = unsafe { libc::pwrite(fd, buf.as_ptr().cast(), n, at) };
        match wrote {
            w if w > 0 => done += w as u64,
            0 => return Err(io::ErrorKind::WriteZero.into()),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(0)
}

/// `preadv`/`pwritev` until every iovec is done, resuming after short transfers.
///
/// The caller's iovecs are used in place, never copied (a copy per request was a heap
/// allocation): a transfer that stops inside an iovec is resumed with a one-element iovec
/// for the rest of that buffer, then the caller's array from the next one on.
///
/// # Safety
///
/// `iovecs` points at `count` initialised iovecs describing memory valid for the transfer
/// (writable for a read, readable for a write), and none of it is otherwise accessed until
/// this returns (the contract of [`Engine::push`]).
unsafe fn transfer_all(
    fd: RawFd,
    mut offset: u64,
    iovecs: *const libc::iovec,
    count: usize,
    write: bool,
) -> io::Result<usize> {
    if count == 0 {
        return Ok(0);
    }
    // SAFETY: this function's contract: `iovecs` points at `count` initialised iovecs that
    // stay valid, and unchanged, for the whole operation.
    let iov: &[libc::iovec] = unsafe { std::slice::from_raw_parts(iovecs, count) };
    // The first iovec not yet fully transferred, and how much of it already was.
    let mut start = 0usize;
    let mut skip = 0usize;
    let mut total = 0usize;
    while start < iov.len() {
        let rest_of_one;
        let (ptr, cnt) = if skip > 0 {
            rest_of_one = libc::iovec {
                iov_base: iov[start].iov_base.cast::<u8>().wrapping_add(skip).cast(),
                iov_len: iov[start].iov_len - skip,
            };
            (&raw const rest_of_one, 1)
        } else {
            let cnt = (iov.len() - start).min(libc::UIO_MAXIOV as usize);
            (iov[start..].as_ptr(), cnt as libc::c_int)
        };
        let off =
            i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `ptr` points at `cnt` iovecs (the caller's, or `rest_of_one`, which is
        // alive here) describing guest memory or bounce buffers that the caller keeps
        // mapped and does not otherwise touch until the operation completes.
        let n = unsafe {
            if write {
                libc::pwritev(fd, ptr, cnt, off)
            } else {
                libc::preadv(fd, ptr, cnt, off)
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let n = n as usize;
        total += n;
        offset += n as u64;
        // Skip the iovecs now fully transferred (and empty ones); note how far into the
        // next one the transfer got.
        let mut done = skip + n;
        while start < iov.len() && done >= iov[start].iov_len {
            done -= iov[start].iov_len;
            start += 1;
        }
        skip = done;
    }
    Ok(total)
}

/// Submission-queue entries: enough for a full 256-entry virtqueue in one batch.
const URING_ENTRIES: u32 = 256;

/// The io_uring engine, with an eventfd registered for completions.
pub(crate) struct UringEngine {
    file: File,
    ring: IoUring,
    completion_evt: vmm_sys_util::eventfd::EventFd,
    /// Write-zeroes in flight (token, offset, length): one the file system refuses is
    /// redone with written zeroes when it completes. Rare, so a short list.
    zeroing: Vec<(u64, u64, u64)>,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("file", &self.file)
            .finish()
    }
}

impl UringEngine {
    /// Sets up a ring, checks the kernel supports every opcode we use, and registers a
    /// completion eventfd.
    pub(crate) fn new(file: File) -> io::Result<Self> {
        let ring = IoUring::new(URING_ENTRIES)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        let needed = [
            opcode::Readv::CODE,
            opcode::Writev::CODE,
            opcode::Fsync::CODE,
            opcode::Fallocate::CODE,
        ];
        if let Some(missing) = needed.iter().find(|&&op| !probe.is_supported(op)) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring opcode {missing} not supported"),
            ));
        }
        let completion_evt =
            vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?;
        ring.submitter()
            .register_eventfd(completion_evt.as_raw_fd())?;
        Ok(Self {
            file,
            ring,
            completion_evt,
            zeroing: Vec::new(),
        })
    }

    fn entry(&self, op: Op) -> io::Result<squeue::Entry> {
        let fd = types::Fd(self.file.as_raw_fd());
        let too_many = || io::Error::from(io::ErrorKind::InvalidInput);
        Ok(match op {
            Op::Read {
                offset,
                iovecs,
                count,
            } => opcode::Readv::new(fd, iovecs, u32::try_from(count).map_err(|_| too_many())?)
                .offset(offset)
                .build(),
            Op::Write {
                offset,
                iovecs,
                count,
            } => opcode::Writev::new(fd, iovecs, u32::try_from(count).map_err(|_| too_many())?)
                .offset(offset)
                .build(),
            // IO_DRAIN: the flush starts only after everything submitted before it has
            // completed, so it covers every write the guest issued before the flush.
            Op::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .flags(squeue::Flags::IO_DRAIN),
            Op::Discard { offset, len } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(DISCARD_MODE)
                .build(),
            Op::WriteZeroes { offset, len } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(WRITE_ZEROES_MODE)
                .build(),
        })
    }
}

impl Engine for UringEngine {
    unsafe fn push(&mut self, op: Op, token: u64) -> io::Result<()> {
        let entry = self.entry(op)?.user_data(token);
        if let Op::WriteZeroes { offset, len } = op {
            self.zeroing.push((token, offset, len));
        }
        loop {
            // SAFETY: the contract of `push`: the entry's buffers (iovec arrays and what
            // they point to) stay valid and untouched until this token's completion is
            // reaped.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                return Ok(());
            }
            // Submission queue full: hand what we have to the kernel and retry.
            self.ring.submit()?;
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.ring.submit().map(|_| ())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let _ = self.completion_evt.read();
        let fd = self.file.as_raw_fd();
        for cqe in self.ring.completion() {
            let res = cqe.result();
            let token = cqe.user_data();
            let mut result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
                Ok(res as usize)
            };
            if let Some(i) = self.zeroing.iter().position(|z| z.0 == token) {
                let (_, offset, len) = self.zeroing.swap_remove(i);
                if res == -libc::EOPNOTSUPP {
                    result = pwrite_zeroes(fd, offset, len);
                }
            }
            out.push((token, result));
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        self.ring.submit_and_wait(1).map(|_| ())
    }

    fn notifier(&self) -> Option<RawFd> {
        Some(self.completion_evt.as_raw_fd())
    }

    fn has_completions(&mut self) -> bool {
        // The completion queue's tail lives in memory shared with the kernel.
        !self.ring.completion().is_empty()
    }

    fn name(&self) -> &'static str {
        "io_uring"
    }
}

/// A zeroed heap buffer aligned for `O_DIRECT`.
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is exclusively owned heap memory.
unsafe impl Send for AlignedBuf {}

/// Alignment of bounce buffers: a page satisfies every logical block size.
pub(crate) const DIRECT_ALIGN: usize = 4096;

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (at least one), page-aligned.
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), DIRECT_ALIGN)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::ErrorKind::OutOfMemory.into());
        }
        Ok(Self { ptr, layout })
    }

    /// The buffer.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `layout.size()` initialised bytes, borrowed
        // mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }

    /// Start of the buffer.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom};

    fn temp_file(len: usize) -> File {
        let tmp = crate::devices::virtio::test_utils::TempFile::new(&vec![0xaa; len]);
        tmp.open()
    }

    fn exercise(kind: EngineKind) {
        let mut f = temp_file(8192);
        let mut engine = open(kind, f.try_clone().unwrap()).unwrap();
        let mut a = vec![1u8; 100];
        let mut b = vec![2u8; 412];
        let iov = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: a.len(),
            },
            libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            },
        ];
        let write = Op::Write {
            offset: 512,
            iovecs: iov.as_ptr(),
            count: 2,
        };
        // SAFETY: `iov` and the buffers it points at outlive the operations, which are
        // reaped below before either is touched again.
        unsafe {
            engine.push(write, 7).unwrap();
            engine.push(Op::Flush, 8).unwrap();
            engine
                .push(
                    Op::WriteZeroes {
                        offset: 4096,
                        len: 4096,
                    },
                    9,
                )
                .unwrap();
        }
        engine.submit().unwrap();
        let mut done = Vec::new();
        while done.len() < 3 {
            engine.wait().unwrap();
            engine.reap(&mut done);
        }
        done.sort_by_key(|d| d.0);
        assert_eq!(done[0].0, 7);
        assert_eq!(*done[0].1.as_ref().unwrap(), 512);
        assert!(done[1].1.is_ok() && done[2].1.is_ok());

        let mut contents = Vec::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_end(&mut contents).unwrap();
        assert_eq!(contents.len(), 8192);
        assert!(contents[..512].iter().all(|&x| x == 0xaa));
        assert!(contents[512..612].iter().all(|&x| x == 1));
        assert!(contents[612..1024].iter().all(|&x| x == 2));
        assert!(contents[4096..].iter().all(|&x| x == 0));

        // Read it back through the engine.
        a.fill(0);
        b.fill(0);
        // SAFETY: as above; the read is reaped before `a` and `b` are read.
        unsafe {
            engine
                .push(
                    Op::Read {
                        offset: 512,
                        iovecs: iov.as_ptr(),
                        count: 2,
                    },
                    10,
                )
                .unwrap();
        }
        engine.submit().unwrap();
        done.clear();
        while done.is_empty() {
            engine.wait().unwrap();
            engine.reap(&mut done);
        }
        assert_eq!(*done[0].1.as_ref().unwrap(), 512);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
    }

    #[test]
    fn sync_engine_reads_writes_flushes_and_zeroes() {
        exercise(EngineKind::Sync);
    }

    #[test]
    fn io_uring_engine_reads_writes_flushes_and_zeroes() {
        // This host offers io_uring; if it did not, this must fail loudly.
        exercise(EngineKind::IoUring);
    }

    /// tmpfs has no `FALLOC_FL_ZERO_RANGE`: write-zeroes must still zero the range (it
    /// failed with EOPNOTSUPP, an I/O error for the guest, before the fallback).
    #[test]
    fn write_zeroes_works_on_tmpfs() {
        let dir = std::path::Path::new("/dev/shm");
        // SAFETY: statfs on a NUL-terminated path into a zeroed struct it fills.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::statfs(c"/dev/shm".as_ptr(), &mut st) }, 0);
        // (f_type and the magic numbers are typed differently by glibc and musl.)
        #[allow(clippy::unnecessary_cast)]
        let (f_type, tmpfs) = (st.f_type as i64, libc::TMPFS_MAGIC as i64);
        assert_eq!(f_type, tmpfs, "this test needs /dev/shm on tmpfs");
        for kind in [EngineKind::Sync, EngineKind::IoUring] {
            let path = dir.join(format!("ember-zeroes-{}-{kind:?}", std::process::id()));
            std::fs::write(&path, vec![0xaau8; 3 * ZERO_CHUNK]).unwrap();
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let mut engine = open(kind, file).unwrap();
            let (offset, len) = (512, 2 * ZERO_CHUNK as u64 + 1024);
            // SAFETY: write-zeroes points at no memory.
            unsafe { engine.push(Op::WriteZeroes { offset, len }, 5) }.unwrap();
            engine.submit().unwrap();
            let mut done = Vec::new();
            while done.is_empty() {
                engine.wait().unwrap();
                engine.reap(&mut done);
            }
            let contents = std::fs::read(&path).unwrap();
            let _ = std::fs::remove_file(&path);
            assert!(done[0].1.is_ok(), "{kind:?}: {:?}", done[0].1);
            let (a, b) = (offset as usize, (offset + len) as usize);
            assert!(contents[..a].iter().all(|&x| x == 0xaa), "{kind:?}");
            assert!(contents[a..b].iter().all(|&x| x == 0), "{kind:?}");
            assert!(contents[b..].iter().all(|&x| x == 0xaa), "{kind:?}");
        }
    }

    #[test]
    fn engines_report_finished_work_before_it_is_reaped() {
        for kind in [EngineKind::Sync, EngineKind::IoUring] {
            let mut engine = open(kind, temp_file(4096)).unwrap();
            assert!(!engine.has_completions());
            // SAFETY: a flush points at no memory.
            unsafe { engine.push(Op::Flush, 1) }.unwrap();
            engine.submit().unwrap();
            engine.wait().unwrap();
            assert!(engine.has_completions(), "{}", engine.name());
            let mut done = Vec::new();
            engine.reap(&mut done);
            assert_eq!(done.len(), 1);
            assert!(!engine.has_completions(), "{}", engine.name());
        }
    }

    #[test]
    fn aligned_buffers_are_page_aligned_and_zeroed() {
        let mut b = AlignedBuf::new(1000).unwrap();
        assert_eq!(b.as_ptr() as usize % DIRECT_ALIGN, 0);
        assert!(b.as_mut_slice().iter().all(|&x| x == 0));
    }
}
