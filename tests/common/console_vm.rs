#![allow(dead_code)]

//! `ember boot` with its stdin piped and its console lines arriving on a
//! channel: the Linux snapshot tests type commands at a busybox /init and
//! wait for its lines.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct ConsoleVm {
    pub child: Child,
    pub stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Every console line so far.
    pub log: String,
}

impl ConsoleVm {
    /// `ember boot ARGS…`, its stderr passed through.
    pub fn spawn(args: &[&OsStr]) -> ConsoleVm {
        let mut child = super::ember()
            .arg("boot")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start ember");
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        ConsoleVm {
            child,
            stdin,
            lines,
            log: String::new(),
        }
    }

    /// The PVM test kernel in `kernel_dir` booted with `initrd`, 128 MiB and
    /// [`super::PVM_CMDLINE`], then `extra` arguments.
    pub fn boot_pvm(
        kernel_dir: &std::path::Path,
        initrd: &std::path::Path,
        extra: &[&OsStr],
    ) -> ConsoleVm {
        let kernel = kernel_dir.join("vmlinux");
        let mut args: Vec<&OsStr> = vec![
            OsStr::new("--kernel"),
            kernel.as_os_str(),
            OsStr::new("--initrd"),
            initrd.as_os_str(),
            OsStr::new("--mem"),
            OsStr::new("128M"),
            OsStr::new("--cmdline"),
            OsStr::new(super::PVM_CMDLINE),
        ];
        args.extend_from_slice(extra);
        ConsoleVm::spawn(&args)
    }

    /// The console lines up to and including one containing `what`; fails the
    /// test, with the console so far, if none comes within `limit`.
    pub fn wait_for(&mut self, what: &str, limit: Duration) -> Vec<String> {
        let start = Instant::now();
        let mut got = Vec::new();
        loop {
            let left = limit.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push_str(&line);
                    self.log.push('\n');
                    let end = line.contains(what);
                    got.push(line);
                    if end {
                        return got;
                    }
                }
                Err(_) => panic!("no `{what}` within {limit:?}; console:\n{}", self.log),
            }
        }
    }
}

/// A VM left running by a failed assertion is killed with its test.
impl Drop for ConsoleVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
