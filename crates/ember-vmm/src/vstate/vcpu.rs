//! vCPUs: creation, boot register state, and the run loop that hands exits
//! to the device buses.

use crate::arch::x86_64::regs;
use crate::vstate::bus::Bus;
use crate::vstate::control::{self, ControlError, VcpuControl};
use crate::vstate::end::{GuestEnd, VmEnd};
use crate::vstate::vm::Vm;
use kvm_bindings::{CpuId, Msrs, kvm_msr_entry};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};
use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// LAPIC register offsets and delivery modes for the local interrupt pins:
/// LINT0 carries the 8259 PIC's output (ExtINT), LINT1 the NMI line, as on a PC.
const APIC_LVT_LINT0: usize = 0x350;
const APIC_LVT_LINT1: usize = 0x360;
const APIC_DELIVERY_MODE_MASK: u32 = 0x700;
const APIC_MODE_NMI: u32 = 0x400;
const APIC_MODE_EXTINT: u32 = 0x700;

/// vCPU errors.
#[derive(Debug, Error)]
pub enum VcpuError {
    /// KVM_CREATE_VCPU failed.
    #[error("cannot create vCPU {id}")]
    Create {
        /// vCPU index.
        id: u32,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Setting boot state failed.
    #[error("cannot set vCPU {id} {what}")]
    Configure {
        /// vCPU index.
        id: u32,
        /// Which state.
        what: &'static str,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM refused some of the boot MSRs.
    #[error("KVM accepted only {set} of {wanted} boot MSRs")]
    Msrs {
        /// Accepted.
        set: usize,
        /// Asked.
        wanted: usize,
    },
    /// KVM_RUN itself failed.
    #[error("KVM_RUN failed on vCPU {id}")]
    Run {
        /// vCPU index.
        id: u32,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM could not emulate what the guest did.
    #[error("KVM internal error on vCPU {id} at guest RIP {rip:#x} (suberror {suberror})")]
    Internal {
        /// vCPU index.
        id: u32,
        /// Guest instruction pointer.
        rip: u64,
        /// KVM's suberror code.
        suberror: u32,
    },
    /// Entering the guest failed.
    #[error(
        "KVM could not enter the guest on vCPU {id} (hardware reason {reason:#x}) at RIP {rip:#x}"
    )]
    FailEntry {
        /// vCPU index.
        id: u32,
        /// Hardware entry failure reason.
        reason: u64,
        /// Guest instruction pointer.
        rip: u64,
    },
    /// Lazily registering guest RAM failed.
    #[error("cannot give guest RAM to KVM")]
    Memory(#[source] crate::vstate::vm::VmError),
    /// An access to lazily registered RAM fell outside guest memory.
    #[error("guest access at {0:#x} is outside guest memory")]
    LazyRam(u64),
    /// An exit ember does not handle.
    #[error("unexpected KVM exit {exit} on vCPU {id} at RIP {rip:#x}")]
    Unexpected {
        /// vCPU index.
        id: u32,
        /// Exit description.
        exit: String,
        /// Guest instruction pointer.
        rip: u64,
    },
}

/// The pause control every vCPU of a VM shares; parked vCPUs save their
/// snapshot state through it.
pub(crate) type Control = VcpuControl<crate::vstate::vcpu_state::VcpuState>;

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BootEntry {
    /// 32-bit protected mode, paging off, EBX = hvm_start_info (PVH).
    Pvh(u64),
    /// 64-bit long mode, identity paging, RSI = zero page (Linux boot protocol).
    Linux64(u64),
}

/// One vCPU.
#[derive(Debug)]
pub(crate) struct Vcpu {
    fd: VcpuFd,
    id: u32,
}

thread_local! {
    /// [`Vcpu::confine_thread`] ran on this thread (filters are per thread).
    static CONFINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Vcpu {
    /// Creates vCPU `id` (also its APIC id).
    pub(crate) fn new(vm: &VmFd, id: u32) -> Result<Vcpu, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(|source| VcpuError::Create { id, source })?;
        Ok(Vcpu { fd, id })
    }

    /// The vCPU's KVM descriptor (snapshot state is read and written through it).
    pub(crate) fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// The vCPU index.
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// The guest TSC frequency in kHz, when KVM knows it.
    pub(crate) fn tsc_khz(&self) -> Option<u32> {
        self.fd.get_tsc_khz().ok().filter(|&k| k != 0)
    }

    fn cfg(&self, what: &'static str) -> impl Fn(kvm_ioctls::Error) -> VcpuError + '_ {
        move |source| VcpuError::Configure {
            id: self.id,
            what,
            source,
        }
    }

    /// Sets CPUID, MSRs and the LAPIC's local interrupt pins: what every vCPU needs.
    pub(crate) fn configure(&self, cpuid: &CpuId, msrs: &[kvm_msr_entry]) -> Result<(), VcpuError> {
        self.fd.set_cpuid2(cpuid).map_err(self.cfg("CPUID"))?;
        let wanted = msrs.len();
        let list = Msrs::from_entries(msrs).map_err(|_| VcpuError::Msrs { set: 0, wanted })?;
        let set = self.fd.set_msrs(&list).map_err(self.cfg("MSRs"))?;
        if set != wanted {
            return Err(VcpuError::Msrs { set, wanted });
        }
        self.set_lint()
    }

    /// Puts the boot vCPU at the kernel's entry point. Application processors
    /// skip this: they wait for INIT/SIPI in the in-kernel LAPIC.
    pub(crate) fn set_boot_state(&self, entry: BootEntry) -> Result<(), VcpuError> {
        let mut sregs = self.fd.get_sregs().map_err(self.cfg("segment registers"))?;
        let regs = match entry {
            BootEntry::Pvh(rip) => {
                regs::protected_mode_sregs(&mut sregs);
                regs::pvh_regs(rip)
            }
            BootEntry::Linux64(rip) => {
                regs::long_mode_sregs(&mut sregs);
                regs::linux64_regs(rip)
            }
        };
        self.fd
            .set_sregs(&sregs)
            .map_err(self.cfg("segment registers"))?;
        self.fd.set_regs(&regs).map_err(self.cfg("registers"))?;
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(self.cfg("FPU state"))
    }

    fn set_lint(&self) -> Result<(), VcpuError> {
        let mut lapic = self.fd.get_lapic().map_err(self.cfg("LAPIC"))?;
        for (reg, mode) in [
            (APIC_LVT_LINT0, APIC_MODE_EXTINT),
            (APIC_LVT_LINT1, APIC_MODE_NMI),
        ] {
            let v = read_lapic_reg(&lapic.regs, reg);
            write_lapic_reg(&mut lapic.regs, reg, (v & !APIC_DELIVERY_MODE_MASK) | mode);
        }
        self.fd.set_lapic(&lapic).map_err(self.cfg("LAPIC"))
    }

    fn rip(&self) -> u64 {
        self.fd.get_regs().map(|r| r.rip).unwrap_or(0)
    }

    /// Runs the guest until it ends (reported to `end`) or fails.
    ///
    /// `vm` and `mem` serve guest RAM that KVM learns about lazily (see
    /// [`Vm::register_memory`]): an access to it arrives here as MMIO once.
    /// `control` parks the vCPU on request (see [`crate::vstate::control`]).
    pub(crate) fn run(
        &mut self,
        io: &Bus,
        mmio: &Bus,
        end: &VmEnd,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        control: &Control,
    ) -> Result<(), VcpuError> {
        // Before the guest's first instruction on this vCPU, if its thread
        // was not filtered yet.
        Self::confine_thread(self.id)?;
        crate::seccomp::test_hook::vcpu_start();
        control::enter_run_loop(std::ptr::from_mut(self.fd.get_kvm_run()));
        control.register(self.id);
        let result = self.run_loop(io, mmio, end, vm, mem, control);
        control::leave_run_loop();
        result
    }

    /// Installs the vCPU kick handler and the vCPU list's seccomp filter on
    /// the calling thread, the one that will run vCPU `id`: best as soon as
    /// it starts, while it waits for the rest of the VM. Installing a filter
    /// costs ~0.15 ms of kernel time (checking, JIT-compiling and caching
    /// the program), which is then off the way to the guest's first
    /// instruction. Creating, configuring, restoring and running a vCPU are
    /// all on the list.
    pub(crate) fn confine_thread(id: u32) -> Result<(), VcpuError> {
        if CONFINED.get() {
            return Ok(());
        }
        let err = |e: &dyn std::fmt::Display| VcpuError::Unexpected {
            id,
            exit: e.to_string(),
            rip: 0,
        };
        control::install_kick_handler().map_err(|e| err(&e))?;
        crate::seccomp::confine(crate::seccomp::Thread::Vcpu).map_err(|e| err(&e))?;
        CONFINED.set(true);
        Ok(())
    }

    /// One function: one loop around KVM_RUN and a match with an arm per
    /// exit, on the hot path, while `exit` borrows the vCPU.
    fn run_loop(
        &mut self,
        io: &Bus,
        mmio: &Bus,
        end: &VmEnd,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        control: &Control,
    ) -> Result<(), VcpuError> {
        let id = self.id;
        loop {
            if end.is_over() {
                return Ok(());
            }
            if control.pause_requested() {
                self.park(end, control);
                continue;
            }
            let exit = match self.fd.run() {
                Ok(exit) => exit,
                // A signal kicked us out; re-check whether the VM is over or
                // pausing. A kick's immediate_exit is spent now: clear it, or
                // every later KVM_RUN would return at once.
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.fd.set_kvm_immediate_exit(0);
                    continue;
                }
                Err(source) => return Err(VcpuError::Run { id, source }),
            };
            // Port I/O is served after the match, once `exit` no longer
            // borrows the vCPU: its access size is needed and kvm-ioctls
            // does not pass it on.
            let port_io = match exit {
                VcpuExit::IoOut(..) | VcpuExit::IoIn(..) => true,
                VcpuExit::MmioWrite(addr, data) => {
                    if !mmio.write(addr, data) && claim(vm, addr)? {
                        mem.write_slice(data, GuestAddress(addr))
                            .map_err(|_| VcpuError::LazyRam(addr))?;
                    }
                    false
                }
                VcpuExit::MmioRead(addr, data) => {
                    if !mmio.read(addr, data) && claim(vm, addr)? {
                        mem.read_slice(data, GuestAddress(addr))
                            .map_err(|_| VcpuError::LazyRam(addr))?;
                    }
                    false
                }
                // A triple fault: the CPU gives up.
                VcpuExit::Shutdown => {
                    end.report(GuestEnd::TripleFault);
                    false
                }
                // With the in-kernel LAPIC, HLT only exits when the guest halted for good.
                VcpuExit::Hlt => {
                    end.report(GuestEnd::PowerOff);
                    false
                }
                VcpuExit::SystemEvent(kind, _) => {
                    end.report(match kind {
                        kvm_bindings::KVM_SYSTEM_EVENT_RESET => GuestEnd::Reset,
                        _ => GuestEnd::PowerOff,
                    });
                    false
                }
                // An instruction KVM could not emulate may be one that touched RAM
                // KVM does not know yet (e.g. a fetch): register it and retry.
                VcpuExit::InternalError if vm.claim_all_ram().map_err(VcpuError::Memory)? => false,
                VcpuExit::InternalError => return Err(self.internal_error()),
                VcpuExit::FailEntry(reason, _) => {
                    return Err(VcpuError::FailEntry {
                        id,
                        reason,
                        rip: self.rip(),
                    });
                }
                VcpuExit::Intr => false,
                other => {
                    let exit = format!("{other:?}");
                    return Err(VcpuError::Unexpected {
                        id,
                        exit,
                        rip: self.rip(),
                    });
                }
            };
            if port_io {
                self.serve_port_io(io);
            }
        }
    }

    /// KVM's internal error, with its suberror and where the guest was.
    fn internal_error(&mut self) -> VcpuError {
        let run = self.fd.get_kvm_run();
        // SAFETY: KVM filled the `internal` member of the exit union because
        // exit_reason is KVM_EXIT_INTERNAL_ERROR; it is plain integers.
        let suberror = unsafe { run.__bindgen_anon_1.internal.suberror };
        VcpuError::Internal {
            id: self.id,
            rip: self.rip(),
            suberror,
        }
    }

    /// Parks this vCPU for a pause, saving its state when asked.
    ///
    /// Never inlined into the run loop: a saved state holds the XSAVE area
    /// and the LAPIC page (~6 KiB, moved about a few times), and inlined it
    /// made the run loop's frame 18 KiB, which every vCPU thread touched
    /// (stack probes) on entering the loop, paused or not: 16 KiB of
    /// resident memory per vCPU. Out here it is only touched by a pause.
    #[cold]
    #[inline(never)]
    fn park(&mut self, end: &VmEnd, control: &Control) {
        // Entering with immediate_exit set completes the exit served
        // last (the guest's MMIO read gets its value) and returns
        // EINTR without running the guest: the state is then whole.
        self.fd.set_kvm_immediate_exit(1);
        let _ = self.fd.run();
        self.fd.set_kvm_immediate_exit(0);
        let id = self.id;
        control.park(id, end, || {
            crate::vstate::vcpu_state::save(&self.fd, id).map_err(|e| ControlError::Save {
                id,
                why: crate::error_chain(&e),
            })
        });
    }

    /// Serves the port-I/O exit KVM_RUN just returned. String instructions
    /// (`rep outsb`, `rep insw`) arrive as one exit of `count` accesses of
    /// `size` bytes each; every access goes to the device on its own, as the
    /// guest made it.
    fn serve_port_io(&mut self, io: &Bus) {
        let run = self.fd.get_kvm_run();
        // SAFETY: the last exit was KVM_EXIT_IO, so KVM filled the `io` member
        // of the exit union; it is plain integers.
        let exit = unsafe { run.__bindgen_anon_1.io };
        let size = usize::from(exit.size);
        let len = size * exit.count as usize;
        let base = (run as *mut kvm_bindings::kvm_run).cast::<u8>();
        // SAFETY: KVM staged this exit's `size * count` data bytes at
        // `data_offset` inside the vCPU's kvm_run mapping, which lives as long
        // as `self.fd` (kvm-ioctls slices the same bytes for `IoOut`/`IoIn`);
        // no other reference to them is alive while `data` is.
        let data =
            unsafe { std::slice::from_raw_parts_mut(base.add(exit.data_offset as usize), len) };
        if u32::from(exit.direction) == kvm_bindings::KVM_EXIT_IO_OUT {
            dispatch_out(io, exit.port, size, data);
        } else {
            dispatch_in(io, exit.port, size, data);
        }
    }
}

/// Writes `data` to `port` as accesses of `size` bytes each.
fn dispatch_out(io: &Bus, port: u16, size: usize, data: &[u8]) {
    for access in data.chunks(size.max(1)) {
        io.write(u64::from(port), access);
    }
}

/// Fills `data` from `port` with reads of `size` bytes each.
fn dispatch_in(io: &Bus, port: u16, size: usize, data: &mut [u8]) {
    for access in data.chunks_mut(size.max(1)) {
        io.read(u64::from(port), access);
    }
}

/// Whether an unclaimed MMIO access at `addr` was guest RAM (now registered).
fn claim(vm: &Vm, addr: u64) -> Result<bool, VcpuError> {
    vm.claim_ram(addr).map_err(VcpuError::Memory)
}

fn read_lapic_reg(regs: &[std::os::raw::c_char; 1024], offset: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[offset + i] as u8);
    u32::from_le_bytes(b)
}

fn write_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().into_iter().enumerate() {
        regs[offset + i] = b as std::os::raw::c_char;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::bus::BusDevice;
    use std::sync::{Arc, Mutex};

    /// Records every access it gets; reads return 0x10, 0x11, …
    #[derive(Default)]
    struct Recorder {
        writes: Vec<Vec<u8>>,
        reads: Vec<usize>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, _offset: u64, data: &mut [u8]) {
            self.reads.push(data.len());
            data.fill(0x10 + self.reads.len() as u8 - 1);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.writes.push(data.to_vec());
        }
    }

