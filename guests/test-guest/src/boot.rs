//! The CPL0 part: three entry points, prebuilt tables, and the exception stubs.
//!
//! Under a software KVM (PVM) every guest CPL0 instruction is emulated and
//! costs microseconds, and some instructions can't be emulated at all. So the
//! kernel-mode code here is straight-line (no loops on the boot path), every
//! table is a constant built at compile time, and the code only does what the
//! CPU needs to run us in ring 3: our page tables, GDT/TSS, IDT, two CPUIDs
//! (the TSC rate, as the VMM reports it), then `iretq`. After that, ring 0
//! runs only for exceptions: a #GP handler that emulates ring 3's port I/O
//! where the KVM ignores IOPL (PVM), and a report-and-exit for the rest.
//!
//! Fixed addresses (must agree with `link.ld`, which asserts them):
//! the tables live in one static at [`TABLES_ADDR`], the exception stubs at
//! [`VECTORS_ADDR`], 16 bytes apart.

use core::mem::offset_of;

/// Where the linker script places [`BootTables`].
const TABLES_ADDR: u64 = 0x10_2000;
/// Where the linker script places the 256 exception stubs.
const VECTORS_ADDR: u64 = 0x10_1000;
/// Size of one exception stub (`.balign 16` in the assembly).
const VECTOR_STUB_SIZE: u64 = 16;

/// How we were entered; passed to `ember_main` in RDI.
pub const ENTRY_PVH: u64 = 1;
/// The Linux 64-bit boot protocol (RSI = zero page).
pub const ENTRY_LINUX64: u64 = 2;
/// The Linux 32-bit boot protocol (ESI = zero page), e.g. after a real-mode setup stub.
pub const ENTRY_LINUX32: u64 = 3;

/// GDT selectors. User data precedes user code (the SYSRET layout, harmless here).
const KERNEL_CS: u64 = 0x08;
const USER_DS: u64 = 0x18 | 3;
const USER_CS: u64 = 0x20 | 3;
const TSS_SEL: u64 = 0x28;

/// Page-table entry bits.
const PTE_PRESENT: u64 = 1 << 0;
const PTE_WRITE: u64 = 1 << 1;
/// Ring 3 runs everything, so every mapping is a user mapping.
const PTE_USER: u64 = 1 << 2;
/// Uncached: for the device hole (MMIO must not be cached or combined).
const PTE_PCD: u64 = 1 << 4;
/// Pre-set accessed/dirty so the CPU (an emulator, under PVM) never writes them back.
const PTE_ACCESSED: u64 = 1 << 5;
const PTE_DIRTY: u64 = 1 << 6;
/// A 2 MiB page in a page directory.
const PTE_HUGE: u64 = 1 << 7;
const TABLE_FLAGS: u64 = PTE_PRESENT | PTE_WRITE | PTE_USER | PTE_ACCESSED;
/// Start of the 32-bit device hole (ember's `layout::MMIO_GAP_START`).
const MMIO_GAP_START: u64 = 0xc000_0000;

/// Control-register values, written whole (no read-modify-write: fewer
/// emulated instructions, and a known state whatever the VMM left).
/// CR0: PE | MP | ET | NE | WP | PG (EM and TS clear: ring 3 uses SSE).
const CR0_VALUE: u64 = 0x8001_0033;
/// CR4: PAE | OSFXSR | OSXMMEXCPT (SSE is part of the x86_64 Rust ABI).
const CR4_VALUE: u64 = (1 << 5) | (1 << 9) | (1 << 10);
const MSR_EFER: u64 = 0xc000_0080;
/// EFER: LME only (NXE off: our PTEs never set NX; SCE off: no SYSCALL).
const EFER_VALUE: u64 = 1 << 8;
/// RFLAGS for ring 3: IOPL=3 (port I/O allowed), IF=0 (we poll), bit 1 reserved-set.
const USER_RFLAGS: u64 = (3 << 12) | (1 << 1);

