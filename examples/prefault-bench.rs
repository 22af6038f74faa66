//! `--prefault` benchmark: exec → the test guest's first line, and the time until
//! all guest memory is committed and visible, for each memory size with no
//! prefault, `sync` and `async`; QEMU `-mem-prealloc` with prealloc threads as the
//! anchor; the host's own MADV_POPULATE_WRITE rate in a plain process as the
//! limit. Interleaved rounds, medians and min–max, ratios.
//!
//! ```text
//! cargo build --release && cargo run --release --example prefault-bench -- \
//!     [--sizes 512M,4G,8G] [--rounds 3] [--threads 2] [--ember PATH] \
//!     [--subjects host,off,sync,async,async-boot,qemu,ch] [--ch PATH|EMBER_CH_BIN]
//! ```
//! `async-boot` is async's first line only, without waiting for the whole
//! commit (for sizes the host cannot commit in full). Cloud Hypervisor (`--memory size=…,prefault=on`) is the second anchor when
//! its binary is given. Each subject starts only once the previous one's
//! guest memory is freed (see `reap_all`).
//! (`--populate SIZE THREADS` is the plain-process child.)

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use ember_vmm::events::EventFile;
use ember_vmm::prefault::EVENT_COMMITTED;
use ember_vmm::vstate::memory::parse_size;

/// Ms from exec to the first stdout line containing `marker`, and the child's
/// stdout afterwards is drained until it exits.
fn first_line_ms(cmd: &mut Command, marker: &str) -> f64 {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let out = child.stdout.take().unwrap();
    let mut ms = f64::NAN;
    for line in BufReader::new(out).lines() {
        let Ok(line) = line else { break };
        if ms.is_nan() && line.contains(marker) {
            ms = start.elapsed().as_secs_f64() * 1e3;
        }
    }
    let _ = child.wait();
    ms
}

/// The plain process: map `size` bytes as ember does (anonymous, NORESERVE,
/// THP-advised) and populate them with `threads` threads; prints ms.
/// Ms from exec to the first stdout line containing `marker` and to the first
/// stderr line containing `done` (not waited for when empty); then `stop`
/// ends the child (killed if it has not ended 30 s later).
fn two_lines_ms(cmd: &mut Command, marker: &str, done: &str, stop: impl FnOnce()) -> (f64, f64) {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // Each pipe is read to its end (ember must never write into a closed
    // pipe); the time of the wanted line is sent as soon as it is seen.
    let watch = |pipe: Box<dyn std::io::Read + Send>, want: String| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if line.contains(&want)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(start.elapsed().as_secs_f64() * 1e3);
                }
            }
        });
        rx
    };
    let out = watch(Box::new(child.stdout.take().unwrap()), marker.into());
    let err = watch(Box::new(child.stderr.take().unwrap()), done.into());
    // (A closed channel: the child ended without the line.)
    let out = out.recv().unwrap_or(f64::NAN);
    let err = if done.is_empty() {
        f64::NAN
    } else {
        err.recv().unwrap_or(f64::NAN)
    };
    stop();
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    (out, err)
}

fn populate_child(size: u64, threads: u64) {
    // SAFETY: a fresh private anonymous mapping, unmapped at exit.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the mapping above.
    unsafe { libc::madvise(base, size as usize, libc::MADV_HUGEPAGE) };
    let start = Instant::now();
    let share = (size / threads).next_multiple_of(2 << 20);
    let base = base as u64;
    std::thread::scope(|s| {
        for i in 0..threads {
            let from = i * share;
            let len = share.min(size.saturating_sub(from));
            if len == 0 {
                continue;
            }
            s.spawn(move || {
                // SAFETY: a slice of the mapping above.
                let rc = unsafe {
                    libc::madvise(
                        (base + from) as *mut _,
                        len as usize,
                        libc::MADV_POPULATE_WRITE,
                    )
                };
                assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
            });
        }
    });
    println!("{:.1}", start.elapsed().as_secs_f64() * 1e3);
}

