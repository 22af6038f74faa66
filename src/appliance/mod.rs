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
pub mod builder;
pub mod cache;
pub mod closure;
pub mod host;
pub mod kernel;
pub mod module_sig;
pub mod modules;
pub mod protocol;
pub mod rig;
pub mod userland;
pub mod warm;

use crate::backend::{self, ChannelKind, GuestSpec};
pub use crate::exit::EXIT_TIMEOUT;
use clap::Args;
use ember_vmm::error_chain;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Exit status when the appliance (not the command) failed.
pub const EXIT_APPLIANCE: i32 = 125;
/// Exit status when the command cannot be carried into the appliance.
pub const EXIT_CANNOT_RUN: i32 = 126;
/// Exit status when the command is not found.
pub const EXIT_NOT_FOUND: i32 = 127;

/// The command's environment unless `--env` overrides an entry.
const DEFAULT_ENV: &[&str] = &[
    // busybox's applets last: the command's own files come first.
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/lib/ember/busybox",
    "HOME=/root",
    "TERM=linux",
];
/// Kernel arguments of every appliance boot: console on the first UART,
/// reboot (so the VMM exits) on panic, and no crypto self-tests: Debian's
/// kernel runs them at boot and `crypto_algapi_init` waits for them — 1.5 s
/// of the 3.1 s boot to `true` under QEMU/TCG (measured with `-icount`
/// and `initcall_debug`). And no IO-APIC timer check: a VM's timer is
/// wired, and under TCG on a loaded host (a starved vCPU thread while
/// QEMU's timer runs on) the check can miss its ticks and panic with
/// "IO-APIC + timer doesn't work" — seen at load 20, once in three
/// parallel boots (the nested rig's L1 met it first). And one UART, the only
/// one either backend gives the appliance: Debian's 8250 driver registers and
/// probes four (the doctor's `8250.nr_uarts` advice; the driver's initcall
/// takes 0.85 ms of guest work with four and 0.44 with one under `-icount`,
/// BENCHMARKS.md §8).
const BASE_CMDLINE: &str =
    "console=ttyS0 panic=-1 cryptomgr.notests no_timer_check 8250.nr_uarts=1";

