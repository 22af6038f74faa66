//! The appliance: `ember setup` and `ember run -- CMD`.
//!
//! `ember run -- CMD` boots a throwaway VM whose initramfs holds our own
//! static init and the few kernel modules it needs, runs CMD there and
//! relays its stdin, stdout, stderr and exit status over a framed channel
//! ([`protocol`]). CMD runs on the host's own root, read-only over
//! virtio-fs under a writable overlay in guest memory ([`hostroot`]); or,
//! in the initramfs appliance, with CMD and its libraries carried in the
//! initramfs. Like libguestfs' supermin appliance, but without udev,
//! hwclock, ldconfig or a shell; and cached, so a second run only stats
//! files.
//!
//! Exit status: the command's own; 124 on `--timeout`; 125 when the
//! appliance or VMM failed; 126 when CMD cannot be carried into the
//! appliance; 127 when CMD is not found.

mod assemble;
pub mod builder;
pub mod cache;
mod cli;
pub mod closure;
mod error;
pub mod host;
pub mod hostroot;
pub mod kernel;
pub mod modules;
pub mod protocol;
pub mod rig;
mod run;
pub mod userland;
pub mod warm;

pub use crate::exit::EXIT_TIMEOUT;
pub use assemble::{
    Assembled, Extras, Prepared, assemble, find_init, prepare, prepare_boot_only, prepare_with,
    setup,
};
pub use cli::{RunArgs, SetupArgs, parse_mem_mib};
pub use error::{
    ApplianceError, EXIT_APPLIANCE, EXIT_BROKEN_PIPE, EXIT_CANNOT_RUN, EXIT_NOT_FOUND,
};
pub use run::run_command;

/// A fresh per-test scratch directory, removed when the test ends.
#[cfg(test)]
pub(crate) fn test_dir(name: &str) -> ember_testing::TempDir {
    ember_testing::TempDir::new(&format!("test-{name}"))
}
