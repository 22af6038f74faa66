//! The doctor's rules. Each reads the [`Inputs`] and proposes the changes
//! its evidence supports, with a predicted saving:
//! - [`console`]: the kernel log on the serial console (`quiet`);
//! - [`cmdline`]: kernel work an option skips — crypto self-tests, the TSC
//!   check and SMP bring-up (or one vCPU), the APIC timer's calibration,
//!   ftrace's call-site check, UART probing;
//! - [`vm`]: the VM's own options — the firmware, the memory size;
//! - [`guest`]: the initramfs and the guest's start-up;
//! - [`kernel_config`]: config symbols behind the slowest initcalls.

mod cmdline;
mod console;
mod guest;
mod kernel_config;
mod vm;

use super::evidence::Inputs;
use super::initcalls::initcalls;
use super::model::{Advice, MIN_SAVING_MS};

/// Runs every rule; the suggestions, largest predicted saving first.
pub fn advise(i: &Inputs<'_>) -> Vec<Advice> {
    let calls = initcalls(i.profile);
    let mut out = Vec::new();
    out.extend(console::console_rule(i));
    out.extend(cmdline::crypto_rule(i, &calls));
    out.extend(cmdline::smp_rules(i));
    out.extend(cmdline::apic_timer_rule(i));
    out.extend(cmdline::ftrace_check_rule(i));
    out.extend(vm::firmware_rule(i));
    out.extend(cmdline::probe_rules(i, &calls));
    out.extend(guest::initramfs_rule(i, &calls));
    out.extend(guest::userspace_rule(i));
    out.extend(vm::memory_rule(i));
    out.extend(kernel_config::kconfig_rules(i, &calls));
    out.retain(|a| a.predicted_ms >= MIN_SAVING_MS);
    out.sort_by(|a, b| b.predicted_ms.total_cmp(&a.predicted_ms));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::doctor::model::Change;
    use crate::lab::doctor::testing::{header, kmap, opts, profile, record, run};
    use crate::lab::record::BootRecord;
    use std::collections::BTreeSet;

    #[test]
    fn crypto_tests_smp_uarts_and_kconfig_symbols() {
        let p = profile();
        let m = kmap();
        let h = header("console=ttyS0 quiet", 2, 256, "ember");
        let a = run(
            advise,
            &h,
            &opts(&[]),
            std::slice::from_ref(&p),
            std::slice::from_ref(&p),
            Some(&m),
            None,
        );
        let ids: Vec<&str> = a.iter().map(|a| a.id.as_str()).collect();
        // Ranked by predicted saving.
        assert_eq!(ids[0], "cryptomgr.notests", "{ids:?}");
        assert_eq!(a[0].predicted_ms, 820.0);
        assert!(
            a[0].evidence.iter().any(|e| e.contains("crypto/algapi.c")),
            "{:?}",
            a[0].evidence
        );
        let smp = a.iter().find(|a| a.id == "cpus-1").unwrap();
        assert!((smp.predicted_ms - 40.0).abs() < 1e-6, "{smp:?}");
        assert!(ids.contains(&"tsc.reliable"));
        let uarts = a.iter().find(|a| a.id == "8250.nr_uarts").unwrap();
        assert_eq!(
            uarts.change,
            Change::CmdlineAdd {
                option: "8250.nr_uarts=1".into()
            }
        );
        // audit_init and audit_watch_init: one owner each (innermost symbol,
        // here all taken as built in); crypto is left to cryptomgr.notests;
        // tiny_init is below the bar;
        // a module's init is not a built-in symbol.
        let syms: Vec<&str> = a
            .iter()
            .filter_map(|a| a.id.strip_prefix("kconfig:"))
            .collect();
        // audit_watch_init's 3 ms is under 1 % of all initcall time.
        // CONFIG_SERIAL_8250 drives the console=ttyS0 of this boot: kept.
        assert_eq!(syms, ["CONFIG_AUDIT"]);
        // With cryptomgr.notests already given and the symbol map saying
        // CONFIG_AUDIT_WATCH is not built in, audit_watch_init goes to CONFIG_AUDIT.
        let h = header("console=ttyS0 quiet cryptomgr.notests", 1, 256, "ember");
        let builtin: BTreeSet<String> = [
            "CONFIG_AUDIT",
            "CONFIG_SERIAL_8250",
            "CONFIG_CRYPTO_ALGAPI2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let b: Vec<&BootRecord> = vec![&p];
        let o = opts(&[]);
        let a = advise(&Inputs {
            header: &h,
            opts: &o,
            boots: &b,
            profile: &b,
            console: None,
            kmap: Some(&m),
            builtin: Some(&builtin),
        });
        let ids: Vec<&str> = a.iter().map(|a| a.id.as_str()).collect();
        assert!(
            !ids.contains(&"cryptomgr.notests") && !ids.contains(&"cpus-1"),
            "{ids:?}"
        );
        let audit = a.iter().find(|a| a.id == "kconfig:CONFIG_AUDIT").unwrap();
        assert_eq!(audit.predicted_ms, 12.0);
        assert_eq!(ids[0], "kconfig:CONFIG_CRYPTO_ALGAPI2");
    }

    #[test]
    fn userspace_steps_and_memory() {
        let r = record(
            &[
                (1000.0, "[    0.001000] Zone ranges:"),
                (
                    41_000.0,
                    "[    0.041000] Memory: 900000K/1048576K available (12288K kernel code)",
                ),
                (100_000.0, "Starting udev: udevadm settle"),
                (230_000.0, "done"),
                (300_000.0, "hwclock --hctosys"),
                (600_000.0, "ember-lab: poweroff"),
            ],
            700_000.0,
        );
        let h = header("console=ttyS0 quiet", 1, 1024, "ember");
        let a = run(advise, &h, &opts(&[]), &[r], &[], None, None);
        let udev = a
            .iter()
            .find(|a| a.id == "userspace:udev")
            .unwrap_or_else(|| panic!("{a:#?}"));
        assert!((udev.predicted_ms - 130.0).abs() < 1e-6);
        let hw = a.iter().find(|a| a.id == "userspace:hwclock").unwrap();
        assert!((hw.predicted_ms - 300.0).abs() < 1e-6);
        let mem = a.iter().find(|a| a.id == "mem").unwrap();
        assert_eq!(mem.change, Change::Mem { mib: 512 });
        assert!((mem.predicted_ms - 20.0).abs() < 1e-6);
    }
}