/// Arguments of `ember run [OPTIONS] -- CMD…`: only what the appliance
/// honours. The devices a command can use ([`backend::DeviceArgs`]: disks
/// with all their options, pmem, rng, balloon, `--no-acpi`, `--events`) are
/// passed to the backend, which refuses in one line what it cannot do; what
/// the appliance owns itself (initrd, console, channel) clap refuses here
/// rather than the appliance dropping it; QEMU's `--machine` and `--bios`
/// are refused on the ember backend.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Kernel to boot; defaults to the one `ember setup` fetched.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Extra kernel command-line arguments, after the appliance's own.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory, with an optional K/M/G suffix (bytes without one); a
    /// whole number of MiB.
    #[arg(long, default_value = "256M", value_parser = backend::parse_mem_mib)]
    pub mem: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    #[command(flatten)]
    pub devices: backend::DeviceArgs,
    /// When guest memory is committed, as `ember boot --prefault` (ember
    /// backend only): `sync`, or `async[,window=SIZE]…` — which adds the
    /// balloon and loads its driver before any other device's, so the fence
    /// is up early in the boot.
    #[arg(long, value_name = "sync|async[,OPTIONS]")]
    pub prefault: Option<String>,
    /// Which VMM boots the appliance.
    #[arg(long, value_enum, default_value_t = backend::BackendKind::Auto)]
    pub backend: backend::BackendKind,
    /// qemu backend: machine type [default: q35].
    #[arg(long)]
    pub machine: Option<String>,
    /// qemu backend: the firmware, or `seabios` for the machine's own.
    /// Default: qboot where QEMU ships it — SeaBIOS searches PCI for boot
    /// devices and mirrors its screen to the serial port before it reaches
    /// the kernel that `-kernel` gives it anyway (`ember analyze --advise`
    /// measures it from SeaBIOS's own log).
    #[arg(long, value_name = "FILE|seabios")]
    pub bios: Option<String>,
    /// Give up after this many seconds (the VM is killed; exit status 124).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Set VAR=VALUE in the command's environment. Repeatable.
    #[arg(long, value_name = "VAR=VALUE")]
    pub env: Vec<String>,
    /// The command's working directory in the guest.
    #[arg(long)]
    pub workdir: Option<String>,
    /// Run in a copy of this host directory instead of a minimal root.
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Show the guest kernel's console.
    #[arg(long, short)]
    pub verbose: bool,
    /// qemu backend: the nested rig. The guest gets an emulated AMD SVM CPU
    /// (QEMU/TCG `-cpu max`) and loads kvm-amd before CMD, so CMD has a
    /// /dev/kvm (e.g. `-- ember boot --kernel …`). Give it memory
    /// (`--mem 2G`), 2 vCPUs and a generous `--timeout`.
    #[arg(long)]
    pub nested_kvm: bool,
    /// Carry this host file or directory into the guest at GUEST (default:
    /// the same path). Symlinks are followed; a dynamically linked program
    /// brings its libraries. Repeatable.
    #[arg(long, value_name = "HOST[:GUEST]")]
    pub file: Vec<String>,
    /// Also carry this host command and its libraries (found on PATH), as CMD
    /// is. Repeatable.
    #[arg(long = "with", value_name = "CMD")]
    pub with: Vec<String>,
    /// Carry only CMD (and `--with`) files: no busybox userland (a smaller
    /// initramfs; the command cannot call `ls`, `cat`, … unless carried).
    #[arg(long)]
    pub bare: bool,
    /// Only build (or find) the appliance for CMD and print it as JSON (path,
    /// size, cached, milliseconds, the kernel command line and the backend
    /// a cold boot would use); do not boot.
    #[arg(long)]
    pub prepare_only: bool,
    /// ember backend: boot the appliance cold instead of restoring (or
    /// making) its snapshot. Runs with disks, pmem, rng, a balloon,
    /// `--rootfs` or `--nested-kvm` always boot cold.
    #[arg(long)]
    pub no_snapshot: bool,
    /// The command to run in the guest, and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

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
    match run_appliance(args) {
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
    /// The initramfs is this run's own (it carries `--file`s, which are not
    /// cached): delete it after the run.
    pub temporary: bool,
}

/// What a run adds to the appliance beyond its command.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// Carry kvm-amd and its dependencies (the `kvm` module group).
    pub nested_kvm: bool,
    /// Host files and directories to carry (`--file`).
    pub files: Vec<rig::FileSpec>,
    /// More host commands to carry with their closures (`--with`).
    pub with: Vec<String>,
    /// No busybox base layer (`--bare`).
    pub bare: bool,
    /// Carry only the modules of these groups (`modules::MODULE_GROUPS`;
    /// `None`: all of them). The kernel unpacks every byte of the initramfs
    /// whether init loads it or not: the 0.95 MB of modules a run without
    /// disks, pmem, vsock, entropy or balloon never loads cost 3.3 M guest
    /// instructions (BENCHMARKS.md §8).
    pub module_groups: Option<Vec<String>>,
}

/// Finds the kernel, modules, init and the command's files, and returns the
/// (cached) appliance for them.
pub fn prepare(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
) -> Result<Prepared, ApplianceError> {
    prepare_with(kernel_arg, rootfs, command, &Extras::default())
}

/// [`prepare`] with [`Extras`] (the nested rig's modules and files).
pub fn prepare_with(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
    extras: &Extras,
) -> Result<Prepared, ApplianceError> {
    let a = assemble(kernel_arg, rootfs, command, extras)?;
    write_appliance(a)
}

/// An appliance's files, found but not written.
pub struct Assembled {
    start: Instant,
    /// The kernel.
    pub kernel: kernel::Kernel,
    /// ember-init's bytes.
    pub init: Vec<u8>,
    /// The kernel modules it carries.
    pub mods: Vec<modules::GroupedModule>,
    /// Every file: init, modules, the command and its closure, busybox, `--file`s.
    pub tree: builder::Tree,
    /// The path init executes.
    pub exec: PathBuf,
    /// The kernel's version (or its path): part of the cache keys.
    pub version: String,
    /// It holds `--file`s (not cached).
    pub temporary: bool,
}

