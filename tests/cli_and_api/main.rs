//! Tests that boot no guest, quick: the command line, the boot lab's
//! plumbing on stand-in VMMs and on recorded boots, `bench-range` on a scratch
//! repository, the appliance's public API, and the module graph.
//!
//! One test binary (one link of ember and the test dependencies) for what
//! were separate ones: each module below is one of them, its tests named
//! `module::test` (`cargo test --test GROUP -- module::` runs one).

mod appliance_api;
mod cli;
mod lab_cli;
mod lab_fixtures;
mod lab_range;
mod layers;
