//! End-to-end: the test guest under `qemu-system-x86_64 -M microvm`, as a
//! PVH ELF and as a synthetic bzImage, with TCG (and KVM where /dev/kvm
//! exists). Checks the banner and every stage-1 command through what QEMU
//! shows: the serial console, isa-debug-exit's status ((N << 1) | 1), and an
//! isa-debugcon on port 0x80 that records the boot marks.

use ember::testing::{as_bzimage, test_guest};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Generous: TCG on a shared two-core machine.
const TIMEOUT: Duration = Duration::from_secs(60);

struct Run {
    /// QEMU's exit status.
    status: i32,
    /// The guest's serial console.
    console: String,
    /// Bytes written to port 0x80.
    marks: Vec<u8>,
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-guest-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// isa-debug-exit turns the guest's `exit=N` into QEMU status (N << 1) | 1.
fn qemu_status(n: i32) -> i32 {
    (n << 1) | 1
}

fn qemu_command(kernel: &Path, cmdline: &str, accel: &[&str], marks: &Path) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-M", "microvm", "-m", "256", "-smp", "1"])
        .args(accel)
        .args([
            "-nodefaults",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
        ])
        .args(["-device", "isa-debug-exit,iobase=0x501,iosize=1"])
        .arg("-chardev")
        .arg(format!("file,id=marks,path={}", marks.display()))
        .args(["-device", "isa-debugcon,iobase=0x80,chardev=marks"])
        .arg("-kernel")
        .arg(kernel)
        .args(["-append", cmdline]);
    cmd
}

fn run_with(kernel: &Path, cmdline: &str, accel: &[&str], extra: &[&str]) -> Run {
    let marks = scratch(&format!("marks-{}", unique()));
    let mut cmd = qemu_command(kernel, cmdline, accel, &marks);
    cmd.args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .expect("qemu-system-x86_64 must be installed for these tests");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > TIMEOUT {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the guest did not stop within {TIMEOUT:?}; console:\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let console = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = out.status.code().unwrap_or_else(|| {
        panic!(
            "qemu was killed by a signal; stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let recorded = std::fs::read(&marks).unwrap_or_default();
    let _ = std::fs::remove_file(&marks);
    Run {
        status,
        console,
        marks: recorded,
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn tcg(kernel: &Path, cmdline: &str) -> Run {
    run_with(kernel, cmdline, &["-accel", "tcg"], &[])
}

fn bzimage() -> PathBuf {
    let out = scratch("guest.bzImage");
    as_bzimage(&test_guest().unwrap(), &out).unwrap();
    out
}

#[test]
fn pvh_elf_runs_every_stage_1_command() {
    let cmdline =
        "console=ttyS0 print=hello_from_ring_3 mark=0x42 mark=7 timer touch=4 spin=20 exit=7";
    let run = tcg(&test_guest().unwrap(), cmdline);
    let banner = format!("ember-test-guest: ring 3, entry=pvh, cmdline=\"{cmdline}\"\n");
    assert!(run.console.starts_with(&banner), "{}", run.console);
    assert!(
        run.console.contains("\nhello from ring 3\n"),
        "{}",
        run.console
    );
    assert!(
        run.console.contains("\ntouch: mib=4 pages=1024 ns="),
        "{}",
        run.console
    );
    // 0x40 from the first CPL0 instruction, 0x41 from ring 3, then ours.
    assert_eq!(run.marks, [0x40, 0x41, 0x42, 7]);
    assert_eq!(run.status, qemu_status(7), "{}", run.console);
}

#[test]
fn exit_status_is_the_exit_token() {
    let guest = test_guest().unwrap();
    for n in [0, 1, 100] {
        let run = tcg(&guest, &format!("exit={n} print=not_reached"));
        assert_eq!(run.status, qemu_status(n), "{}", run.console);
        assert!(!run.console.contains("not reached"), "{}", run.console);
    }
}

#[test]
fn foreign_tokens_are_ignored_and_halt_ends_early() {
    let run = tcg(
        &test_guest().unwrap(),
        "quiet console=ttyS0 reboot=k print=before halt print=after exit=9",
    );
    assert!(run.console.contains("\nbefore\n"), "{}", run.console);
    assert!(!run.console.contains("after\n"), "{}", run.console);
    // The default ending: no ACPI or i8042 on this microvm, so exit=0.
    assert_eq!(run.status, qemu_status(0), "{}", run.console);
}

#[test]
fn malformed_tokens_exit_with_status_2() {
    let guest = test_guest().unwrap();
    for token in ["mark=300", "touch=lots", "exit", "timer=1", "touch=4000"] {
        let run = tcg(&guest, &format!("print=first {token} print=not_reached"));
        assert_eq!(run.status, qemu_status(2), "{token}: {}", run.console);
        assert!(
            run.console.contains("ember-test-guest: error: "),
            "{token}: {}",
            run.console
        );
        assert!(!run.console.contains("not reached"), "{}", run.console);
    }
}

#[test]
fn bzimage_boots_through_the_real_mode_stub() {
    let cmdline = "print=from_a_bzimage exit=5";
    let kernel = bzimage();
    let run = tcg(&kernel, cmdline);
    std::fs::remove_file(&kernel).unwrap();
    // QEMU enters a bzImage in real mode; our stub takes the 32-bit entry.
    let banner = format!("ember-test-guest: ring 3, entry=linux32, cmdline=\"{cmdline}\"\n");
    assert!(run.console.starts_with(&banner), "{}", run.console);
    assert!(
        run.console.contains("\nfrom a bzimage\n"),
        "{}",
        run.console
    );
    assert_eq!(run.marks[..2], [0x40, 0x41]);
    assert_eq!(run.status, qemu_status(5), "{}", run.console);
}

#[test]
fn pvh_elf_boots_without_option_roms() {
    // qboot enters a PVH kernel itself: no option ROM needed.
    let run = run_with(
        &test_guest().unwrap(),
        "print=no_roms exit=3",
        &["-accel", "tcg"],
        &[
            "-M",
            "microvm,x-option-roms=off,acpi=off,pic=off,pit=off,rtc=off",
        ],
    );
    assert!(run.console.contains("\nno roms\n"), "{}", run.console);
    assert_eq!(run.status, qemu_status(3), "{}", run.console);
}

/// Under this machine's software KVM (PVM), ring-3 port I/O faults despite
/// IOPL=3 and the guest's #GP handler emulates it: this proves that path.
#[test]
fn pvh_elf_runs_under_kvm() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (QEMU with -accel kvm)"
    );
    // PVM rejects -cpu host (MSR 0x10a); qemu64 works.
    let run = run_with(
        &test_guest().unwrap(),
        "print=under_kvm mark=0x55 timer touch=8 exit=4",
        &["-accel", "kvm", "-cpu", "qemu64"],
        &[],
    );
    assert!(run.console.contains("entry=pvh"), "{}", run.console);
    assert!(run.console.contains("\nunder kvm\n"), "{}", run.console);
    assert!(
        run.console.contains("\ntouch: mib=8 pages=2048"),
        "{}",
        run.console
    );
    assert_eq!(run.marks, [0x40, 0x41, 0x55]);
    assert_eq!(run.status, qemu_status(4), "{}", run.console);
}
