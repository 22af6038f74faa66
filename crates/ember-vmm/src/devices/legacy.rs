//! The few PC devices a direct-booted guest needs: COM1, the i8042 reset line,
//! the POST/debug port for boot-timing marks, Firecracker's boot-timer page,
//! an isa-debug-exit port and the hardware-reduced ACPI sleep register.
//!
//! None of them holds KVM: each reports through an injected `VmEnd`,
//! [`Recorder`] or `Write` sink.

use crate::events::{LineStamper, Recorder, kind};
use crate::vstate::bus::BusDevice;
use crate::vstate::end::{GuestEnd, VmEnd};
use std::io::{self, Write};
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// Console output: the guest's bytes go to `out` (the terminal) and, split
/// into lines stamped on arrival, into the event timeline.
pub(crate) struct ConsoleSink {
    out: Option<Box<dyn Write + Send>>,
    stamper: LineStamper,
    recorder: Arc<Recorder>,
    pending: Vec<u8>,
}

impl ConsoleSink {
    /// A sink writing to `out` (None: discard) and recording lines.
    pub(crate) fn new(out: Option<Box<dyn Write + Send>>, recorder: Arc<Recorder>) -> Self {
        ConsoleSink {
            out,
            stamper: LineStamper::default(),
            recorder,
            pending: Vec::new(),
        }
    }

    /// Records a trailing partial line (at exit).
    pub(crate) fn finish(&mut self) {
        let rec = &self.recorder;
        self.stamper.flush(|l| rec.mark_text(kind::CONSOLE_LINE, l));
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.recorder.enabled() {
            let rec = &self.recorder;
            self.stamper
                .feed(buf, |l| rec.mark_text(kind::CONSOLE_LINE, l));
        }
        self.pending.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if let Some(out) = self.out.as_mut() {
            // A closed terminal must not stop the guest: drop output instead.
            if out
                .write_all(&self.pending)
                .and_then(|_| out.flush())
                .is_err()
            {
                self.out = None;
            }
        }
        self.pending.clear();
        Ok(())
    }
}

/// The serial interrupt: an irqfd.
#[derive(Debug)]
pub(crate) struct SerialIrq(pub EventFd);

impl vm_superio::Trigger for SerialIrq {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// The 16550 UART from vm-superio.
pub(crate) type SerialUart =
    vm_superio::Serial<SerialIrq, vm_superio::serial::NoEvents, ConsoleSink>;

/// COM1 on the port-I/O bus.
pub(crate) struct Serial(pub SerialUart);

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(off), [b]) = (u8::try_from(offset), data) {
            *b = self.0.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), [b]) = (u8::try_from(offset), data) {
            if let Err(e) = self.0.write(off, *b) {
                crate::guest_warn!("serial write failed: {e:?}");
            }
        }
    }
}

/// The i8042 keyboard controller, reduced to what guests use it for: the
/// CPU-reset command (0xfe on the command port).
pub(crate) struct I8042 {
    end: Arc<VmEnd>,
}

/// i8042 command: pulse the CPU reset line.
const I8042_CMD_RESET_CPU: u8 = 0xfe;
/// Status register: nothing to read, input buffer empty.
const I8042_STATUS_EMPTY: u8 = 0;

impl I8042 {
    /// A controller that reports resets to `end`.
    pub(crate) fn new(end: Arc<VmEnd>) -> Self {
        I8042 { end }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Linux polls the status port; "empty" lets its probe finish quickly.
        data.fill(I8042_STATUS_EMPTY);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        // The device sits on 0x60..0x65; the command port is at offset 4.
        let command_port = u64::from(
            crate::arch::x86_64::layout::I8042_COMMAND_PORT
                - crate::arch::x86_64::layout::I8042_DATA_PORT,
        );
        if offset == command_port && data.first() == Some(&I8042_CMD_RESET_CPU) {
            self.end.report(GuestEnd::Reset);
        }
    }
}

/// Port 0x80: guests write progress codes there; each becomes a timestamped
/// boot mark (Cloud Hypervisor's ranges: 0x00–0x1f firmware, 0x20–0x3f
/// bootloader, 0x40–0x5f kernel, 0x60–0x7f userspace).
pub(crate) struct DebugPort {
    recorder: Arc<Recorder>,
}

impl DebugPort {
    /// A port recording into `recorder`.
    pub(crate) fn new(recorder: Arc<Recorder>) -> Self {
        DebugPort { recorder }
    }
}

impl BusDevice for DebugPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        if let Some(&code) = data.first() {
            self.recorder.mark_code(kind::BOOT_MARK, u32::from(code));
        }
    }
}

/// Firecracker's boot-timer magic: the guest writes this byte to the boot-timer page.
pub(crate) const BOOT_TIMER_MAGIC: u8 = 123;
/// The event code a boot-timer write is recorded with (outside the 8-bit port-0x80 range).
pub const BOOT_TIMER_MAGIC_CODE: u32 = 0x100 | BOOT_TIMER_MAGIC as u32;

/// Firecracker-style boot timer: a write of [`BOOT_TIMER_MAGIC`] anywhere in
/// its page records a mark and logs the time since the VMM started.
pub(crate) struct BootTimer {
    recorder: Arc<Recorder>,
}

