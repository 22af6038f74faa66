//! What the doctor says: a suggestion ([`Advice`]) — a concrete [`Change`]
//! with its evidence and predicted saving — and what `--verify` measured of
//! it ([`Verification`]).

use crate::lab::analysis::split_printk;
use crate::lab::config::GuestOpts;
use crate::lab::failures::Failures;
use crate::lab::record::BootRecord;
use crate::lab::stats::{Interval, Summary};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What `--advise` appends to the command line of its profile boots: every
/// initcall reports its own duration, every message reaches the console,
/// the APIC code says when it calibrates its timer, and every work item
/// the kernel runs in the background says when it starts and ends (about a
/// hundred lines: boot work an initcall queues is invisible to
/// `initcall_debug`).
pub const PROFILE_CMDLINE: &str = "initcall_debug ignore_loglevel apic=verbose \
     trace_event=workqueue:workqueue_execute_start,workqueue:workqueue_execute_end tp_printk";

/// Suggestions predicted to save less than this are not listed.
pub const MIN_SAVING_MS: f64 = 0.5;

/// One concrete change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Change {
    /// Add this option to the kernel command line.
    CmdlineAdd {
        /// The option.
        option: String,
    },
    /// Boot with this many vCPUs (`--cpus`).
    Cpus {
        /// vCPUs.
        cpus: u32,
    },
    /// Boot with this much memory (`--mem`, MiB).
    Mem {
        /// MiB.
        mib: u64,
    },
    /// QEMU backend: boot through this firmware (`--bios`).
    Bios {
        /// The firmware image.
        path: String,
    },
    /// Build the kernel without this config symbol.
    KconfigOff {
        /// `CONFIG_…`.
        symbol: String,
    },
    /// Change the guest's init or initramfs (by hand).
    Guest {
        /// What to do.
        what: String,
    },
}

impl Change {
    /// Whether `--verify` can apply it by itself.
    pub fn automatic(&self) -> bool {
        matches!(
            self,
            Change::CmdlineAdd { .. }
                | Change::Cpus { .. }
                | Change::Mem { .. }
                | Change::Bios { .. }
        )
    }

    /// The change as the user would make it.
    pub fn describe(&self) -> String {
        match self {
            Change::CmdlineAdd { option } => format!("kernel command line += {option}"),
            Change::Cpus { cpus } => format!("--cpus {cpus}"),
            Change::Mem { mib } => format!("--mem {mib}M"),
            Change::Bios { path } => format!("--bios {path} (QEMU -bios)"),
            Change::KconfigOff { symbol } => format!("kernel config: {symbol}=n"),
            Change::Guest { what } => what.clone(),
        }
    }

    /// Applies an automatic change to `opts`; false for a manual one.
    pub fn apply(&self, opts: &mut GuestOpts) -> bool {
        match self {
            Change::CmdlineAdd { option } => {
                opts.cmdline.push(' ');
                opts.cmdline.push_str(option);
            }
            Change::Cpus { cpus } => opts.cpus = *cpus,
            Change::Mem { mib } => opts.mem = *mib,
            Change::Bios { path } => opts.bios = Some(PathBuf::from(path)),
            _ => return false,
        }
        true
    }
}

/// One suggestion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advice {
    /// Stable identifier (`quiet`, `cryptomgr.notests`, `kconfig:CONFIG_X`…).
    pub id: String,
    /// What and why, in one line.
    pub title: String,
    /// The activities and console lines behind it.
    pub evidence: Vec<String>,
    /// Saving predicted from this analysis, ms per boot.
    pub predicted_ms: f64,
    /// The change to make.
    pub change: Change,
    /// `--verify`'s measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<Verification>,
}

/// What `--verify` times of each boot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyClock {
    /// Spawn to exit, on the host's clock.
    #[default]
    Wall,
    /// The guest kernel's clock at its last console line: under `--icount`
    /// it counts the guest's instructions (1 ns each), whatever the host's
    /// load. Not for a firmware change (the firmware runs before the
    /// kernel's clock starts).
    Guest,
}