/// Bytes of CPL0 stack (exception handlers only: they print and stop).
const KERNEL_STACK_SIZE: usize = 4096;
/// A 64-bit TSS is 104 bytes; we keep it as 26 dwords.
const TSS_DWORDS: usize = 26;
const TSS_LIMIT: u64 = 103;

/// Everything CPL0 needs, in one page-aligned static at a fixed address.
#[repr(C, align(4096))]
pub struct BootTables {
    pml4: [u64; 512],
    pdpt: [u64; 512],
    /// Five page directories: 0–5 GiB in 2 MiB pages (the fifth for a
    /// virtio-mem region at 4 GiB).
    pd: [[u64; 512]; 5],
    /// 256 interrupt gates, 16 bytes each.
    idt: [u64; 512],
    kernel_stack: [u8; KERNEL_STACK_SIZE],
    gdt: [u64; 7],
    tss: [u32; TSS_DWORDS],
    /// lgdt/lidt operands: limit (u16) then base (u64), packed as 5 words.
    gdtr: [u16; 5],
    idtr: [u16; 5],
}

const fn field_addr(offset: usize) -> u64 {
    TABLES_ADDR + offset as u64
}
const PML4_ADDR: u64 = field_addr(offset_of!(BootTables, pml4));
const PDPT_ADDR: u64 = field_addr(offset_of!(BootTables, pdpt));
const PD_ADDR: u64 = field_addr(offset_of!(BootTables, pd));
const IDT_ADDR: u64 = field_addr(offset_of!(BootTables, idt));
const GDT_ADDR: u64 = field_addr(offset_of!(BootTables, gdt));
const TSS_ADDR: u64 = field_addr(offset_of!(BootTables, tss));
const GDTR_ADDR: u64 = field_addr(offset_of!(BootTables, gdtr));
const IDTR_ADDR: u64 = field_addr(offset_of!(BootTables, idtr));
const KERNEL_STACK_TOP: u64 = field_addr(offset_of!(BootTables, kernel_stack) + KERNEL_STACK_SIZE);

const fn page_tables() -> ([u64; 512], [u64; 512], [[u64; 512]; 5]) {
    let mut pml4 = [0; 512];
    pml4[0] = PDPT_ADDR | TABLE_FLAGS;
    let mut pdpt = [0; 512];
    let mut pd = [[0; 512]; 5];
    let mut g = 0;
    while g < 5 {
        pdpt[g] = (PD_ADDR + g as u64 * 4096) | TABLE_FLAGS;
        let mut i = 0;
        while i < 512 {
            let addr = ((g as u64) << 30) | ((i as u64) << 21);
            let cache = if addr >= MMIO_GAP_START && addr < 1 << 32 {
                PTE_PCD
            } else {
                0
            };
            pd[g][i] = addr | TABLE_FLAGS | PTE_DIRTY | PTE_HUGE | cache;
            i += 1;
        }
        g += 1;
    }
    (pml4, pdpt, pd)
}

/// Interrupt gates (type 0xE, DPL 0, present) to stub `v` for every vector.
const fn idt() -> [u64; 512] {
    let mut idt = [0; 512];
    let mut v = 0;
    while v < 256 {
        let handler = VECTORS_ADDR + v as u64 * VECTOR_STUB_SIZE;
        idt[2 * v] = (handler & 0xffff)
            | (KERNEL_CS << 16)
            | (0x8e << 40)
            | (((handler >> 16) & 0xffff) << 48);
        idt[2 * v + 1] = handler >> 32;
        v += 1;
    }
    idt
}

