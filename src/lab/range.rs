//! `ember bench-range`: build and benchmark every commit of a git range in a
//! scratch worktree, and flag changes beyond noise.
//!
//! Results are kept per commit hash in `<cache>/state.json`, together with a
//! fingerprint of the settings that produced them, so an interrupted or
//! repeated run only measures what is missing. Each commit's artifact is
//! copied to `<cache>/artifacts/<hash>/` before it is booted; build logs go
//! to `<cache>/logs/<hash>.log`. The worktree is reused between commits and not
//! cleaned, so incremental builds stay incremental.

use super::analysis::boot_metrics;
use super::config::{self, ConfigError, GuestOpts};
use super::failures::Failures;
use super::report::num;
use super::runner::{self, EXIT_INTERRUPTED, RunError, Verdict};
use super::signal;
use super::stats::{self, Summary};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// Version of the state file format.
const STATE_VERSION: u32 = 1;

/// Range errors. Those of one commit (see [`RangeError::concerns_commit`])
/// are recorded in its result; the others stop the range.
#[derive(Debug, Error)]
pub enum RangeError {
    /// The repository cannot be found.
    #[error("repository {}", path.display())]
    Repo {
        /// As given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// git could not be run, or failed.
    #[error(transparent)]
    Git(#[from] crate::tool::ToolError),
    /// The range has no commits.
    #[error("the range `{0}` contains no commits")]
    Empty(String),
    /// A cache file could not be written or read.
    #[error("cache file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The commit's build command failed.
    #[error("build failed ({status}); log: {}", log.display())]
    Build {
        /// How it ended.
        status: std::process::ExitStatus,
        /// Its output.
        log: PathBuf,
    },
    /// The commit's build did not produce the artifact.
    #[error("the build did not produce {}", .0.display())]
    NoArtifact(PathBuf),
    /// The commit's artifact makes no configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The commit's boots could not run.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Ctrl-C stopped the commit's boots.
    #[error("interrupted")]
    Interrupted,
}

impl RangeError {
    /// Whether the error concerns only the commit being measured (recorded
    /// in its result, and the range goes on).
    pub fn concerns_commit(&self) -> bool {
        matches!(
            self,
            RangeError::Build { .. }
                | RangeError::NoArtifact(_)
                | RangeError::Config(_)
                | RangeError::Run(_)
                | RangeError::Interrupted
        )
    }
}

/// Arguments of `ember bench-range`.
#[derive(Debug, Clone, Args)]
pub struct RangeArgs {
    /// The git repository.
    pub repo: PathBuf,
    /// Commits to benchmark, as `git rev-list` takes them (`A..B` excludes A;
    /// write `A^..B` to include it).
    pub range: String,
    /// Shell command that builds the artifact, run in the commit's checkout.
    #[arg(long, value_name = "CMD")]
    pub build: String,
    /// The artifact the build produces, relative to the checkout.
    #[arg(long, value_name = "PATH")]
    pub artifact: PathBuf,
    /// How the artifact is used: as the guest kernel, or as the VMM binary
    /// of `--backend`.
    #[arg(long, value_enum, default_value_t = ArtifactKind::Kernel)]
    pub artifact_kind: ArtifactKind,
    /// The guest and the VMM (the artifact replaces one of them).
    #[command(flatten)]
    pub guest: GuestOpts,
    /// Measured boots per commit.
    #[arg(short = 'n', long, default_value_t = 10)]
    pub runs: usize,
    /// Discarded warm-up boots per commit.
    #[arg(short = 'w', long, default_value_t = 1)]
    pub warmup: usize,
    /// The figure compared between commits.
    #[arg(long, default_value = "exit")]
    pub metric: String,
    /// Significance level of the Welch t-test that marks a change.
    #[arg(long, default_value_t = 0.01)]
    pub alpha: f64,
    /// Where the scratch worktree, artifacts and the state file live
    /// (default: ~/.cache/ember/bench-range/<repo name>).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// How the built artifact is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    /// The guest kernel (`--kernel`).
    Kernel,
    /// The VMM binary of `--backend` (`--vmm`).
    Vmm,
}

/// One commit's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitResult {
    /// Full hash.
    pub hash: String,
    /// Subject line.
    pub subject: String,
    /// The settings fingerprint the result was made with.
    pub fingerprint: String,
    /// Per-boot values of the metric, ms.
    pub samples: Vec<f64>,
    /// Their summary.
    pub summary: Option<Summary>,
    /// Boots that did not count.
    pub failures: Failures,
    /// Why the commit could not be measured (build failure …).
    pub error: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    version: u32,
    commits: BTreeMap<String, CommitResult>,
}

/// A change between consecutive measured commits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Change {
    /// `true` when faster.
    pub improves: bool,
    /// Size of the change, percent (speed-up or slow-down factor − 1).
    pub percent: f64,
    /// Welch's two-sided p-value.
    pub p: f64,
}

