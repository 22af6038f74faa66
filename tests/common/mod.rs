//! Shared helpers for ember's end-to-end tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The ember binary under test.
pub fn ember() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ember"))
}

/// Whether this host has a usable /dev/kvm. Without one, KVM tests fail —
/// unless EMBER_ALLOW_NO_KVM=1, in which case they print a loud SKIPPED line.
pub fn require_kvm(test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        if std::env::var_os("EMBER_ALLOW_NO_KVM").is_some() {
            eprintln!("\n*** SKIPPED {test}: /dev/kvm is not usable on this host ***\n");
            return false;
        }
        panic!(
            "{test}: /dev/kvm is not usable (set EMBER_ALLOW_NO_KVM=1 to skip KVM tests loudly)"
        );
    }
    true
}

/// A scratch directory removed at drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("ember-test-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a command, returning its output; panics with context if it cannot start.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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

/// An initramfs holding just `/init` (and /dev/console so its output shows).
pub fn tiny_initramfs(path: &Path, msg: &str) {
    let mut w = ember::initramfs::NewcWriter::new(Vec::new());
    w.dir("/dev", 0o755).unwrap();
    w.char_dev("/dev/console", 0o600, 5, 1).unwrap();
    w.file("/init", 0o755, &tiny_init_elf(msg)).unwrap();
    let (bytes, _) = w.finish().unwrap();
    std::fs::write(path, bytes).unwrap();
}