fn median_range(v: &[f64]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    let m = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    (m, s[0], s[n - 1])
}

fn fmt(v: &[f64]) -> String {
    let (m, lo, hi) = median_range(v);
    if m.is_nan() {
        return "—".into();
    }
    if m >= 1000.0 {
        format!("{:.2} s ({:.2}–{:.2})", m / 1e3, lo / 1e3, hi / 1e3)
    } else {
        format!("{m:.0} ms ({lo:.0}–{hi:.0})")
    }
}

#[derive(Default)]
struct Row {
    host: Vec<f64>,
    qemu: Vec<f64>,
    ch: Vec<f64>,
    off: Vec<f64>,
    off_entry: Vec<f64>,
    sync: Vec<f64>,
    sync_committed: Vec<f64>,
    async_: Vec<f64>,
    async_entry: Vec<f64>,
    async_committed: Vec<f64>,
}

/// Waits until every child of this process has exited, keepers included:
/// ember leaves the teardown of a VM (unmapping all of guest memory) to a
/// keeper process that outlives it (`vstate::teardown`); this process is the
/// keepers' subreaper, so the next subject never starts while the previous
/// one's gigabytes are still being freed.
fn reap_all() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on any child; `status` is a valid out-pointer.
        let rc = unsafe { libc::waitpid(-1, &mut status, 0) };
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return; // ECHILD: none left
        }
    }
}

