//! Activity definitions: an activity is a named span from the first line
//! matching `start` to the next line matching `end`.
//!
//! Definitions match *timeline entries*: console lines with any printk timestamp
//! (`[    1.234567] `) stripped, and VMM events written as `@kind`, `@kind
//! code=0x40` or `@kind TEXT` (the lab adds `@spawn`, `@first_output` and
//! `@exit` itself). A name may use capture groups of the regexes — `$name`,
//! `${name}` or `$1` — so one definition yields one activity per initcall; the end
//! then closes the open activity whose expanded name matches.
//!
//! # Definition files (`--rules FILE`)
//!
//! ```text
//! # Comments start with '#'. One block per activity.
//! [kernel:pci]
//! start  = ^PCI: Using configuration type
//! end    = ^pci_bus 0000:00: resource
//! parent = kernel
//! ```
//!
//! Values run to the end of the line (spaces around `=` and at the ends are
//! trimmed; nothing else is unescaped), so a regex needs no quoting. `start`
//! and `end` are required; `parent` (another activity's name) only nests the
//! bar one row lower in the timeline.

use regex::{Captures, Regex};
use thiserror::Error;

/// Definition-file errors.
#[derive(Debug, Error)]
pub enum ActivityDefError {
    /// A regex does not compile.
    #[error("{origin}:{line}: bad regex in `{key}`: {reason}")]
    BadRegex {
        /// File name.
        origin: String,
        /// 1-based line.
        line: usize,
        /// `start` or `end`.
        key: String,
        /// The compiler's complaint, on one line.
        reason: String,
    },
    /// A line that is neither a header, a key, a comment nor blank.
    #[error("{origin}:{line}: {message}")]
    Syntax {
        /// File name.
        origin: String,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A block without `start` or `end`.
    #[error("{origin}: activity `{name}` has no `{key}` regex")]
    Missing {
        /// File name.
        origin: String,
        /// The activity.
        name: String,
        /// The missing key.
        key: &'static str,
    },
    /// The definition file could not be read.
    #[error("cannot read rule file {origin}")]
    Read {
        /// File name.
        origin: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The regex compiler's complaint on one line: its message draws the pattern
/// with a caret over several lines, which a one-line error cannot carry; the
/// last line says what is wrong.
pub fn regex_reason(e: &regex::Error) -> String {
    let text = e.to_string();
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    last.trim().trim_start_matches("error: ").to_owned()
}

/// How one activity starts and ends.
#[derive(Debug, Clone)]
pub struct ActivityDef {
    /// Activity name, possibly with `$group` references.
    pub name: String,
    /// Opens the activity.
    pub start: Regex,
    /// Closes it.
    pub end: Regex,
    /// Enclosing activity (display nesting only).
    pub parent: Option<String>,
}

impl ActivityDef {
    /// Builds a definition from regex sources.
    pub fn new(
        name: &str,
        start: &str,
        end: &str,
        parent: Option<&str>,
    ) -> Result<ActivityDef, regex::Error> {
        Ok(ActivityDef {
            name: name.to_owned(),
            start: Regex::new(start)?,
            end: Regex::new(end)?,
            parent: parent.map(str::to_owned),
        })
    }

    /// Whether the name depends on capture groups.
    pub fn is_template(&self) -> bool {
        self.name.contains('$')
    }

    /// The name with `caps` substituted.
    pub fn expand(&self, caps: &Captures<'_>) -> String {
        let mut out = String::new();
        caps.expand(&self.name, &mut out);
        out
    }
}

/// The built-in definitions for a Linux guest booted with a serial console (and,
/// for per-initcall bars, `initcall_debug ignore_loglevel`), plus the VMM
/// events ember reports. Levels: 0 the whole run; 1 the phases; 2 kernel
/// parts; 3 single initcalls and userspace markers.
// Over a hundred lines only because the table is: one entry per definition.
pub fn builtin_linux() -> Vec<ActivityDef> {
    /// Userspace begins: Linux starting /init, the lab's busybox /init
    /// marker, or the ember test guest's ring-3 banner.
    const USERSPACE: &str =
        r"^Run /init as init process|^ember-lab: begin |^ember-test-guest: ring 3";
    const DEFS: &[(&str, &str, &str, Option<&str>)] = &[
        ("run", r"^@spawn$", r"^@exit$", None),
        (
            "vmm:until-first-output",
            r"^@spawn$",
            r"^@first_output$",
            Some("run"),
        ),
        (
            "vmm:setup",
            r"^@spawn$",
            r"^@first_guest_entry",
            Some("run"),
        ),
        (
            "vmm:exec+kvm-open",
            r"^@spawn$",
            r"^@kvm_open",
            Some("vmm:setup"),
        ),
        (
            "vmm:guest-memory",
            r"^@kvm_open",
            r"^@memory_ready",
            Some("vmm:setup"),
        ),
        (
            "vmm:load+vcpus",
            r"^@memory_ready",
            r"^@first_guest_entry",
            Some("vmm:setup"),
        ),
        (
            "guest:until-userspace",
            r"^@first_guest_entry",
            r"^ember-test-guest: ring 3",
            Some("run"),
        ),
        (
            "kernel:before-printk",
            r"^@first_guest_entry",
            r"Linux version \d",
            Some("run"),
        ),
        (
            "firmware+decompress",
            r"SeaBIOS \(version",
            r"Linux version \d",
            Some("run"),
        ),
        (
            "kernel",
            r"Linux version \d",
            r"^Run /init as init process",
            Some("run"),
        ),
        (
            "kernel:setup+memory-init",
            r"Linux version \d",
            r"^Memory: \d+K/\d+K available",
            Some("kernel"),
        ),
        (
            "kernel:early-init",
            r"^Memory: \d+K/\d+K available",
            r"^calling  \S+ @ 1$|^smp: Bringing up secondary CPUs",
            Some("kernel"),
        ),
        (
            "kernel:ftrace-init",
            r"^ftrace: allocating \d+ entries",
            r"^ftrace: allocated \d+ pages",
            Some("kernel:early-init"),
        ),
        (
            "kernel:initcalls",
            r"^calling  \S+ @ 1$",
            r"^Freeing unused",
            Some("kernel"),
        ),
        (
            "initcall:$name",
            r"^calling  (?P<name>[^+ ]+)\+\S+ @ \d+$",
            r"^initcall (?P<name>[^+ ]+)\+\S+ returned",
            Some("kernel:initcalls"),
        ),
        (
            "kernel:unpack-initramfs",
            r"^Trying to unpack rootfs image",
            r"^Freeing initrd memory",
            Some("kernel"),
        ),
        (
            "kernel:free-unused-memory",
            r"^Freeing unused",
            r"^Run /init as init process",
            Some("kernel"),
        ),
        (
            "userspace",
            USERSPACE,
            r"^ember-lab: poweroff|^reboot: |^@guest_shutdown",
            Some("run"),
        ),
        (
            "userspace:$name",
            r"^ember-lab: begin (?P<name>\S+)",
            r"^ember-lab: end (?P<name>\S+)",
            Some("userspace"),
        ),
        (
            "shutdown",
            r"^ember-lab: poweroff",
            r"^reboot: (Power down|Restarting system)|^@guest_shutdown",
            Some("run"),
        ),
        (
            "vmm:teardown",
            r"^reboot: (Power down|Restarting system)|^@guest_shutdown",
            r"^@exit$",
            Some("run"),
        ),
    ];
    DEFS.iter()
        .map(|(n, s, e, p)| ActivityDef::new(n, s, e, *p).expect("built-in definitions compile"))
        .collect()
}

/// Reads a definition file.
pub fn load(path: &std::path::Path) -> Result<Vec<ActivityDef>, ActivityDefError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ActivityDefError::Read {
        origin: origin.clone(),
        source,
    })?;
    parse(&text, &origin)
}

/// Parses definition-file text (`origin` names it in errors).
pub fn parse(text: &str, origin: &str) -> Result<Vec<ActivityDef>, ActivityDefError> {
    struct Block {
        name: String,
        start: Option<Regex>,
        end: Option<Regex>,
        parent: Option<String>,
    }
    let finish = |b: Block| -> Result<ActivityDef, ActivityDefError> {
        let missing = |key| ActivityDefError::Missing {
            origin: origin.to_owned(),
            name: b.name.clone(),
            key,
        };
        Ok(ActivityDef {
            start: b.start.clone().ok_or_else(|| missing("start"))?,
            end: b.end.clone().ok_or_else(|| missing("end"))?,
            name: b.name,
            parent: b.parent,
        })
    };
    let mut defs = Vec::new();
    let mut block: Option<Block> = None;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.trim();
        let syntax = |message: &str| ActivityDefError::Syntax {
            origin: origin.to_owned(),
            line: line_no,
            message: message.to_owned(),
        };
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if name.trim().is_empty() {
                return Err(syntax("empty activity name"));
            }
            if let Some(b) = block.take() {
                defs.push(finish(b)?);
            }
            block = Some(Block {
                name: name.trim().to_owned(),
                start: None,
                end: None,
                parent: None,
            });
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(syntax("expected `[name]` or `key = value`"));
        };
        let Some(b) = block.as_mut() else {
            return Err(syntax("`key = value` before the first `[name]`"));
        };
        let (key, value) = (key.trim(), value.trim());
        let compile = |v: &str| {
            Regex::new(v).map_err(|e| ActivityDefError::BadRegex {
                origin: origin.to_owned(),
                line: line_no,
                key: key.to_owned(),
                reason: regex_reason(&e),
            })
        };
        match key {
            "start" => b.start = Some(compile(value)?),
            "end" => b.end = Some(compile(value)?),
            "parent" => b.parent = Some(value.to_owned()),
            other => {
                return Err(syntax(&format!(
                    "unknown key `{other}` (start, end, parent)"
                )));
            }
        }
    }
    if let Some(b) = block.take() {
        defs.push(finish(b)?);
    }
    Ok(defs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_blocks_with_raw_regexes() {
        let defs = parse(
            "# pci\n[kernel:pci]\nstart = ^PCI: Using (a|b) = x\nend=^done$\nparent = kernel\n\n[x]\nstart=a\nend=b\n",
            "r.txt",
        )
        .unwrap();
        assert_eq!(defs.len(), 2);
        assert_eq!(defs[0].name, "kernel:pci");
        assert_eq!(defs[0].start.as_str(), "^PCI: Using (a|b) = x");
        assert_eq!(defs[0].parent.as_deref(), Some("kernel"));
        assert_eq!(defs[1].parent, None);
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let e = parse("[a]\nstart = (unclosed\nend = x\n", "r.txt").unwrap_err();
        assert!(
            e.to_string().starts_with("r.txt:2: bad regex in `start`"),
            "{e}"
        );
        let e = parse("[a]\nstart = x\n", "r.txt").unwrap_err();
        assert_eq!(e.to_string(), "r.txt: activity `a` has no `end` regex");
        let e = parse("start = x\n", "r.txt").unwrap_err();
        assert!(e.to_string().contains("r.txt:1:"), "{e}");
        let e = parse("[a]\ncolour = red\n", "r.txt").unwrap_err();
        assert!(e.to_string().contains("unknown key `colour`"), "{e}");
        let e = parse("[a]\nnonsense\n", "r.txt").unwrap_err();
        assert!(e.to_string().contains("expected"), "{e}");
    }

    #[test]
    fn template_names_expand_from_captures() {
        let r = builtin_linux()
            .into_iter()
            .find(|r| r.is_template() && r.name.starts_with("initcall"))
            .unwrap();
        let caps = r.start.captures("calling  pci_init+0x0/0x2c @ 1").unwrap();
        assert_eq!(r.expand(&caps), "initcall:pci_init");
        let caps = r
            .end
            .captures("initcall pci_init+0x0/0x2c returned 0 after 93 usecs")
            .unwrap();
        assert_eq!(r.expand(&caps), "initcall:pci_init");
    }
}
