//! Restore: a VM built from a snapshot directory instead of a kernel.
//!
//! 1. open KVM; on a helper thread (`spawn_vm`) create the VM, map the memory file privately as guest RAM (nothing is read:
//!    pages fault in from the file as the guest touches them, and its writes
//!    go to private copies), give it to KVM, create the irqchip and then the
//!    PIT: none of this needs the state file, and it costs as much as
//!    reading and checking it;
//! 2. meanwhile read and check the snapshot ([`super::load_replacing`]) and
//!    this host's CPU signature against the snapshot's
//!    (`super::check_host_cpu`): a snapshot that fails a check is refused
//!    before any vCPU exists (the VM made meanwhile is dropped; nothing ran);
//! 3. map pmem files at their recorded addresses;
//! 4. create each vCPU and set its state, each on its own thread (the
//!    thread it will run on); then the irqchip's, PIT's and clock's state
//!    (once the PIT is there);
//! 5. rebuild each virtio device in its window on its recorded backing and
//!    set its transport's state (a running device restarts on its queues);
//!    a balloon gets its target, size, held ranges and statistics back, and
//!    an unfinished `--prefault async` commit's floor comes down with every
//!    deflated page committed first (see `restore_fence`);
//! 6. COM1 from its state, the other legacy devices fresh (they hold none);
//! 7. a new VM generation ID, announced to the guest (`devices::vmgenid`),
//!    so no two restores of one snapshot share their RNG state;
//! 8. hand the vCPU threads, waiting since step 4 (each took its seccomp
//!    filter meanwhile), the finished buses.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::{AttachedDevice, DeviceConfig, Machine, SnapshotError, vcpu, vm};
use crate::arch::x86_64::layout;
use crate::builder::{self, BuildError};
use crate::device_manager::{DeviceManager, transport_for};
use crate::devices::legacy::{ConsoleSink, Serial, SerialUart};
use crate::devices::virtio::{
    Balloon, BalloonHandle, Block, Console, Fs, FsConfig, MemHandle, Net, NetConfig, Pmem,
    PmemConfig, PmemRegion, Rng, VirtioMem, Vsock, VsockConfig,
};
use crate::devices::vmgenid::VmGenId;
use crate::events::{Recorder, kind};
use crate::machine::Attached;
use crate::prefault::{self, MemoryOptions, Prefault};
use crate::vstate::bus::Bus;
use crate::vstate::end::{EndError, VmEnd};
use crate::vstate::kvm;
use crate::vstate::vcpu::{Control, Vcpu};
use crate::vstate::vm::Vm;

/// What to restore and where its console goes.
pub struct RestoreConfig {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// Where COM1 writes (None: discarded).
    pub console: Option<Box<dyn Write + Send>>,
    /// The unix socket a snapshotted virtio-console channel connects to
    /// (the appliance's channel; required when the snapshot has one).
    pub channel: Option<PathBuf>,
    /// Backing files for the snapshot's pmem devices, in order, instead of
    /// the recorded ones (each of the recorded size; see
    /// [`super::load_replacing`]).
    pub pmem: Vec<PmemConfig>,
    /// Backends for the snapshot's network devices, in order, instead of the
    /// recorded ones: each one's tap (or descriptor), and its MAC and rate limits
    /// where given. A device whose backend or MAC changes shows its guest the link
    /// going down and up.
    pub net: Vec<NetConfig>,
    /// Directories for the snapshot's virtio-fs shares, by tag, instead of
    /// the recorded ones (and `ro` as given): a share's directory may
    /// differ per restore. The guest's node IDs are the snapshot's; the
    /// device opens them again by path beneath the new directory, as it
    /// would the recorded one. A tag the snapshot lacks is an error.
    pub fs: Vec<FsConfig>,
    /// The snapshot's vsock device on this socket (and guest CID) instead of
    /// the recorded ones: a clone restored beside the VM it was taken from
    /// cannot bind that one's socket. The guest learns its CID again from
    /// the transport reset every restored vsock device sends (Linux's driver
    /// reads it then). An error when the snapshot has no vsock device.
    pub vsock: Option<VsockConfig>,
    /// Run once the VM is complete, before the vCPUs start
    /// ([`builder::BeforeGo`]).
    pub before_go: Option<builder::BeforeGo>,
    /// `--prefault`: commit the restored memory (the guest's RAM but what
    /// its balloon holds, and its plugged virtio-mem blocks) before the
    /// guest runs (`sync`) or beside it (`async`); a virtio-mem block
    /// plugged later is committed before its plug is acknowledged. Without,
    /// pages fault in from the memory file as the guest touches them.
    pub memory: MemoryOptions,
}

