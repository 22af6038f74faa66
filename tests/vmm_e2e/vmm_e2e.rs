//! End-to-end: ember boots its own test guest on KVM through every loader path
//! and reports how it ended. (On this host guest kernel mode is emulated, so the
//! test guest does its work in ring 3; see guests/test-guest.)

use crate::common;

use common::{Scratch, ember, output, require_kvm, stderr, stdout};
use ember_vmm::events::EventFile;
use std::path::{Path, PathBuf};

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// Runs the guest with `cmdline`; returns (exit status, stdout, stderr, events).
fn boot(kernel: &Path, cmdline: &str, extra: &[&str]) -> (i32, String, String, EventFile) {
    let dir = Scratch::new("boot");
    let events = dir.path("events.json");
    let o = output(
        ember()
            .args(["boot", "--kernel"])
            .arg(kernel)
            .args(["--mem", "128M", "--cmdline", cmdline, "--events"])
            .arg(&events)
            .args(extra),
    );
    let ev: EventFile = std::fs::read(&events)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    (o.status.code().unwrap_or(-1), stdout(&o), stderr(&o), ev)
}

fn kinds(ev: &EventFile) -> Vec<&str> {
    ev.events.iter().map(|e| e.kind.as_str()).collect()
}

fn marks(ev: &EventFile) -> Vec<u32> {
    ev.events
        .iter()
        .filter(|e| e.kind == "boot_mark")
        .filter_map(|e| e.code)
        .collect()
}

#[test]
fn pvh_entry_prints_marks_and_returns_the_guest_status() {
    if !require_kvm("pvh_entry") {
        return;
    }
    let (code, out, err, ev) = boot(&guest(), "print=hello_world mark=0x42 timer exit=7", &[]);
    // The guest's debug-exit 7 comes out as 128 + 7 (docs/behaviour.md: exit statuses).
    assert_eq!(code, 128 + 7, "stderr: {err}");
    // The logger puts the boot timer's line on stderr.
    assert!(err.contains("ember: info: guest boot time = "), "{err}");
    assert!(out.contains("entry=pvh"), "{out}");
    assert!(out.contains("hello world\n"), "{out}");
    assert_eq!(
        marks(&ev),
        [
            0x40,
            0x41,
            0x42,
            ember_vmm::devices::legacy::BOOT_TIMER_MAGIC_CODE
        ]
    );
    let k = kinds(&ev);
    for want in [
        "kvm_open",
        "memory_ready",
        "kernel_loaded",
        "vcpus_created",
        "first_guest_entry",
        "guest_shutdown",
        "process_exit",
    ] {
        assert!(k.contains(&want), "{want} missing from {k:?}");
    }
    let pos = |w: &str| k.iter().position(|x| *x == w).unwrap();
    assert!(
        pos("kvm_open") < pos("memory_ready") && pos("memory_ready") < pos("first_guest_entry")
    );
    assert!(pos("first_guest_entry") < pos("boot_mark"));
    assert!(ev.events.windows(2).all(|w| w[0].t_us <= w[1].t_us));
    let lines: Vec<_> = ev
        .events
        .iter()
        .filter(|e| e.kind == "console_line")
        .filter_map(|e| e.text.as_deref())
        .collect();
    assert!(lines.contains(&"hello world"), "{lines:?}");
}

#[test]
fn linux64_entry_without_pvh_note() {
    if !require_kvm("linux64_entry") {
        return;
    }
    let dir = Scratch::new("nopvh");
    let plain = dir.path("guest-nopvh.elf");
    ember_testing::without_pvh_note(&guest(), &plain).unwrap();
    let (code, out, err, _) = boot(&plain, "print=sixty-four exit=0", &[]);
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("entry=linux64"), "{out}");
    assert!(out.contains("sixty-four"), "{out}");
}

#[test]
fn bzimage_entry() {
    if !require_kvm("bzimage_entry") {
        return;
    }
    let dir = Scratch::new("bz");
    let bz = dir.path("guest.bzImage");
    ember_testing::as_bzimage(&guest(), &bz).unwrap();
    let (code, out, err, _) = boot(&bz, "print=from_a_bzimage exit=0", &[]);
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("from a bzimage"), "{out}");
    assert!(out.contains("entry=linux64"), "{out}");
}

