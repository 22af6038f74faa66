//! Pausing and resuming the vCPUs from another thread (the control socket).
//!
//! A vCPU thread spends its life inside `KVM_RUN`. To stop it, the pauser
//! sets the pause flag and sends the thread a real-time signal; its handler
//! sets `immediate_exit` on that thread's `kvm_run` page (the pointer is kept
//! in a thread-local), so `KVM_RUN` returns `EINTR` whether the signal lands
//! inside the ioctl or just before it (Firecracker's and Cloud Hypervisor's
//! scheme). The vCPU thread then enters `KVM_RUN` once more with
//! `immediate_exit` set, which completes a half-done MMIO or port-I/O exit
//! without running a guest instruction (the KVM API's rule before state is
//! read), and parks here.
//!
//! A parked vCPU serves requests on its own thread, where its descriptor
//! lives: "save your state" (`VcpuControl::collect`). It leaves the park on
//! resume or when the VM ends.

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvm_bindings::kvm_run;
use thiserror::Error;

use crate::vstate::end::VmEnd;

/// How long a pause may take before it is given up (a vCPU that never comes
/// back from KVM_RUN is a KVM problem, not something to wait on forever).
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the pauser re-sends the kick while waiting: a vCPU thread that
/// had not reached KVM_RUN yet (still being configured) gets it next time.
const KICK_INTERVAL: Duration = Duration::from_millis(1);

/// Control errors.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ControlError {
    /// The vCPUs did not all park in time.
    #[error("only {parked} of {total} vCPUs stopped in time")]
    PauseTimeout {
        /// Parked.
        parked: usize,
        /// All.
        total: usize,
    },
    /// The VM ended while waiting.
    #[error("the VM has ended")]
    Ended,
    /// Asked to pause a paused VM, or to resume a running one.
    #[error("the VM is already {0}")]
    Already(&'static str),
    /// A vCPU could not save its state.
    #[error("vCPU {id}: {why}")]
    Save {
        /// vCPU index.
        id: u32,
        /// What failed.
        why: String,
    },
    /// The signal handler could not be installed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(String),
}

/// Whether the VM runs or is parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    /// vCPUs run the guest.
    Running,
    /// Every vCPU is parked outside KVM_RUN.
    Paused,
}

struct Ctl<S> {
    pause: bool,
    parked: usize,
    /// Thread of each vCPU that reached its run loop, by index: its
    /// `pthread_t` as an integer (a pointer on musl, which is not `Send`).
    threads: Vec<Option<usize>>,
    /// Bumped for each collection; each vCPU answers it once.
    save_gen: u64,
    saved: Vec<Option<(u64, Result<S, ControlError>)>>,
}

/// Pause control shared by the vCPU threads and the control socket. `S` is
/// what a vCPU saves when asked (its snapshot state).
pub(crate) struct VcpuControl<S> {
    ctl: Mutex<Ctl<S>>,
    cv: Condvar,
    total: usize,
}

impl<S> std::fmt::Debug for VcpuControl<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuControl")
            .field("total", &self.total)
            .finish()
    }
}

thread_local! {
    /// This thread's `kvm_run` page, for the kick handler. Const-initialized,
    /// so reading it in a signal handler allocates nothing.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.with(Cell::get);
    if !run.is_null() {
        // SAFETY: the pointer is this thread's kvm_run mapping, set by
        // `enter_run_loop` and cleared before the mapping goes away; a byte
        // store is async-signal-safe. KVM reads the field at KVM_RUN entry.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

/// The signal that kicks a vCPU out of KVM_RUN.
fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Installs the kick handler once per process.
pub(crate) fn install_kick_handler() -> Result<(), ControlError> {
    static RESULT: OnceLock<Result<(), ControlError>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
                .map_err(|e| ControlError::Signal(e.to_string()))
        })
        .clone()
}