/// Compares `cur` with `prev`: a change when Welch's t-test rejects equal
/// means at `alpha`.
pub fn compare(prev: &[f64], cur: &[f64], alpha: f64) -> Option<Change> {
    let t = stats::welch(prev, cur)?;
    if t.p >= alpha {
        return None;
    }
    let (a, b) = (stats::mean(prev), stats::mean(cur));
    if a <= 0.0 || b <= 0.0 {
        return None;
    }
    Some(if b < a {
        Change {
            improves: true,
            percent: (a / b - 1.0) * 100.0,
            p: t.p,
        }
    } else {
        Change {
            improves: false,
            percent: (b / a - 1.0) * 100.0,
            p: t.p,
        }
    })
}

fn git(repo: &Path, args: &[&str]) -> Result<String, RangeError> {
    // Run in the repository rather than with `-C`, so the error names the
    // git command as a person would type it there.
    Ok(crate::tool::run(
        Command::new("git").args(args).current_dir(repo),
    )?)
}

/// The commits of `range`, oldest first, with their subjects.
pub fn commits(repo: &Path, range: &str) -> Result<Vec<(String, String)>, RangeError> {
    let out = git(repo, &["rev-list", "--reverse", "--format=%s", range, "--"])?;
    let mut list = Vec::new();
    let mut lines = out.lines();
    while let Some(l) = lines.next() {
        if let Some(hash) = l.strip_prefix("commit ") {
            list.push((hash.to_owned(), lines.next().unwrap_or("").to_owned()));
        }
    }
    if list.is_empty() {
        return Err(RangeError::Empty(range.to_owned()));
    }
    Ok(list)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RangeError + '_ {
    move |source| RangeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn load_state(path: &Path) -> State {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<State>(&t).ok())
        .filter(|s| s.version == STATE_VERSION)
        .unwrap_or(State {
            version: STATE_VERSION,
            commits: BTreeMap::new(),
        })
}

fn save_state(path: &Path, state: &State) -> Result<(), RangeError> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(state).expect("state serializes");
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Everything that changes what a measurement means.
fn fingerprint(args: &RangeArgs) -> String {
    let g = &args.guest;
    format!(
        "build={}|artifact={}|kind={:?}|backend={}|machine={}|accel={:?}|vmm={:?}|kernel={:?}|initrd={}|busybox={}|cmdline={}|mem={}|cpus={}|userspace={}|metric={}|n={}|w={}",
        args.build,
        args.artifact.display(),
        args.artifact_kind,
        // Resolved: what a measurement means is the VMM that ran.
        g.backend.resolve(),
        g.machine,
        g.accel,
        g.vmm,
        g.kernel,
        initrd_choice(g),
        g.busybox_init,
        g.cmdline,
        g.mem,
        g.cpus,
        g.userspace,
        args.metric,
        args.runs,
        args.warmup
    )
}

/// `--initrd` as the fingerprint has it (as it always had, with `busybox=`
/// beside it), but the appliance booted by default is named: measurements
/// made when no `--initrd` meant no initramfs are not taken for its.
fn initrd_choice(g: &GuestOpts) -> String {
    if g.initrd.is_none() && !g.busybox_init && !g.no_initrd {
        "appliance".into()
    } else {
        format!("{:?}", g.initrd)
    }
}

fn default_cache(repo: &Path) -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    let name = repo
        .file_name()
        .map_or("repo".into(), |n| n.to_string_lossy().into_owned());
    home.join(".cache/ember/bench-range").join(name)
}

/// Checks `hash` out in the scratch worktree, creating it the first time.
fn checkout(repo: &Path, wt: &Path, hash: &str) -> Result<(), RangeError> {
    if wt.join(".git").exists() {
        git(wt, &["checkout", "--quiet", "--detach", "--force", hash])?;
    } else {
        // A stale registration (directory deleted by hand) would block `add`.
        git(repo, &["worktree", "prune"])?;
        let wt_s = wt.to_string_lossy();
        git(
            repo,
            &["worktree", "add", "--quiet", "--detach", &wt_s, hash],
        )?;
    }
    Ok(())
}

