//! How a guest's run ends, and how the VMM's main thread learns of it.
//!
//! Devices (the i8042 reset line, the debug-exit port, the ACPI sleep
//! register) and vCPU threads report here; the main thread waits on one
//! eventfd. It lives in vstate, below the devices and the vCPUs that both
//! report into it. Turning an ending into a process exit status is the
//! command line's business, not the VMM's.

use crate::events::kind;
use std::io;
use std::sync::Mutex;
use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

/// How a guest ended its run. First report wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestEnd {
    /// Powered off (ACPI S5).
    PowerOff,
    /// Asked for a reset (i8042 pulse, reboot).
    Reset,
    /// Wrote a status to the debug-exit port.
    ExitCode(u8),
    /// Triple fault: the CPU shut down.
    TripleFault,
}

impl GuestEnd {
    /// Event kind for the timeline.
    pub fn event_kind(self) -> &'static str {
        match self {
            GuestEnd::PowerOff | GuestEnd::ExitCode(_) => kind::GUEST_SHUTDOWN,
            GuestEnd::Reset | GuestEnd::TripleFault => kind::GUEST_RESET,
        }
    }
}

/// Why the VMM could not go on running the guest.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EndError {
    /// A vCPU thread failed (configuring, confining or running its vCPU). The
    /// error is rendered with its causes on that thread: the first failure is
    /// kept and read by every waiter, from other threads.
    #[error("{0}")]
    Vcpu(String),
}

/// Where devices and vCPU threads report the end of the guest's run; the
/// VMM's main thread waits on [`VmEnd::eventfd`]. The first report wins.
#[derive(Debug)]
pub(crate) struct VmEnd {
    end: Mutex<Option<Result<GuestEnd, EndError>>>,
    evt: EventFd,
}

impl VmEnd {
    /// A fresh, not-yet-ended state.
    pub(crate) fn new() -> io::Result<Self> {
        Ok(VmEnd {
            end: Mutex::new(None),
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }

    /// Records how the guest ended and wakes the VMM.
    pub(crate) fn report(&self, end: GuestEnd) {
        self.set(Ok(end));
    }

    /// Records that the VMM could not go on and wakes the VMM.
    pub(crate) fn fail(&self, why: EndError) {
        self.set(Err(why));
    }

    fn set(&self, outcome: Result<GuestEnd, EndError>) {
        let mut slot = self.end.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(outcome);
            // The eventfd counter cannot overflow from a single write of 1.
            let _ = self.evt.write(1);
        }
    }

    /// Whether the run is over (either way).
    pub(crate) fn is_over(&self) -> bool {
        self.end.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// The recorded guest ending, if the guest ended.
    #[cfg(test)]
    pub(crate) fn get(&self) -> Option<GuestEnd> {
        self.outcome().and_then(Result::ok)
    }

    /// The recorded outcome, if any.
    pub(crate) fn outcome(&self) -> Option<Result<GuestEnd, EndError>> {
        self.end.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The eventfd that becomes readable at the end.
    pub(crate) fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_ending_wins_and_wakes_the_vmm() {
        let end = VmEnd::new().unwrap();
        assert_eq!(end.get(), None);
        end.report(GuestEnd::ExitCode(7));
        end.report(GuestEnd::Reset);
        assert_eq!(end.get(), Some(GuestEnd::ExitCode(7)));
        assert_eq!(end.eventfd().read().unwrap(), 1);
        end.fail(EndError::Vcpu("late".into()));
        assert_eq!(end.outcome(), Some(Ok(GuestEnd::ExitCode(7))));
    }

    #[test]
    fn failures_end_the_run_too() {
        let end = VmEnd::new().unwrap();
        end.fail(EndError::Vcpu("KVM internal error".into()));
        end.report(GuestEnd::PowerOff);
        assert!(end.is_over());
        assert_eq!(end.get(), None);
        assert_eq!(
            end.outcome(),
            Some(Err(EndError::Vcpu("KVM internal error".into())))
        );
    }
}
