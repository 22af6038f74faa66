//! The VM file descriptor: memory slots, in-kernel irqchip and PIT, and the
//! eventfd plumbing (ioeventfd, irqfd) devices use to bypass the vCPU thread.

use crate::arch::x86_64::layout;
use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{IoEventAddress, Kvm, VmFd};
use std::sync::Mutex;
use thiserror::Error;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::eventfd::EventFd;

/// VM errors.
#[derive(Debug, Error)]
pub enum VmError {
    /// KVM_CREATE_VM failed.
    #[error("cannot create a KVM VM")]
    Create(#[source] kvm_ioctls::Error),
    /// A memory slot could not be registered.
    #[error("cannot register guest memory at {addr:#x} with KVM")]
    Memory {
        /// Guest address of the region.
        addr: u64,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// More memory regions than KVM has slots.
    #[error("KVM has only {0} memory slots")]
    TooManySlots(usize),
    /// TSS / identity map / irqchip / PIT set-up failed.
    #[error("cannot set up {what}")]
    Setup {
        /// Which step.
        what: &'static str,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Registering an ioeventfd or irqfd failed.
    #[error("cannot register {what}")]
    EventFd {
        /// Which registration.
        what: &'static str,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// Guest RAM registered with KVM as soon as the VM exists; the rest waits for
/// the guest's first touch (see [`Vm::register_memory`]).
pub(crate) const EAGER_RAM: u64 = 1 << 30;

/// A RAM range (guest address, length, host address) not yet given to KVM.
#[derive(Debug, Clone, Copy)]
struct PendingRam {
    guest: u64,
    len: u64,
    host: u64,
}

#[derive(Debug, Default)]
struct Slots {
    next: u32,
    /// RAM not yet registered.
    pending: Vec<PendingRam>,
    /// RAM registered lazily (an access that exited before then is still ours to complete).
    claimed: Vec<PendingRam>,
}

impl PendingRam {
    fn contains(&self, addr: u64) -> bool {
        addr >= self.guest && addr - self.guest < self.len
    }
}

/// A VM with its interrupt controllers set up.
#[derive(Debug)]
pub(crate) struct Vm {
    fd: VmFd,
    max_slots: usize,
    slots: Mutex<Slots>,
}

impl Vm {
    /// Creates the VM. Register guest memory next, then call
    /// [`Vm::create_irqchip`]: once the irqchip exists, adding a memory slot waits
    /// out an SRCU grace period of `kvm->srcu` (5-7 ms measured on a 2-core PVM
    /// host, where grace periods are slow); before, it costs microseconds.
    pub(crate) fn new(kvm: &Kvm) -> Result<Vm, VmError> {
        let fd = kvm.create_vm().map_err(VmError::Create)?;
        let setup = |what| move |source| VmError::Setup { what, source };
        // Intel VMX needs these three pages for real-mode emulation; they must not
        // overlap RAM or devices, so they sit just below the BIOS area at 4 GiB.
        fd.set_tss_address(layout::KVM_TSS_ADDRESS as usize)
            .map_err(setup("the TSS area"))?;
        fd.set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDRESS)
            .map_err(setup("the identity-map page"))?;
        Ok(Vm {
            fd,
            max_slots: kvm.get_nr_memslots(),
            slots: Mutex::new(Slots::default()),
        })
    }

    /// Creates the in-kernel PIC/IOAPIC/LAPIC (before any vCPU).
    pub(crate) fn create_irqchip(&self) -> Result<(), VmError> {
        self.fd.create_irq_chip().map_err(|source| VmError::Setup {
            what: "the in-kernel irqchip",
            source,
        })
    }

    /// Creates the in-kernel PIT (after the irqchip, before the guest runs).
    /// It starts a kernel thread, ~0.1 ms here, so [`crate::builder`] does
    /// this while the vCPU threads create their vCPUs.
    pub(crate) fn create_pit(&self) -> Result<(), VmError> {
        // The PIT's speaker port is a dummy: nothing can beep.
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd.create_pit2(pit).map_err(|source| VmError::Setup {
            what: "the in-kernel PIT",
            source,
        })
    }

    /// The raw VM fd, for vCPU creation.
    pub(crate) fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Gives guest RAM to KVM: the first `EAGER_RAM` bytes now, the rest on
    /// the guest's first touch ([`Vm::claim_ram`]).
    ///
    /// Why lazily: where KVM shadows guest page tables (as on this workplace's
    /// software KVM), a memory slot costs per-page metadata at creation, about
    /// 20 ms per 64 GiB; a guest that never touches its high memory (or touches
    /// it late) should not pay that before its first instruction. Until a range
    /// is registered, guest accesses to it exit to the vCPU thread as MMIO, which
    /// registers everything pending and completes the access on the same host
    /// memory, so the guest sees ordinary RAM throughout.
    pub(crate) fn register_memory(&self, mem: &GuestMemoryMmap) -> Result<(), VmError> {
        for region in mem.iter() {
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .map_err(|_| VmError::TooManySlots(self.max_slots))? as u64;
            let (guest, len) = (region.start_addr().0, region.len());
            let eager = EAGER_RAM.saturating_sub(guest).min(len);
            if eager > 0 {
                self.add_region(guest, eager, host)?;
            }
            if eager < len {
                let pending = PendingRam {
                    guest: guest + eager,
                    len: len - eager,
                    host: host + eager,
                };
                self.lock_slots().pending.push(pending);
            }
        }
        Ok(())
    }

    fn lock_slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called when a guest access to `addr` exited as MMIO: if `addr` is RAM
    /// that was registered lazily, registers everything still pending (once, for
    /// all vCPUs) and returns true: the caller completes the access on guest
    /// memory. False means `addr` is not RAM.
    pub(crate) fn claim_ram(&self, addr: u64) -> Result<bool, VmError> {
        let mut slots = self.lock_slots();
        let is_ram = slots
            .pending
            .iter()
            .chain(&slots.claimed)
            .any(|p| p.contains(addr));
        if is_ram {
            self.register_pending(&mut slots)?;
        }
        Ok(is_ram)
    }

    /// Registers every pending RAM range; returns whether there was any.
    pub(crate) fn claim_all_ram(&self) -> Result<bool, VmError> {
        let mut slots = self.lock_slots();
        self.register_pending(&mut slots)
    }

    fn register_pending(&self, slots: &mut Slots) -> Result<bool, VmError> {
        let pending = std::mem::take(&mut slots.pending);
        for p in &pending {
            self.add_region_locked(slots, p.guest, p.len, p.host)?;
            slots.claimed.push(*p);
        }
        Ok(!pending.is_empty())
    }

    /// Maps `len` bytes of host memory at `host_addr` into the guest at
    /// `guest_addr` (guest RAM, or a virtio-pmem file mapping).
    ///
    /// The caller keeps the host mapping alive for as long as the VM exists.
    pub(crate) fn add_region(
        &self,
        guest_addr: u64,
        len: u64,
        host_addr: u64,
    ) -> Result<(), VmError> {
        self.add_region_locked(&mut self.lock_slots(), guest_addr, len, host_addr)
    }

    fn add_region_locked(
        &self,
        slots: &mut Slots,
        guest_addr: u64,
        len: u64,
        host_addr: u64,
    ) -> Result<(), VmError> {
        if slots.next as usize >= self.max_slots {
            return Err(VmError::TooManySlots(self.max_slots));
        }
        let region = kvm_userspace_memory_region {
            slot: slots.next,
            flags: 0,
            guest_phys_addr: guest_addr,
            memory_size: len,
            userspace_addr: host_addr,
        };
        // SAFETY: the caller guarantees `host_addr..host_addr+len` is a live mapping
        // that outlives the VM (guest memory is owned by the VMM for the VM's whole
        // life), and slots are never reused, so KVM cannot alias another region.
        unsafe { self.fd.set_user_memory_region(region) }.map_err(|source| VmError::Memory {
            addr: guest_addr,
            source,
        })?;
        slots.next += 1;
        Ok(())
    }

    /// Routes `evt` to GSI `gsi`: writing the eventfd raises the interrupt
    /// without a trip through the VMM.
    pub(crate) fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd
            .register_irqfd(evt, gsi)
            .map_err(|source| VmError::EventFd {
                what: "an irqfd",
                source,
            })
    }

    /// Has KVM signal `evt` when the guest writes `datamatch` (4 bytes) to the
    /// MMIO address `addr`, instead of exiting to the vCPU thread.
    pub(crate) fn register_mmio_ioevent(
        &self,
        evt: &EventFd,
        addr: u64,
        datamatch: u32,
    ) -> Result<(), VmError> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(|source| VmError::EventFd {
                what: "an ioeventfd",
                source,
            })
    }
}
