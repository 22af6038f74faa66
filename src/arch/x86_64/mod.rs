//! x86-64: memory layout, boot protocol structures, registers, firmware tables.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod regs;
