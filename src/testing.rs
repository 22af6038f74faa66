//! Helpers for tests and benchmarks: building the test guest
//! (`guests/test-guest`) and deriving the other kernel formats from it.
//!
//! The guest is one ELF with two entry points (see its README): a Xen PVH
//! note, and the Linux 64-bit entry at load address + 0x200. From it we make a
//! copy without the PVH note (loaders then take the 64-bit entry) and a
//! synthetic bzImage (a real setup header in front of the same flat image).

use crate::arch::x86_64::layout;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Mutex;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum TestingError {
    /// Cargo couldn't be started.
    #[error("cannot run cargo to build the test guest")]
    CargoSpawn(#[source] io::Error),
    /// Cargo ran and failed.
    #[error("building the test guest failed ({status}):\n{stderr}")]
    Build {
        /// Cargo's exit status.
        status: ExitStatus,
        /// The end of cargo's error output.
        stderr: String,
    },
    /// An input file couldn't be read.
    #[error("cannot read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// An output file couldn't be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The input isn't an ELF we can convert.
    #[error("{}: {reason}", path.display())]
    BadElf {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Debug-exit status the guest writes for a malformed token or a failed
/// command (`ember-test-guest: error: …` on the console).
pub const GUEST_EXIT_ERROR: u8 = 2;
/// Debug-exit status the guest writes when it panics.
pub const GUEST_EXIT_PANIC: u8 = 3;
/// A CPU exception ends the guest with this plus the vector (#GP: 0x8d, #PF: 0x8e).
pub const GUEST_EXIT_EXCEPTION_BASE: u8 = 0x80;

/// The guest's result lines with this prefix (`blk`, `blkverify`, `touch`),
/// each as its `key=value` fields in order. Lines look like
/// `blk: op=read bs=4096 … lat_p99_ns=… dev=0xd0000000`; a word without `=`
/// (the `ok` of `blkverify: ok …`) becomes a key with an empty value.
pub fn guest_results(console: &str, prefix: &str) -> Vec<Vec<(String, String)>> {
    console
        .lines()
        .filter_map(|line| line.strip_prefix(prefix)?.strip_prefix(": "))
        .map(|fields| {
            fields
                .split_whitespace()
                .map(|f| {
                    let (k, v) = f.split_once('=').unwrap_or((f, ""));
                    (k.to_owned(), v.to_owned())
                })
                .collect()
        })
        .collect()
}

/// The workspace root (this crate's manifest directory).
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The guest's own target directory: tests run while the outer cargo holds
/// the lock on `target/`, so the guest builds elsewhere.
fn guest_target_dir() -> PathBuf {
    workspace_root().join("target").join("guests")
}

/// Builds the test guest (once per process; a failed build is retried on
/// the next call) and returns its ELF, which carries the PVH note.
pub fn test_guest() -> Result<PathBuf, TestingError> {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    // A poisoned lock only means another test panicked; the cache is still valid.
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = built.as_ref() {
        return Ok(path.clone());
    }
    let target_dir = guest_target_dir();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "build",
            "-p",
            "ember-test-guest",
            "--release",
            "--target-dir",
        ])
        .arg(&target_dir)
        .current_dir(workspace_root())
        // Flags meant for the host build (coverage, sanitizers) don't suit a
        // freestanding guest.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .output()
        .map_err(TestingError::CargoSpawn)?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        return Err(TestingError::Build {
            status: output.status,
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        });
    }
    let path = target_dir.join("release").join("ember-test-guest");
    *built = Some(path.clone());
    Ok(path)
}

/// Copies `elf` to `out` with every PT_NOTE program header turned into
/// PT_NULL, so loaders see no PVH note and take the 64-bit ELF entry.
pub fn without_pvh_note(elf: &Path, out: &Path) -> Result<(), TestingError> {
    let mut bytes = read(elf)?;
    let headers = Elf::parse(&bytes).map_err(|reason| bad(elf, reason))?;
    for ph in headers
        .program_headers
        .iter()
        .filter(|ph| ph.p_type == PT_NOTE)
    {
        bytes[ph.header_offset..ph.header_offset + 4].copy_from_slice(&PT_NULL.to_le_bytes());
    }
    write(out, &bytes)
}

