//! End-to-end check of the x86-64 boot-state layer on real KVM: boots the
//! PVM test kernel (see /work/shared/pvm-test-kernel) through both entry
//! protocols with nothing but `ember::arch::x86_64` and a polled 16550, and
//! checks in its console log that the kernel understood every structure we
//! wrote: command line, e820 map, MP table, CPUID, and the initramfs.
//!
//! Slow (tens of seconds: guest kernel code is emulated on this machine's
//! KVM), so opt-in: `cargo test --test arch_boot_kvm -- --ignored`.

use std::fs::File;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ember::arch::x86_64::{boot, cpuid, layout, mptable, msr, regs};
use ember::initramfs::NewcWriter;
use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, Msrs, kvm_pit_config};
use kvm_ioctls::{Kvm, VcpuExit};
use linux_loader::loader::KernelLoader;
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vm_superio::{Serial, Trigger};

const BUILD: &str = "/root/.cache/ember/pvm-build";
/// The command line the PVM test kernel needs (see its README), plus ours.
const CMDLINE: &str = "console=ttyS0 noxsave noint3selftest nofxsaveleak \
    clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase noinvpcid \
    nopcid nopku mitigations=off earlyprintk=serial,ttyS0,115200 ember.test=arch";
const MEM_SIZE: u64 = 128 << 20;
const TIMEOUT: Duration = Duration::from_secs(240);
/// Offset of the 64-bit entry point in a bzImage's protected-mode kernel.
const STARTUP_64_OFFSET: u64 = 0x200;
/// UART line control register offset, and its divisor-latch access bit.
const UART_LCR: u8 = 3;
const UART_LCR_DLAB: u8 = 0x80;
/// Log note for the first divisor-latch write.
const DIVISOR_NOTE: &str = "COM1 baud divisor low byte";
/// Log prefix for the end of a run the guest did not choose.
const FATAL: &str = "[fatal]";
/// The COM1 16550's eight ports.
const COM1: std::ops::Range<u16> = layout::COM1_PORT..layout::COM1_PORT + layout::COM1_PORT_LEN;

/// The 16550's interrupt line is not wired: console output is polled.
struct NoIrq;
impl Trigger for NoIrq {
    type E = std::io::Error;
    fn trigger(&self) -> Result<(), Self::E> {
        Ok(())
    }
}

/// Which kernel image, entered how.
#[derive(Clone, Copy, Debug)]
enum Protocol {
    /// `vmlinux` through the 64-bit Linux boot protocol (zero page with our
    /// default setup header), as Firecracker boots an ELF kernel.
    ElfLinux64,
    /// `vmlinux` through its PVH entry note.
    Pvh,
    /// `bzImage` through the 64-bit Linux boot protocol with its own setup
    /// header: the compressed kernel's `startup_64`.
    BzImage,
}

fn initramfs() -> Vec<u8> {
    // /init exists but cannot run (no interpreter): the kernel prints
    // "Run /init as init process" — proof it found and unpacked the initrd —
    // then panics, which ends the test.
    let mut w = NewcWriter::new(Vec::new());
    w.file("init", 0o755, b"#!/bin/sh\necho never\n").unwrap();
    w.finish().unwrap().0
}

