//! The Intel MultiProcessor Specification 1.4 table: how a kernel without
//! ACPI (such as a minimal `tinyconfig` kernel) learns about the vCPUs, the
//! I/O APIC and how interrupt lines reach it.
//!
//! Layout, from the start of the EBDA (`EBDA_START`, which is also "the last
//! KiB of base memory" at 639 KiB — one of the places Linux scans for `_MP_`):
//!
//! ```text
//! EBDA_START       MP floating pointer  (16 bytes, "_MP_")
//! EBDA_START + 16  MP configuration table header (44 bytes, "PCMP")
//!                  processor entries    (20 bytes each, one per vCPU)
//!                  bus entry            (8 bytes: ISA)
//!                  I/O APIC entry       (8 bytes)
//!                  I/O interrupt entries (8 bytes each, one per I/O APIC pin)
//!                  local interrupt entries (8 bytes each: ExtINT, NMI)
//! ```
//!
//! Up to 37 vCPUs this fits in the EBDA's first KiB. Beyond that the table
//! grows into the legacy VGA/ROM hole above it: guest RAM in this VM, marked
//! reserved in the e820 map like the EBDA, and unused up to the ACPI tables.
//! Only the floating pointer has to be where Linux scans; the table can be
//! anywhere it points.
//!
//! Interrupt routing is the identity: ISA IRQ *n* → I/O APIC pin *n* for
//! every pin. That is how KVM's in-kernel irqchip routes GSIs by default
//! (`KVM_CREATE_IRQCHIP`: GSI *n* → PIC *n* and I/O APIC pin *n*), so the
//! PIT's GSI 0 reaches pin 0 and the virtio-mmio GSIs from `VIRTIO_IRQ_BASE`
//! reach their own pins. PC chipsets and QEMU instead wire IRQ0 to pin 2 with
//! the 8259 as ExtINT on pin 0; describing that here would be a lie unless
//! the VMM also reprogrammed KVM's routing, and Linux would then lose ~100 ms
//! in `check_timer()` discovering the timer on a different pin. The 8259's
//! ExtINT output goes to LINT0 of every local APIC (virtual-wire mode) and NMI
//! to LINT1, as on real boards.
//!
//! Entries use "conforms to bus" polarity and trigger: on ISA that is
//! active-high, edge-triggered — what irqfd-driven virtio-mmio interrupts are.

use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{APIC_START, EBDA_START, IOAPIC_PINS, IOAPIC_START, RSDP_START};

/// Floating pointer signature.
const MPF_SIGNATURE: &[u8; 4] = b"_MP_";
/// Configuration table signature.
const MPC_SIGNATURE: &[u8; 4] = b"PCMP";
/// MP spec revision 1.4.
const MP_SPEC_REV_1_4: u8 = 4;
/// The floating pointer is one 16-byte paragraph long.
const MPF_LENGTH_PARAGRAPHS: u8 = 1;
const MPF_SIZE: usize = 16;
const MPC_HEADER_SIZE: usize = 44;
const PROCESSOR_ENTRY_SIZE: usize = 20;
const SMALL_ENTRY_SIZE: usize = 8;
/// The two local interrupt entries (ExtINT on LINT0, NMI on LINT1).
const LOCAL_INTERRUPT_ENTRIES: usize = 2;

/// OEM ID, 8 bytes space-padded.
const OEM_ID: &[u8; 8] = b"EMBER   ";
/// Product ID, 12 bytes space-padded.
const PRODUCT_ID: &[u8; 12] = b"MICROVM     ";

// Entry types.
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;

/// Local APIC version: 0x14, what KVM's emulated integrated APIC reports.
const LAPIC_VERSION: u8 = 0x14;
/// I/O APIC version: 0x11, what KVM's in-kernel I/O APIC reports.
const IOAPIC_VERSION: u8 = 0x11;
/// Processor flag EN: usable.
const CPU_ENABLED: u8 = 1 << 0;
/// Processor flag BP: the bootstrap processor.
const CPU_BOOTSTRAP: u8 = 1 << 1;
/// CPU signature (family 6, model 0, stepping 0): informational only; Linux
/// takes the real one from CPUID.
const CPU_SIGNATURE: u32 = 6 << 8;
/// Feature flags from CPUID.1:EDX: FPU (bit 0) and on-chip APIC (bit 9).
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);
/// I/O APIC flag EN: usable.
const IOAPIC_ENABLED: u8 = 1 << 0;
/// The one bus, ISA, has ID 0.
const ISA_BUS_ID: u8 = 0;
/// Bus type string, 6 bytes space-padded.
const ISA_BUS_TYPE: &[u8; 6] = b"ISA   ";

