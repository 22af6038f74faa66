//! The machine: what a VM is made of, and the running VM itself.
//!
//! # One configuration type per device
//!
//! Each device has exactly one type for what the user configures of it —
//! [`DiskConfig`], [`PmemConfig`], [`RngConfig`], [`BalloonConfig`], [`NetConfig`],
//! [`VsockConfig`], [`FsConfig`], beside
//! its device model — and that one type is what the command line parses
//! (its `FromStr` is the option's only grammar; a relative path becomes
//! absolute in its constructor), what a machine description ([`DeviceSet`],
//! [`DeviceConfig`]) and a snapshot record, and what the appliance hands its
//! `ember boot` (as JSON, never re-rendered as options). A value a backend
//! may not be able to honour is an `Option` (given or not), so that backend
//! refuses it instead of dropping it. Where the device manager put the
//! device (`Placement`: a window, an interrupt line, a guest-physical
//! region) is not configuration, and neither is what the device holds once
//! the guest runs (its transport's and its own state in a snapshot). A new
//! device adds its configuration type, a [`DeviceConfig`] variant and a
//! [`DeviceSet`] field; nothing mirrors them.
//!
//! # The running VM
//!
//! [`Machine`] is what [`crate::builder`] (or a restore) made: its methods
//! are what a caller needs of a running VM (feed the console, wait for the
//! end, pause, end the process). It sits below both, so that the builder
//! needs nothing of snapshots and a snapshot nothing of the builder but its
//! result.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use crate::devices::legacy::Serial;
use crate::devices::virtio::{
    BalloonConfig, BalloonHandle, DiskConfig, FsConfig, FsHandle, MemConfig, MemHandle,
    MmioTransport, NetConfig, PmemConfig, PmemRegion, RngConfig, VsockConfig,
};
use crate::prefault::Committer;
use crate::vstate::control::{ControlError, RunState};
use crate::vstate::end::{EndError, GuestEnd, VmEnd};
use crate::vstate::vcpu::Control;
use crate::vstate::vm::Vm;

/// One virtio device of a machine: its kind and its configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DeviceConfig {
    /// virtio-blk.
    Block(DiskConfig),
    /// virtio-rng.
    Rng(RngConfig),
    /// virtio-pmem.
    Pmem(PmemConfig),
    /// The appliance's virtio-console channel. It holds no state beyond its
    /// transport: a restore connects it to the channel socket it is given.
    Console,
    /// virtio-balloon.
    Balloon(BalloonConfig),
    /// virtio-net.
    Net(NetConfig),
    /// virtio-vsock. Its connections are not state: a restore binds its
    /// socket again and the guest is told they are gone.
    Vsock(VsockConfig),
    /// virtio-mem.
    Mem(MemConfig),
    /// virtio-fs: a shared host directory.
    Fs(FsConfig),
}

impl DeviceConfig {
    /// The backing file, for a disk or pmem device.
    pub(crate) fn path(&self) -> Option<&Path> {
        match self {
            DeviceConfig::Block(d) => Some(&d.path),
            DeviceConfig::Pmem(p) => Some(&p.path),
            _ => None,
        }
    }
}

/// The devices a user asks a VM to have, as `ember boot` and `ember run`
/// take them and as `ember run` hands them to its `ember boot`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSet {
    /// virtio-blk disks (`/dev/vda`, `/dev/vdb`, … in order).
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// virtio-pmem regions (`/dev/pmem0`, …). With a restore: the files that
    /// back the snapshot's pmem devices instead, in order.
    #[serde(default)]
    pub pmem: Vec<PmemConfig>,
    /// A virtio-rng device.
    #[serde(default)]
    pub rng: Option<RngConfig>,
    /// A virtio-balloon device.
    #[serde(default)]
    pub balloon: Option<BalloonConfig>,
    /// virtio-net devices (`eth0`, … in order). With a restore: the backends (and
    /// MACs) that replace the snapshot's, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net: Vec<NetConfig>,
    /// A virtio-vsock device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<VsockConfig>,
    /// A virtio-mem region (memory beyond the boot RAM, plugged at run time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem: Option<MemConfig>,
    /// virtio-fs shares, each with its own tag.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fs: Vec<FsConfig>,
}