/// Setup sectors after the boot sector: room for the header and the
/// real-mode stub (QEMU enters a bzImage there).
const SETUP_SECTS: usize = 1;
const SECTOR_SIZE: usize = 512;
/// Boot protocol 2.15 (the first with `kernel_info`).
const BOOT_PROTOCOL_VERSION: u16 = 0x020f;
/// `loadflags`: the protected-mode image loads at 0x100000.
const LOADED_HIGH: u8 = 0x01;
/// `xloadflags`: the image has a 64-bit entry at +0x200.
const XLF_KERNEL_64: u16 = 0x01;
/// Where a 64-bit entry sits in the protected-mode image.
const STARTUP_64_OFFSET: u64 = 0x200;
/// The guest reads at most 64 KiB of command line, NUL included.
const CMDLINE_SIZE: u32 = layout::CMDLINE_MAX_SIZE as u32 - 1;
const INITRD_ADDR_MAX: u32 = 0x7fff_ffff;
/// The image is not relocatable; it is aligned to its own 1 MiB load address.
const KERNEL_ALIGNMENT: u32 = 0x10_0000;
/// `kernel_info` magic, found in the guest's protected-mode image.
const KERNEL_INFO_MAGIC: &[u8; 4] = b"LToP";
const PAGE_SIZE: u64 = 4096;

/// Setup-header field offsets (Documentation/arch/x86/boot.rst).
mod hdr {
    pub const SETUP_SECTS: usize = 0x1f1;
    pub const SYSSIZE: usize = 0x1f4;
    pub const BOOT_FLAG: usize = 0x1fe;
    pub const JUMP: usize = 0x200;
    pub const HEADER: usize = 0x202;
    pub const VERSION: usize = 0x206;
    pub const KERNEL_VERSION: usize = 0x20e;
    pub const LOADFLAGS: usize = 0x211;
    pub const CODE32_START: usize = 0x214;
    pub const INITRD_ADDR_MAX: usize = 0x22c;
    pub const KERNEL_ALIGNMENT: usize = 0x230;
    pub const MIN_ALIGNMENT: usize = 0x235;
    pub const XLOADFLAGS: usize = 0x236;
    pub const CMDLINE_SIZE: usize = 0x238;
    pub const PREF_ADDRESS: usize = 0x258;
    pub const INIT_SIZE: usize = 0x260;
    pub const KERNEL_INFO_OFFSET: usize = 0x268;
}

/// Where the real-mode stub, its GDT and the version string sit in the setup.
const STUB_OFFSET: usize = 0x280;
const STUB_GDT_OFFSET: usize = 0x2c0;
const STUB_GDTR_OFFSET: usize = 0x2d8;
const VERSION_STRING_OFFSET: usize = 0x2e0;
const VERSION_STRING: &[u8] = b"ember-test-guest\0";

/// The real-mode entry (setup + 0x200 jumps here; CS = DS + 0x20, DS = the
/// setup segment, which is also the zero page). It switches to flat 32-bit
/// protected mode and enters the guest's Linux 32-bit entry with ESI = the
/// zero page, as the 32-bit boot protocol specifies. Hand-assembled (16-bit).
fn real_mode_stub() -> Vec<u8> {
    let gdt = (STUB_GDT_OFFSET as u32).to_le_bytes();
    let gdtr_base = (STUB_GDTR_OFFSET as u16 + 2).to_le_bytes();
    let gdtr = (STUB_GDTR_OFFSET as u16).to_le_bytes();
    let entry = (layout::KERNEL_START as u32).to_le_bytes();
    let mut code = vec![
        0xfa, // cli
        0x66,
        0x31,
        0xf6, // xor esi, esi
        0x8c,
        0xde, // mov si, ds
        0x66,
        0xc1,
        0xe6,
        0x04, // shl esi, 4: linear address of the zero page
        0x66,
        0x89,
        0xf0, // mov eax, esi
        0x66,
        0x05,
        gdt[0],
        gdt[1],
        gdt[2],
        gdt[3], // add eax, STUB_GDT_OFFSET
        0x66,
        0xa3,
        gdtr_base[0],
        gdtr_base[1], // mov [gdtr.base], eax
        0x66,
        0x0f,
        0x01,
        0x16,
        gdtr[0],
        gdtr[1], // lgdt [gdtr] (32-bit base)
        0x0f,
        0x20,
        0xc0, // mov eax, cr0
        0x0c,
        0x01, // or al, 1 (PE)
        0x0f,
        0x22,
        0xc0, // mov cr0, eax
        0xb8,
        0x10,
        0x00, // mov ax, 0x10 (flat data)
        0x8e,
        0xd8, // mov ds, ax
        0x8e,
        0xc0, // mov es, ax
        0x8e,
        0xd0, // mov ss, ax
        0x8e,
        0xe0, // mov fs, ax
        0x8e,
        0xe8, // mov gs, ax
        0x66,
        0xea, // jmp far dword 0x08:KERNEL_START
    ];
    code.extend_from_slice(&entry);
    code.extend_from_slice(&[0x08, 0x00]);
    code
}

