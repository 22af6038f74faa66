//! Snapshots: a paused VM written to a directory, and brought back to life
//! in another ember process.
//!
//! A snapshot directory holds two files:
//!
//! - `memory`: guest RAM, its regions back to back in guest-address order,
//!   sparse (only non-zero pages the guest may have written take space);
//! - `state`: everything else — every vCPU (`vcpu::VcpuState`), the VM's
//!   interrupt controllers, PIT and clock (`vm::VmState`), COM1, each
//!   virtio-mmio transport and the device behind it, and the host CPUID the
//!   snapshot was taken on. It is a fixed header (magic, format version,
//!   payload length, CRC-32 of the payload) and a JSON payload.
//!
//! Both are written into a private directory beside the target and swapped
//! into place in one step (`staging`), so a snapshot directory is always
//! whole: the previous snapshot, or this one.
//!
//! [`create`] takes a snapshot of a paused VM; [`restore::restore`] builds a
//! VM from one. Every check that can refuse a snapshot (format, version,
//! checksum, sizes, the host's CPU, the disks' identity) runs before any
//! vCPU is made (the VM and its memory are made meanwhile on a helper
//! thread, and dropped unused when the snapshot is refused).

pub(crate) mod memory;
pub mod restore;
mod staging;

pub(crate) use crate::vstate::vcpu_state as vcpu;
pub(crate) use crate::vstate::vm_state as vm;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvm_bindings::kvm_cpuid_entry2;
use serde::{Deserialize, Serialize};
use thiserror::Error;

pub(crate) use crate::machine::{AttachedDevice, DeviceConfig, Machine, Placement};

use crate::arch::x86_64::layout;
use crate::devices::virtio::mmio::TransportState;
use crate::devices::virtio::{BalloonHandle, BalloonState, FsHandle, FsState, MemHandle, MemState};

/// The state file's first bytes.
pub(crate) const MAGIC: &[u8; 8] = b"EMBERSNP";
/// The state format this ember writes and reads. Bump it whenever a
/// serialized type changes (4: devices are recorded by their configuration
/// types, `machine::DeviceConfig`, and their placement).
pub const FORMAT_VERSION: u32 = 4;
/// magic, version (u32), payload length (u64), CRC-32 (u32).
const HEADER_LEN: usize = 8 + 4 + 8 + 4;
/// The state file's name in a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The memory file's name in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// A virtio-mem region's memory, beside the boot RAM's (mapped at
/// `layout::hotplug_start` of the memory file's size).
pub const HOTPLUG_FILE: &str = "hotplug";
/// How long in-flight device requests may take to finish before a snapshot
/// gives up.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds on what a state file may claim, so a forged one cannot make
/// ember allocate or loop without end.
const MAX_MSRS: usize = 1024;
/// The largest state file read: ~25 KiB a vCPU, so 64 MiB is far beyond any
/// real one, and a damaged or hostile file cannot make ember allocate its
/// size.
pub const MAX_STATE_BYTES: u64 = 64 << 20;
const MAX_CPUID: usize = kvm_bindings::KVM_MAX_CPUID_ENTRIES;
const MAX_QUEUES: usize = 64;