/// Finds the kernel, modules, init and the command's files.
pub fn assemble(
    kernel_arg: Option<&Path>,
    rootfs: Option<&Path>,
    command: &str,
    extras: &Extras,
) -> Result<Assembled, ApplianceError> {
    let start = Instant::now();
    let cache = kernel::cache_dir()?;
    let k = kernel::find_kernel(kernel_arg, &cache)?;
    let mut mods = match &k.modules {
        Some(dir) => modules::resolve_cached(dir, &cache)?,
        None => Vec::new(),
    };
    if let Some(groups) = &extras.module_groups {
        carry_only(&mut mods, groups);
    }
    if extras.nested_kvm {
        let kvm = rig::kvm_modules(k.modules.as_deref(), &mods)?;
        mods.extend(kvm);
    }
    let init_path = find_init()?;
    let init = std::fs::read(&init_path).map_err(|source| builder::BuildError::Read {
        path: init_path,
        source,
    })?;
    let mut tree = builder::Tree::skeleton(init.clone(), &mods);
    let exec = match rootfs {
        Some(root) => {
            if !root.is_dir() {
                return Err(ApplianceError::BadArg(format!(
                    "--rootfs `{}` is not a directory",
                    root.display()
                )));
            }
            if !extras.with.is_empty() {
                return Err(ApplianceError::BadArg(
                    "--with carries host commands; with --rootfs, put them in the root".into(),
                ));
            }
            tree.add_rootfs(root)?;
            closure::find_command(command, closure::GUEST_PATH, Some(root))?
        }
        None => {
            let path_var = std::env::var("PATH").unwrap_or_else(|_| closure::GUEST_PATH.into());
            let busybox = if extras.bare {
                None
            } else {
                let bb = userland::Busybox::find_cached(&path_var, Some(&cache.join("busybox")));
                if bb.is_none() {
                    eprintln!(
                        "ember: no busybox on PATH: the appliance carries only the command's \
                         files (install busybox-static; --bare says this is meant)"
                    );
                }
                bb
            };
            let exe = match closure::find_command(command, &path_var, None) {
                Ok(exe) => {
                    for f in closure::closure(&exe)? {
                        tree.add_host_path(&f)?;
                    }
                    exe
                }
                // Not on the host, but an applet (e.g. `ash`): run busybox's.
                Err(closure::ClosureError::NotFound(n)) => busybox
                    .as_ref()
                    .and_then(|bb| bb.applet(command))
                    .ok_or(closure::ClosureError::NotFound(n))?,
                Err(e) => return Err(e.into()),
            };
            for w in &extras.with {
                for f in closure::closure(&closure::find_command(w, &path_var, None)?)? {
                    tree.add_host_path(&f)?;
                }
            }
            // Last, so the command's own files win over an applet's.
            if let Some(bb) = &busybox {
                bb.add_to(&mut tree)?;
            }
            exe
        }
    };
    let version = k
        .version
        .clone()
        .unwrap_or_else(|| k.image.display().to_string());
    rig::add_files(&mut tree, &extras.files)?;
    // `--file`s change from run to run (test images, scripts): such an
    // appliance is written for this run only instead of filling the cache.
    let temporary = !extras.files.is_empty();
    Ok(Assembled {
        start,
        kernel: k,
        init,
        mods,
        tree,
        exec,
        version,
        temporary,
    })
}

/// Writes (or finds in the cache) the initramfs of `a`.
fn write_appliance(a: Assembled) -> Result<Prepared, ApplianceError> {
    let Assembled {
        start,
        kernel: k,
        mods,
        tree,
        exec,
        version,
        temporary,
        ..
    } = a;
    let cache = kernel::cache_dir()?;
    let app = if temporary {
        let path = std::env::temp_dir().join(format!(
            "ember-appliance-{}-{}.cpio",
            std::process::id(),
            tree.cache_key(&version)
        ));
        tree.write(&path)?;
        builder::Appliance {
            path,
            cached: false,
        }
    } else {
        builder::build_cached(&tree, &version, &cache, cache::max_bytes())?
    };
    Ok(Prepared {
        kernel: k.image,
        initrd: app.path,
        exec: exec.to_string_lossy().into_owned(),
        cached: app.cached,
        modules: mods.len(),
        elapsed: start.elapsed(),
        temporary,
    })
}

