//! Helpers for tests and benchmarks: building the test guest
//! (`guests/test-guest`) and deriving the other kernel formats from it.
//!
//! The guest is one ELF with two entry points (see its README): a Xen PVH
//! note, and the Linux 64-bit entry at load address + 0x200. From it we make a
//! copy without the PVH note (loaders then take the 64-bit entry) and a
//! synthetic bzImage (a real setup header in front of the same flat image).

use ember_vmm::arch::x86_64::boot::{
    BOOT_FLAG_MAGIC, HDRS_MAGIC, LOADED_HIGH, SETUP_CODE_OFFSET, XLF_KERNEL_64, setup_header,
    write_setup_header,
};
use ember_vmm::arch::x86_64::layout;
use object::Endianness;
use object::elf::{FileHeader64, PT_LOAD, PT_NOTE, PT_NULL, ProgramHeader64};
use object::read::elf::{FileHeader, ProgramHeader};
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
        reason: String,
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

/// The workspace root (two levels above this crate's manifest directory).
fn workspace_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
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
    let parsed = Elf::parse(elf, &bytes)?;
    let notes: Vec<usize> = parsed
        .program_headers
        .iter()
        .filter(|(_, ph)| ph.p_type(parsed.endian) == PT_NOTE)
        .map(|(at, _)| *at)
        .collect();
    for at in notes {
        // p_type is the program header's first word.
        bytes[at..at + 4].copy_from_slice(&PT_NULL.0.to_le_bytes());
    }
    write(out, &bytes)
}

/// Where, in `elf`'s bytes, the type word of its Xen PVH entry note
/// (`XEN_ELFNOTE_PHYS32_ENTRY`) is: a test overwrites it to hide the note.
pub fn pvh_note_type_offset(elf: &[u8]) -> Option<usize> {
    /// `XEN_ELFNOTE_PHYS32_ENTRY` (xen/include/public/elfnote.h).
    const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
    let header = FileHeader64::<Endianness>::parse(elf).ok()?;
    let endian = header.endian().ok()?;
    for ph in header.program_headers(endian, elf).ok()? {
        let Ok(Some(mut notes)) = ph.notes(endian, elf) else {
            continue;
        };
        while let Ok(Some(note)) = notes.next() {
            if note.name() == b"Xen" && note.n_type(endian).0 == XEN_ELFNOTE_PHYS32_ENTRY {
                // The note borrows from `elf`: its place is its distance from
                // the start (n_type follows n_namesz and n_descsz).
                let at = note.name_bytes().as_ptr() as usize - elf.as_ptr() as usize;
                return Some(at - 4);
            }
        }
    }
    None
}

/// Setup sectors after the boot sector: room for the header and the
/// real-mode stub (QEMU enters a bzImage there).
const SETUP_SECTS: usize = 1;
const SECTOR_SIZE: usize = 512;
/// Boot protocol 2.15 (the first with `kernel_info`).
const BOOT_PROTOCOL_VERSION: u16 = 0x020f;
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
/// The header's `jump` (at 0x200) is a short jump, `eb <rel8>`, counted from
/// the end of the jump (0x202) to the stub.
const SHORT_JMP: u8 = 0xeb;
const JUMP_END: usize = SETUP_CODE_OFFSET + 2;

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
    let parsed = Elf::parse(elf, &bytes)?;
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
    let hdr = setup_header {
        setup_sects: SETUP_SECTS as u8,
        syssize: image.bytes.len().div_ceil(16) as u32,
        boot_flag: BOOT_FLAG_MAGIC,
        // Over the rest of the header to the stub.
        jump: u16::from_le_bytes([SHORT_JMP, (STUB_OFFSET - JUMP_END) as u8]),
        header: HDRS_MAGIC,
        version: BOOT_PROTOCOL_VERSION,
        kernel_version: (VERSION_STRING_OFFSET - SETUP_CODE_OFFSET) as u16,
        loadflags: LOADED_HIGH,
        code32_start: layout::KERNEL_START as u32,
        initrd_addr_max: INITRD_ADDR_MAX,
        kernel_alignment: KERNEL_ALIGNMENT,
        min_alignment: 12,
        xloadflags: XLF_KERNEL_64,
        cmdline_size: CMDLINE_SIZE,
        pref_address: layout::KERNEL_START,
        init_size: (image.mem_size.div_ceil(PAGE_SIZE) * PAGE_SIZE) as u32,
        kernel_info_offset: kernel_info,
        ..Default::default()
    };
    write_setup_header(&mut setup, &hdr).expect("the setup sectors hold the header");
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

