//! Boot-protocol data in guest memory: the kernel command line, the e820 memory
//! map, the Linux zero page (`struct boot_params`), the PVH `hvm_start_info`,
//! and where the initramfs goes.
//!
//! Two ways into a Linux kernel are supported:
//!
//! * the **64-bit Linux boot protocol** (Documentation/arch/x86/boot.rst,
//!   "64-bit BOOT PROTOCOL"): the VMM loads the protected-mode kernel, fills a
//!   zero page and jumps to `startup_64` with `%rsi` pointing at it;
//! * **PVH** (Xen's `hvm_start_info`, xen/include/public/arch-x86/hvm/start_info.h;
//!   Linux's side is arch/x86/platform/pvh/): the VMM jumps to the entry
//!   named by the ELF note `XEN_ELFNOTE_PHYS32_ENTRY` in 32-bit protected mode
//!   with `%ebx` pointing at a start-info block.
//!
//! Everything here is a pure function over guest memory; registers are in
//! `super::regs`.

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{
    CAN_USE_HEAP, E820_MAX_ENTRIES_ZEROPAGE, boot_e820_entry, boot_params,
};
/// The bzImage setup header's layout and the flags ember and its tools read
/// or write in it, from linux-loader (re-exported: the header has one
/// definition, whoever reads it).
pub use linux_loader::loader::bootparam::{LOADED_HIGH, XLF_KERNEL_64, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START, HIMEM_START, PVH_INFO_START, PVH_MEMMAP_START,
    PVH_MODLIST_START, ZERO_PAGE_START,
};

/// e820 type: usable RAM.
pub(crate) const E820_RAM: u32 = 1;
/// e820 type: reserved, the kernel must not use it as RAM.
pub(crate) const E820_RESERVED: u32 = 2;

/// `boot_flag` at 0x1fe: the old boot-sector signature, checked by the kernel.
pub const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `header` at 0x202: "HdrS" in little-endian, marks a 2.00+ setup header.
pub const HDRS_MAGIC: u32 = 0x5372_6448;
/// The protocol version we claim when no bzImage header is given: 2.15,
/// recent enough that the kernel reads `acpi_rsdp_addr` (2.14+) and the
/// `ext_*` fields.
pub(crate) const DEFAULT_PROTOCOL_VERSION: u16 = 0x020f;
/// Protocol 2.03 introduced `initrd_addr_max`; older kernels imply this limit.
pub(crate) const LEGACY_INITRD_ADDR_MAX: u32 = 0x37ff_ffff;
/// `type_of_loader` 0xff: "undefined" boot loader, the right choice for a VMM
/// that has no ID assigned by the kernel maintainers.
pub(crate) const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// `heap_end_ptr`: end of the real-mode setup heap, relative to the start of
/// the setup code, as boot.rst recommends (0xfe00 = 0x10000 minus 0x200 for
/// the stack). Only the 16-bit setup code uses it; we still fill it so the
/// header is what a conventional loader would hand over.
pub(crate) const SETUP_HEAP_END: u16 = 0xfe00;
/// Kernel alignment we advertise in the default header (2 MiB, what x86-64
/// kernels use for `CONFIG_PHYSICAL_ALIGN`).
pub(crate) const DEFAULT_KERNEL_ALIGNMENT: u32 = 0x20_0000;

/// Longest command line (without the NUL) an x86 Linux kernel keeps when it
/// brings no setup header to say so (ELF `vmlinux`, PVH): `COMMAND_LINE_SIZE`
/// is 2048 on x86, and the kernel silently truncates anything longer.
pub(crate) const LINUX_CMDLINE_MAX: usize = 2047;
/// Protocol 2.10 added `pref_address` and `init_size`.
pub(crate) const PROTOCOL_2_10: u16 = 0x020a;
/// Protocol 2.12 added `xloadflags`, where XLF_KERNEL_64 announces the 64-bit
/// entry point at offset 0x200.
pub(crate) const PROTOCOL_2_12: u16 = 0x020c;

/// PVH `hvm_start_info.magic`: "xEn3" with the top bit of each byte set.
pub(crate) const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// Start-info version 1 carries the memory map fields.
pub(crate) const XEN_HVM_START_VERSION: u32 = 1;

const PAGE_SIZE: u64 = 0x1000;
const MIB: u64 = 1 << 20;
const FOUR_GIB: u64 = 1 << 32;

