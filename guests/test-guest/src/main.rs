//! ember's test guest: a tiny "kernel" that enters ring 3 at once and proves
//! the VMM's paths from there (console, boot marks, memory, timers, exits,
//! virtio-blk), driven by its command line. See README.md for the language.

#![no_std]
#![no_main]

mod boot;
mod cmdline;
mod io;
mod mem;
mod virtio;
mod virtio_blk;
mod virtio_mem;
mod virtio_net;
mod virtio_vsock;

use cmdline::{Command, Tokens};
use io::{Clock, outb};

/// Boot mark written by ring 3's first instruction (CPL0's is 0x40).
const MARK_RING3: u8 = 0x41;
/// `touch=` works from here up (above the image and the virtio-blk area).
const TOUCH_START: u64 = 16 << 20;
const PAGE_SIZE: u64 = 4096;
/// `touch=` must stay below the device hole.
const TOUCH_END_MAX: u64 = 0xc000_0000;
/// Exit status for a malformed command line.
const EXIT_BAD_CMDLINE: u8 = 2;

/// PVH `hvm_start_info`: magic, and where the command line's address is.
const PVH_MAGIC: u32 = 0x336e_c578;
const PVH_CMDLINE_PADDR: u64 = 24;
/// Linux `boot_params`: `hdr.cmd_line_ptr` and `ext_cmd_line_ptr`.
const BP_CMD_LINE_PTR: u64 = 0x228;
const BP_EXT_CMD_LINE_PTR: u64 = 0x0c8;
/// We read at most this much command line (ember passes ≤ 64 KiB).
const CMDLINE_MAX: usize = 0x10000;

/// Ring-3 entry, reached by `iretq` from `boot.rs`.
#[unsafe(no_mangle)]
/// `hv_max_leaf` and `timing_eax` are CPUID 0x40000000.EAX and
/// 0x40000010.EAX as ring 0 saw them (see boot.rs).
extern "C" fn ember_main(entry: u64, info: u64, hv_max_leaf: u32, timing_eax: u32) -> ! {
    outb(io::DEBUG_PORT, MARK_RING3);
    let (name, cmdline) = match entry {
        boot::ENTRY_PVH => ("pvh", pvh_cmdline(info)),
        boot::ENTRY_LINUX64 => ("linux64", linux_cmdline(info)),
        boot::ENTRY_LINUX32 => ("linux32", linux_cmdline(info)),
        _ => ("unknown", ""),
    };
    println!(
        "ember-test-guest: ring {}, entry={name}, cmdline=\"{cmdline}\"",
        current_ring()
    );
    let mut state = State::new(io::TscSource::from_ring0(hv_max_leaf, timing_eax));
    for token in Tokens::new(cmdline) {
        match cmdline::parse(token) {
            Ok(None) => {}
            Ok(Some(Command::Halt)) => break,
            Ok(Some(command)) => {
                if let Err(e) = state.run(command) {
                    fail(format_args!("{token}: {e}"));
                }
            }
            Err(e) => fail(format_args!("bad token `{token}`: {e}")),
        }
    }
    end()
}

/// The privilege level we run at (CS's low two bits): 3 once `boot.rs` is done.
fn current_ring() -> u16 {
    let cs: u16;
    // SAFETY: reading CS has no effects.
    unsafe { core::arch::asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack)) };
    cs & 3
}

/// Reads a NUL-terminated string from guest-physical memory (identity mapped).
fn c_string(addr: u64) -> &'static str {
    if addr == 0 {
        return "";
    }
    let ptr = addr as *const u8;
    let mut len = 0;
    // SAFETY: the VMM put a NUL-terminated command line here; we stop at
    // CMDLINE_MAX whatever it did.
    while len < CMDLINE_MAX && unsafe { ptr.add(len).read_volatile() } != 0 {
        len += 1;
    }
    // SAFETY: `len` bytes were just read; they are never written afterwards.
    let bytes = unsafe { core::slice::from_raw_parts(ptr, len) };
    core::str::from_utf8(bytes).unwrap_or("<command line is not UTF-8>")
}