impl VerifyClock {
    /// The clock for `change`: the guest's where it counts instructions
    /// (`icount`) and sees the change.
    pub fn for_change(icount: bool, change: &Change) -> Self {
        if icount && !matches!(change, Change::Bios { .. }) {
            VerifyClock::Guest
        } else {
            VerifyClock::Wall
        }
    }

    /// This clock's reading of a boot, ms.
    pub fn of(self, r: &BootRecord) -> Option<f64> {
        match self {
            VerifyClock::Wall => Some(r.exit_us / 1e3),
            VerifyClock::Guest => guest_end_ms(r),
        }
    }
}

/// The guest kernel's clock at its last timestamped console line, ms.
pub fn guest_end_ms(r: &BootRecord) -> Option<f64> {
    r.lines
        .iter()
        .filter_map(|l| split_printk(&l.text).0)
        .reduce(f64::max)
        .map(|us| us / 1e3)
}

/// What `--verify` measured for one suggestion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    /// Pairs booted (A without, B with the change), interleaved.
    pub pairs: usize,
    /// What was timed.
    #[serde(default)]
    pub clock: VerifyClock,
    /// A's time, ms (spawn to exit, or the guest's clock).
    pub without_ms: Option<Summary>,
    /// B's time, ms.
    pub with_ms: Option<Summary>,
    /// Saving A − B per pair, mean with its 95 % t-interval, ms.
    pub saving_ms: Option<Interval>,
    /// The outcome.
    pub verdict: VerifyVerdict,
    /// Boots that did not count, without and with the change (a pair
    /// counts only when both of its boots do).
    #[serde(default)]
    pub failures: [Failures; 2],
}

/// Whether a suggestion paid off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyVerdict {
    /// The interval lies above zero.
    Saves,
    /// The interval contains zero: no saving shown.
    NoSaving,
    /// The interval lies below zero: it made the boot slower.
    Slower,
    /// Boots with the change did not reach userspace.
    Broke,
    /// Too few pairs counted for an interval.
    Inconclusive,
}

impl VerifyVerdict {
    /// From the paired savings.
    pub fn of(saving: Option<&Interval>) -> Self {
        match saving {
            None => VerifyVerdict::Inconclusive,
            Some(i) if i.low > 0.0 => VerifyVerdict::Saves,
            Some(i) if i.high < 0.0 => VerifyVerdict::Slower,
            Some(_) => VerifyVerdict::NoSaving,
        }
    }
}

/// The doctor's part of an `ember analyze` report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdviceReport {
    /// Profile boots (with [`PROFILE_CMDLINE`]) the initcall figures come from.
    pub profile_boots: usize,
    /// Where the initcall → config symbol map came from.
    pub kconfig_source: Option<String>,
    /// The kernel config consulted for built-in symbols.
    pub kernel_config: Option<String>,
    /// The suggestions, largest predicted saving first.
    pub advice: Vec<Advice>,
    /// `--verify`: every automatic change at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combined: Option<Combined>,
}

/// All automatic suggestions applied together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Combined {
    /// The changes.
    pub changes: Vec<String>,
    /// The sum of their predictions, ms.
    pub predicted_ms: f64,
    /// What was measured.
    pub verified: Verification,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::qemu::QBOOT;
    use crate::lab::doctor::testing::record;

    #[test]
    fn icount_verifies_on_the_guests_clock_but_a_firmware_change() {
        let mem = Change::Mem { mib: 128 };
        let bios = Change::Bios {
            path: QBOOT.to_owned(),
        };
        assert_eq!(VerifyClock::for_change(true, &mem), VerifyClock::Guest);
        assert_eq!(VerifyClock::for_change(true, &bios), VerifyClock::Wall);
        assert_eq!(VerifyClock::for_change(false, &mem), VerifyClock::Wall);
        // The guest's clock: the last kernel timestamp, whatever arrives after it.
        let r = record(
            &[
                (1000.0, "[    0.500000] a"),
                (2000.0, "[    0.712345] reboot: Power down"),
                (2100.0, "no stamp"),
            ],
            9000.0,
        );
        assert_eq!(VerifyClock::Guest.of(&r), Some(712.345));
        assert_eq!(VerifyClock::Wall.of(&r), Some(9.0));
        assert_eq!(guest_end_ms(&record(&[(1.0, "plain")], 5.0)), None);
    }
}