/// Errors while laying out boot-protocol data.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line does not fit the kernel's (or our) limit.
    #[error("kernel command line is {len} bytes, the limit is {max}")]
    CmdlineTooLong {
        /// Length of the command line (without the NUL).
        len: usize,
        /// Longest command line allowed (without the NUL).
        max: usize,
    },
    /// The command line would be cut short by an embedded NUL.
    #[error("kernel command line contains a NUL byte")]
    CmdlineHasNul,
    /// Guest memory does not cover the command-line area.
    #[error("cannot write the kernel command line to guest memory")]
    WriteCmdline(#[source] GuestMemoryError),
    /// The memory map does not fit the zero page's e820 table.
    #[error("{0} e820 entries do not fit the zero page (at most {E820_MAX_ENTRIES_ZEROPAGE})")]
    TooManyE820Entries(usize),
    /// The bzImage cannot be entered in 64-bit mode.
    #[error(
        "the bzImage has no 64-bit entry point (boot protocol {major}.{minor:02}, \
         xloadflags {xloadflags:#x} without XLF_KERNEL_64)"
    )]
    No64BitEntry {
        /// Protocol major version.
        major: u16,
        /// Protocol minor version.
        minor: u16,
        /// The header's xloadflags (0 before protocol 2.12).
        xloadflags: u16,
    },
    /// Not a Linux setup header at all.
    #[error("not a Linux bzImage: setup header magic missing")]
    NotABzImage,
    /// Guest memory does not cover the zero page.
    #[error("cannot write the zero page to guest memory")]
    WriteZeroPage(#[source] linux_loader::configurator::Error),
    /// Guest memory does not cover the PVH start info, module list or memory map.
    #[error("cannot write the PVH start info to guest memory")]
    WritePvhInfo(#[source] linux_loader::configurator::Error),
    /// There is no room for the initramfs between the kernel and its limit.
    #[error(
        "initrd of {size_mib} MiB does not fit in {mem_mib} MiB of guest memory \
         (it must lie between the kernel end {kernel_end:#x} and {limit:#x})"
    )]
    InitrdDoesNotFit {
        /// Initramfs size, MiB rounded up.
        size_mib: u64,
        /// Guest RAM, MiB.
        mem_mib: u64,
        /// First byte after the kernel.
        kernel_end: u64,
        /// First byte the initramfs may not touch.
        limit: u64,
    },
}

/// Where things are, for the boot-protocol writers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BootLayout<'a> {
    /// Guest RAM as (start, len) ranges, from `layout::ram_ranges`.
    pub ram: &'a [(u64, u64)],
    /// The kernel command line, without the terminating NUL.
    pub cmdline: &'a str,
    /// The initramfs as (guest address, size), if any.
    pub initrd: Option<(u64, u64)>,
    /// Address of the ACPI RSDP when ACPI tables were written.
    pub rsdp: Option<u64>,
}

/// `cmdline` telling Linux the machine has no PCI bus (`pci=off`), unless the
/// user already gave a `pci=` option of their own.
///
/// ember has no PCI host bridge, but Linux cannot know: without `pci=off` it
/// probes the legacy configuration ports (0xcf8/0xcfc) and BIOS tables, ~90
/// port accesses, each a trap out to the VMM that answers "nothing here".
/// Firecracker appends the same option for the same reason.
pub(crate) fn with_no_pci(cmdline: &str) -> String {
    let given = cmdline.split_whitespace().any(|w| w.starts_with("pci="));
    match (given, cmdline.trim()) {
        (true, c) => c.to_owned(),
        (false, "") => "pci=off".to_owned(),
        (false, c) => format!("{c} pci=off"),
    }
}

/// Writes the NUL-terminated command line at `CMDLINE_START`.
///
/// `max_len` is the kernel's limit without the NUL (the bzImage header's
/// `cmdline_size`, or [`LINUX_CMDLINE_MAX`] for ELF kernels);
/// it is further capped by the space ember reserves (`CMDLINE_MAX_SIZE`,
/// including the NUL).
pub(crate) fn write_cmdline(
    mem: &GuestMemoryMmap,
    cmdline: &str,
    max_len: usize,
) -> Result<(), Error> {
    let max = max_len.min(CMDLINE_MAX_SIZE - 1);
    if cmdline.len() > max {
        return Err(Error::CmdlineTooLong {
            len: cmdline.len(),
            max,
        });
    }
    if cmdline.as_bytes().contains(&0) {
        return Err(Error::CmdlineHasNul);
    }
    let mut bytes = Vec::with_capacity(cmdline.len() + 1);
    bytes.extend_from_slice(cmdline.as_bytes());
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(CMDLINE_START))
        .map_err(Error::WriteCmdline)
}

