//! ACPI tables: how a modern kernel learns about the vCPUs, the interrupt
//! controllers, the devices and how to power off.
//!
//! The machine is "hardware-reduced" ACPI (ACPI 6, §4.1): no PM timer, no
//! fixed-feature registers, no GPEs, no SCI, no 8259 or PIT from the ACPI
//! point of view. Linux then skips all legacy-PC probing that would cost
//! exits (PIC, PIT calibration, PM timer, CMOS RTC, VGA, i8042) and powers
//! off through the two sleep registers the FADT names.
//!
//! Layout in guest memory (all below 1 MiB, in the BIOS area Linux scans):
//!
//! ```text
//! RSDP_START          RSDP (v2, 36 bytes) ─→ XSDT
//! ACPI_TABLES_START   XSDT ─→ FADT, MADT
//!                     FADT ─→ DSDT
//!                     MADT (local APICs, I/O APIC, LINT1 NMI)
//!                     DSDT (AML: virtio-mmio devices, COM1, the VM
//!                     generation ID and its Generic Event Device, \_S5_)
//! VMGENID_START       the VM generation ID (16 bytes; `devices::vmgenid`)
//! ```
//!
//! Interrupts are identity-mapped (ISA IRQ *n* = GSI *n* = I/O APIC pin
//! *n*), as KVM's in-kernel irqchip routes them by default and as the MP
//! table says; so the MADT carries no interrupt source overrides. (A PC's
//! IRQ0→GSI2 override would only matter for the PIT, which hardware-reduced
//! ACPI already tells Linux not to use.)

use acpi_tables::aml::{
    self, Arg, Device, EISAName, Equal, IO, If, Interrupt, Memory32Fixed, Method, Name, Notify,
    Package, Path, ResourceTemplate, Return, Scope,
};
use acpi_tables::fadt::{FADT, FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{Aml, AmlSink};
use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{
    ACPI_SLEEP_CONTROL_PORT, ACPI_SLEEP_STATUS_PORT, ACPI_TABLES_START, APIC_START, COM1_IRQ,
    COM1_PORT, COM1_PORT_LEN, GED_GSI, IOAPIC_PINS, IOAPIC_START, RSDP_START,
    VIRTIO_MMIO_MAX_DEVICES, VMGENID_START,
};

/// OEM ID in every table header (6 bytes).
const OEM_ID: [u8; 6] = *b"EMBER ";
/// OEM table ID (8 bytes); the signature already tells tables apart.
const OEM_TABLE_ID: [u8; 8] = *b"EMBERVM ";
/// OEM revision.
const OEM_REVISION: u32 = 1;
/// FADT "hypervisor vendor identity" (ACPI 6.0+), informational.
const HYPERVISOR_VENDOR: u64 = u64::from_le_bytes(*b"EMBERVMM");

/// Tables start 8-byte aligned, so 64-bit fields inside them are aligned too.
const TABLE_ALIGN: u64 = 8;
/// Header length of every system description table.
const SDT_HEADER_LEN: u32 = 36;
/// MADT revision 5 (ACPI 6.3+).
const MADT_REVISION: u8 = 5;
/// DSDT revision 2: AML integers are 64-bit.
const DSDT_REVISION: u8 = 2;

// FADT IAPC_BOOT_ARCH flags (offset 109): what legacy hardware exists.
/// Bit 2: VGA not present — Linux must not poke the VGA ranges.
const BOOT_ARCH_NO_VGA: u16 = 1 << 2;
/// Bit 5: no CMOS RTC — Linux skips the RTC (kvmclock gives wall time).
const BOOT_ARCH_NO_CMOS_RTC: u16 = 1 << 5;
// Bit 1 (8042) stays clear: Linux then skips probing a keyboard controller.

// MADT structures (ACPI 6, §5.2.12).
/// Processor Local APIC structure: type 0, 8 bytes.
const MADT_LOCAL_APIC: [u8; 2] = [0, 8];
/// I/O APIC structure: type 1, 12 bytes.
const MADT_IO_APIC: [u8; 2] = [1, 12];
/// Local APIC NMI structure: type 4, 6 bytes.
const MADT_LOCAL_APIC_NMI: [u8; 2] = [4, 6];
/// Local APIC flag: enabled (the vCPU exists and is usable now).
const LAPIC_ENABLED: u32 = 1 << 0;
/// Processor UID 0xff in a Local APIC NMI structure: all processors.
const ALL_PROCESSORS: u8 = 0xff;
/// MPS INTI flags: active high (bits 1-0 = 01), edge triggered (bits 3-2 = 01).
const INTI_ACTIVE_HIGH_EDGE: u16 = 0b0101;
/// NMI is wired to LINT1 of every local APIC, as on PC boards.
const NMI_LINT: u8 = 1;
/// The I/O APIC's pins start at GSI 0.
const IOAPIC_GSI_BASE: u32 = 0;

/// Hardware-reduced sleep: SLP_TYP for S5 (soft off). Linux writes
/// `SLP_EN | SLP_TYP << 2` = 0x34 to the sleep control register to power off.
pub(crate) const S5_SLEEP_TYPE: u8 = 5;
/// The ACPI ID Linux's virtio-mmio driver binds to.
pub(crate) const VIRTIO_MMIO_HID: &str = "LNRO0005";
/// 16550-compatible UART.
const COM_HID: &str = "PNP0501";
/// The IDs Linux's vmgenid driver binds to (`drivers/virt/vmgenid.c`).
pub(crate) const VMGENID_HID: &str = "VMGENCTR";
/// The compatible ID of Microsoft's VM generation ID specification.
pub(crate) const VMGENID_CID: &str = "VM_GEN_COUNTER";
/// ACPI Generic Event Device (ACPI 6, §5.6.9).
pub(crate) const GED_HID: &str = "ACPI0013";
/// The notification a vmgenid driver expects when the ID changes
/// (device-specific notify values start at 0x80).
pub(crate) const VMGENID_NOTIFY: u8 = 0x80;

/// Highest vCPU count the MADT can describe with 8-bit APIC IDs (0xff is
/// broadcast, and the I/O APIC takes the ID after the last vCPU).
pub(crate) const MAX_CPUS: u32 = super::cpuid::MAX_VCPUS;

/// One virtio-mmio device to describe in the DSDT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct VirtioMmioAcpi {
    /// Guest-physical base of the device's register window.
    pub base: u64,
    /// Window length.
    pub len: u64,
    /// The GSI (I/O APIC pin) the device interrupts on.
    pub gsi: u32,
}

