//! What seccomp costs `ember boot` at start-up: the same boot with
//! `--seccomp trap` (the default) and `--seccomp off`, interleaved in one
//! run so both see the same noise, medians and min–max, and the ratio.
//!
//! `cargo bench --bench seccomp` measures the dynamically linked build;
//! `EMBER_BIN=$(scripts/build-release) cargo bench --bench seccomp` ember as
//! shipped (static musl).
//! EMBER_BENCH_RUNS=N changes the run count (default 20). The guest is
//! ember's test guest printing one line and ending (`print=up halt`), 512 MiB,
//! 1 vCPU, as in the VMM-core bench (`benches/vmm.rs`). It also times, in
//! this process, what installing each kind of thread's filter costs the
//! thread (the kernel checks, JIT-compiles and caches the program: the
//! reason ember installs each where its thread would otherwise wait), and
//! what the vCPU filter adds to each ioctl, the call a vCPU makes at every
//! exit.

use ember::lab::stats::Summary;
use ember_vmm::events::{EventFile, monotonic_ns};
use ember_vmm::seccomp::{self, Mode, Thread};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Pause before each run, so the previous VM's teardown (5–25 ms of a core
/// here) does not overlap the next start.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(40);

/// One boot: exec → first console line, exec → exit, and (from the events
/// file) exec → first guest instruction, in ms.
struct Boot {
    first_line: f64,
    exit: f64,
    first_insn: f64,
}

fn boot(ember: &Path, guest: &Path, mode: &str, events: &Path) -> Boot {
    std::thread::sleep(SETTLE);
    let t0 = monotonic_ns();
    let mut child = Command::new(ember)
        .args(["boot", "--mem", "512M", "--cmdline", "print=up halt"])
        .args(["--seccomp", mode, "--kernel"])
        .arg(guest)
        .arg("--events")
        .arg(events)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn ember");
    let mut out = child.stdout.take().unwrap();
    let mut first_line = None;
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = out.read(&mut buf) {
        if first_line.is_none() && buf[..n].contains(&b'\n') {
            first_line = Some((monotonic_ns() - t0) as f64 / 1e6);
        }
    }
    let status = child.wait().expect("wait for ember");
    let exit = (monotonic_ns() - t0) as f64 / 1e6;
    assert!(status.success(), "ember --seccomp {mode} failed: {status}");
    let ev: EventFile = serde_json::from_slice(&std::fs::read(events).unwrap()).unwrap();
    let entry = ev
        .events
        .iter()
        .find(|e| e.kind == "boot_mark" && e.code == Some(0x40))
        .expect("the guest's first mark")
        .t_us;
    Boot {
        first_line: first_line.expect("a console line"),
        exit,
        first_insn: (ev.t0_monotonic_ns as f64 - t0 as f64) / 1e6 + entry / 1e3,
    }
}

fn row(name: &str, unit: &str, v: &[f64]) -> f64 {
    let s = Summary::of(v).unwrap_or_default();
    println!(
        "| {name} | {:.3} {unit} | {:.3} – {:.3} |",
        s.median, s.min, s.max
    );
    s.median
}