/// Ms from exec to the first stdout line containing `marker` (NaN if none
/// within `timeout_s`); the child is killed then (for VMMs whose guest cannot
/// end itself there).
fn first_line_then_kill(cmd: &mut Command, marker: &str, timeout_s: u64) -> f64 {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let out = child.stdout.take().unwrap();
    let want = marker.to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if line.contains(&want) {
                let _ = tx.send(start.elapsed().as_secs_f64() * 1e3);
                return;
            }
        }
    });
    let ms = rx
        .recv_timeout(std::time::Duration::from_secs(timeout_s))
        .unwrap_or(f64::NAN);
    let _ = child.kill();
    let _ = child.wait();
    ms
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--populate") {
        let size = parse_size(&args[2]).unwrap();
        populate_child(size, args[3].parse().unwrap());
        return;
    }
    let mut sizes = vec!["512M".to_string(), "4G".into(), "8G".into()];
    let mut rounds = 3;
    let mut threads = 2u64;
    let mut subjects: Vec<String> = ["host", "off", "sync", "async", "qemu", "ch"]
        .map(String::from)
        .to_vec();
    let mut ch_bin = std::env::var_os("EMBER_CH_BIN").map(std::path::PathBuf::from);
    // target/release/examples/prefault-bench -> target/release/ember
    let mut ember_bin = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("ember"))
        .unwrap();
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--sizes" => sizes = args[i + 1].split(',').map(String::from).collect(),
            "--rounds" => rounds = args[i + 1].parse().unwrap(),
            "--threads" => threads = args[i + 1].parse().unwrap(),
            "--ember" => ember_bin = args[i + 1].clone().into(),
            "--ch" => ch_bin = Some(args[i + 1].clone().into()),
            "--subjects" => subjects = args[i + 1].split(',').map(String::from).collect(),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    let want = |s: &str| subjects.iter().any(|x| x == s);
    if want("ch") && ch_bin.is_none() {
        eprintln!(
            "NOT MEASURED: Cloud Hypervisor (give its binary with --ch PATH or EMBER_CH_BIN)"
        );
    }
    // Keepers (ember's teardown processes) are reparented here, to be waited for.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let guest = ember_testing::test_guest().expect("build the test guest");
    let me = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!("ember-prefault-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let events = dir.join("events.json");
    let sock = dir.join("api.sock");
    let mut rows: Vec<Row> = sizes.iter().map(|_| Row::default()).collect();
    let banner = "ember-test-guest:";
    let at = |ev: &EventFile, kind: &str| {
        ev.events
            .iter()
            .find(|e| e.kind == kind)
            .map_or(f64::NAN, |e| e.t_us / 1e3)
    };
    let read_events = || -> EventFile {
        std::fs::read(&events)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    };
    for round in 1..=rounds {
        for (size, row) in sizes.iter().zip(rows.iter_mut()) {
            let bytes = parse_size(size).unwrap();
            let mut line = format!("round {round} {size}:");
            if want("host") {
                // The limit: the host populating the same size in a plain process.
                let out = Command::new(&me)
                    .args(["--populate", size, &threads.to_string()])
                    .output()
                    .unwrap();
                let host: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
                row.host.push(host);
                line += &format!(" host populate {host:.0} ms;");
            }
            let run = |prefault: Option<&str>, cmdline: &str| -> (f64, EventFile) {
                let _ = std::fs::remove_file(&events);
                let mut cmd = Command::new(&ember_bin);
                cmd.args(["boot", "--kernel"])
                    .arg(&guest)
                    .args(["--mem", size, "--cmdline", cmdline, "--events"])
                    .arg(&events);
                if let Some(p) = prefault {
                    cmd.args(["--prefault", p]);
                }
                let ms = first_line_ms(&mut cmd, banner);
                reap_all();
                (ms, read_events())
            };
            if want("off") {
                let (off, ev) = run(None, "print=ready");
                row.off.push(off);
                row.off_entry.push(at(&ev, "first_guest_entry"));
                line += &format!(
                    " off {off:.0} (entry {:.0}) ms;",
                    at(&ev, "first_guest_entry")
                );
            }
            if want("sync") {
                let t = format!("sync,threads={threads}");
                let (sync, ev) = run(Some(&t), "print=ready");
                row.sync.push(sync);
                row.sync_committed.push(at(&ev, EVENT_COMMITTED));
                line += &format!(" sync {sync:.0} ms;");
            }
            // `async` runs the guest until `until` (a line of ember's stderr;
            // empty: the guest's first line), then shuts the VM down through its
            // socket, so the timeline is written; (ms to the first line, ms to
            // `until`, first guest entry in ms).
            let run_async = |secs: u32, until: &str| -> (f64, f64, f64) {
                let _ = std::fs::remove_file(&events);
                let _ = std::fs::remove_file(&sock);
                let mut cmd = Command::new(&ember_bin);
                cmd.args(["boot", "--kernel"])
                    .arg(&guest)
                    .args(["--mem", size, "--timeout", &secs.to_string()])
                    .args(["--cmdline", &format!("print=ready spin={}", secs * 1000)])
                    .args(["--prefault", &format!("async,threads={threads}")])
                    .arg("--api-socket")
                    .arg(&sock)
                    .arg("--events")
                    .arg(&events);
                let (first, until_ms) = two_lines_ms(&mut cmd, banner, until, || {
                    let _ = Command::new(&ember_bin)
                        .args(["ctl", "--api-socket"])
                        .arg(&sock)
                        .arg("shutdown")
                        .output();
                });
                reap_all();
                (first, until_ms, at(&read_events(), "first_guest_entry"))
            };
            if want("async-boot") {
                // async's boot alone: the VM is shut down at the first line, so
                // sizes the host could not commit in full (16G here) can be
                // measured too.
                let (asy, _, entry) = run_async(600, "");
                row.async_.push(asy);
                row.async_entry.push(entry);
                line += &format!(" async {asy:.0} (entry {entry:.0}) ms;");
            }
            if want("async") {
                // The guest spins until ember says the background commit is done
                // (the test guest has no balloon driver: it owns all its memory
                // from the start, so committed is also visible).
                let (asy, committed, entry) = run_async(1800, "guest memory committed");
                row.async_.push(asy);
                row.async_entry.push(entry);
                row.async_committed.push(committed);
                line +=
                    &format!(" async {asy:.0} (entry {entry:.0}, committed {committed:.0}) ms;");
            }
            let mib = bytes >> 20;
            if want("qemu") {
                // The anchor: QEMU preallocating with as many threads.
                let qemu = first_line_ms(
                    Command::new("qemu-system-x86_64")
                        .args(["-M", "microvm,x-option-roms=off,rtc=off", "-accel", "kvm"])
                        .args(["-cpu", "qemu64", "-m", &format!("{mib}M"), "-smp", "1"])
                        .args(["-object"])
                        .arg(format!(
                            "memory-backend-ram,id=ram,size={mib}M,prealloc=on,prealloc-threads={threads}"
                        ))
                        .args(["-machine", "memory-backend=ram"])
                        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
                        .args(["-serial", "stdio", "-device", "isa-debug-exit,iobase=0x501,iosize=1"])
                        .arg("-kernel")
                        .arg(&guest)
                        .args(["-append", "print=ready"]),
                    banner,
                );
                reap_all();
                row.qemu.push(qemu);
                line += &format!(" qemu prealloc {qemu:.0} ms;");
            }
            if let (true, Some(ch)) = (want("ch"), &ch_bin) {
                // The other anchor: Cloud Hypervisor's prefault=on (its own
                // populate before the guest starts). The test guest cannot power
                // it off (no isa-debug-exit): killed after the first line.
                let ms = first_line_then_kill(
                    Command::new(ch)
                        .arg("--kernel")
                        .arg(&guest)
                        .args(["--cmdline", "print=ready spin=600000"])
                        .args(["--cpus", "boot=1"])
                        .args(["--memory", &format!("size={mib}M,prefault=on")])
                        .args(["--serial", "tty", "--console", "off"]),
                    banner,
                    900,
                );
                reap_all();
                row.ch.push(ms);
                line += &format!(" ch prefault {ms:.0} ms;");
            }
            eprintln!("{line}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "exec → test guest's first line, median (min–max) of {rounds} interleaved rounds, {threads} populate threads\n"
    );
    println!(
        "| memory | no prefault | sync | async | QEMU -mem-prealloc (prealloc-threads={threads}) | Cloud Hypervisor prefault=on |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (size, r) in sizes.iter().zip(&rows) {
        println!(
            "| {size} | {} | {} | {} | {} | {} |",
            fmt(&r.off),
            fmt(&r.sync),
            fmt(&r.async_),
            fmt(&r.qemu),
            fmt(&r.ch)
        );
    }
    println!("\nexec → first guest instruction (ember's own timeline)\n");
    println!("| memory | no prefault | async |");
    println!("| --- | --- | --- |");
    for (size, r) in sizes.iter().zip(&rows) {
        println!(
            "| {size} | {} | {} |",
            fmt(&r.off_entry),
            fmt(&r.async_entry)
        );
    }
    println!(
        "\ntime until all memory is committed (ms from exec), and the host's own populate time for the same size\n"
    );
    println!(
        "| memory | host MADV_POPULATE_WRITE, plain process | sync: committed | async: committed and visible | async commit / host |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for (size, r) in sizes.iter().zip(&rows) {
        let ratio = median_range(&r.async_committed).0 / median_range(&r.host).0;
        println!(
            "| {size} | {} | {} | {} | {ratio:.2}× |",
            fmt(&r.host),
            fmt(&r.sync_committed),
            fmt(&r.async_committed),
        );
    }
    if rows.len() >= 2 {
        let ratio = |f: fn(&Row) -> &Vec<f64>| {
            median_range(f(&rows[rows.len() - 1])).0 / median_range(f(&rows[0])).0
        };
        println!(
            "\nfirst line, {} vs {}: async {:.2}× (target ≤ 1.05×), no prefault {:.2}×, sync {:.2}×",
            sizes[sizes.len() - 1],
            sizes[0],
            ratio(|r| &r.async_),
            ratio(|r| &r.off),
            ratio(|r| &r.sync),
        );
    }
}