/// Errors while writing ACPI tables.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A VM needs at least one vCPU.
    #[error("the VM has no vCPUs")]
    NoCpus,
    /// More vCPUs than 8-bit APIC IDs allow.
    #[error("{0} vCPUs requested, the MADT describes at most {MAX_CPUS}")]
    TooManyCpus(u32),
    /// More virtio-mmio devices than the layout provides.
    #[error("{0} virtio-mmio devices, at most {VIRTIO_MMIO_MAX_DEVICES} are supported")]
    TooManyDevices(usize),
    /// A virtio window a 32-bit memory descriptor cannot express.
    #[error("virtio-mmio window {base:#x}+{len:#x} is not below 4 GiB")]
    WindowAbove4G {
        /// Window base.
        base: u64,
        /// Window length.
        len: u64,
    },
    /// A GSI the I/O APIC does not have.
    #[error("GSI {0} is beyond the I/O APIC's {IOAPIC_PINS} pins")]
    NoSuchGsi(u32),
    /// The tables overflow the BIOS area (up to the VM generation ID).
    #[error("ACPI tables end at {0:#x}, past the BIOS area left for them")]
    TablesTooLarge(u64),
    /// Guest memory does not cover the BIOS area.
    #[error("cannot write the ACPI tables to guest memory")]
    Write(#[source] GuestMemoryError),
}

/// Already-serialized AML, to nest inside other AML objects.
struct RawAml(Vec<u8>);

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(&self.0);
    }
}

fn aml_bytes(object: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    object.to_aml_bytes(&mut bytes);
    bytes
}

/// `Device (VRnn)` for virtio-mmio device `n`: the window and its interrupt.
fn virtio_device(n: usize, dev: &VirtioMmioAcpi) -> Result<Vec<u8>, Error> {
    let window_err = || Error::WindowAbove4G {
        base: dev.base,
        len: dev.len,
    };
    let base = u32::try_from(dev.base).map_err(|_| window_err())?;
    let len = u32::try_from(dev.len).map_err(|_| window_err())?;
    base.checked_add(len).ok_or_else(window_err)?;
    if dev.gsi >= IOAPIC_PINS {
        return Err(Error::NoSuchGsi(dev.gsi));
    }
    let uid = n as u32;
    let window = Memory32Fixed::new(true, base, len);
    // Interrupt(consumer, edge, active-high, exclusive): irqfd edges.
    let irq = Interrupt::new(true, true, false, false, dev.gsi);
    let crs = ResourceTemplate::new(vec![&window, &irq]);
    let name = format!("VR{n:02X}");
    Ok(aml_bytes(&Device::new(
        Path::new(&name),
        vec![
            &Name::new("_HID".into(), &VIRTIO_MMIO_HID),
            &Name::new("_UID".into(), &uid),
            &Name::new("_CRS".into(), &crs),
        ],
    )))
}

