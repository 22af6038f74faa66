//! Keeps glibc off vector registers the guest kernel does not switch.
//!
//! On a software KVM such as this project's PVM host, guest user mode runs
//! natively on the host CPU, so `cpuid` and `xgetbv` in the guest report the
//! *host's* extended state: AVX, AVX-512 enabled in XCR0. A guest kernel that
//! cannot use XSAVE there (the PVM test kernel boots with `noxsave`: its
//! `xrstor` cannot be emulated) saves only the FXSAVE part — x87 and the low
//! 128 bits of xmm0-15 — when it switches processes. The upper halves of the
//! ymm registers, ymm16-31 and the mask registers then pass from one process
//! to the next: glibc's AVX2/EVEX `memcpy`, preempted by a page fault into a
//! fresh page while another process runs its own, stores the other process's
//! bytes (a static busybox's TLS block got zeros that way, and the process
//! died on its first TLS load).
//!
//! glibc picks its string functions from `cpuid`/`xgetbv`, and its tunables
//! can take the vector features away: when the CPU exposes state the kernel
//! does not save, the command's environment gets them.

/// XCR0 bits every x86-64 kernel saves with FXSAVE: x87 and SSE.
const FXSAVE_STATE: u64 = 0b11;
/// CPUID.1:ECX bit 27: the OS has set CR4.OSXSAVE, so `xgetbv` works.
const CPUID1_ECX_OSXSAVE: u32 = 1 << 27;

/// The variable and what it sets. `-OSXSAVE` takes every XSAVE-dependent
/// feature away (glibc 2.34+); the preferred-bit `AVX_Fast_Unaligned_Load`
/// survives that and would still select the AVX `memcpy`; the named
/// features are for older glibcs. Names a glibc does not know are ignored.
pub const TUNABLES_VAR: &[u8] = b"GLIBC_TUNABLES=";
pub const HWCAPS: &[u8] = ember_frames::GLIBC_HWCAPS.as_bytes();

/// Whether user mode can use extended state that the kernel does not save
/// across a context switch.
pub fn kernel_misses_vector_state() -> bool {
    let leaf1 = core::arch::x86_64::__cpuid(1);
    if leaf1.ecx & CPUID1_ECX_OSXSAVE == 0 {
        return false;
    }
    let (lo, hi): (u32, u32);
    // SAFETY: xgetbv with ECX=0 reads XCR0; CPUID says the OS enabled it.
    unsafe {
        core::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi,
            options(nomem, nostack, preserves_flags));
    }
    let xcr0 = u64::from(hi) << 32 | u64::from(lo);
    // An old kernel cannot say: assume it saves what it enabled.
    let Some(saved) = crate::sys::kernel_xfeatures() else {
        return false;
    };
    xcr0 & !(saved | FXSAVE_STATE) != 0
}

/// The `GLIBC_TUNABLES=` entry the command gets, given the one it brought
/// (`existing`, the whole `NAME=value` entry) if any: `None` leaves it as it
/// is — a caller who sets `glibc.cpu.hwcaps` has chosen the features.
pub fn tunables_entry<'a>(existing: Option<&[u8]>, out: &'a mut [u8]) -> Option<&'a [u8]> {
    let mut len = 0;
    let mut put = |s: &[u8]| -> Option<()> {
        out.get_mut(len..len + s.len())?.copy_from_slice(s);
        len += s.len();
        Some(())
    };
    match existing {
        None => {
            put(TUNABLES_VAR)?;
            put(HWCAPS)?;
        }
        Some(e) if e.windows(17).any(|w| w == b"glibc.cpu.hwcaps=") => return None,
        Some(e) => {
            put(e)?;
            if e.len() > TUNABLES_VAR.len() {
                put(b":")?;
            }
            put(HWCAPS)?;
        }
    }
    Some(&out[..len])
}
