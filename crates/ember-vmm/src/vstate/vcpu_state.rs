//! One vCPU's snapshot state: everything KVM keeps per vCPU that a guest can
//! observe, read on the vCPU's own thread while it is parked and written
//! back into a fresh vCPU before it first runs.

use std::sync::OnceLock;

use kvm_bindings::{
    KVM_MAX_CPUID_ENTRIES, Msrs, kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors saving or restoring a vCPU.
#[derive(Debug, Clone, Error)]
pub(crate) enum VcpuStateError {
    /// An ioctl failed.
    #[error("cannot {op} vCPU {id} {what}")]
    Ioctl {
        /// "read" or "set".
        op: &'static str,
        /// vCPU index.
        id: u32,
        /// Which state.
        what: &'static str,
        /// The ioctl error.
        source: kvm_ioctls::Error,
    },
    /// The host's MSR list could not be read.
    #[error("cannot list the MSRs KVM saves: {0}")]
    MsrList(String),
    /// KVM refused an MSR value on restore.
    #[error("KVM refused MSR {index:#x} of vCPU {id}")]
    Msr {
        /// vCPU index.
        id: u32,
        /// The MSR.
        index: u32,
    },
}

/// What a vCPU is, for the snapshot (Firecracker saves the same list).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct VcpuState {
    /// The vCPU index (and APIC id).
    pub(crate) id: u32,
    /// The CPUID table the guest saw.
    #[serde(with = "crate::hex::vec")]
    pub(crate) cpuid: Vec<kvm_cpuid_entry2>,
    /// The guest TSC rate; the restoring host's must be the same.
    pub(crate) tsc_khz: Option<u32>,
    /// Running, halted, waiting for SIPI...
    #[serde(with = "crate::hex")]
    pub(crate) mp_state: kvm_mp_state,
    /// General-purpose registers.
    #[serde(with = "crate::hex")]
    pub(crate) regs: kvm_regs,
    /// Segment, control and descriptor-table registers.
    #[serde(with = "crate::hex")]
    pub(crate) sregs: kvm_sregs,
    /// FPU, SSE and AVX state.
    #[serde(with = "crate::hex")]
    pub(crate) xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    #[serde(with = "crate::hex")]
    pub(crate) xcrs: kvm_xcrs,
    /// Debug registers.
    #[serde(with = "crate::hex")]
    pub(crate) debugregs: kvm_debugregs,
    /// The in-kernel local APIC's registers.
    #[serde(with = "crate::hex")]
    pub(crate) lapic: kvm_lapic_state,
    /// Every MSR KVM lists as saveable that reads back (TSC, syscall MSRs,
    /// kvmclock's, PAT, EFER...).
    #[serde(with = "crate::hex::vec")]
    pub(crate) msrs: Vec<kvm_msr_entry>,
    /// Pending exceptions, interrupts, NMIs, SMM state.
    #[serde(with = "crate::hex")]
    pub(crate) events: kvm_vcpu_events,
}

/// The MSRs KVM saves and restores (KVM_GET_MSR_INDEX_LIST), read once per
/// process. Read it before asking vCPU threads to save their state: finding
/// it opens /dev/kvm, which a vCPU's seccomp list does not allow.
pub(crate) fn msr_list() -> Result<&'static [u32], VcpuStateError> {
    static LIST: OnceLock<Result<Vec<u32>, VcpuStateError>> = OnceLock::new();
    LIST.get_or_init(|| {
        let kvm = crate::vstate::kvm::open().map_err(|e| VcpuStateError::MsrList(e.to_string()))?;
        kvm.get_msr_index_list()
            .map(|l| l.as_slice().to_vec())
            .map_err(|e| VcpuStateError::MsrList(e.to_string()))
    })
    .as_deref()
    .map_err(Clone::clone)
}

