//! `ember run`: how the appliance boots (a [`Plan`], decided once), getting
//! it ready for that, running the command in it and turning how it ended
//! into an exit status.

use super::assemble::{
    Assembled, CHANNEL_VSOCK_GROUP, Extras, assemble, assemble_host_root, module_groups,
    write_appliance,
};
use super::cli::{self, RunArgs};
use super::error::{ApplianceError, EXIT_APPLIANCE, EXIT_BROKEN_PIPE};
use super::hostroot::{self, Root};
use super::modules::MEM_GROUP;
use super::{builder, cache, closure, host, kernel, rig, userland, warm};
use crate::backend::{self, Backend, ChannelKind, GuestSpec};
use crate::cleanup::{self, TempPath};
use crate::exit::EXIT_TIMEOUT;
use crate::passt::{GuestNet, Passt};
use ember_frames::netconf::{self, NetConf};
use ember_vmm::devices::virtio::net::{NetBackendConfig, NetConfig};
use ember_vmm::error_chain;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// How a run boots its appliance, decided once from its arguments and backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Restore the appliance's snapshot, or boot to make it (see [`warm`]);
    /// cold after all when this run cannot use one (no mkfs.ext4, a command
    /// tree larger than the slot).
    Snapshot,
    /// Boot the appliance cold.
    ColdBoot {
        /// The first reason found.
        why: Cold,
    },
}

/// Why a run boots cold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cold {
    /// `--no-snapshot`.
    Asked,
    /// `--prepare-only`: no boot at all.
    PrepareOnly,
    /// Only the ember backend restores snapshots.
    Backend,
    /// `--nested-kvm` boots on QEMU with modules of its own.
    NestedKvm,
    /// `--rootfs`: the root is the host directory, not the slot.
    Rootfs,
    /// `--prefault` is a choice of the boot.
    Prefault,
    /// `--no-acpi` is another machine than the snapshot's.
    NoAcpi,
    /// Disks, pmem, rng or a balloon: a snapshot's devices are fixed when it
    /// is taken.
    Devices,
}

impl std::fmt::Display for Cold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cold::Asked => "--no-snapshot",
            Cold::PrepareOnly => "--prepare-only",
            Cold::Backend => "not the ember backend",
            Cold::NestedKvm => "--nested-kvm",
            Cold::Rootfs => "--rootfs",
            Cold::Prefault => "--prefault",
            Cold::NoAcpi => "--no-acpi",
            Cold::Devices => "devices of its own",
        })
    }
}

impl Plan {
    fn of(args: &RunArgs, backend: &dyn Backend) -> Plan {
        let d = &args.devices;
        let devices = !d.disk.is_empty()
            || !d.pmem.is_empty()
            || d.rng
            || d.balloon
            || !d.fs.is_empty()
            || args.mem_boot.is_some();
        [
            (args.no_snapshot, Cold::Asked),
            (args.prepare_only, Cold::PrepareOnly),
            (backend.name() != "ember", Cold::Backend),
            (args.nested_kvm, Cold::NestedKvm),
            (args.rootfs.is_some(), Cold::Rootfs),
            (args.prefault.is_some(), Cold::Prefault),
            (d.no_acpi, Cold::NoAcpi),
            (devices, Cold::Devices),
        ]
        .into_iter()
        .find_map(|(cold, why)| cold.then_some(Plan::ColdBoot { why }))
        .unwrap_or(Plan::Snapshot)
    }
}

/// Runs `ember run [OPTIONS] -- CMD…`; returns the command's exit status.
/// Errors are printed here so each gets its own exit status.
pub fn run_command(args: &RunArgs) -> anyhow::Result<i32> {
    match run(args) {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("ember: {}", error_chain(&e));
            Ok(e.exit_code())
        }
    }
}

