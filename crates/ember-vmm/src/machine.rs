//! The running VM as the control socket and snapshots see it, beyond guest
//! memory and the KVM descriptors: what [`crate::builder`] (or a restore)
//! made. It sits below both, so that the builder needs nothing of
//! snapshots and a snapshot nothing of the builder but its result.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use crate::devices::legacy::Serial;
use crate::devices::virtio::{BalloonHandle, MmioTransport};
use crate::vstate::end::VmEnd;
use crate::vstate::vcpu::Control;
use crate::vstate::vm::Vm;

/// What a virtio device is, to rebuild it in the same window with the same
/// backing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum DeviceSpec {
    /// virtio-blk.
    Block {
        /// The image.
        path: PathBuf,
        /// Offered read-only.
        read_only: bool,
        /// O_DIRECT.
        direct: bool,
        /// GET_ID's answer.
        serial: Option<String>,
        /// Busy-poll window, microseconds.
        poll_us: u64,
    },
    /// virtio-rng.
    Rng,
    /// virtio-pmem.
    Pmem {
        /// The backing file.
        path: PathBuf,
        /// Where it sits in guest-physical memory.
        guest_addr: u64,
    },
    /// The appliance's virtio-console channel. It holds no state beyond its
    /// transport: a restore connects it to the channel socket it is given.
    Console,
    /// virtio-balloon; its own state is the snapshot's
    /// `DeviceState::balloon`.
    Balloon,
}

impl DeviceSpec {
    /// The backing file, for a disk or pmem device.
    pub fn path(&self) -> Option<&Path> {
        match self {
            DeviceSpec::Block { path, .. } | DeviceSpec::Pmem { path, .. } => Some(path),
            _ => None,
        }
    }
}

/// One virtio device of a running VM.
pub struct AttachedDevice {
    /// What it is.
    pub spec: DeviceSpec,
    /// Its register window.
    pub transport: Arc<Mutex<MmioTransport>>,
}

/// What pausing, snapshotting and the balloon's control need of a running
/// VM: built by the builder (or a restore), used by the control socket.
pub struct Machine {
    /// Pause control of the vCPUs.
    pub control: Arc<Control>,
    /// The virtio devices in window order.
    pub devices: Vec<AttachedDevice>,
    /// Guest RAM in bytes.
    pub mem_size: u64,
    /// vCPU count.
    pub vcpus: u32,
    /// Whether guest RAM is anonymous memory (a booted VM) or a private
    /// mapping of a snapshot's memory file (a restored one).
    pub anonymous_memory: bool,
    /// Whether the guest was given a VM generation ID (its ACPI tables
    /// describe one): a restore then writes a new one and notifies it.
    pub vmgenid: bool,
    /// The balloon's handle, when the VM has one (its state is saved).
    pub balloon: Option<BalloonHandle>,
    /// The VM (irqchip, PIT, clock).
    pub vm: Arc<Vm>,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// COM1.
    pub serial: Arc<Mutex<Serial>>,
    /// Where the VM's end is reported.
    pub end: Arc<VmEnd>,
}