fn main() {
    let runs: usize = std::env::var("EMBER_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let ember = std::env::var_os("EMBER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ember")));
    let guest = ember_testing::test_guest().expect("test guest");
    let dir = std::env::temp_dir().join(format!("ember-bench-seccomp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let events = dir.join("ev.json");

    // Warm-up: page cache, THP pool, binaries.
    for mode in ["trap", "off", "trap", "off"] {
        boot(&ember, &guest, mode, &events);
    }
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for i in 0..runs {
        eprint!("\rrun {}/{runs}", i + 1);
        // Alternate which goes first, so neither always follows the other.
        if i % 2 == 0 {
            on.push(boot(&ember, &guest, "trap", &events));
            off.push(boot(&ember, &guest, "off", &events));
        } else {
            off.push(boot(&ember, &guest, "off", &events));
            on.push(boot(&ember, &guest, "trap", &events));
        }
    }
    eprintln!();
    // Installing each kind's filter as ember does (`seccomp::confine`: the
    // built-in program, and the clone3 filter for kinds that start threads),
    // each time on a fresh thread. Not the keeper's: it would stop a thread
    // from ending (and is 20-odd instructions).
    seccomp::init(Mode::Trap, 99).expect("seccomp::init");
    let installs: Vec<(Thread, usize, Vec<f64>)> = Thread::ALL
        .into_iter()
        .filter(|&t| t != Thread::Keeper)
        .map(|t| {
            let program = seccomp::compile(t, Mode::Trap);
            let times = (0..runs)
                .map(|_| {
                    std::thread::spawn(move || {
                        let t0 = monotonic_ns();
                        seccomp::confine(t).expect("install");
                        (monotonic_ns() - t0) as f64 / 1e3
                    })
                    .join()
                    .expect("install thread")
                })
                .collect();
            (t, program.len(), times)
        })
        .collect();
    // What a filter costs every system call its thread makes: a vCPU makes
    // one ioctl (KVM_RUN) per exit, and its list checks the request's type.
    // Timed here with a KVM request on no descriptor (EBADF at once), on a
    // fresh thread each time: unfiltered, under the vCPU filter, and under
    // the vCPU list with every ioctl allowed (as it was before ember checked
    // requests), in turn.
    const CALLS: u32 = 200_000;
    let mut any_ioctl = seccomp::rules(Thread::Vcpu);
    any_ioctl.insert(libc::SYS_ioctl, Vec::new());
    let any_ioctl = std::sync::Arc::new(seccomp::compile_rules(&any_ioctl, Mode::Trap));
    #[derive(Clone, Copy)]
    enum Filter {
        None,
        Vcpu,
        AnyIoctl,
    }
    let per_call = |filter: Filter| -> f64 {
        let any_ioctl = any_ioctl.clone();
        std::thread::spawn(move || {
            match filter {
                Filter::None => {}
                Filter::Vcpu => seccomp::confine(Thread::Vcpu).expect("install"),
                Filter::AnyIoctl => seccompiler::apply_filter(&any_ioctl).expect("install"),
            }
            let t0 = monotonic_ns();
            for _ in 0..CALLS {
                // SAFETY: an invalid descriptor: the call fails with EBADF.
                // (KVM_CHECK_EXTENSION, _IO(KVMIO, 0x03).)
                unsafe { libc::ioctl(-1, 0xAE03 as _, 0) };
            }
            (monotonic_ns() - t0) as f64 / f64::from(CALLS)
        })
        .join()
        .expect("per-call thread")
    };
    let (mut call_off, mut call_vcpu, mut call_any) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        // Each goes first in turn.
        for k in 0..3 {
            match (i + k) % 3 {
                0 => call_off.push(per_call(Filter::None)),
                1 => call_vcpu.push(per_call(Filter::Vcpu)),
                _ => call_any.push(per_call(Filter::AnyIoctl)),
            }
        }
    }

    println!(
        "\nember boot with --seccomp trap vs off, {runs} interleaved pairs (test guest, 512 MiB, 1 vCPU)"
    );
    println!("ember binary: {}\n", ember.display());
    println!("| measure | median | min – max |");
    println!("| --- | --- | --- |");
    let pick = |v: &[Boot], f: fn(&Boot) -> f64| v.iter().map(f).collect::<Vec<_>>();
    let on_insn = row(
        "seccomp trap: exec → first guest instruction",
        "ms",
        &pick(&on, |b| b.first_insn),
    );
    let off_insn = row(
        "seccomp off: exec → first guest instruction",
        "ms",
        &pick(&off, |b| b.first_insn),
    );
    let on_line = row(
        "seccomp trap: exec → first console line",
        "ms",
        &pick(&on, |b| b.first_line),
    );
    let off_line = row(
        "seccomp off: exec → first console line",
        "ms",
        &pick(&off, |b| b.first_line),
    );
    let on_exit = row("seccomp trap: exec → exit", "ms", &pick(&on, |b| b.exit));
    let off_exit = row("seccomp off: exec → exit", "ms", &pick(&off, |b| b.exit));
    println!("\ninstalling one filter on a thread (in process, {runs} fresh threads each):\n");
    println!("| thread kind (BPF instructions) | median | min – max |");
    println!("| --- | --- | --- |");
    for (t, len, times) in &installs {
        row(&format!("{} ({len})", t.name()), "µs", times);
    }
    println!(
        "\none KVM ioctl (a request on no descriptor), {CALLS} calls on a fresh thread, {runs} threads each:\n"
    );
    println!("| thread | ns per call, median | min – max |");
    println!("| --- | --- | --- |");
    let c_off = row("no filter", "ns", &call_off);
    let c_any = row("the vCPU list, any ioctl allowed", "ns", &call_any);
    let c_vcpu = row("the vCPU filter (KVM's requests only)", "ns", &call_vcpu);
    println!(
        "\ncost per ioctl against no filter: any ioctl allowed {:+.1} ns ({:.3}×), KVM's only {:+.1} ns ({:.3}×)",
        c_any - c_off,
        c_any / c_off,
        c_vcpu - c_off,
        c_vcpu / c_off
    );
    println!(
        "\nratios (trap / off, medians): first instruction {:.3}×, first line {:.3}×, exit {:.3}×",
        on_insn / off_insn,
        on_line / off_line,
        on_exit / off_exit
    );
    println!(
        "differences (trap − off, medians): first instruction {:+.3} ms, first line {:+.3} ms",
        on_insn - off_insn,
        on_line - off_line
    );
    let _ = std::fs::remove_dir_all(&dir);
}