/// Runs `ember run`; returns the command's exit status. In order: the pod's
/// namespace, the backend and the devices checked, passt started, the
/// appliance made, the spec to boot, the network attached, the
/// conversation, and a damaged snapshot dealt with.
pub(super) fn run(args: &RunArgs) -> Result<i32, ApplianceError> {
    ember_vmm::events::stage("run_main");
    if args.cpus == 0 {
        return Err(ApplianceError::BadArg("--cpus must be at least 1".into()));
    }
    // First, before ember starts any thread or child: they all inherit the
    // namespace (the VMM opens the tap there).
    let pod_net = match &args.netns {
        Some(path) if !args.prepare_only => {
            let joined = crate::netns::join(path)?;
            ember_vmm::events::stage("run_netns_tap_tc");
            Some(joined)
        }
        _ => None,
    };
    let timeout = cli::timeout(args)?;
    let extras = extras(args)?;
    // Check the backend before building anything.
    let backend = choose_backend(args)?;
    // The devices the command asked for, checked against the backend before
    // anything is built: what it cannot do is refused here, never dropped.
    let asked = with_devices(args, GuestSpec::new("/"))?;
    backend.command(&asked)?;
    let publish = cli::publish(args)?;
    // passt starts now, so it sets itself up while the appliance is made.
    let net = match cli::wants_net(args) && !args.prepare_only {
        true => {
            let guest = GuestNet::from_host()?;
            let (passt, fd) = Passt::start(&guest, &publish)?;
            Some((guest, passt, fd))
        }
        false => None,
    };
    let made = make(args, backend.as_ref(), &asked, extras)?;
    let modules = made.a.mods.len();
    let mut job = job(args, &made, timeout);
    // Leftovers of killed runs (a root image's staging directory, a
    // socket never connected to): only dead embers'.
    cleanup::sweep_dead(&std::env::temp_dir());
    // What this run removes when it ends (however it ends), and the files
    // its VMM opens through their descriptors, open until it is gone.
    let mut temps = Vec::new();
    let mut held: Vec<Arc<File>> = Vec::new();
    let spec = boot_spec(
        args,
        made,
        backend.as_ref(),
        &mut job,
        &mut temps,
        &mut held,
    )?;
    let Some(mut spec) = spec else {
        // `--prepare-only`: kept for the caller to boot.
        temps.into_iter().for_each(|t| drop(t.keep()));
        return Ok(0);
    };
    // Held until the run ends: passt goes with it.
    let _passt = attach_passt(args, net, &mut spec, &mut job)?;
    // Held until the run ends: the interface's filter goes with it.
    let _pod_net = pod_net.inspect(|p| attach_pod_net(args, p, &mut spec, &mut job));
    let restored_from = spec.restore.clone();
    let outcome = host::run(
        backend.as_ref(),
        spec,
        &job,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    )?;
    drop(held);
    if let Some(dir) = &restored_from {
        match damaged_snapshot(dir, &outcome) {
            // Nothing of the command ran (no input read, no output
            // written): run it again, making the snapshot afresh.
            Some(true) => return run(args),
            Some(false) => return Ok(EXIT_APPLIANCE),
            None => {}
        }
    }
    Ok(exit_status(args, outcome, timeout, modules, backend.name()))
}

/// What a run has decided and made before it boots: where its root comes
/// from, the plan, the module groups and the appliance.
struct Made {
    root: Root,
    env: Vec<String>,
    plan: Plan,
    host_root: bool,
    /// The module groups a cold boot loads.
    cold_groups: Vec<&'static str>,
    a: Assembled,
    /// The shares as the VMM serves them and as the guest mounts them.
    shares: Option<(Vec<backend::Share>, Vec<host::GuestShare>)>,
}

