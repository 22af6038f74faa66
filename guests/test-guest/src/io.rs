//! Ring-3 device access: port I/O (allowed by RFLAGS.IOPL=3, or emulated by
//! our #GP handler where the KVM ignores IOPL), MMIO (every page is a user
//! page), the COM1 console, and the TSC clock.

use core::arch::asm;
use core::fmt;

/// COM1 transmit-holding register (ember's `layout::COM1_PORT`).
pub const COM1_PORT: u16 = 0x3f8;
/// POST/boot-progress port (`layout::DEBUG_PORT`).
pub const DEBUG_PORT: u16 = 0x80;
/// isa-debug-exit (`layout::DEBUG_EXIT_PORT`).
pub const DEBUG_EXIT_PORT: u16 = 0x501;
/// i8042 command port (`layout::I8042_COMMAND_PORT`).
pub const I8042_COMMAND_PORT: u16 = 0x64;
/// i8042 command: pulse the CPU reset line.
pub const I8042_RESET: u8 = 0xfe;
/// Hardware-reduced ACPI sleep control (`layout::ACPI_SLEEP_CONTROL_PORT`).
pub const ACPI_SLEEP_CONTROL_PORT: u16 = 0x3c0;
/// SLP_TYP = 5 (S5, soft off) in bits 2..4, SLP_EN in bit 5.
pub const ACPI_SLEEP_S5: u8 = (5 << 2) | (1 << 5);
/// Firecracker's boot-timer page (`layout::BOOT_TIMER_MMIO_START`).
pub const BOOT_TIMER_MMIO: u64 = 0xc000_0000;
/// The byte Firecracker's boot timer expects.
pub const BOOT_TIMER_MAGIC: u8 = 123;

/// Writes a byte to an I/O port. Always the one-byte `out %al,%dx` (EE):
/// that is the encoding our #GP handler emulates.
pub fn outb(port: u16, value: u8) {
    // SAFETY: IOPL=3 (or our #GP handler) makes port I/O legal in ring 3; the
    // ports we use have no effect on our own memory.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags))
    }
}

/// The COM1 console. The UART's transmit register is written blindly: the
/// VMMs we run under accept bytes at any rate, so LSR polling only costs exits.
/// Text is gathered and written with one `rep outsb` per `print!`/`println!`
/// (or per 256 bytes): where ring 3 port I/O faults into our emulated ring 0,
/// each write is one fault, the slowest thing this guest does.
pub struct Console {
    buf: [u8; 256],
    len: usize,
}

impl Console {
    pub const fn new() -> Self {
        Console {
            buf: [0; 256],
            len: 0,
        }
    }

    /// Writes out what is gathered.
    pub fn flush(&mut self) {
        outsb(COM1_PORT, &self.buf[..self.len]);
        self.len = 0;
    }
}

impl fmt::Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for &b in s.as_bytes() {
            if self.len == self.buf.len() {
                self.flush();
            }
            self.buf[self.len] = b;
            self.len += 1;
        }
        Ok(())
    }
}

/// Writes bytes to one port with `rep outsb`: one instruction for the whole
/// string, so one fault (not one per byte) where ring 3 port I/O is emulated
/// by our #GP handler (see boot.rs), and one batched exit under KVM.
pub fn outsb(port: u16, bytes: &[u8]) {
    // SAFETY: reads `bytes` only; IOPL=3 (or our #GP handler) allows the port.
    unsafe {
        asm!("rep outsb", in("dx") port, inout("rsi") bytes.as_ptr() => _,
             inout("rcx") bytes.len() => _, options(nostack, preserves_flags, readonly))
    }
}

/// `print!` to COM1.
#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => {{
        let mut console = $crate::io::Console::new();
        let _ = core::fmt::Write::write_fmt(&mut console, format_args!($($arg)*));
        console.flush();
    }};
}

/// `println!` to COM1.
#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => {{
        let mut console = $crate::io::Console::new();
        let _ = core::fmt::Write::write_fmt(&mut console, format_args!($($arg)*));
        let _ = core::fmt::Write::write_str(&mut console, "\n");
        console.flush();
    }};
}