fn read_u32(addr: u64) -> u32 {
    // SAFETY: a field of a boot structure the VMM placed in RAM.
    unsafe { (addr as *const u32).read_volatile() }
}

fn pvh_cmdline(start_info: u64) -> &'static str {
    if read_u32(start_info) != PVH_MAGIC {
        return "";
    }
    // SAFETY: hvm_start_info.cmdline_paddr, 8-byte aligned in the structure.
    let addr = unsafe { ((start_info + PVH_CMDLINE_PADDR) as *const u64).read_volatile() };
    c_string(addr)
}

fn linux_cmdline(zero_page: u64) -> &'static str {
    let low = u64::from(read_u32(zero_page + BP_CMD_LINE_PTR));
    let high = u64::from(read_u32(zero_page + BP_EXT_CMD_LINE_PTR));
    c_string(high << 32 | low)
}

/// Settings that persist across tokens (the `blk` options).
struct State {
    clock: Clock,
    blk: virtio_blk::Options,
    net: virtio_net::Net,
    vsock: virtio_vsock::Options,
    vmem: Option<virtio_mem::VirtioMem>,
}

impl State {
    fn new(tsc: io::TscSource) -> Self {
        State {
            clock: Clock::new(tsc),
            blk: virtio_blk::Options::default(),
            net: virtio_net::Net::default(),
            vsock: virtio_vsock::Options::default(),
            vmem: None,
        }
    }

    fn run(&mut self, command: Command) -> Result<(), &'static str> {
        match command {
            Command::Print(text) => print_words(text),
            Command::Mark(n) => outb(io::DEBUG_PORT, n),
            Command::Timer => {
                // SAFETY: the boot-timer page is MMIO in the device hole, mapped uncached.
                unsafe { (io::BOOT_TIMER_MMIO as *mut u8).write_volatile(io::BOOT_TIMER_MAGIC) }
            }
            Command::Touch(mib) => self.touch(mib)?,
            Command::Spin(ms) => self.spin(ms),
            Command::Tsc => {
                let (khz, source) = (self.clock.khz(), self.clock.source());
                println!("tsc: khz={khz} source={source}");
            }
            Command::Exit(n) => outb(io::DEBUG_EXIT_PORT, n),
            Command::Reset => outb(io::I8042_COMMAND_PORT, io::I8042_RESET),
            Command::Shutdown => outb(io::ACPI_SLEEP_CONTROL_PORT, io::ACPI_SLEEP_S5),
            Command::Halt => {}
            Command::Blk(opt) => self.blk.set(opt),
            Command::BlkRun { base, verify } => {
                virtio_blk::run(&self.blk, base, verify, &self.clock)?
            }
            Command::NetOpt(opt) => self.net.set(opt),
            Command::Net(cmd) => self.net.run(cmd, &self.clock)?,
            Command::Vsock(opt) => self.vsock.set(opt),
            Command::VsockRun(mode) => virtio_vsock::run(&self.vsock, mode, &self.clock)?,
            Command::Vmem(op) => self.vmem_op(op)?,
        }
        Ok(())
    }

    /// Writes one byte per 4 KiB page over `mib` MiB from 16 MiB: first-touch cost.
    fn touch(&self, mib: u64) -> Result<(), &'static str> {
        let end = mib
            .checked_mul(1 << 20)
            .and_then(|len| len.checked_add(TOUCH_START))
            .filter(|&end| end <= TOUCH_END_MAX)
            .ok_or("the range must end below 3 GiB")?;
        let pages = (end - TOUCH_START) / PAGE_SIZE;
        let start = io::rdtsc();
        let mut addr = TOUCH_START;
        while addr < end {
            // SAFETY: RAM above our image and buffers; nothing else lives there.
            unsafe { (addr as *mut u8).write_volatile(1) };
            addr += PAGE_SIZE;
        }
        let ns = self.clock.ns(io::rdtsc() - start);
        let per_page = ns.checked_div(pages).unwrap_or(0);
        println!("touch: mib={mib} pages={pages} ns={ns} ns_per_page={per_page}");
        Ok(())
    }

    fn vmem_op(&mut self, op: cmdline::VmemOp) -> Result<(), &'static str> {
        use cmdline::VmemOp;
        use virtio_mem::{PLUG, STATE, UNPLUG, UNPLUG_ALL};
        if self.vmem.is_none() {
            self.vmem = Some(virtio_mem::VirtioMem::init()?);
        }
        let Some(d) = self.vmem.as_mut() else {
            return Err("no virtio-mem device");
        };
        let (ty, block, n) = match op {
            VmemOp::Info => {
                d.info();
                return Ok(());
            }
            VmemOp::Fill(b, n) => return d.fill(b, n),
            VmemOp::Check(b, n) => return d.check(b, n),
            VmemOp::Wait(bytes) => return d.wait_requested(bytes, &self.clock),
            VmemOp::PlugToRequested => {
                d.plug_to_requested();
                return Ok(());
            }
            VmemOp::UnplugToRequested => {
                d.unplug_to_requested();
                return Ok(());
            }
            VmemOp::Plug(b, n) => (PLUG, b, n),
            VmemOp::Unplug(b, n) => (UNPLUG, b, n),
            VmemOp::State(b, n) => (STATE, b, n),
            VmemOp::UnplugAll => (UNPLUG_ALL, 0, 0),
        };
        let resp = d.request(ty, block, n);
        let what = ["plug", "unplug", "unplugall", "state"][usize::from(ty)];
        println!(
            "vmem: {what} block={block} n={n} -> {}",
            virtio_mem::name(resp, ty)
        );
        Ok(())
    }

    fn spin(&self, ms: u64) {
        let until = io::rdtsc().saturating_add(self.clock.ticks(ms.saturating_mul(1_000_000)));
        while io::rdtsc() < until {
            core::hint::spin_loop();
        }
    }
}

