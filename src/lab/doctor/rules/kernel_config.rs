//! A cut-down kernel: the config symbols that own the slowest initcalls.

use crate::lab::doctor::evidence::{Inputs, has_option};
use crate::lab::doctor::initcalls::{InitcallTime, initcall_line, is_crypto};
use crate::lab::doctor::model::{Advice, Change};
use std::collections::BTreeMap;

/// Initcall owners listed as Kconfig advice, at most.
const MAX_KCONFIG: usize = 8;

/// An owner's initcalls must take at least this share of all initcall time
/// to be worth a custom kernel (Jones cut everything above 1 ms of ~700 ms).
const KCONFIG_MIN_SHARE: f64 = 0.01;

/// Slow initcalls → the config symbols that own them (a custom kernel).
pub fn kconfig_rules(i: &Inputs<'_>, calls: &[InitcallTime]) -> Vec<Advice> {
    let total: f64 = calls.iter().map(|c| c.ms).sum();
    if total <= 0.0 {
        return Vec::new();
    }
    let Some(kmap) = i.kmap else {
        let slow: Vec<String> = calls
            .iter()
            .take(8)
            .map(|c| initcall_line(c, None))
            .collect();
        if slow.is_empty() {
            return Vec::new();
        }
        let mut evidence = vec![
            "the kernel source was not found (install linux-source or set EMBER_KERNEL_SOURCE) — \
             the slowest initcalls, unattributed:"
                .to_owned(),
        ];
        evidence.extend(slow);
        return vec![Advice {
            id: "kconfig".into(),
            title: "Build a kernel without the subsystems behind the slowest initcalls".into(),
            evidence,
            predicted_ms: calls.iter().take(8).map(|c| c.ms).sum(),
            change: Change::Guest {
                what: "a cut-down kernel config".into(),
            },
            verified: None,
        }];
    };
    let crypto_handled = !has_option(&i.header.cmdline, "cryptomgr.notests");
    // Group by the innermost symbol that is built in (=y): setting it to n
    // removes the initcall. Modules (=m) cost only when loaded.
    let mut by_symbol: BTreeMap<String, Vec<&InitcallTime>> = BTreeMap::new();
    for c in calls {
        if crypto_handled && is_crypto(c, Some(kmap)) {
            continue;
        }
        let Some(owner) = kmap.owner(&c.name) else {
            continue;
        };
        let symbol = owner
            .symbols
            .iter()
            .find(|s| i.builtin.is_none_or(|b| b.contains(*s)) && c.module.is_none());
        // The initramfs is how this guest boots: never advise removing it.
        if let Some(s) = symbol
            && !(s == "CONFIG_BLK_DEV_INITRD" && i.header.initrd.is_some())
            // Nor the driver of the console it is told to use.
            && !(s == "CONFIG_SERIAL_8250" && i.header.cmdline.contains("console=ttyS"))
        {
            by_symbol.entry(s.clone()).or_default().push(c);
        }
    }
    let mut groups: Vec<(String, Vec<&InitcallTime>, f64)> = by_symbol
        .into_iter()
        .map(|(s, v)| {
            let ms = v.iter().map(|c| c.ms).sum();
            (s, v, ms)
        })
        .filter(|(_, _, ms)| *ms >= total * KCONFIG_MIN_SHARE)
        .collect();
    groups.sort_by(|a, b| b.2.total_cmp(&a.2));
    groups
        .into_iter()
        .take(MAX_KCONFIG)
        .map(|(symbol, v, ms)| {
            let mut evidence = vec![format!(
                "{} initcall(s), {ms:.1} ms of {total:.0} ms of all initcalls (profile boot, kernel-measured)",
                v.len()
            )];
            evidence.extend(v.iter().take(4).map(|c| initcall_line(c, Some(kmap))));
            Advice {
                id: format!("kconfig:{symbol}"),
                title: format!("A cut-down kernel without {symbol} (if the guest does not need it)"),
                evidence,
                predicted_ms: ms,
                change: Change::KconfigOff { symbol },
                verified: None,
            }
        })
        .collect()
}
