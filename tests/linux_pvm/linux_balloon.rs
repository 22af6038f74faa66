//! End-to-end: unmodified Linux's virtio_balloon driver (built into the PVM test
//! kernel, scripts/pvm-kernel.config) as the fence of `--prefault async`.
//!
//! The background commit is paced (`rate=`) so that it is still running when
//! the driver comes up (~10 s into a boot on a quiet host, ~30 s on a loaded
//! one): the driver must inflate to the fence's target, then deflate chunk by
//! chunk as memory is committed, until the guest sees all of it. /init prints
//! a marker and sleeps; the test waits (through the control socket and
//! ember's stderr) until the commit (64 s from start) is done and the balloon
//! empty, then shuts the VM down, however fast or slow the kernel booted.

use crate::common;

use common::{PVM_CMDLINE, Scratch, ember, output, pvm_kernel_dir, require_kvm, stderr, stdout};
use ember_vmm::events::EventFile;
use ember_vmm::prefault::{EVENT_COMMITTED, EVENT_VISIBLE};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const MARKER: &str = "EMBER-BALLOON-INIT";

/// An /init that prints `msg`, sleeps `secs` seconds, and reboots.
fn sleeping_init(msg: &str, secs: u32) -> Vec<u8> {
    let mut code = Vec::new();
    code.extend([0xb8, 1, 0, 0, 0]); // mov eax, 1 (write)
    code.extend([0xbf, 1, 0, 0, 0]); // mov edi, 1 (stdout)
    let msg_lea = code.len();
    code.extend([0x48, 0x8d, 0x35, 0, 0, 0, 0]); // lea rsi, [rip + msg]
    code.push(0xba); // mov edx, len
    code.extend((msg.len() as u32).to_le_bytes());
    code.extend([0x0f, 0x05]); // syscall
    code.extend([0xb8, 35, 0, 0, 0]); // mov eax, 35 (nanosleep)
    let ts_lea = code.len();
    code.extend([0x48, 0x8d, 0x3d, 0, 0, 0, 0]); // lea rdi, [rip + timespec]
    code.extend([0x31, 0xf6]); // xor esi, esi
    code.extend([0x0f, 0x05]); // syscall
    code.extend([0xb8, 169, 0, 0, 0]); // mov eax, 169 (reboot)
    code.extend([0xbf, 0xad, 0xde, 0xe1, 0xfe]); // LINUX_REBOOT_MAGIC1
    code.extend([0xbe, 0x69, 0x19, 0x12, 0x28]); // LINUX_REBOOT_MAGIC2
    code.extend([0xba, 0x67, 0x45, 0x23, 0x01]); // LINUX_REBOOT_CMD_RESTART
    code.extend([0x45, 0x31, 0xd2]); // xor r10d, r10d
    code.extend([0x0f, 0x05]); // syscall
    code.extend([0xeb, 0xfe]); // jmp $
    while code.len() % 8 != 0 {
        code.push(0x90);
    }
    let ts_at = code.len();
    code.extend(u64::from(secs).to_le_bytes()); // tv_sec
    code.extend(0u64.to_le_bytes()); // tv_nsec
    let msg_at = code.len();
    code.extend(msg.as_bytes());
    let disp = |at: usize, to: usize| ((to - (at + 7)) as u32).to_le_bytes();
    code[msg_lea + 3..msg_lea + 7].copy_from_slice(&disp(msg_lea, msg_at));
    code[ts_lea + 3..ts_lea + 7].copy_from_slice(&disp(ts_lea, ts_at));
    ember_testing::static_elf(0x40_0000, &code)
}

fn initramfs(msg: &str, secs: u32) -> Vec<u8> {
    let mut w = ember::initramfs::NewcWriter::new(Vec::new());
    w.dir("/dev", 0o755).unwrap();
    w.char_dev("/dev/console", 0o600, 5, 1).unwrap();
    w.file("/init", 0o755, &sleeping_init(msg, secs)).unwrap();
    w.finish().unwrap().0
}