/// Boots the test kernel and returns its console output up to the first
/// line containing `stop_at` (or a vCPU failure, or the timeout).
fn boot(protocol: Protocol, stop_at: &str) -> String {
    let kernel = match protocol {
        Protocol::BzImage => format!("{BUILD}/arch/x86/boot/bzImage"),
        Protocol::ElfLinux64 | Protocol::Pvh => format!("{BUILD}/vmlinux"),
    };
    let mut kernel_file = File::open(&kernel)
        .unwrap_or_else(|e| panic!("test kernel {kernel} missing ({e}): build it with /work/shared/pvm-test-kernel/build.sh"));

    let ram = layout::ram_ranges(MEM_SIZE);
    let ranges: Vec<_> = ram
        .iter()
        .map(|&(s, l)| (GuestAddress(s), l as usize))
        .collect();
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&ranges).unwrap();

    let kvm = Kvm::new().expect("/dev/kvm");
    let vm = kvm.create_vm().unwrap();
    vm.set_tss_address(layout::KVM_TSS_ADDRESS as usize)
        .unwrap();
    vm.create_irq_chip().unwrap();
    vm.create_pit2(kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    })
    .unwrap();
    for (slot, region) in mem.iter().enumerate() {
        let region_desc = kvm_bindings::kvm_userspace_memory_region {
            slot: slot as u32,
            guest_phys_addr: region.start_addr().raw_value(),
            memory_size: region.len(),
            userspace_addr: region.as_ptr() as u64,
            flags: 0,
        };
        // SAFETY: the mapping belongs to `mem`, which outlives the VM (both
        // live until this function's vCPU thread is done with them or the
        // test process exits), and slots do not overlap.
        unsafe { vm.set_user_memory_region(region_desc).unwrap() };
    }

    // Kernel, command line, initramfs.
    let start = Some(GuestAddress(layout::HIMEM_START));
    let (entry, hdr, kernel_end) = match protocol {
        Protocol::BzImage => {
            let r = BzImage::load(&mem, None, &mut kernel_file, start).unwrap();
            let hdr = r.setup_header.expect("bzImage setup header");
            let init_size = u64::from(hdr.init_size);
            let load = r.kernel_load.raw_value();
            (
                load + STARTUP_64_OFFSET,
                Some(hdr),
                load + init_size.max(r.kernel_end - load),
            )
        }
        Protocol::ElfLinux64 => {
            let r = Elf::load(&mem, None, &mut kernel_file, start).unwrap();
            // e_entry is startup_64's physical address.
            (r.kernel_load.raw_value(), None, r.kernel_end)
        }
        Protocol::Pvh => {
            let r = Elf::load(&mem, None, &mut kernel_file, start).unwrap();
            let PvhBootCapability::PvhEntryPresent(entry) = r.pvh_boot_cap else {
                panic!("vmlinux has no PVH entry note");
            };
            (entry.raw_value(), None, r.kernel_end)
        }
    };
    let max_cmdline = hdr.map_or(2047, |h| h.cmdline_size as usize);
    boot::write_cmdline(&mem, CMDLINE, max_cmdline).unwrap();
    let initrd = initramfs();
    let initrd_max = hdr.map(|h| h.initrd_addr_max);
    let initrd_addr = boot::initrd_address(
        &ram,
        initrd.len() as u64,
        initrd_max.or(Some(u32::MAX)),
        kernel_end,
    )
    .unwrap();
    mem.write_slice(&initrd, GuestAddress(initrd_addr)).unwrap();
    let layout_ = boot::BootLayout {
        ram: &ram,
        cmdline: CMDLINE,
        initrd: Some((initrd_addr, initrd.len() as u64)),
        rsdp: None, // the test kernel has no ACPI
    };
    mptable::setup_mptable(&mem, 1).unwrap();
    regs::write_gdt_and_idt(&mem).unwrap();

    // The boot vCPU.
    let mut vcpu = vm.create_vcpu(0).unwrap();
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    let tsc_khz = vcpu.get_tsc_khz().ok();
    vcpu.set_cpuid2(&cpuid::configure_cpuid(&supported, 0, 1, tsc_khz).unwrap())
        .unwrap();
    let msrs = msr::boot_msrs();
    let set = vcpu.set_msrs(&Msrs::from_entries(&msrs).unwrap()).unwrap();
    assert_eq!(set, msrs.len(), "KVM refused an MSR");
    let mut sregs = vcpu.get_sregs().unwrap();
    match protocol {
        Protocol::ElfLinux64 | Protocol::BzImage => {
            regs::write_identity_page_tables(&mem).unwrap();
            boot::configure_linux(&mem, &layout_, hdr).unwrap();
            regs::long_mode_sregs(&mut sregs);
            vcpu.set_regs(&regs::linux64_regs(entry)).unwrap();
        }
        Protocol::Pvh => {
            boot::configure_pvh(&mem, &layout_).unwrap();
            regs::protected_mode_sregs(&mut sregs);
            vcpu.set_regs(&regs::pvh_regs(entry)).unwrap();
        }
    }
    vcpu.set_sregs(&sregs).unwrap();
    vcpu.set_fpu(&regs::boot_fpu()).unwrap();

    // Run on a thread so a hung guest becomes a timeout, not a hung test.
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let _keep = (&mem, &vm, &kvm);
        let mut serial = Serial::new(NoIrq, Vec::new());
        let mut lcr = 0u8;
        let mut divisor_reported = false;
        loop {
            let exit = match vcpu.run() {
                Ok(exit) => exit,
                Err(e) => {
                    let _ = tx.send(format!("\n{FATAL} KVM_RUN failed: {e}\n").into_bytes());
                    return;
                }
            };
            match exit {
                VcpuExit::IoOut(port, data) if COM1.contains(&port) => {
                    let offset = (port - COM1.start) as u8;
                    if offset == UART_LCR {
                        lcr = data[0];
                    }
                    // The first baud-divisor write shows a console driver
                    // configured the UART (before it prints anything).
                    if offset == 0 && lcr & UART_LCR_DLAB != 0 && !divisor_reported {
                        divisor_reported = true;
                        let note = format!("\n[{DIVISOR_NOTE} {}]\n", data[0]);
                        if tx.send(note.into_bytes()).is_err() {
                            return;
                        }
                    }
                    serial.write(offset, data[0]).unwrap();
                    if !serial.writer().is_empty() {
                        let out = std::mem::take(serial.writer_mut());
                        if tx.send(out).is_err() {
                            return;
                        }
                    }
                }
                VcpuExit::IoIn(port, data) if COM1.contains(&port) => {
                    data[0] = serial.read((port - COM1.start) as u8);
                }
                VcpuExit::IoIn(_, data) => data.fill(0xff),
                VcpuExit::MmioRead(_, data) => data.fill(0xff),
                VcpuExit::IoOut(..) | VcpuExit::MmioWrite(..) => {}
                other => {
                    let _ = tx.send(format!("\n{FATAL} vCPU exit: {other:?}\n").into_bytes());
                    return;
                }
            }
        }
    });

    let started = Instant::now();
    let mut log = String::new();
    let mut line_start = 0;
    while let Some(left) = TIMEOUT.checked_sub(started.elapsed()) {
        let Ok(bytes) = rx.recv_timeout(left) else {
            break;
        };
        log.push_str(&String::from_utf8_lossy(&bytes));
        let Some(end) = log.rfind('\n').filter(|&end| end >= line_start) else {
            continue;
        };
        let lines = &log[line_start..=end];
        eprint!("{lines}");
        line_start = end + 1;
        if lines.contains(stop_at) || lines.contains(FATAL) {
            break;
        }
    }
    eprintln!(
        "{}\n[{protocol:?} boot: {:.1} s]",
        &log[line_start..],
        started.elapsed().as_secs_f64()
    );
    log
}

