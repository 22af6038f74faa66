//! x86-64: memory layout, boot protocol structures, registers, firmware tables.

pub mod layout;
