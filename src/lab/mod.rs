//! The boot lab: `ember bench`, `ember analyze`, `ember bench-range`.

use clap::Args;

/// Arguments of `ember bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {}

/// Arguments of `ember analyze`.
#[derive(Debug, Clone, Args)]
pub struct AnalyzeArgs {}

/// Arguments of `ember bench-range`.
#[derive(Debug, Clone, Args)]
pub struct RangeArgs {}

/// Runs `ember bench`; returns the exit status.
pub fn bench(_args: BenchArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}

/// Runs `ember analyze`; returns the exit status.
pub fn analyze(_args: AnalyzeArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}

/// Runs `ember bench-range`; returns the exit status.
pub fn bench_range(_args: RangeArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}