/// Snapshot errors; each reads as one line.
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// The state file is shorter than its header or than its header says.
    #[error("{0}: the state file is truncated")]
    Truncated(PathBuf),
    /// The state file is larger than any ember writes.
    #[error("{path}: a state file of {size} bytes (ember writes at most {MAX_STATE_BYTES})")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// Not an ember state file.
    #[error("{0}: not an ember snapshot state file")]
    NotASnapshot(PathBuf),
    /// Written by an ember with another state format.
    #[error("{path}: state format version {found}, this ember reads version {FORMAT_VERSION}")]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// Bytes after the payload.
    #[error("{0}: the state file has trailing data")]
    TrailingData(PathBuf),
    /// The memory file does not match the checksum its state recorded.
    #[error("{0}: the snapshot's memory is damaged (it does not match the checksum taken with it)")]
    MemoryDamaged(PathBuf),
    /// The payload does not match its checksum.
    #[error("{0}: the state file is corrupt (checksum mismatch)")]
    Checksum(PathBuf),
    /// The payload passed its checksum but does not parse or make sense.
    #[error("{path}: invalid state: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The memory file does not match the state.
    #[error("{path}: memory file of {found} bytes, the snapshot's guest has {want}")]
    MemorySize {
        /// The file.
        path: PathBuf,
        /// Its size.
        found: u64,
        /// The guest's.
        want: u64,
    },
    /// Taken on a CPU with other features.
    #[error("the snapshot was taken on a CPU with other features ({0}); it cannot resume here")]
    Cpu(String),
    /// A disk or pmem file is not the one recorded.
    #[error("{path}: {why} since the snapshot")]
    FileChanged {
        /// The file.
        path: PathBuf,
        /// What differs.
        why: String,
    },
    /// The VM has a device that snapshots do not cover yet.
    #[error("cannot snapshot a VM with a {0} device yet")]
    Unsupported(&'static str),
    /// The VM is running.
    #[error("pause the VM before taking a snapshot")]
    NotPaused,
    /// Requests did not finish.
    #[error("device requests did not finish within {0:?}")]
    Drain(Duration),
    /// File system trouble.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A KVM or device step failed.
    #[error("{0}")]
    Step(String),
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Which file a disk or pmem device had open: the same path must name the
/// same, unchanged file at restore (the guest's caches hold its contents).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileIdentity {
    /// st_dev.
    pub(crate) dev: u64,
    /// st_ino.
    pub(crate) ino: u64,
    /// Size in bytes.
    pub(crate) size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
}

impl FileIdentity {
    /// The identity of the file at `path` now.
    pub(crate) fn of(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        })
    }

    /// Why `now` is not this file, if it is not.
    fn differs(&self, now: &FileIdentity) -> Option<String> {
        if (self.dev, self.ino) != (now.dev, now.ino) {
            Some("is another file".into())
        } else if self.size != now.size {
            Some(format!(
                "changed size ({} -> {} bytes)",
                self.size, now.size
            ))
        } else if self.mtime_ns != now.mtime_ns {
            Some("was modified".into())
        } else {
            None
        }
    }
}

/// One virtio device in the snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceState {
    /// What it is and what backs it, as configured.
    pub(crate) config: DeviceConfig,
    /// Where the device manager put it.
    pub(crate) placement: Placement,
    /// Its backing file, for disks and pmem.
    pub file: Option<FileIdentity>,
    /// Its register window.
    pub(crate) transport: TransportState,
    /// A balloon's target, size, held ranges and statistics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) balloon: Option<BalloonState>,
    /// A virtio-mem device's plugged blocks and sizes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hotplug: Option<MemState>,
    /// A virtio-fs device's table: the node IDs the guest holds, by path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fs: Option<FsState>,
}

/// COM1 (vm-superio's `SerialState`, which has no serde of its own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SerialState {
    /// DLL.
    pub(crate) baud_divisor_low: u8,
    /// DLM.
    pub(crate) baud_divisor_high: u8,
    /// IER.
    pub(crate) interrupt_enable: u8,
    /// IIR.
    pub(crate) interrupt_identification: u8,
    /// LCR.
    pub(crate) line_control: u8,
    /// LSR.
    pub(crate) line_status: u8,
    /// MCR.
    pub(crate) modem_control: u8,
    /// MSR.
    pub(crate) modem_status: u8,
    /// SCR.
    pub(crate) scratch: u8,
    /// Received bytes the guest has not read.
    pub(crate) in_buffer: Vec<u8>,
}