fn step(e: impl std::error::Error) -> SnapshotError {
    SnapshotError::Step(crate::error_chain(&e))
}

fn build_err(e: BuildError) -> SnapshotError {
    step(e)
}

/// What [`spawn_vm`]'s thread makes before the state file is needed.
struct EarlyVm {
    vm: Arc<Vm>,
    mem: GuestMemoryMmap,
}

/// [`spawn_vm`]'s answer: the VM and memory as soon as they exist, and the
/// thread, which goes on to create the PIT.
type VmThread = (
    mpsc::Receiver<Result<EarlyVm, SnapshotError>>,
    JoinHandle<Result<(), SnapshotError>>,
);

/// Creates the VM, maps the memory file (by its own size; the state must
/// agree, which the caller checks) and registers it, and creates the
/// irqchip on a thread of its own; sends them as soon as they exist (the
/// vCPUs may be created from then on), then creates the PIT (a kernel
/// thread, ~0.6 ms here), which the returned handle waits for.
fn spawn_vm(kvm: Arc<kvm_ioctls::Kvm>, mem_path: PathBuf) -> Result<VmThread, SnapshotError> {
    let (tx, rx) = mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("ember-vm".into())
        .spawn(move || {
            let early = (|| {
                let io = |source| SnapshotError::Io {
                    path: mem_path.clone(),
                    source,
                };
                let size = std::fs::metadata(&mem_path).map_err(io)?.len();
                // Refused here before anything is mapped; the state file's
                // own check names the mismatch when it is the state's fault.
                if crate::vstate::memory::check_size(size).is_err() || size % 4096 != 0 {
                    return Err(SnapshotError::Invalid {
                        path: mem_path.clone(),
                        why: format!("a memory file of {size} bytes"),
                    });
                }
                let vm = Arc::new(Vm::new(&kvm).map_err(step)?);
                let mut mem = super::memory::map_private(&mem_path, size).map_err(io)?;
                // A virtio-mem region, where the boot RAM's size puts it
                // (the state file, read meanwhile, must agree: `check_mapped`).
                let hotplug = mem_path.with_file_name(super::HOTPLUG_FILE);
                if hotplug.exists() {
                    let at = layout::hotplug_start(size);
                    mem = super::memory::add_private_region(&mem, &hotplug, at).map_err(
                        |source| SnapshotError::Io {
                            path: hotplug.clone(),
                            source,
                        },
                    )?;
                }
                vm.register_memory(&mem).map_err(step)?;
                vm.create_irqchip().map_err(step)?;
                Ok(EarlyVm { vm, mem })
            })();
            let vm = early.as_ref().ok().map(|e| e.vm.clone());
            // The receiver is gone when the state file was refused: the VM
            // is dropped unused.
            let _ = tx.send(early);
            match vm {
                Some(vm) => vm.create_pit().map_err(step),
                None => Ok(()),
            }
        })
        .map_err(step)?;
    Ok((rx, thread))
}