/// Prints `text` with underscores as spaces, and a newline, in few console writes.
fn print_words(text: &str) {
    let mut buf = [0u8; 256];
    for chunk in text.as_bytes().chunks(buf.len()) {
        for (out, &b) in buf.iter_mut().zip(chunk) {
            *out = if b == b'_' { b' ' } else { b };
        }
        io::outsb(io::COM1_PORT, &buf[..chunk.len()]);
    }
    outb(io::COM1_PORT, b'\n');
}

/// The default ending, in order of preference; whichever the VMM implements
/// stops us. If none does, spin (ring 3 can't `hlt`).
fn end() -> ! {
    outb(io::ACPI_SLEEP_CONTROL_PORT, io::ACPI_SLEEP_S5);
    outb(io::I8042_COMMAND_PORT, io::I8042_RESET);
    outb(io::DEBUG_EXIT_PORT, 0);
    spin_forever()
}

fn spin_forever() -> ! {
    loop {
        core::hint::spin_loop();
    }
}

/// Reports a command-line error and exits with status 2.
fn fail(message: core::fmt::Arguments) -> ! {
    println!("ember-test-guest: error: {message}");
    outb(io::DEBUG_EXIT_PORT, EXIT_BAD_CMDLINE);
    spin_forever()
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    println!("ember-test-guest: panic: {info}");
    outb(io::DEBUG_EXIT_PORT, EXIT_BAD_CMDLINE + 1);
    spin_forever()
}

/// Never called: panics abort. The precompiled `core` still references the
/// unwinding personality routine from its (discarded) unwind tables.
#[unsafe(no_mangle)]
extern "C" fn rust_eh_personality() {}
