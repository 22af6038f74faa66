//! The `ember` binary: argument parsing and error reporting. Everything else
//! lives in the library.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "ember",
    version,
    about = "A microVM monitor for Linux/KVM, and a boot-time lab"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a kernel on KVM, or run `-- CMD` in a fresh appliance VM.
    Run(Box<ember::run::RunArgs>),
    /// Fetch the default guest kernel and prepare the appliance cache.
    Setup(ember::appliance::SetupArgs),
    /// Boot a guest N times and report boot-time statistics.
    Bench(ember::lab::BenchArgs),
    /// Timestamp every console line and VMM event of N boots; find the slow parts.
    Analyze(ember::lab::AnalyzeArgs),
    /// Benchmark each commit in a git range and flag changes beyond noise.
    BenchRange(ember::lab::RangeArgs),
}

/// `ember run` alone: what a boot parses. clap builds every subcommand's
/// arguments before it parses any, and the lab's are many; building only
/// `run`'s takes a few hundred microseconds off every boot.
#[derive(Debug, Parser)]
#[command(name = "ember", version)]
struct RunCli {
    #[command(subcommand)]
    command: RunOnly,
}

#[derive(Debug, Subcommand)]
enum RunOnly {
    Run(Box<ember::run::RunArgs>),
}

fn main() {
    ember::events::process_start();
    let command = if std::env::args_os().nth(1).is_some_and(|a| a == "run") {
        let RunOnly::Run(args) = RunCli::parse().command;
        Command::Run(args)
    } else {
        Cli::parse().command
    };
    let result = match command {
        Command::Run(args) => ember::run::main(*args),
        Command::Setup(args) => ember::appliance::setup(args),
        Command::Bench(args) => ember::lab::bench(args),
        Command::Analyze(args) => ember::lab::analyze(args),
        Command::BenchRange(args) => ember::lab::bench_range(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ember: {e:#}");
            std::process::exit(1);
        }
    }
}
