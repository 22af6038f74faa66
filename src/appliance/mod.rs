//! The appliance: `ember setup` and `ember run -- CMD`.

use clap::Args;

/// Arguments of `ember setup`.
#[derive(Debug, Clone, Args)]
pub struct SetupArgs {}

/// Runs `ember setup`; returns the exit status.
pub fn setup(_args: SetupArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}

/// Runs `ember run [OPTIONS] -- CMD…` (appliance mode); returns the command's exit status.
pub fn run_command(_args: &crate::run::RunArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}
