//! The transport's snapshot state: what the driver wrote to the register
//! window (status, features, queue addresses) and where each queue stands.
//!
//! Queue positions are not kept by the transport once the device runs (its
//! I/O thread owns the queues), so they are taken from guest memory: a
//! snapshot is taken with every queue drained ([`MmioTransport::drained`]:
//! the used index has caught up with the available index), and then the
//! device's next available and next used positions both equal the used
//! index the device last published. A restored device starts from there.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::MmioTransport;

/// Why a transport state cannot be restored.
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum StateError {
    /// The recorded device is of another type than the one rebuilt.
    #[error("device type {recorded} was recorded where a device of type {found} is")]
    DeviceType {
        /// In the snapshot.
        recorded: u32,
        /// Rebuilt.
        found: u32,
    },
    /// The queue count differs.
    #[error("{recorded} queues were recorded, the device has {found}")]
    QueueCount {
        /// In the snapshot.
        recorded: usize,
        /// Rebuilt.
        found: usize,
    },
    /// A queue's registers are inconsistent (size, addresses).
    #[error("queue {index} is invalid: {why}")]
    Queue {
        /// Which queue.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// The device could not be started again.
    #[error("the device did not start: {0}")]
    Activate(String),
}

/// One queue's registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QueueRegs {
    /// Size the driver chose.
    pub size: u16,
    /// Whether the driver enabled it.
    pub ready: bool,
    /// Descriptor table address.
    pub desc: u64,
    /// Available ring address.
    pub avail: u64,
    /// Used ring address.
    pub used: u64,
}

/// The register file of one virtio-mmio window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TransportState {
    /// `DeviceID`, checked against the rebuilt device.
    pub device_type: u32,
    /// The device status byte.
    pub status: u32,
    /// `DeviceFeaturesSel`.
    pub device_features_sel: u32,
    /// `DriverFeaturesSel`.
    pub driver_features_sel: u32,
    /// The features the driver accepted.
    pub driver_features: u64,
    /// `QueueSel`.
    pub queue_sel: u32,
    /// Whether the device was serving its queues.
    pub active: bool,
    /// Pending `InterruptStatus` causes.
    pub interrupt_status: u32,
    /// Whether the device had asked for a reset.
    pub needs_reset: bool,
    /// Each queue's registers.
    pub queues: Vec<QueueRegs>,
}

impl MmioTransport {
    /// The transport's state. Take it with the vCPUs paused and the queues
    /// [`drained`](Self::drained).
    pub(crate) fn state(&self) -> TransportState {
        TransportState {
            device_type: self.device.device_type(),
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            active: self.active,
            interrupt_status: self.interrupt.status(),
            needs_reset: self.interrupt.needs_reset(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueRegs {
                    size: q.size(),
                    ready: q.ready(),
                    desc: q.desc_table(),
                    avail: q.avail_ring(),
                    used: q.used_ring(),
                })
                .collect(),
        }
    }

    /// How many requests the driver made available that the device has
    /// not completed yet, over all enabled queues of a running device. The
    /// buffers a device holds until it has something for them (the
    /// console's receive buffers, the balloon's statistics buffer:
    /// [`holds_buffers`](crate::devices::virtio::VirtioDevice::holds_buffers)) are not requests: they wait for the
    /// host, and their position is their queue's used index, from which
    /// [`Self::restore`] makes the device take them again.
    pub(crate) fn in_flight(&self) -> u32 {
        if !self.active {
            return 0;
        }
        self.queues
            .iter()
            .enumerate()
            .filter(|(i, q)| q.ready() && !self.device.holds_buffers(*i))
            .map(|(_, q)| {
                match (
                    q.avail_idx(&self.mem, Ordering::Acquire),
                    q.used_idx(&self.mem, Ordering::Acquire),
                ) {
                    (Ok(a), Ok(u)) => u32::from((a - u).0),
                    // A ring outside guest memory: the device refused it already.
                    _ => 0,
                }
            })
            .sum()
    }