/// Where the device manager put a device, beyond its MMIO window and
/// interrupt line (which follow from its position in the machine).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Placement {
    /// The guest-physical address of a device's memory region (pmem, virtio-mem).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) region: Option<u64>,
}

/// One virtio device of a running VM.
pub(crate) struct AttachedDevice {
    /// What it is, as configured.
    pub(crate) config: DeviceConfig,
    /// Where it was put.
    pub(crate) placement: Placement,
    /// Its register window.
    pub(crate) transport: Arc<Mutex<MmioTransport>>,
    /// A virtio-fs device's table, which a snapshot records.
    pub(crate) fs: Option<FsHandle>,
}

/// The virtio devices a build or a restore attached, with the handles the
/// VMM keeps.
pub(crate) struct Attached {
    /// In window order.
    pub(crate) devices: Vec<AttachedDevice>,
    /// The balloon's.
    pub(crate) balloon: Option<BalloonHandle>,
    /// The virtio-mem device's.
    pub(crate) hotplug: Option<MemHandle>,
}

/// A running VM, built by [`crate::builder::build`] or
/// [`crate::snapshot::restore::restore`]: its vCPUs run until the guest
/// ends or the process does ([`Machine::exit`]).
pub struct Machine {
    /// Pause control of the vCPUs.
    pub(crate) control: Arc<Control>,
    /// The virtio devices in window order.
    pub(crate) devices: Vec<AttachedDevice>,
    /// Guest RAM in bytes.
    pub(crate) mem_size: u64,
    /// vCPU count.
    pub(crate) vcpus: u32,
    /// Whether guest RAM is anonymous memory (a booted VM) or a private
    /// mapping of a snapshot's memory file (a restored one).
    pub(crate) anonymous_memory: bool,
    /// Whether the guest was given a VM generation ID (its ACPI tables
    /// describe one): a restore then writes a new one and notifies it.
    pub(crate) vmgenid: bool,
    /// The balloon's handle, when the VM has one (its state is saved).
    pub(crate) balloon: Option<BalloonHandle>,
    /// The virtio-mem device's handle, when the VM has one.
    pub(crate) hotplug: Option<MemHandle>,
    /// The VM (irqchip, PIT, clock); dropping the last reference tears it down.
    pub(crate) vm: Arc<Vm>,
    /// Guest memory (kept alive for KVM and the devices).
    pub(crate) mem: GuestMemoryMmap,
    /// COM1.
    pub(crate) serial: Arc<Mutex<Serial>>,
    /// Where the VM's end is reported, by devices and vCPU threads.
    pub(crate) end: Arc<VmEnd>,
    /// vCPU threads (never joined: the process ends with [`Machine::exit`]).
    pub(crate) _vcpu_threads: Vec<JoinHandle<()>>,
    /// virtio-pmem file mappings, alive as long as the VM.
    pub(crate) _pmem: Vec<PmemRegion>,
    /// What of guest memory is committed, with `--prefault`.
    pub(crate) _committer: Option<Committer>,
}

impl Machine {
    /// vCPU count.
    pub fn vcpus(&self) -> u32 {
        self.vcpus
    }

    /// Guest RAM in bytes.
    pub fn mem_size(&self) -> u64 {
        self.mem_size
    }

    /// The virtio devices' configurations, in window order.
    pub fn devices(&self) -> impl ExactSizeIterator<Item = &DeviceConfig> {
        self.devices.iter().map(|d| &d.config)
    }

    /// The balloon's control, when the VM has one.
    pub fn balloon(&self) -> Option<&BalloonHandle> {
        self.balloon.as_ref()
    }

    /// The virtio-mem device's control, when the VM has one.
    pub fn hotplug(&self) -> Option<&MemHandle> {
        self.hotplug.as_ref()
    }

    /// Whether the vCPUs run or are paused.
    pub fn run_state(&self) -> RunState {
        self.control.state()
    }