/// A vCPU's thread: creates the vCPU and sets its state (reported on
/// `ready`), then waits for the buses and runs it. Several vCPUs are set up
/// in parallel, and each thread is up before the devices are.
fn spawn_vcpu(
    vm: Arc<Vm>,
    state: vcpu::VcpuState,
    ready: mpsc::Sender<Result<(), SnapshotError>>,
    go: mpsc::Receiver<VcpuStart>,
) -> Result<JoinHandle<()>, SnapshotError> {
    std::thread::Builder::new()
        .name(format!("ember-vcpu{}", state.id))
        .spawn(move || {
            let set_up = (|| {
                let v = Vcpu::new(vm.fd(), state.id).map_err(step)?;
                if let (Some(then), Some(now)) = (state.tsc_khz, v.tsc_khz()) {
                    if then != now {
                        return Err(SnapshotError::Cpu(format!(
                            "TSC at {then} kHz then, {now} kHz here"
                        )));
                    }
                }
                vcpu::restore(v.fd(), &state).map_err(step)?;
                Ok(v)
            })();
            // Its registers, XSAVE area and LAPIC page are in KVM now.
            drop(state);
            let mut v = match set_up {
                Ok(v) => {
                    let _ = ready.send(Ok(()));
                    v
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            drop(ready);
            // Filtered while the rest of the VM is restored (the filter's
            // cost is then off the way to the first instruction).
            let confined = Vcpu::confine_thread(v.id());
            // The restore gave up (its error is the caller's) when no start comes.
            let Ok(start) = go.recv() else { return };
            if let Err(e) = confined {
                start.end.fail(EndError::Vcpu(crate::error_chain(&e)));
                return;
            }
            if v.id() == 0 {
                start.recorder.mark(kind::FIRST_GUEST_ENTRY);
            }
            let (io, mmio) = &*start.buses;
            if let Err(e) = v.run(io, mmio, &start.end, &vm, &start.mem, &start.control) {
                start.end.fail(EndError::Vcpu(crate::error_chain(&e)));
            }
        })
        .map_err(step)
}

/// What a waiting vCPU thread needs to run.
#[derive(Clone)]
struct VcpuStart {
    buses: Arc<(Bus, Bus)>,
    end: Arc<VmEnd>,
    mem: GuestMemoryMmap,
    control: Arc<Control>,
    recorder: Arc<Recorder>,
}

/// Builds and starts the VM saved in `cfg.dir`, in the steps of this module's
/// documentation.
///
/// One function on purpose: the numbered restore path reads top to bottom,
/// as `build`'s boot path does.
pub fn restore(cfg: RestoreConfig, recorder: Arc<Recorder>) -> Result<Arc<Machine>, SnapshotError> {
    // 1-2. KVM; this host's CPU and the VM on helper threads while the
    // state file is read and checked here.
    let kvm = Arc::new(kvm::open().map_err(step)?);
    let (early, pit) = spawn_vm(kvm.clone(), cfg.dir.join(super::MEMORY_FILE))?;
    let pmem: Vec<PathBuf> = cfg.pmem.iter().map(|p| p.path.clone()).collect();
    let (mut state, mem_path) = super::load_replacing(&cfg.dir, &pmem)?;
    super::check_host_cpu(&state, &crate::arch::x86_64::cpuid::host_signature())?;
    recorder.mark(kind::KVM_OPEN);
    let channel = connect_channel(&state.devices, cfg.channel.as_deref())?;

    // 3. The VM and its memory, from the helper thread; pmem.
    let EarlyVm { vm, mem } = match early.recv() {
        Ok(made) => made?,
        // The thread died without a word: its panic is the error.
        Err(_) => {
            pit.join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            return Err(SnapshotError::Step("the VM thread ended early".into()));
        }
    };
    check_mapped(&mem, &state, mem_path)?;
    recorder.mark(kind::MEMORY_READY);
    let pmem_regions = map_pmem(&vm, &state.devices, state.mem_size)?;

    // 4. vCPUs, each created and set on the thread it will run on.
    let n_vcpus = state.vcpus.len();
    let WaitingVcpus {
        threads: vcpu_threads,
        starts,
    } = start_vcpus(&vm, std::mem::take(&mut state.vcpus))?;
    // The irqchips', PIT's and clock's state once the PIT is there (the
    // clock set after the vCPUs' MSRs, as on any running VM).
    pit.join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
    vm::restore(vm.fd(), &state.vm).map_err(step)?;
    recorder.mark(kind::VCPUS_CREATED);

    // 5. virtio devices, each in its window.
    let end = Arc::new(VmEnd::new().map_err(step)?);
    let mut devices = DeviceManager::new(vm.clone(), mem.clone());
    let Attached {
        devices: attached,
        balloon,
        hotplug,
    } = restore_virtio(
        &mut devices,
        &state.devices,
        &pmem_regions,
        channel,
        &cfg.net,
        &cfg.fs,
        cfg.vsock.as_ref(),
    )?;
    if let Some(b) = &balloon {
        restore_fence(b, &mem);
    }
    crate::events::stage("devices_restored");

    // 6. Legacy devices; COM1 as it was.
    let sink = ConsoleSink::new(cfg.console, recorder.clone());
    let serial = restore_serial(&devices, &state.serial, sink)?;
    devices
        .attach_legacy(serial.clone(), &end, &recorder)
        .map_err(|e| build_err(e.into()))?;

    // 7. A new generation: the guest's vmgenid driver reseeds its RNG. The
    // interrupt is raised now that every local APIC has its restored state
    // (setting it would clear an interrupt raised earlier) and the I/O APIC
    // routes the GED's pin as the guest programmed it; it is delivered as
    // the vCPUs enter the guest.
    if state.vmgenid {
        new_generation(&devices, &mem)?;
    }

    // 8. Go: the caller's threads are started first (`before_go`: not under
    // this thread's filter, each takes its own), then this thread takes its
    // filter (the vCPU threads, waiting for the buses since step 4, took
    // theirs). The vCPU kick handler is installed before it, here: `ember
    // snapshot` may pause the VM the moment its control socket exists, from
    // a thread whose list has no `rt_sigaction`, before any restored vCPU has
    // run.
    let control = Control::new(n_vcpus);
    let buses = Arc::new(devices.into_buses());
    let machine = Arc::new(Machine {
        control: control.clone(),
        devices: attached,
        mem_size: state.mem_size,
        vcpus: n_vcpus as u32,
        anonymous_memory: false,
        vmgenid: state.vmgenid,
        balloon,
        hotplug,
        vm,
        mem: mem.clone(),
        serial,
        end: end.clone(),
        _vcpu_threads: vcpu_threads,
        _pmem: pmem_regions,
        _committer: None,
    });
    match cfg.memory.prefault {
        Prefault::Off => {}
        Prefault::Sync => {
            if let Some(h) = &machine.hotplug {
                h.keep_committed_restored();
            }
            let c = prefault::Committer::new(&mem, cfg.memory.threads);
            let done = prefault::commit_restored(
                &c,
                machine.balloon.as_ref(),
                machine.hotplug.as_ref(),
                cfg.memory.chunk,
            )
            .map_err(step)?;
            prefault::mark_restored_committed(&recorder, done);
        }
        Prefault::Async => {
            prefault::start_restored_background(
                &mem,
                machine.balloon.clone(),
                machine.hotplug.clone(),
                &cfg.memory,
                recorder.clone(),
            )
            .map_err(step)?;
        }
    }
    if let Some(f) = cfg.before_go {
        f(&machine).map_err(step)?;
    }
    crate::vstate::control::install_kick_handler().map_err(step)?;
    crate::seccomp::confine(crate::seccomp::Thread::Main).map_err(step)?;
    let start = VcpuStart {
        buses,
        end,
        mem,
        control,
        recorder,
    };
    for go in starts {
        // A thread that failed already reported it on `ready`.
        let _ = go.send(start.clone());
    }
    Ok(machine)
}

/// The memory file as mapped must be the size the state says (the file may
/// have changed size between the two looks), and a virtio-mem region mapped
/// exactly when the state has the device, of its size.
fn check_mapped(
    mem: &GuestMemoryMmap,
    state: &super::SnapshotState,
    path: PathBuf,
) -> Result<(), SnapshotError> {
    let want = state.mem_size;
    let at = layout::hotplug_start(want);
    let found: u64 = mem
        .iter()
        .filter(|r| r.start_addr().0 < at)
        .map(|r| r.len())
        .sum();
    if found != want {
        return Err(SnapshotError::MemorySize { path, found, want });
    }
    let mapped = mem
        .iter()
        .find(|r| r.start_addr().0 >= at)
        .map(|r| (r.start_addr().0, r.len()));
    let wanted = state.devices.iter().find_map(|d| match &d.config {
        DeviceConfig::Mem(c) => Some((at, c.size)),
        _ => None,
    });
    if mapped != wanted {
        return Err(SnapshotError::Invalid {
            path: path.with_file_name(super::HOTPLUG_FILE),
            why: format!("a virtio-mem region {mapped:x?} where the state has {wanted:x?}"),
        });
    }
    Ok(())
}

/// The appliance channel's console, connected before anything is built: a
/// snapshot with one cannot run without it.
fn connect_channel(
    devices: &[super::DeviceState],
    socket: Option<&Path>,
) -> Result<Option<Console>, SnapshotError> {
    if !devices.iter().any(|d| d.config == DeviceConfig::Console) {
        return Ok(None);
    }
    let Some(sock) = socket else {
        return Err(SnapshotError::Step(
            "the snapshot has an appliance channel (virtio-console): give its socket (--channel)"
                .into(),
        ));
    };
    let channel_err = |e| build_err(BuildError::Channel(sock.to_owned(), e));
    let stream = std::os::unix::net::UnixStream::connect(sock).map_err(channel_err)?;
    Console::from_unix_stream(stream)
        .map(Some)
        .map_err(channel_err)
}

/// Step 3: maps each pmem file at its recorded address.
fn map_pmem(
    vm: &Vm,
    devices: &[super::DeviceState],
    mem_size: u64,
) -> Result<Vec<PmemRegion>, SnapshotError> {
    let mut regions = Vec::new();
    for d in devices {
        if let (DeviceConfig::Pmem(p), Some(guest_addr)) = (&d.config, d.placement.region) {
            let region = PmemRegion::map(&p.path).map_err(step)?;
            check_pmem_addr(&p.path, guest_addr, region.len(), mem_size)?;
            vm.add_region(guest_addr, region.len(), region.host_addr())
                .map_err(step)?;
            regions.push(region);
        }
    }
    Ok(regions)
}

/// The vCPU threads, each set up and waiting for its [`VcpuStart`].
struct WaitingVcpus {
    threads: Vec<JoinHandle<()>>,
    starts: Vec<mpsc::Sender<VcpuStart>>,
}

/// Step 4: a thread per vCPU, which creates it and sets its state; returns
/// once every vCPU is set.
fn start_vcpus(vm: &Arc<Vm>, states: Vec<vcpu::VcpuState>) -> Result<WaitingVcpus, SnapshotError> {
    let n_vcpus = states.len();
    let (ready_tx, ready) = mpsc::channel();
    let mut threads = Vec::with_capacity(n_vcpus);
    let mut starts = Vec::with_capacity(n_vcpus);
    for s in states {
        let (go_tx, go) = mpsc::channel();
        threads.push(spawn_vcpu(vm.clone(), s, ready_tx.clone(), go)?);
        starts.push(go_tx);
    }
    drop(ready_tx);
    for _ in 0..n_vcpus {
        let set = ready
            .recv()
            .map_err(|_| SnapshotError::Step("a vCPU thread ended early".into()))?;
        set?;
    }
    Ok(WaitingVcpus { threads, starts })
}

/// Step 5: each virtio device rebuilt in its window on its recorded backing,
/// its transport's state set. Returns the devices as the machine lists them
/// and the balloon's handle, if there is one.
///
/// One function: one short arm per device kind, in the snapshot's order,
/// with the backends given for this restore (network, pmem, the channel)
/// taken in step as the arms meet their devices.
fn restore_virtio(
    devices: &mut DeviceManager,
    states: &[super::DeviceState],
    pmem_regions: &[PmemRegion],
    mut channel: Option<Console>,
    net: &[NetConfig],
    fs: &[FsConfig],
    vsock: Option<&VsockConfig>,
) -> Result<Attached, SnapshotError> {
    check_given(states, fs, vsock)?;
    let mut attached = Vec::new();
    let mut net_iter = net.iter();
    let mut pmem_iter = pmem_regions.iter();
    let mut balloon: Option<BalloonHandle> = None;
    let mut hotplug: Option<MemHandle> = None;
    for (i, d) in states.iter().enumerate() {
        let mut config = d.config.clone();
        let mut table = None;
        let make = match &d.config {
            DeviceConfig::Block(disk) => {
                let block = Block::new(disk)
                    .map_err(|e| build_err(BuildError::Disk(disk.path.clone(), e)))?;
                transport_for(block)
            }
            DeviceConfig::Rng(_) => transport_for(Rng::new()),
            DeviceConfig::Vsock(recorded) => {
                let now = vsock.unwrap_or(recorded);
                let mut dev = Vsock::new(now).map_err(|e| build_err(BuildError::Vsock(e)))?;
                dev.reset_guest_connections();
                config = DeviceConfig::Vsock(now.clone());
                transport_for(dev)
            }
            DeviceConfig::Pmem(p) => {
                let (Some(region), Some(guest_addr)) = (pmem_iter.next(), d.placement.region)
                else {
                    return Err(SnapshotError::Step("pmem regions out of step".into()));
                };
                let dev = Pmem::new(region, guest_addr)
                    .map_err(|e| SnapshotError::Step(format!("{}: {}", p.path.display(), e)))?;
                transport_for(dev)
            }
            DeviceConfig::Console => match channel.take() {
                Some(console) => transport_for(console),
                None => return Err(SnapshotError::Step("more than one channel".into())),
            },
            DeviceConfig::Balloon(_) => {
                // `validate` checked that a balloon has its state, and there is one.
                let (Some(s), None) = (&d.balloon, &balloon) else {
                    return Err(SnapshotError::Step(
                        "a balloon without its state, or two balloons".into(),
                    ));
                };
                let dev = Balloon::from_state(s).map_err(step)?;
                balloon = Some(dev.handle());
                transport_for(dev)
            }
            DeviceConfig::Net(recorded) => {
                let now = replace_net(recorded, net_iter.next());
                let mut dev = Net::new(&now).map_err(|e| build_err(BuildError::Net(e)))?;
                if now.backend != recorded.backend || now.mac != recorded.mac {
                    dev.change_link();
                }
                config = DeviceConfig::Net(now);
                transport_for(dev)
            }
            DeviceConfig::Mem(_) => {
                // `validate` checked its state against its configuration.
                let (Some(s), None) = (&d.hotplug, &hotplug) else {
                    return Err(SnapshotError::Step(
                        "virtio-mem without its state, or two".into(),
                    ));
                };
                let dev = VirtioMem::from_state(s);
                let h = dev.handle();
                // Its memory is the snapshot's file now, lazily mapped: all
                // of it may be handed out (no committer runs here).
                h.set_committed(h.region_size());
                hotplug = Some(h);
                transport_for(dev)
            }
            DeviceConfig::Fs(recorded) => {
                let share = fs
                    .iter()
                    .find(|f| f.tag == recorded.tag)
                    .unwrap_or(recorded);
                config = DeviceConfig::Fs(share.clone());
                let dev = match &d.fs {
                    Some(state) => Fs::from_state(share, state),
                    None => Fs::new(share),
                }
                .map_err(|e| build_err(BuildError::Fs(e)))?;
                table = Some(dev.handle());
                transport_for(dev)
            }
        };
        let transport = devices
            .attach_virtio(make)
            .map_err(|e| build_err(e.into()))?;
        transport
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restore(&d.transport)
            .map_err(|e| SnapshotError::Step(format!("virtio device {i}: {e}")))?;
        attached.push(AttachedDevice {
            config,
            placement: d.placement,
            transport,
            fs: table,
        });
    }
    if net_iter.next().is_some() {
        return Err(SnapshotError::Step(format!(
            "{} --net given, the snapshot has fewer network devices",
            net.len()
        )));
    }
    Ok(Attached {
        devices: attached,
        balloon,
        hotplug,
    })
}

/// Refuses a vsock or a share given for this restore that the snapshot has
/// no device for.
fn check_given(
    states: &[super::DeviceState],
    fs: &[FsConfig],
    vsock: Option<&VsockConfig>,
) -> Result<(), SnapshotError> {
    if vsock.is_some()
        && !states
            .iter()
            .any(|d| matches!(d.config, DeviceConfig::Vsock(_)))
    {
        return Err(SnapshotError::Step(
            "--vsock: the snapshot has no vsock device to put on it".into(),
        ));
    }
    for given in fs {
        let recorded = states
            .iter()
            .any(|d| matches!(&d.config, DeviceConfig::Fs(s) if s.tag == given.tag));
        if !recorded {
            return Err(SnapshotError::Step(format!(
                "the snapshot has no virtio-fs share tagged {:?}",
                given.tag
            )));
        }
    }
    Ok(())
}

/// A recorded network device on the backend given for it, if any: its MAC and rate
/// limits too where given; its MTU stays (the driver read it).
fn replace_net(recorded: &NetConfig, given: Option<&NetConfig>) -> NetConfig {
    let Some(g) = given else {
        return recorded.clone();
    };
    NetConfig {
        backend: g.backend.clone(),
        mac: g.mac.or(recorded.mac),
        mtu: recorded.mtu,
        rx_rate: if g.rx_rate.is_none() {
            recorded.rx_rate
        } else {
            g.rx_rate
        },
        tx_rate: if g.tx_rate.is_none() {
            recorded.tx_rate
        } else {
            g.tx_rate
        },
    }
}

/// Step 7: a new VM generation ID, announced on the GED's interrupt.
fn new_generation(devices: &DeviceManager, mem: &GuestMemoryMmap) -> Result<(), SnapshotError> {
    let ged = devices.ged_irq().map_err(|e| build_err(e.into()))?;
    VmGenId::new(mem.clone(), layout::VMGENID_START, ged)
        .new_generation()
        .map_err(step)?;
    Ok(())
}

/// Step 6: COM1 from its state, writing to `sink`.
fn restore_serial(
    devices: &DeviceManager,
    state: &super::SerialState,
    sink: ConsoleSink,
) -> Result<Arc<Mutex<Serial>>, SnapshotError> {
    let serial_irq = devices.com1_irq().map_err(|e| build_err(e.into()))?;
    let uart = SerialUart::from_state(
        &state.into(),
        serial_irq,
        vm_superio::serial::NoEvents,
        sink,
    )
    .map_err(|e| SnapshotError::Step(format!("COM1: {e:?}")))?;
    Ok(Arc::new(Mutex::new(Serial(uart))))
}

/// The balloon of a VM snapshotted while `--prefault async` was still
/// committing its memory: the guest holds the committer's floor in the
/// balloon (memory the host had not committed, never given to the guest).
///
/// A restored VM's RAM is the snapshot's memory file mapped privately:
/// nothing is read or committed up front (that is what makes a restore take
/// milliseconds), and the pages the guest already owned fault in from the
/// file as it touches them. There is no background commit to resume (the
/// file already holds what the guest wrote), so the floor comes down at
/// once; but a page the guest gets back from the balloon is committed
/// (`MADV_POPULATE_WRITE` on the private mapping: a private, resident copy)
/// before its deflate is acknowledged (the driver negotiated
/// `MUST_TELL_HOST`, so it does not touch a page before): the guest is never
/// given memory the host has not committed, even though the booted VM's
/// commit never finished. Pages it inflates afterwards are discarded as
/// on any VM without a fence.
pub(crate) fn restore_fence(balloon: &BalloonHandle, mem: &vm_memory::GuestMemoryMmap) {
    if balloon.fence_pages() == 0 {
        return;
    }
    let committer = crate::prefault::Committer::new(mem, 1);
    balloon.set_fence(committer.fence());
    // The fence itself is down (inflations discard); only deflates commit.
    committer.set_fence_up(false);
    // Interrupts the driver (its device is running): it deflates to the
    // user's target.
    balloon.set_fence_pages(0);
}

/// A recorded pmem address must lie above RAM and the 32-bit hole, aligned
/// as the builder places them, so a forged one cannot overlap guest RAM.
fn check_pmem_addr(path: &Path, addr: u64, len: u64, mem_size: u64) -> Result<(), SnapshotError> {
    let ram_end = layout::ram_ranges(mem_size).last().map_or(0, |r| r.0 + r.1);
    let align = crate::devices::virtio::pmem::PMEM_ALIGN;
    if addr < layout::PMEM_START_MIN.max(ram_end)
        || addr % align != 0
        || addr.checked_add(len).is_none()
    {
        return Err(SnapshotError::Invalid {
            path: path.to_owned(),
            why: format!("pmem address {addr:#x} is not where ember places pmem"),
        });
    }
    Ok(())
}