/// Records `run` as this thread's kvm_run page for the kick handler.
/// Call on the vCPU thread before its loop; [`leave_run_loop`] undoes it.
pub(crate) fn enter_run_loop(run: *mut kvm_run) {
    KVM_RUN.with(|c| c.set(run));
}

/// Forgets this thread's kvm_run page.
pub(crate) fn leave_run_loop() {
    KVM_RUN.with(|c| c.set(std::ptr::null_mut()));
}

impl<S> VcpuControl<S> {
    /// Control for `total` vCPUs.
    pub(crate) fn new(total: usize) -> Arc<Self> {
        Arc::new(VcpuControl {
            ctl: Mutex::new(Ctl {
                pause: false,
                parked: 0,
                threads: vec![None; total],
                save_gen: 0,
                saved: (0..total).map(|_| None).collect(),
            }),
            cv: Condvar::new(),
            total,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Ctl<S>> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the calling thread as vCPU `id`'s (it can now be kicked).
    pub(crate) fn register(&self, id: u32) {
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() } as usize;
        if let Some(slot) = self.lock().threads.get_mut(id as usize) {
            *slot = Some(me);
        }
    }

    /// Whether vCPUs should park (checked by each before KVM_RUN).
    pub(crate) fn pause_requested(&self) -> bool {
        self.lock().pause
    }

    /// Running or paused.
    pub(crate) fn state(&self) -> RunState {
        let c = self.lock();
        if c.pause && c.parked == self.total {
            RunState::Paused
        } else {
            RunState::Running
        }
    }

    /// Parks vCPU `id` (on its own thread) until resume or the VM's end,
    /// serving save requests with `save` meanwhile.
    pub(crate) fn park(
        &self,
        id: u32,
        end: &VmEnd,
        mut save: impl FnMut() -> Result<S, ControlError>,
    ) {
        let mut c = self.lock();
        c.parked += 1;
        self.cv.notify_all();
        let mut answered = c.save_gen;
        while c.pause && !end.is_over() {
            if c.save_gen != answered {
                answered = c.save_gen;
                drop(c);
                let state = save();
                c = self.lock();
                if let Some(slot) = c.saved.get_mut(id as usize) {
                    *slot = Some((answered, state));
                }
                self.cv.notify_all();
                continue;
            }
            // The VM's end is reported without this condvar: look now and then.
            c = self
                .cv
                .wait_timeout(c, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        c.parked -= 1;
    }

    /// Stops every vCPU; returns once all are parked.
    pub(crate) fn pause(&self, end: &VmEnd) -> Result<(), ControlError> {
        self.pause_within(end, PAUSE_TIMEOUT)
    }

    fn pause_within(&self, end: &VmEnd, timeout: Duration) -> Result<(), ControlError> {
        // Never kick without the handler: the signal's default action ends
        // the process.
        install_kick_handler()?;
        let mut c = self.lock();
        if c.pause {
            return Err(ControlError::Already("paused"));
        }
        c.pause = true;
        let start = Instant::now();
        loop {
            if end.is_over() {
                return Err(ControlError::Ended);
            }
            if c.parked == self.total {
                return Ok(());
            }
            if start.elapsed() > timeout {
                let parked = c.parked;
                c.pause = false;
                self.cv.notify_all();
                return Err(ControlError::PauseTimeout {
                    parked,
                    total: self.total,
                });
            }
            for t in c.threads.iter().flatten() {
                // SAFETY: the thread registered itself and lives as long as
                // the process (vCPU threads are never joined); the handler
                // only stores a byte.
                unsafe { libc::pthread_kill(*t as libc::pthread_t, kick_signal()) };
            }
            c = self
                .cv
                .wait_timeout(c, KICK_INTERVAL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Lets every parked vCPU run again.
    pub(crate) fn resume(&self) -> Result<(), ControlError> {
        let mut c = self.lock();
        if !c.pause {
            return Err(ControlError::Already("running"));
        }
        c.pause = false;
        self.cv.notify_all();
        Ok(())
    }

    /// Asks every parked vCPU for its state; returns them by index. The VM
    /// must be paused.
    pub(crate) fn collect(&self, end: &VmEnd) -> Result<Vec<S>, ControlError> {
        let mut c = self.lock();
        if !(c.pause && c.parked == self.total) {
            return Err(ControlError::Already("running"));
        }
        c.save_gen += 1;
        let gen_ = c.save_gen;
        self.cv.notify_all();
        let start = Instant::now();
        while c
            .saved
            .iter()
            .any(|s| !matches!(s, Some((g, _)) if *g == gen_))
        {
            if end.is_over() {
                return Err(ControlError::Ended);
            }
            if start.elapsed() > PAUSE_TIMEOUT {
                return Err(ControlError::PauseTimeout {
                    parked: c.parked,
                    total: self.total,
                });
            }
            c = self
                .cv
                .wait_timeout(c, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let mut out = Vec::with_capacity(self.total);
        for slot in c.saved.iter_mut() {
            match slot.take() {
                Some((_, saved)) => out.push(saved?),
                None => unreachable!("every slot was answered above"),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::end::EndError;

    /// Fake vCPU threads that "run" by polling the flag, as the real loop does.
    fn spawn(ctl: &Arc<VcpuControl<u32>>, end: &Arc<VmEnd>, n: u32) {
        for id in 0..n {
            let (ctl, end) = (ctl.clone(), end.clone());
            std::thread::spawn(move || {
                ctl.register(id);
                let mut saves = 0;
                while !end.is_over() {
                    if ctl.pause_requested() {
                        ctl.park(id, &end, || {
                            saves += 1;
                            Ok(id * 100 + saves)
                        });
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            });
        }
    }

    #[test]
    fn pause_collect_resume_in_order_and_refuses_out_of_order() {
        install_kick_handler().unwrap();
        let end = Arc::new(VmEnd::new().unwrap());
        let ctl = VcpuControl::<u32>::new(2);
        spawn(&ctl, &end, 2);
        assert_eq!(ctl.state(), RunState::Running);
        assert_eq!(ctl.resume(), Err(ControlError::Already("running")));
        assert_eq!(ctl.collect(&end), Err(ControlError::Already("running")));
        ctl.pause(&end).unwrap();
        assert_eq!(ctl.state(), RunState::Paused);
        assert_eq!(ctl.pause(&end), Err(ControlError::Already("paused")));
        assert_eq!(ctl.collect(&end).unwrap(), [1, 101]);
        // A second collection asks again.
        assert_eq!(ctl.collect(&end).unwrap(), [2, 102]);
        ctl.resume().unwrap();
        assert_eq!(ctl.state(), RunState::Running);
        ctl.pause(&end).unwrap();
        ctl.resume().unwrap();
        end.fail(EndError::Vcpu("done".into()));
    }

    #[test]
    fn a_vcpu_that_never_parks_times_out_and_the_vm_runs_on() {
        // The kicks go to the one registered thread: without the handler the
        // signal's default action would end the test process.
        install_kick_handler().unwrap();
        let end = Arc::new(VmEnd::new().unwrap());
        let ctl = VcpuControl::<u32>::new(2);
        spawn(&ctl, &end, 1);
        // Long enough for the one live thread to park however loaded the host
        // (the whole test binary runs in parallel on few cores).
        let timeout = Duration::from_secs(2);
        let t = Instant::now();
        let err = ctl.pause_within(&end, timeout).unwrap_err();
        assert_eq!(
            err,
            ControlError::PauseTimeout {
                parked: 1,
                total: 2
            }
        );
        assert!(t.elapsed() >= timeout);
        assert!(!ctl.pause_requested(), "a failed pause lets the vCPUs go");
        end.fail(EndError::Vcpu("done".into()));
    }
}