/// Reads the time-stamp counter (unprivileged: CR4.TSD is clear).
pub fn rdtsc() -> u64 {
    // SAFETY: rdtsc has no memory effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}

fn cpuid(leaf: u32) -> core::arch::x86_64::CpuidResult {
    core::arch::x86_64::__cpuid(leaf)
}

/// Fallback when no CPUID leaf reports the TSC rate: this machine's KVM TSC.
const DEFAULT_TSC_KHZ: u64 = 2_250_000;
const HYPERVISOR_BASE_LEAF: u32 = 0x4000_0000;
/// The VMware/KVM "timing information" leaf: EAX = TSC kHz.
const HYPERVISOR_TSC_LEAF: u32 = 0x4000_0010;
const CPUID_HYPERVISOR_BIT: u32 = 1 << 31;

/// The TSC rate reported by the VMM's CPUID timing leaf, read in ring 0.
#[derive(Clone, Copy)]
pub struct TscSource(Option<u64>);

impl TscSource {
    /// From CPUID 0x40000000.EAX (the highest hypervisor leaf) and
    /// 0x40000010.EAX (TSC kHz) as ring 0 read them.
    pub fn from_ring0(hv_max_leaf: u32, timing_eax: u32) -> Self {
        let has_leaf =
            (HYPERVISOR_TSC_LEAF..HYPERVISOR_BASE_LEAF + 0x1000_0000).contains(&hv_max_leaf);
        TscSource((has_leaf && timing_eax != 0).then_some(timing_eax.into()))
    }
}

/// The TSC frequency in kHz and where it came from: the VMM's timing leaf
/// (read in ring 0: on PVM ring 3's CPUID is the host CPU's, not the VMM's),
/// else ring 3's view of it, else the crystal ratio (leaf 0x15), else the
/// base frequency (leaf 0x16), else a default.
fn tsc_khz(ring0: TscSource) -> (u64, &'static str) {
    if let Some(khz) = ring0.0 {
        return (khz, "cpuid-0x40000010-ring0");
    }
    if cpuid(1).ecx & CPUID_HYPERVISOR_BIT != 0 {
        let max = cpuid(HYPERVISOR_BASE_LEAF).eax;
        let khz = cpuid(HYPERVISOR_TSC_LEAF).eax;
        if let Some(khz) = TscSource::from_ring0(max, khz).0 {
            return (khz, "cpuid-0x40000010");
        }
    }
    let max = cpuid(0).eax;
    if max >= 0x15 {
        let r = cpuid(0x15);
        if r.eax != 0 && r.ebx != 0 && r.ecx != 0 {
            let khz = u64::from(r.ecx) * u64::from(r.ebx) / u64::from(r.eax) / 1000;
            return (khz, "cpuid-0x15");
        }
    }
    if max >= 0x16 {
        let mhz = cpuid(0x16).eax & 0xffff;
        if mhz != 0 {
            return (u64::from(mhz) * 1000, "cpuid-0x16");
        }
    }
    (DEFAULT_TSC_KHZ, "default")
}

/// A TSC-based clock.
#[derive(Clone, Copy)]
pub struct Clock {
    khz: u64,
    source: &'static str,
}

impl Clock {
    /// Determines the TSC rate once.
    pub fn new(ring0: TscSource) -> Self {
        let (khz, source) = tsc_khz(ring0);
        Clock { khz, source }
    }

    /// The rate, kHz.
    pub fn khz(&self) -> u64 {
        self.khz
    }

    /// Which CPUID leaf (or default) gave the rate.
    pub fn source(&self) -> &'static str {
        self.source
    }

    /// TSC ticks to nanoseconds.
    pub fn ns(&self, ticks: u64) -> u64 {
        (u128::from(ticks) * 1_000_000 / u128::from(self.khz)) as u64
    }

    /// Nanoseconds to TSC ticks.
    pub fn ticks(&self, ns: u64) -> u64 {
        (u128::from(ns) * u128::from(self.khz) / 1_000_000) as u64
    }
}