/// The e820 memory map for `ram`, as (address, size, type) entries sorted by
/// address.
///
/// The low megabyte follows the PC layout Linux expects: RAM up to the EBDA,
/// then [EBDA_START, 1 MiB) reserved — the EBDA (where our MP table is), the
/// legacy VGA/ROM hole and the BIOS area (where our ACPI tables are). Linux
/// would reserve most of that by itself, but saying so keeps it from ever
/// handing those pages to the page allocator. RAM resumes at 1 MiB, up to the
/// 32-bit device hole, and continues above 4 GiB for large guests.
pub(crate) fn e820_entries(ram: &[(u64, u64)]) -> Vec<(u64, u64, u32)> {
    let mut entries = Vec::new();
    let mut covers_low_megabyte = false;
    for &(start, len) in ram {
        let end = start.saturating_add(len);
        if start < EBDA_START {
            entries.push((start, end.min(EBDA_START) - start, E820_RAM));
        }
        if start < HIMEM_START && end > EBDA_START {
            covers_low_megabyte = true;
        }
        if end > HIMEM_START {
            let from = start.max(HIMEM_START);
            entries.push((from, end - from, E820_RAM));
        }
    }
    if covers_low_megabyte {
        entries.push((EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED));
    }
    entries.retain(|e| e.1 > 0);
    entries.sort_unstable_by_key(|e| e.0);
    entries
}

/// A zero-page setup header for kernels that bring none (ELF `vmlinux`):
/// just enough for `startup_64` and the early boot code to trust it.
fn default_setup_header() -> setup_header {
    setup_header {
        boot_flag: BOOT_FLAG_MAGIC,
        header: HDRS_MAGIC,
        version: DEFAULT_PROTOCOL_VERSION,
        // The kernel is already loaded at 1 MiB ("high"), not at 0x10000.
        loadflags: LOADED_HIGH,
        kernel_alignment: DEFAULT_KERNEL_ALIGNMENT,
        initrd_addr_max: u32::MAX,
        ..Default::default()
    }
}

/// Writes the Linux zero page (`struct boot_params`) at `ZERO_PAGE_START`.
///
/// `hdr` is the setup header read from a bzImage (offset 0x1f1 of the file);
/// boot.rst asks the loader to copy it into the zero page and then fill the
/// "write" fields. For ELF kernels pass `None` and a default header is used.
/// The command line must already be (or later be) written by
/// [`write_cmdline`].
pub(crate) fn configure_linux(
    mem: &GuestMemoryMmap,
    b: &BootLayout,
    hdr: Option<setup_header>,
) -> Result<(), Error> {
    let mut params = boot_params {
        hdr: hdr.unwrap_or_else(default_setup_header),
        ..Default::default()
    };

    // "Undefined" loader: we have no assigned loader ID.
    params.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    // heap_end_ptr is valid, so the (unused by us) 16-bit setup code may use
    // a heap; it is only meaningful from protocol 2.01.
    params.hdr.heap_end_ptr = SETUP_HEAP_END;
    params.hdr.loadflags |= CAN_USE_HEAP;

    // Command line: low 32 bits in the header, high 32 bits in the zero page
    // proper (read when the kernel sets XLF_CAN_BE_LOADED_ABOVE_4G or is
    // entered through the 64-bit protocol).
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.ext_cmd_line_ptr = (CMDLINE_START >> 32) as u32;
    // Length without the NUL, as the protocol defines `cmdline_size`.
    params.hdr.cmdline_size = b.cmdline.len() as u32;

    if let Some((addr, size)) = b.initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
        params.ext_ramdisk_image = (addr >> 32) as u32;
        params.ext_ramdisk_size = (size >> 32) as u32;
    }

    let e820 = e820_entries(b.ram);
    if e820.len() > E820_MAX_ENTRIES_ZEROPAGE {
        return Err(Error::TooManyE820Entries(e820.len()));
    }
    for (slot, &(addr, size, type_)) in params.e820_table.iter_mut().zip(&e820) {
        *slot = boot_e820_entry {
            addr,
            size,
            r#type: type_,
        };
    }
    params.e820_entries = e820.len() as u8;

    // Protocol 2.14+ kernels take the RSDP from here instead of scanning the
    // BIOS area; older kernels ignore the field and still find it by scanning.
    if let Some(rsdp) = b.rsdp {
        params.acpi_rsdp_addr = rsdp;
    }

    let boot = BootParams::new(&params, GuestAddress(ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams(&boot, mem).map_err(Error::WriteZeroPage)
}

/// Writes the PVH `hvm_start_info` at `PVH_INFO_START`, with the initramfs as
/// module 0 at `PVH_MODLIST_START` and the memory map at `PVH_MEMMAP_START`.
pub(crate) fn configure_pvh(mem: &GuestMemoryMmap, b: &BootLayout) -> Result<(), Error> {
    let memmap: Vec<hvm_memmap_table_entry> = e820_entries(b.ram)
        .into_iter()
        .map(|(addr, size, type_)| hvm_memmap_table_entry {
            addr,
            size,
            type_,
            reserved: 0,
        })
        .collect();
    let modules: Vec<hvm_modlist_entry> = b
        .initrd
        .map(|(paddr, size)| hvm_modlist_entry {
            paddr,
            size,
            // Linux ignores per-module command lines.
            cmdline_paddr: 0,
            reserved: 0,
        })
        .into_iter()
        .collect();

    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: XEN_HVM_START_VERSION,
        flags: 0,
        nr_modules: modules.len() as u32,
        modlist_paddr: if modules.is_empty() {
            0
        } else {
            PVH_MODLIST_START
        },
        cmdline_paddr: CMDLINE_START,
        // 0 means "no RSDP given": the kernel then scans the BIOS area.
        rsdp_paddr: b.rsdp.unwrap_or(0),
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        reserved: 0,
    };

    let mut boot = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
    boot.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    if !modules.is_empty() {
        boot.set_modules(&modules, GuestAddress(PVH_MODLIST_START));
    }
    PvhBootConfigurator::write_bootparams(&boot, mem).map_err(Error::WritePvhInfo)
}

