//! x86-64: memory layout, boot protocol structures, registers, firmware tables.

pub mod boot;
pub mod layout;
pub mod msr;
pub mod regs;
