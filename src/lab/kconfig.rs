//! Which kernel config symbol owns an initcall, from the kernel's own build
//! files: the C file that registers the function (`*_initcall(fn)`,
//! `module_init(fn)`, `module_*_driver(drv)`), its object, and the
//! Makefile lines that build that object (`obj-$(CONFIG_X) += name.o`,
//! composite objects `foo-y += name.o` + `obj-$(CONFIG_X) += foo.o`, and
//! directories `obj-$(CONFIG_Y) += dir/` up the tree). Jones cut his kernel
//! down by removing every subsystem with more than 1 ms of initcalls; this is
//! the map from his initcall list to the config symbols to remove.
//!
//! The map is derived once from a kernel source tree or Debian's
//! `linux-source-*.tar.xz` (only its Makefiles and C files are unpacked, to
//! a scratch directory that is removed afterwards) and cached as JSON.

use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use thiserror::Error;

/// Bump when the derivation changes, so stale caches are rebuilt.
const FORMAT: u32 = 1;
/// How many directory levels up a chain of `obj-y += dir/` is followed.
const MAX_DEPTH: usize = 12;

/// Errors deriving the map.
#[derive(Debug, Error)]
pub enum KconfigError {
    /// The source tree or tarball could not be read, or not unpacked.
    #[error("cannot read the kernel source {}", path.display())]
    Source {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `tar` could not be run on the tarball.
    #[error("cannot read the kernel source {}: cannot run tar", path.display())]
    NoTar {
        /// The tarball.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `tar` failed on the tarball.
    #[error("cannot read the kernel source {}: tar exited with {status}", path.display())]
    Tar {
        /// The tarball.
        path: PathBuf,
        /// How tar ended.
        status: std::process::ExitStatus,
    },
}

/// Who builds one initcall.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The C file that registers it, relative to the source root.
    pub file: String,
    /// Config symbols that must be set for it to be built, innermost first
    /// (`CONFIG_SERIAL_8250`, then the directory's `CONFIG_TTY`…).
    pub symbols: Vec<String>,
}

/// initcall function → owner.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KconfigMap {
    /// Derivation format.
    pub format: u32,
    /// What it was derived from.
    pub source: String,
    /// Function name → owner.
    pub owners: BTreeMap<String, Owner>,
}

impl KconfigMap {
    /// The owner of initcall `function`.
    pub fn owner(&self, function: &str) -> Option<&Owner> {
        self.owners.get(function)
    }
}

/// The kernel source this machine has: `$EMBER_KERNEL_SOURCE`, else the
/// newest `/usr/src/linux-source-*.tar.xz` (Debian's `linux-source-6.1`),
/// else an unpacked `/usr/src/linux-source-*` directory.
pub fn find_source() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("EMBER_KERNEL_SOURCE") {
        return Some(PathBuf::from(p));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/src")
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("linux-source-"))
        })
        .collect();
    // Tarballs first (`.tar.xz` sorts after the bare directory name).
    found.sort();
    found.reverse();
    found.into_iter().next()
}

