//! The CPUID table each vCPU sees.
//!
//! Starts from what KVM can virtualize (`KVM_GET_SUPPORTED_CPUID`, fetched
//! once by the caller) and makes it describe *this* VM rather than the host:
//!
//! * **identity** — each vCPU's APIC ID (leaf 0x1 EBX, 0xb/0x1f EDX, AMD
//!   0x8000001e) is its vCPU index, matching the MP table and the MADT;
//! * **topology** — one package with `num_vcpus` cores of one thread each,
//!   told consistently by every leaf Linux may read (0x1, 0x4, 0xb, 0x1f on
//!   Intel; 0x80000008, 0x8000001d, 0x8000001e on AMD), so the scheduler sees
//!   no phantom hyper-threads and the cache-sharing masks are right;
//! * **hypervisor** — the "running under a hypervisor" bit and KVM's
//!   paravirtual leaves (signature, features, TSC frequency), which is what
//!   lets Linux use kvmclock and skip calibrating the TSC against the PIT —
//!   a calibration that costs whole seconds when each PIT read is an exit;
//! * **timers KVM emulates but does not report** — the LAPIC's TSC-deadline
//!   mode is a capability of KVM's in-kernel LAPIC (`KVM_CAP_TSC_DEADLINE_TIMER`),
//!   not of the CPU, so `KVM_GET_SUPPORTED_CPUID` leaves its bit clear and the
//!   VMM sets it (as QEMU does): without it Linux programs the LAPIC timer in
//!   one-shot mode and first calibrates it against jiffies, ~100 ms of waiting;
//! * **no phantom hardware** — features that need something this VM doesn't
//!   provide (nested VMX/SVM, MONITOR/MWAIT, thermal monitoring, a PMU) are
//!   cleared so the guest doesn't probe for them.

use kvm_bindings::{CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX, kvm_cpuid_entry2};

/// Highest vCPU count: APIC IDs are 8 bits in xAPIC mode, 0xff is the
/// broadcast ID, and the I/O APIC takes the ID after the last vCPU.
pub(crate) const MAX_VCPUS: u32 = 254;

/// KVM's hypervisor signature, "KVMKVMKVM\0\0\0" as EBX, ECX, EDX.
pub(crate) const KVM_SIGNATURE: [u32; 3] = [0x4b4d_564b, 0x564b_4d56, 0x0000_004d];
/// Hypervisor leaf: max hypervisor leaf in EAX, signature in EBX/ECX/EDX.
pub(crate) const LEAF_HYPERVISOR: u32 = 0x4000_0000;
/// KVM paravirtual feature bits (kvmclock, PV EOI, ...) in EAX.
pub(crate) const LEAF_KVM_FEATURES: u32 = 0x4000_0001;
/// Timing leaf (the VMware/KVM convention): TSC and APIC bus kHz.
pub(crate) const LEAF_TIMING: u32 = 0x4000_0010;
/// KVM's local APIC timer ticks once per nanosecond: 1 GHz, in kHz.
pub(crate) const KVM_APIC_BUS_KHZ: u32 = 1_000_000;

const LEAF_VENDOR: u32 = 0x0;
const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_PMU: u32 = 0xa;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_EXT_FEATURES: u32 = 0x8000_0001;
const LEAF_AMD_SIZES: u32 = 0x8000_0008;
const LEAF_AMD_CACHE_TOPOLOGY: u32 = 0x8000_001d;
const LEAF_AMD_EXT_APIC_ID: u32 = 0x8000_001e;

// Leaf 0x1 EBX fields.
/// EBX bits 31-24: initial APIC ID.
const EBX_APIC_ID_SHIFT: u32 = 24;
/// EBX bits 23-16: logical processors per package (valid when EDX.HTT is set).
const EBX_LOGICAL_COUNT_SHIFT: u32 = 16;
/// EBX bits 0-15 (brand index, CLFLUSH line size) are kept from the host.
const EBX_KEEP_MASK: u32 = 0xffff;

