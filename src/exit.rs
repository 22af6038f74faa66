//! The process exit statuses of `ember boot` and `ember run`, and how a
//! guest's ending maps onto them. The VMM reports how the guest ended
//! ([`GuestEnd`]); what number a shell sees is the command line's choice.

use ember_vmm::vstate::end::GuestEnd;

/// Exit status when the guest asked for a reset (reboot).
pub const EXIT_GUEST_RESET: i32 = 2;
/// Exit status when the guest crashed (triple fault) or KVM could not run it.
pub const EXIT_GUEST_CRASHED: i32 = 3;
/// Exit status when a thread of ember made a system call its seccomp list
/// does not allow (`ember boot --seccomp trap`, the default).
pub const EXIT_SECCOMP: i32 = 4;
/// Exit status when `--timeout` expired (as timeout(1)).
pub const EXIT_TIMEOUT: i32 = 124;

/// The process exit status `ember boot` reports for a guest's ending: 0 on
/// power-off, [`debug_exit_status`] of the guest's debug-exit value, else the
/// constants above.
pub fn guest_end_status(end: GuestEnd) -> i32 {
    match end {
        GuestEnd::PowerOff => 0,
        GuestEnd::Reset => EXIT_GUEST_RESET,
        GuestEnd::ExitCode(n) => debug_exit_status(n),
        GuestEnd::TripleFault => EXIT_GUEST_CRASHED,
    }
}

/// The exit status for a guest that wrote `n` to the debug-exit port: 0 stays 0 (success,
/// like a power-off); any other value becomes `128 + n`, capped at 255. ember's own
/// statuses (1, 2, 3, 124) are all below 128, so a guest can never pass for ember
/// reporting its own failure, a reset, a crash or a timeout. (QEMU's `(n << 1) | 1` would
/// turn 0 and 1 into 1 and 3, two of ember's.)
pub fn debug_exit_status(n: u8) -> i32 {
    match n {
        0 => 0,
        n => (128 + i32::from(n)).min(255),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_endings_map_to_distinct_statuses() {
        assert_eq!(guest_end_status(GuestEnd::PowerOff), 0);
        assert_eq!(guest_end_status(GuestEnd::ExitCode(7)), 135);
        assert_eq!(guest_end_status(GuestEnd::Reset), EXIT_GUEST_RESET);
        assert_eq!(guest_end_status(GuestEnd::TripleFault), EXIT_GUEST_CRASHED);
    }

    /// No value a guest can write looks like one of ember's own statuses.
    #[test]
    fn debug_exit_values_never_collide_with_embers_statuses() {
        let ours = [
            1,
            EXIT_GUEST_RESET,
            EXIT_GUEST_CRASHED,
            EXIT_SECCOMP,
            EXIT_TIMEOUT,
        ];
        for n in 0..=u8::MAX {
            let status = guest_end_status(GuestEnd::ExitCode(n));
            assert!(
                !ours.contains(&status),
                "guest {n} reads as ember's {status}"
            );
            assert!((0..=255).contains(&status));
        }
        assert_eq!(debug_exit_status(0), 0);
        assert_eq!(debug_exit_status(1), 129);
        assert_eq!(debug_exit_status(255), 255);
    }
}