/// Chooses the root and the plan, and assembles the appliance with the
/// modules the plan's boot needs.
fn make(
    args: &RunArgs,
    backend: &dyn Backend,
    asked: &GuestSpec,
    mut extras: Extras,
) -> Result<Made, ApplianceError> {
    if args.devices.no_acpi {
        cli::no_acpi_check(args.kernel.as_deref())?;
    }
    let root = hostroot::choose(args, backend)?;
    let env = match &root {
        Root::Host(_) => hostroot::environment(&args.env)?,
        Root::Initramfs => cli::environment(&args.env)?,
    };
    let plan = Plan::of(args, backend);
    let host_root = root != Root::Initramfs;
    let mut cold_groups = module_groups(asked, backend, args.nested_kvm);
    if root != Root::Initramfs {
        cold_groups.push(hostroot::FS_GROUP);
    }
    let mut carried = cold_groups.clone();
    if plan == Plan::Snapshot {
        carried.extend(warm_groups(backend, cli::wants_net(args), host_root));
    }
    let carried: Vec<String> = carried.iter().map(|g| (*g).to_owned()).collect();
    let (a, shares) = match &root {
        Root::Host(user) => {
            // The guest sees the host's root: the command is where the
            // caller's PATH finds it.
            let path_var = std::env::var("PATH").unwrap_or_else(|_| closure::GUEST_PATH.into());
            let exe = closure::find_command(&args.command[0], &path_var, None)?;
            let a = assemble_host_root(args.kernel.as_deref(), exe, &carried)?;
            (a, Some(hostroot::shares(user)))
        }
        Root::Initramfs => {
            extras.module_groups = Some(carried);
            let a = assemble(
                args.kernel.as_deref(),
                args.rootfs.as_deref(),
                &args.command[0],
                &extras,
            )?;
            (a, None)
        }
    };
    ember_vmm::events::stage("run_assembled");
    Ok(Made {
        root,
        env,
        plan,
        host_root,
        cold_groups,
        a,
        shares,
    })
}

/// The job the guest's init runs, before the boot adds how it is handed
/// over (descriptors, the root slot, the network).
fn job(args: &RunArgs, made: &Made, timeout: Option<Duration>) -> host::Job {
    let shares = &made.shares;
    host::Job {
        argv: args.command.clone(),
        exec: made.a.exec.to_string_lossy().into_owned(),
        env: made.env.clone(),
        cwd: match made.root {
            Root::Host(_) => hostroot::workdir(args),
            Root::Initramfs => args.workdir.clone(),
        },
        // A terminal too: `ember run -- sh` reads commands as they are typed
        // (Ctrl-D ends its input, Ctrl-C ember and the VM).
        forward_stdin: true,
        timeout,
        verbose: args.verbose,
        root: None,
        net: None,
        host_root: shares.as_ref().map(|_| hostroot::ROOT_TAG.to_owned()),
        shares: shares
            .as_ref()
            .map(|(_, guest)| guest.clone())
            .unwrap_or_default(),
        restored: false,
        snapshot_at_ready: None,
        inherit_fds: Vec::new(),
    }
}

/// The spec this run boots: the plan's snapshot, or a cold boot when there
/// is none to use; `None` for `--prepare-only`.
fn boot_spec(
    args: &RunArgs,
    made: Made,
    backend: &dyn Backend,
    job: &mut host::Job,
    temps: &mut Vec<TempPath>,
    held: &mut Vec<Arc<File>>,
) -> Result<Option<GuestSpec>, ApplianceError> {
    let channel_dev = match backend.channel_kind() {
        ChannelKind::Serial => "/dev/ttyS1".to_owned(),
        ChannelKind::VirtioConsole => "/dev/hvc0".to_owned(),
        ChannelKind::VirtioSerialPort => "/dev/vport0p1".to_owned(),
        ChannelKind::Vsock => format!("vsock:{}", backend::VSOCK_CHANNEL_PORT),
    };
    let channel_dev = channel_dev.as_str();
    let Made {
        plan,
        host_root,
        cold_groups,
        a,
        shares,
        ..
    } = made;
    let warm = match plan {
        Plan::Snapshot => {
            let groups = warm_groups(backend, cli::wants_net(args), host_root);
            let mut cmdline = appliance_cmdline(args, backend, channel_dev, &groups);
            let vmm_shares = shares.as_ref().map(|(vmm, _)| vmm.as_slice());
            if let Some(vmm) = vmm_shares {
                cmdline.push_str(&premount_words(vmm));
            }
            warm_spec(args, &a, cmdline, vmm_shares, job, temps, held)?
        }
        Plan::ColdBoot { why } => {
            log::debug!("appliance boots cold: {why}");
            None
        }
    };
    ember_vmm::events::stage("run_warm_spec");
    if let Some(spec) = warm {
        return Ok(Some(spec));
    }
    let cmdline = appliance_cmdline(args, backend, channel_dev, &cold_groups);
    let Some((mut spec, p)) = cold_spec(args, a, backend, cmdline, temps)? else {
        return Ok(None);
    };
    if let Some((vmm, _)) = &shares {
        spec.shares = vmm.clone();
    }
    if let Some(f) = p.held {
        job.inherit_fds.push(f.as_raw_fd());
        held.push(f);
    }
    Ok(Some(spec))
}