    /// Whether every enabled queue of a running device has no request left
    /// in flight or waiting: its used index equals its available index.
    /// (With the vCPUs paused the driver adds nothing, so once true it stays.)
    pub(crate) fn drained(&self) -> bool {
        self.in_flight() == 0
    }

    /// Signals every queue as if the driver had notified it: a request the
    /// driver made available but had not announced yet (its vCPU stopped in
    /// between) is served too. A spurious notification is harmless.
    pub(crate) fn kick_queues(&self) {
        for (q, evt) in self.queues.iter().zip(&self.queue_evts) {
            if q.ready() {
                let _ = evt.write(1);
            }
        }
    }

    /// Sets the registers back to `s` and, if the device was running, starts
    /// it on its queues where the snapshot left them. Guest memory must hold
    /// the snapshot's contents already.
    pub(crate) fn restore(&mut self, s: &TransportState) -> Result<(), StateError> {
        let found = self.device.device_type();
        if s.device_type != found {
            return Err(StateError::DeviceType {
                recorded: s.device_type,
                found,
            });
        }
        if s.queues.len() != self.queues.len() {
            return Err(StateError::QueueCount {
                recorded: s.queues.len(),
                found: self.queues.len(),
            });
        }
        for (index, (q, r)) in self.queues.iter_mut().zip(&s.queues).enumerate() {
            let bad = |why: String| StateError::Queue { index, why };
            // The position is filled in below, from guest memory.
            let mut state = QueueState {
                max_size: q.max_size(),
                next_avail: 0,
                next_used: 0,
                event_idx_enabled: false,
                size: r.size,
                ready: r.ready,
                desc_table: r.desc,
                avail_ring: r.avail,
                used_ring: r.used,
            };
            if s.active && r.ready {
                let probe = Queue::try_from(state).map_err(|e| bad(e.to_string()))?;
                if !probe.is_valid(&self.mem) {
                    return Err(bad("its rings lie outside guest memory".into()));
                }
                let used = probe
                    .used_idx(&self.mem, Ordering::Acquire)
                    .map_err(|e| bad(e.to_string()))?;
                state.next_avail = used.0;
                state.next_used = used.0;
                // The old I/O thread may have asked the driver not to notify
                // while it polled; the new one starts asleep, so it must be
                // notified. (used.flags is the ring's first word.)
                self.mem
                    .write_obj(0u16, GuestAddress(r.used))
                    .map_err(|e| bad(e.to_string()))?;
            }
            *q = Queue::try_from(state).map_err(|e| bad(e.to_string()))?;
        }
        self.status = s.status;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.driver_features = s.driver_features;
        self.queue_sel = s.queue_sel;
        // The pending causes go back BEFORE the device runs again: its thread
        // starts serving at once (the appliance's channel already holds the
        // job, which the console delivers and signals within microseconds),
        // and a cause it signals must add to the recorded ones, not be
        // overwritten by them. Restoring them afterwards lost that VRING bit:
        // the guest took the interrupt, read an empty status, and waited
        // forever for a buffer that was already used
        // (`tests/linux_pvm/appliance_snapshot.rs` hung in 2 of 7 runs).
        self.interrupt.clear();
        self.interrupt.restore_status(s.interrupt_status);
        if s.needs_reset {
            self.interrupt.set_needs_reset();
        }
        if s.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            if self.driver_features & !self.device.avail_features() != 0 {
                return Err(StateError::Activate(format!(
                    "the driver had accepted features {:#x} this device does not offer",
                    self.driver_features
                )));
            }
            self.device.ack_features(self.driver_features);
        }
        if s.active {
            if s.status & VIRTIO_CONFIG_S_DRIVER_OK == 0 {
                return Err(StateError::Activate(
                    "running without DRIVER_OK in its status".into(),
                ));
            }
            // `activate` sets DRIVER_OK itself.
            self.status &= !VIRTIO_CONFIG_S_DRIVER_OK;
            self.activate();
            if !self.active {
                return Err(StateError::Activate(
                    "it refused its queues (see the log)".into(),
                ));
            }
            self.kick_queues();
        }
        Ok(())
    }
}
