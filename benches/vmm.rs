//! VMM-core benchmark: ember against QEMU microvm (KVM) on the same machine,
//! in one run, interleaved so both see the same noise.
//!
//! `cargo bench --bench vmm` measures the dynamically linked build; ember as
//! shipped (statically linked against musl, see scripts/build-release) with
//! `cargo bench --target x86_64-unknown-linux-musl --bench vmm`.
//! EMBER_BENCH_RUNS=N changes the run count; EMBER_BENCH_BASE_BIN=PATH also
//! measures another ember build (an older commit's) in the same rounds, to
//! show a change cost nothing. The guest is ember's test guest
//! told to end at once (`halt`): a null guest. Two floors put ember's start-up
//! in proportion: how long this host takes to exec a static process that does
//! nothing, and the KVM calls no VMM can skip before a guest runs.
//!
//! ember's peak RSS comes from its own `memory` event, which also says how
//! much of it is guest memory.

use ember::lab::stats::Summary;
use ember_vmm::events::{EventFile, monotonic_ns};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One measured process run.
#[derive(Debug, Default, Clone)]
struct Run {
    /// exec -> exit (ms).
    exit_ms: f64,
    /// exec -> first complete stdout line (ms).
    first_line_ms: Option<f64>,
    /// Peak RSS (KiB) from wait4.
    maxrss_kib: u64,
}

/// Pause before each measured run. Destroying a VM costs a core 5-25 ms
/// here, after ember (or QEMU) has exited; on a 2-core host
/// the previous run's teardown would otherwise compete with the next start.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(40);

/// Spawns `cmd`, timing its first stdout line and its exit.
// Reaped with wait4(2) rather than `Child::wait`, for its resource usage.
#[allow(clippy::zombie_processes)]
fn measure(cmd: &mut Command) -> Run {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null());
    std::thread::sleep(SETTLE);
    let t0 = monotonic_ns();
    let mut child = cmd.spawn().expect("spawn");
    let mut out = child.stdout.take().unwrap();
    let mut first_line = None;
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = out.read(&mut buf) {
        if first_line.is_none() && buf[..n].contains(&b'\n') {
            first_line = Some((monotonic_ns() - t0) as f64 / 1e6);
        }
    }
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid out-parameter for wait4.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child; `status` and `ru` are valid out-pointers.
    unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    let exit_ms = (monotonic_ns() - t0) as f64 / 1e6;
    Run {
        exit_ms,
        first_line_ms: first_line,
        maxrss_kib: ru.ru_maxrss as u64,
    }
}

/// Runs ember with an events file; returns (exec -> first guest instruction ms,
/// VMM process peak RSS KiB, VMM overhead KiB = that - guest memory resident).
fn ember_internals(ember: &Path, guest: &Path, dir: &Path) -> (f64, f64, f64) {
    let events = dir.join("ev.json");
    std::thread::sleep(SETTLE);
    let t0 = monotonic_ns();
    let st = Command::new(ember)
        .args([
            ember_testing::boot_subcommand(ember),
            "--mem",
            "512M",
            "--cmdline",
            "halt",
            "--console",
            "none",
            "--kernel",
        ])
        .arg(guest)
        .arg("--events")
        .arg(&events)
        .status()
        .expect("ember");
    assert!(st.success());
    let ev: EventFile = serde_json::from_slice(&std::fs::read(&events).unwrap()).unwrap();
    let exec_to_main_us = (ev.t0_monotonic_ns as f64 - t0 as f64) / 1e3;
    let first = ev
        .events
        .iter()
        .find(|e| e.kind == "boot_mark" && e.code == Some(0x40))
        .expect("mark 0x40")
        .t_us;
    let kib = |name| ev.memory_kib(name).unwrap_or(0) as f64;
    (
        (exec_to_main_us + first) / 1e3,
        kib("vm_hwm_kib"),
        kib("vm_hwm_kib") - kib("guest_resident_kib"),
    )
}

/// The host's own floor under "exec → first guest instruction": the KVM
/// calls any VMM makes before a guest runs (open /dev/kvm, create a VM, give
/// it 512 MiB, create the in-kernel irqchip and one vCPU), timed in this
/// process (ms).
fn kvm_floor() -> f64 {
    std::thread::sleep(SETTLE);
    let t0 = monotonic_ns();
    let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm");
    let vm = kvm.create_vm().expect("create a VM");
    const MEM: usize = 512 << 20;
    // SAFETY: a fresh anonymous mapping, unmapped below after the VM that
    // uses it is gone.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            MEM,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(host, libc::MAP_FAILED);
    let region = kvm_bindings::kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: MEM as u64,
        userspace_addr: host as u64,
    };
    // SAFETY: the region is a live mapping of MEM bytes, kept until the VM is dropped.
    unsafe { vm.set_user_memory_region(region) }.expect("memory slot");
    vm.create_irq_chip().expect("irqchip");
    let vcpu = vm.create_vcpu(0).expect("vCPU");
    let ms = (monotonic_ns() - t0) as f64 / 1e6;
    drop((vcpu, vm));
    // SAFETY: unmapping the mapping made above; the VM using it is gone.
    unsafe { libc::munmap(host, MEM) };
    ms
}