/// `Device (COM1)`: the legacy UART at 0x3f8, IRQ 4, so Linux's 8250 driver
/// binds through ACPI and does not probe the other legacy ports.
fn com1_device() -> Vec<u8> {
    let port_len = COM1_PORT_LEN as u8;
    // One fixed 8-port range (alignment 0: min == max).
    let ports = IO::new(COM1_PORT, COM1_PORT, 0, port_len);
    let irq = Interrupt::new(true, true, false, false, COM1_IRQ);
    let crs = ResourceTemplate::new(vec![&ports, &irq]);
    aml_bytes(&Device::new(
        "COM1".into(),
        vec![
            &Name::new("_HID".into(), &EISAName::new(COM_HID)),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new("_CRS".into(), &crs),
        ],
    ))
}

/// `Device (VGEN)`: the VM generation ID. `ADDR` returns the GUID's
/// guest-physical address as a package of its low and high 32 bits, as the
/// specification (and Linux's driver) want.
fn vmgenid_device() -> Vec<u8> {
    let low = (VMGENID_START & 0xffff_ffff) as u32;
    let high = (VMGENID_START >> 32) as u32;
    let addr = Package::new(vec![&low, &high]);
    let ret = Return::new(&addr);
    aml_bytes(&Device::new(
        "VGEN".into(),
        vec![
            &Name::new("_HID".into(), &VMGENID_HID),
            &Name::new("_CID".into(), &VMGENID_CID),
            &Name::new("_DDN".into(), &"VM_Gen_Counter"),
            &Method::new("ADDR".into(), 0, false, vec![&ret]),
        ],
    ))
}

/// `Device (GED0)`: the Generic Event Device, the hardware-reduced way to
/// raise an ACPI event: Linux's GED driver runs `_EVT(GSI)` when the
/// interrupt fires, and `_EVT` notifies `VGEN` (the only event today).
fn ged_device() -> Vec<u8> {
    // Edge, like every ember interrupt: the restore raises it once.
    let irq = Interrupt::new(true, true, false, false, GED_GSI);
    let crs = ResourceTemplate::new(vec![&irq]);
    let vgen = Path::new("\\_SB_.VGEN");
    let notify = Notify::new(&vgen, &VMGENID_NOTIFY);
    let is_vmgenid = Equal::new(&Arg(0), &GED_GSI);
    let on_vmgenid = If::new(&is_vmgenid, vec![&notify]);
    aml_bytes(&Device::new(
        "GED0".into(),
        vec![
            &Name::new("_HID".into(), &GED_HID),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new("_CRS".into(), &crs),
            &Method::new("_EVT".into(), 1, true, vec![&on_vmgenid]),
        ],
    ))
}

/// The DSDT's AML body: devices in `\_SB_`, and `\_S5_` for poweroff.
fn dsdt_body(virtio: &[VirtioMmioAcpi]) -> Result<Vec<u8>, Error> {
    let mut devices = vec![
        RawAml(com1_device()),
        RawAml(vmgenid_device()),
        RawAml(ged_device()),
    ];
    for (n, dev) in virtio.iter().enumerate() {
        devices.push(RawAml(virtio_device(n, dev)?));
    }
    let children: Vec<&dyn Aml> = devices.iter().map(|d| d as &dyn Aml).collect();
    let mut body = aml_bytes(&Scope::new("\\_SB_".into(), children));
    // \_S5_: {SLP_TYPa, SLP_TYPb}; only SLP_TYPa is used with the
    // hardware-reduced sleep control register.
    Name::new(
        "\\_S5_".into(),
        &Package::new(vec![&S5_SLEEP_TYPE, &aml::ZERO]),
    )
    .to_aml_bytes(&mut body);
    Ok(body)
}