impl BootTimer {
    /// A boot timer recording into `recorder`.
    pub(crate) fn new(recorder: Arc<Recorder>) -> Self {
        BootTimer { recorder }
    }
}

impl BusDevice for BootTimer {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        if data.first() == Some(&BOOT_TIMER_MAGIC) {
            self.recorder
                .mark_code(kind::BOOT_MARK, BOOT_TIMER_MAGIC_CODE);
            crate::guest_log!(
                log::Level::Info,
                "guest boot time = {:.0} us",
                crate::events::now_us()
            );
        }
    }
}

/// isa-debug-exit (QEMU's device, same port): the guest writes its exit status.
pub(crate) struct DebugExit {
    end: Arc<VmEnd>,
}

impl DebugExit {
    /// A port reporting to `end`.
    pub(crate) fn new(end: Arc<VmEnd>) -> Self {
        DebugExit { end }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        if let Some(&code) = data.first() {
            self.end.report(GuestEnd::ExitCode(code));
        }
    }
}

/// Sleep control register: SLP_EN (bit 5) with SLP_TYP (bits 2–4).
const SLP_EN: u8 = 1 << 5;
/// SLP_TYP field mask and shift.
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0b111;
/// The sleep type our DSDT's `\_S5` names.
pub(crate) const S5_SLP_TYP: u8 = 5;

/// The hardware-reduced ACPI sleep control/status registers (FADT): writing
/// SLP_EN with the S5 type powers the guest off.
pub(crate) struct AcpiSleep {
    end: Arc<VmEnd>,
}

impl AcpiSleep {
    /// A sleep register reporting to `end`.
    pub(crate) fn new(end: Arc<VmEnd>) -> Self {
        AcpiSleep { end }
    }
}

impl BusDevice for AcpiSleep {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        // Offset 0 is the control register; 1 is status (write-1-to-clear, nothing to clear).
        if let (0, Some(&v)) = (offset, data.first()) {
            if v & SLP_EN != 0 && (v >> SLP_TYP_SHIFT) & SLP_TYP_MASK == S5_SLP_TYP {
                self.end.report(GuestEnd::PowerOff);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn i8042_resets_only_on_the_reset_command() {
        let end = Arc::new(VmEnd::new().unwrap());
        let mut dev = I8042::new(end.clone());
        dev.write(0, &[0xfe]);
        assert_eq!(end.get(), None, "0xfe on the data port is a keyboard byte");
        dev.write(4, &[0xd1]);
        assert_eq!(end.get(), None);
        dev.write(4, &[0xfe]);
        assert_eq!(end.get(), Some(GuestEnd::Reset));
    }

    #[test]
    fn acpi_sleep_powers_off_on_s5_only() {
        let end = Arc::new(VmEnd::new().unwrap());
        let mut dev = AcpiSleep::new(end.clone());
        dev.write(0, &[(3 << 2) | SLP_EN]);
        dev.write(0, &[5 << 2]);
        dev.write(1, &[(5 << 2) | SLP_EN]);
        assert_eq!(end.get(), None);
        dev.write(0, &[(5 << 2) | SLP_EN]);
        assert_eq!(end.get(), Some(GuestEnd::PowerOff));
    }

    #[test]
    fn marks_are_recorded_with_codes() {
        let rec = Arc::new(Recorder::new(true));
        DebugPort::new(rec.clone()).write(0, &[0x41]);
        let mut timer = BootTimer::new(rec.clone());
        timer.write(0, &[1]);
        timer.write(0, &[BOOT_TIMER_MAGIC]);
        let codes: Vec<_> = rec.snapshot().events.iter().map(|e| e.code).collect();
        assert_eq!(codes, [Some(0x41), Some(BOOT_TIMER_MAGIC_CODE)]);
    }

    #[test]
    fn console_sink_passes_bytes_and_stamps_lines() {
        let rec = Arc::new(Recorder::new(true));
        let out = Shared::default();
        let mut sink = ConsoleSink::new(Some(Box::new(out.clone())), rec.clone());
        sink.write_all(b"hello\nwor").unwrap();
        sink.flush().unwrap();
        sink.write_all(b"ld").unwrap();
        sink.flush().unwrap();
        sink.finish();
        assert_eq!(&*out.0.lock().unwrap(), b"hello\nworld");
        let lines: Vec<_> = rec
            .snapshot()
            .events
            .into_iter()
            .filter_map(|e| e.text)
            .collect();
        assert_eq!(lines, ["hello", "world"]);
    }

    #[test]
    fn serial_uart_reaches_the_sink() {
        let rec = Arc::new(Recorder::new(false));
        let out = Shared::default();
        let sink = ConsoleSink::new(Some(Box::new(out.clone())), rec);
        let mut com1 = Serial(SerialUart::new(SerialIrq(EventFd::new(0).unwrap()), sink));
        for &b in b"ok\n" {
            com1.write(0, &[b]);
        }
        assert_eq!(&*out.0.lock().unwrap(), b"ok\n");
    }
}
