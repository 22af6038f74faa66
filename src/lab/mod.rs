//! The boot lab: `ember bench`, `ember analyze`, `ember bench-range` — the
//! boot-benchmark, boot-analysis and boot-benchmark-range tools of Jones's
//! "Optimizing QEMU boot time", for any VMM a [`crate::backend::Backend`]
//! can drive.
//!
//! - [`record`] spawns one boot and records it (console lines stamped on
//!   arrival, the VMM's event file, exit time, peak RSS);
//! - [`runner`] runs warm-ups and interleaved series with a progress bar and
//!   Ctrl-C handling ([`signal`]); [`failures`] says which boots did not
//!   count and why;
//! - [`analysis`] merges console and events into a timeline (on the guest's
//!   printk clock where it has one), matches [`activities`], aggregates, and
//!   costs the console; [`stats`] has the statistics;
//! - [`report`] and [`timeline`] print tables and draw the SVG/HTML;
//! - [`doctor`] is the boot doctor (`ember analyze --advise`), with
//!   [`kconfig`] mapping initcalls to config symbols;
//! - [`range`] benchmarks a git range.

pub mod activities;
pub mod analysis;
pub mod config;
pub mod doctor;
pub mod failures;
pub mod guest;
pub mod kconfig;
pub mod range;
pub mod record;
pub mod report;
pub mod runner;
pub mod signal;
pub mod stats;
pub mod timeline;

