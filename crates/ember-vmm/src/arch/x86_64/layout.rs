//! Every guest-physical address and fixed resource ember uses, in one place.
//!
//! The low megabyte follows the PC conventions Linux expects (EBDA below
//! 640 KiB, BIOS area above); everything ember itself places lives in the
//! first 1 MiB, below where kernels load.

/// Guest RAM below this is backed by small pages, the rest by transparent
/// huge pages: this first huge page holds every boot structure ember writes
/// (and the start of a kernel loaded at 1 MiB), of which the guest touches a
/// few dozen 4 KiB pages early on. Faulting it in as one huge page means
/// zeroing 2 MiB on the boot path (about 0.5 ms measured where the VMM
/// itself runs in a VM and each page zeroed is slower, before the first
/// guest instruction).
pub(crate) const SMALL_PAGES_END: u64 = 0x20_0000;
/// Boot GDT (four 8-byte descriptors).
pub(crate) const BOOT_GDT_START: u64 = 0x500;
/// Boot IDT: an empty table; the guest installs its own.
pub(crate) const BOOT_IDT_START: u64 = 0x520;
/// PVH `hvm_start_info` for kernels entered through their PVH note.
pub(crate) const PVH_INFO_START: u64 = 0x6000;
/// PVH module list (one entry: the initramfs).
pub(crate) const PVH_MODLIST_START: u64 = 0x6040;
/// PVH memory map (e820-style entries).
pub(crate) const PVH_MEMMAP_START: u64 = 0x7000;
/// Linux zero page (`struct boot_params`), for the 64-bit boot protocol.
pub(crate) const ZERO_PAGE_START: u64 = 0x7000;
/// Identity page tables: PML4, PDPTE, and one PDE page mapping 1 GiB with 2 MiB pages.
pub(crate) const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table.
pub(crate) const PDPTE_START: u64 = 0xa000;
/// Page directory (512 × 2 MiB = the first 1 GiB).
pub(crate) const PDE_START: u64 = 0xb000;
/// Kernel command line (NUL-terminated), at most `CMDLINE_MAX_SIZE` bytes.
pub(crate) const CMDLINE_START: u64 = 0x20000;
/// Largest command line we pass (the boot protocol's `cmdline_size` may be smaller).
pub const CMDLINE_MAX_SIZE: usize = 0x10000;
/// Initial stack pointer for the 64-bit boot protocol entry.
pub(crate) const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Start of the Extended BIOS Data Area; the MP table lives here, where Linux scans for it.
pub(crate) const EBDA_START: u64 = 0x9fc00;
/// End of the legacy hole (VGA, option ROMs, BIOS: not RAM), which starts at
/// 0xa0000.
pub(crate) const LEGACY_HOLE_END: u64 = 0x10_0000;
/// ACPI RSDP, in the BIOS read-only area Linux scans (0xe0000..0x100000).
pub(crate) const RSDP_START: u64 = 0xe0000;
/// Other ACPI tables follow the RSDP.
pub(crate) const ACPI_TABLES_START: u64 = 0xe0100;
/// The VM generation ID: a 16-byte GUID the guest finds through the DSDT's
/// `VGEN.ADDR`, in the last page of the BIOS area. That area is reserved in
/// the e820 map (the guest never uses it as RAM) and is part of guest memory
/// (so a snapshot carries it, and a restore rewrites it); the ACPI tables
/// must end below it.
pub const VMGENID_START: u64 = 0xf_f000;
/// Where protected-mode kernels (bzImage payloads) and our test guest load.
pub const KERNEL_START: u64 = 0x10_0000;
/// Lowest address for the high-memory area (kernels may not load below it).
pub const HIMEM_START: u64 = 0x10_0000;

/// The 32-bit device hole: no RAM between here and 4 GiB.
pub(crate) const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the device hole.
pub(crate) const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Firecracker-style boot-timer page: the guest writes the magic byte here.
pub(crate) const BOOT_TIMER_MMIO_START: u64 = 0xc000_0000;
/// Size of the boot-timer region.
pub(crate) const BOOT_TIMER_MMIO_SIZE: u64 = 0x1000;
/// First virtio-mmio device window; each device takes `VIRTIO_MMIO_SIZE`.
pub(crate) const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// Size of one virtio-mmio window.
pub(crate) const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// At most this many virtio-mmio devices.
pub(crate) const VIRTIO_MMIO_MAX_DEVICES: usize = 16;
/// Where virtio-pmem regions are mapped (above the 4 GiB hole and any RAM
/// there): 64 GiB, well below 2^39. KVM refuses a memory slot past the host
/// CPU's physical address width, which is 39 bits on many Intel client CPUs
/// and 40 under QEMU/TCG (the nested rig): 1 TiB, the earlier choice, failed
/// on both.
pub(crate) const PMEM_START_MIN: u64 = 0x10_0000_0000;
/// The virtio-mem region starts on a boundary of this above RAM and the
/// device hole (a whole number of Linux's 128 MiB memory blocks).
pub(crate) const HOTPLUG_ALIGN: u64 = 1 << 30;
/// IOAPIC registers.
pub(crate) const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC registers.
pub(crate) const APIC_START: u64 = 0xfee0_0000;
/// KVM needs three pages for the TSS (Intel-only, harmless elsewhere).
pub(crate) const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// KVM's identity-map page, right below the TSS.
pub(crate) const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