// Interrupt types, for I/O and local interrupt entries.
/// A vectored interrupt, programmed in the I/O APIC redirection entry.
const INT_TYPE_INT: u8 = 0;
/// Non-maskable interrupt.
const INT_TYPE_NMI: u8 = 1;
/// External interrupt: the vector comes from the 8259 PIC.
const INT_TYPE_EXTINT: u8 = 3;
/// Polarity and trigger "conform to the bus" (edge, active high on ISA).
const INT_FLAGS_CONFORMING: u16 = 0;
/// Local interrupt destination 0xff: every local APIC.
const ALL_LOCAL_APICS: u8 = 0xff;
/// LINT0 and LINT1 inputs of a local APIC.
const LINT0: u8 = 0;
const LINT1: u8 = 1;

/// Room for the MP structures: the reserved low memory from the EBDA up to
/// the ACPI tables.
pub(crate) const MPTABLE_MAX_SIZE: usize = (RSDP_START - EBDA_START) as usize;
/// APIC IDs are 8 bits, 0xff is the broadcast ID, and the I/O APIC takes
/// the ID after the last vCPU: at most 254 vCPUs.
const MAX_APIC_CPUS: u32 = super::cpuid::MAX_VCPUS;

/// Errors while writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A VM needs at least one vCPU.
    #[error("the VM has no vCPUs")]
    NoCpus,
    /// More vCPUs than APIC IDs (or the reserved low memory) allow.
    #[error("the MP table cannot describe {0} vCPUs (at most {max})", max = max_cpus())]
    TooManyCpus(u32),
    /// Guest memory does not cover the EBDA.
    #[error("cannot write the MP table to guest memory")]
    Write(#[source] GuestMemoryError),
}

/// Bytes the MP structures take for `num_cpus` vCPUs.
fn table_size(num_cpus: usize) -> usize {
    MPF_SIZE
        + MPC_HEADER_SIZE
        + PROCESSOR_ENTRY_SIZE * num_cpus
        + SMALL_ENTRY_SIZE * (2 + IOAPIC_PINS as usize + LOCAL_INTERRUPT_ENTRIES)
}

/// The most vCPUs an MP table can describe here.
pub(crate) fn max_cpus() -> u32 {
    let fits = (MPTABLE_MAX_SIZE - table_size(0)) / PROCESSOR_ENTRY_SIZE;
    MAX_APIC_CPUS.min(u32::try_from(fits).unwrap_or(u32::MAX))
}

/// The value that makes `bytes` sum to zero (mod 256), as every MP structure requires.
fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

/// Appends an I/O or local interrupt entry (same 8-byte shape).
fn interrupt_entry(t: &mut Vec<u8>, entry: u8, int_type: u8, src_irq: u8, dst_id: u8, dst_pin: u8) {
    t.push(entry);
    t.push(int_type);
    t.extend_from_slice(&INT_FLAGS_CONFORMING.to_le_bytes());
    t.push(ISA_BUS_ID);
    t.push(src_irq);
    t.push(dst_id);
    t.push(dst_pin);
}

