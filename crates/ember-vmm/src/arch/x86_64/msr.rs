//! Model-specific registers at kernel entry.
//!
//! A vCPU created by KVM has most MSRs zeroed already; we still set the ones
//! Linux relies on explicitly, so the boot state does not depend on what a
//! particular KVM (or this machine's PVM) happens to reset them to. Nothing
//! here can fail, so the module has no error type.

use kvm_bindings::kvm_msr_entry;

/// IA32_TSC: the time-stamp counter. Zero at boot so every vCPU starts in step.
pub(crate) const MSR_IA32_TSC: u32 = 0x10;
/// IA32_SYSENTER_CS: code segment for SYSENTER (32-bit fast system calls).
pub(crate) const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// IA32_SYSENTER_ESP: stack for SYSENTER.
pub(crate) const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// IA32_SYSENTER_EIP: entry point for SYSENTER.
pub(crate) const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// IA32_MISC_ENABLE: assorted feature switches.
pub(crate) const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MTRR_DEF_TYPE: memory type for addresses no MTRR range covers.
pub(crate) const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// STAR: SYSCALL/SYSRET segment selectors.
pub(crate) const MSR_STAR: u32 = 0xc000_0081;
/// LSTAR: 64-bit SYSCALL entry point.
pub(crate) const MSR_LSTAR: u32 = 0xc000_0082;
/// CSTAR: compatibility-mode SYSCALL entry point.
pub(crate) const MSR_CSTAR: u32 = 0xc000_0083;
/// SYSCALL_MASK (FMASK): RFLAGS bits cleared on SYSCALL.
pub(crate) const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// KERNEL_GS_BASE: the GS base SWAPGS exchanges in.
pub(crate) const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

/// IA32_MISC_ENABLE bit 0: fast-string operations. Linux checks it to decide
/// whether `rep movsb/stosb` are fast (X86_FEATURE_REP_GOOD / ERMS); without
/// it the kernel falls back to slower unrolled copies.
pub(crate) const MISC_ENABLE_FAST_STRING: u64 = 1 << 0;
/// IA32_MTRR_DEF_TYPE bits 0-7 = 6: write-back. With no variable ranges set,
/// all RAM is then cacheable, and Linux's MTRR sanity check sees a usable map.
pub(crate) const MTRR_TYPE_WRITE_BACK: u64 = 6;
/// IA32_MTRR_DEF_TYPE bit 11 (E): MTRRs enabled; if clear, all memory is
/// uncacheable regardless of the default type.
pub(crate) const MTRR_DEF_TYPE_ENABLE: u64 = 1 << 11;

fn msr(index: u32, data: u64) -> kvm_msr_entry {
    kvm_msr_entry {
        index,
        reserved: 0,
        data,
    }
}

/// MSR values for every vCPU at entry (pass to `KVM_SET_MSRS`).
///
/// The system-call MSRs are cleared: the kernel programs them itself in
/// `syscall_init()`, and zero means "not set up" rather than a stale pointer.
pub(crate) fn boot_msrs() -> Vec<kvm_msr_entry> {
    vec![
        msr(MSR_IA32_SYSENTER_CS, 0),
        msr(MSR_IA32_SYSENTER_ESP, 0),
        msr(MSR_IA32_SYSENTER_EIP, 0),
        msr(MSR_STAR, 0),
        msr(MSR_LSTAR, 0),
        msr(MSR_CSTAR, 0),
        msr(MSR_SYSCALL_MASK, 0),
        msr(MSR_KERNEL_GS_BASE, 0),
        msr(MSR_IA32_TSC, 0),
        msr(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        msr(
            MSR_MTRR_DEF_TYPE,
            MTRR_DEF_TYPE_ENABLE | MTRR_TYPE_WRITE_BACK,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(index: u32) -> Option<u64> {
        boot_msrs()
            .iter()
            .find(|e| e.index == index)
            .map(|e| e.data)
    }

    #[test]
    fn boot_msrs_have_the_expected_values() {
        assert_eq!(value(0x1a0), Some(1), "MISC_ENABLE fast strings");
        assert_eq!(value(0x2ff), Some(0x806), "MTRR enabled, default WB");
        for index in [
            0x10,
            0x174,
            0x175,
            0x176,
            0xc000_0081,
            0xc000_0082,
            0xc000_0083,
        ] {
            assert_eq!(value(index), Some(0), "{index:#x}");
        }
        assert_eq!(value(0xc000_0084), Some(0));
        assert_eq!(value(0xc000_0102), Some(0));
    }

    #[test]
    fn boot_msrs_are_unique() {
        let mut idx: Vec<u32> = boot_msrs().iter().map(|e| e.index).collect();
        let n = idx.len();
        idx.sort_unstable();
        idx.dedup();
        assert_eq!(idx.len(), n);
        assert!(boot_msrs().iter().all(|e| e.reserved == 0));
    }
}