/// Where a bzImage's setup header starts in the file (boot.rst: at 0x1f1 of
/// the boot sector, running on into the setup code).
pub(crate) const SETUP_HEADER_OFFSET: usize = 0x1f1;
/// Where the setup code starts in the file: the header's `jump` is there,
/// and `kernel_version` points relative to it.
pub const SETUP_CODE_OFFSET: usize = 0x200;

/// The setup header of a bzImage whose first bytes are `image`, in
/// linux-loader's `setup_header` layout; `None` when they are too short or
/// lack the "HdrS" magic of a 2.00+ header. The one reader of the header
/// outside linux-loader's own loader: `ember setup` (the payload, the
/// release string) and the test helpers use it.
pub fn read_setup_header(image: &[u8]) -> Option<setup_header> {
    let end = SETUP_HEADER_OFFSET + std::mem::size_of::<setup_header>();
    let hdr = *setup_header::from_slice(image.get(SETUP_HEADER_OFFSET..end)?)?;
    (hdr.header == HDRS_MAGIC).then_some(hdr)
}

/// Writes `hdr` where [`read_setup_header`] reads it; `None` (nothing
/// written) when `image` is too short to hold it.
pub fn write_setup_header(image: &mut [u8], hdr: &setup_header) -> Option<()> {
    let end = SETUP_HEADER_OFFSET + std::mem::size_of::<setup_header>();
    image
        .get_mut(SETUP_HEADER_OFFSET..end)?
        .copy_from_slice(hdr.as_slice());
    Some(())
}

/// Checks that a bzImage's setup header offers the 64-bit boot protocol
/// entry (`startup_64`, 0x200 bytes into the protected-mode kernel), the only
/// bzImage entry ember uses.
pub(crate) fn check_64bit_entry(hdr: &setup_header) -> Result<(), Error> {
    let (boot_flag, header, version, xloadflags) =
        (hdr.boot_flag, hdr.header, hdr.version, hdr.xloadflags);
    if boot_flag != BOOT_FLAG_MAGIC || header != HDRS_MAGIC {
        return Err(Error::NotABzImage);
    }
    // xloadflags was padding before 2.12: only trust it from there on.
    if version < PROTOCOL_2_12 || xloadflags & XLF_KERNEL_64 == 0 {
        return Err(Error::No64BitEntry {
            major: version >> 8,
            minor: version & 0xff,
            xloadflags: if version < PROTOCOL_2_12 {
                0
            } else {
                xloadflags
            },
        });
    }
    Ok(())
}

/// The first byte above everything a bzImage kernel occupies once it runs,
/// for [`initrd_address`]'s `kernel_end`.
///
/// The file's payload loaded at `load_addr` (ending at `loaded_end`) is not
/// the whole story: the compressed kernel's `startup_64` moves itself to
/// `pref_address` (rounding a relocatable kernel's load address up to
/// `kernel_alignment` if that is higher) and decompresses there, using
/// `init_size` bytes (boot.rst: "init_size"). Kernels before protocol 2.10
/// don't say; then only the loaded image counts.
pub(crate) fn bzimage_kernel_end(hdr: &setup_header, load_addr: u64, loaded_end: u64) -> u64 {
    let (version, relocatable, alignment, pref_address, init_size) = (
        hdr.version,
        hdr.relocatable_kernel,
        hdr.kernel_alignment,
        hdr.pref_address,
        hdr.init_size,
    );
    if version < PROTOCOL_2_10 {
        return loaded_end;
    }
    let runs_at = if relocatable != 0 && alignment.is_power_of_two() {
        load_addr
            .next_multiple_of(u64::from(alignment))
            .max(pref_address)
    } else {
        pref_address
    };
    loaded_end.max(runs_at.saturating_add(u64::from(init_size)))
}

