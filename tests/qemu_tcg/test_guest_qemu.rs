//! End-to-end: the test guest under `qemu-system-x86_64 -M microvm`, as a
//! PVH ELF and as a synthetic bzImage, with TCG (and KVM where /dev/kvm
//! exists). Checks the banner and every stage-1 command through what QEMU
//! shows: the serial console, isa-debug-exit's status ((N << 1) | 1), and an
//! isa-debugcon on port 0x80 that records the boot marks.

use ember_testing::{GUEST_EXIT_ERROR, as_bzimage, test_guest};
use std::path::Path;
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

/// A scratch file's path, in a directory removed when the test ends.
fn scratch(name: &str) -> ember_testing::TempFile {
    ember_testing::TempFile::new("guest-qemu", name)
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

fn bzimage() -> ember_testing::TempFile {
    let out = scratch("guest.bzImage");
    as_bzimage(&test_guest().unwrap(), &out).unwrap();
    out
}

#[test]
fn pvh_elf_runs_every_stage_1_command() {
    let cmdline =
        "console=ttyS0 print=hello_from_ring_3 mark=0x42 mark=7 timer touch=4 spin=20 tsc exit=7";
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
    assert!(run.console.contains("\ntsc: khz="), "{}", run.console);
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
        assert_eq!(
            run.status,
            qemu_status(GUEST_EXIT_ERROR.into()),
            "{token}: {}",
            run.console
        );
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

/// A raw disk of `mib` MiB, zero-filled, for `-device virtio-blk-device`.
fn disk(mib: u64) -> ember_testing::TempFile {
    let path = scratch(&format!("disk-{}.raw", unique()));
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(mib << 20).unwrap();
    path
}

/// The `-drive` value for a raw disk file.
fn raw_drive(disk: &Path, extra_drive_opts: &str) -> String {
    format!(
        "file={},format=raw,cache=unsafe{extra_drive_opts}",
        disk.display()
    )
}

/// QEMU options for a modern virtio-blk-device on `drive` (a `-drive` value
/// without `if`/`id`).
fn virtio_blk_args(drive: &str) -> Vec<String> {
    vec![
        "-global".into(),
        "virtio-mmio.force-legacy=false".into(),
        "-drive".into(),
        format!("{drive},if=none,id=d0"),
        "-device".into(),
        "virtio-blk-device,drive=d0".into(),
    ]
}

fn tcg_with_drive(drive: &str, cmdline: &str) -> Run {
    let args = virtio_blk_args(drive);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_with(&test_guest().unwrap(), cmdline, &["-accel", "tcg"], &args)
}

fn tcg_with_disk(disk: &Path, drive_opts: &str, cmdline: &str) -> Run {
    tcg_with_drive(&raw_drive(disk, drive_opts), cmdline)
}

/// The verify pattern's words differ from word 0 by a seed-free function of
/// their disk offset (see virtio_blk.rs `pattern_word`), so the host can
/// check what the guest wrote without knowing the seed.
fn assert_disk_has_verify_pattern(disk: &[u8], span: usize) {
    let word = |o: usize| u64::from_le_bytes(disk[o..o + 8].try_into().unwrap());
    let first = word(0);
    for o in (0..span).step_by(8) {
        let expected = (o as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        assert_eq!(word(o) ^ first, expected, "disk word at {o:#x}");
    }
    assert!(disk[span..].iter().all(|&b| b == 0), "wrote past the span");
}

#[test]
fn blkverify_writes_the_pattern_and_reads_it_back() {
    let disk = disk(8);
    let run = tcg_with_disk(&disk, "", "bs=8k qd=4 blkmib=2 blkverify exit=0");
    assert!(
        run.console
            .contains("\nblkverify: ok blocks=256 bytes=2097152 bs=8192 qd=4 "),
        "{}",
        run.console
    );
    assert_eq!(run.status, qemu_status(0), "{}", run.console);
    let bytes = std::fs::read(&disk).unwrap();
    std::fs::remove_file(&disk).unwrap();
    assert_disk_has_verify_pattern(&bytes, 2 << 20);
}

#[test]
fn blkverify_catches_a_disk_that_drops_writes() {
    // null-co discards writes and reads zeros.
    let run = tcg_with_drive(
        "driver=null-co,size=8M,read-zeroes=on",
        "blkmib=1 blkverify exit=0",
    );
    assert!(
        run.console
            .contains("\nblkverify: mismatch at disk offset 0 (block at 0)\n"),
        "{}",
        run.console
    );
    assert_eq!(run.status, qemu_status(GUEST_EXIT_ERROR.into()));
}

#[test]
fn blk_reports_device_errors() {
    // blkdebug fails every request with EIO: virtio status 1 (IOERR).
    let drive = "driver=blkdebug,inject-error.0.event=none,inject-error.0.errno=5,\
                 image.driver=null-co,image.size=8M,image.read-zeroes=on";
    let run = tcg_with_drive(drive, "blk exit=0");
    assert!(
        run.console
            .contains("\nblk: request failed: status=1 offset=0\n"),
        "{}",
        run.console
    );
    assert_eq!(run.status, qemu_status(GUEST_EXIT_ERROR.into()));
}

#[test]
fn blk_benchmark_prints_one_line_per_run() {
    let disk = disk(8);
    let run = tcg_with_disk(
        &disk,
        "",
        "ios=300 blk qd=8 pattern=rand blkop=write blk bs=16k blkop=rw blkmib=4 blk exit=0",
    );
    std::fs::remove_file(&disk).unwrap();
    let line = regex::Regex::new(
        r"(?m)^blk: op=(\w+) bs=(\d+) qd=(\d+) pattern=(\w+) ios=(\d+) bytes=(\d+) ns=(\d+) iops=(\d+) mibps=\d+\.\d\d lat_p50_ns=(\d+) lat_p99_ns=(\d+) lat_max_ns=(\d+) dev=0x[0-9a-f]+$",
    )
    .unwrap();
    let runs: Vec<Vec<String>> = line
        .captures_iter(&run.console)
        .map(|c| (1..=11).map(|i| c[i].to_owned()).collect())
        .collect();
    let settings: Vec<[&str; 5]> = runs
        .iter()
        .map(|r| [&r[0], &r[1], &r[2], &r[3], &r[4]].map(String::as_str))
        .collect();
    assert_eq!(
        settings,
        [
            ["read", "4096", "1", "seq", "300"],
            ["write", "4096", "8", "rand", "300"],
            ["rw", "16384", "8", "rand", "300"],
        ],
        "{}",
        run.console
    );
    for r in &runs {
        let n = |i: usize| r[i].parse::<u64>().unwrap();
        assert_eq!(n(5), n(4) * n(1), "bytes = ios × bs");
        assert!(n(6) > 0 && n(7) > 0, "{r:?}");
        assert!(n(8) > 0 && n(8) <= n(9), "p50 ≤ p99: {r:?}");
        assert!(n(9) <= n(10), "p99 ≤ max: {r:?}");
    }
    assert_eq!(run.status, qemu_status(0), "{}", run.console);
}

#[test]
fn blk_errors_exit_with_status_2() {
    let disk = disk(1);
    let cases = [
        // (drive options, command line, expected message)
        (",readonly=on", "blkop=write blk", "read-only"),
        ("", "bs=1000 blk", "multiple of 512"),
        ("", "qd=1000 blk", "qd must be"),
        ("", "blkmib=2 blk", "larger than the disk"),
        ("", "blk=0xd0000000", "no virtio-mmio device there"),
    ];
    for (drive, cmdline, message) in cases {
        let run = tcg_with_disk(&disk, drive, &format!("{cmdline} exit=0"));
        assert!(run.console.contains(message), "{cmdline}: {}", run.console);
        assert_eq!(
            run.status,
            qemu_status(GUEST_EXIT_ERROR.into()),
            "{cmdline}: {}",
            run.console
        );
    }
    std::fs::remove_file(&disk).unwrap();
}

#[test]
fn blk_without_a_device_is_an_error() {
    let run = tcg(&test_guest().unwrap(), "blk exit=0");
    assert!(
        run.console.contains("no virtio-blk device found"),
        "{}",
        run.console
    );
    assert_eq!(
        run.status,
        qemu_status(GUEST_EXIT_ERROR.into()),
        "{}",
        run.console
    );
}

#[test]
fn blk_rejects_legacy_virtio_mmio() {
    let disk = disk(1);
    // Without force-legacy=false, microvm's transports are version 1.
    let drive = format!("file={},format=raw,if=none,id=d0", disk.display());
    let run = run_with(
        &test_guest().unwrap(),
        "blk exit=0",
        &["-accel", "tcg"],
        &["-drive", &drive, "-device", "virtio-blk-device,drive=d0"],
    );
    std::fs::remove_file(&disk).unwrap();
    assert!(run.console.contains("version 2"), "{}", run.console);
    assert_eq!(
        run.status,
        qemu_status(GUEST_EXIT_ERROR.into()),
        "{}",
        run.console
    );
}

#[test]
fn blk_runs_under_kvm() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (QEMU with -accel kvm)"
    );
    let disk = disk(4);
    let args = virtio_blk_args(&raw_drive(&disk, ""));
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["-accel", "kvm", "-cpu", "qemu64"]);
    let run = run_with(
        &test_guest().unwrap(),
        "qd=4 blkmib=1 blkverify ios=100 blk exit=0",
        &[],
        &args,
    );
    let bytes = std::fs::read(&disk).unwrap();
    std::fs::remove_file(&disk).unwrap();
    assert!(
        run.console.contains("\nblkverify: ok blocks=256 "),
        "{}",
        run.console
    );
    assert!(
        run.console.contains("\nblk: op=read bs=4096 qd=4 "),
        "{}",
        run.console
    );
    assert_eq!(run.status, qemu_status(0), "{}", run.console);
    assert_disk_has_verify_pattern(&bytes, 1 << 20);
}