/// Starts `ember boot` on the PVM kernel (128 MiB) with an /init that prints
/// [`MARKER`] and sleeps 900 s, a control socket at `sock` and `extra` args;
/// stdout and stderr piped. The test ends the VM through the socket.
fn boot_sleeping_guest(
    dir: &std::path::Path,
    scratch: &Scratch,
    sock: &std::path::Path,
    extra: &[&std::ffi::OsStr],
) -> std::process::Child {
    let initrd = scratch.path("initrd.cpio");
    std::fs::write(&initrd, initramfs(&format!("{MARKER}\n"), 900)).unwrap();
    ember()
        .args(["boot", "--kernel"])
        .arg(dir.join("vmlinux"))
        .arg("--initrd")
        .arg(&initrd)
        .args([
            "--mem",
            "128M",
            "--cmdline",
            PVM_CMDLINE,
            "--timeout",
            "900",
        ])
        .args(extra)
        .arg("--api-socket")
        .arg(sock)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn linux_inflates_then_deflates_as_memory_is_committed() {
    let test = "linux balloon fence";
    if !require_kvm(test) {
        return;
    }
    let Some(dir) = pvm_kernel_dir(test) else {
        return;
    };
    let scratch = Scratch::new("linux-balloon");
    let events = scratch.path("events.json");
    let sock = scratch.path("api.sock");
    // 64 MiB in 4 MiB chunks at 1 MiB/s: 64 s in the background, so the
    // driver (up before /init) takes part even when a loaded host slows the
    // boot to 40 s. The test ends the VM once the commit is done and the
    // balloon empty, not after a fixed time.
    let mut child = boot_sleeping_guest(
        &dir,
        &scratch,
        &sock,
        &[
            "--prefault".as_ref(),
            "async,window=64M,chunk=4M,rate=1M,driver-timeout=120".as_ref(),
            "--events".as_ref(),
            events.as_os_str(),
        ],
    );
    let drain = |mut r: Box<dyn std::io::Read + Send>, committed: Option<Arc<AtomicBool>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                s.push_str(&String::from_utf8_lossy(&buf[..n]));
                // ember's line once the background commit is done.
                if let Some(flag) = &committed
                    && s.contains("guest memory committed in the background")
                {
                    flag.store(true, Ordering::SeqCst);
                }
            }
            s
        })
    };
    let committed_line = Arc::new(AtomicBool::new(false));
    let out_reader = drain(Box::new(child.stdout.take().unwrap()), None);
    let err_reader = drain(
        Box::new(child.stderr.take().unwrap()),
        Some(committed_line.clone()),
    );
    // Wait until the commit is done and the driver has deflated everything:
    // then ember marks all memory visible (within one 2 ms poll).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    while std::time::Instant::now() < deadline && child.try_wait().unwrap().is_none() {
        if committed_line.load(Ordering::SeqCst)
            && ctl(&sock, &["balloon-stats"])["actual_pages"].as_u64() == Some(0)
        {
            std::thread::sleep(std::time::Duration::from_millis(200));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    if sock.exists() {
        let _ = ctl(&sock, &["shutdown"]);
    }
    let status = child.wait().unwrap();
    let o = std::process::Output {
        status,
        stdout: out_reader.join().unwrap().into_bytes(),
        stderr: err_reader.join().unwrap().into_bytes(),
    };
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(out.contains(MARKER), "no marker; stderr: {err}\n{out}");
    assert!(!err.contains("no balloon driver"), "{err}");
    let ev: EventFile = serde_json::from_slice(&std::fs::read(&events).unwrap()).unwrap();
    let at = |kind: &str| ev.events.iter().find(|e| e.kind == kind).map(|e| e.t_us);
    let committed = at(EVENT_COMMITTED).expect("all memory committed");
    let visible = ev
        .events
        .iter()
        .find(|e| e.kind == EVENT_VISIBLE)
        .expect("all memory visible");
    assert!(visible.t_us >= committed);
    // The driver took part: it inflated to the fence and deflated it all again.
    let text = visible.text.clone().unwrap_or_default();
    let field = |name: &str| -> u64 {
        text.split_whitespace()
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {text}"))
    };
    assert_eq!(field("driver"), 1, "{text}");
    assert!(field("inflated_pages") > 0, "{text}");
    assert_eq!(field("deflated_pages"), field("inflated_pages"), "{text}");
    assert_eq!(field("held_pages"), 0, "{text}");
    // And the guest ran on all of it, committed.
    assert!(ev.memory_kib("guest_resident_kib").unwrap() >= 128 << 10);
}

/// `ember ctl --api-socket SOCK ARGS…`'s reply as JSON.
fn ctl(sock: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let o = output(ember().arg("ctl").arg("--api-socket").arg(sock).args(args));
    serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("ember ctl {args:?}: {e}: {} {}", stdout(&o), stderr(&o)))
}

/// Polls `balloon-stats` until the balloon holds `pages` pages; the last reply.
fn wait_actual(sock: &std::path::Path, pages: u64) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let r = ctl(sock, &["balloon-stats"]);
        if r["actual_pages"].as_u64() == Some(pages) || std::time::Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

#[test]
fn socket_target_is_inflated_by_linux_and_its_statistics_arrive() {
    use std::io::{BufRead, BufReader};
    let test = "linux balloon over the socket";
    if !require_kvm(test) {
        return;
    }
    let Some(dir) = pvm_kernel_dir(test) else {
        return;
    };
    let scratch = Scratch::new("linux-balloon-socket");
    let sock = scratch.path("api.sock");
    let mut child = boot_sleeping_guest(&dir, &scratch, &sock, &["--balloon".as_ref()]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let booted = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains(MARKER));
    assert!(booted, "the guest never reached /init");
    // The driver is up (built in, probed before /init): it posted its statistics.
    let before = ctl(&sock, &["balloon-stats"]);
    assert_eq!(before["ok"], true, "{before}");
    assert_eq!(before["actual_pages"], 0, "{before}");
    let r = ctl(&sock, &["balloon", "--target-mib", "32"]);
    assert_eq!(r["ok"], true, "{r}");
    let inflated = wait_actual(&sock, 32 << 8);
    assert_eq!(
        inflated["actual_pages"].as_u64(),
        Some(32 << 8),
        "Linux did not inflate to the socket's target: {inflated}"
    );
    assert_eq!(inflated["target_pages"].as_u64(), Some(32 << 8));
    // What the guest gave up went back to the host (inflated pages are discarded).
    assert!(
        inflated["discarded_pages"].as_u64().unwrap_or(0) >= 32 << 8,
        "{inflated}"
    );
    // Statistics: tag 5 is the guest's total memory, tag 4 its free memory.
    let total = inflated["stats"]["5"].as_u64().unwrap_or(0);
    assert!(
        (64 << 20..=128 << 20).contains(&total) && inflated["stats"]["4"].is_u64(),
        "statistics: {inflated}"
    );
    // Too large a target is refused and changes nothing.
    let big = ctl(&sock, &["balloon", "--target-mib", "4096"]);
    assert_eq!(big["ok"], false, "{big}");
    let r = ctl(&sock, &["balloon", "--target-mib", "0"]);
    assert_eq!(r["ok"], true, "{r}");
    let deflated = wait_actual(&sock, 0);
    assert_eq!(
        deflated["actual_pages"], 0,
        "Linux did not deflate: {deflated}"
    );
    let r = ctl(&sock, &["shutdown"]);
    assert_eq!(r["ok"], true, "{r}");
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "ember's exit status");
}
