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

pub mod builder;
pub mod closure;
pub mod host;
pub mod kernel;
pub mod modules;
pub mod protocol;

use crate::backend::{self, ChannelKind, GuestSpec};
use crate::run::RunArgs;
use clap::Args;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Exit status when `--timeout` expires.
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit status when the appliance (not the command) failed.
pub const EXIT_APPLIANCE: i32 = 125;
/// Exit status when the command cannot be carried into the appliance.
pub const EXIT_CANNOT_RUN: i32 = 126;
/// Exit status when the command is not found.
pub const EXIT_NOT_FOUND: i32 = 127;

/// The command's environment unless `--env` overrides an entry.
const DEFAULT_ENV: &[&str] = &[
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "TERM=linux",
];
/// Kernel arguments of every appliance boot: console on the first UART,
/// reboot (so the VMM exits) on panic, and no crypto self-tests: Debian's
/// kernel runs them at boot and `crypto_algapi_init` waits for them — 1.5 s
/// of the 3.1 s boot to `true` under QEMU/TCG (measured with `-icount`
/// and `initcall_debug`).
const BASE_CMDLINE: &str = "console=ttyS0 panic=-1 cryptomgr.notests";

/// Arguments of `ember setup`.
#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    /// Use this kernel instead of downloading Debian's cloud kernel (its
    /// modules are looked up by version in the cache and /lib/modules).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
}

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

/// Runs `ember run [OPTIONS] -- CMD…` (appliance mode); returns the command's
/// exit status. Errors are printed here so each gets its own exit status.
pub fn run_command(args: &RunArgs) -> anyhow::Result<i32> {
    match run_appliance(args) {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("ember: {}", error_chain(&e));
            Ok(e.exit_code())
        }
    }
}

/// `outer: inner: innermost`, like anyhow's `{:#}`.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
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
    let bad = || ApplianceError::BadArg(format!("bad --mem `{s}` (e.g. 256M, 1G)"));
    match crate::vstate::memory::parse_size(s).map_err(|_| bad())? >> 20 {
        0 => Err(bad()),
        mib => Ok(mib),
    }
}

/// The environment: defaults, then `--env` entries (same name replaces).
fn environment(extra: &[String]) -> Result<Vec<String>, ApplianceError> {
    let mut env: Vec<String> = DEFAULT_ENV.iter().map(|s| s.to_string()).collect();
    for e in extra {
        let Some((name, _)) = e.split_once('=').filter(|(n, _)| !n.is_empty()) else {
            return Err(ApplianceError::BadArg(format!(
                "bad --env `{e}` (want NAME=VALUE)"
            )));
        };
        env.retain(|x| x.split_once('=').map(|(n, _)| n) != Some(name));
        env.push(e.clone());
    }
    Ok(env)
}

/// A ready-to-boot appliance and how long preparing it took.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The kernel image to boot.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// The path init executes.
    pub exec: String,
    /// Whether the initramfs came from the cache.
    pub cached: bool,
    /// How many kernel modules it carries (0: none found for this kernel).
    pub modules: usize,
    /// Time spent finding/building it.
    pub elapsed: Duration,
}

/// Finds the kernel, modules, init and the command's files, and returns the
/// (cached) appliance for them.
pub fn prepare(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
) -> Result<Prepared, ApplianceError> {
    let start = Instant::now();
    let cache = kernel::cache_dir()?;
    let k = kernel::find_kernel(kernel_arg, &cache)?;
    let mods = match &k.modules {
        Some(dir) => modules::resolve_cached(dir, &cache)?,
        None => Vec::new(),
    };
    let init_path = find_init()?;
    let init = std::fs::read(&init_path).map_err(|source| builder::BuildError::Read {
        path: init_path,
        source,
    })?;
    let mut tree = builder::Tree::skeleton(init, &mods);
    let exec = match rootfs {
        Some(root) => {
            if !root.is_dir() {
                return Err(ApplianceError::BadArg(format!(
                    "--rootfs `{}` is not a directory",
                    root.display()
                )));
            }
            tree.add_rootfs(root)?;
            closure::find_command(command, closure::GUEST_PATH, Some(root))?
        }
        None => {
            let path_var = std::env::var("PATH").unwrap_or_else(|_| closure::GUEST_PATH.into());
            let exe = closure::find_command(command, &path_var, None)?;
            for f in closure::closure(&exe)? {
                tree.add_host_path(&f)?;
            }
            exe
        }
    };
    let version = k
        .version
        .clone()
        .unwrap_or_else(|| k.image.display().to_string());
    let app = builder::build_cached(&tree, &version, &cache)?;
    Ok(Prepared {
        kernel: k.image,
        initrd: app.path,
        exec: exec.to_string_lossy().into_owned(),
        cached: app.cached,
        modules: mods.len(),
        elapsed: start.elapsed(),
    })
}