// The setup area's pieces don't overlap and fit in the setup sectors.
const _: () = assert!(STUB_GDT_OFFSET + 3 * 8 <= STUB_GDTR_OFFSET);
const _: () = assert!(STUB_GDTR_OFFSET + 6 <= VERSION_STRING_OFFSET);
const _: () =
    assert!(VERSION_STRING_OFFSET + VERSION_STRING.len() <= (SETUP_SECTS + 1) * SECTOR_SIZE);

/// The stub's GDT: null, flat 32-bit code (0x08), flat data (0x10).
const STUB_GDT: [u64; 3] = [0, 0x00cf_9a00_0000_ffff, 0x00cf_9200_0000_ffff];

/// Writes a synthetic bzImage made from the test guest's ELF: a boot sector
/// and setup sector with a real boot-protocol 2.15 header (and a real-mode
/// stub for loaders that enter there), then the flat protected-mode image
/// that the ELF loads at 1 MiB, 64-bit entry at +0x200.
pub fn as_bzimage(elf: &Path, out: &Path) -> Result<(), TestingError> {
    let bytes = read(elf)?;
    let parsed = Elf::parse(&bytes).map_err(|reason| bad(elf, reason))?;
    let image = parsed
        .flat_image(&bytes)
        .map_err(|reason| bad(elf, reason))?;
    if parsed.entry != image.base + STARTUP_64_OFFSET {
        return Err(bad(elf, "the ELF entry is not at load address + 0x200"));
    }
    if image.base != layout::KERNEL_START {
        return Err(bad(elf, "the image does not load at 1 MiB"));
    }
    let kernel_info = image
        .bytes
        .chunks_exact(4)
        .position(|w| w == KERNEL_INFO_MAGIC)
        .map_or(0, |i| i * 4) as u32;

    let setup_len = (SETUP_SECTS + 1) * SECTOR_SIZE;
    let mut setup = vec![0u8; setup_len];
    let put = |setup: &mut Vec<u8>, at: usize, value: &[u8]| {
        setup[at..at + value.len()].copy_from_slice(value);
    };
    let init_size = (image.mem_size.div_ceil(PAGE_SIZE) * PAGE_SIZE) as u32;
    let syssize = image.bytes.len().div_ceil(16) as u32;
    put(&mut setup, hdr::SETUP_SECTS, &[SETUP_SECTS as u8]);
    put(&mut setup, hdr::SYSSIZE, &syssize.to_le_bytes());
    put(&mut setup, hdr::BOOT_FLAG, &0xaa55u16.to_le_bytes());
    // A short jump from 0x202 over the header to the stub.
    put(
        &mut setup,
        hdr::JUMP,
        &[0xeb, (STUB_OFFSET - hdr::HEADER) as u8],
    );
    put(&mut setup, hdr::HEADER, b"HdrS");
    put(
        &mut setup,
        hdr::VERSION,
        &BOOT_PROTOCOL_VERSION.to_le_bytes(),
    );
    let version_ptr = (VERSION_STRING_OFFSET - hdr::JUMP) as u16;
    put(&mut setup, hdr::KERNEL_VERSION, &version_ptr.to_le_bytes());
    put(&mut setup, hdr::LOADFLAGS, &[LOADED_HIGH]);
    let code32 = layout::KERNEL_START as u32;
    put(&mut setup, hdr::CODE32_START, &code32.to_le_bytes());
    put(
        &mut setup,
        hdr::INITRD_ADDR_MAX,
        &INITRD_ADDR_MAX.to_le_bytes(),
    );
    put(
        &mut setup,
        hdr::KERNEL_ALIGNMENT,
        &KERNEL_ALIGNMENT.to_le_bytes(),
    );
    put(&mut setup, hdr::MIN_ALIGNMENT, &[12]);
    put(&mut setup, hdr::XLOADFLAGS, &XLF_KERNEL_64.to_le_bytes());
    put(&mut setup, hdr::CMDLINE_SIZE, &CMDLINE_SIZE.to_le_bytes());
    put(
        &mut setup,
        hdr::PREF_ADDRESS,
        &layout::KERNEL_START.to_le_bytes(),
    );
    put(&mut setup, hdr::INIT_SIZE, &init_size.to_le_bytes());
    put(
        &mut setup,
        hdr::KERNEL_INFO_OFFSET,
        &kernel_info.to_le_bytes(),
    );
    put(&mut setup, STUB_OFFSET, &real_mode_stub());
    let gdt: Vec<u8> = STUB_GDT.iter().flat_map(|d| d.to_le_bytes()).collect();
    put(&mut setup, STUB_GDT_OFFSET, &gdt);
    let limit = (gdt.len() - 1) as u16;
    put(&mut setup, STUB_GDTR_OFFSET, &limit.to_le_bytes());
    put(&mut setup, VERSION_STRING_OFFSET, VERSION_STRING);

    setup.extend_from_slice(&image.bytes);
    write(out, &setup)
}