fn sdt(signature: [u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let mut table = Sdt::new(
        signature,
        SDT_HEADER_LEN,
        revision,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    table.append_slice(body);
    table.as_slice().to_vec()
}

/// The MADT: one local APIC per vCPU, the I/O APIC, NMI on LINT1.
fn madt(num_cpus: u32) -> Vec<u8> {
    let mut body = Vec::new();
    // Local interrupt controller address, then flags = 0: no PCAT_COMPAT,
    // there is no 8259 for the OS to mask.
    body.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    for cpu in 0..num_cpus as u8 {
        body.extend_from_slice(&MADT_LOCAL_APIC);
        body.push(cpu); // ACPI processor UID
        body.push(cpu); // APIC ID, as in CPUID and the MP table
        body.extend_from_slice(&LAPIC_ENABLED.to_le_bytes());
    }
    body.extend_from_slice(&MADT_IO_APIC);
    body.push(num_cpus as u8); // I/O APIC ID
    body.push(0); // reserved
    body.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    body.extend_from_slice(&IOAPIC_GSI_BASE.to_le_bytes());
    body.extend_from_slice(&MADT_LOCAL_APIC_NMI);
    body.push(ALL_PROCESSORS);
    body.extend_from_slice(&INTI_ACTIVE_HIGH_EDGE.to_le_bytes());
    body.push(NMI_LINT);
    sdt(*b"APIC", MADT_REVISION, &body)
}

/// An 8-bit I/O-port register, as the FADT's sleep registers are.
fn io_port_register(port: u16) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(port),
    )
}

/// The FADT: hardware-reduced, pointing at the DSDT, with the sleep registers.
fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi);
    fadt.iapc_boot_arch = (BOOT_ARCH_NO_VGA | BOOT_ARCH_NO_CMOS_RTC).into();
    fadt.sleep_control_reg = io_port_register(ACPI_SLEEP_CONTROL_PORT);
    fadt.sleep_status_reg = io_port_register(ACPI_SLEEP_STATUS_PORT);
    fadt.hypervisor_vendor_identity = HYPERVISOR_VENDOR.into();
    aml_bytes(&fadt.finalize())
}

