//! The guest's side: its initramfs (compression, modules) and the steps of
//! its start-up Jones found slow.

use crate::lab::analysis;
use crate::lab::doctor::evidence::{Inputs, first_line, span_either};
use crate::lab::doctor::initcalls::InitcallTime;
use crate::lab::doctor::initramfs::inspect_initramfs;
use crate::lab::doctor::model::{Advice, Change};
use crate::lab::stats;
use regex::Regex;

/// The initramfs: its size, compression, and the modules in it.
pub fn initramfs_rule(i: &Inputs<'_>, calls: &[InitcallTime]) -> Vec<Advice> {
    let Some(path) = i.header.initrd.as_deref() else {
        return Vec::new();
    };
    let Ok(data) = std::fs::read(path) else {
        return Vec::new();
    };
    let unpack = span_either(
        i,
        r"^Trying to unpack rootfs image",
        r"^Freeing initrd memory",
    )
    .map(|(ms, _)| ms)
    .or_else(|| {
        calls
            .iter()
            .find(|c| c.name == "populate_rootfs")
            .map(|c| c.ms)
    })
    .unwrap_or(0.0);
    let info = inspect_initramfs(&data);
    let mut out = Vec::new();
    let mb = data.len() as f64 / (1 << 20) as f64;
    if let Some(comp) = info.compression {
        out.push(Advice {
            id: "initramfs-uncompressed".into(),
            title: "Ship the initramfs uncompressed: the VMM copies it in at memory speed, the guest decompresses it at CPU speed".into(),
            evidence: vec![
                format!("{path}: {mb:.1} MiB, {comp}-compressed"),
                format!("unpacking it: {unpack:.1} ms"),
            ],
            // Decompression dominates the unpack of a compressed archive.
            predicted_ms: unpack * 0.5,
            change: Change::Guest {
                what: format!("build the initramfs without compression (cpio only) instead of {comp}"),
            },
            verified: None,
        });
    }
    if info.compressed_modules > 0 {
        out.push(Advice {
            id: "modules-uncompressed".into(),
            title: "Carry kernel modules uncompressed (.ko, not .ko.xz/.ko.zst)".into(),
            evidence: vec![format!(
                "{} compressed module(s) in {path}: the kernel decompresses each as it loads",
                info.compressed_modules
            )],
            predicted_ms: calls
                .iter()
                .filter(|c| c.module.is_some())
                .map(|c| c.ms)
                .sum::<f64>()
                * 0.1,
            change: Change::Guest {
                what: "decompress the modules when building the initramfs".into(),
            },
            verified: None,
        });
    }
    if info.debug_module_bytes > 0 {
        let share = info.debug_module_bytes as f64 / data.len().max(1) as f64;
        out.push(Advice {
            id: "modules-strip".into(),
            title: "Strip debug info from the modules (strip -g)".into(),
            evidence: vec![format!(
                "{} KiB of modules with debug info ({:.0}% of the initramfs)",
                info.debug_module_bytes / 1024,
                share * 100.0
            )],
            predicted_ms: unpack * share * 0.5,
            change: Change::Guest {
                what: "strip -g the .ko files in the initramfs".into(),
            },
            verified: None,
        });
    }
    out
}

/// Userspace steps Jones found slow: udev settle, hwclock, ldconfig.
pub fn userspace_rule(i: &Inputs<'_>) -> Vec<Advice> {
    const STEPS: &[(&str, &str, &str)] = &[
        (
            "udev",
            r"udevadm settle|systemd-udevd|[Ss]tarting udev",
            "do not wait for udev: create the few device nodes the appliance needs (devtmpfs has them)",
        ),
        (
            "hwclock",
            r"\bhwclock\b",
            "do not run hwclock: the kernel reads the RTC itself",
        ),
        (
            "ldconfig",
            r"\bldconfig\b",
            "do not run ldconfig at boot: ship /etc/ld.so.cache in the image",
        ),
    ];
    let mut out = Vec::new();
    for (name, re, fix) in STEPS {
        // The step runs from its line to the next line (any kind).
        let Ok(re) = Regex::new(re) else { continue };
        let lens: Vec<f64> = i
            .boots
            .iter()
            .filter_map(|r| {
                let tl = analysis::timeline(r);
                let pos = tl.iter().position(|e| re.is_match(&e.text))?;
                let next = tl.get(pos + 1)?;
                Some((next.t_us - tl[pos].t_us) / 1e3)
            })
            .collect();
        if lens.is_empty() {
            continue;
        }
        let line = first_line(i.boots, re.as_str()).unwrap_or_default();
        out.push(Advice {
            id: format!("userspace:{name}"),
            title: format!("Drop {name} from the guest's start-up"),
            evidence: vec![format!(
                "`{line}` until the next line: {:.1} ms",
                stats::mean(&lens)
            )],
            predicted_ms: stats::mean(&lens),
            change: Change::Guest {
                what: (*fix).to_owned(),
            },
            verified: None,
        });
    }
    out
}