fn run_appliance(args: &RunArgs) -> Result<i32, ApplianceError> {
    let argv = &args.command;
    let mem_mib = args.mem;
    if args.cpus == 0 {
        return Err(ApplianceError::BadArg("--cpus must be at least 1".into()));
    }
    let timeout = match args.timeout {
        // Durations from floats panic on NaN, infinity and overflow: refuse them here.
        Some(t) if t.is_finite() && t > 0.0 && t < 1e9 => Some(Duration::from_secs_f64(t)),
        Some(t) => return Err(ApplianceError::BadArg(format!("bad --timeout {t}"))),
        None => None,
    };
    let env = environment(&args.env)?;
    let mut extras = Extras {
        nested_kvm: args.nested_kvm,
        files: args
            .file
            .iter()
            .map(|f| rig::FileSpec::parse(f))
            .collect::<Result<_, _>>()?,
        with: args.with.clone(),
        bare: args.bare,
        module_groups: None,
    };
    // Check the backend before building anything.
    let backend: Box<dyn backend::Backend> = if args.nested_kvm {
        Box::new(rig::backend(args.backend, machine(args))?)
    } else {
        backend::by_kind(args.backend, machine(args), appliance_bios(args).as_deref())?
    };
    if backend.name() != "qemu" && (args.machine.is_some() || args.bios.is_some()) {
        return Err(ApplianceError::BadArg(format!(
            "--machine and --bios choose QEMU's machine; this run uses the {} backend",
            backend.name()
        )));
    }
    // The devices the command asked for, checked against the backend before
    // anything is built: what it cannot do is refused here, never dropped.
    // `async` is fenced by the balloon: the VM gets one and the guest its driver.
    let fenced = args
        .prefault
        .as_deref()
        .is_some_and(|p| p.split(',').next().map(str::trim) == Some("async"));
    let devices = |mut spec: GuestSpec| {
        args.devices.apply(&mut spec)?;
        spec.balloon |= fenced;
        spec.prefault = args.prefault.clone();
        Ok::<_, backend::BackendError>(spec)
    };
    let asked = devices(GuestSpec::new("/"))?;
    backend.command(&asked)?;
    if args.devices.no_acpi {
        no_acpi_check(args.kernel.as_deref())?;
    }
    let d = &args.devices;
    let warm_wanted = !args.no_snapshot
        && !args.prepare_only
        && backend.name() == "ember"
        && !args.nested_kvm
        && args.rootfs.is_none()
        && args.prefault.is_none()
        && !d.no_acpi
        && d.disk.is_empty()
        && d.pmem.is_empty()
        && !d.rng
        && !d.balloon;
    // The warm appliance's snapshot is taken with the pmem group loaded (its
    // command tree comes on a pmem slot); a cold boot loads only its devices'.
    let warm_groups = || {
        let mut g = vec!["core"];
        g.extend(backend.virtio_transports());
        g.push("pmem");
        g
    };
    let cold_groups = module_groups(&asked, backend.as_ref(), args.nested_kvm);
    let mut carried = cold_groups.clone();
    if warm_wanted {
        carried.extend(warm_groups());
    }
    extras.module_groups = Some(carried.iter().map(|g| (*g).to_owned()).collect());
    let a = assemble(
        args.kernel.as_deref(),
        args.rootfs.as_deref(),
        &argv[0],
        &extras,
    )?;
    let channel_dev = match backend.channel_kind() {
        ChannelKind::Serial => "/dev/ttyS1",
        ChannelKind::VirtioConsole => "/dev/hvc0",
    };
    let modules = a.mods.len();
    let mut job = host::Job {
        argv: argv.clone(),
        exec: a.exec.to_string_lossy().into_owned(),
        env,
        cwd: args.workdir.clone(),
        // A terminal too: `ember run -- sh` reads commands as they are typed
        // (Ctrl-D ends its input, Ctrl-C ember and the VM).
        forward_stdin: true,
        timeout,
        verbose: args.verbose,
        root: None,
        restored: false,
        snapshot_at_ready: None,
    };
    // What this run removes when it ends (however it ends).
    let mut cleanup = Vec::new();
    let warm = if warm_wanted {
        let cmdline = appliance_cmdline(args, backend.as_ref(), channel_dev, &warm_groups());
        warm_spec(args, &a, cmdline, &mut job, &mut cleanup)?
    } else {
        None
    };
    let spec = match warm {
        Some(spec) => spec,
        None => {
            let p = write_appliance(a)?;
            if p.temporary {
                cleanup.push(TempFile(p.initrd.clone()));
            }
            if args.prepare_only {
                let size = std::fs::metadata(&p.initrd).map(|m| m.len()).unwrap_or(0);
                let info = serde_json::json!({
                    "initrd": p.initrd,
                    "kernel": p.kernel,
                    "cmdline": appliance_cmdline(args, backend.as_ref(), channel_dev, &cold_groups),
                    "backend": backend.describe(),
                    "exec": p.exec,
                    "bytes": size,
                    "cached": p.cached,
                    "ms": p.elapsed.as_secs_f64() * 1e3,
                });
                println!("{info}");
                // Kept for the caller to boot.
                std::mem::forget(cleanup);
                return Ok(0);
            }
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
            let mut spec = devices(GuestSpec::new(&p.kernel))?;
            spec.initrd = Some(p.initrd.clone());
            spec.mem_mib = mem_mib;
            spec.cpus = args.cpus;
            spec.cmdline = appliance_cmdline(args, backend.as_ref(), channel_dev, &cold_groups);
            spec
        }
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
        host::Outcome::GuestError(msg) => match rig::explain_guest_error(&msg) {
            Some(why) if args.nested_kvm => {
                eprintln!("ember: {why}");
                EXIT_APPLIANCE
            }
            _ => {
                eprintln!("ember: the appliance failed: {msg}");
                EXIT_APPLIANCE
            }
        },
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
                console_excerpt(&tail)
            );
            EXIT_APPLIANCE
        }
    })
}