/// passt's socket as the guest's network device, once passt is ready.
fn attach_passt(
    args: &RunArgs,
    net: Option<(GuestNet, Passt, OwnedFd)>,
    spec: &mut GuestSpec,
    job: &mut host::Job,
) -> Result<Option<(Passt, OwnedFd)>, ApplianceError> {
    let Some((guest, mut passt, fd)) = net else {
        return Ok(None);
    };
    spec.net_fd = Some(fd.as_raw_fd());
    job.inherit_fds.push(fd.as_raw_fd());
    job.net = Some(net_payload(&guest));
    passt.wait_ready()?;
    if args.verbose {
        eprintln!(
            "ember: passt (pid {}) gives the guest {}",
            passt.id(),
            describe(&guest)
        );
    }
    Ok(Some((passt, fd)))
}

/// The `--netns` pod's tap as the guest's network device.
fn attach_pod_net(
    args: &RunArgs,
    p: &crate::netns::PodNet,
    spec: &mut GuestSpec,
    job: &mut host::Job,
) {
    // In place of with_devices' placeholder (`ember run` has no other
    // network device).
    spec.devices.net.clear();
    let mut dev = NetConfig::tap(crate::netns::TAP);
    dev.backend = NetBackendConfig::Fd(p.tap.as_raw_fd());
    dev.mac = Some(p.mac);
    dev.mtu = Some(p.mtu);
    spec.devices.net.push(dev);
    job.inherit_fds.push(p.tap.as_raw_fd());
    job.net = Some(net_payload(&p.guest));
    if args.verbose {
        eprintln!("ember: --netns gives the guest {}", describe(&p.guest));
    }
}

/// After a run restored from the snapshot in `dir`: whether the snapshot
/// was found damaged (and discarded), and if so whether to run the command
/// again (`Some(true)`: nothing of it ran and the snapshot is gone).
fn damaged_snapshot(dir: &std::path::Path, outcome: &host::Outcome) -> Option<bool> {
    let never_ran = matches!(outcome, host::Outcome::VmmFailed { .. });
    if !never_ran && !matches!(outcome, host::Outcome::NoReport(_)) {
        return None;
    }
    // The restore failed: a damaged memory file is the likelier
    // cause than the guest, and would fail every later run too.
    let e = warm::check_memory(dir).err()?;
    let gone = warm::discard(dir).is_ok();
    let then = match (gone, never_ran) {
        (true, true) => "; making it again",
        (true, false) => "; the next run makes it again",
        (false, _) => "",
    };
    eprintln!("ember: {}{then}", error_chain(&e));
    Some(gone && never_ran)
}