impl From<vm_superio::serial::SerialState> for SerialState {
    fn from(s: vm_superio::serial::SerialState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialState> for vm_superio::serial::SerialState {
    fn from(s: &SerialState) -> Self {
        vm_superio::serial::SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// Everything in a snapshot but guest memory. The i8042, the debug ports,
/// the ACPI sleep register and the boot timer hold no state.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotState {
    /// The ember that wrote it (informational).
    pub(crate) ember_version: String,
    /// Guest RAM in bytes (the memory file's size).
    pub mem_size: u64,
    /// The CPU signature of the host it was taken on
    /// (`arch::x86_64::cpuid::host_signature`).
    #[serde(with = "crate::hex::vec")]
    pub host_cpuid: Vec<kvm_cpuid_entry2>,
    /// Each vCPU, by index.
    pub(crate) vcpus: Vec<vcpu::VcpuState>,
    /// Interrupt controllers, PIT, clock.
    pub(crate) vm: vm::VmState,
    /// COM1.
    pub(crate) serial: SerialState,
    /// The virtio devices, in window order.
    pub devices: Vec<DeviceState>,
    /// Whether the guest has a VM generation ID (at `layout::VMGENID_START`,
    /// announced through the GED at `layout::GED_GSI`). Absent in older
    /// snapshots, whose guests had none.
    #[serde(default)]
    pub(crate) vmgenid: bool,
    /// The memory file's checksum (`memory::checksum`), checked when a
    /// restored guest crashes ([`check_memory`]). Absent in older snapshots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) memory_checksum: Option<u32>,
}

impl SnapshotState {
    /// Checks what a checksum cannot: that the state describes a VM this
    /// ember can build.
    fn validate(&self, path: &Path) -> Result<(), SnapshotError> {
        let bad = |why: String| SnapshotError::Invalid {
            path: path.to_owned(),
            why,
        };
        crate::vstate::memory::check_size(self.mem_size).map_err(|e| bad(e.to_string()))?;
        if self.mem_size % 4096 != 0 {
            return Err(bad("guest memory is not a whole number of pages".into()));
        }
        let max_cpus = crate::arch::x86_64::mptable::max_cpus() as usize;
        if self.vcpus.is_empty() || self.vcpus.len() > max_cpus {
            return Err(bad(format!("{} vCPUs", self.vcpus.len())));
        }
        for (i, v) in self.vcpus.iter().enumerate() {
            if v.id as usize != i {
                return Err(bad(format!("vCPU {i} is recorded as vCPU {}", v.id)));
            }
            if v.msrs.len() > MAX_MSRS || v.cpuid.len() > MAX_CPUID {
                return Err(bad(format!("vCPU {i} has too many MSRs or CPUID entries")));
            }
        }
        if self.host_cpuid.len() > MAX_CPUID {
            return Err(bad("too many host CPUID entries".into()));
        }
        let chips = [
            (&self.vm.pic_master, kvm_bindings::KVM_IRQCHIP_PIC_MASTER),
            (&self.vm.pic_slave, kvm_bindings::KVM_IRQCHIP_PIC_SLAVE),
            (&self.vm.ioapic, kvm_bindings::KVM_IRQCHIP_IOAPIC),
        ];
        if chips.iter().any(|(c, id)| c.chip_id != *id) {
            return Err(bad("interrupt controllers out of order".into()));
        }
        if self.serial.in_buffer.len() > 64 {
            return Err(bad("COM1 holds more than its FIFO".into()));
        }
        if self.devices.len() > layout::VIRTIO_MMIO_MAX_DEVICES {
            return Err(bad(format!("{} virtio devices", self.devices.len())));
        }
        for (i, d) in self.devices.iter().enumerate() {
            if d.transport.queues.len() > MAX_QUEUES {
                return Err(bad(format!("device {i} has too many queues")));
            }
            if d.config.path().is_some() != d.file.is_some() {
                return Err(bad(format!("device {i}'s backing file is not recorded")));
            }
            let has_region = matches!(d.config, DeviceConfig::Pmem(_) | DeviceConfig::Mem(_));
            if has_region != d.placement.region.is_some() {
                return Err(bad(format!(
                    "device {i}'s memory region is not as recorded"
                )));
            }
            match (&d.config, &d.balloon) {
                (DeviceConfig::Balloon(_), Some(b)) => {
                    let ram = layout::ram_ranges(self.mem_size);
                    b.check(&ram).map_err(|e| bad(format!("device {i}: {e}")))?;
                }
                (DeviceConfig::Balloon(_), None) => {
                    return Err(bad(format!("device {i} is a balloon without its state")));
                }
                (_, Some(_)) => return Err(bad(format!("device {i} has a balloon's state"))),
                (_, None) => {}
            }
            match (&d.config, &d.hotplug) {
                (DeviceConfig::Mem(c), Some(m)) => {
                    let at = layout::hotplug_start(self.mem_size);
                    if d.placement.region != Some(at) {
                        return Err(bad(format!("device {i}'s region is not at {at:#x}")));
                    }
                    m.check(c, at)
                        .map_err(|e| bad(format!("device {i}: {e}")))?;
                }
                (DeviceConfig::Mem(_), None) => {
                    return Err(bad(format!("device {i} is virtio-mem without its state")));
                }
                (_, Some(_)) => return Err(bad(format!("device {i} has virtio-mem's state"))),
                (_, None) => {}
            }
            match (&d.config, &d.fs) {
                (DeviceConfig::Fs(_), Some(f)) => {
                    f.check().map_err(|e| bad(format!("device {i}: {e}")))?;
                }
                (DeviceConfig::Fs(_), None) => {}
                (_, Some(_)) => return Err(bad(format!("device {i} has a virtio-fs table"))),
                (_, None) => {}
            }
        }
        Ok(())
    }
}

/// Encodes `state` as a state file.
pub fn encode(state: &SnapshotState) -> Vec<u8> {
    // Serializing plain data into a Vec cannot fail.
    let payload = serde_json::to_vec(state).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes and checks a state file's bytes (`path` names it in errors).
pub fn decode(bytes: &[u8], path: &Path) -> Result<SnapshotState, SnapshotError> {
    let p = || path.to_owned();
    if bytes.len() < MAGIC.len() {
        return Err(SnapshotError::Truncated(p()));
    }
    if &bytes[..8] != MAGIC {
        return Err(SnapshotError::NotASnapshot(p()));
    }
    if bytes.len() < HEADER_LEN {
        return Err(SnapshotError::Truncated(p()));
    }
    let word = |r: std::ops::Range<usize>| -> [u8; 8] {
        let mut w = [0u8; 8];
        w[..r.len()].copy_from_slice(&bytes[r]);
        w
    };
    let version = u64::from_le_bytes(word(8..12)) as u32;
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version {
            path: p(),
            found: version,
        });
    }
    let len = u64::from_le_bytes(word(12..20));
    let crc = u64::from_le_bytes(word(20..24)) as u32;
    let payload = &bytes[HEADER_LEN..];
    match (payload.len() as u64).cmp(&len) {
        std::cmp::Ordering::Less => return Err(SnapshotError::Truncated(p())),
        std::cmp::Ordering::Greater => return Err(SnapshotError::TrailingData(p())),
        std::cmp::Ordering::Equal => {}
    }
    if crc32fast::hash(payload) != crc {
        return Err(SnapshotError::Checksum(p()));
    }
    let state: SnapshotState =
        serde_json::from_slice(payload).map_err(|e| SnapshotError::Invalid {
            path: p(),
            why: e.to_string(),
        })?;
    state.validate(path)?;
    Ok(state)
}

/// Reads and checks a snapshot directory: the state file, the memory file's
/// size, the backing files' identity, and that this host's CPU is the one
/// the snapshot was taken on (`host_cpuid` gives its CPUID; it is asked
/// only once the state has parsed, so the caller may fetch it meanwhile).
/// Nothing is built.
#[cfg(test)]
pub(crate) fn load(
    dir: &Path,
    host_cpuid: impl FnOnce() -> Result<Vec<kvm_cpuid_entry2>, SnapshotError>,
) -> Result<(SnapshotState, PathBuf), SnapshotError> {
    let (state, mem_path) = load_replacing(dir, &[])?;
    check_host_cpu(&state, &host_cpuid()?)?;
    Ok((state, mem_path))
}

/// Whether the snapshot in `dir` still has the memory it was taken with:
/// asked when its restored guest crashed at once, where a damaged memory
/// file (not the guest) is the likelier cause. `Ok` when it matches, or the
/// snapshot recorded no checksum.
pub fn check_memory(dir: &Path) -> Result<(), SnapshotError> {
    let state_path = dir.join(STATE_FILE);
    let state = decode(&read_bounded(&state_path)?, &state_path)?;
    let Some(recorded) = state.memory_checksum else {
        return Ok(());
    };
    let mem_path = dir.join(MEMORY_FILE);
    if memory::checksum(&mem_path).map_err(io_err(&mem_path))? != recorded {
        return Err(SnapshotError::MemoryDamaged(mem_path));
    }
    Ok(())
}

/// Refuses a snapshot taken on a CPU whose features differ from this host's
/// (`host_cpuid`: this host's `arch::x86_64::cpuid::host_signature`).
/// [`load`] checks it; a caller of [`load_replacing`] must, before the VM
/// runs.
pub(crate) fn check_host_cpu(
    state: &SnapshotState,
    host_cpuid: &[kvm_cpuid_entry2],
) -> Result<(), SnapshotError> {
    compare_cpuid(&state.host_cpuid, host_cpuid)
}

/// Reads and checks a snapshot directory (state, memory size, backing
/// files' identity) but not the CPU, which the caller checks with
/// `check_host_cpu` before the VM runs, and with the first `pmem.len()`
/// pmem devices backed by these files instead of the recorded ones. A replacement must have the recorded size (the guest sized
/// its region by it); its contents are the caller's business: the guest must
/// hold nothing of the old file in its caches (the appliance's per-run slot
/// is never mounted before its snapshot).
pub fn load_replacing(
    dir: &Path,
    pmem: &[PathBuf],
) -> Result<(SnapshotState, PathBuf), SnapshotError> {
    let (mut state, mem_path) = read(dir)?;
    replace_pmem(&mut state, pmem)?;
    for d in &state.devices {
        if let (Some(path), Some(rec)) = (d.config.path(), &d.file) {
            let now = FileIdentity::of(path).map_err(io_err(path))?;
            if let Some(why) = rec.differs(&now) {
                return Err(SnapshotError::FileChanged {
                    path: path.to_owned(),
                    why,
                });
            }
        }
    }
    Ok((state, mem_path))
}

/// Reads a snapshot directory's state and checks it against its memory
/// file's size: whether this ember can restore it, short of the host's CPU
/// and the backing files (which [`load_replacing`] checks). Cheap: the state
/// is a few KiB and the memory file is only stat'ed. Returns the state and
/// the memory file's path.
pub fn read(dir: &Path) -> Result<(SnapshotState, PathBuf), SnapshotError> {
    let state_path = dir.join(STATE_FILE);
    let state = decode(&read_bounded(&state_path)?, &state_path)?;
    let mem_path = dir.join(MEMORY_FILE);
    let found = std::fs::metadata(&mem_path)
        .map_err(io_err(&mem_path))?
        .len();
    if found != state.mem_size {
        return Err(SnapshotError::MemorySize {
            path: mem_path,
            found,
            want: state.mem_size,
        });
    }
    Ok((state, mem_path))
}

/// The state file's bytes, refusing one larger than [`MAX_STATE_BYTES`]
/// before reading it (or while: it may grow under us).
fn read_bounded(path: &Path) -> Result<Vec<u8>, SnapshotError> {
    use std::io::Read;
    let file = crate::files::open_regular(path).map_err(io_err(path))?;
    let size = file.metadata().map_err(io_err(path))?.len();
    let too_large = |size| SnapshotError::TooLarge {
        path: path.to_owned(),
        size,
    };
    if size > MAX_STATE_BYTES {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(MAX_STATE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(path))?;
    if bytes.len() as u64 > MAX_STATE_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Points the first pmem devices of `state` at `files`, checking sizes.
fn replace_pmem(state: &mut SnapshotState, files: &[PathBuf]) -> Result<(), SnapshotError> {
    let mut files = files.iter();
    for d in &mut state.devices {
        let DeviceConfig::Pmem(pmem) = &mut d.config else {
            continue;
        };
        let path = &mut pmem.path;
        let Some(new) = files.next() else { break };
        let now = FileIdentity::of(new).map_err(io_err(new))?;
        let want = d.file.map_or(0, |f| f.size);
        if now.size != want {
            return Err(SnapshotError::Invalid {
                path: new.clone(),
                why: format!(
                    "{} bytes, the snapshot's pmem device {} has {want}",
                    now.size,
                    path.display()
                ),
            });
        }
        *path = new.clone();
        d.file = Some(now);
    }
    if let Some(extra) = files.next() {
        return Err(SnapshotError::Invalid {
            path: extra.clone(),
            why: "the snapshot has fewer pmem devices than files given".into(),
        });
    }
    Ok(())
}

/// A CPUID entry's registers without what depends on the host CPU the
/// query ran on rather than on the CPU model (APIC ids).
fn cpu_independent(e: &kvm_cpuid_entry2) -> (u32, u32, u32, u32, u32) {
    let (mut eax, mut ebx, mut ecx, mut edx) = (e.eax, e.ebx, e.ecx, e.edx);
    match e.function {
        // EBX[31:24]: initial APIC id.
        0x1 => ebx &= 0x00ff_ffff,
        // EDX: x2APIC id.
        0xb | 0x1f => edx = 0,
        // AMD: extended APIC id, core and node ids.
        0x8000_001e => {
            eax = 0;
            ebx &= !0xff;
            ecx &= !0xff;
        }
        _ => {}
    }
    (e.flags, eax, ebx, ecx, edx)
}

/// Compares two hosts' CPUID tables leaf by leaf.
fn compare_cpuid(then: &[kvm_cpuid_entry2], now: &[kvm_cpuid_entry2]) -> Result<(), SnapshotError> {
    let key = |e: &kvm_cpuid_entry2| (e.function, e.index);
    let regs = cpu_independent;
    for t in then {
        match now.iter().find(|n| key(n) == key(t)) {
            None => {
                return Err(SnapshotError::Cpu(format!(
                    "leaf {:#x}.{} is missing here",
                    t.function, t.index
                )));
            }
            Some(n) if regs(n) != regs(t) => {
                return Err(SnapshotError::Cpu(format!(
                    "leaf {:#x}.{} differs",
                    t.function, t.index
                )));
            }
            Some(_) => {}
        }
    }
    if let Some(n) = now.iter().find(|n| !then.iter().any(|t| key(t) == key(n))) {
        return Err(SnapshotError::Cpu(format!(
            "leaf {:#x}.{} is new here",
            n.function, n.index
        )));
    }
    Ok(())
}

/// What [`create`] did.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CreateStats {
    /// Bytes of guest memory written (the rest of the file is holes).
    pub memory_bytes: u64,
    /// The state file's size.
    pub state_bytes: u64,
    /// Requests the guest had made available that the devices had not
    /// completed when the snapshot began (drained before it was taken).
    pub in_flight: u32,
    /// Wall time of the whole snapshot.
    pub ms: f64,
}

/// Writes a snapshot of the paused VM to `dir` (created if needed, 0700,
/// its files 0600). An earlier snapshot there is replaced in one step, and
/// kept whole if this one fails; a directory holding anything but a
/// snapshot's files is refused.
pub fn create(machine: &Machine, dir: &Path) -> Result<CreateStats, SnapshotError> {
    let start = Instant::now();
    check_snapshottable(machine)?;
    let in_flight = drain(machine)?;
    let step = |e: &dyn std::fmt::Display| SnapshotError::Step(e.to_string());
    // Here, not on the vCPU threads (their seccomp list opens no files).
    crate::vstate::vcpu_state::msr_list().map_err(|e| step(&e))?;
    let vcpus = machine
        .control
        .collect(&machine.end)
        .map_err(|e| step(&e))?;
    let vm_state = vm::save(machine.vm.fd()).map_err(|e| step(&e))?;
    let serial_state = machine
        .serial
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .0
        .state();
    let mut state = SnapshotState {
        ember_version: env!("CARGO_PKG_VERSION").into(),
        mem_size: machine.mem_size,
        host_cpuid: crate::arch::x86_64::cpuid::host_signature(),
        vcpus,
        vm: vm_state,
        serial: serial_state.into(),
        devices: device_states(machine)?,
        vmgenid: machine.vmgenid,
        memory_checksum: None,
    };
    let (memory_bytes, state_bytes) = write_files(machine, &mut state, dir)?;
    Ok(CreateStats {
        memory_bytes,
        state_bytes,
        in_flight,
        ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// Refuses a VM that is running, or whose balloon's state cannot be read.
fn check_snapshottable(machine: &Machine) -> Result<(), SnapshotError> {
    if machine.control.state() != crate::vstate::control::RunState::Paused {
        return Err(SnapshotError::NotPaused);
    }
    if machine
        .devices
        .iter()
        .any(|d| matches!(d.config, DeviceConfig::Balloon(_)))
        && machine.balloon.is_none()
    {
        return Err(SnapshotError::Unsupported(
            "virtio-balloon without its handle",
        ));
    }
    Ok(())
}

/// A device's transport, whether or not a thread panicked holding it.
fn transport(
    d: &crate::machine::AttachedDevice,
) -> std::sync::MutexGuard<'_, crate::devices::virtio::mmio::MmioTransport> {
    d.transport.lock().unwrap_or_else(|p| p.into_inner())
}

/// Lets the requests in flight finish: their completions land in guest
/// memory and the used rings, where the restore finds them. Returns how
/// many there were.
fn drain(machine: &Machine) -> Result<u32, SnapshotError> {
    let in_flight = machine
        .devices
        .iter()
        .map(|d| transport(d).in_flight())
        .sum();
    for d in &machine.devices {
        transport(d).kick_queues();
    }
    let drain_start = Instant::now();
    while !machine.devices.iter().all(|d| transport(d).drained()) {
        if drain_start.elapsed() > DRAIN_TIMEOUT {
            return Err(SnapshotError::Drain(DRAIN_TIMEOUT));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(in_flight)
}

/// Each device's configuration, placement, backing file and state, taken
/// after the drain: no inflate or deflate is half-way.
fn device_states(machine: &Machine) -> Result<Vec<DeviceState>, SnapshotError> {
    let mut devices = Vec::new();
    for d in &machine.devices {
        let file = match d.config.path() {
            Some(p) => Some(FileIdentity::of(p).map_err(io_err(p))?),
            None => None,
        };
        let balloon = match d.config {
            DeviceConfig::Balloon(_) => machine.balloon.as_ref().map(BalloonHandle::state),
            _ => None,
        };
        let hotplug = match d.config {
            DeviceConfig::Mem(_) => machine.hotplug.as_ref().map(MemHandle::state),
            _ => None,
        };
        devices.push(DeviceState {
            config: d.config.clone(),
            placement: d.placement,
            file,
            balloon,
            hotplug,
            fs: d.fs.as_ref().map(FsHandle::state),
            transport: transport(d).state(),
        });
    }
    Ok(devices)
}

/// Writes the memory file(s) and the state file, staged in a private
/// directory beside `dir` and swapped in whole (`staging`): a failed
/// snapshot leaves the previous one as it was, and a VM restored from the
/// old one keeps its mapping of the old memory. Returns the memory bytes
/// written and the state file's size.
fn write_files(
    machine: &Machine,
    state: &mut SnapshotState,
    dir: &Path,
) -> Result<(u64, u64), SnapshotError> {
    let mem = &machine.mem;
    let staging = staging::Staging::new(dir).map_err(io_err(dir))?;
    let mem_path = staging.path(MEMORY_FILE);
    // Boot RAM to the memory file, a virtio-mem region to its own.
    let hotplug_at = layout::hotplug_start(machine.mem_size);
    let (mut memory_bytes, checksum) = staging
        .create(MEMORY_FILE)
        .and_then(|f| {
            memory::write_range(mem, &f, machine.anonymous_memory, 0..hotplug_at).and_then(|n| {
                f.sync_all()?;
                Ok(n)
            })
        })
        .map_err(io_err(&mem_path))?;
    if machine.hotplug.is_some() {
        let hp_path = staging.path(HOTPLUG_FILE);
        let (n, _) = staging
            .create(HOTPLUG_FILE)
            .and_then(|f| {
                let n =
                    memory::write_range(mem, &f, machine.anonymous_memory, hotplug_at..u64::MAX)?;
                f.sync_all()?;
                Ok(n)
            })
            .map_err(io_err(&hp_path))?;
        memory_bytes += n;
    }
    state.memory_checksum = Some(checksum);
    let bytes = encode(state);
    let state_path = staging.path(STATE_FILE);
    staging
        .create(STATE_FILE)
        .and_then(|mut f| {
            use std::io::Write;
            f.write_all(&bytes)?;
            f.sync_all()
        })
        .map_err(io_err(&state_path))?;
    staging.commit().map_err(io_err(dir))?;
    Ok((memory_bytes, bytes.len() as u64))
}

#[cfg(test)]
mod tests;