/// The module groups (see [`modules::MODULE_GROUPS`]) a boot with `spec`'s
/// devices on `backend` loads: the console channel, the transports the
/// backend's devices sit on, and one group per kind of device it has.
fn module_groups(
    spec: &GuestSpec,
    backend: &dyn backend::Backend,
    nested_kvm: bool,
) -> Vec<&'static str> {
    let mut groups = vec!["core"];
    groups.extend(backend.virtio_transports());
    for (wanted, group) in [
        (!spec.disks.is_empty(), "blk"),
        (!spec.pmem.is_empty(), "pmem"),
        (spec.rng, "rng"),
        (spec.balloon, "balloon"),
    ] {
        if wanted {
            groups.push(group);
        }
    }
    if nested_kvm {
        groups.push(rig::KVM_GROUP);
    }
    groups
}

/// Keeps the modules of `groups` only.
fn carry_only(mods: &mut Vec<modules::GroupedModule>, groups: &[String]) {
    mods.retain(|m| groups.contains(&m.group));
}

/// The kernel command line of an appliance boot on `backend` that loads
/// module `groups`.
fn appliance_cmdline(
    args: &RunArgs,
    backend: &dyn backend::Backend,
    channel_dev: &str,
    groups: &[&str],
) -> String {
    let mut cmdline = format!(
        "{BASE_CMDLINE}{} EMBER_CHANNEL={channel_dev} EMBER_MODULES={}",
        if args.verbose { "" } else { " quiet" },
        groups.join(",")
    );
    let options = backend.kernel_options(args.cpus);
    if !options.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(options);
    }
    if let Some(extra) = &args.cmdline {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    cmdline
}