const fn gdt() -> [u64; 7] {
    // Access 0x89: present, DPL 0, available 64-bit TSS. Base split per the SDM.
    let tss_low = TSS_LIMIT
        | ((TSS_ADDR & 0xff_ffff) << 16)
        | (0x89 << 40)
        | (((TSS_ADDR >> 24) & 0xff) << 56);
    [
        0,
        0x00af_9a00_0000_ffff, // 0x08 kernel code, 64-bit
        0x00cf_9200_0000_ffff, // 0x10 kernel data
        0x00cf_f200_0000_ffff, // 0x18 user data (DPL 3)
        0x00af_fa00_0000_ffff, // 0x20 user code, 64-bit (DPL 3)
        tss_low,               // 0x28 TSS, 16 bytes
        TSS_ADDR >> 32,
    ]
}

const fn tss() -> [u32; TSS_DWORDS] {
    let mut tss = [0; TSS_DWORDS];
    // rsp0 (offset 4): the stack the CPU switches to on a fault from ring 3.
    tss[1] = KERNEL_STACK_TOP as u32;
    tss[2] = (KERNEL_STACK_TOP >> 32) as u32;
    // I/O map base (offset 102) = the limit: no bitmap; IOPL=3 grants the ports.
    tss[25] = (TSS_LIMIT as u32 + 1) << 16;
    tss
}

const fn pseudo_descriptor(limit: u64, base: u64) -> [u16; 5] {
    [
        limit as u16,
        base as u16,
        (base >> 16) as u16,
        (base >> 32) as u16,
        (base >> 48) as u16,
    ]
}

const fn boot_tables() -> BootTables {
    let (pml4, pdpt, pd) = page_tables();
    BootTables {
        pml4,
        pdpt,
        pd,
        idt: idt(),
        kernel_stack: [0; KERNEL_STACK_SIZE],
        gdt: gdt(),
        tss: tss(),
        gdtr: pseudo_descriptor(7 * 8 - 1, GDT_ADDR),
        idtr: pseudo_descriptor(256 * 16 - 1, IDT_ADDR),
    }
}

/// The CPU reads and writes these (TSS busy bit, the stack); Rust never does.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".boot.tables")]
#[used]
static mut ember_boot_tables: BootTables = boot_tables();