/// The map for `source` (a directory or a `.tar.xz`), from the cache in
/// `cache_dir` when it was derived before.
pub fn load_or_derive(source: &Path, cache_dir: &Path) -> Result<KconfigMap, KconfigError> {
    let unreadable = |e| KconfigError::Source {
        path: source.to_path_buf(),
        source: e,
    };
    let meta = std::fs::metadata(source).map_err(unreadable)?;
    let stamp = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    let name = source
        .file_name()
        .map_or("source".into(), |n| n.to_string_lossy().into_owned());
    let cached = cache_dir.join(format!("{name}-{stamp}-v{FORMAT}.json"));
    if let Ok(text) = std::fs::read_to_string(&cached)
        && let Ok(map) = serde_json::from_str::<KconfigMap>(&text)
        && map.format == FORMAT
    {
        return Ok(map);
    }
    let map = if meta.is_dir() {
        derive(source)
    } else {
        let scratch = cache_dir.join(format!("unpack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).map_err(unreadable)?;
        eprintln!(
            "ember: deriving initcall → config symbol map from {} (once, ~30 s)",
            source.display()
        );
        let status = std::process::Command::new("tar")
            .arg("-xJf")
            .arg(source)
            .arg("-C")
            .arg(&scratch)
            .args(["--wildcards", "*Makefile", "*Kbuild", "*.c"])
            .status();
        let root = std::fs::read_dir(&scratch)
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| e.ok())
            .map(|e| e.path());
        let result = match (status, root) {
            (Ok(s), Some(root)) if s.success() => Ok(derive(&root)),
            (Ok(status), _) => Err(KconfigError::Tar {
                path: source.to_path_buf(),
                status,
            }),
            (Err(e), _) => Err(KconfigError::NoTar {
                path: source.to_path_buf(),
                source: e,
            }),
        };
        let _ = std::fs::remove_dir_all(&scratch);
        result?
    };
    let map = KconfigMap {
        source: source.display().to_string(),
        ..map
    };
    let _ = std::fs::create_dir_all(cache_dir);
    if let Ok(text) = serde_json::to_string(&map) {
        let tmp = cached.with_extension("tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, &cached);
        }
    }
    Ok(map)
}

/// Derives the map from an unpacked source tree.
pub fn derive(root: &Path) -> KconfigMap {
    let mut registrations: Vec<(String, String)> = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "c")
                && let Ok(bytes) = std::fs::read(&p)
            {
                let rel = p.strip_prefix(root).unwrap_or(&p).to_string_lossy();
                for f in registered_initcalls(&String::from_utf8_lossy(&bytes)) {
                    registrations.push((f, rel.to_string()));
                }
            }
        }
    }
    let mut makefiles = Makefiles::new(root);
    let mut owners = BTreeMap::new();
    // A function name registered in several files (static `init` helpers)
    // cannot be attributed: keep only unambiguous ones.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (f, _) in &registrations {
        *seen.entry(f.clone()).or_default() += 1;
    }
    for (f, file) in registrations {
        if seen[&f] != 1 {
            continue;
        }
        let symbols = makefiles.symbols_for_file(&file);
        owners.insert(f, Owner { file, symbols });
    }
    KconfigMap {
        format: FORMAT,
        source: root.display().to_string(),
        owners,
    }
}

/// The initcall functions a C file registers.
pub fn registered_initcalls(text: &str) -> Vec<String> {
    static CALL: OnceLock<Regex> = OnceLock::new();
    static DRIVER: OnceLock<Regex> = OnceLock::new();
    let call = CALL.get_or_init(|| {
        Regex::new(
            r"(?m)^\s*(?:(?:early|core|postcore|arch|subsys|fs|rootfs|device|late|pure|console|security)_initcall(?:_sync)?|module_init|fs_initcall_sync)\s*\(\s*(\w+)\s*\)",
        )
        .unwrap()
    });
    // `module_platform_driver(foo)` and friends define `foo_init`.
    let driver = DRIVER.get_or_init(|| {
        Regex::new(r"(?m)^\s*(?:module|builtin)_(?:\w+_)?driver\s*\(\s*(\w+)").unwrap()
    });
    if !text.contains("initcall") && !text.contains("module_") && !text.contains("builtin_") {
        return Vec::new();
    }
    let mut out: Vec<String> = call.captures_iter(text).map(|c| c[1].to_owned()).collect();
    out.extend(
        driver
            .captures_iter(text)
            .map(|c| format!("{}_init", &c[1])),
    );
    out.sort();
    out.dedup();
    out
}

/// One Makefile's assignments: left-hand side → right-hand words.
struct Makefile {
    lines: Vec<(String, Vec<String>)>,
}

/// Parsed Makefiles by directory, read on demand.
struct Makefiles {
    root: PathBuf,
    by_dir: BTreeMap<String, Makefile>,
}

impl Makefiles {
    fn new(root: &Path) -> Self {
        Makefiles {
            root: root.to_path_buf(),
            by_dir: BTreeMap::new(),
        }
    }

    fn get(&mut self, dir: &str) -> &Makefile {
        if !self.by_dir.contains_key(dir) {
            let mut text = String::new();
            for name in ["Makefile", "Kbuild"] {
                if let Ok(t) = std::fs::read_to_string(self.root.join(dir).join(name)) {
                    text.push_str(&t);
                    text.push('\n');
                }
            }
            self.by_dir.insert(dir.to_owned(), parse_makefile(&text));
        }
        &self.by_dir[dir]
    }