/// The appliance restored from its snapshot, or booted to make that
/// snapshot at READY (see [`warm`]): the spec to run and, in `job`, how the
/// job is handed over. `None` when this run cannot use one (no mkfs.ext4,
/// a command tree larger than the slot): it boots cold.
fn warm_spec(
    args: &RunArgs,
    a: &Assembled,
    cmdline: String,
    job: &mut host::Job,
    cleanup: &mut Vec<TempFile>,
) -> Result<Option<GuestSpec>, ApplianceError> {
    let start = Instant::now();
    let cache = kernel::cache_dir()?;
    let base = builder::Tree::skeleton(a.init.clone(), &a.mods);
    let base = builder::build_cached(&base, &a.version, &cache, cache::max_bytes())?;
    let ember = std::env::current_exe().map_err(|e| {
        ApplianceError::BadArg(format!("cannot find the running ember binary: {e}"))
    })?;
    let key = warm::key(&warm::Inputs {
        kernel: &a.kernel.image,
        initrd: &base.path,
        ember: &ember,
        mem_mib: args.mem,
        cpus: args.cpus,
        cmdline: &cmdline,
    });
    let dir = warm::snapshot_dir(&cache, &key);
    let image = unique_temp("root", "img");
    if let Err(e) = warm::root_image(&userland::with_links(&a.tree), &image) {
        if args.verbose {
            eprintln!("ember: booting cold: {}", error_chain(&e));
        }
        return Ok(None);
    }
    cleanup.push(TempFile(image.clone()));
    let mut spec = GuestSpec::new(&a.kernel.image);
    spec.pmem = vec![image];
    spec.events = args.devices.events.clone();
    job.root = Some(warm::SLOT_DEVICE.into());
    if warm::is_complete(&dir) {
        spec.restore = Some(dir.clone());
        job.restored = true;
    } else {
        let api = unique_temp("api", "sock");
        cleanup.push(TempFile(api.clone()));
        spec.initrd = Some(base.path);
        spec.mem_mib = args.mem;
        spec.cpus = args.cpus;
        spec.cmdline = cmdline;
        spec.api_socket = Some(api.clone());
        job.snapshot_at_ready = Some(host::SnapshotAt {
            api,
            dir: dir.clone(),
        });
    }
    // At debug level (`ember -v run`, or `run --verbose`), not as a change
    // of the command line: that would be another snapshot.
    log::debug!(
        "appliance {} snapshot {} ({:.1} ms to prepare), kernel {}",
        if job.restored { "from" } else { "making" },
        dir.display(),
        start.elapsed().as_secs_f64() * 1e3,
        a.kernel.image.display(),
    );
    Ok(Some(spec))
}