fn run_appliance(args: &RunArgs) -> Result<i32, ApplianceError> {
    let argv = &args.command;
    let mem_mib = parse_mem_mib(&args.mem)?;
    if args.cpus == 0 {
        return Err(ApplianceError::BadArg("--cpus must be at least 1".into()));
    }
    let timeout = match args.timeout {
        Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
        Some(t) => return Err(ApplianceError::BadArg(format!("bad --timeout {t}"))),
        None => None,
    };
    let env = environment(&args.env)?;
    let p = prepare(args.kernel.as_deref(), args.rootfs.as_deref(), &argv[0])?;
    if args.prepare_only {
        let size = std::fs::metadata(&p.initrd).map(|m| m.len()).unwrap_or(0);
        let info = serde_json::json!({
            "initrd": p.initrd,
            "kernel": p.kernel,
            "exec": p.exec,
            "bytes": size,
            "cached": p.cached,
            "ms": p.elapsed.as_secs_f64() * 1e3,
        });
        println!("{info}");
        return Ok(0);
    }
    let backend = backend::by_name(&args.backend, &args.machine)?;
    if args.verbose {
        eprintln!(
            "ember: appliance {} ({} in {:.1} ms), kernel {}, {}",
            p.initrd.display(),
            if p.cached { "cached" } else { "built" },
            p.elapsed.as_secs_f64() * 1e3,
            p.kernel.display(),
            backend.describe()
        );
    }
    let channel_dev = match backend.channel_kind() {
        ChannelKind::Serial => "/dev/ttyS1",
        ChannelKind::VirtioConsole => "/dev/hvc0",
    };
    let mut spec = GuestSpec::new(&p.kernel);
    spec.initrd = Some(p.initrd.clone());
    spec.mem_mib = mem_mib;
    spec.cpus = args.cpus;
    // Load only the module groups for devices this VM has (see modules::MODULE_GROUPS).
    let mut groups = vec!["core"];
    if !args.disk.is_empty() {
        groups.push("blk");
    }
    if !args.pmem.is_empty() {
        groups.push("pmem");
    }
    spec.cmdline = format!(
        "{BASE_CMDLINE}{} EMBER_CHANNEL={channel_dev} EMBER_MODULES={}",
        if args.verbose { "" } else { " quiet" },
        groups.join(",")
    );
    if let Some(extra) = &args.cmdline {
        spec.cmdline.push(' ');
        spec.cmdline.push_str(extra);
    }
    for d in &args.disk {
        let mut parts = d.split(',');
        let path = PathBuf::from(parts.next().unwrap_or_default());
        spec.disks.push(backend::DiskSpec {
            path,
            read_only: parts.any(|o| o == "ro"),
        });
    }
    let modules = p.modules;
    let job = host::Job {
        argv: argv.clone(),
        exec: p.exec,
        env,
        cwd: args.workdir.clone(),
        forward_stdin: !std::io::stdin().is_terminal(),
        timeout,
        verbose: args.verbose,
    };
    let outcome = host::run(
        backend.as_ref(),
        spec,
        &job,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    )?;
    Ok(match outcome {
        host::Outcome::Exited(code) => code,
        host::Outcome::TimedOut => {
            eprintln!(
                "ember: timed out after {:.1} s; the VM was killed",
                timeout.unwrap_or_default().as_secs_f64()
            );
            EXIT_TIMEOUT
        }
        host::Outcome::GuestError(msg) => {
            eprintln!("ember: the appliance failed: {msg}");
            EXIT_APPLIANCE
        }
        host::Outcome::NoReport(tail) => {
            let hint = if modules == 0 {
                "; no kernel modules were found for this kernel, so it needs \
                 virtio-console built in"
            } else {
                ""
            };
            eprintln!(
                "ember: the guest stopped without reporting the command's status \
                 (run with --verbose to see its console){hint}{}",
                last_lines(&tail, 5)
            );
            EXIT_APPLIANCE
        }
    })
}

/// The last `n` non-empty lines of `s`, indented, for error messages.
fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<_> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("\n  | {}", l.trim_end()))
        .collect()
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
    fn env_overrides_defaults() {
        let e = environment(&["PATH=/x".into(), "A=b=c".into()]).unwrap();
        assert!(e.contains(&"PATH=/x".to_string()));
        assert!(!e.iter().any(|x| x.starts_with("PATH=/usr")));
        assert!(e.contains(&"A=b=c".to_string()));
        assert!(environment(&["novalue".into()]).is_err());
        assert!(environment(&["=v".into()]).is_err());
    }

    #[test]
    fn exit_codes_of_errors() {
        let nf = ApplianceError::Closure(closure::ClosureError::NotFound("x".into()));
        assert_eq!(nf.exit_code(), EXIT_NOT_FOUND);
        let nc = ApplianceError::Closure(closure::ClosureError::NotCarriable {
            path: "/x".into(),
            why: "y".into(),
        });
        assert_eq!(nc.exit_code(), EXIT_CANNOT_RUN);
        assert_eq!(ApplianceError::NoInit.exit_code(), EXIT_APPLIANCE);
        assert!(error_chain(&nc).contains("cannot carry `/x`"));
    }
}
