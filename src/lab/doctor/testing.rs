//! Boots, headers and options the doctor's tests share.

use super::evidence::Inputs;
use super::model::Advice;
use crate::lab::analysis::ConsoleCost;
use crate::lab::config::{GuestOpts, Header};
use crate::lab::kconfig::{KconfigMap, Owner};
use crate::lab::record::BootRecord;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    g: GuestOpts,
}

/// `GuestOpts` as the command line `args` gives them.
pub fn opts(args: &[&str]) -> GuestOpts {
    Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).g
}

/// A clean boot with these console lines (µs, text), ended at `exit`.
pub fn record(lines: &[(f64, &str)], exit: f64) -> BootRecord {
    BootRecord::from_lines(lines, exit)
}

/// What was booted: this command line, vCPUs, MiB and backend.
pub fn header(cmdline: &str, cpus: u32, mem: u64, backend: &str) -> Header {
    Header {
        host: "h".into(),
        host_kernel: "k".into(),
        host_cpu: "c".into(),
        backend: backend.into(),
        backend_version: "v".into(),
        accel: "a".into(),
        kernel: "/k".into(),
        initrd: None,
        cmdline: cmdline.into(),
        cpus,
        mem_mib: mem,
    }
}

/// The advice `rule` gives these boots (and profile boots), given no
/// kernel config.
pub fn run<R: IntoIterator<Item = Advice>>(
    rule: impl Fn(&Inputs<'_>) -> R,
    h: &Header,
    o: &GuestOpts,
    boots: &[BootRecord],
    profile: &[BootRecord],
    kmap: Option<&KconfigMap>,
    console: Option<&ConsoleCost>,
) -> Vec<Advice> {
    let b: Vec<&BootRecord> = boots.iter().collect();
    let p: Vec<&BootRecord> = profile.iter().collect();
    rule(&Inputs {
        header: h,
        opts: o,
        boots: &b,
        profile: &p,
        console,
        kmap,
        builtin: None,
    })
    .into_iter()
    .collect()
}

/// A profile boot: crypto, UART, audit and module initcalls timed by the
/// kernel, and two vCPUs brought up in 40 ms.
pub fn profile() -> BootRecord {
    record(
        &[
            (
                1000.0,
                "[    0.100000] calling  crypto_algapi_init+0x0/0x1a @ 1",
            ),
            (
                900_000.0,
                "[    0.900000] initcall crypto_algapi_init+0x0/0x1a returned 0 after 800000 usecs",
            ),
            (
                900_100.0,
                "[    0.900100] initcall aes_init+0x0/0x1a returned 0 after 20000 usecs",
            ),
            (
                900_200.0,
                "[    0.900200] initcall serial8250_init+0x0/0x1a returned 0 after 30000 usecs",
            ),
            (
                900_300.0,
                "[    0.900300] serial8250: ttyS0 at I/O 0x3f8 (irq = 4, base_baud = 115200) is a 16550A",
            ),
            (
                900_400.0,
                "[    0.900400] initcall audit_init+0x0/0x1a returned 0 after 9000 usecs",
            ),
            (
                900_500.0,
                "[    0.900500] initcall audit_watch_init+0x0/0x1a returned 0 after 3000 usecs",
            ),
            (
                900_600.0,
                "[    0.900600] initcall tiny_init+0x0/0x1a returned 0 after 10 usecs",
            ),
            (
                900_700.0,
                "[    0.900700] initcall virtio_console_init+0x0/0x1a [virtio_console] returned 0 after 5000 usecs",
            ),
            (
                900_800.0,
                "[    0.900800] smp: Bringing up secondary CPUs ...",
            ),
            (940_800.0, "[    0.940800] smp: Brought up 1 node, 2 CPUs"),
        ],
        1_000_000.0,
    )
}

/// An initcall → owner map for [`profile`]'s initcalls.
pub fn kmap() -> KconfigMap {
    let own = |file: &str, syms: &[&str]| Owner {
        file: file.into(),
        symbols: syms.iter().map(|s| s.to_string()).collect(),
    };
    let mut m = KconfigMap::default();
    m.owners.insert(
        "crypto_algapi_init".into(),
        own("crypto/algapi.c", &["CONFIG_CRYPTO_ALGAPI2"]),
    );
    m.owners.insert(
        "aes_init".into(),
        own(
            "arch/x86/crypto/aesni-intel_glue.c",
            &["CONFIG_CRYPTO_AES_NI_INTEL"],
        ),
    );
    m.owners.insert(
        "serial8250_init".into(),
        own(
            "drivers/tty/serial/8250/8250_core.c",
            &["CONFIG_SERIAL_8250", "CONFIG_TTY"],
        ),
    );
    m.owners.insert(
        "audit_init".into(),
        own("kernel/audit.c", &["CONFIG_AUDIT"]),
    );
    m.owners.insert(
        "audit_watch_init".into(),
        own(
            "kernel/audit_watch.c",
            &["CONFIG_AUDIT_WATCH", "CONFIG_AUDIT"],
        ),
    );
    m.owners
        .insert("tiny_init".into(), own("kernel/tiny.c", &["CONFIG_TINY"]));
    m
}

/// The advice `id` that `rule` gives a qemu boot with `cmdline` and `cpus`
/// vCPUs from the profile boot `profile` alone.
pub fn profile_advice<R: IntoIterator<Item = Advice>>(
    rule: impl Fn(&Inputs<'_>) -> R,
    profile: &BootRecord,
    cmdline: &str,
    cpus: u32,
    id: &str,
) -> Option<Advice> {
    run(
        rule,
        &header(cmdline, cpus, 256, "qemu"),
        &opts(&[]),
        &[],
        std::slice::from_ref(profile),
        None,
        None,
    )
    .into_iter()
    .find(|a| a.id == id)
}
