//! The x86-64 boot-state writers together: written in the order a VMM would,
//! no structure may clobber another. Each writer's own format is unit-tested
//! beside it; this checks they share guest memory.

use crate::arch::x86_64::acpi::{self, VirtioMmioAcpi};
use crate::arch::x86_64::{boot, layout, mptable, regs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM_SIZE: u64 = 256 << 20;
const CMDLINE: &str = "console=ttyS0 reboot=k panic=1";
const CPUS: u32 = 4;

fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
    v
}

fn sum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
}

fn u32_at(mem: &GuestMemoryMmap, addr: u64) -> u32 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

fn u64_at(mem: &GuestMemoryMmap, addr: u64) -> u64 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

fn virtio() -> Vec<VirtioMmioAcpi> {
    (0..layout::VIRTIO_MMIO_MAX_DEVICES as u64)
        .map(|i| VirtioMmioAcpi {
            base: layout::VIRTIO_MMIO_START + i * layout::VIRTIO_MMIO_SIZE,
            len: layout::VIRTIO_MMIO_SIZE,
            gsi: layout::VIRTIO_IRQ_BASE + i as u32,
        })
        .collect()
}

/// Guest memory with everything but the protocol-specific block written.
struct Common {
    mem: GuestMemoryMmap,
    ram: Vec<(u64, u64)>,
    rsdp: u64,
    /// (address, size) of the initramfs.
    initrd: (u64, u64),
}

fn common() -> Common {
    let ram = layout::ram_ranges(MEM_SIZE);
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
    // Fill with a pattern so "never written" and "zeroed" are told apart.
    mem.write_slice(&vec![0xa5; 2 << 20], GuestAddress(0))
        .unwrap();
    boot::write_cmdline(&mem, CMDLINE, 2047).unwrap();
    regs::write_gdt_and_idt(&mem).unwrap();
    regs::write_identity_page_tables(&mem).unwrap();
    mptable::setup_mptable(&mem, CPUS).unwrap();
    let rsdp = acpi::setup_acpi(&mem, CPUS, &virtio()).unwrap();
    let initrd_size = 3 << 20;
    let initrd = boot::initrd_address(&ram, initrd_size, Some(0x7fff_ffff), 0x200_0000).unwrap();
    Common {
        mem,
        ram,
        rsdp,
        initrd: (initrd, initrd_size),
    }
}

/// Every structure `common()` wrote is still intact.
fn check_common(mem: &GuestMemoryMmap, rsdp: u64) {
    let cmdline = read(mem, layout::CMDLINE_START, CMDLINE.len() + 1);
    assert_eq!(&cmdline[..CMDLINE.len()], CMDLINE.as_bytes());
    assert_eq!(cmdline[CMDLINE.len()], 0);

    // GDT: null, then the three flat descriptors (limit 0xffff in the low word).
    assert_eq!(u64_at(mem, layout::BOOT_GDT_START), 0);
    for i in 1..4 {
        assert_eq!(u64_at(mem, layout::BOOT_GDT_START + i * 8) & 0xffff, 0xffff);
    }
    assert_eq!(u64_at(mem, layout::BOOT_IDT_START), 0);

    // Page tables: PML4[0] → PDPT, PDPT[0] → PD, PD[511] maps 1 GiB - 2 MiB.
    assert_eq!(
        u64_at(mem, layout::PML4_START) & !0xfff,
        layout::PDPTE_START
    );
    assert_eq!(u64_at(mem, layout::PDPTE_START) & !0xfff, layout::PDE_START);
    assert_eq!(u64_at(mem, layout::PDE_START + 511 * 8) & !0xfff, 511 << 21);

    // MP table: both checksums still hold.
    let mpf = read(mem, layout::EBDA_START, 16);
    assert_eq!(&mpf[..4], b"_MP_");
    assert_eq!(sum(&mpf), 0);
    let config = u64::from(u32::from_le_bytes(mpf[4..8].try_into().unwrap()));
    let len = u16::from_le_bytes(read(mem, config + 4, 2).try_into().unwrap());
    assert_eq!(sum(&read(mem, config, usize::from(len))), 0);

    // ACPI: the RSDP and every table it reaches still checksum.
    let r = read(mem, rsdp, 36);
    assert_eq!(&r[..8], b"RSD PTR ");
    assert_eq!(sum(&r), 0);
    let xsdt = u64::from_le_bytes(r[24..32].try_into().unwrap());
    let table = |addr: u64| {
        let len = u32_at(mem, addr + 4) as usize;
        let t = read(mem, addr, len);
        assert_eq!(sum(&t), 0, "{}", String::from_utf8_lossy(&t[..4]));
        t
    };
    let x = table(xsdt);
    for entry in x[36..].chunks(8) {
        let t = table(u64::from_le_bytes(entry.try_into().unwrap()));
        if &t[..4] == b"FACP" {
            table(u64::from_le_bytes(t[140..148].try_into().unwrap()));
        }
    }
}

#[test]
fn linux_boot_structures_do_not_overlap() {
    let Common {
        mem,
        ram,
        rsdp,
        initrd,
    } = common();
    let layout_ = boot::BootLayout {
        ram: &ram,
        cmdline: CMDLINE,
        initrd: Some(initrd),
        rsdp: Some(rsdp),
    };
    boot::configure_linux(&mem, &layout_, None).unwrap();
    check_common(&mem, rsdp);
    let zp = layout::ZERO_PAGE_START;
    assert_eq!(u32_at(&mem, zp + 0x202), u32::from_le_bytes(*b"HdrS"));
    assert_eq!(u32_at(&mem, zp + 0x228), layout::CMDLINE_START as u32);
    assert_eq!(u32_at(&mem, zp + 0x218), initrd.0 as u32);
    assert_eq!(u64_at(&mem, zp + 0x070), rsdp);
    // The zero page ends before the boot stack's page and the page tables.
    assert!(zp + 0x1000 <= layout::PML4_START);
}

#[test]
fn pvh_boot_structures_do_not_overlap() {
    let Common {
        mem,
        ram,
        rsdp,
        initrd,
    } = common();
    let layout_ = boot::BootLayout {
        ram: &ram,
        cmdline: CMDLINE,
        initrd: Some(initrd),
        rsdp: Some(rsdp),
    };
    boot::configure_pvh(&mem, &layout_).unwrap();
    check_common(&mem, rsdp);
    let info = layout::PVH_INFO_START;
    assert_eq!(u32_at(&mem, info), 0x336e_c578);
    assert_eq!(u64_at(&mem, info + 32), rsdp);
    let entries = u32_at(&mem, info + 48);
    let memmap = u64_at(&mem, info + 40);
    // The memory map ends before the page tables.
    assert!(memmap + u64::from(entries) * 24 <= layout::PML4_START);
    assert_eq!(u64_at(&mem, u64_at(&mem, info + 16)), initrd.0);
}

#[test]
fn initrd_lands_in_ram_clear_of_the_kernel_and_low_structures() {
    let Common {
        ram,
        initrd: (addr, size),
        ..
    } = common();
    assert!(addr >= 0x200_0000);
    assert!(addr + size <= MEM_SIZE);
    let e820 = boot::e820_entries(&ram);
    assert!(
        e820.iter()
            .any(|&(a, s, t)| t == boot::E820_RAM && a <= addr && addr + size <= a + s),
        "initrd {addr:#x}+{size:#x} not inside one RAM entry of {e820:x?}"
    );
}