fn read(path: &Path) -> Result<Vec<u8>, TestingError> {
    std::fs::read(path).map_err(|source| TestingError::Read {
        path: path.to_owned(),
        source,
    })
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), TestingError> {
    std::fs::write(path, bytes).map_err(|source| TestingError::Write {
        path: path.to_owned(),
        source,
    })
}

fn bad(path: &Path, reason: &'static str) -> TestingError {
    TestingError::BadElf {
        path: path.to_owned(),
        reason,
    }
}

const PT_NULL: u32 = 0;
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const ELF_HEADER_SIZE: usize = 64;
const PROGRAM_HEADER_SIZE: usize = 56;

/// The parts of an ELF64 (little-endian) file we use.
struct Elf {
    entry: u64,
    program_headers: Vec<ProgramHeader>,
}

struct ProgramHeader {
    /// Where this header is in the file (to patch its type).
    header_offset: usize,
    p_type: u32,
    offset: u64,
    paddr: u64,
    filesz: u64,
    memsz: u64,
}

/// The loadable segments laid out flat from the lowest physical address.
struct FlatImage {
    base: u64,
    bytes: Vec<u8>,
    /// Bytes from `base` to the end of the highest segment in memory (with BSS).
    mem_size: u64,
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Elf {
    fn parse(b: &[u8]) -> Result<Elf, &'static str> {
        if b.len() < ELF_HEADER_SIZE || &b[..4] != b"\x7fELF" {
            return Err("not an ELF file");
        }
        if b[4] != 2 || b[5] != 1 {
            return Err("not a little-endian 64-bit ELF");
        }
        let phoff = usize::try_from(le_u64(b, 0x20)).map_err(|_| "bad program header offset")?;
        let phentsize = usize::from(le_u16(b, 0x36));
        let phnum = usize::from(le_u16(b, 0x38));
        if phentsize < PROGRAM_HEADER_SIZE {
            return Err("program headers too small");
        }
        let end = phnum
            .checked_mul(phentsize)
            .and_then(|n| n.checked_add(phoff))
            .ok_or("bad program header table")?;
        if end > b.len() {
            return Err("program header table past the end of the file");
        }
        let program_headers = (0..phnum)
            .map(|i| {
                let at = phoff + i * phentsize;
                ProgramHeader {
                    header_offset: at,
                    p_type: le_u32(b, at),
                    offset: le_u64(b, at + 8),
                    paddr: le_u64(b, at + 24),
                    filesz: le_u64(b, at + 32),
                    memsz: le_u64(b, at + 40),
                }
            })
            .collect();
        Ok(Elf {
            entry: le_u64(b, 0x18),
            program_headers,
        })
    }