    #[test]
    fn string_port_io_reaches_the_device_access_by_access() {
        let dev = Arc::new(Mutex::new(Recorder::default()));
        let mut bus = Bus::new();
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        // `rep outsb` of "hi!": one exit, three 1-byte accesses.
        dispatch_out(&bus, 0x3f8, 1, b"hi!");
        // `out dx, ax`: one 2-byte access.
        dispatch_out(&bus, 0x3f8, 2, &[1, 2]);
        // `rep insw`, count 2.
        let mut data = [0u8; 4];
        dispatch_in(&bus, 0x3f8, 2, &mut data);
        let d = dev.lock().unwrap();
        assert_eq!(
            d.writes,
            [b"h".to_vec(), b"i".to_vec(), b"!".to_vec(), vec![1, 2]]
        );
        assert_eq!(d.reads, [2, 2]);
        assert_eq!(data, [0x10, 0x10, 0x11, 0x11]);
    }

    #[test]
    fn lapic_register_round_trip() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        write_lapic_reg(&mut regs, APIC_LVT_LINT0, 0x0001_0700);
        assert_eq!(read_lapic_reg(&regs, APIC_LVT_LINT0), 0x0001_0700);
        assert_eq!(read_lapic_reg(&regs, APIC_LVT_LINT1), 0);
    }
}
