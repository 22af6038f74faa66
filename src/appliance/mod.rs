//! The appliance: `ember setup` and `ember run -- CMD`.
//!
//! `ember run -- CMD` boots a throwaway VM whose initramfs holds our own
//! static init, the few kernel modules it needs and CMD with its libraries,
//! runs CMD there and relays its stdin, stdout, stderr and exit status over a
//! framed channel ([`protocol`]). Like libguestfs' supermin appliance, but
//! without udev, hwclock, ldconfig or a shell; and cached, so a second run
//! only stats files.
//!
//! Exit status: the command's own; 124 on `--timeout`; 125 when the
//! appliance or VMM failed; 126 when CMD cannot be carried into the
//! appliance; 127 when CMD is not found.

pub mod applets;
mod assemble;
pub mod builder;
pub mod cache;
mod cli;
pub mod closure;
pub mod host;
pub mod kernel;
pub mod module_sig;
pub mod modules;
pub mod protocol;
pub mod rig;
mod run;
pub mod userland;
pub mod warm;

use crate::backend;
pub use crate::exit::EXIT_TIMEOUT;
pub use assemble::{Assembled, Extras, Prepared, assemble, prepare, prepare_with};
pub use cli::{RunArgs, SetupArgs};
use ember_vmm::error_chain;
use std::path::PathBuf;
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

/// Runs `ember setup`; returns the exit status.
pub fn setup(args: SetupArgs) -> anyhow::Result<i32> {
    let cache = kernel::cache_dir()?;
    let k = kernel::setup(&cache, args.kernel.as_deref())?;
    if let Some(dir) = &k.modules {
        let mods = modules::ModuleTree::open(dir)?
            .resolve(modules::APPLIANCE_MODULES, modules::BLACKLIST)?;
        eprintln!("ember setup: {} appliance modules available", mods.len());
    }
    match find_init() {
        Ok(p) => eprintln!("ember setup: guest init {}", p.display()),
        Err(e) => eprintln!("ember setup: warning: {e}"),
    }
    Ok(0)
}

/// Runs `ember run [OPTIONS] -- CMD…`; returns the command's exit status.
/// Errors are printed here so each gets its own exit status.
pub fn run_command(args: &RunArgs) -> anyhow::Result<i32> {
    match run::run(args) {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("ember: {}", error_chain(&e));
            Ok(e.exit_code())
        }
    }
}

/// Where ember-init is: `$EMBER_INIT`, else next to the running ember (or in
/// the cargo target directory it was built in).
pub fn find_init() -> Result<PathBuf, ApplianceError> {
    if let Some(p) = std::env::var_os("EMBER_INIT") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|_| ApplianceError::NoInit)?;
    let dir = exe.parent().ok_or(ApplianceError::NoInit)?;
    [
        "ember-init",
        "../ember-init",
        "../release/ember-init",
        "../../release/ember-init",
    ]
    .iter()
    .map(|c| dir.join(c))
    .find(|p| p.is_file())
    .ok_or(ApplianceError::NoInit)
}

/// Parses `256M`, `1G`, `512K` or bytes (the VMM's size syntax) into MiB.
pub fn parse_mem_mib(s: &str) -> Result<u64, ApplianceError> {
    backend::parse_mem_mib(s).map_err(|e| ApplianceError::BadArg(format!("bad --mem: {e}")))
}

/// A fresh per-test scratch directory under the target directory.
#[cfg(test)]
pub(crate) fn test_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ember-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_sizes() {
        assert_eq!(parse_mem_mib("256M").unwrap(), 256);
        assert_eq!(parse_mem_mib("1g").unwrap(), 1024);
        assert_eq!(parse_mem_mib("524288K").unwrap(), 512);
        assert_eq!(parse_mem_mib("1048576").unwrap(), 1);
        for bad in ["", "M", "12Q", "-1M", "0", "99999999999999G"] {
            assert!(parse_mem_mib(bad).is_err(), "{bad}");
        }
    }

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