/// Set, this bench only prints when its `main` began (see `exec_floor`).
const NOOP_ENV: &str = "EMBER_BENCH_NOOP";

/// The host's floor under any process's start: exec → `main` of a static
/// binary that does nothing (this one, with [`NOOP_ENV`] set), in ms.
fn exec_floor(this: &Path) -> f64 {
    std::thread::sleep(SETTLE);
    let t0 = monotonic_ns();
    let out = Command::new(this)
        .env(NOOP_ENV, "1")
        .output()
        .expect("no-op");
    let main_ns: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a time");
    (main_ns - t0) as f64 / 1e6
}

/// How `bin` is linked: "static" without a program interpreter.
fn linking(bin: &Path) -> &'static str {
    let bytes = std::fs::read(bin).unwrap_or_default();
    match object::read::File::parse(&*bytes) {
        Ok(f) => {
            use object::Object;
            if f.section_by_name(".interp").is_some() {
                "dynamically linked"
            } else {
                "statically linked"
            }
        }
        Err(_) => "unknown linking",
    }
}

/// Median and range of `v` (the lab's summary; empty input gives zeros).
fn stats(v: Vec<f64>) -> Summary {
    Summary::of(&v).unwrap_or_default()
}

fn row(name: &str, unit: &str, v: Vec<f64>) -> f64 {
    let s = stats(v);
    println!(
        "| {name} | {:.2} {unit} | {:.2} – {:.2} |",
        s.median, s.min, s.max
    );
    s.median
}