/// Builds and measures one commit (checked out in `wt`) into its result:
/// an error that concerns only this commit (build failure, missing
/// artifact, boot problems) is recorded there, the others stop the range.
fn measure_commit(
    args: &RangeArgs,
    cache: &Path,
    wt: &Path,
    (hash, subject): (&str, &str),
    fingerprint: &str,
    bar: &indicatif::ProgressBar,
) -> Result<CommitResult, RangeError> {
    let (samples, failures, error) = match measure(args, cache, wt, hash, bar) {
        Ok((s, f)) => (s, f, None),
        Err(e) if e.concerns_commit() => (
            Vec::new(),
            Failures::default(),
            Some(ember_vmm::error_chain(&e)),
        ),
        Err(e) => return Err(e),
    };
    Ok(CommitResult {
        hash: hash.to_owned(),
        subject: subject.to_owned(),
        fingerprint: fingerprint.to_owned(),
        summary: Summary::of(&samples),
        samples,
        failures,
        error,
    })
}

/// Builds and measures one commit: the metric's samples and the boots that
/// did not count.
fn measure(
    args: &RangeArgs,
    cache: &Path,
    wt: &Path,
    hash: &str,
    bar: &indicatif::ProgressBar,
) -> Result<(Vec<f64>, Failures), RangeError> {
    let logs = cache.join("logs");
    std::fs::create_dir_all(&logs).map_err(io(&logs))?;
    let log_path = logs.join(format!("{hash}.log"));
    let log = std::fs::File::create(&log_path).map_err(io(&log_path))?;
    let log_err = log.try_clone().map_err(io(&log_path))?;
    bar.set_message(format!("{} building", &hash[..7]));
    let status = Command::new("sh")
        .arg("-c")
        .arg(&args.build)
        .current_dir(wt)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .status()
        .map_err(io(&log_path))?;
    if !status.success() {
        return Err(RangeError::Build {
            status,
            log: log_path,
        });
    }
    let built = wt.join(&args.artifact);
    if !built.is_file() {
        return Err(RangeError::NoArtifact(args.artifact.clone()));
    }
    let dir = cache.join("artifacts").join(hash);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let artifact = dir.join(built.file_name().unwrap_or_default());
    std::fs::copy(&built, &artifact).map_err(io(&artifact))?;
    let mut guest = args.guest.clone();
    match args.artifact_kind {
        ArtifactKind::Kernel => guest.kernel = Some(artifact),
        ArtifactKind::Vmm => guest.vmm = Some(artifact),
    }
    let cfg = config::build(&guest, &hash[..7])?;
    bar.set_message(format!("{} booting", &hash[..7]));
    let series = runner::run_series_with(
        std::slice::from_ref(&cfg),
        args.warmup,
        args.runs,
        signal::flag(),
        bar,
    )?;
    if series.interrupted {
        return Err(RangeError::Interrupted);
    }
    let m = &cfg.1;
    let samples = series.records[0]
        .iter()
        .filter(|r| runner::verdict(r, m) == Verdict::Ok)
        .filter_map(|r| {
            boot_metrics(r, m)
                .into_iter()
                .find(|(n, _)| *n == args.metric)
                .map(|(_, v)| v)
        })
        .collect();
    let failures = Failures::of(&series.records[0], m);
    Ok((samples, failures))
}

fn short_subject(s: &str) -> String {
    const MAX: usize = 60;
    if s.chars().count() > MAX {
        format!("{}[...]", s.chars().take(MAX).collect::<String>())
    } else {
        s.to_owned()
    }
}

/// The report line(s) of one commit.
fn render(r: &CommitResult, change: Option<Change>) -> String {
    /// Width of the figures column, so subjects line up.
    const FIGURES: usize = 56;
    let hash = &r.hash[..7.min(r.hash.len())];
    let figures = match (&r.error, &r.summary) {
        (Some(e), _) => format!("error: {e}"),
        (None, Some(s)) => {
            let mut b = format!("{:>9}ms ±{:>8}ms n={:<3}", num(s.mean), num(s.sd), s.n);
            if let Some(c) = change {
                b.push_str(&format!(
                    " {} by {:.1}% (p={:.1e})",
                    if c.improves {
                        "↑ improves"
                    } else {
                        "↓ regresses"
                    },
                    c.percent,
                    c.p
                ));
            }
            let f = &r.failures;
            let lost: Vec<String> = [
                (f.timed_out, "timed out"),
                (f.panicked, "panicked"),
                (f.no_userspace, "without userspace"),
            ]
            .iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
            if !lost.is_empty() {
                b.push_str(&format!(" [{}]", lost.join(", ")));
            }
            b
        }
        (None, None) => "no boot counted".into(),
    };
    format!("{hash} {figures:<FIGURES$} {}\n", short_subject(&r.subject))
}