    /// Config symbols that gate `file` (innermost first).
    fn symbols_for_file(&mut self, file: &str) -> Vec<String> {
        let (dir, name) = match file.rsplit_once('/') {
            Some((d, n)) => (d.to_owned(), n.to_owned()),
            None => (String::new(), file.to_owned()),
        };
        let object = format!("{}.o", name.trim_end_matches(".c"));
        let mut out = Vec::new();
        self.object_symbols(&dir, &object, &mut out, 0);
        let mut seen = BTreeSet::new();
        out.retain(|s| seen.insert(s.clone()));
        out
    }

    /// Symbols for `word` (an object `x.o` or a subdirectory `x/`) in `dir`.
    fn object_symbols(&mut self, dir: &str, word: &str, out: &mut Vec<String>, depth: usize) {
        if depth > MAX_DEPTH {
            return;
        }
        let hits: Vec<String> = self
            .get(dir)
            .lines
            .iter()
            .filter(|(_, words)| words.iter().any(|w| w == word))
            .map(|(lhs, _)| lhs.clone())
            .collect();
        let mut gated_here = false;
        for lhs in hits {
            let (target, cond) = split_lhs(&lhs);
            if let Some(c) = &cond {
                out.push(c.clone());
            }
            match target.as_str() {
                "obj" | "lib" | "core" | "drivers" | "libs" => {
                    gated_here = true;
                    // Built only when its directory is too: ask the parent.
                    self.dir_symbols(dir, out, depth + 1);
                    break;
                }
                composite => {
                    // `foo-y += name.o` / `foo-objs := name.o`: foo.o owns it.
                    let parent = format!("{composite}.o");
                    if parent != word {
                        self.object_symbols(dir, &parent, out, depth + 1);
                        gated_here = true;
                        break;
                    }
                }
            }
        }
        if !gated_here && depth == 0 {
            self.dir_symbols(dir, out, depth + 1);
        }
    }

    /// Symbols that gate directory `dir` in its parent's Makefile.
    fn dir_symbols(&mut self, dir: &str, out: &mut Vec<String>, depth: usize) {
        if dir.is_empty() {
            return;
        }
        let (parent, name) = match dir.rsplit_once('/') {
            Some((p, n)) => (p.to_owned(), n.to_owned()),
            None => (String::new(), dir.to_owned()),
        };
        self.object_symbols(&parent, &format!("{name}/"), out, depth);
    }
}

/// `obj-$(CONFIG_FOO)` → ("obj", Some("CONFIG_FOO")); `foo-y` → ("foo", None).
fn split_lhs(lhs: &str) -> (String, Option<String>) {
    static COND: OnceLock<Regex> = OnceLock::new();
    let cond = COND.get_or_init(|| Regex::new(r"^(.*?)-\$\((CONFIG_\w+)\)$").unwrap());
    if let Some(c) = cond.captures(lhs) {
        return (c[1].to_owned(), Some(c[2].to_owned()));
    }
    for suffix in ["-y", "-objs", "-m", "-objs-y"] {
        if let Some(t) = lhs.strip_suffix(suffix) {
            return (t.to_owned(), None);
        }
    }
    (lhs.to_owned(), None)
}

/// Assignments of a Makefile, continuation lines joined, comments dropped.
fn parse_makefile(text: &str) -> Makefile {
    let mut joined = String::new();
    let mut lines = Vec::new();
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or("");
        if let Some(cont) = line.strip_suffix('\\') {
            joined.push_str(cont);
            joined.push(' ');
            continue;
        }
        joined.push_str(line);
        let full = std::mem::take(&mut joined);
        let Some((lhs, rhs)) = full
            .split_once("+=")
            .or_else(|| full.split_once(":="))
            .or_else(|| full.split_once('='))
        else {
            continue;
        };
        let lhs = lhs.trim().trim_end_matches(':').trim();
        if lhs.is_empty() || lhs.contains(' ') {
            continue;
        }
        let words = rhs.split_whitespace().map(str::to_owned).collect();
        lines.push((lhs.to_owned(), words));
    }
    Makefile { lines }
}