    fn flat_image(&self, file: &[u8]) -> Result<FlatImage, &'static str> {
        let loads: Vec<&ProgramHeader> = self
            .program_headers
            .iter()
            .filter(|ph| ph.p_type == PT_LOAD)
            .collect();
        let base = loads.iter().map(|ph| ph.paddr).min().ok_or("no PT_LOAD")?;
        let mut file_end = base;
        let mut mem_end = base;
        for ph in &loads {
            if ph.memsz < ph.filesz {
                return Err("a segment's file size exceeds its memory size");
            }
            let end_of = |len: u64| ph.paddr.checked_add(len).ok_or("segment wraps around");
            file_end = file_end.max(end_of(ph.filesz)?);
            mem_end = mem_end.max(end_of(ph.memsz)?);
        }
        let len = usize::try_from(file_end - base).map_err(|_| "image too large")?;
        if len > (1 << 30) {
            return Err("image too large");
        }
        let mut bytes = vec![0u8; len];
        for ph in &loads {
            let src = usize::try_from(ph.offset)
                .ok()
                .zip(usize::try_from(ph.filesz).ok())
                .and_then(|(o, n)| file.get(o..o.checked_add(n)?))
                .ok_or("segment past the end of the file")?;
            let at = (ph.paddr - base) as usize;
            bytes[at..at + src.len()].copy_from_slice(src);
        }
        Ok(FlatImage {
            base,
            bytes,
            mem_size: mem_end - base,
        })
    }
}

/// A complete static x86-64 ELF executable, written by hand so the test
/// depends on no toolchain: it prints `msg` to stdout, then asks the kernel to
/// reboot (with `reboot=k`, a keyboard-controller reset that ends the VM).
pub fn tiny_init_elf(msg: &str) -> Vec<u8> {
    const BASE: u64 = 0x400000;
    let mut code = Vec::new();
    code.extend([0xb8, 1, 0, 0, 0]); // mov eax, 1 (write)
    code.extend([0xbf, 1, 0, 0, 0]); // mov edi, 1 (stdout)
    let lea_at = code.len();
    code.extend([0x48, 0x8d, 0x35, 0, 0, 0, 0]); // lea rsi, [rip + msg]
    code.push(0xba); // mov edx, len
    code.extend((msg.len() as u32).to_le_bytes());
    code.extend([0x0f, 0x05]); // syscall
    code.extend([0xb8, 169, 0, 0, 0]); // mov eax, 169 (reboot)
    code.extend([0xbf, 0xad, 0xde, 0xe1, 0xfe]); // mov edi, LINUX_REBOOT_MAGIC1
    code.extend([0xbe, 0x69, 0x19, 0x12, 0x28]); // mov esi, LINUX_REBOOT_MAGIC2
    code.extend([0xba, 0x67, 0x45, 0x23, 0x01]); // mov edx, LINUX_REBOOT_CMD_RESTART
    code.extend([0x45, 0x31, 0xd2]); // xor r10d, r10d
    code.extend([0x0f, 0x05]); // syscall
    code.extend([0xeb, 0xfe]); // jmp $
    let disp = (code.len() - (lea_at + 7)) as u32;
    code[lea_at + 3..lea_at + 7].copy_from_slice(&disp.to_le_bytes());
    code.extend(msg.as_bytes());

    static_elf(BASE, &code)
}

