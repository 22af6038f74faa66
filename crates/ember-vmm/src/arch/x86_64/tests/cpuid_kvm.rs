//! The CPUID and MSR tables against this host's real KVM: what
//! `KVM_GET_SUPPORTED_CPUID` reports goes through `configure_cpuid`, and KVM
//! must accept the result (`KVM_SET_CPUID2` validates it) for every vCPU, as
//! it must accept every boot MSR.

use super::require_kvm;
use crate::arch::x86_64::{cpuid, msr};
use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, Msrs, kvm_cpuid_entry2};
use kvm_ioctls::{Cap, Kvm};

fn leaf(c: &kvm_bindings::CpuId, function: u32, index: u32) -> Option<kvm_cpuid_entry2> {
    c.as_slice()
        .iter()
        .find(|e| e.function == function && e.index == index)
        .copied()
}

#[test]
fn kvm_accepts_the_cpuid_of_every_vcpu() {
    if !require_kvm("kvm_accepts_the_cpuid_of_every_vcpu") {
        return;
    }
    let kvm = Kvm::new().unwrap();
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    for vcpus in [1u32, 2, 4] {
        let vm = kvm.create_vm().unwrap();
        let mut apic_ids = Vec::new();
        for id in 0..vcpus {
            let vcpu = vm.create_vcpu(u64::from(id)).unwrap();
            let tsc_khz = vcpu.get_tsc_khz().ok();
            let tsc_deadline = kvm.check_extension(Cap::TscDeadlineTimer);
            let timers = cpuid::Timers {
                tsc_khz,
                tsc_deadline,
            };
            let table = cpuid::configure_cpuid(&supported, id, vcpus, timers).unwrap();
            vcpu.set_cpuid2(&table)
                .unwrap_or_else(|e| panic!("KVM_SET_CPUID2 refused vCPU {id}/{vcpus}: {e}"));

            // What the vCPU will see is what we gave KVM.
            let seen = vcpu.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
            let l1 = leaf(&seen, 1, 0).expect("leaf 1");
            assert_ne!(l1.ecx & (1 << 31), 0, "hypervisor bit");
            assert_eq!(l1.ecx & (1 << 24) != 0, tsc_deadline, "TSC-deadline timer");
            apic_ids.push(l1.ebx >> 24);
            assert_eq!(leaf(&seen, 0xb, 0).map(|e| e.edx), Some(id), "x2APIC id");
            let hv = leaf(&seen, 0x4000_0000, 0).expect("hypervisor leaf");
            assert_eq!([hv.ebx, hv.ecx, hv.edx], cpuid::KVM_SIGNATURE);
            if let Some(khz) = tsc_khz {
                assert_eq!(leaf(&seen, 0x4000_0010, 0).map(|e| e.eax), Some(khz));
            }

            let msrs = msr::boot_msrs();
            let set = vcpu.set_msrs(&Msrs::from_entries(&msrs).unwrap()).unwrap();
            assert_eq!(
                set,
                msrs.len(),
                "KVM refused boot MSR {:#x}",
                msrs[set].index
            );
        }
        let expected: Vec<u32> = (0..vcpus).collect();
        assert_eq!(apic_ids, expected, "distinct APIC ids for {vcpus} vCPUs");
    }
}