// Leaf 0x1 ECX feature bits.
/// MONITOR/MWAIT: idle through mwait needs host support we don't arrange.
const ECX_MONITOR: u32 = 1 << 3;
/// VMX: no nested virtualization.
const ECX_VMX: u32 = 1 << 5;
/// SMX: no trusted-execution (GETSEC) support.
const ECX_SMX: u32 = 1 << 6;
/// Thermal Monitor 2: no thermal sensors.
const ECX_TM2: u32 = 1 << 8;
/// TSC-deadline mode of the LAPIC timer.
const ECX_TSC_DEADLINE: u32 = 1 << 24;
/// PDCM: the PERF_CAPABILITIES MSR, part of the PMU we don't expose.
const ECX_PDCM: u32 = 1 << 15;
/// Hypervisor present: Linux then looks at the 0x40000000 leaves.
const ECX_HYPERVISOR: u32 = 1 << 31;

// Leaf 0x1 EDX feature bits.
/// ACPI thermal-monitor MSRs (not ACPI tables): no thermal sensors.
const EDX_ACPI_THERMAL: u32 = 1 << 22;
/// HTT: EBX bits 23-16 hold a valid logical-processor count.
const EDX_HTT: u32 = 1 << 28;
/// Thermal Monitor: no thermal sensors.
const EDX_TM: u32 = 1 << 29;

// AMD 0x80000001 ECX.
/// SVM: no nested virtualization.
const AMD_ECX_SVM: u32 = 1 << 2;
/// PerfCtrExtCore: core performance counters, part of the PMU we don't expose.
const AMD_ECX_PERFCTR_CORE: u32 = 1 << 23;

// Leaf 0x4 / 0x8000001d EAX fields (deterministic cache parameters).
/// Bits 4-0: cache type, 0 = no more caches.
const CACHE_TYPE_MASK: u32 = 0x1f;
/// Bits 7-5: cache level.
const CACHE_LEVEL_SHIFT: u32 = 5;
/// Bits 25-14: logical processors sharing this cache, minus one.
const CACHE_SHARING_SHIFT: u32 = 14;
const CACHE_SHARING_MASK: u32 = 0xfff << CACHE_SHARING_SHIFT;
/// Leaf 0x4 bits 31-26: cores per package, minus one (6 bits).
const CACHE_CORES_SHIFT: u32 = 26;
const CACHE_CORES_MAX: u32 = 0x3f;
/// Caches at this level or above (L3) are shared by the whole package.
const SHARED_CACHE_LEVEL: u32 = 3;

// Leaf 0xb / 0x1f ECX bits 15-8: the level type.
const LEVEL_TYPE_SHIFT: u32 = 8;
/// Level type 1: SMT (threads of a core).
const LEVEL_TYPE_SMT: u32 = 1;
/// Level type 2: core.
const LEVEL_TYPE_CORE: u32 = 2;

// AMD 0x80000008 ECX.
/// Bits 7-0: number of cores in the package minus one (NC).
const AMD_NC_MASK: u32 = 0xff;
/// Bits 15-12: APIC ID bits that identify the core (ApicIdCoreIdSize).
const AMD_APIC_ID_CORE_SIZE_SHIFT: u32 = 12;

/// Errors while building a vCPU's CPUID table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A VM needs at least one vCPU.
    #[error("the VM has no vCPUs")]
    NoVcpus,
    /// More vCPUs than 8-bit APIC IDs allow.
    #[error("{0} vCPUs requested, at most {MAX_VCPUS} are supported")]
    TooManyVcpus(u32),
    /// The vCPU index is outside the VM.
    #[error("vCPU {vcpu_id} does not exist in a VM with {num_vcpus} vCPUs")]
    NoSuchVcpu {
        /// The vCPU index asked for.
        vcpu_id: u32,
        /// How many vCPUs the VM has.
        num_vcpus: u32,
    },
    /// The table outgrew what `KVM_SET_CPUID2` accepts.
    #[error("the CPUID table has too many entries")]
    TooManyEntries(#[source] vmm_sys_util::fam::Error),
}

/// Whose CPUID conventions the host follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vendor {
    Intel,
    /// AMD and Hygon (a licensed Zen), which share AMD's topology leaves.
    Amd,
    Other,
}

