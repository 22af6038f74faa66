//! A running `ember boot` whose console (its stdout) is gathered as it
//! arrives, for tests that poll the whole console for a line; and, when it
//! was started with a control socket, that socket. (`console_vm` is the
//! other shape: stdin piped, lines handed over one by one.)

use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a wait for the test guest may take: it answers in milliseconds,
/// so this only bounds a failing test.
const WAIT: Duration = Duration::from_secs(90);

pub struct Booted {
    pub child: Child,
    console: Arc<Mutex<String>>,
    sock: Option<PathBuf>,
}

impl Booted {
    /// Starts `cmd` (an `ember boot …`) with stdout and stderr piped.
    pub fn spawn(cmd: &mut Command) -> Booted {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {cmd:?}: {e}"));
        let console = Arc::new(Mutex::new(String::new()));
        let out = child.stdout.take().unwrap();
        let c = console.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let mut c = c.lock().unwrap();
                c.push_str(&line);
                c.push('\n');
            }
        });
        Booted {
            child,
            console,
            sock: None,
        }
    }

    /// Starts `cmd`, passing it `--api-socket SOCK`, and waits for the socket.
    pub fn with_socket(cmd: &mut Command, sock: &Path) -> Booted {
        let mut b = Booted::spawn(cmd.arg("--api-socket").arg(sock));
        b.wait_until("the control socket", |_| sock.exists());
        b.sock = Some(sock.to_owned());
        b
    }

    /// The console so far.
    pub fn console(&self) -> String {
        self.console.lock().unwrap().clone()
    }

    /// Waits until `f` holds of the console; fails the test, showing the
    /// console, if it does not within 90 s.
    pub fn wait_until(&self, what: &str, f: impl Fn(&str) -> bool) {
        let start = Instant::now();
        while !f(&self.console()) {
            assert!(
                start.elapsed() < WAIT,
                "no {what} after {WAIT:?}; console:\n{}",
                self.console()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for `what` anywhere in the console; the console then.
    pub fn wait_for(&self, what: &str) -> String {
        self.wait_until(&format!("`{what}`"), |c| c.contains(what));
        self.console()
    }

    /// Waits for a console line that is exactly `line`.
    pub fn wait_for_line(&self, line: &str) {
        self.wait_until(&format!("line `{line}`"), |c| c.lines().any(|l| l == line));
    }

    /// A request on the control socket it was started with.
    pub fn call(&self, req: Value) -> Value {
        let sock = self
            .sock
            .as_ref()
            .expect("started without a control socket");
        ember::api::call(sock, &req).expect("control socket reply")
    }

    /// ember's resident memory, bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kib << 10
    }

    /// Waits for ember to exit; (status, console, stderr).
    pub fn finish(mut self) -> (i32, String, String) {
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        // The reader thread sees end-of-file once ember is gone.
        std::thread::sleep(Duration::from_millis(50));
        (status.code().unwrap_or(-1), self.console(), err)
    }
}
