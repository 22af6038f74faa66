//! x86-64: memory layout, boot protocol structures, registers, firmware tables.
//!
//! Everything here is a pure function over guest memory or register structs;
//! the KVM calls are the caller's. A boot, in order:
//!
//! 1. `boot::write_cmdline`, `boot::initrd_address` (then copy the initrd);
//! 2. `regs::write_gdt_and_idt`, and for the 64-bit Linux protocol
//!    `regs::write_identity_page_tables`;
//! 3. `mptable::setup_mptable` (kernels without ACPI) and
//!    `acpi::setup_acpi` (returns the RSDP address);
//! 4. `boot::configure_linux` (zero page) or `boot::configure_pvh`
//!    (`hvm_start_info`), given the RSDP;
//! 5. per vCPU: `cpuid::configure_cpuid`, `msr::boot_msrs`, then on the
//!    boot vCPU `regs::long_mode_sregs` + `regs::linux64_regs` or
//!    `regs::protected_mode_sregs` + `regs::pvh_regs`, and `regs::boot_fpu`.
//!
//! `builder` does exactly this; `tests/` here checks the writers share guest
//! memory without clobbering each other.

pub(crate) mod acpi;
pub mod boot;
pub(crate) mod cpuid;
pub mod layout;
pub(crate) mod mptable;
pub(crate) mod msr;
pub(crate) mod regs;

#[cfg(test)]
mod tests;