/// Runs the whole range; returns the exit status.
pub fn run(args: &RangeArgs) -> Result<i32, RangeError> {
    let repo = args
        .repo
        .canonicalize()
        .map_err(|source| RangeError::Repo {
            path: args.repo.clone(),
            source,
        })?;
    let list = commits(&repo, &args.range)?;
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(|| default_cache(&repo));
    std::fs::create_dir_all(&cache).map_err(io(&cache))?;
    let cache = cache.canonicalize().map_err(io(&cache))?;
    let state_path = cache.join("state.json");
    let wt = cache.join("worktree");
    let mut state = load_state(&state_path);
    let fp = fingerprint(args);
    let todo = list
        .iter()
        .filter(|(h, _)| state.commits.get(h).is_none_or(|r| r.fingerprint != fp))
        .count();
    eprintln!(
        "ember bench-range: {} commit(s), {} cached, {} to measure; cache {}",
        list.len(),
        list.len() - todo,
        todo,
        cache.display()
    );
    let bar = runner::progress((todo * (args.warmup + args.runs)) as u64);
    let mut prev: Option<Vec<f64>> = None;
    let mut results = Vec::new();
    let mut interrupted = false;
    for (hash, subject) in &list {
        let cached = state
            .commits
            .get(hash)
            .filter(|r| r.fingerprint == fp)
            .cloned();
        let result = match cached {
            Some(r) => r,
            None => {
                if signal::interrupted() {
                    interrupted = true;
                    break;
                }
                checkout(&repo, &wt, hash)?;
                let r = measure_commit(args, &cache, &wt, (hash, subject), &fp, &bar)?;
                if signal::interrupted() {
                    interrupted = true;
                    break;
                }
                state.commits.insert(hash.clone(), r.clone());
                save_state(&state_path, &state)?;
                r
            }
        };
        let change = prev
            .as_ref()
            .and_then(|p| compare(p, &result.samples, args.alpha));
        if !args.json {
            bar.suspend(|| print!("{}", render(&result, change)));
        }
        if result.summary.is_some() {
            prev = Some(result.samples.clone());
        }
        results.push((result, change));
    }
    bar.finish_and_clear();
    if args.json {
        println!("{}", json(&results));
    }
    if interrupted {
        eprintln!(
            "ember bench-range: interrupted; {} commit(s) done, rerun to continue",
            results.len()
        );
        return Ok(EXIT_INTERRUPTED);
    }
    Ok(0)
}

/// The results as `--json` prints them: each commit's result with its change.
fn json(results: &[(CommitResult, Option<Change>)]) -> String {
    #[derive(Serialize)]
    struct Row<'a> {
        #[serde(flatten)]
        result: &'a CommitResult,
        change: Option<Change>,
    }
    let rows: Vec<Row<'_>> = results
        .iter()
        .map(|(result, change)| Row {
            result,
            change: *change,
        })
        .collect();
    serde_json::to_string_pretty(&rows).expect("results serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_flags_only_real_changes() {
        let base = [100.0, 101.0, 99.0, 100.5, 99.5, 100.2];
        let noise = [100.3, 99.2, 100.8, 99.9, 100.1, 100.6];
        let slower: Vec<f64> = base.iter().map(|x| x * 1.2).collect();
        let faster: Vec<f64> = base.iter().map(|x| x / 1.5).collect();
        assert_eq!(compare(&base, &noise, 0.01), None);
        let c = compare(&base, &slower, 0.01).unwrap();
        assert!(!c.improves && (c.percent - 20.0).abs() < 0.5, "{c:?}");
        let c = compare(&base, &faster, 0.01).unwrap();
        assert!(c.improves && (c.percent - 50.0).abs() < 0.5, "{c:?}");
        assert_eq!(compare(&base, &[1.0], 0.01), None);
    }

    #[test]
    fn render_marks_changes_and_errors() {
        let r = CommitResult {
            hash: "8e86aa8000".into(),
            subject: "Add optionrom compatible with fw_cfg DMA version".into(),
            fingerprint: String::new(),
            samples: vec![],
            summary: Summary::of(&[1013.7, 1013.7]),
            failures: Failures::default(),
            error: None,
        };
        let c = Change {
            improves: true,
            percent: 64.9,
            p: 1e-9,
        };
        let s = render(&r, Some(c));
        assert!(
            s.starts_with("8e86aa8    1013.7ms ±   0.000ms n=2   ↑ improves by 64.9%"),
            "{s}"
        );
        assert!(
            s.trim_end()
                .ends_with("Add optionrom compatible with fw_cfg DMA version"),
            "{s}"
        );
        assert_eq!(s.lines().count(), 1);
        let e = CommitResult {
            error: Some("build failed".into()),
            ..r
        };
        assert!(render(&e, None).contains("error: build failed"));
    }
}