/// First GSI handed to virtio-mmio devices (IOAPIC pins 5.. are free on our board).
pub(crate) const VIRTIO_IRQ_BASE: u32 = 5;
/// Number of IOAPIC pins KVM's in-kernel IOAPIC provides.
pub(crate) const IOAPIC_PINS: u32 = 24;
/// The ACPI Generic Event Device's interrupt (the last IOAPIC pin, above
/// every virtio device's): how a hardware-reduced machine raises an ACPI
/// event, here "the VM generation ID changed" after a restore.
pub(crate) const GED_GSI: u32 = IOAPIC_PINS - 1;

/// COM1 16550 UART: ports and IRQ.
pub(crate) const COM1_PORT: u16 = 0x3f8;
/// Number of COM1 registers.
pub(crate) const COM1_PORT_LEN: u16 = 8;
/// COM1 interrupt line.
pub(crate) const COM1_IRQ: u32 = 4;
/// i8042 controller data port (we only handle the command port's reset).
pub(crate) const I8042_DATA_PORT: u16 = 0x60;
/// i8042 command port.
pub(crate) const I8042_COMMAND_PORT: u16 = 0x64;
/// POST/debug port: boot-progress codes (Cloud Hypervisor's convention).
pub(crate) const DEBUG_PORT: u16 = 0x80;
/// isa-debug-exit (same port as QEMU's default): write N to exit with status N.
pub(crate) const DEBUG_EXIT_PORT: u16 = 0x501;
/// Hardware-reduced ACPI sleep control register (FADT), for ACPI poweroff.
pub(crate) const ACPI_SLEEP_CONTROL_PORT: u16 = 0x3c0;
/// Hardware-reduced ACPI sleep status register.
pub(crate) const ACPI_SLEEP_STATUS_PORT: u16 = 0x3c1;

// Checked at compile time: the generation ID sits after the ACPI tables, in
// the BIOS area, within one page; the GED's pin is nobody else's.
const _: () = {
    assert!(ACPI_TABLES_START < VMGENID_START && VMGENID_START + 16 <= LEGACY_HOLE_END);
    assert!(VMGENID_START % 4096 == 0);
    assert!(GED_GSI >= VIRTIO_IRQ_BASE + VIRTIO_MMIO_MAX_DEVICES as u32);
    assert!(GED_GSI < IOAPIC_PINS && GED_GSI != COM1_IRQ);
};

/// Guest RAM split around the 32-bit device hole: ranges of (start, len).
pub(crate) fn ram_ranges(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_GAP_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_size - MMIO_GAP_START),
        ]
    }
}

/// Where a virtio-mem region goes in a guest of `mem_size` bytes of boot
/// RAM: above it and above the 4 GiB hole, on a [`HOTPLUG_ALIGN`] boundary.
pub(crate) fn hotplug_start(mem_size: u64) -> u64 {
    let ram_end = ram_ranges(mem_size).last().map_or(0, |r| r.0 + r.1);
    ram_end.max(MMIO_GAP_END).next_multiple_of(HOTPLUG_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_below_hole_is_one_range() {
        assert_eq!(ram_ranges(512 << 20), vec![(0, 512 << 20)]);
    }

    #[test]
    fn ram_above_hole_is_split_and_keeps_its_size() {
        let r = ram_ranges(8 << 30);
        assert_eq!(r[0], (0, MMIO_GAP_START));
        assert_eq!(r[1].0, MMIO_GAP_END);
        assert_eq!(r.iter().map(|r| r.1).sum::<u64>(), 8 << 30);
    }

    #[test]
    fn the_hotplug_region_sits_above_ram_and_the_hole() {
        assert_eq!(hotplug_start(512 << 20), MMIO_GAP_END);
        assert_eq!(hotplug_start(4 << 30), 5 << 30);
        assert_eq!(hotplug_start((4 << 30) + 4096), 6 << 30);
    }

    #[test]
    fn fixed_areas_do_not_overlap() {
        let areas = [
            (BOOT_GDT_START, 0x20),
            (BOOT_IDT_START, 0x8),
            (PVH_INFO_START, 0x40),
            (PVH_MODLIST_START, 0x40),
            (PML4_START, 0x3000),
            (BOOT_STACK_POINTER - 0x100, 0x100),
            (CMDLINE_START, CMDLINE_MAX_SIZE as u64),
            (EBDA_START, 0x400),
        ];
        for (i, a) in areas.iter().enumerate() {
            for b in &areas[i + 1..] {
                assert!(
                    a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0,
                    "{a:x?} overlaps {b:x?}"
                );
            }
        }
        assert!(CMDLINE_START + CMDLINE_MAX_SIZE as u64 <= EBDA_START);
    }
}
