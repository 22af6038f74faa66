//! Reliability through the `ember` binary: what a hostile or careless
//! user can do to it (issue 22).
//!
//! One test binary (one link of ember and the test dependencies) for what
//! were separate ones: each module below is one of them, its tests named
//! `module::test` (`cargo test --test GROUP -- module::` runs one).

#[path = "../common/mod.rs"]
mod common;

mod reliability_run;
mod reliability_vm;
