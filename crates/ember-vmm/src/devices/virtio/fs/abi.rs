//! The FUSE wire format (Linux `include/uapi/linux/fuse.h`), as far as the
//! passthrough server speaks it: protocol 7.31, little-endian like its only
//! guest, every struct `#[repr(C)]` with no implicit padding.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The protocol version the server speaks.
pub(crate) const KERNEL_VERSION: u32 = 7;
pub(crate) const KERNEL_MINOR_VERSION: u32 = 31;
/// The root directory's node ID.
pub(crate) const ROOT_ID: u64 = 1;

// Opcodes.
pub(crate) const LOOKUP: u32 = 1;
pub(crate) const FORGET: u32 = 2;
pub(crate) const GETATTR: u32 = 3;
pub(crate) const SETATTR: u32 = 4;
pub(crate) const READLINK: u32 = 5;
pub(crate) const SYMLINK: u32 = 6;
pub(crate) const MKNOD: u32 = 8;
pub(crate) const MKDIR: u32 = 9;
pub(crate) const UNLINK: u32 = 10;
pub(crate) const RMDIR: u32 = 11;
pub(crate) const RENAME: u32 = 12;
pub(crate) const LINK: u32 = 13;
pub(crate) const OPEN: u32 = 14;
pub(crate) const READ: u32 = 15;
pub(crate) const WRITE: u32 = 16;
pub(crate) const STATFS: u32 = 17;
pub(crate) const RELEASE: u32 = 18;
pub(crate) const FSYNC: u32 = 20;
pub(crate) const FLUSH: u32 = 25;
pub(crate) const INIT: u32 = 26;
pub(crate) const OPENDIR: u32 = 27;
pub(crate) const READDIR: u32 = 28;
pub(crate) const RELEASEDIR: u32 = 29;
pub(crate) const FSYNCDIR: u32 = 30;
pub(crate) const CREATE: u32 = 35;
pub(crate) const INTERRUPT: u32 = 36;
pub(crate) const DESTROY: u32 = 38;
pub(crate) const BATCH_FORGET: u32 = 42;
pub(crate) const FALLOCATE: u32 = 43;
pub(crate) const RENAME2: u32 = 45;
pub(crate) const LSEEK: u32 = 46;

// INIT flags.
pub(crate) const ASYNC_READ: u32 = 1 << 0;
pub(crate) const ATOMIC_O_TRUNC: u32 = 1 << 3;
pub(crate) const BIG_WRITES: u32 = 1 << 5;
pub(crate) const AUTO_INVAL_DATA: u32 = 1 << 12;
pub(crate) const PARALLEL_DIROPS: u32 = 1 << 18;
pub(crate) const MAX_PAGES: u32 = 1 << 22;
pub(crate) const CACHE_SYMLINKS: u32 = 1 << 23;

// SETATTR `valid` bits.
pub(crate) const FATTR_MODE: u32 = 1 << 0;
pub(crate) const FATTR_UID: u32 = 1 << 1;
pub(crate) const FATTR_GID: u32 = 1 << 2;
pub(crate) const FATTR_SIZE: u32 = 1 << 3;
pub(crate) const FATTR_ATIME: u32 = 1 << 4;
pub(crate) const FATTR_MTIME: u32 = 1 << 5;
pub(crate) const FATTR_FH: u32 = 1 << 6;
pub(crate) const FATTR_ATIME_NOW: u32 = 1 << 7;
pub(crate) const FATTR_MTIME_NOW: u32 = 1 << 8;

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
    pub padding: u16,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct OutHeader {
    pub len: u32,
    pub error: i32,
    pub unique: u64,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct EntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: Attr,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: Attr,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct ForgetIn {
    pub nlookup: u64,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct BatchForgetIn {
    pub count: u32,
    pub dummy: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct ForgetOne {
    pub nodeid: u64,
    pub nlookup: u64,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct SetattrIn {
    pub valid: u32,
    pub padding: u32,
    pub fh: u64,
    pub size: u64,
    pub lock_owner: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub unused4: u32,
    pub uid: u32,
    pub gid: u32,
    pub unused5: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct MknodIn {
    pub mode: u32,
    pub rdev: u32,
    pub umask: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct MkdirIn {
    pub mode: u32,
    pub umask: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct RenameIn {
    pub newdir: u64,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct Rename2In {
    pub newdir: u64,
    pub flags: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct LinkIn {
    pub oldnodeid: u64,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct OpenIn {
    pub flags: u32,
    pub open_flags: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct CreateIn {
    pub flags: u32,
    pub mode: u32,
    pub umask: u32,
    pub open_flags: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct ReleaseIn {
    pub fh: u64,
    pub flags: u32,
    pub release_flags: u32,
    pub lock_owner: u64,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub read_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// WRITE's arguments have READ's layout; the data follows.
pub(crate) type WriteIn = ReadIn;

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct WriteOut {
    pub size: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
    pub padding: u32,
    pub spare: [u32; 6],
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct FsyncIn {
    pub fh: u64,
    pub fsync_flags: u32,
    pub padding: u32,
}

/// INIT's arguments as every 7.x kernel sends them (newer ones append more).
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
    pub map_alignment: u16,
    pub flags2: u32,
    pub unused: [u32; 7],
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct Dirent {
    pub ino: u64,
    pub off: u64,
    pub namelen: u32,
    pub typ: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct FallocateIn {
    pub fh: u64,
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct LseekIn {
    pub fh: u64,
    pub offset: u64,
    pub whence: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct LseekOut {
    pub offset: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_the_kernels() {
        assert_eq!(size_of::<InHeader>(), 40);
        assert_eq!(size_of::<OutHeader>(), 16);
        assert_eq!(size_of::<Attr>(), 88);
        assert_eq!(size_of::<EntryOut>(), 128);
        assert_eq!(size_of::<AttrOut>(), 104);
        assert_eq!(size_of::<SetattrIn>(), 88);
        assert_eq!(size_of::<ReadIn>(), 40);
        assert_eq!(size_of::<StatfsOut>(), 80);
        assert_eq!(size_of::<InitOut>(), 64);
        assert_eq!(size_of::<Dirent>(), 24);
        assert_eq!(size_of::<FallocateIn>(), 32);
    }
}
