//! The `ember` binary: argument parsing and error reporting. Everything else
//! lives in the `ember` library and, for the VMM, in `ember-vmm`.

use clap::{CommandFactory, Parser, Subcommand};
use std::io::Write;

/// The shipped build's allocator. musl's own (mallocng) maps a fresh page
/// for a small size class and unmaps it as soon as its last block is freed:
/// a restore made ~115 mmap/munmap calls before its first guest instruction,
/// and each munmap, with the VM's other threads running, sends a TLB
/// shootdown to the other CPUs (an IPI, which is expensive where ember itself
/// runs in a VM). dlmalloc keeps freed memory for reuse: restore → first
/// guest instruction 2.08 → 1.62 ms with 2 vCPUs, a cold boot's 3.18 → 2.84
/// ms, for 0.2 MiB more VMM memory (BENCHMARKS.md §9.5).
/// glibc builds keep glibc's allocator, which does not behave that way.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

/// The environment variables ember reads, shown under every `--help`.
const ENVIRONMENT: &str = "\
Environment:
  EMBER_CACHE     ember's cache: kernel, modules, appliances [default: $XDG_CACHE_HOME/ember, else ~/.cache/ember]
  EMBER_CACHE_MAX built appliances kept in the cache, least recently used evicted first (bytes, or K/M/G) [default: 1G]
  XDG_CACHE_HOME  where the cache goes when EMBER_CACHE is unset
  EMBER_INIT      the appliance's guest init [default: ember-init next to the ember binary]
  EMBER_QEMU      the qemu backend's binary [default: qemu-system-x86_64 on PATH]
  EMBER_PASST     `run --net`: the passt binary [default: passt on PATH]
  EMBER_VIRTIOFSD `run` on the qemu backend: the virtiofsd that serves the host's root and --share [default: $CARGO_HOME/bin/virtiofsd (CARGO_HOME: ~/.cargo), virtiofsd on PATH, /usr/lib/qemu/virtiofsd]
  EMBER_KERNEL_SOURCE  `analyze --advise`: the kernel source (tarball or tree) that maps initcalls to Kconfig symbols [default: the newest /usr/src/linux-source-*]
  EMBER_CTL_TIMEOUT  `ctl`, `snapshot`: seconds to wait for the control socket's connection and its reply's first byte [default: 5]
  EMBER_API_REQUEST_TIMEOUT  `boot --api-socket`: seconds a client has to send a whole request [default: 60]
  HOME            `bench-range`: its results and worktrees go in $HOME/.cache/ember/bench-range
  PATH            where `ember run -- CMD` looks for CMD (and the qemu binary); `ember run` passes the caller's environment on
  EMBER_TEST_SECCOMP_VIOLATION  debug builds only, for tests: `block` has the virtio-blk thread make a forbidden call";

#[derive(Debug, Parser)]
#[command(
    name = "ember",
    version,
    about = "A microVM monitor for Linux/KVM, and a boot-time lab",
    after_help = ENVIRONMENT
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log output: `ember -v CMD` for debug, `-vv` for trace (the base level is
    /// `EMBER_LOG`, else info). `ember run --verbose` also raises it one step.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a kernel directly on KVM (no firmware); the guest's console is
    /// the terminal and its ending is the exit status.
    Boot(Box<ember::boot::BootArgs>),
    /// Run `-- CMD` in a fresh appliance VM; its output and exit status are the command's.
    #[command(after_help = ENVIRONMENT)]
    Run(Box<ember::appliance::RunArgs>),
    /// Fetch the default guest kernel and prepare the appliance cache.
    #[command(after_help = ENVIRONMENT)]
    Setup(ember::appliance::SetupArgs),
    /// Boot a guest N times and report boot-time statistics.
    #[command(after_help = ENVIRONMENT)]
    Bench(ember::lab::BenchArgs),
    /// Timestamp every console line and VMM event of N boots; find the slow parts.
    #[command(after_help = ENVIRONMENT)]
    Analyze(ember::lab::AnalyzeArgs),
    /// Benchmark each commit in a git range and flag changes beyond noise.
    #[command(after_help = ENVIRONMENT)]
    BenchRange(ember::lab::RangeArgs),
    /// Ask a running VM (`ember boot … --api-socket PATH`) to pause, resume, shut down…
    Ctl(ember::api::CtlArgs),
    /// Write a snapshot of a running VM (`ember boot --restore DIR` resumes it).
    Snapshot(ember::api::SnapshotArgs),
    /// Print a shell completion script (e.g. `ember completions bash >
    /// /etc/bash_completion.d/ember`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print a man page (roff; `ember man run | man -l -`): ember(1), or
    /// ember-SUBCOMMAND(1); `--dir DIR` writes them all.
    Man {
        /// The subcommand whose page to print (ember-SUBCOMMAND(1)); without
        /// it, ember(1).
        subcommand: Option<String>,
        /// Write every page (ember.1, ember-boot.1, ember-run.1, …) into DIR
        /// instead of printing one.
        #[arg(long, value_name = "DIR", conflicts_with = "subcommand")]
        dir: Option<std::path::PathBuf>,
    },
}

/// `ember boot` alone: what a boot parses. clap builds every subcommand's
/// arguments before it parses any, and the lab's are many; building only
/// `boot`'s takes a few hundred microseconds off every boot.
#[derive(Debug, Parser)]
#[command(name = "ember", version)]
struct BootCli {
    #[command(subcommand)]
    command: BootOnly,
}