impl Vendor {
    fn of(entries: &[kvm_cpuid_entry2]) -> Vendor {
        let Some(leaf0) = entries.iter().find(|e| e.function == LEAF_VENDOR) else {
            return Vendor::Other;
        };
        // The vendor string is EBX, EDX, ECX.
        let mut name = [0u8; 12];
        name[..4].copy_from_slice(&leaf0.ebx.to_le_bytes());
        name[4..8].copy_from_slice(&leaf0.edx.to_le_bytes());
        name[8..].copy_from_slice(&leaf0.ecx.to_le_bytes());
        match &name {
            b"GenuineIntel" => Vendor::Intel,
            b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
            _ => Vendor::Other,
        }
    }
}

/// Bits needed to number `n` items: ceil(log2(n)), 0 for n <= 1.
fn id_bits(n: u32) -> u32 {
    n.next_power_of_two().trailing_zeros()
}

fn leaf(function: u32, index: u32, flags: u32, regs: [u32; 4]) -> kvm_cpuid_entry2 {
    let [eax, ebx, ecx, edx] = regs;
    kvm_cpuid_entry2 {
        function,
        index,
        flags,
        eax,
        ebx,
        ecx,
        edx,
        padding: [0; 3],
    }
}

/// The CPUID leaves that say which CPU this is and what it offers: vendor
/// and model (0x0, 0x1, 0x80000000), features (0x1, 0x7, 0x80000001), XSAVE
/// layout (0xd), invariant TSC (0x80000007) and address sizes (0x80000008).
const SIGNATURE_LEAVES: [(u32, u32); 10] = [
    (0x0, 0),
    (0x1, 0),
    (0x7, 0),
    (0x7, 1),
    (0xd, 0),
    (0xd, 1),
    (0x8000_0000, 0),
    (0x8000_0001, 0),
    (0x8000_0007, 0),
    (0x8000_0008, 0),
];

/// This host CPU's signature: `SIGNATURE_LEAVES` as the CPUID instruction
/// answers them here (those past the CPU's highest leaf left out). A
/// snapshot records it and a restore compares it before anything runs. Ten
/// instructions: KVM's supported CPUID, which says the same of the CPU, runs
/// several for each of its ~75 leaves, ~0.4 ms where CPUID traps to a
/// hypervisor (as in a cloud VM). What the host's *kernel* adds or hides
/// shows when the vCPU state is set: KVM refuses what it cannot give.
pub(crate) fn host_signature() -> Vec<kvm_cpuid_entry2> {
    use std::arch::x86_64::__cpuid_count;
    let max_basic = __cpuid_count(0, 0).eax;
    let max_ext = __cpuid_count(0x8000_0000, 0).eax;
    SIGNATURE_LEAVES
        .iter()
        .filter(|&&(f, _)| f <= if f >= 0x8000_0000 { max_ext } else { max_basic })
        .map(|&(f, i)| {
            let r = __cpuid_count(f, i);
            let flags = if matches!(f, 0x7 | 0xd) {
                KVM_CPUID_FLAG_SIGNIFCANT_INDEX
            } else {
                0
            };
            leaf(f, i, flags, [r.eax, r.ebx, r.ecx, r.edx])
        })
        .collect()
}

/// Leaf 0xb / 0x1f subleaves: SMT level (1 thread), core level (all vCPUs),
/// then an invalid level that ends the list. EDX is the x2APIC ID everywhere.
fn topology_leaves(function: u32, apic_id: u32, cores: u32) -> [kvm_cpuid_entry2; 3] {
    let flags = KVM_CPUID_FLAG_SIGNIFCANT_INDEX;
    [
        // EAX: APIC ID bits to shift away to reach the next level (no thread
        // bits), EBX: logical processors at this level.
        leaf(
            function,
            0,
            flags,
            [0, 1, (LEVEL_TYPE_SMT << LEVEL_TYPE_SHIFT), apic_id],
        ),
        leaf(
            function,
            1,
            flags,
            [
                id_bits(cores),
                cores,
                1 | (LEVEL_TYPE_CORE << LEVEL_TYPE_SHIFT),
                apic_id,
            ],
        ),
        leaf(function, 2, flags, [0, 0, 2, apic_id]),
    ]
}