/// The configuration table (header and entries), checksummed.
fn config_table(num_cpus: u8) -> Vec<u8> {
    let ioapic_id = num_cpus; // the first APIC ID after the vCPUs'
    let mut entries = Vec::new();
    let mut count: u16 = 0;

    for cpu in 0..num_cpus {
        entries.push(ENTRY_PROCESSOR);
        entries.push(cpu); // local APIC ID = vCPU index, as in CPUID
        entries.push(LAPIC_VERSION);
        let bsp = if cpu == 0 { CPU_BOOTSTRAP } else { 0 };
        entries.push(CPU_ENABLED | bsp);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]); // reserved
        count += 1;
    }

    entries.push(ENTRY_BUS);
    entries.push(ISA_BUS_ID);
    entries.extend_from_slice(ISA_BUS_TYPE);
    count += 1;

    entries.push(ENTRY_IOAPIC);
    entries.push(ioapic_id);
    entries.push(IOAPIC_VERSION);
    entries.push(IOAPIC_ENABLED);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;

    for pin in 0..IOAPIC_PINS as u8 {
        interrupt_entry(
            &mut entries,
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            pin,
            ioapic_id,
            pin,
        );
        count += 1;
    }

    // Virtual-wire mode: the 8259 on LINT0, NMI on LINT1, for every CPU.
    interrupt_entry(
        &mut entries,
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_EXTINT,
        0,
        ALL_LOCAL_APICS,
        LINT0,
    );
    interrupt_entry(
        &mut entries,
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_NMI,
        0,
        ALL_LOCAL_APICS,
        LINT1,
    );
    count += LOCAL_INTERRUPT_ENTRIES as u16;

    let length = (MPC_HEADER_SIZE + entries.len()) as u16;
    let mut t = Vec::with_capacity(usize::from(length));
    t.extend_from_slice(MPC_SIGNATURE);
    t.extend_from_slice(&length.to_le_bytes()); // base table length
    t.push(MP_SPEC_REV_1_4);
    t.push(0); // checksum, filled below
    t.extend_from_slice(OEM_ID);
    t.extend_from_slice(PRODUCT_ID);
    t.extend_from_slice(&0u32.to_le_bytes()); // no OEM table
    t.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    t.extend_from_slice(&count.to_le_bytes()); // entry count
    t.extend_from_slice(&(APIC_START as u32).to_le_bytes()); // local APIC address
    t.extend_from_slice(&0u16.to_le_bytes()); // no extended table
    t.push(0); // extended table checksum
    t.push(0); // reserved
    debug_assert_eq!(t.len(), MPC_HEADER_SIZE);
    t.extend_from_slice(&entries);
    t[7] = checksum(&t);
    t
}

/// The floating pointer structure pointing at the table at `config_addr`.
fn floating_pointer(config_addr: u32) -> [u8; MPF_SIZE] {
    let mut f = [0u8; MPF_SIZE];
    f[0..4].copy_from_slice(MPF_SIGNATURE);
    f[4..8].copy_from_slice(&config_addr.to_le_bytes());
    f[8] = MPF_LENGTH_PARAGRAPHS;
    f[9] = MP_SPEC_REV_1_4;
    // f[10]: checksum. Feature byte 1 (f[11]) = 0: a configuration table is
    // present (no default configuration). Feature byte 2 (f[12]) bit 7
    // (IMCRP) = 0: no IMCR, the PIC is in virtual-wire mode.
    f[10] = checksum(&f);
    f
}

