//! What can go wrong in `ember run` and `ember setup`, and the exit status
//! each failure gives.

use super::{builder, closure, host, kernel, modules, rig};
use crate::backend;
use thiserror::Error;

/// Exit status when the appliance (not the command) failed.
pub const EXIT_APPLIANCE: i32 = 125;
/// Exit status when the reader of our output went away (128 + SIGPIPE).
pub const EXIT_BROKEN_PIPE: i32 = 141;
/// Exit status when the command cannot be carried into the appliance.
pub const EXIT_CANNOT_RUN: i32 = 126;
/// Exit status when the command is not found.
pub const EXIT_NOT_FOUND: i32 = 127;

/// Appliance errors.
#[derive(Debug, Error)]
pub enum ApplianceError {
    /// Kernel lookup or setup failed.
    #[error("kernel")]
    Kernel(#[from] kernel::KernelError),
    /// Module selection failed.
    #[error("kernel modules")]
    Modules(#[from] modules::ModuleError),
    /// The command cannot be found or carried.
    #[error("command")]
    Closure(#[from] closure::ClosureError),
    /// Writing the initramfs failed.
    #[error("appliance build")]
    Build(#[from] builder::BuildError),
    /// Booting or talking to the guest failed.
    #[error("appliance run")]
    Host(#[from] host::HostError),
    /// A backend problem.
    #[error("backend")]
    Backend(#[from] backend::BackendError),
    /// ember-init is nowhere to be found.
    #[error(
        "ember-init not found next to the ember binary: build it with \
         `cargo build --release -p ember-init`, or set EMBER_INIT=PATH"
    )]
    NoInit,
    /// A bad command-line value.
    #[error("{0}")]
    BadArg(String),
    /// The nested rig (`--nested-kvm`, `--file`) cannot be set up.
    #[error(transparent)]
    Rig(#[from] rig::RigError),
    /// The network (`--net`, `--publish`) cannot be set up.
    #[error(transparent)]
    Net(#[from] crate::passt::PasstError),
    /// `--netns`: the namespace's interface cannot be joined.
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
}

impl ApplianceError {
    /// The exit status `ember run` reports for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            ApplianceError::Closure(closure::ClosureError::NotFound(_)) => EXIT_NOT_FOUND,
            ApplianceError::Closure(_) => EXIT_CANNOT_RUN,
            _ => EXIT_APPLIANCE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_vmm::error_chain;

    #[test]
    fn exit_codes_of_errors() {
        let nf = ApplianceError::Closure(closure::ClosureError::NotFound("x".into()));
        assert_eq!(nf.exit_code(), EXIT_NOT_FOUND);
        let nc = ApplianceError::Closure(closure::ClosureError::NotCarriable {
            path: "/x".into(),
            why: closure::Unrunnable::Unknown,
        });
        assert_eq!(nc.exit_code(), EXIT_CANNOT_RUN);
        assert_eq!(ApplianceError::NoInit.exit_code(), EXIT_APPLIANCE);
        assert!(error_chain(&nc).contains("cannot carry `/x`"));
    }
}