/// A minimal static x86-64 ELF: one PT_LOAD at `base` holding the headers and
/// `code`, entered at the first byte of `code`.
pub fn static_elf(base: u64, code: &[u8]) -> Vec<u8> {
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    let entry = base + (EHDR + PHDR) as u64;
    let filesz = (EHDR + PHDR + code.len()) as u64;
    let mut elf = Vec::new();
    elf.extend(b"\x7fELF");
    elf.extend([2, 1, 1, 0]); // 64-bit, little-endian, version 1, SysV
    elf.extend([0u8; 8]);
    elf.extend(2u16.to_le_bytes()); // ET_EXEC
    elf.extend(62u16.to_le_bytes()); // EM_X86_64
    elf.extend(1u32.to_le_bytes());
    elf.extend(entry.to_le_bytes());
    elf.extend((EHDR as u64).to_le_bytes()); // e_phoff
    elf.extend(0u64.to_le_bytes()); // e_shoff
    elf.extend(0u32.to_le_bytes()); // e_flags
    elf.extend((EHDR as u16).to_le_bytes());
    elf.extend((PHDR as u16).to_le_bytes());
    elf.extend(1u16.to_le_bytes()); // e_phnum
    elf.extend([0u8; 6]); // shentsize, shnum, shstrndx
    elf.extend(1u32.to_le_bytes()); // PT_LOAD
    elf.extend(5u32.to_le_bytes()); // R + X
    elf.extend(0u64.to_le_bytes()); // p_offset
    elf.extend(base.to_le_bytes()); // p_vaddr
    elf.extend(base.to_le_bytes()); // p_paddr
    elf.extend(filesz.to_le_bytes());
    elf.extend(filesz.to_le_bytes());
    elf.extend(0x1000u64.to_le_bytes());
    elf.extend(code);
    elf
}

