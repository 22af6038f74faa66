//! End-to-end: the control socket, snapshots and restores of the test guest
//! in fresh ember processes, and every damaged snapshot refused.

use crate::common;
use common::booted::Booted;

use common::{Scratch, ember, output, require_kvm, stderr, stdout};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// ember's exit status when the guest writes `n` to the debug-exit port.
fn guest_status(n: u8) -> i32 {
    ember::exit::guest_end_status(ember_vmm::vstate::end::GuestEnd::ExitCode(n))
}

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// A running ember with a control socket.
fn start(args: &[&str], sock: &Path) -> Booted {
    Booted::with_socket(ember().arg("boot").args(args), sock)
}

/// A guest result line's fields without the timings, which differ run to run.
fn untimed(console: &str, prefix: &str) -> Vec<Vec<(String, String)>> {
    ember_testing::guest_results(console, prefix)
        .into_iter()
        .map(|l| l.into_iter().filter(|(k, _)| !k.contains("ns")).collect())
        .collect()
}

/// The guest's blkverify pattern: word(o) ^ word(0) = o × K over the span.
fn check_disk_pattern(disk: &Path, span: usize) {
    let bytes = std::fs::read(disk).unwrap();
    let word = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
    let w0 = word(0);
    for o in (0..span).step_by(8) {
        assert_eq!(
            word(o) ^ w0,
            (o as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            "{}: word at {o:#x}",
            disk.display()
        );
    }
}

const DISK_MIB: usize = 64;
/// Touches memory, prints, then verifies the whole disk with 7 requests in
/// flight (the snapshot lands in there), then touches memory again. The
/// requests are large (1 MiB, milliseconds each) because a pause takes time
/// too: 4 KiB requests (tens of µs) had all completed by the time the
/// snapshot looked in 4 of 5 tries here and 5 of 5 on CI, and 256 KiB ones
/// in 10 of 10 once, with seccomp's threads in the pause's path.
const WORK: &str = "print=start touch=24 bs=1048576 qd=7 blkverify touch=8 print=all_done exit=9";

#[test]
fn a_guest_snapshotted_mid_work_finishes_in_a_fresh_process_like_an_uninterrupted_run() {
    if !require_kvm("snapshot_mid_work") {
        return;
    }
    let dir = Scratch::new("snap-work");
    let g = guest();
    let g = g.to_str().unwrap();

    // The uninterrupted run.
    let disk_a = dir.path("a.img");
    std::fs::write(&disk_a, vec![0u8; DISK_MIB << 20]).unwrap();
    let disk_arg = format!("{},direct", disk_a.display());
    let o = output(ember().args([
        "boot",
        "--kernel",
        g,
        "--mem",
        "128M",
        "--cmdline",
        WORK,
        "--disk",
        &disk_arg,
    ]));
    assert_eq!(
        o.status.code(),
        Some(guest_status(9)),
        "stderr: {}",
        stderr(&o)
    );
    let straight = stdout(&o);
    check_disk_pattern(&disk_a, DISK_MIB << 20);

    // The same, snapshotted while blkverify runs; in-flight requests are
    // likely but not certain at any one instant, so try a few times.
    let mut attempt = 0;
    let (snap, disk_b, before) = loop {
        attempt += 1;
        let disk_b = dir.path(&format!("b{attempt}.img"));
        std::fs::write(&disk_b, vec![0u8; DISK_MIB << 20]).unwrap();
        let sock = dir.path(&format!("api{attempt}.sock"));
        let vm = start(
            &[
                "--kernel",
                g,
                "--mem",
                "128M",
                "--cmdline",
                WORK,
                "--disk",
                &format!("{},direct", disk_b.display()),
            ],
            &sock,
        );
        // blkverify starts right after the first touch line.
        vm.wait_until("the touch line", |c| c.contains("touch: "));
        let snap = dir.path(&format!("snap{attempt}"));
        let o = output(
            ember()
                .args(["snapshot", "--api-socket"])
                .arg(&sock)
                .arg("--to")
                .arg(&snap),
        );
        assert!(o.status.success(), "snapshot: {}", stderr(&o));
        let reply: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        eprintln!("snapshot attempt {attempt}: {reply}");
        let (code, before, err) = vm.finish();
        assert_eq!(code, 0, "a snapshot without --resume ends the VM: {err}");
        assert!(!sock.exists(), "the socket is removed at exit");
        assert!(
            !before.contains("blkverify:"),
            "the snapshot came after the work:\n{before}"
        );
        if reply["in_flight"].as_u64().unwrap() > 0 || attempt == 20 {
            assert!(
                reply["in_flight"].as_u64().unwrap() > 0,
                "no request was in flight in 20 snapshots"
            );
            break (snap, disk_b, before);
        }
    };

    // Resumed in a fresh process: it finishes the work.
    let o = output(ember().arg("boot").arg("--restore").arg(&snap));
    assert_eq!(
        o.status.code(),
        Some(guest_status(9)),
        "stderr: {}",
        stderr(&o)
    );
    let resumed = format!("{before}{}", stdout(&o));
    for prefix in ["touch", "blkverify"] {
        assert_eq!(
            untimed(&resumed, prefix),
            untimed(&straight, prefix),
            "{prefix} results differ:\nresumed:\n{resumed}\nstraight:\n{straight}"
        );
    }
    assert_eq!(untimed(&resumed, "blkverify").len(), 1, "{resumed}");
    assert!(resumed.ends_with("all done\n"), "{resumed}");
    check_disk_pattern(&disk_b, DISK_MIB << 20);
}

/// Runs `ember boot --restore dir`; (status, stdout, stderr).
fn restore(dir: &Path) -> (i32, String, String) {
    let o = output(
        ember()
            .args(["boot", "--timeout", "30", "--restore"])
            .arg(dir),
    );
    (o.status.code().unwrap_or(-1), stdout(&o), stderr(&o))
}

/// A copy of snapshot `src` in `dst` (memory hard-linked: restores only read it).
fn copy_snapshot(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    std::fs::copy(src.join("state"), dst.join("state")).unwrap();
    std::fs::hard_link(src.join("memory"), dst.join("memory")).unwrap();
}

#[test]
fn damaged_snapshots_are_refused_with_one_line_and_nothing_runs() {
    if !require_kvm("snapshot_damage") {
        return;
    }
    let dir = Scratch::new("snap-damage");
    let disk = dir.path("d.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let sock = dir.path("api.sock");
    let g = guest();
    let vm = start(
        &[
            "--kernel",
            g.to_str().unwrap(),
            "--mem",
            "32M",
            "--cmdline",
            "print=up spin=2000 print=resumed exit=4",
            "--disk",
            disk.to_str().unwrap(),
        ],
        &sock,
    );
    vm.wait_until("the guest", |c| c.contains("up\n"));
    let good = dir.path("good");
    assert_eq!(vm.call(json!({"op": "pause"}))["ok"], true);
    let r = vm.call(json!({"op": "snapshot", "dir": good}));
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(vm.call(json!({"op": "shutdown"}))["ok"], true);
    assert_eq!(vm.finish().0, 0);

    let state = std::fs::read(good.join("state")).unwrap();
    type Damage<'a> = Box<dyn Fn(&Path) + 'a>;
    let damaged: Vec<(&str, Damage, &str)> = vec![
        (
            "truncated",
            Box::new(|d: &Path| {
                std::fs::write(d.join("state"), &state[..state.len() / 2]).unwrap()
            }),
            "truncated",
        ),
        (
            "altered",
            Box::new(|d: &Path| {
                let mut s = state.clone();
                let i = s.len() - 100;
                s[i] ^= 1;
                std::fs::write(d.join("state"), s).unwrap()
            }),
            "checksum",
        ),
        (
            "version",
            Box::new(|d: &Path| {
                let mut s = state.clone();
                s[8] = s[8].wrapping_add(1);
                std::fs::write(d.join("state"), s).unwrap()
            }),
            "version",
        ),
        (
            "memory size",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("memory")).unwrap();
                let f = std::fs::File::create(d.join("memory")).unwrap();
                f.set_len(16 << 20).unwrap();
            }),
            "memory file",
        ),
        (
            "other cpu",
            Box::new(|d: &Path| {
                let mut s = ember_vmm::snapshot::decode(&state, d).unwrap();
                s.host_cpuid[0].ebx ^= 1;
                std::fs::write(d.join("state"), ember_vmm::snapshot::encode(&s)).unwrap();
            }),
            "other features",
        ),
        (
            "missing state",
            Box::new(|d: &Path| std::fs::remove_file(d.join("state")).unwrap()),
            "state",
        ),
    ];
    for (i, (what, damage, says)) in damaged.iter().enumerate() {
        let d = dir.path(&format!("bad{i}"));
        copy_snapshot(&good, &d);
        damage(&d);
        let (code, out, err) = restore(&d);
        assert_eq!(code, 1, "{what}: {err}");
        assert!(out.is_empty(), "{what}: the guest ran: {out}");
        assert_eq!(err.lines().count(), 1, "{what}: one line: {err}");
        assert!(err.contains(says), "{what}: {err}");
    }
    // The disk changed after the snapshot.
    let d = dir.path("bad-disk");
    copy_snapshot(&good, &d);
    std::fs::write(&disk, vec![1u8; 1 << 20]).unwrap();
    let (code, out, err) = restore(&d);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(err.contains("was modified since the snapshot"), "{err}");
    // The checks can pass: the undamaged snapshot (with its disk back as it
    // was, identity included) resumes.
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let rec = ember_vmm::snapshot::decode(&state, &good).unwrap().devices[0]
        .file
        .unwrap();
    let t = std::time::UNIX_EPOCH + Duration::from_nanos(rec.mtime_ns as u64);
    std::fs::File::options()
        .write(true)
        .open(&disk)
        .unwrap()
        .set_modified(t)
        .unwrap();
    // A vsock socket for a snapshot that has no vsock device.
    let uds = dir.path("v.sock");
    let o = output(
        ember()
            .args(["boot", "--timeout", "30", "--restore"])
            .arg(&good)
            .arg("--vsock")
            .arg(format!("cid=3,uds={}", uds.display())),
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(o.stdout.is_empty(), "the guest ran");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("no vsock device"), "{err}");
    assert!(!uds.exists(), "no socket left behind");
    let (code, out, err) = restore(&good);
    assert_eq!(code, guest_status(4), "{err}");
    assert_eq!(out, "resumed\n");
}