/// Reads every listed MSR that reads back. KVM_GET_MSRS stops at the first
/// it cannot read (some listed MSRs depend on CPUID the guest lacks): that
/// one is skipped and the rest read on.
fn read_msrs(fd: &VcpuFd, id: u32) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let mut left: Vec<u32> = msr_list()?.to_vec();
    let mut out = Vec::with_capacity(left.len());
    while !left.is_empty() {
        let entries: Vec<kvm_msr_entry> = left
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs =
            Msrs::from_entries(&entries).map_err(|e| VcpuStateError::MsrList(format!("{e:?}")))?;
        let n = fd
            .get_msrs(&mut msrs)
            .map_err(|source| VcpuStateError::Ioctl {
                op: "read",
                id,
                what: "MSRs",
                source,
            })?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        // Entry n could not be read: skip it.
        left.drain(..(n + 1).min(left.len()));
    }
    Ok(out)
}

/// Reads vCPU `id`'s state. The vCPU must be out of KVM_RUN with its last
/// exit completed (parked; see `vstate::control`).
pub(crate) fn save(fd: &VcpuFd, id: u32) -> Result<VcpuState, VcpuStateError> {
    let read = |what| {
        move |source| VcpuStateError::Ioctl {
            op: "read",
            id,
            what,
            source,
        }
    };
    // The MP state first: reading it may fold pending LAPIC events into the
    // vCPU's state (as Firecracker orders it).
    let mp_state = fd.get_mp_state().map_err(read("MP state"))?;
    let regs = fd.get_regs().map_err(read("registers"))?;
    let sregs = fd.get_sregs().map_err(read("segment registers"))?;
    let xsave = fd.get_xsave().map_err(read("XSAVE state"))?;
    let xcrs = fd.get_xcrs().map_err(read("XCRs"))?;
    let debugregs = fd.get_debug_regs().map_err(read("debug registers"))?;
    let lapic = fd.get_lapic().map_err(read("LAPIC"))?;
    let tsc_khz = fd.get_tsc_khz().ok().filter(|&k| k != 0);
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(read("CPUID"))?
        .as_slice()
        .to_vec();
    let msrs = read_msrs(fd, id)?;
    let events = fd.get_vcpu_events().map_err(read("events"))?;
    Ok(VcpuState {
        id,
        cpuid,
        tsc_khz,
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        msrs,
        events,
    })
}

/// Writes `state` into a freshly created vCPU (Firecracker's order: CPUID
/// before anything that depends on it, MSRs after the LAPIC, events last).
pub(crate) fn restore(fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuStateError> {
    let id = state.id;
    let set = |what| {
        move |source| VcpuStateError::Ioctl {
            op: "set",
            id,
            what,
            source,
        }
    };
    let cpuid =
        kvm_bindings::CpuId::from_entries(&state.cpuid).map_err(|_| VcpuStateError::Ioctl {
            op: "set",
            id,
            what: "CPUID",
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
    fd.set_cpuid2(&cpuid).map_err(set("CPUID"))?;
    fd.set_mp_state(state.mp_state).map_err(set("MP state"))?;
    fd.set_regs(&state.regs).map_err(set("registers"))?;
    fd.set_sregs(&state.sregs)
        .map_err(set("segment registers"))?;
    // SAFETY: `state.xsave` is a plain kvm_xsave of the size KVM_SET_XSAVE
    // reads (no trailing extended area: KVM_CAP_XSAVE2 is not used).
    unsafe { fd.set_xsave(&state.xsave) }.map_err(set("XSAVE state"))?;
    fd.set_xcrs(&state.xcrs).map_err(set("XCRs"))?;
    fd.set_debug_regs(&state.debugregs)
        .map_err(set("debug registers"))?;
    fd.set_lapic(&state.lapic).map_err(set("LAPIC"))?;
    let msrs = Msrs::from_entries(&state.msrs).map_err(|_| VcpuStateError::Msr { id, index: 0 })?;
    let n = fd.set_msrs(&msrs).map_err(set("MSRs"))?;
    if n != state.msrs.len() {
        return Err(VcpuStateError::Msr {
            id,
            index: state.msrs[n].index,
        });
    }
    fd.set_vcpu_events(&state.events).map_err(set("events"))?;
    Ok(())
}