/// `CONFIG_X=y` symbols of a kernel `.config`.
pub fn builtin_symbols(config_text: &str) -> BTreeSet<String> {
    config_text
        .lines()
        .filter_map(|l| l.strip_suffix("=y"))
        .filter(|s| s.starts_with("CONFIG_"))
        .map(str::to_owned)
        .collect()
}

/// The `.config` a kernel image was built with: `boot/config-*` beside an
/// `ember setup` kernel, `.config` beside a vmlinux built in its tree, or
/// `/boot/config-<release>` for a file named `vmlinu?-<release>`.
pub fn find_config(kernel: &Path) -> Option<PathBuf> {
    let dir = kernel.parent()?;
    if let Ok(rd) = std::fs::read_dir(dir.join("boot")) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("config-") {
                return Some(e.path());
            }
        }
    }
    for c in [dir.join(".config"), dir.join("../.config")] {
        if c.is_file() {
            return Some(c);
        }
    }
    let name = kernel.file_name()?.to_string_lossy().into_owned();
    let release = name.split_once('-').map(|(_, r)| r)?;
    let p = PathBuf::from(format!("/boot/config-{release}"));
    p.is_file().then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn registrations_of_every_kind() {
        let c = "static int __init a_init(void) { return 0; }\n\
                 subsys_initcall(a_init);\n  late_initcall_sync(b);\nmodule_init(c_mod);\n\
                 module_platform_driver(d_driver);\nmodule_pci_driver(e_pci);\n\
                 /* not: */ x_initcall_helper(z);\n";
        assert_eq!(
            registered_initcalls(c),
            ["a_init", "b", "c_mod", "d_driver_init", "e_pci_init"]
        );
    }

    #[test]
    fn makefile_chain_from_object_to_directories() {
        let d = crate::appliance::test_dir("kconfig");
        write(&d, "Makefile", "obj-y += drivers/\n");
        write(
            &d,
            "drivers/Makefile",
            "obj-$(CONFIG_TTY)\t\t+= tty/\nobj-y += base/\n",
        );
        write(
            &d,
            "drivers/tty/Makefile",
            "obj-$(CONFIG_SERIAL_CORE) += serial/ \\\n  other.o # comment\n",
        );
        write(
            &d,
            "drivers/tty/serial/Makefile",
            "8250_base-y := 8250_core.o 8250_port.o\nobj-$(CONFIG_SERIAL_8250) += 8250_base.o\n",
        );
        write(
            &d,
            "drivers/tty/serial/8250_core.c",
            "static int __init serial8250_init(void)\n{}\nmodule_init(serial8250_init);\n",
        );
        write(&d, "drivers/base/core.c", "core_initcall(base_init);\n");
        write(&d, "drivers/tty/other.c", "device_initcall(dup);\n");
        write(&d, "drivers/base/dup.c", "device_initcall(dup);\n");
        let m = derive(&d);
        assert_eq!(
            m.owner("serial8250_init").unwrap(),
            &Owner {
                file: "drivers/tty/serial/8250_core.c".into(),
                symbols: vec![
                    "CONFIG_SERIAL_8250".into(),
                    "CONFIG_SERIAL_CORE".into(),
                    "CONFIG_TTY".into()
                ],
            }
        );
        assert!(m.owner("base_init").unwrap().symbols.is_empty());
        // Registered twice: ambiguous, left out.
        assert!(m.owner("dup").is_none());
        // Cached and reloaded. The cache lives outside the source: making it
        // inside would change the source directory's mtime, which is the key.
        let cache = crate::appliance::test_dir("kconfig-cache");
        let a = load_or_derive(&d, &cache).unwrap();
        let b = load_or_derive(&d, &cache).unwrap();
        assert_eq!(a.owners, b.owners);
        assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
    }

    #[test]
    fn builtin_symbols_of_a_config() {
        let s = builtin_symbols("CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=m\nCONFIG_D=y\n");
        assert_eq!(s.into_iter().collect::<Vec<_>>(), ["CONFIG_A", "CONFIG_D"]);
    }
}