#[test]
fn each_ending_has_its_own_status() {
    if !require_kvm("endings") {
        return;
    }
    let g = guest();
    let (code, _, err, ev) = boot(&g, "shutdown", &[]);
    assert_eq!(code, 0, "ACPI power-off: {err}");
    assert!(kinds(&ev).contains(&"guest_shutdown"));
    let (code, _, _, ev) = boot(&g, "reset", &[]);
    assert_eq!(code, ember::exit::EXIT_GUEST_RESET);
    assert!(kinds(&ev).contains(&"guest_reset"));
    let (code, _, _, _) = boot(&g, "exit=42", &[]);
    assert_eq!(code, 128 + 42);
    // Guest statuses that were ember's own before the mapping: 1 (ember failed), 3 (crash).
    for (n, want) in [(1, 129), (3, 131), (0, 0)] {
        let (code, _, err, _) = boot(&g, &format!("exit={n}"), &[]);
        assert_eq!(code, want, "exit={n}: {err}");
    }
}

#[test]
fn an_unwritable_events_file_is_reported_and_the_guest_status_kept() {
    if !require_kvm("events_unwritable") {
        return;
    }
    let o = output(ember().arg("boot").arg("--kernel").arg(guest()).args([
        "--events",
        "/nonexistent-dir/events.json",
        "--cmdline",
        "print=hi exit=0",
    ]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot write the events to /nonexistent-dir/events.json"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn timeout_kills_a_guest_that_never_ends() {
    if !require_kvm("timeout") {
        return;
    }
    let started = std::time::Instant::now();
    let (code, _, err, _) = boot(&guest(), "spin=60000", &["--timeout", "0.5"]);
    assert_eq!(code, ember::exit::EXIT_TIMEOUT, "{err}");
    assert!(err.contains("did not finish"), "{err}");
    assert!(started.elapsed().as_secs() < 20);
}

#[test]
fn several_vcpus_and_large_lazy_memory() {
    if !require_kvm("vcpus_memory") {
        return;
    }
    let o = output(ember().arg("boot").arg("--kernel").arg(guest()).args([
        "--cpus",
        "4",
        "--mem",
        "64G",
        "--cmdline",
        "touch=32 exit=3",
    ]));
    assert_eq!(o.status.code(), Some(128 + 3), "{}", stderr(&o));
    assert!(stdout(&o).contains("touch: mib=32"), "{}", stdout(&o));
}

#[test]
fn console_none_prints_nothing() {
    if !require_kvm("console_none") {
        return;
    }
    let o = output(ember().arg("boot").arg("--kernel").arg(guest()).args([
        "--console",
        "none",
        "--cmdline",
        "print=quiet exit=0",
    ]));
    assert_eq!(o.status.code(), Some(0));
    assert!(o.stdout.is_empty(), "{}", stdout(&o));
}

/// Bad input gets one clear line and a non-zero status, never a panic.
#[test]
fn bad_input_is_a_clear_error() {
    if !require_kvm("bad_input") {
        return;
    }
    let dir = Scratch::new("bad");
    let text = dir.path("notes.txt");
    std::fs::write(&text, "not a kernel at all").unwrap();
    let truncated = dir.path("truncated.elf");
    let g = std::fs::read(guest()).unwrap();
    std::fs::write(&truncated, &g[..200]).unwrap();
    let big = dir.path("big.img");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let g = guest();
    let gs = g.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--kernel", "/nonexistent/vmlinux"],
            "cannot open kernel",
        ),
        (vec!["--kernel", text.to_str().unwrap()], "not a kernel"),
        (
            vec!["--kernel", truncated.to_str().unwrap()],
            "not a kernel",
        ),
        (
            vec![
                "--kernel",
                gs,
                "--initrd",
                big.to_str().unwrap(),
                "--mem",
                "32M",
            ],
            "does not fit",
        ),
        (
            vec!["--kernel", gs, "--initrd", "/nonexistent/initrd"],
            "cannot read initrd",
        ),
        (vec!["--kernel", gs, "--mem", "lots"], "not a memory size"),
        (vec!["--kernel", gs, "--mem", "1M"], "too small"),
        (vec!["--kernel", gs, "--cpus", "100000"], "vCPUs requested"),
        (vec!["--kernel", gs, "--cpus", "0"], "at least one vCPU"),
        (
            vec!["--kernel", gs, "--timeout", "nan"],
            "--timeout must be",
        ),
        (vec!["--kernel", gs, "--timeout", "1e30"], "too large"),
        (
            vec!["--kernel", gs, "--disk", "/nonexistent/disk.img"],
            "cannot attach disk",
        ),
        (
            vec!["--kernel", gs, "--pmem", "/nonexistent/pmem.img"],
            "cannot map pmem file",
        ),
    ];
    for (args, want) in cases {
        let o = output(ember().arg("boot").args(&args));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: expected `{want}` in: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.trim().lines().count(),
            1,
            "{args:?}: one line please: {err}"
        );
    }
}