/// Writes the MP floating pointer and configuration table at `EBDA_START`.
pub(crate) fn setup_mptable(mem: &GuestMemoryMmap, num_cpus: u32) -> Result<(), Error> {
    if num_cpus == 0 {
        return Err(Error::NoCpus);
    }
    if num_cpus > max_cpus() {
        return Err(Error::TooManyCpus(num_cpus));
    }
    let config_addr = EBDA_START + MPF_SIZE as u64;
    let table = config_table(num_cpus as u8);
    debug_assert_eq!(MPF_SIZE + table.len(), table_size(num_cpus as usize));
    mem.write_slice(
        &floating_pointer(config_addr as u32),
        GuestAddress(EBDA_START),
    )
    .map_err(Error::Write)?;
    mem.write_slice(&table, GuestAddress(config_addr))
        .map_err(Error::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn read(m: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        m.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    /// Parses the table as a kernel would; returns the entries by type.
    fn parse(m: &GuestMemoryMmap) -> Vec<Vec<u8>> {
        let mpf = read(m, EBDA_START, 16);
        assert_eq!(&mpf[0..4], b"_MP_");
        assert_eq!(sum(&mpf), 0, "floating pointer checksum");
        assert_eq!((mpf[8], mpf[9]), (1, 4));
        let cfg = u64::from(u32::from_le_bytes(mpf[4..8].try_into().unwrap()));
        let hdr = read(m, cfg, 44);
        assert_eq!(&hdr[0..4], b"PCMP");
        let len = usize::from(u16::from_le_bytes([hdr[4], hdr[5]]));
        let count = usize::from(u16::from_le_bytes([hdr[34], hdr[35]]));
        assert_eq!(
            u32::from_le_bytes(hdr[36..40].try_into().unwrap()),
            0xfee0_0000
        );
        let table = read(m, cfg, len);
        assert_eq!(sum(&table), 0, "configuration table checksum");
        assert!(cfg + len as u64 <= RSDP_START, "clear of the ACPI tables");
        let mut entries = Vec::new();
        let mut off = 44;
        while off < len {
            let size = if table[off] == 0 { 20 } else { 8 };
            entries.push(table[off..off + size].to_vec());
            off += size;
        }
        assert_eq!(off, len);
        assert_eq!(entries.len(), count);
        entries
    }

    #[test]
    fn tables_for_1_to_254_cpus() {
        for cpus in [1u32, 2, 8, 38, 254] {
            let m = mem();
            setup_mptable(&m, cpus).unwrap();
            let entries = parse(&m);
            let of = |t: u8| entries.iter().filter(|e| e[0] == t).collect::<Vec<_>>();
            let procs = of(0);
            assert_eq!(procs.len(), cpus as usize);
            for (i, p) in procs.iter().enumerate() {
                assert_eq!(p[1], i as u8, "APIC id");
                assert_eq!(p[3] & 1, 1, "enabled");
                assert_eq!(p[3] & 2 != 0, i == 0, "only the BSP is flagged BP");
            }
            assert_eq!(of(1).len(), 1);
            assert_eq!(&of(1)[0][2..8], b"ISA   ");
            let ioapic = of(2);
            assert_eq!(ioapic.len(), 1);
            assert_eq!(ioapic[0][1], cpus as u8, "I/O APIC id follows the CPUs");
            assert_eq!(
                u32::from_le_bytes(ioapic[0][4..8].try_into().unwrap()),
                0xfec0_0000
            );
            let io = of(3);
            assert_eq!(io.len(), IOAPIC_PINS as usize);
            for (pin, e) in io.iter().enumerate() {
                // INT, ISA bus, IRQ n → this I/O APIC's pin n.
                assert_eq!(
                    (e[1], e[4], e[5], e[6], e[7]),
                    (0, 0, pin as u8, cpus as u8, pin as u8)
                );
            }
            let local = of(4);
            assert_eq!(local.len(), 2);
            assert_eq!(
                (local[0][1], local[0][6], local[0][7]),
                (3, 0xff, 0),
                "ExtINT on LINT0"
            );
            assert_eq!(
                (local[1][1], local[1][6], local[1][7]),
                (1, 0xff, 1),
                "NMI on LINT1"
            );
        }
    }

    #[test]
    fn small_tables_stay_in_the_ebdas_first_kib() {
        let m = mem();
        setup_mptable(&m, 37).unwrap();
        let len = m
            .read_obj::<u16>(GuestAddress(EBDA_START + 16 + 4))
            .unwrap();
        assert!(EBDA_START + 16 + u64::from(len) <= EBDA_START + 0x400);
    }

    #[test]
    fn too_many_cpus_is_an_error() {
        let m = mem();
        let max = max_cpus();
        assert_eq!(max, 254, "limited by 8-bit APIC IDs, not by space");
        setup_mptable(&m, max).unwrap();
        parse(&m);
        let err = setup_mptable(&m, max + 1).unwrap_err();
        assert!(matches!(err, Error::TooManyCpus(n) if n == max + 1));
        assert_eq!(
            err.to_string(),
            "the MP table cannot describe 255 vCPUs (at most 254)"
        );
        assert!(matches!(setup_mptable(&m, 0), Err(Error::NoCpus)));
    }

    #[test]
    fn memory_without_an_ebda_is_an_error() {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x9000)]).unwrap();
        assert!(matches!(setup_mptable(&m, 1), Err(Error::Write(_))));
    }
}