/// The appliance written for a cold boot, and the spec that boots it (with
/// the appliance, whose descriptor it boots from); `None` for
/// `--prepare-only`, which prints it instead.
fn cold_spec(
    args: &RunArgs,
    a: Assembled,
    backend: &dyn Backend,
    cmdline: String,
    temps: &mut Vec<TempPath>,
) -> Result<Option<(GuestSpec, super::Prepared)>, ApplianceError> {
    let p = write_appliance(a, !args.prepare_only)?;
    if p.temporary {
        temps.push(TempPath::new(&p.initrd));
    }
    if args.prepare_only {
        print_prepared(&p, &cmdline, backend);
        return Ok(None);
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
    let mut spec = with_devices(args, GuestSpec::new(&p.kernel))?;
    spec.initrd = Some(p.boot_path());
    spec.mem_mib = args.mem;
    spec.cpus = args.cpus;
    spec.cmdline = cmdline;
    Ok(Some((spec, p)))
}

/// What the run carries beyond its command (`--nested-kvm`, `--file`,
/// `--with`, `--bare`); the module groups are the plan's.
fn extras(args: &RunArgs) -> Result<Extras, ApplianceError> {
    Ok(Extras {
        nested_kvm: args.nested_kvm,
        files: args
            .file
            .iter()
            .map(|f| rig::FileSpec::parse(f))
            .collect::<Result<_, _>>()?,
        with: args.with.clone(),
        bare: args.bare,
        module_groups: None,
    })
}

/// The backend a run boots on, with `--machine` and `--bios` checked against it.
fn choose_backend(args: &RunArgs) -> Result<Box<dyn Backend>, ApplianceError> {
    let machine = cli::machine(args);
    let backend: Box<dyn Backend> = if args.nested_kvm {
        Box::new(rig::backend(args.backend, machine)?)
    } else {
        backend::by_kind(args.backend, machine, cli::appliance_bios(args).as_deref())?
    };
    if backend.name() != "qemu" && (args.machine.is_some() || args.bios.is_some()) {
        return Err(ApplianceError::BadArg(format!(
            "--machine and --bios choose QEMU's machine; this run uses the {} backend",
            backend.name()
        )));
    }
    Ok(backend)
}

/// The `NET` frame's payload for `net`.
fn net_payload(net: &GuestNet) -> Vec<u8> {
    let conf = NetConf {
        mtu: net.mtu,
        v4: net.v4.map(|n| netconf::V4 {
            addr: n.addr.octets(),
            prefix: n.prefix,
            gateway: n.gateway.octets(),
        }),
        v6: net.v6.map(|n| netconf::V6 {
            addr: n.addr.octets(),
            prefix: n.prefix,
            gateway: n.gateway.octets(),
        }),
        resolv_conf: b"",
    };
    let mut p = conf.header().to_vec();
    p.extend_from_slice(net.resolv_conf().as_bytes());
    p
}

/// `net` in a few words, for `--verbose`.
fn describe(net: &GuestNet) -> String {
    let mut parts = Vec::new();
    if let Some(n) = &net.v4 {
        parts.push(format!("{}/{} via {}", n.addr, n.prefix, n.gateway));
    }
    if let Some(n) = &net.v6 {
        parts.push(format!("{}/{} via {}", n.addr, n.prefix, n.gateway));
    }
    let dns: Vec<String> = net.dns.iter().map(|a| a.to_string()).collect();
    format!(
        "{}, mtu {}, dns [{}]",
        parts.join(", "),
        net.mtu,
        dns.join(" ")
    )
}

/// `spec` with the devices the command asked for (and, for `--net`, a
/// placeholder for passt's socket: the real one comes with passt).
fn with_devices(args: &RunArgs, mut spec: GuestSpec) -> Result<GuestSpec, ApplianceError> {
    args.devices.apply(&mut spec);
    // The region is part of the memory size.
    spec.mem_mib = args.mem;
    spec.devices.mem = cli::mem_region(args)?;
    if cli::wants_net(args) {
        spec.net_fd = Some(-1);
    }
    if args.netns.is_some() {
        // The tap comes with the namespace's join.
        let mut dev = NetConfig::tap(crate::netns::TAP);
        dev.backend = NetBackendConfig::Fd(-1);
        spec.devices.net.push(dev);
    }
    if cli::prefault_fenced(args) {
        spec.devices.balloon.get_or_insert_with(Default::default);
    }
    spec.prefault = args.prefault.clone();
    Ok(spec)
}

/// The module groups of the appliance's snapshot: it is taken with the pmem
/// group loaded (its command tree comes on a pmem slot), or, on the host's
/// root, the virtio-fs one (no slot: the command is the host's), and with
/// `net` for `--net` (another snapshot: its machine has the network
/// device); a cold boot loads only its devices'.
fn warm_groups(backend: &dyn Backend, net: bool, host_root: bool) -> Vec<&'static str> {
    let mut g = vec!["core"];
    g.extend(backend.virtio_transports());
    if backend.channel_kind() == ChannelKind::Vsock {
        g.push(CHANNEL_VSOCK_GROUP);
    }
    g.push(if host_root {
        hostroot::FS_GROUP
    } else {
        "pmem"
    });
    if net {
        g.push("net");
    }
    g
}