/// Rewrites the cache-sharing field of a deterministic-cache-parameters leaf:
/// L1/L2 belong to one core (one thread), L3 to the whole package.
fn set_cache_sharing(eax: u32, cores: u32) -> u32 {
    if eax & CACHE_TYPE_MASK == 0 {
        return eax; // end of the cache list
    }
    let level = (eax >> CACHE_LEVEL_SHIFT) & 0x7;
    let sharing = if level >= SHARED_CACHE_LEVEL {
        cores - 1
    } else {
        0
    };
    (eax & !CACHE_SHARING_MASK) | ((sharing << CACHE_SHARING_SHIFT) & CACHE_SHARING_MASK)
}

/// What KVM's timers offer the guest, beyond what `KVM_GET_SUPPORTED_CPUID`
/// says: both come from other KVM calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Timers {
    /// The guest TSC frequency in kHz (`KVM_GET_TSC_KHZ`) when known,
    /// advertised in leaf 0x40000010.
    pub tsc_khz: Option<u32>,
    /// KVM's LAPIC emulates TSC-deadline mode (`KVM_CAP_TSC_DEADLINE_TIMER`).
    pub tsc_deadline: bool,
}

/// The CPUID table for vCPU `vcpu_id` of `num_vcpus` (pass to `KVM_SET_CPUID2`).
///
/// `supported` is `KVM_GET_SUPPORTED_CPUID`; `timers` what KVM's timers add.
pub(crate) fn configure_cpuid(
    supported: &CpuId,
    vcpu_id: u32,
    num_vcpus: u32,
    timers: Timers,
) -> Result<CpuId, Error> {
    let tsc_khz = timers.tsc_khz;
    if num_vcpus == 0 {
        return Err(Error::NoVcpus);
    }
    if num_vcpus > MAX_VCPUS {
        return Err(Error::TooManyVcpus(num_vcpus));
    }
    if vcpu_id >= num_vcpus {
        return Err(Error::NoSuchVcpu { vcpu_id, num_vcpus });
    }
    let apic_id = vcpu_id;
    let cores = num_vcpus;
    let host = supported.as_slice();
    let vendor = Vendor::of(host);
    let has = |function: u32| host.iter().any(|e| e.function == function);

    let mut out: Vec<kvm_cpuid_entry2> = Vec::with_capacity(host.len() + 8);
    for &entry in host {
        let mut e = entry;
        match e.function {
            LEAF_FEATURES => {
                e.ebx = (e.ebx & EBX_KEEP_MASK) | (apic_id << EBX_APIC_ID_SHIFT);
                e.ecx |= ECX_HYPERVISOR;
                e.ecx &= !(ECX_MONITOR | ECX_VMX | ECX_SMX | ECX_TM2 | ECX_PDCM | ECX_TSC_DEADLINE);
                if timers.tsc_deadline {
                    e.ecx |= ECX_TSC_DEADLINE;
                }
                e.edx &= !(EDX_ACPI_THERMAL | EDX_TM | EDX_HTT);
                // A package of one logical processor says so by leaving HTT
                // clear (as QEMU does): Linux then reports no "ht" flag.
                if cores > 1 {
                    e.ebx |= cores << EBX_LOGICAL_COUNT_SHIFT;
                    e.edx |= EDX_HTT;
                }
            }
            LEAF_CACHE_PARAMS if vendor == Vendor::Intel => {
                e.eax = set_cache_sharing(e.eax, cores);
                if e.eax & CACHE_TYPE_MASK != 0 {
                    let cores_field = (cores - 1).min(CACHE_CORES_MAX);
                    e.eax = (e.eax & !(CACHE_CORES_MAX << CACHE_CORES_SHIFT))
                        | (cores_field << CACHE_CORES_SHIFT);
                }
            }
            // No virtual PMU: architectural perfmon version 0.
            LEAF_PMU => (e.eax, e.ebx, e.ecx, e.edx) = (0, 0, 0, 0),
            // Rebuilt below, whatever subleaves the host listed.
            LEAF_TOPOLOGY | LEAF_TOPOLOGY_V2 => continue,
            LEAF_EXT_FEATURES => e.ecx &= !(AMD_ECX_SVM | AMD_ECX_PERFCTR_CORE),
            LEAF_AMD_SIZES if vendor == Vendor::Amd => {
                e.ecx = (cores - 1) & AMD_NC_MASK | (id_bits(cores) << AMD_APIC_ID_CORE_SIZE_SHIFT);
            }
            LEAF_AMD_CACHE_TOPOLOGY if vendor == Vendor::Amd => {
                e.eax = set_cache_sharing(e.eax, cores);
            }
            LEAF_AMD_EXT_APIC_ID if vendor == Vendor::Amd => {
                // EAX: extended APIC ID; EBX: core (compute unit) ID in bits
                // 7-0, threads per core minus one (0) in bits 15-8; ECX: node 0,
                // one node per package.
                (e.eax, e.ebx, e.ecx, e.edx) = (apic_id, apic_id & 0xff, 0, 0);
            }
            LEAF_HYPERVISOR | LEAF_TIMING => continue,
            _ => {}
        }
        out.push(e);
    }

    out.extend(topology_leaves(LEAF_TOPOLOGY, apic_id, cores));
    if has(LEAF_TOPOLOGY_V2) {
        out.extend(topology_leaves(LEAF_TOPOLOGY_V2, apic_id, cores));
    }

    if !has(LEAF_KVM_FEATURES) {
        // Not KVM-reported: advertise the signature but no PV features.
        out.push(leaf(LEAF_KVM_FEATURES, 0, 0, [0; 4]));
    }
    let max_hv_leaf = if tsc_khz.is_some() {
        LEAF_TIMING
    } else {
        LEAF_KVM_FEATURES
    };
    let [sig_b, sig_c, sig_d] = KVM_SIGNATURE;
    out.push(leaf(
        LEAF_HYPERVISOR,
        0,
        0,
        [max_hv_leaf, sig_b, sig_c, sig_d],
    ));
    if let Some(khz) = tsc_khz {
        out.push(leaf(LEAF_TIMING, 0, 0, [khz, KVM_APIC_BUS_KHZ, 0, 0]));
    }

    CpuId::from_entries(&out).map_err(Error::TooManyEntries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vendor_leaf(vendor: &[u8; 12], max_leaf: u32) -> kvm_cpuid_entry2 {
        let w = |i: usize| u32::from_le_bytes(vendor[i..i + 4].try_into().unwrap());
        leaf(0, 0, 0, [max_leaf, w(0), w(8), w(4)])
    }

    /// What an AMD host's KVM reports (abridged from this machine's KVM).
    fn amd_host() -> CpuId {
        CpuId::from_entries(&[
            vendor_leaf(b"AuthenticAMD", 0x1c),
            leaf(
                1,
                0,
                0,
                [0x00b0_0f21, 0x0102_0800, 0x8120_2000 | ECX_VMX, 0x078b_fbff],
            ),
            leaf(0xa, 0, 0, [0x0860_0000, 0, 0, 0]),
            leaf(0xb, 0, 1, [0, 0, 0, 1]),
            leaf(
                0x8000_0001,
                0,
                0,
                [0, 0, 0x0040_0393 | AMD_ECX_SVM, 0x23d3_fbff],
            ),
            leaf(0x8000_0008, 0, 0, [0x3030, 0x5002_0005, 0x7001, 0]),
            leaf(0x8000_001d, 0, 1, [0x121, 0x02c0_003f, 0x3f, 0]),
            leaf(0x8000_001d, 3, 1, [0x4163, 0x03c0_003f, 0x7fff, 1]),
            leaf(0x8000_001e, 0, 0, [0; 4]),
            leaf(
                0x4000_0000,
                0,
                0,
                [0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d],
            ),
            leaf(0x4000_0001, 0, 0, [0x0100_7efb, 0, 0, 0]),
        ])
        .unwrap()
    }

    /// An Intel host, with leaf 4 caches and leaf 0x1f.
    fn intel_host() -> CpuId {
        CpuId::from_entries(&[
            vendor_leaf(b"GenuineIntel", 0x1f),
            leaf(
                1,
                0,
                0,
                [0x0005_0654, 0x0010_0800, 0x7ffa_3223, 0x0f8b_fbff],
            ),
            // L1d, L2, L3 and the end marker; host says 2 threads share L1/L2.
            leaf(4, 0, 1, [0x1c00_4121, 0, 0, 0]),
            leaf(4, 2, 1, [0x1c00_4143, 0, 0, 0]),
            leaf(4, 3, 1, [0x1c03_c163, 0, 0, 0]),
            leaf(4, 4, 1, [0, 0, 0, 0]),
            leaf(0xb, 0, 1, [1, 2, 0x100, 7]),
            leaf(0xb, 1, 1, [5, 24, 0x201, 7]),
            leaf(0x1f, 0, 1, [1, 2, 0x100, 7]),
            leaf(0x4000_0001, 0, 0, [0x0100_7efb, 0, 0, 0]),
        ])
        .unwrap()
    }

    fn get(c: &CpuId, function: u32, index: u32) -> kvm_cpuid_entry2 {
        *c.as_slice()
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap_or_else(|| panic!("no leaf {function:#x}.{index}"))
    }

    #[test]
    fn apic_ids_are_distinct_and_match_the_vcpu() {
        for host in [amd_host(), intel_host()] {
            let mut ids = Vec::new();
            for id in 0..8 {
                let c = configure_cpuid(&host, id, 8, Timers::default()).unwrap();
                let l1 = get(&c, 1, 0);
                assert_eq!(l1.ebx >> 24, id);
                assert_eq!((l1.ebx >> 16) & 0xff, 8, "logical processors per package");
                assert_eq!(l1.ebx & 0xffff, 0x0800, "CLFLUSH size kept");
                assert_eq!(get(&c, 0xb, 0).edx, id);
                assert_eq!(get(&c, 0xb, 1).edx, id);
                ids.push(l1.ebx >> 24);
            }
            ids.dedup();
            assert_eq!(ids.len(), 8);
        }
    }

    #[test]
    fn hypervisor_bit_and_kvm_signature() {
        let c = configure_cpuid(&intel_host(), 0, 1, Timers::default()).unwrap();
        assert_ne!(get(&c, 1, 0).ecx & (1 << 31), 0);
        let hv = get(&c, 0x4000_0000, 0);
        let sig: Vec<u8> = [hv.ebx, hv.ecx, hv.edx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        assert_eq!(&sig, b"KVMKVMKVM\0\0\0");
        assert_eq!(hv.eax, 0x4000_0001);
        // KVM's paravirt features are passed through.
        assert_eq!(get(&c, 0x4000_0001, 0).eax, 0x0100_7efb);
        // Exactly one signature leaf.
        let n = c
            .as_slice()
            .iter()
            .filter(|e| e.function == 0x4000_0000)
            .count();
        assert_eq!(n, 1);
    }

    #[test]
    fn tsc_frequency_leaf_when_known() {
        let c = configure_cpuid(
            &amd_host(),
            0,
            2,
            Timers {
                tsc_khz: Some(2_250_000),
                tsc_deadline: false,
            },
        )
        .unwrap();
        assert_eq!(get(&c, 0x4000_0000, 0).eax, 0x4000_0010);
        let t = get(&c, 0x4000_0010, 0);
        assert_eq!((t.eax, t.ebx), (2_250_000, 1_000_000));
        let c = configure_cpuid(&amd_host(), 0, 2, Timers::default()).unwrap();
        assert!(!c.as_slice().iter().any(|e| e.function == 0x4000_0010));
    }

    #[test]
    fn topology_leaves_describe_one_thread_per_core() {
        let c = configure_cpuid(&intel_host(), 3, 6, Timers::default()).unwrap();
        for function in [0xb, 0x1f] {
            let smt = get(&c, function, 0);
            assert_eq!((smt.eax, smt.ebx, smt.ecx >> 8 & 0xff), (0, 1, 1));
            let core = get(&c, function, 1);
            assert_eq!((core.eax, core.ebx, core.ecx >> 8 & 0xff), (3, 6, 2));
            assert_eq!(core.ecx & 0xff, 1, "subleaf number echoed in ECX");
            assert_eq!(get(&c, function, 2).ecx >> 8 & 0xff, 0, "end of levels");
            assert_ne!(smt.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX, 0);
        }
        // Intel leaf 4: 6 cores per package, L1/L2 private, L3 shared by 6.
        let l1 = get(&c, 4, 0);
        assert_eq!((l1.eax >> 26, l1.eax >> 14 & 0xfff), (5, 0));
        assert_eq!(l1.eax & 0x3fff, 0x121, "cache type/level kept");
        let l3 = get(&c, 4, 3);
        assert_eq!((l3.eax >> 26, l3.eax >> 14 & 0xfff), (5, 5));
        assert_eq!(get(&c, 4, 4).eax, 0, "end marker untouched");
    }

    #[test]
    fn amd_core_count_and_cache_sharing() {
        let c = configure_cpuid(&amd_host(), 2, 4, Timers::default()).unwrap();
        let sizes = get(&c, 0x8000_0008, 0);
        assert_eq!(sizes.ecx & 0xff, 3, "NC = cores - 1");
        assert_eq!(sizes.ecx >> 12 & 0xf, 2, "2 APIC ID bits for 4 cores");
        assert_eq!(get(&c, 0x8000_001d, 0).eax >> 14 & 0xfff, 0);
        assert_eq!(get(&c, 0x8000_001d, 3).eax >> 14 & 0xfff, 3);
        let ext = get(&c, 0x8000_001e, 0);
        assert_eq!((ext.eax, ext.ebx & 0xff, ext.ebx >> 8 & 0xff), (2, 2, 0));
        // The AMD-only rewrites are not applied to Intel.
        let c = configure_cpuid(&intel_host(), 0, 4, Timers::default()).unwrap();
        assert!(!c.as_slice().iter().any(|e| e.function == 0x8000_0008));
    }

    #[test]
    fn hardware_we_lack_is_not_advertised() {
        let c = configure_cpuid(&amd_host(), 0, 1, Timers::default()).unwrap();
        assert_eq!(get(&c, 1, 0).ecx & ECX_VMX, 0);
        assert_eq!(get(&c, 0x8000_0001, 0).ecx & AMD_ECX_SVM, 0);
        assert_eq!(get(&c, 0xa, 0).eax, 0, "no PMU");
        let c = configure_cpuid(&intel_host(), 0, 1, Timers::default()).unwrap();
        let l1 = get(&c, 1, 0);
        assert_eq!(l1.ecx & (ECX_MONITOR | ECX_PDCM | ECX_TM2), 0);
        assert_eq!(l1.edx & (EDX_TM | EDX_ACPI_THERMAL), 0);
    }

    #[test]
    fn one_vcpu_is_no_hyperthreaded_package() {
        // The Intel host says 16 logical processors per package.
        let one = get(
            &configure_cpuid(&intel_host(), 0, 1, Timers::default()).unwrap(),
            1,
            0,
        );
        assert_eq!(one.edx & EDX_HTT, 0);
        assert_eq!((one.ebx >> 16) & 0xff, 0);
        let two = get(
            &configure_cpuid(&intel_host(), 1, 2, Timers::default()).unwrap(),
            1,
            0,
        );
        assert_ne!(two.edx & EDX_HTT, 0);
        assert_eq!((two.ebx >> 16) & 0xff, 2);
    }

    #[test]
    fn tsc_deadline_timer_follows_kvm_not_the_host_cpu() {
        // Hosts report the bit (the Intel one) or not (the AMD one): only
        // KVM's LAPIC decides.
        for host in [amd_host(), intel_host()] {
            let with = Timers {
                tsc_deadline: true,
                ..Timers::default()
            };
            let c = configure_cpuid(&host, 0, 1, with).unwrap();
            assert_ne!(get(&c, 1, 0).ecx & ECX_TSC_DEADLINE, 0);
            let c = configure_cpuid(&host, 0, 1, Timers::default()).unwrap();
            assert_eq!(get(&c, 1, 0).ecx & ECX_TSC_DEADLINE, 0);
        }
    }

    #[test]
    fn bad_vcpu_numbers_are_errors() {
        let host = amd_host();
        assert!(matches!(
            configure_cpuid(&host, 0, 0, Timers::default()),
            Err(Error::NoVcpus)
        ));
        assert!(matches!(
            configure_cpuid(&host, 4, 4, Timers::default()),
            Err(Error::NoSuchVcpu {
                vcpu_id: 4,
                num_vcpus: 4
            })
        ));
        let err = configure_cpuid(&host, 0, 255, Timers::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "255 vCPUs requested, at most 254 are supported"
        );
    }

    #[test]
    fn id_bits_rounds_up() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9].map(id_bits), [0, 1, 2, 2, 3, 3, 4]);
    }
}