/// A kernel whose first instruction is undefined, with no IDT to handle it:
/// #UD, then #DF, then a triple fault, which ember reports as a crash.
#[test]
fn triple_fault_is_reported_as_a_crash() {
    if !require_kvm("triple_fault") {
        return;
    }
    let dir = Scratch::new("triple");
    let kernel = dir.path("ud2.elf");
    // ud2; then spin (never reached).
    std::fs::write(
        &kernel,
        ember_testing::static_elf(0x10_0000, &[0x0f, 0x0b, 0xeb, 0xfe]),
    )
    .unwrap();
    let o = output(
        ember()
            .arg("boot")
            .arg("--kernel")
            .arg(&kernel)
            .args(["--timeout", "60"]),
    );
    assert_eq!(
        o.status.code(),
        Some(ember::exit::EXIT_GUEST_CRASHED),
        "{}",
        stderr(&o)
    );
}

/// The test guest's ring-3 virtio-blk driver against ember's virtio-blk (I/O
/// thread, ioeventfd, irqfd): data written is on the host file, and a
/// read-only disk refuses writes and stays untouched.
#[test]
fn virtio_blk_round_trip_and_read_only() {
    if !require_kvm("virtio_blk") {
        return;
    }
    let dir = Scratch::new("blk");
    let disk = dir.path("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let d = disk.to_str().unwrap();
    let (code, out, err, _) = boot(
        &guest(),
        "bs=64k qd=4 blkmib=4 blkverify exit=0",
        &["--disk", d, "--rng", "--balloon"],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("blkverify: ok blocks=64 bytes=4194304"),
        "{out}"
    );
    let written = std::fs::read(&disk).unwrap();
    assert!(
        written[..4 << 20].iter().any(|&b| b != 0),
        "the guest's writes must be in the host file"
    );
    assert!(
        written[4 << 20..].iter().all(|&b| b == 0),
        "nothing beyond the span"
    );

    let before = std::fs::read(&disk).unwrap();
    let ro = format!("{d},ro");
    let (code, out, _, _) = boot(
        &guest(),
        "bs=4k blkmib=1 blkverify exit=0",
        &["--disk", &ro],
    );
    assert_ne!(code, 0, "a write to a read-only disk must fail: {out}");
    assert_eq!(
        std::fs::read(&disk).unwrap(),
        before,
        "a read-only disk stays byte-identical"
    );
}

/// A DAX-style pmem region and the other virtio devices coexist with a disk.
#[test]
fn all_virtio_devices_attach() {
    if !require_kvm("virtio_all") {
        return;
    }
    let dir = Scratch::new("virtio-all");
    let disk = dir.path("disk.img");
    let pmem = dir.path("pmem.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    std::fs::File::create(&pmem)
        .unwrap()
        .set_len(3 << 20)
        .unwrap();
    let args = [
        "--disk",
        disk.to_str().unwrap(),
        "--pmem",
        pmem.to_str().unwrap(),
        "--rng",
        "--balloon",
    ];
    let (code, out, err, _) = boot(&guest(), "bs=4k blkmib=1 blkverify exit=0", &args);
    assert_eq!(code, 0, "{out}\n{err}");
    // Four windows, announced on the command line (and in the DSDT).
    assert_eq!(out.matches("virtio_mmio.device=4K@").count(), 4, "{out}");
    assert!(out.contains("blkverify: ok"), "{out}");
}

/// Two VMs on one read-write image: the second is refused with a one-line error while
/// the first runs; read-only users share; once the first is gone the image is free.
#[test]
fn a_disk_image_in_use_read_write_is_refused_to_a_second_vm() {
    if !require_kvm("image_lock") {
        return;
    }
    use std::io::{BufRead, BufReader};
    let dir = Scratch::new("lock");
    let disk = dir.path("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let d = disk.to_str().unwrap();
    let mut first = ember()
        .arg("boot")
        .arg("--kernel")
        .arg(guest())
        .args(["--disk", d, "--cmdline", "print=up spin=60000"])
        .args(["--timeout", "60"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(first.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("up") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the guest never printed"
        );
    }
    let second = |spec: &str| {
        output(ember().arg("boot").arg("--kernel").arg(guest()).args([
            "--disk",
            spec,
            "--cmdline",
            "exit=0",
        ]))
    };
    let o = second(d);
    // Read-only against a writer is refused too (it would see writes in flight).
    let ro = second(&format!("{d},ro"));
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("in use by another VM"), "{err}");
    assert_eq!(ro.status.code(), Some(1), "{}", stderr(&ro));
    // After the writer is gone, the image is free again.
    let o = second(d);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}