// Entry points. Each instruction's reason is beside it.
core::arch::global_asm!(
    r#"
    .section .boot.entry32, "ax"
    .code32
    .global ember_entry32
ember_entry32:
    /* Linux 32-bit boot protocol (0x100000 = code32_start): ESI = zero page. */
    movb $0x40, %al                 /* boot mark 0x40: first guest instruction */
    outb %al, $0x80
    movl ${linux32}, %edi           /* tell main how we came in */
    jmp ember_common32

    .balign 64
    .global ember_entry_pvh
ember_entry_pvh:
    /* Xen PVH entry (32-bit, paging off): EBX = hvm_start_info. */
    movb $0x40, %al                 /* boot mark 0x40: first guest instruction */
    outb %al, $0x80
    movl %ebx, %esi                 /* main's second argument: the start info */
    movl ${pvh}, %edi
ember_common32:
    cli                             /* no interrupts until ring 3 (IF stays 0 there) */
    lgdt {gdtr}                     /* our GDT: its 64-bit code segment is needed next */
    movl ${cr4}, %eax               /* PAE is required for long mode; OSFXSR/OSXMMEXCPT for SSE */
    movl %eax, %cr4
    movl ${pml4}, %eax              /* our identity map, prebuilt */
    movl %eax, %cr3
    movl ${efer}, %ecx              /* EFER.LME: long mode on the next CR0.PG */
    movl ${efer_value}, %eax
    xorl %edx, %edx
    wrmsr
    movl ${cr0}, %eax               /* paging on: we are now in compatibility mode */
    movl %eax, %cr0
    ljmp ${kernel_cs}, $ember_from32 /* load a 64-bit CS: long mode proper */

    .section .boot.entry64, "ax"
    .code64
    .global ember_entry64
ember_entry64:
    /* Linux 64-bit boot protocol (load address + 0x200): RSI = zero page. */
    movb $0x40, %al                 /* boot mark 0x40: first guest instruction */
    outb %al, $0x80
    cli                             /* no interrupts until ring 3 */
    movl ${linux64}, %edi           /* tell main how we came in (RSI already set) */
    lgdt {gdtr}                     /* our GDT: user segments and the TSS */
    movl ${cr4}, %eax               /* keep PAE; add OSFXSR/OSXMMEXCPT for SSE */
    movq %rax, %cr4
    movl ${pml4}, %eax              /* our map: the VMM's covers 1 GiB, supervisor-only */
    movq %rax, %cr3
    movl ${cr0}, %eax               /* a known CR0: EM/TS clear for SSE, WP set */
    movq %rax, %cr0
    jmp ember_common64

    .section .boot.text, "ax"
ember_from32:
    movl %esi, %esi                 /* upper halves are undefined after the mode switch */
    movl %edi, %edi
ember_common64:
    movl ${kstack}, %esp            /* a CPL0 stack we own, for the iretq frame */
    movw ${tss_sel}, %ax            /* TSS.rsp0: where faults from ring 3 land */
    ltr %ax
    lidt {idtr}                     /* faults report themselves instead of triple-faulting */
    movl ${hv_leaf}, %eax           /* CPUID here, not in ring 3: on PVM ring 3's CPUID */
    cpuid                           /* runs on the host CPU; ring 0's is the VMM's table */
    movl %eax, %r8d                 /* highest hypervisor leaf */
    movl ${timing_leaf}, %eax
    xorl %ecx, %ecx
    cpuid                           /* timing leaf: EAX = TSC kHz, if the leaf exists */
    movl %r8d, %edx                 /* main's 3rd argument: highest hypervisor leaf */
    movl %eax, %ecx                 /* main's 4th argument: the timing leaf's EAX */
    pushq ${user_ds}                /* iretq frame: SS */
    leaq ember_user_stack_top - 8(%rip), %rax
    pushq %rax                      /* RSP (ABI: entry as if called, so 8 mod 16) */
    pushq ${rflags}                 /* RFLAGS: IOPL=3, IF=0 */
    pushq ${user_cs}                /* CS: ring 3, 64-bit */
    leaq {main}(%rip), %rax
    pushq %rax                      /* RIP */
    iretq                           /* to ring 3: main(RDI entry kind, RSI info, RDX, RCX) */

    /* #GP. On a software KVM (PVM) ring 3 runs on the host CPU with the
       host's IOPL 0, so our IOPL=3 doesn't reach the hardware and every port
       instruction from ring 3 faults here. We emulate the two that ring 3 uses
       (io.rs): `out %al,%dx` (EE) and `rep outsb` (F3 6E, a whole console
       line per fault). They run here with ring 3's own registers, which we
       keep untouched except RBX (saved); then we step over the instruction.
       Anything else is a real #GP. */
ember_gp:                           /* [rsp]: error code, 8: RIP, 16: CS */
    testb $3, 16(%rsp)              /* only ring 3's instructions are emulated */
    jz ember_gp_fault
    pushq %rbx                      /* now RIP is at 16(%rsp) */
    movq 16(%rsp), %rbx
    cmpb $0xee, (%rbx)              /* out %al,%dx */
    je ember_gp_outb
    cmpw $0x6ef3, (%rbx)            /* rep outsb: F3 6E, little-endian */
    je ember_gp_outsb
    popq %rbx
ember_gp_fault:
    pushq $13                       /* the frame ember_fault expects */
    jmp ember_fault
ember_gp_outb:
    outb %al, %dx
    incq 16(%rsp)                   /* step over the 1-byte instruction */
    popq %rbx
    addq $8, %rsp                   /* drop the error code */
    iretq
ember_gp_outsb:
    rep outsb                       /* RSI/RCX advance as ring 3 would see them */
    addq $2, 16(%rsp)               /* step over F3 6E */
    popq %rbx
    addq $8, %rsp
    iretq

    /* Any exception or interrupt: print vector, error code and RIP to COM1,
       then write 0x80+vector to the debug-exit port; halt if that returns. */
ember_fault:
    movw $0x3f8, %dx
    movb $'\n', %al
    outb %al, %dx
    .irpc c, EXCEPTION
    movb $'\c', %al
    outb %al, %dx
    .endr
    movq (%rsp), %rbx               /* vector, 2 hex digits */
    shlq $56, %rbx
    .rept 2
    call ember_fault_hex_digit
    .endr
    movq 8(%rsp), %rbx              /* error code (0 if the vector has none) */
    call ember_fault_space_hex16
    movq 16(%rsp), %rbx             /* RIP */
    call ember_fault_space_hex16
    movb $'\n', %al
    outb %al, %dx
    movq (%rsp), %rax
    addb $0x80, %al
    movw ${exit_port}, %dx
    outb %al, %dx
1:  hlt
    jmp 1b

ember_fault_space_hex16:
    movb $' ', %al
    outb %al, %dx
    .rept 16
    call ember_fault_hex_digit
    .endr
    ret

ember_fault_hex_digit:              /* prints RBX's top nibble, rotates it away */
    rolq $4, %rbx
    movl %ebx, %eax
    andl $0xf, %eax
    movb ember_hex_digits(%rax), %al
    outb %al, %dx
    ret

ember_hex_digits:
    .ascii "0123456789abcdef"

    /* Boot protocol 2.15 kernel_info, found by the bzImage maker (testing.rs). */
    .balign 4
ember_kernel_info:
    .ascii "LToP"                   /* magic */
    .long 16                        /* size */
    .long 16                        /* size_total */
    .long 0                         /* setup_type_max: we read no setup_data */

    /* 256 stubs, 16 bytes apart: make the frame uniform (push a 0 error code
       where the CPU pushes none), push the vector, go to ember_fault. */
    .section .boot.vectors, "ax"
    .global ember_vectors
ember_vectors:
    .set vec, 0
    .rept 256
    .balign 16
    .if vec == 13
    jmp ember_gp                    /* #GP: maybe a port instruction to emulate */
    .else
    .if vec == 8 || (vec >= 10 && vec <= 14) || vec == 17 || vec == 21 || vec == 29 || vec == 30
    .else
    pushq $0
    .endif
    .byte 0x68                      /* push imm32: the vector */
    .long vec
    jmp ember_fault
    .endif
    .set vec, vec + 1
    .endr

    /* The Xen PVH note: loaders that see it enter at ember_entry_pvh. */
    .section .note.Xen, "a", @note
    .balign 4
    .long 4                         /* name size ("Xen\0") */
    .long 4                         /* descriptor size: a 32-bit entry address */
    .long 18                        /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .balign 4
    .long ember_entry_pvh
    .balign 4

    .text
"#,
    hv_leaf = const 0x4000_0000u32,
    timing_leaf = const 0x4000_0010u32,
    linux32 = const ENTRY_LINUX32,
    linux64 = const ENTRY_LINUX64,
    pvh = const ENTRY_PVH,
    gdtr = const GDTR_ADDR,
    idtr = const IDTR_ADDR,
    cr0 = const CR0_VALUE,
    cr4 = const CR4_VALUE,
    pml4 = const PML4_ADDR,
    efer = const MSR_EFER,
    efer_value = const EFER_VALUE,
    kernel_cs = const KERNEL_CS,
    kstack = const KERNEL_STACK_TOP,
    tss_sel = const TSS_SEL,
    user_ds = const USER_DS,
    user_cs = const USER_CS,
    rflags = const USER_RFLAGS,
    exit_port = const crate::io::DEBUG_EXIT_PORT,
    main = sym crate::ember_main,
    options(att_syntax)
);