/// A fresh path in the temp directory for this run's `what`.
fn unique_temp(what: &str, ext: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "ember-{what}-{}-{}.{ext}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A file removed when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The QEMU firmware an appliance boots through (see `--bios`).
/// Without ACPI the devices reaching here are virtio-mmio ones named on the
/// kernel command line (ember, QEMU microvm), which only a kernel built with
/// CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES reads; Debian's cloud kernel is not,
/// and would wait for its channel until the timeout. Refused up front when
/// the kernel's configuration says so.
fn no_acpi_check(kernel_arg: Option<&Path>) -> Result<(), ApplianceError> {
    let k = kernel::find_kernel(kernel_arg, &kernel::cache_dir()?)?;
    if kernel::config_has(&k, "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES") == Some(false) {
        return Err(ApplianceError::BadArg(format!(
            "--no-acpi: kernel {} cannot find virtio-mmio devices without ACPI \
             (built without CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES)",
            k.version.as_deref().unwrap_or("?")
        )));
    }
    Ok(())
}

/// The QEMU machine a run asks for.
fn machine(args: &RunArgs) -> &str {
    args.machine.as_deref().unwrap_or(DEFAULT_MACHINE)
}

/// QEMU's machine when `--machine` is not given: q35 (PCI devices, found
/// with or without ACPI; microvm has no memory-device area for pmem).
const DEFAULT_MACHINE: &str = "q35";

fn appliance_bios(args: &RunArgs) -> Option<PathBuf> {
    match args.bios.as_deref() {
        Some("seabios") => None,
        Some(path) => Some(PathBuf::from(path)),
        // microvm has its own minimal firmware.
        None if machine(args).starts_with("microvm") => None,
        None => {
            let qboot = Path::new(crate::backend::qemu::QBOOT);
            qboot.is_file().then(|| qboot.to_path_buf())
        }
    }
}

/// Where a kernel's crash report starts, on its first line.
const CRASH_STARTS: [&str; 6] = [
    "------------[ cut here ]",
    "BUG:",
    "Oops:",
    "general protection fault",
    "stack guard page was hit",
    "Kernel panic",
];
/// At most this many lines of a crash report go into an error message.
const CRASH_LINES: usize = 80;

/// The console's last lines, indented, for the error message of a guest
/// that stopped without a report: the last 5, or, when its kernel crashed,
/// the crash report from its first line (the cause is at the top, the
/// panic at the bottom), at most [`CRASH_LINES`].
fn console_excerpt(s: &str) -> String {
    let lines: Vec<_> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let last_five = lines.len().saturating_sub(5);
    let crash = lines
        .iter()
        .position(|l| CRASH_STARTS.iter().any(|m| l.contains(m)))
        .filter(|&at| at < last_five)
        .map(|at| at.max(lines.len().saturating_sub(CRASH_LINES)));
    lines[crash.unwrap_or(last_five)..]
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

    /// A backend that only answers which transports it uses.
    struct Transports(&'static [&'static str]);

    impl backend::Backend for Transports {
        fn name(&self) -> &str {
            "test"
        }
        fn version(&self) -> Result<String, backend::BackendError> {
            Ok(String::new())
        }
        fn describe(&self) -> String {
            String::new()
        }
        fn channel_kind(&self) -> ChannelKind {
            ChannelKind::VirtioConsole
        }
        fn command(&self, _: &GuestSpec) -> Result<std::process::Command, backend::BackendError> {
            unreachable!("not booted")
        }
        fn virtio_transports(&self) -> &'static [&'static str] {
            self.0
        }
    }

    #[test]
    fn a_boot_loads_and_carries_only_its_devices_module_groups() {
        let mut spec = GuestSpec::new("/k");
        let pci = Transports(&["pci"]);
        assert_eq!(module_groups(&spec, &pci, false), ["core", "pci"]);
        spec.rng = true;
        spec.balloon = true;
        assert_eq!(
            module_groups(&spec, &Transports(&["pci", "mmio"]), true),
            ["core", "pci", "mmio", "rng", "balloon", rig::KVM_GROUP]
        );
        let m = |group: &str, name: &str| modules::GroupedModule {
            group: group.into(),
            path: PathBuf::from(format!("/m/{name}.ko")),
        };
        let mut mods = vec![
            m("core", "virtio_console"),
            m("pci", "virtio_pci"),
            m("mmio", "virtio_mmio"),
            m("blk", "virtio_blk"),
            m("pmem", "nd_pmem"),
        ];
        carry_only(&mut mods, &["core".into(), "pci".into(), "pmem".into()]);
        assert_eq!(
            mods,
            [
                m("core", "virtio_console"),
                m("pci", "virtio_pci"),
                m("pmem", "nd_pmem")
            ]
        );
    }

    #[test]
    fn a_crashed_guest_shows_its_crash_report_from_the_top() {
        let quiet: String = (0..20).map(|i| format!("line {i}\n")).collect();
        let shown = console_excerpt(&quiet);
        assert_eq!(shown.lines().count(), 6, "{shown}"); // "" + 5
        assert!(shown.contains("line 15") && !shown.contains("line 14"));

        let crash = format!(
            "{quiet}[ 1.0] BUG: stack guard page was hit at 0x1\n{}[ 2.0] Kernel panic - not syncing\n",
            (0..10)
                .map(|i| format!("[ 1.5] frame {i}\n"))
                .collect::<String>()
        );
        let shown = console_excerpt(&crash);
        assert!(shown.contains("BUG: stack guard page"), "{shown}");
        assert!(shown.contains("frame 0") && shown.contains("Kernel panic"));
        assert!(!shown.contains("line 19"));

        let long = format!("BUG: x\n{}", quiet.repeat(CRASH_LINES / 10));
        assert_eq!(console_excerpt(&long).lines().count(), CRASH_LINES + 1);
    }

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
