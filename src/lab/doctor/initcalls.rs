//! Initcalls as the kernel times them itself (`initcall_debug`), and how
//! one is quoted as evidence.

use crate::lab::analysis::split_printk;
use crate::lab::kconfig::KconfigMap;
use crate::lab::record::BootRecord;
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// An initcall's duration as the kernel measured it (`initcall_debug`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitcallTime {
    /// The function.
    pub name: String,
    /// Its module, for a module's init.
    pub module: Option<String>,
    /// Mean over the profile boots, ms.
    pub ms: f64,
}

/// Kernel-measured initcall durations, mean over `boots` (each boot's
/// repeats of one name summed), longest first.
pub fn initcalls(boots: &[&BootRecord]) -> Vec<InitcallTime> {
    static RET: OnceLock<Regex> = OnceLock::new();
    let ret = RET.get_or_init(|| {
        Regex::new(
            r"^initcall (?P<name>[^+ ]+)\+0x[0-9a-f]+/0x[0-9a-f]+(?: \[(?P<module>[^\]]+)\])? returned -?\d+ after (?P<us>\d+) usecs",
        )
        .unwrap()
    });
    let mut sums: BTreeMap<(String, Option<String>), f64> = BTreeMap::new();
    for r in boots {
        for l in &r.lines {
            let (_, body) = split_printk(&l.text);
            if let Some(c) = ret.captures(&body) {
                let us: f64 = c["us"].parse().unwrap_or(0.0);
                let key = (
                    c["name"].to_owned(),
                    c.name("module").map(|m| m.as_str().to_owned()),
                );
                *sums.entry(key).or_default() += us / 1e3;
            }
        }
    }
    let n = boots.len().max(1) as f64;
    let mut out: Vec<InitcallTime> = sums
        .into_iter()
        .map(|((name, module), ms)| InitcallTime {
            name,
            module,
            ms: ms / n,
        })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    out
}

/// Is this initcall part of the crypto subsystem? By its source file when
/// the map knows it, else by its name.
pub fn is_crypto(c: &InitcallTime, kmap: Option<&KconfigMap>) -> bool {
    match kmap.and_then(|m| m.owner(&c.name)) {
        Some(o) => o.file.starts_with("crypto/") || o.file.starts_with("arch/x86/crypto/"),
        None => c.name.contains("crypto") || c.name.starts_with("alg"),
    }
}

/// One line of evidence for `c`: its time and, where the map knows it,
/// its source file and innermost config symbol.
pub fn initcall_line(c: &InitcallTime, kmap: Option<&KconfigMap>) -> String {
    let module = c
        .module
        .as_ref()
        .map_or(String::new(), |m| format!(" [{m}]"));
    match kmap.and_then(|m| m.owner(&c.name)) {
        Some(o) => format!(
            "initcall {}{module}: {:.2} ms ({}{}{})",
            c.name,
            c.ms,
            o.file,
            if o.symbols.is_empty() { "" } else { ", " },
            o.symbols.first().map_or("", String::as_str)
        ),
        None => format!("initcall {}{module}: {:.2} ms", c.name, c.ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::doctor::testing::profile;

    #[test]
    fn initcalls_are_the_kernels_own_durations() {
        let p = profile();
        let c = initcalls(&[&p, &p]);
        assert_eq!(c[0].name, "crypto_algapi_init");
        assert_eq!(c[0].ms, 800.0);
        let m = c.iter().find(|c| c.name == "virtio_console_init").unwrap();
        assert_eq!(m.module.as_deref(), Some("virtio_console"));
    }
}