/// Reports a test that could not run here. Written straight to the process's
/// stderr, not through `eprintln!`, which the test harness captures (and hides
/// for a passing test): a skipped test must be seen.
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("\n!!!!!!!! SKIPPED {test}: {why} !!!!!!!!\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// An initramfs holding just `/init` ([`tiny_init_elf`]) and `/dev/console`
/// (so its output shows before devtmpfs exists).
pub fn tiny_initramfs(msg: &str) -> Result<Vec<u8>, crate::initramfs::InitramfsError> {
    let mut w = crate::initramfs::NewcWriter::new(Vec::new());
    w.dir("/dev", 0o755)?;
    w.char_dev("/dev/console", 0o600, 5, 1)?;
    w.file("/init", 0o755, &tiny_init_elf(msg))?;
    Ok(w.finish()?.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use linux_loader::loader::elf::{Elf as ElfLoader, PvhBootCapability};
    use linux_loader::loader::{KernelLoader, bzimage::BzImage};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// The first bytes of both entries: `mov $0x40,%al; out %al,$0x80`.
    const BOOT_MARK_CODE: [u8; 4] = [0xb0, 0x40, 0xe6, 0x80];
    const PVH_ENTRY: u64 = 0x10_0040;

    fn memory() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap()
    }

    fn code_at(mem: &GuestMemoryMmap<()>, addr: u64) -> [u8; 4] {
        let mut code = [0; 4];
        mem.read_slice(&mut code, GuestAddress(addr)).unwrap();
        code
    }

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ember-testing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn guest_elf_has_pvh_note_and_64_bit_entry() {
        let elf = test_guest().unwrap();
        let mem = memory();
        let mut file = std::fs::File::open(&elf).unwrap();
        let himem = Some(GuestAddress(layout::HIMEM_START));
        let result = ElfLoader::load(&mem, None, &mut file, himem).unwrap();
        assert_eq!(
            result.pvh_boot_cap,
            PvhBootCapability::PvhEntryPresent(GuestAddress(PVH_ENTRY))
        );
        assert_eq!(
            result.kernel_load,
            GuestAddress(layout::KERNEL_START + 0x200)
        );
        assert_eq!(code_at(&mem, PVH_ENTRY), BOOT_MARK_CODE);
        assert_eq!(code_at(&mem, layout::KERNEL_START + 0x200), BOOT_MARK_CODE);
        let size = std::fs::metadata(&elf).unwrap().len();
        assert!(size < 256 << 10, "the guest ELF grew to {size} bytes");
    }

    #[test]
    fn without_pvh_note_leaves_only_the_64_bit_entry() {
        let out = tmp("no-pvh.elf");
        without_pvh_note(&test_guest().unwrap(), &out).unwrap();
        let mem = memory();
        let mut file = std::fs::File::open(&out).unwrap();
        let result = ElfLoader::load(&mem, None, &mut file, None).unwrap();
        // linux-loader says "ignored" when there is no note to look at.
        assert!(
            !matches!(result.pvh_boot_cap, PvhBootCapability::PvhEntryPresent(_)),
            "{:?}",
            result.pvh_boot_cap
        );
        assert_eq!(
            result.kernel_load,
            GuestAddress(layout::KERNEL_START + 0x200)
        );
        assert_eq!(code_at(&mem, layout::KERNEL_START + 0x200), BOOT_MARK_CODE);
    }

    #[test]
    fn bzimage_loads_the_same_image_with_a_2_15_header() {
        let elf = test_guest().unwrap();
        let out = tmp("guest.bzImage");
        as_bzimage(&elf, &out).unwrap();

        let from_elf = memory();
        let mut file = std::fs::File::open(&elf).unwrap();
        ElfLoader::load(&from_elf, None, &mut file, None).unwrap();

        let mem = memory();
        let mut file = std::fs::File::open(&out).unwrap();
        let himem = Some(GuestAddress(layout::HIMEM_START));
        let result = BzImage::load(&mem, None, &mut file, himem).unwrap();
        let header = result.setup_header.unwrap();
        assert_eq!(result.kernel_load, GuestAddress(layout::KERNEL_START));
        assert_eq!({ header.version }, BOOT_PROTOCOL_VERSION);
        assert_eq!({ header.xloadflags } & XLF_KERNEL_64, XLF_KERNEL_64);
        assert_eq!({ header.code32_start }, layout::KERNEL_START as u32);
        assert_eq!({ header.pref_address }, layout::KERNEL_START);
        assert_ne!({ header.kernel_info_offset }, 0);
        let init_size = u64::from(header.init_size);
        assert!(init_size >= u64::from(header.syssize) * 16);

        // Byte for byte what the ELF loader put there, entries included.
        let mut a = vec![0u8; init_size as usize];
        let mut b = vec![0u8; init_size as usize];
        from_elf
            .read_slice(&mut a, GuestAddress(layout::KERNEL_START))
            .unwrap();
        mem.read_slice(&mut b, GuestAddress(layout::KERNEL_START))
            .unwrap();
        assert!(a == b, "the bzImage payload differs from the ELF image");
        assert_eq!(code_at(&mem, layout::KERNEL_START + 0x200), BOOT_MARK_CODE);
    }

    #[test]
    fn conversions_reject_non_elf_input() {
        let junk = tmp("junk.bin");
        std::fs::write(&junk, b"not an elf at all, just some bytes").unwrap();
        let out = tmp("junk.out");
        let err = as_bzimage(&junk, &out).unwrap_err();
        assert!(err.to_string().contains("not an ELF file"), "{err}");
        assert!(matches!(
            without_pvh_note(&junk, &out),
            Err(TestingError::BadElf { .. })
        ));
        assert!(matches!(
            as_bzimage(&tmp("missing"), &out),
            Err(TestingError::Read { .. })
        ));
    }

    #[test]
    fn truncated_program_headers_are_an_error() {
        let mut bytes = std::fs::read(test_guest().unwrap()).unwrap();
        bytes.truncate(ELF_HEADER_SIZE + 10);
        assert_eq!(
            Elf::parse(&bytes).err(),
            Some("program header table past the end of the file")
        );
    }

    #[test]
    fn guest_results_parses_only_matching_lines() {
        let console = "ember-test-guest: ring 3\nblk: op=read bs=4096 iops=12\n\
                       blkverify: ok blocks=2\nblk: op=write bs=512 iops=7\nxblk: op=no\n";
        let blk = guest_results(console, "blk");
        assert_eq!(blk.len(), 2);
        assert_eq!(blk[0][0], ("op".to_owned(), "read".to_owned()));
        assert_eq!(blk[1][2], ("iops".to_owned(), "7".to_owned()));
        let verify = guest_results(console, "blkverify");
        assert_eq!(verify[0][0], ("ok".to_owned(), String::new()));
        assert!(guest_results(console, "touch").is_empty());
    }

    #[test]
    fn real_mode_stub_fits_before_its_gdt() {
        assert!(STUB_OFFSET + real_mode_stub().len() <= STUB_GDT_OFFSET);
    }
}
