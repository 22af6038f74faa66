//! Opening /dev/kvm, with errors that say what to do, and host-wide KVM facts
//! that are fetched once per process.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm};
use std::sync::OnceLock;
use thiserror::Error;

/// The KVM API version every KVM since Linux 2.6.22 reports.
const KVM_API_VERSION: i32 = 12;

/// Capabilities ember cannot work without.
const REQUIRED_CAPS: [(Cap, &str); 5] = [
    (Cap::Irqchip, "in-kernel irqchip"),
    (Cap::Pit2, "in-kernel PIT"),
    (Cap::Ioeventfd, "ioeventfd"),
    (Cap::Irqfd, "irqfd"),
    (Cap::UserMemory, "user memory regions"),
];

/// KVM host errors.
#[derive(Debug, Error)]
pub enum KvmError {
    /// No /dev/kvm at all.
    #[error(
        "/dev/kvm does not exist: this host has no KVM (enable virtualization in the firmware and load kvm_intel or kvm_amd)"
    )]
    NotPresent,
    /// /dev/kvm exists but we may not open it.
    #[error(
        "no permission to open /dev/kvm: add your user to its group (`sudo usermod -aG kvm $USER`, then log in again) or run as root"
    )]
    Permission,
    /// Any other failure opening it.
    #[error("cannot open /dev/kvm")]
    Open(#[source] std::io::Error),
    /// A KVM with an API we do not speak.
    #[error("/dev/kvm speaks API version {0}, ember needs {KVM_API_VERSION}")]
    ApiVersion(i32),
    /// A capability we need is missing.
    #[error("this KVM lacks {0}, which ember needs")]
    MissingCap(&'static str),
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("cannot read the CPUID KVM supports")]
    SupportedCpuid(#[source] kvm_ioctls::Error),
}

/// Opens /dev/kvm and checks that it can run ember's VMs.
pub(crate) fn open() -> Result<Kvm, KvmError> {
    let kvm = Kvm::new().map_err(|e| match e.errno() {
        libc::ENOENT | libc::ENODEV | libc::ENXIO => KvmError::NotPresent,
        libc::EACCES | libc::EPERM => KvmError::Permission,
        _ => KvmError::Open(std::io::Error::from_raw_os_error(e.errno())),
    })?;
    let version = kvm.get_api_version();
    if version != KVM_API_VERSION {
        return Err(KvmError::ApiVersion(version));
    }
    if let Some((_, what)) = REQUIRED_CAPS
        .iter()
        .find(|(cap, _)| !kvm.check_extension(*cap))
    {
        return Err(KvmError::MissingCap(what));
    }
    Ok(kvm)
}

/// Whether KVM's in-kernel LAPIC emulates TSC-deadline mode: a KVM feature,
/// so `KVM_GET_SUPPORTED_CPUID` does not report it and the VMM sets its CPUID bit.
pub(crate) fn tsc_deadline_timer(kvm: &Kvm) -> bool {
    kvm.check_extension(Cap::TscDeadlineTimer)
}

/// The CPUID KVM supports, asked once per process: every vCPU's CPUID is
/// derived from it (QEMU Lite's "query CPUID once").
pub(crate) fn supported_cpuid(kvm: &Kvm) -> Result<&'static CpuId, KvmError> {
    // Callers racing here wait for the one fetch rather than repeating it.
    static CPUID: OnceLock<Result<CpuId, kvm_ioctls::Error>> = OnceLock::new();
    CPUID
        .get_or_init(|| kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES))
        .as_ref()
        .map_err(|e| KvmError::SupportedCpuid(*e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_to_do() {
        assert!(KvmError::Permission.to_string().contains("usermod -aG kvm"));
        assert!(
            KvmError::NotPresent
                .to_string()
                .contains("enable virtualization")
        );
    }
}