/// Writes the RSDP at `RSDP_START` and the XSDT, FADT, MADT and DSDT from
/// `ACPI_TABLES_START`; returns the RSDP address (for the zero page's
/// `acpi_rsdp_addr` or PVH's `rsdp_paddr`).
pub(crate) fn setup_acpi(
    mem: &GuestMemoryMmap,
    num_cpus: u32,
    virtio: &[VirtioMmioAcpi],
) -> Result<u64, Error> {
    if num_cpus == 0 {
        return Err(Error::NoCpus);
    }
    if num_cpus > MAX_CPUS {
        return Err(Error::TooManyCpus(num_cpus));
    }
    if virtio.len() > VIRTIO_MMIO_MAX_DEVICES {
        return Err(Error::TooManyDevices(virtio.len()));
    }

    // Tables that point nowhere first, so their sizes fix everyone's address.
    let dsdt = sdt(*b"DSDT", DSDT_REVISION, &dsdt_body(virtio)?);
    let madt = madt(num_cpus);
    const XSDT_ENTRIES: u64 = 2;

    let align = |addr: u64| addr.next_multiple_of(TABLE_ALIGN);
    let xsdt_addr = ACPI_TABLES_START;
    let fadt_addr = align(xsdt_addr + u64::from(SDT_HEADER_LEN) + 8 * XSDT_ENTRIES);
    let madt_addr = align(fadt_addr + FADT::len() as u64);
    let dsdt_addr = align(madt_addr + madt.len() as u64);
    let end = dsdt_addr + dsdt.len() as u64;
    if end > VMGENID_START {
        return Err(Error::TablesTooLarge(end));
    }
    let fadt = fadt(dsdt_addr);

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = aml_bytes(&xsdt);
    let rsdp = aml_bytes(&Rsdp::new(OEM_ID, xsdt_addr));

    for (bytes, addr) in [
        (&rsdp, RSDP_START),
        (&xsdt, xsdt_addr),
        (&fadt, fadt_addr),
        (&madt, madt_addr),
        (&dsdt, dsdt_addr),
    ] {
        mem.write_slice(bytes, GuestAddress(addr))
            .map_err(Error::Write)?;
    }
    Ok(RSDP_START)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{VIRTIO_IRQ_BASE, VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START};

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap()
    }

    fn devices(n: usize) -> Vec<VirtioMmioAcpi> {
        (0..n)
            .map(|i| VirtioMmioAcpi {
                base: VIRTIO_MMIO_START + i as u64 * VIRTIO_MMIO_SIZE,
                len: VIRTIO_MMIO_SIZE,
                gsi: VIRTIO_IRQ_BASE + i as u32,
            })
            .collect()
    }

    fn read(m: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        m.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn u32_of(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    fn u64_of(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |s, x| s.wrapping_add(*x))
    }

    /// Reads the table at `addr`, checking its signature, length and checksum.
    fn table(m: &GuestMemoryMmap, addr: u64, signature: &[u8; 4]) -> Vec<u8> {
        let hdr = read(m, addr, 36);
        assert_eq!(&hdr[0..4], signature);
        let len = u32_of(&hdr, 4) as usize;
        assert!(len >= 36);
        let t = read(m, addr, len);
        assert_eq!(
            sum(&t),
            0,
            "{} checksum",
            String::from_utf8_lossy(signature)
        );
        assert!(addr + len as u64 <= 0x10_0000, "below 1 MiB");
        t
    }

    /// Follows RSDP → XSDT → FADT/MADT → DSDT, as the kernel does.
    fn walk(m: &GuestMemoryMmap, rsdp_addr: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let rsdp = read(m, rsdp_addr, 36);
        assert_eq!(&rsdp[0..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[0..20]), 0, "RSDP v1 checksum");
        assert_eq!(sum(&rsdp), 0, "RSDP extended checksum");
        assert_eq!(rsdp[15], 2, "revision 2: has an XSDT");
        assert_eq!(u32_of(&rsdp, 20), 36, "RSDP length");
        let xsdt = table(m, u64_of(&rsdp, 24), b"XSDT");
        assert_eq!(xsdt.len(), 36 + 16, "two entries");
        let fadt = table(m, u64_of(&xsdt, 36), b"FACP");
        let madt = table(m, u64_of(&xsdt, 44), b"APIC");
        let dsdt = table(m, u64_of(&fadt, 140), b"DSDT");
        (fadt, madt, dsdt)
    }

    fn count(haystack: &[u8], needle: &[u8]) -> usize {
        haystack
            .windows(needle.len())
            .filter(|w| *w == needle)
            .count()
    }

    #[test]
    fn tables_chain_with_valid_checksums() {
        for cpus in [1, 2, 8] {
            let m = mem();
            let rsdp = setup_acpi(&m, cpus, &devices(3)).unwrap();
            assert_eq!(rsdp, RSDP_START);
            assert_eq!(rsdp % 16, 0, "Linux scans 16-byte boundaries");
            walk(&m, rsdp);
        }
    }

    #[test]
    fn fadt_is_hardware_reduced_with_sleep_registers() {
        let m = mem();
        let (fadt, _, _) = walk(&m, setup_acpi(&m, 1, &[]).unwrap());
        assert_eq!(fadt.len(), 276, "ACPI 6.x FADT length");
        assert_eq!(fadt[8], 6, "FADT major revision");
        assert_ne!(u32_of(&fadt, 112) & (1 << 20), 0, "HW_REDUCED_ACPI");
        let boot_arch = u16::from_le_bytes([fadt[109], fadt[110]]);
        assert_eq!(boot_arch & 0b10_0110, 0b10_0100, "no VGA, no RTC, no 8042");
        // SLEEP_CONTROL_REG at 244, SLEEP_STATUS_REG at 256: 12-byte GAS,
        // SystemIO, 8 bits wide, byte access.
        for (off, port) in [
            (244, ACPI_SLEEP_CONTROL_PORT),
            (256, ACPI_SLEEP_STATUS_PORT),
        ] {
            assert_eq!(&fadt[off..off + 4], &[1, 8, 0, 1]);
            assert_eq!(u64_of(&fadt, off + 4), u64::from(port));
        }
        // No PM timer.
        assert_eq!(u32_of(&fadt, 76), 0, "PM_TMR_BLK");
        assert_eq!(fadt[91], 0, "PM_TMR_LEN");
        assert_eq!(u64_of(&fadt, 208 + 4), 0, "X_PM_TMR_BLK");
    }

    #[test]
    fn madt_describes_every_cpu_and_the_ioapic() {
        for cpus in [1u32, 2, 8] {
            let m = mem();
            let (_, madt, _) = walk(&m, setup_acpi(&m, cpus, &[]).unwrap());
            assert_eq!(u32_of(&madt, 36), 0xfee0_0000, "local APIC address");
            let mut off = 44;
            let (mut lapics, mut ioapics, mut nmis) = (Vec::new(), Vec::new(), 0);
            while off < madt.len() {
                let (t, len) = (madt[off], madt[off + 1] as usize);
                let s = &madt[off..off + len];
                match t {
                    0 => lapics.push((s[2], s[3], u32_of(s, 4))),
                    1 => ioapics.push((s[2], u32_of(s, 4), u32_of(s, 8))),
                    4 => {
                        assert_eq!((s[2], s[5]), (0xff, 1), "NMI on LINT1 of all CPUs");
                        nmis += 1;
                    }
                    2 => panic!("unexpected interrupt source override"),
                    other => panic!("unexpected MADT structure {other}"),
                }
                off += len;
            }
            assert_eq!(off, madt.len());
            let expected: Vec<_> = (0..cpus as u8).map(|i| (i, i, 1)).collect();
            assert_eq!(lapics, expected, "uid, APIC id, enabled");
            assert_eq!(ioapics, vec![(cpus as u8, 0xfec0_0000, 0)]);
            assert_eq!(nmis, 1);
        }
    }

    #[test]
    fn dsdt_has_each_virtio_device_com1_and_s5() {
        let m = mem();
        let devs = devices(4);
        let (_, _, dsdt) = walk(&m, setup_acpi(&m, 2, &devs).unwrap());
        assert_eq!(dsdt[8], 2, "DSDT revision");
        assert_eq!(count(&dsdt, b"LNRO0005"), 4);
        for (n, d) in devs.iter().enumerate() {
            assert_eq!(count(&dsdt, format!("VR{n:02X}").as_bytes()), 1);
            // Memory32Fixed descriptor: 0x86, length 9, read-write, base, length.
            let mut desc = vec![0x86, 9, 0, 1];
            desc.extend_from_slice(&(d.base as u32).to_le_bytes());
            desc.extend_from_slice(&(d.len as u32).to_le_bytes());
            assert_eq!(count(&dsdt, &desc), 1, "window of device {n}");
            // Extended interrupt descriptor: consumer, edge, active-high, exclusive.
            let mut irq = vec![0x89, 6, 0, 0b0011, 1];
            irq.extend_from_slice(&d.gsi.to_le_bytes());
            assert_eq!(count(&dsdt, &irq), 1, "interrupt of device {n}");
        }
        // COM1: EISA ID PNP0501 compressed = 0x0105d041, I/O 0x3f8 length 8, GSI 4.
        assert_eq!(count(&dsdt, &0x0105_d041u32.to_le_bytes()), 1);
        assert_eq!(count(&dsdt, &[0x47, 1, 0xf8, 3, 0xf8, 3, 0, 8]), 1);
        assert_eq!(count(&dsdt, &[0x89, 6, 0, 0b0011, 1, 4, 0, 0, 0]), 1);
        // Last: Name(\_S5_, Package(2) {5, 0}) = NameOp, root path, PackageOp,
        // PkgLength 5, 2 elements, BytePrefix 5, ZeroOp.
        let s5 = [0x08, b'\\', b'_', b'S', b'5', b'_', 0x12, 5, 2, 0x0a, 5, 0];
        assert!(dsdt.ends_with(&s5), "{:x?}", &dsdt[dsdt.len() - 12..]);
    }

    #[test]
    fn dsdt_has_the_vm_generation_id_and_its_event_device() {
        let m = mem();
        let (_, _, dsdt) = walk(&m, setup_acpi(&m, 1, &devices(2)).unwrap());
        for id in [VMGENID_HID, VMGENID_CID, GED_HID] {
            assert_eq!(count(&dsdt, id.as_bytes()), 1, "{id}");
        }
        // ADDR returns Package(2) {low, high}: PackageOp, PkgLength 8, two
        // elements, DWordPrefix 0xff000, ZeroOp (a zero is encoded as ZeroOp).
        let mut addr = vec![0x12, 8, 2, 0x0c];
        addr.extend_from_slice(&(VMGENID_START as u32).to_le_bytes());
        addr.push(0);
        assert_eq!(count(&dsdt, &addr), 1, "the GUID's address package");
        // The GED's interrupt: extended descriptor, edge, GSI 23.
        let mut irq = vec![0x89, 6, 0, 0b0011, 1];
        irq.extend_from_slice(&GED_GSI.to_le_bytes());
        assert_eq!(count(&dsdt, &irq), 1, "the GED's interrupt");
        // Notify(\_SB.VGEN, 0x80): NotifyOp, root, DualNamePrefix, BytePrefix 0x80.
        let notify = b"\x86\\\x2e_SB_VGEN\x0a\x80";
        assert_eq!(count(&dsdt, notify), 1, "the notify");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let m = mem();
        assert!(matches!(setup_acpi(&m, 0, &[]), Err(Error::NoCpus)));
        assert!(matches!(
            setup_acpi(&m, 255, &[]),
            Err(Error::TooManyCpus(255))
        ));
        assert!(matches!(
            setup_acpi(&m, 1, &devices(17)),
            Err(Error::TooManyDevices(17))
        ));
        let high = VirtioMmioAcpi {
            base: 1 << 32,
            len: 0x1000,
            gsi: 5,
        };
        let err = setup_acpi(&m, 1, &[high]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "virtio-mmio window 0x100000000+0x1000 is not below 4 GiB"
        );
        let bad_gsi = VirtioMmioAcpi {
            gsi: 24,
            ..devices(1)[0]
        };
        assert!(matches!(
            setup_acpi(&m, 1, &[bad_gsi]),
            Err(Error::NoSuchGsi(24))
        ));
        let small = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0xe0000)]).unwrap();
        assert!(matches!(setup_acpi(&small, 1, &[]), Err(Error::Write(_))));
    }

    #[test]
    fn largest_configuration_fits_below_1mib() {
        let m = mem();
        let rsdp = setup_acpi(&m, MAX_CPUS, &devices(VIRTIO_MMIO_MAX_DEVICES)).unwrap();
        let (_, _, dsdt) = walk(&m, rsdp);
        assert_eq!(count(&dsdt, b"LNRO0005"), VIRTIO_MMIO_MAX_DEVICES);
    }

    fn iasl_installed() -> bool {
        std::process::Command::new("iasl")
            .arg("-v")
            .output()
            .is_ok()
    }

    /// Runs `iasl` with `args` on `name` (holding `bytes`) in a scratch
    /// directory; returns its report and the file `output` it produced (lossy UTF-8).
    fn iasl(name: &str, bytes: &[u8], args: &[&str], output: &str) -> (String, String) {
        let dir =
            std::env::temp_dir().join(format!("ember-iasl-{}-{name}-{output}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
        let out = std::process::Command::new("iasl")
            .args(args)
            .arg(name)
            .current_dir(&dir)
            .output()
            .unwrap();
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let produced = std::fs::read(dir.join(output));
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            out.status.success(),
            "iasl {args:?} {name} failed:\n{report}"
        );
        let produced = produced.unwrap_or_else(|e| panic!("no {output} ({e}):\n{report}"));
        (report, String::from_utf8_lossy(&produced).into_owned())
    }

    /// Loads the DSDT into ACPICA's interpreter (`acpiexec`, the same code as
    /// Linux's) and evaluates the objects Linux will: each device's `_HID` and
    /// `_CRS`, and `\_S5`.
    #[test]
    fn acpica_evaluates_the_dsdt() {
        if std::process::Command::new("acpiexec")
            .arg("-v")
            .output()
            .is_err()
        {
            ember_testing::skip(
                "acpica_evaluates_the_dsdt",
                "`acpiexec` not installed (apt-get install acpica-tools)",
            );
            return;
        }
        let m = mem();
        let (_, _, dsdt) = walk(&m, setup_acpi(&m, 1, &devices(2)).unwrap());
        let dir = ember_testing::TempDir::new("acpiexec");
        std::fs::write(dir.join("dsdt.aml"), &dsdt).unwrap();
        let out = std::process::Command::new("acpiexec")
            .arg("-b")
            .arg(
                "evaluate \\_SB.VR01._HID; evaluate \\_SB.VR01._CRS; \
                 evaluate \\_SB.COM1._HID; evaluate \\_S5; \
                 evaluate \\_SB.VGEN._HID; evaluate \\_SB.VGEN._CID; \
                 evaluate \\_SB.VGEN.ADDR; evaluate \\_SB.GED0._CRS; \
                 evaluate \\_SB.GED0._EVT 23; evaluate \\_SB.GED0._EVT 22",
            )
            .arg("dsdt.aml")
            .current_dir(&dir)
            .output()
            .unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let report = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{report}");
        // VR01: Memory32Fixed(RW, 0xd0001000, 0x1000), Interrupt(GSI 6), end tag.
        let crs = [
            "0000: 86 09 00 01 00 10 00 D0 00 10 00 00 89 06 00 03",
            "0010: 01 06 00 00 00 79 00",
        ];
        for needle in [
            "[String] Length 08 = \"LNRO0005\"",
            crs[0],
            crs[1],
            "[Integer] = 000000000105D041",
            "[Package] Contains 2 Elements:\n    [Integer] = 0000000000000005",
            "No outstanding allocations",
            // The VM generation ID, as Linux's vmgenid driver finds it.
            "[String] Length 08 = \"VMGENCTR\"",
            "[String] Length 0E = \"VM_GEN_COUNTER\"",
            "Evaluation of \\_SB.VGEN.ADDR returned object",
            "[Package] Contains 2 Elements:\n    [Integer] = 00000000000FF000\n    \
             [Integer] = 0000000000000000",
            // The GED: its interrupt (GSI 23, edge), and _EVT(23) notifies VGEN.
            "0000: 89 06 00 03 01 17 00 00 00 79 00",
            "Received a Device Notify on [VGEN]",
        ] {
            assert!(
                report.contains(needle),
                "{needle:?} missing from:\n{report}"
            );
        }
        assert!(!report.contains("AE_"), "ACPICA exception:\n{report}");
        // _EVT(22) is no event of ours: one notify in all, with value 0x80.
        let notifies: Vec<&str> = report
            .lines()
            .filter(|l| l.contains("Received a Device Notify"))
            .collect();
        assert_eq!(notifies.len(), 1, "{report}");
        assert!(notifies[0].contains("Value 0x80"), "{report}");
    }

    /// Disassembles the tables with ACPICA's `iasl`, the reference parser
    /// (what Linux's ACPI interpreter is built from), and recompiles the DSDT.
    #[test]
    fn iasl_accepts_the_tables() {
        if !iasl_installed() {
            ember_testing::skip(
                "iasl_accepts_the_tables",
                "`iasl` not installed (apt-get install acpica-tools)",
            );
            return;
        }
        let m = mem();
        let (fadt, madt, dsdt) = walk(&m, setup_acpi(&m, 2, &devices(2)).unwrap());

        let (_, dsl) = iasl("dsdt.aml", &dsdt, &["-d"], "dsdt.dsl");
        for needle in [
            "Device (VR00)",
            "Device (VR01)",
            "Name (_HID, \"LNRO0005\")",
            "Memory32Fixed (ReadWrite,",
            "0xD0001000,",
            "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, )",
            "0x00000006,",
            "Device (COM1)",
            "EisaId (\"PNP0501\")",
            "IO (Decode16,",
            "0x03F8,",
            "Name (\\_S5, Package (0x02)",
        ] {
            assert!(dsl.contains(needle), "{needle:?} missing from:\n{dsl}");
        }
        for needle in [
            "Device (VGEN)",
            "Name (_CID, \"VM_GEN_COUNTER\")",
            "Method (ADDR, 0, NotSerialized)",
            "Device (GED0)",
            "Name (_HID, \"ACPI0013\"",
            "Method (_EVT, 1, Serialized)",
            "Notify (\\_SB.VGEN, 0x80)",
        ] {
            assert!(dsl.contains(needle), "{needle:?} missing from:\n{dsl}");
        }
        // Recompiling the disassembly is ACPICA's full semantic check. iasl
        // insists that an 8-character _HID end in hex digits; "VMGENCTR" is
        // what Linux's vmgenid driver matches (Firecracker uses it too), so
        // the recompile gets a conforming stand-in for that one string.
        let hid = "Name (_HID, \"VMGENCTR\")";
        assert_eq!(dsl.matches(hid).count(), 1, "{dsl}");
        let dsl = dsl.replace(hid, "Name (_HID, \"EMBR0001\")");
        let (report, _) = iasl("dsdt.dsl", dsl.as_bytes(), &[], "dsdt.aml");
        assert!(report.contains(" 0 Errors, 0 Warnings"), "{report}\n{dsl}");

        let (_, facp) = iasl("facp.dat", &fadt, &["-d"], "facp.dsl");
        let (_, apic) = iasl("apic.dat", &madt, &["-d"], "apic.dsl");
        for (table, needles) in [
            (
                &facp,
                &["Hardware Reduced (V5) : 1", "VGA Not Present (V4) : 1"][..],
            ),
            (
                &apic,
                &["Subtable Type : 01 [I/O APIC]", "Local Apic ID : 01"][..],
            ),
        ] {
            let flat = table.split_whitespace().collect::<Vec<_>>().join(" ");
            for needle in needles {
                assert!(flat.contains(needle), "{needle:?} missing from:\n{table}");
            }
            assert!(
                !table.contains("Warning") && !table.contains("Error"),
                "{table}"
            );
        }
    }
}
