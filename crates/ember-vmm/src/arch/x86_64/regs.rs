//! CPU state at the kernel entry point: the boot GDT/IDT and identity page
//! tables in guest memory, and the special, general and FPU registers.
//!
//! The boot vCPU starts directly in the mode the kernel's entry point wants —
//! 64-bit long mode for the Linux 64-bit boot protocol, 32-bit protected mode
//! for PVH — so no firmware or real-mode code ever runs (under this machine's
//! software KVM every guest kernel-mode instruction is expensive).
//!
//! The boot GDT, at `BOOT_GDT_START`:
//!
//! | selector | descriptor                              | used by                    |
//! |----------|-----------------------------------------|----------------------------|
//! | 0x00     | null (the CPU requires it)              |                            |
//! | 0x08     | 32-bit flat code, execute/read          | PVH entry (`CS`)           |
//! | 0x10     | 64-bit code, execute/read               | Linux `__BOOT_CS`          |
//! | 0x18     | flat data, read/write                   | Linux `__BOOT_DS`, PVH data|
//!
//! Linux's 64-bit boot protocol fixes `__BOOT_CS` = 0x10 and `__BOOT_DS` =
//! 0x18; PVH leaves selectors free, so its code segment takes the spare slot.
//! No TSS descriptor is needed in the table: the task register is only
//! consulted on privilege changes and task switches, which cannot happen before
//! the kernel loads its own GDT and TSS; VM entry only checks TR's hidden
//! (cached) part, which we set directly.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{
    BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, PDE_START, PDPTE_START, PML4_START,
    PVH_INFO_START, ZERO_PAGE_START,
};

/// Selector of the 32-bit flat code segment (PVH entry).
pub(crate) const CODE32_SELECTOR: u16 = 0x08;
/// Selector of the 64-bit code segment: Linux's `__BOOT_CS`.
pub(crate) const CODE64_SELECTOR: u16 = 0x10;
/// Selector of the flat data segment: Linux's `__BOOT_DS`.
pub(crate) const DATA_SELECTOR: u16 = 0x18;

// Segment descriptor fields, as a 16-bit "flags" word: the access byte in
// bits 0-7 and the flags nibble (descriptor bits 52-55) in bits 12-15.

/// Type 0b1011: code, execute/read, accessed. The accessed bit is preset so
/// the CPU never writes back into the GDT, and VM entry insists on it for CS.
const TYPE_CODE_EXEC_READ: u16 = 0xb;
/// Type 0b0011: data, read/write, accessed (accessed for the same reason).
const TYPE_DATA_READ_WRITE: u16 = 0x3;
/// Type 0b1011 for a system descriptor: busy TSS (32-bit, or 64-bit in long
/// mode). VM entry requires TR to be a busy TSS.
const TYPE_TSS_BUSY: u8 = 0xb;
/// S: a code/data descriptor (clear for system descriptors such as a TSS).
const ACCESS_CODE_OR_DATA: u16 = 1 << 4;
/// DPL 0: kernel privilege (bits 5-6 left clear).
const ACCESS_DPL0: u16 = 0;
/// P: the segment is present.
const ACCESS_PRESENT: u16 = 1 << 7;
/// L: 64-bit code segment (only meaningful for code in long mode).
const FLAG_LONG: u16 = 1 << 13;
/// D/B: 32-bit default operand size / 4 GiB stack bound.
const FLAG_DB_32BIT: u16 = 1 << 14;
/// G: the limit counts 4 KiB pages, so limit 0xfffff covers 4 GiB.
const FLAG_GRANULARITY_4K: u16 = 1 << 15;

/// Largest 20-bit limit: with 4 KiB granularity, the whole 4 GiB.
const FLAT_LIMIT: u32 = 0xf_ffff;
/// A 32-bit TSS is 104 bytes; its limit is size - 1.
const TSS_LIMIT: u32 = 0x67;

const CODE32_FLAGS: u16 = FLAG_GRANULARITY_4K
    | FLAG_DB_32BIT
    | ACCESS_PRESENT
    | ACCESS_DPL0
    | ACCESS_CODE_OR_DATA
    | TYPE_CODE_EXEC_READ;
