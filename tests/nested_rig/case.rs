//! What the suite prints, read case by case: its `@@ CASE KIND TEXT` lines
//! (the format is at the top of `tests/rig/suite.sh`).

use std::collections::BTreeMap;

/// One case's output.
#[derive(Debug, Default)]
pub struct Case {
    pub out: Vec<String>,
    pub err: Vec<String>,
    pub rc: Option<i32>,
    pub ms: Option<u64>,
    /// The case ran into its limit (seconds) and the suite killed it.
    pub hung: Option<u64>,
    /// The suite said it started the case.
    pub started: bool,
    /// The first attempt failed after the L2 kernel reported trouble (a
    /// panic, oops, stall or triple fault), and the suite ran the case again
    /// (`retry`); its last console lines (`panic`).
    pub retried: bool,
    pub panic: Vec<String>,
}

impl Case {
    /// The values of `@KEY VALUE` lines (the L2 init's facts).
    pub fn facts(&self, key: &str) -> Vec<&str> {
        let prefix = format!("@{key} ");
        self.out
            .iter()
            .filter_map(|l| {
                l.strip_prefix(&prefix)
                    .or((l == &format!("@{key}")).then_some(""))
            })
            .collect()
    }

    pub fn fact(&self, key: &str) -> Option<&str> {
        self.facts(key).into_iter().next()
    }

    pub fn dump(&self) -> String {
        let hung = match self.hung {
            Some(s) => format!(" HUNG: killed at its limit of {s} s"),
            None => String::new(),
        };
        let first = if self.retried {
            format!(
                "\n--- a first attempt failed after a guest kernel panic, oops, stall or triple fault; its last lines ---\n{}",
                self.panic.join("\n")
            )
        } else {
            String::new()
        };
        format!(
            "rc={:?} ms={:?}{hung}\n--- stdout ---\n{}\n--- stderr ---\n{}{first}",
            self.rc,
            self.ms,
            self.out.join("\n"),
            self.err.join("\n")
        )
    }
}

/// Everything one L1 printed on its stdout.
#[derive(Debug, Default)]
pub struct SuiteLog {
    pub cases: BTreeMap<String, Case>,
    /// The cases in the order they started.
    pub order: Vec<String>,
    /// Lines that are not the suite's (the L1's own messages).
    pub other: Vec<String>,
}

/// What a suite line says about the case running in the L1.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// The case started; the suite kills it after `limit_s` (when it said).
    Started { case: String, limit_s: Option<u64> },
    /// The case ended.
    Ended,
}

impl SuiteLog {
    /// Takes one line (its `\r` already trimmed).
    pub fn take(&mut self, line: &str) -> Option<Progress> {
        let Some(rest) = line.strip_prefix("@@ ") else {
            self.other.push(line.to_owned());
            return None;
        };
        let mut parts = rest.splitn(3, ' ');
        let (name, kind, text) = (
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
        );
        let mut progress = None;
        if kind == "start" {
            self.order.push(name.to_owned());
            progress = Some(Progress::Started {
                case: name.to_owned(),
                limit_s: text.strip_prefix("limit=").and_then(|v| v.parse().ok()),
            });
        } else if kind == "end" {
            progress = Some(Progress::Ended);
        }
        let case = self.cases.entry(name.to_owned()).or_default();
        match kind {
            "out" => case.out.push(text.trim_end_matches('\r').to_owned()),
            "err" => case.err.push(text.to_owned()),
            "end" => {
                for kv in text.split(' ') {
                    match kv.split_once('=') {
                        Some(("rc", v)) => case.rc = v.parse().ok(),
                        Some(("ms", v)) => case.ms = v.parse().ok(),
                        Some(("hung", v)) => case.hung = v.parse().ok(),
                        _ => {}
                    }
                }
            }
            "start" => case.started = true,
            "panic" => case.panic.push(text.to_owned()),
            "retry" => case.retried = true,
            _ => self.other.push(line.to_owned()),
        }
        progress
    }

    /// The suite reached its end (the `l1` case's `done` line).
    pub fn done(&self) -> bool {
        self.cases
            .get("l1")
            .is_some_and(|c| c.out.iter().any(|l| l.starts_with("done")))
    }

    /// The case that started last and has not ended.
    pub fn unfinished(&self) -> Option<&String> {
        self.order
            .iter()
            .rev()
            .find(|n| self.cases.get(*n).is_some_and(|c| c.rc.is_none()))
    }
}

/// The parser alone (no rig): a case's lines, a kill at its limit, a retry,
/// and the L1's own lines kept apart.
#[test]
fn suite_lines_are_read_case_by_case() {
    let mut log = SuiteLog::default();
    let lines = [
        "@@ l1 out uptime_ms=900 kvm=/dev/kvm cpus=2",
        "[   1.0] a kernel line",
        "@@ boot start limit=90",
        "@@ boot panic Kernel panic - not syncing",
        "@@ boot retry rc=1",
        "@@ boot out @cpus 0-1\r",
        "@@ boot err ember: warning",
        "@@ boot end rc=0 ms=1234",
        "@@ virtio start limit=x",
        "@@ virtio end rc=124 ms=5 hung=30",
        "@@ analyze start limit=60",
    ];
    let progress: Vec<_> = lines.iter().filter_map(|l| log.take(l)).collect();
    let started = |case: &str, limit_s| Progress::Started {
        case: case.into(),
        limit_s,
    };
    assert_eq!(
        progress,
        [
            started("boot", Some(90)),
            Progress::Ended,
            started("virtio", None),
            Progress::Ended,
            started("analyze", Some(60)),
        ]
    );
    let boot = &log.cases["boot"];
    assert_eq!((boot.rc, boot.ms, boot.hung), (Some(0), Some(1234), None));
    assert_eq!(boot.fact("cpus"), Some("0-1"));
    assert_eq!(boot.err, ["ember: warning"]);
    assert!(boot.started && boot.retried);
    assert_eq!(boot.panic, ["Kernel panic - not syncing"]);
    assert_eq!(log.cases["virtio"].hung, Some(30));
    assert_eq!(log.order, ["boot", "virtio", "analyze"]);
    assert_eq!(log.unfinished().map(String::as_str), Some("analyze"));
    assert_eq!(log.other, ["[   1.0] a kernel line"]);
    assert!(!log.done());
    log.take("@@ l1 out done uptime_ms=99000");
    assert!(log.done());
}