/// Chooses where the initramfs goes: as high as allowed, page aligned.
///
/// Linux reads the initramfs in place, so it must be in RAM, below the
/// kernel's `initrd_addr_max` (pass the bzImage header's value; `None` means
/// a pre-2.03 kernel, whose limit is 0x37ffffff), below 4 GiB (the 32-bit
/// `ramdisk_image` field; we don't rely on `ext_ramdisk_image`), and above
/// `kernel_end` — for a bzImage that is the load address plus the header's
/// `init_size`, the room the kernel decompresses into. Highest placement keeps
/// it clear of everything the kernel allocates early from low memory.
pub(crate) fn initrd_address(
    ram: &[(u64, u64)],
    initrd_size: u64,
    initrd_addr_max: Option<u32>,
    kernel_end: u64,
) -> Result<u64, Error> {
    // initrd_addr_max is the highest address the initrd may *occupy*.
    let addr_limit = u64::from(initrd_addr_max.unwrap_or(LEGACY_INITRD_ADDR_MAX)) + 1;
    let kernel_end = kernel_end.next_multiple_of(PAGE_SIZE);
    let mem_mib = ram.iter().map(|r| r.1).sum::<u64>() / MIB;

    // Try the highest RAM range first; every range is clipped to the limits.
    let mut ranges: Vec<(u64, u64)> = ram.to_vec();
    ranges.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
    let mut best_limit = 0;
    for (start, len) in ranges {
        let end = start.saturating_add(len).min(FOUR_GIB).min(addr_limit);
        let low = start.max(kernel_end);
        if end <= low {
            continue;
        }
        best_limit = best_limit.max(end);
        if let Some(top) = end.checked_sub(initrd_size) {
            let addr = top & !(PAGE_SIZE - 1);
            if addr >= low {
                return Ok(addr);
            }
        }
    }
    Err(Error::InitrdDoesNotFit {
        size_mib: initrd_size.div_ceil(MIB),
        mem_mib,
        kernel_end,
        limit: if best_limit == 0 {
            addr_limit.min(FOUR_GIB)
        } else {
            best_limit
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{KERNEL_START, MMIO_GAP_END, MMIO_GAP_START, ram_ranges};

    fn mem(size: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)]).unwrap()
    }

    fn u8_at(m: &GuestMemoryMmap, a: u64) -> u8 {
        m.read_obj(GuestAddress(a)).unwrap()
    }
    fn u16_at(m: &GuestMemoryMmap, a: u64) -> u16 {
        m.read_obj(GuestAddress(a)).unwrap()
    }
    fn u32_at(m: &GuestMemoryMmap, a: u64) -> u32 {
        m.read_obj(GuestAddress(a)).unwrap()
    }
    fn u64_at(m: &GuestMemoryMmap, a: u64) -> u64 {
        m.read_obj(GuestAddress(a)).unwrap()
    }

    #[test]
    fn pci_off_is_added_unless_the_user_chose() {
        assert_eq!(
            with_no_pci("console=ttyS0 quiet"),
            "console=ttyS0 quiet pci=off"
        );
        assert_eq!(with_no_pci("  "), "pci=off");
        // The user's own pci= option stands (and is not doubled).
        assert_eq!(with_no_pci("pci=off quiet"), "pci=off quiet");
        assert_eq!(with_no_pci("quiet pci=noacpi"), "quiet pci=noacpi");
        // Only a whole `pci=` parameter counts, not one that merely contains it.
        assert_eq!(with_no_pci("xpci=1"), "xpci=1 pci=off");
    }

    #[test]
    fn cmdline_is_written_nul_terminated() {
        let m = mem(1 << 20);
        write_cmdline(&m, "console=ttyS0 quiet", 2047).unwrap();
        let mut buf = [0xffu8; 20];
        m.read_slice(&mut buf, GuestAddress(CMDLINE_START)).unwrap();
        assert_eq!(&buf, b"console=ttyS0 quiet\0");
    }

    #[test]
    fn cmdline_too_long_is_an_error() {
        let m = mem(1 << 20);
        // Exactly the kernel's limit is fine, one more byte is not.
        write_cmdline(&m, &"a".repeat(16), 16).unwrap();
        let err = write_cmdline(&m, &"a".repeat(17), 16).unwrap_err();
        assert!(matches!(err, Error::CmdlineTooLong { len: 17, max: 16 }));
        assert_eq!(
            err.to_string(),
            "kernel command line is 17 bytes, the limit is 16"
        );
        // Our own area caps a generous kernel limit.
        let err = write_cmdline(&m, &"a".repeat(CMDLINE_MAX_SIZE), usize::MAX).unwrap_err();
        assert!(matches!(err, Error::CmdlineTooLong { max, .. } if max == CMDLINE_MAX_SIZE - 1));
    }

    #[test]
    fn cmdline_with_nul_is_an_error() {
        let m = mem(1 << 20);
        let err = write_cmdline(&m, "root=/dev/vda\0init=/x", 2047).unwrap_err();
        assert!(matches!(err, Error::CmdlineHasNul));
    }

    #[test]
    fn e820_small_memory() {
        let e = e820_entries(&ram_ranges(128 << 20));
        assert_eq!(
            e,
            vec![
                (0, EBDA_START, E820_RAM),
                (EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED),
                (HIMEM_START, (128 << 20) - HIMEM_START, E820_RAM),
            ]
        );
    }

    #[test]
    fn e820_memory_above_the_hole() {
        let e = e820_entries(&ram_ranges(6 << 30));
        assert_eq!(e.len(), 4);
        assert_eq!(e[2], (HIMEM_START, MMIO_GAP_START - HIMEM_START, E820_RAM));
        assert_eq!(e[3], (MMIO_GAP_END, (6 << 30) - MMIO_GAP_START, E820_RAM));
        // No usable RAM inside the device hole or the legacy area.
        for &(a, s, t) in &e {
            if t == E820_RAM {
                assert!(a + s <= EBDA_START || a >= HIMEM_START);
                assert!(a + s <= MMIO_GAP_START || a >= MMIO_GAP_END);
            }
        }
        let ram: u64 = e.iter().filter(|e| e.2 == E820_RAM).map(|e| e.1).sum();
        assert_eq!(ram, (6 << 30) - (HIMEM_START - EBDA_START));
    }

    #[test]
    fn e820_tiny_memory_has_no_himem_entry() {
        let e = e820_entries(&[(0, 0x8000)]);
        assert_eq!(e, vec![(0, 0x8000, E820_RAM)]);
    }

    #[test]
    fn zero_page_fields_are_at_boot_protocol_offsets() {
        let m = mem(64 << 20);
        let ram = ram_ranges(64 << 20);
        let layout = BootLayout {
            ram: &ram,
            cmdline: "console=ttyS0",
            initrd: Some((0x300_0000, 0x12345)),
            rsdp: Some(0xe0000),
        };
        configure_linux(&m, &layout, None).unwrap();
        let zp = ZERO_PAGE_START;
        assert_eq!(u64_at(&m, zp + 0x070), 0xe0000, "acpi_rsdp_addr");
        assert_eq!(u8_at(&m, zp + 0x1e8), 3, "e820_entries");
        assert_eq!(u16_at(&m, zp + 0x1fe), 0xaa55, "boot_flag");
        assert_eq!(
            u32_at(&m, zp + 0x202),
            u32::from_le_bytes(*b"HdrS"),
            "header"
        );
        assert!(u16_at(&m, zp + 0x206) >= 0x020c, "version");
        assert_eq!(u8_at(&m, zp + 0x210), 0xff, "type_of_loader");
        let loadflags = u8_at(&m, zp + 0x211);
        assert_eq!(
            loadflags & (LOADED_HIGH | CAN_USE_HEAP),
            LOADED_HIGH | CAN_USE_HEAP
        );
        assert_eq!(u32_at(&m, zp + 0x218), 0x300_0000, "ramdisk_image");
        assert_eq!(u32_at(&m, zp + 0x21c), 0x12345, "ramdisk_size");
        assert_eq!(u16_at(&m, zp + 0x224), SETUP_HEAP_END, "heap_end_ptr");
        assert_eq!(u32_at(&m, zp + 0x228), CMDLINE_START as u32, "cmd_line_ptr");
        assert_eq!(u32_at(&m, zp + 0x238), 13, "cmdline_size");
        assert_eq!(u32_at(&m, zp + 0x0c8), 0, "ext_cmd_line_ptr");
        // e820 table: 20-byte packed entries from 0x2d0.
        let e = zp + 0x2d0;
        assert_eq!(
            (u64_at(&m, e), u64_at(&m, e + 8), u32_at(&m, e + 16)),
            (0, EBDA_START, 1)
        );
        let e = zp + 0x2d0 + 2 * 20;
        assert_eq!(
            (u64_at(&m, e), u64_at(&m, e + 8), u32_at(&m, e + 16)),
            (HIMEM_START, (64 << 20) - HIMEM_START, 1)
        );
    }

    #[test]
    fn zero_page_keeps_the_bzimage_header() {
        let m = mem(64 << 20);
        let ram = ram_ranges(64 << 20);
        let hdr = setup_header {
            setup_sects: 27,
            boot_flag: BOOT_FLAG_MAGIC,
            header: HDRS_MAGIC,
            version: 0x020d,
            xloadflags: XLF_KERNEL_64,
            init_size: 0x123_4000,
            loadflags: LOADED_HIGH,
            ..Default::default()
        };
        let layout = BootLayout {
            ram: &ram,
            cmdline: "",
            initrd: None,
            rsdp: None,
        };
        configure_linux(&m, &layout, Some(hdr)).unwrap();
        let zp = ZERO_PAGE_START;
        assert_eq!(u8_at(&m, zp + 0x1f1), 27, "setup_sects");
        assert_eq!(u16_at(&m, zp + 0x206), 0x020d, "version");
        assert_eq!(u16_at(&m, zp + 0x236), XLF_KERNEL_64, "xloadflags");
        assert_eq!(u32_at(&m, zp + 0x260), 0x123_4000, "init_size");
        assert_eq!(u8_at(&m, zp + 0x210), 0xff, "type_of_loader overrides");
        assert_eq!(u32_at(&m, zp + 0x218), 0, "no ramdisk");
        assert_eq!(u64_at(&m, zp + 0x070), 0, "no rsdp");
    }

    #[test]
    fn zero_page_outside_memory_is_an_error() {
        let m = mem(0x7800); // ends inside the zero page
        let ram = [(0, 0x7800)];
        let layout = BootLayout {
            ram: &ram,
            cmdline: "",
            initrd: None,
            rsdp: None,
        };
        let err = configure_linux(&m, &layout, None).unwrap_err();
        assert!(matches!(err, Error::WriteZeroPage(_)), "{err}");
    }

    #[test]
    fn pvh_start_info_fields() {
        let m = mem(64 << 20);
        let ram = ram_ranges(64 << 20);
        let layout = BootLayout {
            ram: &ram,
            cmdline: "console=hvc0",
            initrd: Some((0x200_0000, 0x4000)),
            rsdp: Some(0xe0000),
        };
        configure_pvh(&m, &layout).unwrap();
        // struct hvm_start_info, xen/include/public/arch-x86/hvm/start_info.h
        let si = PVH_INFO_START;
        assert_eq!(u32_at(&m, si), 0x336e_c578, "magic");
        assert_eq!(u32_at(&m, si + 4), 1, "version");
        assert_eq!(u32_at(&m, si + 12), 1, "nr_modules");
        assert_eq!(u64_at(&m, si + 16), PVH_MODLIST_START, "modlist_paddr");
        assert_eq!(u64_at(&m, si + 24), CMDLINE_START, "cmdline_paddr");
        assert_eq!(u64_at(&m, si + 32), 0xe0000, "rsdp_paddr");
        assert_eq!(u64_at(&m, si + 40), PVH_MEMMAP_START, "memmap_paddr");
        assert_eq!(u32_at(&m, si + 48), 3, "memmap_entries");
        // Module 0 is the initramfs.
        assert_eq!(u64_at(&m, PVH_MODLIST_START), 0x200_0000);
        assert_eq!(u64_at(&m, PVH_MODLIST_START + 8), 0x4000);
        // Memory map entries are 24 bytes: addr, size, type, reserved.
        let e = PVH_MEMMAP_START + 2 * 24;
        assert_eq!(u64_at(&m, e), HIMEM_START);
        assert_eq!(u64_at(&m, e + 8), (64 << 20) - HIMEM_START);
        assert_eq!(u32_at(&m, e + 16), E820_RAM);
        assert_eq!(u32_at(&m, PVH_MEMMAP_START + 24 + 16), E820_RESERVED);
    }

    #[test]
    fn pvh_without_initrd_has_no_modules() {
        let m = mem(64 << 20);
        let ram = ram_ranges(64 << 20);
        let layout = BootLayout {
            ram: &ram,
            cmdline: "",
            initrd: None,
            rsdp: None,
        };
        configure_pvh(&m, &layout).unwrap();
        assert_eq!(u32_at(&m, PVH_INFO_START + 12), 0);
        assert_eq!(u64_at(&m, PVH_INFO_START + 16), 0);
        assert_eq!(u64_at(&m, PVH_INFO_START + 32), 0);
    }

    fn bzimage_header(version: u16, xloadflags: u16) -> setup_header {
        setup_header {
            boot_flag: BOOT_FLAG_MAGIC,
            header: HDRS_MAGIC,
            version,
            xloadflags,
            kernel_alignment: 0x20_0000,
            pref_address: 0x100_0000,
            init_size: 0xbb_3000,
            ..Default::default()
        }
    }

    #[test]
    fn only_bzimages_with_a_64bit_entry_pass() {
        check_64bit_entry(&bzimage_header(0x020f, XLF_KERNEL_64 | 0x60)).unwrap();
        let err = check_64bit_entry(&bzimage_header(0x020f, 0)).unwrap_err();
        assert!(matches!(err, Error::No64BitEntry { xloadflags: 0, .. }));
        // Before 2.12 the field is padding, whatever it holds.
        let err = check_64bit_entry(&bzimage_header(0x020b, XLF_KERNEL_64)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the bzImage has no 64-bit entry point (boot protocol 2.11, \
             xloadflags 0x0 without XLF_KERNEL_64)"
        );
        let bad = setup_header {
            header: 0,
            ..bzimage_header(0x020f, XLF_KERNEL_64)
        };
        assert!(matches!(check_64bit_entry(&bad), Err(Error::NotABzImage)));
    }

    #[test]
    fn bzimage_kernel_end_covers_the_decompressed_kernel() {
        // Non-relocatable (the PVM test kernel): runs at pref_address.
        let hdr = bzimage_header(0x020f, XLF_KERNEL_64);
        assert_eq!(
            bzimage_kernel_end(&hdr, 0x10_0000, 0x20_0000),
            0x100_0000 + 0xbb_3000
        );
        // Relocatable, loaded below pref_address: still runs at pref_address.
        let reloc = setup_header {
            relocatable_kernel: 1,
            ..hdr
        };
        assert_eq!(
            bzimage_kernel_end(&reloc, 0x10_0000, 0x20_0000),
            0x100_0000 + 0xbb_3000
        );
        // Relocatable, loaded higher and misaligned: rounded up to 2 MiB.
        assert_eq!(
            bzimage_kernel_end(&reloc, 0x210_0000, 0x230_0000),
            0x220_0000 + 0xbb_3000
        );
        // Old protocol: only what was loaded.
        let old = bzimage_header(0x0209, 0);
        assert_eq!(bzimage_kernel_end(&old, 0x10_0000, 0x50_0000), 0x50_0000);
    }

    #[test]
    fn initrd_goes_high_and_page_aligned() {
        let ram = ram_ranges(256 << 20);
        let size = 5 * MIB + 123;
        let addr = initrd_address(&ram, size, Some(0x7fff_ffff), 0x200_0000).unwrap();
        assert_eq!(addr % PAGE_SIZE, 0);
        assert!(addr + size <= 256 << 20);
        // As high as possible: less than a page of slack at the top.
        assert!((256 << 20) - (addr + size) < PAGE_SIZE);
        assert!(addr >= 0x200_0000);
    }

    #[test]
    fn initrd_respects_initrd_addr_max() {
        let ram = ram_ranges(2 << 30);
        let addr = initrd_address(&ram, 8 * MIB, Some(0x3fff_ffff), KERNEL_START).unwrap();
        assert!(addr + 8 * MIB <= 0x4000_0000);
        assert_eq!(addr, 0x4000_0000 - 8 * MIB);
        // Old kernels without the field: 0x37ffffff.
        let addr = initrd_address(&ram, MIB, None, KERNEL_START).unwrap();
        assert_eq!(addr, 0x3800_0000 - MIB);
    }

    #[test]
    fn initrd_stays_below_4g_and_the_hole_with_high_ram() {
        let ram = ram_ranges(8 << 30);
        let addr = initrd_address(&ram, 16 * MIB, Some(u32::MAX), KERNEL_START).unwrap();
        assert_eq!(addr, MMIO_GAP_START - 16 * MIB);
    }

    #[test]
    fn initrd_stays_above_the_kernel() {
        let ram = ram_ranges(64 << 20);
        // Fits exactly between the kernel end and the top of RAM.
        let addr = initrd_address(&ram, 32 * MIB, Some(u32::MAX), 32 * MIB).unwrap();
        assert_eq!(addr, 32 * MIB);
        // One page more does not.
        assert!(initrd_address(&ram, 32 * MIB + 1, Some(u32::MAX), 32 * MIB).is_err());
    }

    #[test]
    fn initrd_too_big_is_a_clear_error() {
        let ram = ram_ranges(256 << 20);
        let err = initrd_address(&ram, 300 * MIB, Some(u32::MAX), KERNEL_START).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("initrd of 300 MiB does not fit in 256 MiB of guest memory"),
            "{msg}"
        );
    }

    #[test]
    fn setup_header_reads_back_what_was_written() {
        let hdr = setup_header {
            setup_sects: 3,
            boot_flag: BOOT_FLAG_MAGIC,
            header: HDRS_MAGIC,
            version: 0x020f,
            kernel_version: 0x1234,
            payload_offset: 0x40,
            payload_length: 0x8000,
            ..Default::default()
        };
        let mut image = vec![0u8; 0x400];
        write_setup_header(&mut image, &hdr).unwrap();
        // The fields sit at boot.rst's offsets in the file.
        assert_eq!(&image[0x202..0x206], b"HdrS");
        assert_eq!(image[0x1f1], 3);
        assert_eq!(image[0x20e..0x210], 0x1234u16.to_le_bytes());
        assert_eq!(image[0x248..0x24c], 0x40u32.to_le_bytes());
        let back = read_setup_header(&image).unwrap();
        assert_eq!({ back.payload_length }, 0x8000);
        assert_eq!({ back.version }, 0x020f);

        // Too short to hold it, or without the magic: no header.
        assert!(read_setup_header(&image[..0x260]).is_none());
        assert!(write_setup_header(&mut [0u8; 0x260], &hdr).is_none());
        image[0x202] = b'X';
        assert!(read_setup_header(&image).is_none());
    }
}
