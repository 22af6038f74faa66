//! Architecture code: pure functions that lay out x86-64 boot state in guest
//! memory and registers.

pub mod x86_64;