/// D/B must be clear when L is set.
const CODE64_FLAGS: u16 = FLAG_GRANULARITY_4K
    | FLAG_LONG
    | ACCESS_PRESENT
    | ACCESS_DPL0
    | ACCESS_CODE_OR_DATA
    | TYPE_CODE_EXEC_READ;
const DATA_FLAGS: u16 = FLAG_GRANULARITY_4K
    | FLAG_DB_32BIT
    | ACCESS_PRESENT
    | ACCESS_DPL0
    | ACCESS_CODE_OR_DATA
    | TYPE_DATA_READ_WRITE;

/// The boot GDT, indexed by selector / 8.
const GDT: [u64; 4] = [
    0,
    gdt_entry(CODE32_FLAGS, 0, FLAT_LIMIT),
    gdt_entry(CODE64_FLAGS, 0, FLAT_LIMIT),
    gdt_entry(DATA_FLAGS, 0, FLAT_LIMIT),
];
/// The boot IDT: one empty 8-byte slot. Any exception before the kernel
/// installs its own IDT then becomes a triple fault (a clean shutdown exit)
/// instead of a jump into garbage.
const IDT_BYTES: usize = 8;

// Control-register bits.

/// CR0.PE: protected mode.
const CR0_PE: u64 = 1 << 0;
/// CR0.ET: 387-style FPU present; hard-wired to 1 on every CPU since the 486.
const CR0_ET: u64 = 1 << 4;
/// CR0.PG: paging (required, with EFER.LME, for long mode).
const CR0_PG: u64 = 1 << 31;
/// CR4.PAE: 64-bit page-table entries, required for long mode.
const CR4_PAE: u64 = 1 << 5;
/// EFER.LME: long mode enable.
const EFER_LME: u64 = 1 << 8;
/// EFER.LMA: long mode active. The CPU sets it when paging turns on with LME;
/// since we enter with paging already on, we must set it ourselves.
const EFER_LMA: u64 = 1 << 10;

// Page-table entry bits.

/// Present.
const PTE_PRESENT: u64 = 1 << 0;
/// Writable.
const PTE_WRITABLE: u64 = 1 << 1;
/// In a page-directory entry: maps a 2 MiB page rather than a page table.
const PDE_PAGE_SIZE: u64 = 1 << 7;
/// 2 MiB.
const HUGE_PAGE_SIZE: u64 = 1 << 21;
/// Entries per page-table page.
const ENTRIES_PER_TABLE: u64 = 512;

/// RFLAGS bit 1 is reserved and always 1; everything else (IF in particular:
/// both protocols want interrupts off) is clear.
const RFLAGS_RESERVED: u64 = 1 << 1;
/// FCW after FNINIT: all x87 exceptions masked, 64-bit precision, round to nearest.
const FCW_DEFAULT: u16 = 0x37f;
/// MXCSR at reset: all SSE exceptions masked, round to nearest.
const MXCSR_DEFAULT: u32 = 0x1f80;

/// Errors while writing boot CPU structures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Guest memory does not cover the boot GDT.
    #[error("cannot write the boot GDT to guest memory")]
    Gdt(#[source] GuestMemoryError),
    /// Guest memory does not cover the boot IDT.
    #[error("cannot write the boot IDT to guest memory")]
    Idt(#[source] GuestMemoryError),
    /// Guest memory does not cover the page tables.
    #[error("cannot write the identity page tables to guest memory")]
    PageTables(#[source] GuestMemoryError),
}

/// Encodes a segment descriptor. The base and limit are scattered over the
/// 8 bytes for 80286 compatibility:
/// limit 0-15 | base 0-23 | access byte | limit 16-19 | flags | base 24-31.
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (flags as u64, base as u64, limit as u64);
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// The hidden (cached) part of a segment register, as the CPU would load it
/// from GDT entry `selector`.
fn segment(selector: u16) -> kvm_segment {
    let entry = GDT[usize::from(selector >> 3)];
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    let raw_limit = (entry & 0xffff) | ((entry >> 32) & 0xf_0000);
    let access = (entry >> 40) as u8;
    let flags = (entry >> 52) as u8 & 0xf;
    let g = (flags >> 3) & 1;
    kvm_segment {
        base,
        // With G set the limit counts pages: the low 12 bits become all ones.
        limit: if g == 1 {
            ((raw_limit << 12) | 0xfff) as u32
        } else {
            raw_limit as u32
        },
        selector,
        type_: access & 0xf,
        present: (access >> 7) & 1,
        dpl: (access >> 5) & 3,
        db: (flags >> 2) & 1,
        s: (access >> 4) & 1,
        l: (flags >> 1) & 1,
        g,
        avl: flags & 1,
        unusable: 0,
        padding: 0,
    }
}

/// A busy TSS at address 0, as PVH demands for TR (and VM entry accepts in
/// long mode too). The kernel loads its real TSS long before it needs one.
fn boot_tr() -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: TSS_LIMIT,
        selector: 0,
        type_: TYPE_TSS_BUSY,
        present: 1,
        s: 0,
        ..Default::default()
    }
}

