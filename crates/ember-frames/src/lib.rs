//! What ember and its appliance's guest init (`guests/init`, freestanding)
//! both need, written once: here the frame header and type bytes of the
//! appliance channel protocol (ember's host side, `src/appliance/protocol.rs`,
//! describes the conversation); the busybox applet list ([`applets`]); where
//! a kernel module's signature starts ([`module_sig`]); the guest's network
//! configuration for `ember run --net` ([`netconf`]); the glibc tunables that
//! keep a process off vector state a guest kernel does not switch
//! ([`GLIBC_HWCAPS`]). Hence `no_std`, no
//! allocation and no dependencies. Its functions are `#[inline]`: compiled
//! in the caller, as they were when ember-init included these files itself,
//! they give ember-init the same instructions (without, LLVM optimises them
//! here first, and ember-init grows by 640 bytes).

#![no_std]

#[cfg(test)]
extern crate std;

pub mod applets;
pub mod module_sig;
pub mod netconf;

/// The `GLIBC_TUNABLES` value that keeps glibc off vector registers whose
/// state a guest kernel does not save between processes (the PVM test
/// kernel runs with `noxsave`: ARCHITECTURE.md). ember-init gives it to the
/// appliance's command; the PVM tests' busybox scripts export it.
/// `-AVX_Fast_Unaligned_Load` matters most: the preferred bit survives
/// `-AVX` and would still select the AVX `memcpy`; the named features are
/// for older glibcs. Names a glibc does not know are ignored.
pub const GLIBC_HWCAPS: &str = "glibc.cpu.hwcaps=-AVX_Fast_Unaligned_Load,-OSXSAVE,-XSAVEC,-XSAVE,\
-AVX,-AVX2,-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD,-FMA,-FMA4";

/// Frame header: type byte + little-endian u32 payload length.
pub const HEADER_LEN: usize = 5;
/// Largest payload either side sends or accepts.
pub const MAX_PAYLOAD: usize = 64 * 1024;

// Guest → host.
/// The guest set its channel up and waits for the command (empty payload).
pub const READY: u8 = 0x01;
/// Bytes the command wrote to its stdout.
pub const STDOUT: u8 = 0x02;
/// Bytes the command wrote to its stderr.
pub const STDERR: u8 = 0x03;
/// The command finished: i32 le, its exit code (128 + signal if killed).
pub const EXIT: u8 = 0x04;
/// The appliance itself failed (UTF-8 message); no EXIT follows.
pub const ERROR: u8 = 0x05;

// Host → guest.
/// One argv element (the first is `argv[0]`).
pub const ARG: u8 = 0x10;
/// One environment entry, `NAME=value`.
pub const ENV: u8 = 0x11;
/// The working directory.
pub const CWD: u8 = 0x12;
/// The path to execute; ends the command description and starts it.
pub const EXEC: u8 = 0x13;
/// Bytes for the command's stdin.
pub const STDIN: u8 = 0x14;
/// The command's stdin ends (empty payload).
pub const STDIN_EOF: u8 = 0x15;
/// Before EXEC: a block device (path) holding the command's root, an ext4
/// file system init mounts (DAX where the device allows) and runs the
/// command chrooted in. A restored appliance gets its files this way.
pub const ROOT: u8 = 0x16;
/// The host has the guest's `EXIT` or `ERROR` and everything sent before it
/// (empty payload): the guest may power off. Until then it must not: a port
/// the host reads slowly still holds output in its queue, which a VMM that
/// ends with the guest would drop.
pub const DONE: u8 = 0x17;
/// Before EXEC: configure the guest's network (`ember run --net`); the
/// payload's layout is in [`netconf`].
pub const NET: u8 = 0x18;
/// Before EXEC: the tag of a virtio-fs share holding the host's root. Init
/// mounts it read-only under a writable overlay in guest memory (tmpfs),
/// with /dev, /proc and /sys of its own, and runs the command chrooted
/// there.
pub const HOSTROOT: u8 = 0x19;
/// Before EXEC, after HOSTROOT: one more share, `ro|rw TAG GUEST-PATH`
/// (the path is the rest of the payload, spaces and all), mounted at
/// GUEST-PATH of that root.
pub const SHARE: u8 = 0x1a;