#[derive(Debug, Subcommand)]
enum BootOnly {
    /// Boot a kernel directly on KVM (no firmware); the guest's console is
    /// the terminal and its ending is the exit status.
    Boot(Box<ember::boot::BootArgs>),
}

fn main() {
    ember_vmm::events::process_start();
    let (command, verbose) = if std::env::args_os().nth(1).is_some_and(|a| a == "boot") {
        ember_vmm::events::stage("vmm_main");
        let BootOnly::Boot(args) = BootCli::parse().command;
        (Command::Boot(args), 0)
    } else {
        let cli = Cli::parse();
        (cli.command, cli.verbose)
    };
    let verbose = match &command {
        Command::Run(args) => verbose.saturating_add(u8::from(args.verbose)),
        _ => verbose,
    };
    ember_vmm::logger::init(verbose);
    let result = match command {
        Command::Boot(args) => ember::boot::main(*args),
        Command::Run(args) => ember::appliance::run_command(&args),
        Command::Setup(args) => ember::appliance::setup(args),
        Command::Bench(args) => ember::lab::bench(args),
        Command::Analyze(args) => ember::lab::analyze(args),
        Command::BenchRange(args) => ember::lab::bench_range(args),
        Command::Ctl(args) => ember::api::ctl(args),
        Command::Snapshot(args) => ember::api::snapshot(args),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "ember", &mut std::io::stdout());
            Ok(0)
        }
        Command::Man { subcommand, dir } => man(subcommand.as_deref(), dir.as_deref()),
    };
    // `exit` runs no destructors: what is still registered is undone first.
    ember::cleanup::run_all();
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ember: {e:#}");
            std::process::exit(1);
        }
    }
}

/// `ember man`: the pages, generated from the CLI definition (clap_mangen):
/// ember(1) lists the subcommands and the environment; each
/// ember-SUBCOMMAND(1) has the subcommand's synopsis, description and
/// options. One page to stdout, or all of them into `dir`.
fn man(subcommand: Option<&str>, dir: Option<&std::path::Path>) -> anyhow::Result<i32> {
    let mut cmd = Cli::command().disable_help_subcommand(true);
    // Gives each subcommand its page name (`ember-boot`) and synopsis
    // name (`ember boot`).
    cmd.build();
    let subs: Vec<clap::Command> = cmd.get_subcommands().cloned().collect();
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
        let write = |name: String, page: &dyn Fn(&mut dyn Write) -> std::io::Result<()>| {
            let path = dir.join(name);
            let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
            page(&mut file)?;
            file.flush()?;
            println!("{}", path.display());
            anyhow::Ok(())
        };
        write("ember.1".into(), &|w| main_page(&cmd, w))?;
        for sub in &subs {
            write(format!("{}.1", page_name(sub)), &|w| sub_page(sub, w))?;
        }
        return Ok(0);
    }
    let mut out = std::io::stdout().lock();
    match subcommand {
        None => main_page(&cmd, &mut out)?,
        Some(name) => {
            let Some(sub) = subs.iter().find(|s| s.get_name() == name) else {
                let names: Vec<&str> = subs.iter().map(|s| s.get_name()).collect();
                anyhow::bail!("no subcommand `{name}` (one of: {})", names.join(", "));
            };
            sub_page(sub, &mut out)?;
        }
    }
    Ok(0)
}

/// `ember-boot` for `ember boot` (the name `build` gave it).
fn page_name(sub: &clap::Command) -> &str {
    sub.get_display_name().unwrap_or(sub.get_name())
}

/// ember(1): what ember is, its subcommands (each a page of its own), the
/// environment.
fn main_page(cmd: &clap::Command, w: &mut dyn Write) -> std::io::Result<()> {
    let page = clap_mangen::Man::new(cmd.clone());
    page.render_title(w)?;
    page.render_name_section(w)?;
    page.render_synopsis_section(w)?;
    page.render_description_section(w)?;
    page.render_options_section(w)?;
    page.render_subcommands_section(w)?;
    environment_section(w)?;
    page.render_version_section(w)
}

/// ember-SUBCOMMAND(1): the subcommand's synopsis, description and options;
/// the environment where its help shows it; a pointer back to ember(1).
fn sub_page(sub: &clap::Command, w: &mut dyn Write) -> std::io::Result<()> {
    // Subcommands carry no version of their own; the page shows ember's.
    let page = clap_mangen::Man::new(sub.clone().version(env!("CARGO_PKG_VERSION")))
        .source(concat!("ember ", env!("CARGO_PKG_VERSION")));
    page.render_title(w)?;
    page.render_name_section(w)?;
    page.render_synopsis_section(w)?;
    page.render_description_section(w)?;
    page.render_options_section(w)?;
    if sub.get_after_help().is_some() {
        environment_section(w)?;
    }
    writeln!(w, ".SH \"SEE ALSO\"\n\\fBember\\fR(1)")?;
    page.render_version_section(w)
}

/// [`ENVIRONMENT`] as a man section.
fn environment_section(w: &mut dyn Write) -> std::io::Result<()> {
    writeln!(w, ".SH ENVIRONMENT")?;
    for line in ENVIRONMENT.lines().skip(1) {
        let line = line.trim_start();
        let (name, what) = line.split_once(' ').unwrap_or((line, ""));
        writeln!(
            w,
            ".TP\n\\fB{name}\\fR\n{}",
            what.trim().replace('-', "\\-")
        )?;
    }
    Ok(())
}