/// `--prepare-only`'s answer: the appliance as JSON.
fn print_prepared(p: &super::Prepared, cmdline: &str, backend: &dyn Backend) {
    let size = std::fs::metadata(&p.initrd).map(|m| m.len()).unwrap_or(0);
    let info = serde_json::json!({
        "initrd": p.initrd,
        "kernel": p.kernel,
        "cmdline": cmdline,
        "backend": backend.describe(),
        "exec": p.exec,
        "bytes": size,
        "cached": p.cached,
        "ms": p.elapsed.as_secs_f64() * 1e3,
    });
    println!("{info}");
}

/// The exit status of a run that ended with `outcome`, its cause said on
/// stderr when it is not the command's own.
fn exit_status(
    args: &RunArgs,
    outcome: host::Outcome,
    timeout: Option<Duration>,
    modules: usize,
    vmm: &str,
) -> i32 {
    match outcome {
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
        // As a shell pipeline's member would: quietly, with SIGPIPE's status.
        host::Outcome::OutputFailed {
            broken_pipe: true, ..
        } => EXIT_BROKEN_PIPE,
        host::Outcome::OutputFailed { stream, reason, .. } => {
            eprintln!("ember: cannot write the command's {stream}: {reason}; the VM was stopped");
            EXIT_APPLIANCE
        }
        // Its own message went to our stderr as it came (host::drain).
        // ember's VMM says what failed in one `ember: ` line (no access to
        // /dev/kvm, a file it cannot open): a second line would only repeat
        // that it failed.
        host::Outcome::VmmFailed { status, tail } => {
            let said = tail
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .is_some_and(|l| l.trim_start().starts_with("ember: "));
            if !(vmm == "ember" && said) {
                eprintln!(
                    "ember: {vmm} could not start the VM ({status}; its message is above, if any)"
                );
            }
            EXIT_APPLIANCE
        }
        host::Outcome::NoReport(tail) => {
            let hint = match (modules, vmm) {
                (0, "ember") => {
                    "; no kernel modules were found for this kernel, so it needs \
                 vsock over virtio (CONFIG_VIRTIO_VSOCKETS) built in"
                }
                (0, _) => {
                    "; no kernel modules were found for this kernel, so it needs \
                 virtio-console built in"
                }
                _ => "",
            };
            eprintln!(
                "ember: the guest stopped without reporting the command's status \
             (run with --verbose to see its console){hint}{}",
                console_excerpt(&tail)
            );
            EXIT_APPLIANCE
        }
    }
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
    if groups.contains(&MEM_GROUP) {
        // The kernel onlines the blocks the driver plugs (nothing in the
        // guest has to), movable where the ratio to kernel memory allows
        // so that they can be unplugged again.
        cmdline.push_str(" memhp_default_state=online memory_hotplug.online_policy=auto-movable");
    }
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

/// The kernel arguments that have the appliance mount the host's root (the
/// first of `shares`) and the other shares before READY, so its snapshot
/// holds them mounted: a restored run only binds each share to its path.
/// The shares' count is in the snapshot's key through them (the machine has
/// a device each); their directories are not: a restore opens this run's.
fn premount_words(shares: &[backend::Share]) -> String {
    let Some((root, rest)) = shares.split_first() else {
        return String::new();
    };
    let mut words = format!(" EMBER_HOSTROOT={}", root.tag);
    if !rest.is_empty() {
        let tags: Vec<&str> = rest.iter().map(|s| s.tag.as_str()).collect();
        words.push_str(&format!(" EMBER_SHARES={}", tags.join(",")));
    }
    words
}

/// The appliance restored from its snapshot, or booted to make that
/// snapshot at READY (see [`warm`]): the spec to run and, in `job`, how the
/// job is handed over. `None` when this run cannot use one (no mkfs.ext4,
/// a command tree larger than the slot): it boots cold.
fn warm_spec(
    args: &RunArgs,
    a: &Assembled,
    cmdline: String,
    shares: Option<&[backend::Share]>,
    job: &mut host::Job,
    temps: &mut Vec<TempPath>,
    held: &mut Vec<Arc<File>>,
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
    let mut spec = GuestSpec::new(&a.kernel.image);
    spec.events = args.devices.events.clone();
    match shares {
        // The host's root and this run's shares: the snapshot's are made
        // with them and restored onto them (their directories this run's).
        Some(shares) => spec.shares = shares.to_vec(),
        None => {
            // The per-run image holds the command's files (a 0600 `--file`
            // too): a 0600 file with no name, which the VMM opens through
            // its descriptor.
            let tmp = std::env::temp_dir();
            let image = cleanup::Nameless::new(&tmp).map_err(|e| {
                ApplianceError::BadArg(format!("cannot make a file in {}: {e}", tmp.display()))
            })?;
            let staging = unique_temp("root", "d");
            if let Err(e) = warm::root_image(&userland::with_links(&a.tree), &image, &staging) {
                if args.verbose {
                    eprintln!("ember: booting cold: {}", error_chain(&e));
                }
                return Ok(None);
            }
            spec.devices.pmem = vec![ember_vmm::devices::virtio::PmemConfig::new(image.path())];
            job.inherit_fds.push(image.fd());
            held.push(Arc::new(image.into_file()));
            job.root = Some(warm::SLOT_DEVICE.into());
        }
    }
    // A damaged snapshot, or one of another format, is made again, as a
    // damaged cached appliance is (a failed restore checks the rest).
    let sound = dir.exists()
        && match warm::check(&dir) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("ember: {}; making it again", error_chain(&e));
                if let Err(e) = warm::discard(&dir) {
                    eprintln!("ember: booting cold: {}", error_chain(&e));
                    return Ok(None);
                }
                false
            }
        };
    if sound {
        spec.restore = Some(dir.clone());
        job.restored = true;
    } else {
        let api = TempPath::new(unique_temp("api", "sock"));
        spec.initrd = Some(base.boot_path());
        if let Some(f) = &base.held {
            job.inherit_fds.push(f.as_raw_fd());
            held.push(f.clone());
        }
        spec.mem_mib = args.mem;
        spec.cpus = args.cpus;
        spec.cmdline = cmdline;
        spec.api_socket = Some(api.path().to_owned());
        job.snapshot_at_ready = Some(host::SnapshotAt {
            api: api.path().to_owned(),
            dir: dir.clone(),
        });
        temps.push(api);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Fake;

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

    fn run_args(options: &[&str]) -> RunArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            run: RunArgs,
        }
        let argv = ["ember"].iter().chain(options).chain(&["--", "true"]);
        <Cli as clap::Parser>::parse_from(argv).run
    }

    /// Only a run on the ember backend with nothing a snapshot cannot hold
    /// uses one; otherwise the plan names the first reason.
    #[test]
    fn the_plan_uses_the_snapshot_only_when_nothing_rules_it_out() {
        let ember = Fake::named("ember");
        assert_eq!(Plan::of(&run_args(&[]), &ember), Plan::Snapshot);
        assert_eq!(
            Plan::of(&run_args(&[]), &Fake::named("qemu")),
            Plan::ColdBoot { why: Cold::Backend }
        );
        for (options, why) in [
            (&["--no-snapshot"][..], Cold::Asked),
            (&["--prepare-only"], Cold::PrepareOnly),
            (&["--nested-kvm"], Cold::NestedKvm),
            (&["--rootfs", "/"], Cold::Rootfs),
            (&["--prefault", "sync"], Cold::Prefault),
            (&["--no-acpi"], Cold::NoAcpi),
            (&["--disk", "/d"], Cold::Devices),
            (&["--pmem", "/p"], Cold::Devices),
            (&["--rng"], Cold::Devices),
            (&["--balloon"], Cold::Devices),
            (&["--rng", "--no-snapshot"], Cold::Asked),
        ] {
            assert_eq!(
                Plan::of(&run_args(options), &ember),
                Plan::ColdBoot { why },
                "{options:?}"
            );
        }
    }
}
