//! The boot doctor (`ember analyze --advise`): Jones's method — measure the
//! boot, find what costs most, change one thing, measure again — turned
//! into rules over the lab's timeline. Each rule reads the analysed boots
//! (and a *profile* boot with `initcall_debug ignore_loglevel`, whose
//! initcall durations the kernel measures itself), and proposes a concrete
//! change with its evidence and a saving predicted from those figures.
//! `--verify` then boots with each change applied, A/B interleaved, and
//! reports the measured saving with its interval.
//!
//! - `model`: a suggestion, its change, and what `--verify` measured;
//! - `evidence`: what the rules read, and how they find spans and lines in
//!   it; `initcalls`: the kernel's own initcall times; `initramfs`: a look
//!   inside the guest's initramfs;
//! - `rules`: the rules themselves, by what they change;
//! - `verify`: the A/B boots; `render`: the advice as text.
//!
//! This file runs them in order ([`examine`]).

mod evidence;
mod initcalls;
mod initramfs;
mod model;
mod render;
mod rules;
#[cfg(test)]
mod testing;
mod verify;

pub use model::{Advice, AdviceReport, Change, PROFILE_CMDLINE};
pub use render::verification_text;

use crate::appliance::kernel::KernelError;
use crate::lab::analysis::{ConsoleCost, Milestones};
use crate::lab::config::{self, ConfigError, GuestOpts, Header};
use crate::lab::kconfig::{self, KconfigMap};
use crate::lab::record::BootRecord;
use crate::lab::runner::{self, RunError, Verdict};
use crate::lab::signal;
use clap::Args;
use evidence::Inputs;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The doctor's options of `ember analyze`.
#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// The boot doctor: a ranked list of concrete changes, each with its
    /// evidence and a predicted saving. Also boots `--profile-boots` times
    /// with `initcall_debug ignore_loglevel` for the kernel's own initcall
    /// durations, and (QEMU) logs the firmware.
    #[arg(long)]
    pub advise: bool,
    /// With `--advise`: boot again with each automatic suggestion applied,
    /// A/B interleaved, and report the measured saving with its 95 % interval.
    #[arg(long, requires = "advise")]
    pub verify: bool,
    /// With `--advise`: profile boots (0: none, no initcall advice).
    #[arg(long, default_value_t = 1)]
    pub profile_boots: usize,
    /// With `--verify`: verify only these suggestions (their ids, as
    /// `--json` shows them: quiet, cryptomgr.notests, qboot…).
    #[arg(long, value_name = "ID,…", value_delimiter = ',', requires = "verify")]
    pub verify_only: Vec<String>,
    /// With `--verify`: A/B pairs per suggestion.
    #[arg(long, default_value_t = 3)]
    pub verify_pairs: usize,
    /// With `--advise`: kernel source (directory or linux-source-*.tar.xz) to
    /// map initcalls to config symbols (default: $EMBER_KERNEL_SOURCE or
    /// /usr/src/linux-source-*).
    #[arg(long, value_name = "PATH")]
    pub kernel_source: Option<PathBuf>,
    /// With `--advise`: the kernel's .config (default: found beside the kernel).
    #[arg(long, value_name = "FILE")]
    pub kernel_config: Option<PathBuf>,
}

/// Errors that stop the doctor.
#[derive(Debug, Error)]
pub enum DoctorError {
    /// A profile boot's configuration could not be built.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The profile boots could not run.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The cache for the initcall → config symbol map has no place.
    #[error(transparent)]
    Cache(#[from] KernelError),
    /// `--verify` could not boot.
    #[error(transparent)]
    Verify(#[from] verify::VerifyError),
}

/// What `ember analyze` found, as the doctor reads it.
pub struct Analysed<'a> {
    /// What was booted.
    pub header: &'a Header,
    /// Every recorded boot, counted or not.
    pub records: &'a [BootRecord],
    /// What counts as reaching userspace.
    pub milestones: &'a Milestones,
    /// The console's cost.
    pub console: Option<&'a ConsoleCost>,
}

/// `--advise` (and `--verify`): profile boots, the initcall → config symbol
/// map, the rules, and the A/B boots. `guest` is what was booted; `loaded`
/// says the boots came from a recording (`--load`), which boots nothing new.
pub fn examine(
    args: &DoctorArgs,
    guest: &GuestOpts,
    loaded: bool,
    seen: &Analysed<'_>,
) -> Result<AdviceReport, DoctorError> {
    let m = seen.milestones;
    let good = counted(seen.records, m);
    let profiled = seen.header.cmdline.contains("initcall_debug");
    let profile_records = if profiled || args.profile_boots == 0 || loaded {
        Vec::new()
    } else {
        profile_boots(guest, args.profile_boots)?
    };
    let profile = if profiled {
        good.clone()
    } else {
        counted(&profile_records, m)
    };
    let kmap = initcall_owners(args.kernel_source.clone())?;
    let config_path = args
        .kernel_config
        .clone()
        .or_else(|| kconfig::find_config(Path::new(&seen.header.kernel)));
    let builtin: Option<BTreeSet<String>> = config_path
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|t| kconfig::builtin_symbols(&t));
    let mut advice = rules::advise(&Inputs {
        header: seen.header,
        opts: guest,
        boots: &good,
        profile: &profile,
        console: seen.console,
        kmap: kmap.as_ref(),
        builtin: builtin.as_ref(),
    });
    let combined = if args.verify && !loaded {
        verify::verify_all(&mut advice, guest, &args.verify_only, args.verify_pairs, m)?
    } else {
        None
    };
    Ok(AdviceReport {
        profile_boots: profile.len(),
        kconfig_source: kmap.as_ref().map(|k| k.source.clone()),
        kernel_config: config_path.map(|p| p.display().to_string()),
        advice,
        combined,
    })
}

/// The boots of `records` that count under `m`.
fn counted<'r>(records: &'r [BootRecord], m: &Milestones) -> Vec<&'r BootRecord> {
    records
        .iter()
        .filter(|r| runner::verdict(r, m) == Verdict::Ok)
        .collect()
}

/// Boots `guest` `n` times with [`PROFILE_CMDLINE`] added.
fn profile_boots(guest: &GuestOpts, n: usize) -> Result<Vec<BootRecord>, DoctorError> {
    let mut p = guest.clone();
    p.cmdline.push(' ');
    p.cmdline.push_str(PROFILE_CMDLINE);
    eprintln!("ember: --advise: {n} profile boot(s) with `{PROFILE_CMDLINE}`");
    let cfg = config::build(&p, "profile")?;
    let mut series = runner::run_series(std::slice::from_ref(&cfg), 0, n, signal::flag())?;
    Ok(series.records.remove(0))
}

/// The initcall → config symbol map of the kernel source `source` (else
/// the one this machine has), derived once and cached. `None` without a
/// source, or when it cannot be read: the initcalls stay unattributed.
fn initcall_owners(source: Option<PathBuf>) -> Result<Option<KconfigMap>, DoctorError> {
    let Some(src) = source.or_else(kconfig::find_source) else {
        return Ok(None);
    };
    let cache = crate::appliance::kernel::cache_dir()?.join("kconfig");
    match kconfig::load_or_derive(&src, &cache) {
        Ok(m) => Ok(Some(m)),
        Err(e) => {
            eprintln!(
                "ember: --advise: {}; initcalls stay unattributed",
                ember_vmm::error_chain(&e)
            );
            Ok(None)
        }
    }
}