/// Writes the boot GDT at `BOOT_GDT_START` and an empty IDT at `BOOT_IDT_START`.
pub(crate) fn write_gdt_and_idt(mem: &GuestMemoryMmap) -> Result<(), Error> {
    let gdt: Vec<u8> = GDT.iter().flat_map(|e| e.to_le_bytes()).collect();
    mem.write_slice(&gdt, GuestAddress(BOOT_GDT_START))
        .map_err(Error::Gdt)?;
    mem.write_slice(&[0; IDT_BYTES], GuestAddress(BOOT_IDT_START))
        .map_err(Error::Idt)
}

/// Writes 4-level page tables identity-mapping the first 1 GiB with 2 MiB
/// pages: `PML4[0]` → PDPT, `PDPT[0]` → PD, `PD[0..512]` → 0..1 GiB.
///
/// Long mode cannot run without paging. The 64-bit boot protocol only asks
/// that the kernel image, zero page and command line be identity-mapped;
/// `startup_64` then switches to its own tables.
pub(crate) fn write_identity_page_tables(mem: &GuestMemoryMmap) -> Result<(), Error> {
    let write = |value: u64, addr: u64| {
        mem.write_obj(value, GuestAddress(addr))
            .map_err(Error::PageTables)
    };
    write(PDPTE_START | PTE_PRESENT | PTE_WRITABLE, PML4_START)?;
    write(PDE_START | PTE_PRESENT | PTE_WRITABLE, PDPTE_START)?;
    let pd: Vec<u8> = (0..ENTRIES_PER_TABLE)
        .flat_map(|i| {
            ((i * HUGE_PAGE_SIZE) | PTE_PRESENT | PTE_WRITABLE | PDE_PAGE_SIZE).to_le_bytes()
        })
        .collect();
    mem.write_slice(&pd, GuestAddress(PDE_START))
        .map_err(Error::PageTables)
}

fn set_descriptor_tables(sregs: &mut kvm_sregs) {
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (GDT.len() * 8 - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = (IDT_BYTES - 1) as u16;
}

fn set_data_segments(sregs: &mut kvm_sregs) {
    let data = segment(DATA_SELECTOR);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = boot_tr();
}

/// Special registers for the 64-bit Linux boot protocol entry: long mode with
/// paging on the identity tables, CS = `__BOOT_CS`, data segments =
/// `__BOOT_DS`. Fields not named here (LDT, APIC base, CR8) keep the values
/// KVM reported.
pub(crate) fn long_mode_sregs(sregs: &mut kvm_sregs) {
    set_descriptor_tables(sregs);
    sregs.cs = segment(CODE64_SELECTOR);
    set_data_segments(sregs);
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
}

/// Special registers for the PVH 32-bit entry: flat 4 GiB segments, CR0.PE
/// only (paging off), CR4 = 0, EFER = 0, TR a busy 32-bit TSS with base 0 and
/// limit 0x67 — exactly the state the PVH spec lists.
pub(crate) fn protected_mode_sregs(sregs: &mut kvm_sregs) {
    set_descriptor_tables(sregs);
    sregs.cs = segment(CODE32_SELECTOR);
    set_data_segments(sregs);
    sregs.cr0 = CR0_PE;
    sregs.cr3 = 0;
    sregs.cr4 = 0;
    sregs.efer = 0;
}

/// General registers for the 64-bit Linux entry: `%rsi` = zero page.
pub(crate) fn linux64_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsi: ZERO_PAGE_START,
        // Not required by the protocol, but a valid stack below the page
        // tables makes an early fault debuggable instead of a double fault.
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rflags: RFLAGS_RESERVED,
        ..Default::default()
    }
}

