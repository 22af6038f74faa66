//! The VM-wide KVM state: the in-kernel interrupt controllers (both 8259
//! PICs, the IOAPIC), the PIT and the KVM clock.

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, kvm_clock_data, kvm_irqchip,
    kvm_pit_state2,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors saving or restoring the VM's state.
#[derive(Debug, Error)]
#[error("cannot {op} the VM's {what}")]
pub(crate) struct VmStateError {
    op: &'static str,
    what: &'static str,
    source: kvm_ioctls::Error,
}

/// The VM's KVM-side state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct VmState {
    /// The master 8259.
    #[serde(with = "crate::hex")]
    pub(crate) pic_master: kvm_irqchip,
    /// The slave 8259.
    #[serde(with = "crate::hex")]
    pub(crate) pic_slave: kvm_irqchip,
    /// The IOAPIC (redirection table, IRR).
    #[serde(with = "crate::hex")]
    pub(crate) ioapic: kvm_irqchip,
    /// The 8254 PIT's three channels.
    #[serde(with = "crate::hex")]
    pub(crate) pit: kvm_pit_state2,
    /// The KVM clock (guest nanoseconds) at the snapshot.
    #[serde(with = "crate::hex")]
    pub(crate) clock: kvm_clock_data,
}

fn chip(fd: &VmFd, id: u32, what: &'static str) -> Result<kvm_irqchip, VmStateError> {
    let mut c = kvm_irqchip {
        chip_id: id,
        ..Default::default()
    };
    fd.get_irqchip(&mut c).map_err(|source| VmStateError {
        op: "read",
        what,
        source,
    })?;
    Ok(c)
}

/// Reads the VM's state (the vCPUs are parked).
pub(crate) fn save(fd: &VmFd) -> Result<VmState, VmStateError> {
    let read = |what| {
        move |source| VmStateError {
            op: "read",
            what,
            source,
        }
    };
    Ok(VmState {
        pic_master: chip(fd, KVM_IRQCHIP_PIC_MASTER, "master PIC")?,
        pic_slave: chip(fd, KVM_IRQCHIP_PIC_SLAVE, "slave PIC")?,
        ioapic: chip(fd, KVM_IRQCHIP_IOAPIC, "IOAPIC")?,
        pit: fd.get_pit2().map_err(read("PIT"))?,
        clock: fd.get_clock().map_err(read("clock"))?,
    })
}

/// Writes `state` into a VM whose irqchip and PIT exist and whose vCPUs
/// have not run. The clock resumes where it stopped: guest time neither
/// jumps back nor over the time the snapshot sat on disk.
pub(crate) fn restore(fd: &VmFd, state: &VmState) -> Result<(), VmStateError> {
    let set = |what| {
        move |source| VmStateError {
            op: "set",
            what,
            source,
        }
    };
    fd.set_irqchip(&state.pic_master)
        .map_err(set("master PIC"))?;
    fd.set_irqchip(&state.pic_slave).map_err(set("slave PIC"))?;
    fd.set_irqchip(&state.ioapic).map_err(set("IOAPIC"))?;
    fd.set_pit2(&state.pit).map_err(set("PIT"))?;
    // KVM_SET_CLOCK accepts only the REALTIME flag; the others describe the
    // source host's clock.
    let clock = kvm_clock_data {
        clock: state.clock.clock,
        flags: 0,
        ..Default::default()
    };
    fd.set_clock(&clock).map_err(set("clock"))?;
    Ok(())
}