fn check(log: &str) {
    let has = |s: &str| log.contains(s);
    assert!(
        has(&format!("Command line: {CMDLINE}")),
        "command line\n{log}"
    );
    // Our e820 map, as the kernel echoes it.
    for line in [
        "BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable",
        "BIOS-e820: [mem 0x000000000009fc00-0x00000000000fffff] reserved",
        "BIOS-e820: [mem 0x0000000000100000-0x0000000007ffffff] usable",
    ] {
        assert!(has(line), "{line}\n{log}");
    }
    assert!(
        has("Intel MultiProcessor Specification v1.4"),
        "MP table\n{log}"
    );
    assert!(has("IOAPIC[0]: apic_id 1"), "MP table I/O APIC\n{log}");
    assert!(
        has("Hypervisor detected: KVM"),
        "CPUID hypervisor leaves\n{log}"
    );
    assert!(has("kvm-clock"), "kvmclock from CPUID 0x40000001\n{log}");
    assert!(has("Run /init as init process"), "initramfs\n{log}");
}

/// Where a full boot stops: the kernel has mounted the initramfs and tried
/// to run its /init, then panics for want of an interpreter.
const FULL_BOOT_END: &str = "Kernel panic";

#[test]
#[ignore = "slow (~1 min): boots the PVM test kernel under KVM (run with --ignored)"]
fn linux_64bit_boot_protocol_reaches_init() {
    check(&boot(Protocol::ElfLinux64, FULL_BOOT_END));
}

#[test]
#[ignore = "slow (~1 min): boots the PVM test kernel under KVM (run with --ignored)"]
fn pvh_boot_reaches_init() {
    check(&boot(Protocol::Pvh, FULL_BOOT_END));
}

/// The bzImage's decompressor (XZ, emulated instruction by instruction here)
/// would take many minutes and prints nothing in this configuration, so this
/// stops once the compressed kernel's `startup_64` has found our zero page,
/// parsed the command line it points to, and set up the serial console named
/// there (`earlyprintk=serial,ttyS0,115200`: divisor 1).
#[test]
#[ignore = "slow: boots the PVM test kernel under KVM (run with --ignored)"]
fn bzimage_64bit_entry_reaches_the_decompressor() {
    let log = boot(Protocol::BzImage, DIVISOR_NOTE);
    assert!(log.contains(&format!("[{DIVISOR_NOTE} 1]")), "{log}");
}