    /// Pauses every vCPU (returns once all are out of the guest).
    pub fn pause(&self) -> Result<(), ControlError> {
        self.control.pause(&self.end)
    }

    /// Lets paused vCPUs run again.
    pub fn resume(&self) -> Result<(), ControlError> {
        self.control.resume()
    }

    /// Ends the guest's run as a guest power-off would.
    pub fn power_off(&self) {
        self.end.report(GuestEnd::PowerOff);
    }

    /// Whether the guest's run is over (either way).
    pub fn has_ended(&self) -> bool {
        self.end.is_over()
    }

    /// Waits for the guest's run to end: how it ended, or why the VMM could
    /// not go on; `None` when `timeout` passes first.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Result<GuestEnd, EndError>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(outcome) = self.end.outcome() {
                return Some(outcome);
            }
            let wait_ms = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
                }
                None => -1,
            };
            let mut pfd = libc::pollfd {
                fd: self.end.eventfd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is a valid pollfd for the duration of the call and the count is 1.
            unsafe { libc::poll(&mut pfd, 1, wait_ms) };
        }
    }

    /// Gives the guest console input on COM1; returns how many bytes its
    /// receive FIFO took (the rest waits for the guest to drain it).
    pub fn feed_console(&self, bytes: &[u8]) -> usize {
        self.serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .enqueue_raw_bytes(bytes)
            .unwrap_or(0)
    }

    /// Flushes a trailing partial console line into the timeline.
    pub fn finish_console(&self) {
        let mut serial = self.serial.lock().unwrap_or_else(|p| p.into_inner());
        serial.0.writer_mut().finish();
    }

    /// Locks guest memory in host RAM (`--mem-lock` on a restored VM; a
    /// booted one's is locked as it is made), each page as it is committed.
    pub fn lock_memory(&self) -> Result<(), crate::prefault::CommitError> {
        crate::prefault::lock(&self.mem)
    }

    /// Bytes of guest RAM resident in host memory.
    pub fn guest_resident_bytes(&self) -> u64 {
        crate::vstate::memory::resident_bytes(&self.mem)
    }

    /// Ends the process with status `code` at once, leaving the VM's
    /// teardown to a process nobody waits for (`crate::vstate::teardown`):
    /// no destructors run, so the caller restores what it must first.
    pub fn exit(&self, code: i32) -> ! {
        crate::vstate::teardown::exit(code, self.vm.fd().as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_its_kind_and_its_configuration() {
        let disk: DiskConfig = "/d.img,ro".parse().unwrap();
        let json = serde_json::to_string(&DeviceConfig::Block(disk.clone())).unwrap();
        assert_eq!(
            json,
            r#"{"kind":"block","path":"/d.img","read_only":true,"direct":false}"#
        );
        let back: DeviceConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, DeviceConfig::Block(disk));
        assert_eq!(back.path(), Some(Path::new("/d.img")));
        for bad in [
            r#"{"kind":"block","path":"/d.img","readonly":true}"#,
            r#"{"kind":"tape","path":"/t"}"#,
            r#"{"kind":"rng","bits":8}"#,
        ] {
            assert!(serde_json::from_str::<DeviceConfig>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_device_set_round_trips_and_an_empty_one_is_the_default() {
        let set = DeviceSet {
            disks: vec!["/a,poll=0".parse().unwrap()],
            pmem: vec!["/p".parse().unwrap()],
            rng: Some(RngConfig::default()),
            balloon: Some(BalloonConfig::default()),
            net: vec!["tap=tap0,mac=02:00:00:00:00:01".parse().unwrap()],
            vsock: Some("cid=3,uds=/v.sock".parse().unwrap()),
            mem: Some(MemConfig::new(1 << 30).unwrap()),
            fs: vec!["tag=t,dir=/srv,ro".parse().unwrap()],
        };
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(serde_json::from_str::<DeviceSet>(&json).unwrap(), set);
        assert_eq!(
            serde_json::from_str::<DeviceSet>("{}").unwrap(),
            DeviceSet::default()
        );
    }
}