#[test]
fn the_control_socket_is_private_refuses_bad_requests_and_goes_away() {
    if !require_kvm("control_socket") {
        return;
    }
    let dir = Scratch::new("api");
    let sock = dir.path("api.sock");
    let g = guest();
    let args = [
        "--kernel",
        g.to_str().unwrap(),
        "--mem",
        "32M",
        "--cmdline",
        "print=up spin=3000 print=survived exit=6",
    ];
    let vm = start(&args, &sock);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    // A second VM may not take a live socket.
    let o = output(
        ember()
            .arg("boot")
            .args(args)
            .arg("--api-socket")
            .arg(&sock),
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("in use"), "{}", stderr(&o));

    let refused = |reply: Value, says: &str| {
        assert_eq!(reply["ok"], false, "{reply}");
        let e = reply["error"].as_str().unwrap();
        assert!(e.contains(says), "{e} (wanted {says})");
    };
    // Raw lines: not JSON, unknown op, unknown field, wrong type.
    for (line, says) in [
        ("hello", "malformed"),
        (r#"{"op":"explode"}"#, "malformed"),
        (r#"{"op":"pause","now":true}"#, "malformed"),
        (r#"{"op":"balloon","target_mib":"lots"}"#, "malformed"),
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        use std::io::Write;
        writeln!(s, "{line}").unwrap();
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).unwrap();
        refused(serde_json::from_str(&reply).unwrap(), says);
    }
    refused(vm.call(json!({"op": "resume"})), "already running");
    refused(
        vm.call(json!({"op": "snapshot", "dir": dir.path("s")})),
        "pause the VM",
    );
    refused(
        vm.call(json!({"op": "balloon", "target_mib": 4})),
        "no balloon",
    );
    assert_eq!(vm.call(json!({"op": "status"}))["state"], "running");
    assert_eq!(vm.call(json!({"op": "pause"}))["ok"], true);
    refused(vm.call(json!({"op": "pause"})), "already paused");
    assert_eq!(vm.call(json!({"op": "status"}))["state"], "paused");
    refused(
        vm.call(json!({"op": "snapshot", "dir": "relative"})),
        "absolute",
    );
    // Paused means paused: no console output arrives.
    let frozen = vm.console();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(vm.console(), frozen);
    assert_eq!(vm.call(json!({"op": "resume"}))["ok"], true);
    // None of it disturbed the guest.
    let (code, out, err) = vm.finish();
    assert_eq!(code, guest_status(6), "{err}");
    assert!(out.ends_with("up\nsurvived\n"), "{out}");
    assert!(!sock.exists(), "removed at a normal exit");

    // SIGTERM and SIGINT remove it too.
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let vm = start(&args, &sock);
        // SAFETY: signalling our own child.
        unsafe { libc::kill(vm.child.id() as i32, sig) };
        let _ = vm.finish();
        assert!(!sock.exists(), "removed on signal {sig}");
    }
    // `ember ctl` speaks the same protocol; shutdown ends the VM with 0.
    let vm = start(&args, &sock);
    let ctl = |op: &str| output(ember().args(["ctl", "--api-socket"]).arg(&sock).arg(op));
    let o = ctl("status");
    assert!(o.status.success());
    assert!(
        stdout(&o).contains("\"state\":\"running\""),
        "{}",
        stdout(&o)
    );
    assert_eq!(ctl("resume").status.code(), Some(1));
    assert!(ctl("shutdown").status.success());
    assert_eq!(vm.finish().0, 0);
    assert!(!sock.exists());
}

/// The VM generation ID in a snapshot's memory file (RAM starts at guest
/// address 0, so its guest address is its file offset).
fn generation_id(snap: &Path) -> [u8; 16] {
    use std::os::unix::fs::FileExt;
    let mut id = [0u8; 16];
    std::fs::File::open(snap.join("memory"))
        .unwrap()
        .read_exact_at(&mut id, ember_vmm::arch::x86_64::layout::VMGENID_START)
        .unwrap();
    id
}

/// Boots (or restores, with `--restore DIR` in `args`) the test guest with
/// a control socket, snapshots it into `to` and returns the snapshot's
/// generation ID.
fn snapshot_of(args: &[&str], sock: &Path, to: &Path) -> [u8; 16] {
    let vm = start(args, sock);
    if !args.contains(&"--restore") {
        vm.wait_until("the up line", |c| c.contains("up"));
    }
    let o = output(
        ember()
            .args(["snapshot", "--api-socket"])
            .arg(sock)
            .arg("--to")
            .arg(to),
    );
    assert!(o.status.success(), "snapshot: {}", stderr(&o));
    let (code, _, err) = vm.finish();
    assert_eq!(code, 0, "the snapshot ends the VM: {err}");
    generation_id(to)
}

/// Each restore of one snapshot writes a new VM generation ID where the
/// guest's ACPI tables say it is (a snapshot of each restored VM shows it);
/// a guest without ACPI has no such device and nothing is written for it.
#[test]
fn each_restore_gets_a_new_vm_generation_id() {
    if !require_kvm("vmgenid") {
        return;
    }
    let dir = Scratch::new("vmgenid");
    let g = guest();
    let g = g.to_str().unwrap();
    for acpi in [true, false] {
        let tag = if acpi { "acpi" } else { "noacpi" };
        let mut args = vec![
            "--kernel",
            g,
            "--mem",
            "32M",
            "--cmdline",
            "print=up spin=60000 exit=6",
        ];
        if !acpi {
            args.push("--no-acpi");
        }
        let base = dir.path(&format!("{tag}-0"));
        let boot_id = snapshot_of(&args, &dir.path(&format!("{tag}.sock")), &base);
        let mut ids = vec![boot_id];
        for n in 1..=2 {
            let snap = dir.path(&format!("{tag}-{n}"));
            let sock = dir.path(&format!("{tag}{n}.sock"));
            let restore = ["--restore", base.to_str().unwrap()];
            ids.push(snapshot_of(&restore, &sock, &snap));
        }
        if acpi {
            for (i, id) in ids.iter().enumerate() {
                assert_ne!(*id, [0; 16], "generation {i} has no ID");
                assert!(
                    !ids[..i].contains(id),
                    "generation {i} repeats an ID: {ids:x?}"
                );
            }
        } else {
            assert_eq!(ids, [[0; 16]; 3], "written without a vmgenid device");
        }
    }
}
