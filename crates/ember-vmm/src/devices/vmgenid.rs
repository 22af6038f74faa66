//! The VM generation ID ("vmgenid"): how a restored guest learns that it is
//! one of possibly many copies of the same snapshot.
//!
//! A snapshot restored twice would otherwise hand both guests the same
//! kernel RNG state, so both would produce the same "random" keys, UUIDs and
//! TCP sequence numbers. Microsoft's VM Generation ID specification, which
//! Linux implements (`drivers/virt/vmgenid.c`, `CONFIG_VMGENID`), fixes
//! that: the firmware describes a device (`_HID "VMGENCTR"`, `_CID
//! "VM_GEN_COUNTER"`) whose `ADDR` method returns the guest-physical address
//! of a 16-byte GUID. The driver mixes the GUID into the RNG at probe; when
//! the host writes a new GUID and notifies the device (`Notify(dev, 0x80)`),
//! the driver reads it and calls `add_vmfork_randomness`, which reseeds the
//! kernel's CRNG at once ("crng reseeded due to virtual machine fork").
//!
//! ember has no firmware: the DSDT (`arch::x86_64::acpi`) describes the
//! device, and, the machine being hardware-reduced ACPI (no SCI, no GPE
//! blocks), the notification travels through an ACPI Generic Event Device
//! whose interrupt (`layout::GED_GSI`) runs its `_EVT` method, which does the
//! `Notify`. This module holds the host side: write a fresh GUID, raise the
//! interrupt. It holds no KVM: the interrupt is injected.
//!
//! The guest reacts asynchronously (an interrupt thread, then ACPI's notify
//! work queue): a program run the instant a restore resumes can, in
//! principle, still read from the old RNG state. Linux offers user space no
//! way to wait for the reseed; ember's tests wait for the kernel's message.

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::Interrupt;

/// Size of the generation ID.
pub(crate) const GUID_LEN: usize = 16;

/// vmgenid errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The host's CSPRNG failed.
    #[error("cannot draw a VM generation ID from the host's getrandom")]
    Random(#[source] std::io::Error),
    /// The GUID's address is not in guest memory.
    #[error("cannot write the VM generation ID at {0:#x}")]
    Write(u64, #[source] GuestMemoryError),
    /// The interrupt could not be raised.
    #[error("cannot raise the generation-ID interrupt")]
    Interrupt(#[source] std::io::Error),
}

/// A fresh generation ID: 128 random bits, as the specification asks (its
/// only requirement is that no two generations share one).
pub(crate) fn fresh_id() -> Result<[u8; GUID_LEN], Error> {
    let mut id = [0u8; GUID_LEN];
    super::virtio::rng::getrandom(&mut id).map_err(Error::Random)?;
    Ok(id)
}

/// Writes a fresh generation ID at `addr` (at boot: the guest's driver reads
/// it when it probes); returns it.
pub(crate) fn write_fresh_id(mem: &GuestMemoryMmap, addr: u64) -> Result<[u8; GUID_LEN], Error> {
    let id = fresh_id()?;
    mem.write_slice(&id, GuestAddress(addr))
        .map_err(|e| Error::Write(addr, e))?;
    Ok(id)
}

/// The device of a restored VM: its GUID's place and the Generic Event
/// Device's interrupt.
pub(crate) struct VmGenId {
    mem: GuestMemoryMmap,
    addr: u64,
    ged: Arc<dyn Interrupt>,
}

impl VmGenId {
    /// The device whose GUID lives at `addr` in `mem`, announced through `ged`.
    pub(crate) fn new(mem: GuestMemoryMmap, addr: u64, ged: Arc<dyn Interrupt>) -> Self {
        VmGenId { mem, addr, ged }
    }

    /// A new generation: writes a fresh GUID, then raises the GED interrupt
    /// (the guest's `_EVT` notifies the vmgenid driver, which reads the GUID
    /// and reseeds). Call it once the vCPUs' interrupt controllers are
    /// restored (an interrupt raised before would be overwritten by the
    /// restored local APIC state) and before they run. Returns the new ID.
    pub(crate) fn new_generation(&self) -> Result<[u8; GUID_LEN], Error> {
        let id = write_fresh_id(&self.mem, self.addr)?;
        self.ged.trigger().map_err(Error::Interrupt)?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::CountingInterrupt;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn read(m: &GuestMemoryMmap, addr: u64) -> [u8; GUID_LEN] {
        let mut id = [0u8; GUID_LEN];
        m.read_slice(&mut id, GuestAddress(addr)).unwrap();
        id
    }

    #[test]
    fn each_generation_writes_a_new_id_then_interrupts() {
        let m = mem();
        let irq = Arc::new(CountingInterrupt::default());
        let boot = write_fresh_id(&m, 0xf_f000).unwrap();
        assert_eq!(read(&m, 0xf_f000), boot);
        assert_eq!(irq.count(), 0, "a boot raises no event");
        let dev = VmGenId::new(m.clone(), 0xf_f000, irq.clone());
        let mut seen = vec![boot];
        for n in 1..=3 {
            let id = dev.new_generation().unwrap();
            assert_eq!(read(&m, 0xf_f000), id, "the guest reads what was written");
            assert!(!seen.contains(&id), "generation {n} repeats an ID");
            assert_ne!(id, [0; GUID_LEN]);
            assert_eq!(irq.count(), n, "one event per generation");
            seen.push(id);
        }
        // Nothing beside the GUID is touched.
        assert_eq!(read(&m, 0xf_f000 - GUID_LEN as u64), [0; GUID_LEN]);
        assert_eq!(read(&m, 0xf_f000 + GUID_LEN as u64), [0; GUID_LEN]);
    }

    #[test]
    fn an_address_outside_memory_is_an_error_and_raises_nothing() {
        let irq = Arc::new(CountingInterrupt::default());
        let dev = VmGenId::new(mem(), 1 << 20, irq.clone());
        let err = dev.new_generation().unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot write the VM generation ID at 0x100000"
        );
        assert_eq!(irq.count(), 0);
    }
}
