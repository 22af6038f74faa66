//! `ember boot` on a terminal: raw mode, so every key (Ctrl-C included) goes
//! to the guest's COM1 and the guest's tty does the echoing; an escape
//! sequence to quit, as QEMU's (Ctrl-A x; Ctrl-A Ctrl-A sends a Ctrl-A); and
//! the terminal as it was on every way out — the guest ending, an error, a
//! panic, SIGINT/SIGTERM/SIGHUP/SIGQUIT. The VMM's last act is
//! `teardown::exit`, which runs no destructors: [`restore`] is registered
//! with [`crate::cleanup`], which calls it before that exit and on a fatal
//! signal (it is async-signal-safe).

use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The escape key: Ctrl-A.
pub const ESCAPE: u8 = 0x01;

/// The terminal's settings before raw mode (set once, read by [`restore`]).
static SAVED: OnceLock<libc::termios> = OnceLock::new();
/// Whether stdin is in raw mode now.
static RAW: AtomicBool = AtomicBool::new(false);

/// Puts stdin in raw mode when it is a terminal; `Ok(false)` when it is not.
/// Has [`crate::cleanup`] put it back on a fatal signal or an exit, and a
/// panic hook on a panic.
pub fn enter_raw() -> io::Result<bool> {
    // SAFETY: isatty only inspects the descriptor.
    if unsafe { libc::isatty(libc::STDIN_FILENO) } != 1 {
        return Ok(false);
    }
    // SAFETY: termios is plain data; tcgetattr fills it.
    let mut saved: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a valid pointer to a termios.
    if unsafe { libc::tcgetattr(libc::STDIN_FILENO, &mut saved) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let saved = *SAVED.get_or_init(|| saved);
    let mut raw = saved;
    // SAFETY: cfmakeraw only edits the struct it is given.
    unsafe { libc::cfmakeraw(&mut raw) };
    // Keep output processing: ember's own messages end in `\n` and must
    // still start at the left margin.
    raw.c_oflag |= saved.c_oflag & (libc::OPOST | libc::ONLCR);
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.swap(true, Ordering::SeqCst) {
        match crate::cleanup::register(crate::cleanup::Undo::Call(restore)) {
            // For the rest of the process: `restore` is a no-op once done.
            Ok(entry) => std::mem::forget(entry),
            Err(e) => log::warn!("the terminal is not restored if ember is killed: {e}"),
        }
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
    }
    RAW.store(true, Ordering::SeqCst);
    // SAFETY: a valid descriptor and a valid termios.
    if unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) } != 0 {
        RAW.store(false, Ordering::SeqCst);
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// Puts the terminal back as [`enter_raw`] found it (a no-op when it is not
/// raw). Async-signal-safe.
pub fn restore() {
    if RAW.swap(false, Ordering::SeqCst) {
        if let Some(saved) = SAVED.get() {
            // SAFETY: a valid descriptor and the termios saved from it.
            unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, saved) };
        }
    }
}

/// What the keys typed after the escape key mean.
pub const HELP: &str = "\r\nember: Ctrl-A x  quit\r\n       Ctrl-A Ctrl-A  send Ctrl-A\r\n       Ctrl-A h  this help\r\n";

/// What a chunk of keyboard input asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Keys {
    /// Bytes for the guest.
    pub guest: Vec<u8>,
    /// Quit (Ctrl-A x).
    pub quit: bool,
    /// Show the escape keys (Ctrl-A h).
    pub help: bool,
}

/// The escape-sequence state machine (pure: no I/O).
#[derive(Debug, Default)]
pub struct Escape {
    pending: bool,
}

impl Escape {
    /// Splits `input` into what goes to the guest and what ember acts on.
    /// An escape key at the end of `input` waits for the next chunk.
    pub fn feed(&mut self, input: &[u8]) -> Keys {
        let mut keys = Keys::default();
        for &b in input {
            if !self.pending {
                if b == ESCAPE {
                    self.pending = true;
                } else {
                    keys.guest.push(b);
                }
                continue;
            }
            self.pending = false;
            match b {
                b'x' | b'X' => {
                    keys.quit = true;
                    return keys;
                }
                b'h' | b'H' | b'?' => keys.help = true,
                ESCAPE => keys.guest.push(ESCAPE),
                // Not an escape after all: both keys go to the guest.
                other => keys.guest.extend([ESCAPE, other]),
            }
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_sequences() {
        let mut e = Escape::default();
        assert_eq!(e.feed(b"ls\r").guest, b"ls\r");
        let k = e.feed(b"a\x01\x01b");
        assert_eq!((k.guest.as_slice(), k.quit), (&b"a\x01b"[..], false));
        let k = e.feed(b"ab\x01xcd");
        assert_eq!((k.guest.as_slice(), k.quit), (&b"ab"[..], true));
        // Split across reads.
        let mut e = Escape::default();
        assert_eq!(
            e.feed(b"q\x01"),
            Keys {
                guest: b"q".to_vec(),
                ..Keys::default()
            }
        );
        assert!(e.feed(b"x").quit);
        let mut e = Escape::default();
        assert_eq!(e.feed(b"\x01c").guest, b"\x01c");
        assert!(e.feed(b"\x01h").help);
        assert!(!e.feed(b"x").quit, "the escape was used up by h");
    }

    #[test]
    fn restore_without_raw_is_a_no_op() {
        restore();
        assert!(!RAW.load(Ordering::SeqCst));
    }
}