fn bad(path: &Path, reason: impl Into<String>) -> TestingError {
    TestingError::BadElf {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// What the conversions need of an ELF64 file, read with `object`.
struct Elf<'a> {
    entry: u64,
    endian: Endianness,
    /// Each program header with where it is in the file (to patch its type).
    program_headers: Vec<(usize, &'a ProgramHeader64<Endianness>)>,
}

/// The loadable segments laid out flat from the lowest physical address.
struct FlatImage {
    base: u64,
    bytes: Vec<u8>,
    /// Bytes from `base` to the end of the highest segment in memory (with BSS).
    mem_size: u64,
}

impl<'a> Elf<'a> {
    /// `b`, the contents of `path` (named in the error).
    fn parse(path: &Path, b: &'a [u8]) -> Result<Elf<'a>, TestingError> {
        if !b.starts_with(b"\x7fELF") {
            return Err(bad(path, "not an ELF file"));
        }
        let header = FileHeader64::<Endianness>::parse(b).map_err(|e| bad(path, e.to_string()))?;
        let endian = header.endian().map_err(|e| bad(path, e.to_string()))?;
        if endian != Endianness::Little {
            return Err(bad(path, "not a little-endian ELF"));
        }
        let phoff = header.e_phoff(endian) as usize;
        let phentsize = usize::from(header.e_phentsize(endian));
        let program_headers = header
            .program_headers(endian, b)
            .map_err(|e| bad(path, e.to_string()))?
            .iter()
            .enumerate()
            .map(|(i, ph)| (phoff + i * phentsize, ph))
            .collect();
        Ok(Elf {
            entry: header.e_entry(endian),
            endian,
            program_headers,
        })
    }

    fn flat_image(&self, file: &[u8]) -> Result<FlatImage, &'static str> {
        let loads: Vec<&ProgramHeader64<Endianness>> = self
            .program_headers
            .iter()
            .map(|(_, ph)| *ph)
            .filter(|ph| ph.p_type(self.endian) == PT_LOAD)
            .collect();
        let e = self.endian;
        let base = loads
            .iter()
            .map(|ph| ph.p_paddr(e))
            .min()
            .ok_or("no PT_LOAD")?;
        let mut file_end = base;
        let mut mem_end = base;
        for ph in &loads {
            let (paddr, filesz, memsz) = (ph.p_paddr(e), ph.p_filesz(e), ph.p_memsz(e));
            if memsz < filesz {
                return Err("a segment's file size exceeds its memory size");
            }
            let end_of = |len: u64| paddr.checked_add(len).ok_or("segment wraps around");
            file_end = file_end.max(end_of(filesz)?);
            mem_end = mem_end.max(end_of(memsz)?);
        }
        let len = usize::try_from(file_end - base).map_err(|_| "image too large")?;
        if len > (1 << 30) {
            return Err("image too large");
        }
        let mut bytes = vec![0u8; len];
        for ph in &loads {
            let src = ph
                .data(e, file)
                .map_err(|()| "segment past the end of the file")?;
            let at = (ph.p_paddr(e) - base) as usize;
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
    use object::elf::{EM_X86_64, ET_EXEC, PF_R, PF_X};
    use object::write::elf::{FileHeader as WFileHeader, ProgramHeader as WProgramHeader, Writer};
    let mut elf = Vec::new();
    let mut w = Writer::new(Endianness::Little, true, &mut elf);
    w.reserve_file_header();
    w.reserve_program_headers(1);
    let code_at = w.reserve(code.len() as u64, 1);
    let filesz = w.reserved_len();
    w.write_file_header(&WFileHeader {
        os_abi: object::elf::OsAbi(0),
        abi_version: 0,
        e_type: ET_EXEC,
        e_machine: EM_X86_64,
        e_entry: base + code_at,
        e_flags: object::elf::FileFlags(0),
    })
    .expect("an ELF of one segment and no sections is always valid");
    w.write_align_program_headers();
    w.write_program_header(&WProgramHeader {
        p_type: PT_LOAD,
        p_flags: PF_R | PF_X,
        p_offset: 0,
        p_vaddr: base,
        p_paddr: base,
        p_filesz: filesz,
        p_memsz: filesz,
        p_align: 0x1000,
    });
    w.write(code);
    elf
}

/// The subcommand an ember binary boots a kernel with: `boot`, or `run` for
/// a build from before `ember boot` existed (benchmarks compare against older
/// builds in the same run).
pub fn boot_subcommand(ember: &Path) -> &'static str {
    let help = std::process::Command::new(ember).arg("--help").output();
    let has_boot = help.is_ok_and(|h| {
        String::from_utf8_lossy(&h.stdout)
            .lines()
            .any(|l| l.trim_start().starts_with("boot "))
    });
    if has_boot { "boot" } else { "run" }
}

/// Whether this host has a usable /dev/kvm. Without one, a KVM test fails,
/// unless `EMBER_ALLOW_NO_KVM` is set, when it is skipped loudly ([`skip`]).
pub fn require_kvm(test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        if std::env::var_os("EMBER_ALLOW_NO_KVM").is_some() {
            skip(test, "/dev/kvm is not usable on this host");
            return false;
        }
        panic!(
            "{test}: /dev/kvm is not usable (set EMBER_ALLOW_NO_KVM=1 to skip KVM tests loudly)"
        );
    }
    true
}

/// Reports a test that could not run here. Written straight to the process's
/// stderr, not through `eprintln!`, which the test harness captures (and hides
/// for a passing test): a skipped test must be seen.
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("\n!!!!!!!! SKIPPED {test}: {why} !!!!!!!!\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// A private temporary directory, `$TMPDIR/ember-NAME-PID-N` (0700), removed
/// with everything in it when dropped: when its test passes and when it
/// panics, so a suite leaves nothing behind (`scripts/check-tmp`).
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory named after `name`; panics if it cannot be made
    /// (a test cannot run without it).
    pub fn new(name: &str) -> TempDir {
        use std::os::unix::fs::DirBuilderExt;
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ember-{name}-{}-{n}", std::process::id()));
        // A leftover of an earlier process with this pid.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TempDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A path `file` in a [`TempDir`] of its own, removed with it at drop.
#[derive(Debug)]
pub struct TempFile {
    path: PathBuf,
    _dir: TempDir,
}

impl TempFile {
    /// `$TMPDIR/ember-NAME-PID-N/FILE` (nothing is created at that path).
    pub fn new(name: &str, file: &str) -> TempFile {
        let dir = TempDir::new(name);
        TempFile {
            path: dir.join(file),
            _dir: dir,
        }
    }
}

impl std::ops::Deref for TempFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for TempFile {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for TempFile {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
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

    fn tmp(name: &str) -> TempFile {
        TempFile::new("testing", name)
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
        bytes.truncate(64 + 10);
        let err = Elf::parse(Path::new("guest"), &bytes)
            .err()
            .expect("a truncated ELF is refused")
            .to_string();
        assert!(err.contains("program header"), "{err}");
    }

    #[test]
    fn the_pvh_note_is_found_where_the_loader_reads_it() {
        let bytes = std::fs::read(test_guest().unwrap()).unwrap();
        let at = pvh_note_type_offset(&bytes).expect("the guest has a PVH note");
        assert_eq!(bytes[at..at + 4], 18u32.to_le_bytes());
        assert_eq!(&bytes[at + 4..at + 8], b"Xen\0");
        // With the note's type overwritten, the loader takes the 64-bit entry.
        let mut hidden = bytes.clone();
        hidden[at..at + 4].fill(0);
        assert_eq!(pvh_note_type_offset(&hidden), None);
        let out = tmp("hidden-note.elf");
        std::fs::write(&out, &hidden).unwrap();
        let mut file = std::fs::File::open(&out).unwrap();
        let result = ElfLoader::load(&memory(), None, &mut file, None).unwrap();
        assert!(!matches!(
            result.pvh_boot_cap,
            PvhBootCapability::PvhEntryPresent(_)
        ));
        let out2 = tmp("no-note.elf");
        without_pvh_note(&test_guest().unwrap(), &out2).unwrap();
        assert_eq!(pvh_note_type_offset(&std::fs::read(&out2).unwrap()), None);
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