use analysis::{Milestones, boot_metrics};
use anyhow::Context;
use clap::Args;
use config::{GuestOpts, Header};
use failures::Failures;
pub use range::RangeArgs;
use record::BootRecord;
use report::{AnalyzeReport, AnalyzeView, BenchReport, MetricRow};
use runner::{EXIT_INTERRUPTED, Series, Verdict};
use serde::{Deserialize, Serialize};
use stats::Summary;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Arguments of `ember bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The guest and the VMM.
    #[command(flatten)]
    pub guest: GuestOpts,
    /// Measured boots (per configuration).
    #[arg(short = 'n', long, default_value_t = 10)]
    pub runs: usize,
    /// Discarded warm-up boots (per configuration).
    #[arg(short = 'w', long, default_value_t = 3)]
    pub warmup: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Compare with a second configuration, booted interleaved (A B A B …):
    /// KEY=VALUE[,KEY=VALUE…] overriding the options above. Keys: backend,
    /// machine, accel, vmm, kernel, initrd, cmdline, cmdline+ (appends), mem, cpus.
    /// Example: --vs 'machine=microvm,cmdline+=quiet'.
    #[arg(long, value_name = "KEY=VALUE,…")]
    pub vs: Option<String>,
    /// The figure `--vs` compares pair by pair (a metric name: exit, userspace, …).
    #[arg(long, default_value = "exit")]
    pub metric: String,
    /// Also write every recorded boot (JSON) here.
    #[arg(long, value_name = "FILE.json")]
    pub save: Option<PathBuf>,
}

/// Arguments of `ember analyze`.
#[derive(Debug, Clone, Args)]
pub struct AnalyzeArgs {
    /// The guest and the VMM.
    #[command(flatten)]
    pub guest: GuestOpts,
    /// Measured boots.
    #[arg(short = 'n', long, default_value_t = 5)]
    pub runs: usize,
    /// Discarded warm-up boots.
    #[arg(short = 'w', long, default_value_t = 1)]
    pub warmup: usize,
    /// More activity definitions (see `ember::lab::activities` for the format). Repeatable.
    #[arg(long, value_name = "FILE")]
    pub rules: Vec<PathBuf>,
    /// Use only the `--rules` files, not the built-in Linux definitions.
    #[arg(long)]
    pub no_builtin_rules: bool,
    /// Write the timeline as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub svg: Option<PathBuf>,
    /// Write the timeline as a self-contained HTML page.
    #[arg(long, value_name = "FILE.html")]
    pub html: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// How many of the longest activities to list.
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    /// Hide activities shorter than this many ms from the full table.
    #[arg(long, default_value_t = 1.0)]
    pub min_ms: f64,
    /// Cost of one console character on the serial line, µs. Default: 4 for
    /// QEMU (Jones's measurement of the emulated 16550), 15 for ember (two
    /// exits per character — the THR write and the LSR poll — at ~7.5 µs per
    /// exit, as measured on a software (PVM) KVM; hardware KVM exits cost ~1 µs).
    #[arg(long, value_name = "MICROSECONDS")]
    pub char_cost_us: Option<f64>,
    /// Also write every recorded boot (JSON) here.
    #[arg(long, value_name = "FILE.json")]
    pub save: Option<PathBuf>,
    /// Analyse boots recorded earlier with `--save` instead of booting.
    #[arg(long, value_name = "FILE.json")]
    pub load: Option<PathBuf>,
    /// The boot doctor (`--advise`) and its options.
    #[command(flatten)]
    pub doctor: doctor::DoctorArgs,
}

/// Boots recorded by `--save`, reloadable with `ember analyze --load`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recording {
    /// What was booted.
    pub header: Header,
    /// The measured boots.
    pub records: Vec<BootRecord>,
}

/// Errors saving or loading a [`Recording`].
#[derive(Debug, Error)]
pub enum RecordingError {
    /// The file could not be read or written.
    #[error("cannot access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a recording.
    #[error("{path} is not a boot recording")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

/// Writes `records` (and what was booted) to `path`.
pub fn save(path: &Path, header: &Header, records: &[BootRecord]) -> Result<(), RecordingError> {
    let rec = Recording {
        header: header.clone(),
        records: records.to_vec(),
    };
    let text = serde_json::to_string(&rec).expect("a recording serializes");
    std::fs::write(path, text).map_err(|source| RecordingError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads a recording written by `--save`.
pub fn load(path: &Path) -> Result<Recording, RecordingError> {
    let text = std::fs::read_to_string(path).map_err(|source| RecordingError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| RecordingError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// Per-metric samples of the counted boots, metrics in first-seen order.
pub fn metric_samples(records: &[&BootRecord], m: &Milestones) -> Vec<(String, Vec<f64>)> {
    let mut out: Vec<(String, Vec<f64>)> = Vec::new();
    for r in records {
        for (name, v) in boot_metrics(r, m) {
            match out.iter_mut().find(|(n, _)| *n == name) {
                Some((_, xs)) => xs.push(v),
                None => out.push((name, vec![v])),
            }
        }
    }
    out
}

/// Per-pair values of `metric` for boots where both A and B counted.
fn pairs(series: &Series, ms: &[Milestones; 2], metric: &str) -> (Vec<f64>, Vec<f64>) {
    let value = |r: &BootRecord, m: &Milestones| {
        boot_metrics(r, m)
            .into_iter()
            .find(|(n, _)| n == metric)
            .map(|(_, v)| v)
    };
    series.records[0]
        .iter()
        .zip(&series.records[1])
        .filter(|(a, b)| {
            runner::verdict(a, &ms[0]) == Verdict::Ok && runner::verdict(b, &ms[1]) == Verdict::Ok
        })
        .filter_map(|(a, b)| Some((value(a, &ms[0])?, value(b, &ms[1])?)))
        .unzip()
}

/// Runs `ember bench`; returns the exit status.
pub fn bench(args: BenchArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(args.runs > 0, "-n/--runs must be at least 1");
    signal::install();
    let mut configs = vec![config::build(&args.guest, "A")?];
    if let Some(vs) = &args.vs {
        let b = config::apply_vs(&args.guest, vs)?;
        configs.push(config::build(&b, "B")?);
    }
    let headers: Vec<Header> = configs.iter().map(|(c, _)| Header::new(c)).collect();
    let series = runner::run_series(&configs, args.warmup, args.runs, signal::flag())?;
    let milestones: Vec<Milestones> = configs.iter().map(|(_, m)| m.clone()).collect();
    let samples: Vec<Vec<(String, Vec<f64>)>> = (0..configs.len())
        .map(|i| metric_samples(&series.good(i, &milestones[i]), &milestones[i]))
        .collect();
    let mut metrics: Vec<MetricRow> = Vec::new();
    for (ci, per) in samples.iter().enumerate() {
        for (name, xs) in per {
            let pos = match metrics.iter().position(|m| m.name == *name) {
                Some(p) => p,
                None => {
                    metrics.push(MetricRow {
                        name: name.clone(),
                        unit: if name.contains("MiB") { "MiB" } else { "ms" },
                        a: None,
                        b: None,
                    });
                    metrics.len() - 1
                }
            };
            let s = Summary::of(xs);
            if ci == 0 {
                metrics[pos].a = s;
            } else {
                metrics[pos].b = s;
            }
        }
    }
    let (pair_a, pair_b) = if configs.len() == 2 {
        let ms = [milestones[0].clone(), milestones[1].clone()];
        pairs(&series, &ms, &args.metric)
    } else {
        (Vec::new(), Vec::new())
    };
    let ratio = stats::paired_ratio(&pair_a, &pair_b, 0.95);
    let pair_ratios = pair_a.iter().zip(&pair_b).map(|(a, b)| b / a).collect();
    let report = BenchReport {
        header: headers[0].clone(),
        header_b: headers.get(1).cloned(),
        runs: args.runs,
        warmup: args.warmup,
        counted: (0..configs.len())
            .map(|i| series.good(i, &milestones[i]).len())
            .collect(),
        failures: (0..configs.len())
            .map(|i| Failures::of(&series.records[i], &milestones[i]))
            .collect(),
        timeout_s: args.guest.timeout,
        interrupted: series.interrupted,
        metrics,
        ratio_metric: (configs.len() == 2).then(|| args.metric.clone()),
        ratio,
        pair_ratios,
        samples,
    };
    if let Some(path) = &args.save {
        save(path, &headers[0], &series.records[0])?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(exit_status(&series, report.counted.iter().all(|&c| c > 0)))
}

fn exit_status(series: &Series, any_counted: bool) -> i32 {
    if series.interrupted {
        EXIT_INTERRUPTED
    } else if any_counted {
        0
    } else {
        eprintln!("ember: no boot counted (see above)");
        1
    }
}

/// Builds the analysis of `records` (the counted ones).
pub fn analyze_records(
    header: Header,
    all: &[BootRecord],
    m: &Milestones,
    defs: &[activities::ActivityDef],
    char_cost_us: f64,
    interrupted: bool,
) -> AnalyzeReport {
    let good: Vec<&BootRecord> = all
        .iter()
        .filter(|r| runner::verdict(r, m) == Verdict::Ok)
        .collect();
    let exits: Vec<f64> = good.iter().map(|r| r.exit_us / 1e3).collect();
    let total = Summary::of(&exits);
    let total_ms = total.map_or(0.0, |t| t.mean);
    let per_boot: Vec<Vec<analysis::Activity>> = good
        .iter()
        .map(|r| analysis::activities(&analysis::timeline(r), defs))
        .collect();
    AnalyzeReport {
        header,
        boots: all.len(),
        failures: Failures::of(all, m),
        timeout_s: None,
        total,
        activities: analysis::aggregate(&per_boot, total_ms),
        console: analysis::console_cost(&good, char_cost_us, total_ms),
        interrupted,
        advice: None,
    }
}

/// The default per-character console cost for a backend (see `--char-cost-us`).
pub fn default_char_cost_us(backend: &str) -> f64 {
    /// Jones: the emulated 16550 under QEMU costs about 4 µs per character.
    const QEMU_UART_US_PER_CHAR: f64 = 4.0;
    /// One VM exit on a software (PVM) KVM, the costlier case the default covers.
    const EXIT_US: f64 = 7.5;
    /// Exits per character on ember's 16550: the THR write and one LSR read.
    const EXITS_PER_CHAR: f64 = 2.0;
    if backend == "ember" {
        EXIT_US * EXITS_PER_CHAR
    } else {
        QEMU_UART_US_PER_CHAR
    }
}

/// Runs `ember analyze`; returns the exit status.
pub fn analyze(args: AnalyzeArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(args.runs > 0, "-n/--runs must be at least 1");
    signal::install();
    let mut defs = if args.no_builtin_rules {
        Vec::new()
    } else {
        activities::builtin_linux()
    };
    for path in &args.rules {
        defs.extend(activities::load(path)?);
    }
    let mut args = args;
    if args.doctor.advise
        && args.guest.backend.resolve() == crate::backend::BackendKind::Qemu
        && args.guest.bios.is_none()
        && !args.guest.machine.starts_with("microvm")
    {
        // SeaBIOS logs to its debug port: put it on the console so the
        // firmware's time shows up on the timeline.
        args.guest.firmware_log = true;
    }
    let milestones = config::milestones(&args.guest)?;
    let (header, records, interrupted) = match &args.load {
        Some(path) => {
            let rec = load(path)?;
            (rec.header, rec.records, false)
        }
        None => {
            let cfg = config::build(&args.guest, "A")?;
            let header = Header::new(&cfg.0);
            let mut series = runner::run_series(
                std::slice::from_ref(&cfg),
                args.warmup,
                args.runs,
                signal::flag(),
            )?;
            (header, series.records.remove(0), series.interrupted)
        }
    };
    if let Some(path) = &args.save {
        save(path, &header, &records)?;
    }
    let cost = args
        .char_cost_us
        .unwrap_or_else(|| default_char_cost_us(&header.backend));
    let mut report = analyze_records(header, &records, &milestones, &defs, cost, interrupted);
    report.timeout_s = args.load.is_none().then_some(args.guest.timeout);
    if args.doctor.advise && !interrupted && report.total.is_some() {
        let seen = doctor::Analysed {
            header: &report.header,
            records: &records,
            milestones: &milestones,
            console: report.console.as_ref(),
        };
        let advice = doctor::examine(&args.doctor, &args.guest, args.load.is_some(), &seen)?;
        report.advice = Some(advice);
    }
    let view = AnalyzeView {
        top: args.top,
        min_ms: args.min_ms,
    };
    let text = report.render(view);
    write_pictures(&args, &report, &text)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{text}");
    }
    Ok(if interrupted {
        EXIT_INTERRUPTED
    } else if report.total.is_some() {
        0
    } else {
        1
    })
}

/// `--svg` and `--html`: the timeline of `report` (whose text is `text`).
fn write_pictures(args: &AnalyzeArgs, report: &AnalyzeReport, text: &str) -> anyhow::Result<()> {
    let total_ms = report.total.map_or(0.0, |t| t.mean);
    let title = format!(
        "ember analyze — {} on {} ({} boots, {}ms ±{}ms)",
        Path::new(&report.header.kernel)
            .file_name()
            .map_or(report.header.kernel.clone(), |f| f
                .to_string_lossy()
                .into_owned()),
        report.header.accel,
        report.boots,
        report::num(total_ms),
        report::num(report.total.map_or(0.0, |t| t.sd))
    );
    if let Some(path) = &args.svg {
        std::fs::write(path, timeline::svg(&report.activities, total_ms, &title))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.html {
        std::fs::write(
            path,
            timeline::html(
                &report.activities,
                total_ms,
                &title,
                text,
                report.advice.as_ref().map_or(&[], |a| &a.advice),
            ),
        )
        .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Runs `ember bench-range`; returns the exit status.
pub fn bench_range(args: RangeArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(
        args.runs >= 2,
        "-n/--runs must be at least 2 (the t-test needs a spread)"
    );
    signal::install();
    Ok(range::run(&args)?)
}
