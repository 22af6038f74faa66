//! `ember boot` on a terminal, driven through a pty: raw mode while the guest
//! runs (keys reach COM1 as typed, no host echo), Ctrl-A Ctrl-A sends a
//! Ctrl-A, Ctrl-A x quits, and the terminal is restored after a quit and
//! after SIGTERM. The guest is a few hand-assembled instructions that echo
//! COM1's input back to it.

use crate::common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Polls the UART's line status until a byte is ready, reads it, writes it back.
const ECHO_GUEST: [u8; 17] = [
    0x66, 0xba, 0xfd, 0x03, // mov dx, 0x3fd (LSR)
    0xec, // in al, dx
    0xa8, 0x01, // test al, 1 (data ready)
    0x74, 0xf7, // jz start
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8 (RBR/THR)
    0xec, // in al, dx
    0xee, // out dx, al
    0xeb, 0xef, // jmp start
];

struct Pty {
    master: File,
    slave: File,
}

fn pty() -> Pty {
    let (mut m, mut s) = (0, 0);
    // SAFETY: openpty writes two descriptors; the null pointers ask for defaults.
    let rc = unsafe {
        libc::openpty(
            &mut m,
            &mut s,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are fresh and owned from here on.
    unsafe {
        Pty {
            master: File::from_raw_fd(m),
            slave: File::from_raw_fd(s),
        }
    }
}

fn lflag(f: &File) -> libc::tcflag_t {
    // SAFETY: termios is plain data filled by tcgetattr on a valid descriptor.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        assert_eq!(libc::tcgetattr(f.as_raw_fd(), &mut t), 0);
        t.c_lflag
    }
}

fn boot(p: &Pty, kernel: &std::path::Path) -> Child {
    let fd = |f: &File| Stdio::from(f.try_clone().unwrap());
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["boot", "--mem", "64M", "--timeout", "120", "--kernel"])
        .arg(kernel)
        .stdin(fd(&p.slave))
        .stdout(fd(&p.slave))
        .stderr(fd(&p.slave))
        .spawn()
        .expect("spawn ember")
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads the master side on a thread; returns everything read so far.
fn reader(master: &File) -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (mut m, out) = (master.try_clone().unwrap(), seen.clone());
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n @ 1..) = m.read(&mut buf) {
            out.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    seen
}

fn guest() -> ember_testing::TempFile {
    let p = ember_testing::TempFile::new("echo-guest", "echo-guest.elf");
    std::fs::write(&p, ember_testing::static_elf(0x10_0000, &ECHO_GUEST)).unwrap();
    p
}

#[test]
fn keys_reach_the_guest_raw_and_ctrl_a_x_quits_and_restores() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "terminal_pty needs /dev/kvm"
    );
    let kernel = guest();
    let mut p = pty();
    let cooked = lflag(&p.slave);
    assert_ne!(cooked & libc::ICANON, 0, "a fresh pty is cooked");
    let seen = reader(&p.master);
    let mut child = boot(&p, &kernel);
    wait_for("raw mode", || lflag(&p.slave) & libc::ICANON == 0);
    assert_eq!(lflag(&p.slave) & (libc::ECHO | libc::ISIG), 0);
    // No newline: in cooked mode the guest would see nothing yet. The echo
    // comes from the guest (the host's is off), once; Ctrl-A Ctrl-A is one Ctrl-A.
    p.master.write_all(b"abc\x01\x01d").unwrap();
    wait_for("the guest's echo", || {
        seen.lock().unwrap().windows(5).any(|w| w == b"abc\x01d")
    });
    p.master.write_all(b"\x01x").unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "Ctrl-A x did not quit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
    assert_eq!(
        lflag(&p.slave),
        cooked,
        "the terminal is restored after Ctrl-A x"
    );
    let text = String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    assert_eq!(
        text.matches("abc").count(),
        1,
        "echoed once (no host echo): {text:?}"
    );
    let (guest_part, _) = text
        .split_once("ember: quit (Ctrl-A x)")
        .expect("the quit message");
    assert!(
        !guest_part.contains('x'),
        "x is ember's, not the guest's: {text:?}"
    );

    // SIGTERM: the terminal goes back too.
    let mut child = boot(&p, &kernel);
    wait_for("raw mode", || lflag(&p.slave) & libc::ICANON == 0);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM));
    assert_eq!(
        lflag(&p.slave),
        cooked,
        "the terminal is restored after SIGTERM"
    );
    let _ = std::fs::remove_file(&kernel);
}

/// ember-init (release, as installed), built once.
fn init_binary() -> std::path::PathBuf {
    common::init_binary().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn run_sh_on_a_terminal_reads_what_is_typed() {
    // The appliance under QEMU/TCG (as appliance_e2e): `ember setup` must have run.
    let p = pty();
    let seen = reader(&p.master);
    let fd = |f: &File| Stdio::from(f.try_clone().unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env("EMBER_INIT", init_binary())
        .args(["run", "--backend", "qemu", "--timeout", "120", "--", "sh"])
        .stdin(fd(&p.slave))
        .stdout(fd(&p.slave))
        .stderr(fd(&p.slave))
        .spawn()
        .expect("spawn ember");
    let mut m = p.master.try_clone().unwrap();
    // Typed before the guest is up: the terminal (cooked) holds the lines.
    m.write_all(b"echo typed-$((40+2)); ls / | grep -c proc\nexit 7\n")
        .unwrap();
    let status = child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let text = String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    assert!(text.contains("typed-42\r\n1\r\n"), "{text:?}");
    assert_eq!(status.code(), Some(7), "{text:?}");
}