/// General registers for the PVH entry: `%ebx` = `hvm_start_info`.
pub(crate) fn pvh_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rbx: PVH_INFO_START,
        rflags: RFLAGS_RESERVED,
        ..Default::default()
    }
}

/// FPU state at entry: as after FNINIT, with SSE exceptions masked.
pub(crate) fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: FCW_DEFAULT,
        mxcsr: MXCSR_DEFAULT,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    /// Decodes a descriptor from its bytes in guest memory, independently of
    /// `segment()`: (base, limit in bytes - 1, access byte, flags nibble).
    fn decode(m: &GuestMemoryMmap, selector: u16) -> (u32, u32, u8, u8) {
        let mut d = [0u8; 8];
        m.read_slice(&mut d, GuestAddress(BOOT_GDT_START + u64::from(selector)))
            .unwrap();
        let base = u32::from_le_bytes([d[2], d[3], d[4], d[7]]);
        let mut limit = u32::from(d[0]) | u32::from(d[1]) << 8 | u32::from(d[6] & 0xf) << 16;
        let flags = d[6] >> 4;
        if flags & 0x8 != 0 {
            limit = limit << 12 | 0xfff;
        }
        (base, limit, d[5], flags)
    }

    #[test]
    fn gdt_descriptors_decode_to_flat_segments() {
        let m = mem();
        write_gdt_and_idt(&m).unwrap();
        assert_eq!(m.read_obj::<u64>(GuestAddress(BOOT_GDT_START)).unwrap(), 0);
        // 32-bit code: present, DPL0, code, exec/read, accessed; G=1, D=1, L=0.
        assert_eq!(decode(&m, CODE32_SELECTOR), (0, 0xffff_ffff, 0x9b, 0b1100));
        // 64-bit code: G=1, D=0, L=1.
        assert_eq!(decode(&m, CODE64_SELECTOR), (0, 0xffff_ffff, 0x9b, 0b1010));
        // Data: present, DPL0, data, read/write, accessed; G=1, B=1.
        assert_eq!(decode(&m, DATA_SELECTOR), (0, 0xffff_ffff, 0x93, 0b1100));
        // Well-known raw encodings of the same descriptors.
        assert_eq!(GDT[1], 0x00cf_9b00_0000_ffff);
        assert_eq!(GDT[2], 0x00af_9b00_0000_ffff);
        assert_eq!(GDT[3], 0x00cf_9300_0000_ffff);
        // The IDT is empty.
        assert_eq!(m.read_obj::<u64>(GuestAddress(BOOT_IDT_START)).unwrap(), 0);
    }

    #[test]
    fn gdt_encodes_a_scattered_base_and_limit() {
        let e = gdt_entry(DATA_FLAGS, 0x1234_5678, 0xa_bcde);
        assert_eq!(e, 0x12ca_9334_5678_bcde);
    }

    #[test]
    fn sregs_segments_match_the_gdt() {
        let m = mem();
        write_gdt_and_idt(&m).unwrap();
        let mut s = kvm_sregs::default();
        long_mode_sregs(&mut s);
        for (seg, sel) in [
            (s.cs, CODE64_SELECTOR),
            (s.ds, DATA_SELECTOR),
            (s.ss, DATA_SELECTOR),
        ] {
            let (base, limit, access, flags) = decode(&m, sel);
            assert_eq!(seg.selector, sel);
            assert_eq!(seg.base, u64::from(base));
            assert_eq!(seg.limit, limit);
            assert_eq!(seg.type_, access & 0xf);
            assert_eq!(seg.present, access >> 7);
            assert_eq!(seg.s, (access >> 4) & 1);
            assert_eq!(
                (seg.g, seg.db, seg.l),
                (flags >> 3, (flags >> 2) & 1, (flags >> 1) & 1)
            );
        }
    }

    #[test]
    fn long_mode_sregs_values() {
        let mut s = kvm_sregs::default();
        long_mode_sregs(&mut s);
        assert_eq!(s.cs.selector, 0x10);
        assert_eq!((s.cs.l, s.cs.db), (1, 0));
        for seg in [s.ds, s.es, s.fs, s.gs, s.ss] {
            assert_eq!(seg.selector, 0x18);
            assert_eq!(seg.type_, 3);
        }
        assert_eq!(s.cr0, 0x8000_0011, "PG | ET | PE");
        assert_eq!(s.cr4, 0x20, "PAE");
        assert_eq!(s.efer, 0x500, "LMA | LME");
        assert_eq!(s.cr3, PML4_START);
        assert_eq!((s.gdt.base, s.gdt.limit), (BOOT_GDT_START, 31));
        assert_eq!((s.idt.base, s.idt.limit), (BOOT_IDT_START, 7));
        assert_eq!((s.tr.type_, s.tr.present, s.tr.s), (11, 1, 0));
    }

    #[test]
    fn protected_mode_sregs_values() {
        let mut s = kvm_sregs {
            cr4: CR4_PAE,
            efer: EFER_LME,
            ..Default::default()
        };
        protected_mode_sregs(&mut s);
        assert_eq!(s.cs.selector, CODE32_SELECTOR);
        assert_eq!((s.cs.l, s.cs.db, s.cs.limit), (0, 1, 0xffff_ffff));
        assert_eq!(s.ss.db, 1);
        assert_eq!(s.cr0, 1, "PE only");
        assert_eq!((s.cr4, s.efer), (0, 0));
        assert_eq!((s.tr.base, s.tr.limit, s.tr.type_), (0, 0x67, 11));
    }

    #[test]
    fn page_tables_identity_map_the_first_gib() {
        let m = mem();
        write_identity_page_tables(&m).unwrap();
        let pml4: u64 = m.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPTE_START | 0x3);
        let pdpte: u64 = m.read_obj(GuestAddress(PDPTE_START)).unwrap();
        assert_eq!(pdpte, PDE_START | 0x3);
        // Walk a few addresses through the tables, as the MMU would.
        for vaddr in [0u64, 0x7000, 0x100_0000, 0x3fff_ffff] {
            let pml4e: u64 = m
                .read_obj(GuestAddress(PML4_START + ((vaddr >> 39) & 511) * 8))
                .unwrap();
            let pdpte: u64 = m
                .read_obj(GuestAddress((pml4e & !0xfff) + ((vaddr >> 30) & 511) * 8))
                .unwrap();
            let pde: u64 = m
                .read_obj(GuestAddress((pdpte & !0xfff) + ((vaddr >> 21) & 511) * 8))
                .unwrap();
            assert_eq!(pde & 0x83, 0x83, "present, writable, 2 MiB page");
            let paddr = (pde & !0x1f_ffff) | (vaddr & 0x1f_ffff);
            assert_eq!(paddr, vaddr);
        }
        // The 513th 2 MiB page (1 GiB) is not mapped by this PDPT entry.
        let pdpte1: u64 = m.read_obj(GuestAddress(PDPTE_START + 8)).unwrap();
        assert_eq!(pdpte1 & PTE_PRESENT, 0);
    }

    #[test]
    fn entry_registers() {
        let r = linux64_regs(0x100_0200);
        assert_eq!((r.rip, r.rsi, r.rflags), (0x100_0200, ZERO_PAGE_START, 2));
        assert_eq!((r.rsp, r.rbp), (BOOT_STACK_POINTER, BOOT_STACK_POINTER));
        let r = pvh_regs(0x100_0000);
        assert_eq!((r.rip, r.rbx, r.rflags), (0x100_0000, PVH_INFO_START, 2));
        let f = boot_fpu();
        assert_eq!((f.fcw, f.mxcsr), (0x37f, 0x1f80));
    }

    #[test]
    fn writes_outside_memory_fail_cleanly() {
        let small = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        write_gdt_and_idt(&small).unwrap();
        assert!(matches!(
            write_identity_page_tables(&small),
            Err(Error::PageTables(_))
        ));
    }
}