fn main() {
    if std::env::var_os(NOOP_ENV).is_some() {
        println!("{}", monotonic_ns());
        return;
    }
    // `cargo bench` passes --bench; anything else is ignored.
    let runs: usize = std::env::var("EMBER_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let ember = PathBuf::from(env!("CARGO_BIN_EXE_ember"));
    let guest = ember_testing::test_guest().expect("test guest");
    let dir = std::env::temp_dir().join(format!("ember-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let qemu = ember::backend::find_binary("qemu-system-x86_64");

    let base = std::env::var_os("EMBER_BENCH_BASE_BIN").map(PathBuf::from);
    let ember_cmd_of = |bin: &Path, mem: &str| {
        let mut c = Command::new(bin);
        c.args([
            ember_testing::boot_subcommand(bin),
            "--mem",
            mem,
            "--cmdline",
            "print=up halt",
            "--kernel",
        ])
        .arg(&guest);
        c
    };
    let ember_cmd = |mem: &str| ember_cmd_of(&ember, mem);
    let qemu_cmd = |q: &Path| {
        let mut c = Command::new(q);
        c.args([
            "-M",
            "microvm",
            "-enable-kvm",
            "-cpu",
            "qemu64",
            "-m",
            "512M",
            "-smp",
            "1",
        ]);
        c.args([
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-serial",
            "stdio",
            "-no-reboot",
        ]);
        c.args([
            "-device",
            "isa-debug-exit,iobase=0x501,iosize=1",
            "-append",
            "print=up exit=0",
            "-kernel",
        ]);
        c.arg(&guest);
        c
    };

    // Warm-up: page cache, THP pool, binaries.
    for _ in 0..3 {
        measure(&mut ember_cmd("512M"));
        if let Some(q) = &qemu {
            measure(&mut qemu_cmd(q));
        }
    }
    let (mut e, mut e64g, mut ver, mut q) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut first_insn, mut vmm_rss, mut overhead) = (Vec::new(), Vec::new(), Vec::new());
    let (mut exec_floors, mut kvm_floors) = (Vec::new(), Vec::new());
    let (mut b, mut b_first_insn, mut b_overhead) = (Vec::new(), Vec::new(), Vec::new());
    let this = std::env::current_exe().expect("the bench's own path");
    for i in 0..runs {
        eprint!("\rrun {}/{runs}", i + 1);
        // ember and the base build, each a plain run then one with its
        // timeline, take turns going first: whatever ran just before (a VM
        // still being torn down) weighs on both alike.
        let ember_turn = |e: &mut Vec<Run>,
                          first_insn: &mut Vec<f64>,
                          vmm_rss: &mut Vec<f64>,
                          overhead: &mut Vec<f64>| {
            e.push(measure(&mut ember_cmd("512M")));
            let (fi, rss, oh) = ember_internals(&ember, &guest, &dir);
            first_insn.push(fi);
            vmm_rss.push(rss / 1024.0);
            overhead.push(oh / 1024.0);
        };
        let base_turn =
            |b: &mut Vec<Run>, b_first_insn: &mut Vec<f64>, b_overhead: &mut Vec<f64>| {
                if let Some(base) = &base {
                    b.push(measure(&mut ember_cmd_of(base, "512M")));
                    let (fi, _, oh) = ember_internals(base, &guest, &dir);
                    b_first_insn.push(fi);
                    b_overhead.push(oh / 1024.0);
                }
            };
        if i % 2 == 0 {
            ember_turn(&mut e, &mut first_insn, &mut vmm_rss, &mut overhead);
            base_turn(&mut b, &mut b_first_insn, &mut b_overhead);
        } else {
            base_turn(&mut b, &mut b_first_insn, &mut b_overhead);
            ember_turn(&mut e, &mut first_insn, &mut vmm_rss, &mut overhead);
        }
        e64g.push(measure(&mut ember_cmd("64G")));
        ver.push(measure(Command::new(&ember).arg("--version")));
        if let Some(qb) = &qemu {
            q.push(measure(&mut qemu_cmd(qb)));
        }
        exec_floors.push(exec_floor(&this));
        kvm_floors.push(kvm_floor());
    }
    eprintln!();
    let ms = |v: &[Run]| v.iter().map(|r| r.exit_ms).collect::<Vec<_>>();
    let line = |v: &[Run]| v.iter().filter_map(|r| r.first_line_ms).collect::<Vec<_>>();
    let rss = |v: &[Run]| {
        v.iter()
            .map(|r| r.maxrss_kib as f64 / 1024.0)
            .collect::<Vec<_>>()
    };

    println!("\nember VMM core, {runs} interleaved runs (test guest, 512 MiB, 1 vCPU)");
    println!("ember binary: {} ({})\n", ember.display(), linking(&ember));
    println!("| measure | median | min – max |");
    println!("| --- | --- | --- |");
    let e_first = row("ember: exec → first guest instruction", "ms", first_insn);
    let e_line = row("ember: exec → first console line", "ms", line(&e));
    let e_exit = row("ember: exec → exit", "ms", ms(&e));
    let e64 = row("ember: exec → exit, 64 GiB guest", "ms", ms(&e64g));
    let v = row("ember --version: exec → exit", "ms", ms(&ver));
    row("ember: VMM process peak RSS", "MiB", vmm_rss);
    let e_oh = row(
        "ember: VMM overhead (VMM peak RSS − guest resident)",
        "MiB",
        overhead,
    );
    row(
        "ember: peak RSS from wait4 (guest memory included)",
        "MiB",
        rss(&e),
    );
    if !q.is_empty() {
        let q_line = row(
            "QEMU microvm (KVM): exec → first console line",
            "ms",
            line(&q),
        );
        let q_exit = row("QEMU microvm (KVM): exec → exit", "ms", ms(&q));
        row("QEMU microvm (KVM): peak RSS", "MiB", rss(&q));
        println!(
            "\nratios (QEMU / ember, medians): exit {:.1}×, first line {:.1}×",
            q_exit / e_exit,
            q_line / e_line
        );
    } else {
        println!("\nQEMU not found: no comparison");
    }
    if let Some(base) = &base {
        println!(
            "\nthe base build, {} ({}), in the same rounds:\n",
            base.display(),
            linking(base)
        );
        println!("| measure | median | min – max |");
        println!("| --- | --- | --- |");
        let b_first = row("base: exec → first guest instruction", "ms", b_first_insn);
        let b_line = row("base: exec → first console line", "ms", line(&b));
        let b_exit = row("base: exec → exit", "ms", ms(&b));
        let b_oh = row("base: VMM overhead", "MiB", b_overhead);
        println!(
            "\nratios (ember / base, medians): first instruction {:.2}×, first line {:.2}×, \
             exit {:.2}×, VMM overhead {:.2}×",
            e_first / b_first,
            e_line / b_line,
            e_exit / b_exit,
            e_oh / b_oh
        );
    }
    println!("\nthe host's floor under the first instruction:\n");
    println!("| measure | median | min – max |");
    println!("| --- | --- | --- |");
    let fe = row(
        "exec → `main` of a process that does nothing (this bench)",
        "ms",
        exec_floors,
    );
    let fk = row(
        "KVM: open, create VM, 512 MiB slot, irqchip, one vCPU (in process)",
        "ms",
        kvm_floors,
    );
    println!(
        "ember's own share of exec → first guest instruction: {:.2} ms of {e_first:.2} ms",
        e_first - fe - fk
    );
    println!(
        "64 GiB vs 512 MiB guest: {:.2}× ; ember boot vs ember --version: {:.2}×",
        e64 / e_exit,
        e_exit / v
    );
    let _ = std::fs::remove_dir_all(&dir);
}
