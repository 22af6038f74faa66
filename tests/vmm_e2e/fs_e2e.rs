//! End-to-end on the test guest (which has no virtio-fs driver: the device
//! is there, unused): `--fs` goes with `--prefault`, `--mem-lock`,
//! `--hugepages` and the balloon; bad `--fs` input is a one-line error; and a
//! snapshot with a share attached restores with its restore to the first
//! guest instruction no slower than one without. What a Linux guest does
//! with a share is in tests/linux_pvm/linux_fs.rs.

use crate::common;

use common::{Scratch, ember, output, require_kvm, stderr};
use ember_vmm::events::EventFile;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

fn guest() -> PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

#[test]
fn bad_fs_options_are_one_line_errors() {
    let dir = Scratch::new("fs_bad");
    let share = dir.path("share");
    std::fs::create_dir_all(&share).unwrap();
    let file = dir.path("file");
    std::fs::write(&file, "").unwrap();
    let ok = format!("tag=a,dir={}", share.display());
    let long = format!("tag={},dir={}", "t".repeat(37), share.display());
    let not_dir = format!("tag=f,dir={}", file.display());
    for (flags, says) in [
        (
            vec!["--fs", "tag=a,dir=/nonexistent/share"],
            "cannot share /nonexistent/share",
        ),
        (vec!["--fs", &not_dir], "cannot share"),
        (vec!["--fs", &ok, "--fs", &ok], "fs tag \"a\" is used twice"),
        (vec!["--fs", &long], "longer than 36 bytes"),
        (vec!["--fs", "dir=/tmp"], "--fs needs tag=TAG"),
        (vec!["--fs", "tag=x,dir=/tmp,rw"], "unknown --fs option"),
    ] {
        let o = output(ember().args(["boot", "--kernel"]).arg(guest()).args(&flags));
        let err = stderr(&o);
        assert_ne!(o.status.code(), Some(0), "{flags:?}: {err}");
        // The reason on one line (clap adds its usage hint below its own).
        let first = err.lines().next().unwrap_or("");
        assert!(first.contains(says), "{flags:?}: {err}");
        let rest: Vec<_> = err
            .trim()
            .lines()
            .skip(1)
            .filter(|l| !l.is_empty())
            .collect();
        assert!(
            rest.is_empty() || rest == ["For more information, try '--help'."],
            "{flags:?}: {err}"
        );
    }
}

#[test]
fn a_share_goes_with_prefault_hugepages_and_the_balloon() {
    if !require_kvm("fs with prefault") {
        return;
    }
    let dir = Scratch::new("fs_memory");
    let share = dir.path("share");
    std::fs::create_dir_all(&share).unwrap();
    let fs = format!("tag=s,dir={}", share.display());
    for extra in [
        &["--prefault", "sync", "--mem-lock"][..],
        &["--prefault", "async"],
        &["--hugepages", "--balloon"],
    ] {
        let o = output(
            ember()
                .args(["boot", "--kernel"])
                .arg(guest())
                .args(["--mem", "96M", "--cmdline", "print=hi", "--fs", &fs])
                .args(extra),
        );
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", stderr(&o));
    }
}

fn first_entry(events: &std::path::Path) -> f64 {
    let ev: EventFile = serde_json::from_slice(&std::fs::read(events).unwrap()).unwrap();
    ev.events
        .iter()
        .find(|e| e.kind == "first_guest_entry")
        .map(|e| e.t_us)
        .expect("first_guest_entry")
}

/// The test guest snapshotted with (and without) a share; restores of each,
/// interleaved: the share adds nothing measurable before the first guest
/// instruction.
#[test]
fn a_snapshot_with_a_share_restores_as_fast_as_one_without() {
    if !require_kvm("fs snapshot") {
        return;
    }
    let dir = Scratch::new("fs_snapshot");
    let share = dir.path("share");
    std::fs::create_dir_all(&share).unwrap();
    let fs = format!("tag=s,dir={}", share.display());
    let mut snaps = Vec::new();
    for (name, extra) in [("plain", vec![]), ("share", vec!["--fs", &fs])] {
        let sock = dir.path(&format!("{name}.sock"));
        let snap = dir.path(name);
        let mut vm = ember()
            .args(["boot", "--kernel"])
            .arg(guest())
            .args(["--mem", "256M", "--cmdline", "print=up spin=600000"])
            .args(&extra)
            .arg("--api-socket")
            .arg(&sock)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !sock.exists() {
            assert!(start.elapsed() < Duration::from_secs(30), "no socket");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(200));
        let o = output(
            ember()
                .args(["snapshot", "--api-socket"])
                .arg(&sock)
                .arg("--to")
                .arg(&snap),
        );
        assert!(o.status.success(), "snapshot: {}", stderr(&o));
        vm.wait().unwrap();
        snaps.push(snap);
    }
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..10 {
        for (i, snap) in snaps.iter().enumerate() {
            let events = dir.path(&format!("ev{round}-{i}.json"));
            let o = output(
                ember()
                    .args(["boot", "--timeout", "0.2", "--restore"])
                    .arg(snap)
                    .arg("--events")
                    .arg(&events),
            );
            assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
            times[i].push(first_entry(&events));
        }
    }
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    // Medians for the record, minimums for the check: the least loaded run
    // of each (the host's other work moves single runs by tens of ms).
    let (plain, shared) = (times[0][5], times[1][5]);
    eprintln!(
        "fs_snapshot: restore -> first guest entry, median of 10: {plain:.0} us without a share, {shared:.0} us with"
    );
    let (plain_min, shared_min) = (times[0][0], times[1][0]);
    assert!(
        shared_min < plain_min * 2.0 + 5000.0,
        "a share slows the restore: {shared_min} us against {plain_min} us"
    );
}
