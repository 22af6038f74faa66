//! End-to-end: ember exits as soon as the guest ends and leaves the VM's
//! teardown to a keeper process that dies with it (see `vstate::teardown`).
//!
//! One test in its own binary: it makes this test process a subreaper and
//! reaps whatever ember leaves behind, which would reap other tests' children
//! from under them.

mod common;

use common::{ember, require_kvm};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

fn guest() -> std::path::PathBuf {
    ember_testing::test_guest().expect("build the test guest")
}

/// How each process ember left behind ended, once all have: `Ok(code)` or
/// `Err(signal)`. Panics if one is still alive after `limit`.
fn reap_orphans(limit: Duration) -> Vec<Result<i32, i32>> {
    let deadline = Instant::now() + limit;
    let mut ended = Vec::new();
    loop {
        let mut status = 0;
        // SAFETY: reaping our own (adopted) children; `status` is a valid out-pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            ended.push(if libc::WIFSIGNALED(status) {
                Err(libc::WTERMSIG(status))
            } else {
                Ok(libc::WEXITSTATUS(status))
            });
        } else if pid < 0 {
            return ended; // ECHILD: nothing is left.
        } else {
            assert!(
                Instant::now() < deadline,
                "a process ember left is still alive"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Starts `ember boot` on the test guest with `cmdline`, stdout piped.
fn spawn(cmdline: &str) -> std::process::Child {
    ember()
        .args(["boot", "--mem", "64M", "--cmdline", cmdline, "--kernel"])
        .arg(guest())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn the_vm_outlives_ember_only_in_a_keeper_that_dies_with_it() {
    if !require_kvm("the_vm_outlives_ember_only_in_a_keeper_that_dies_with_it") {
        return;
    }
    // SAFETY: prctl with integer arguments.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) }, 0);

    // A guest that ends: ember reports its status, its output reaches
    // end-of-file (nothing left holds the pipe), and exactly one process
    // remains to be reaped: the keeper, gone soon after ember.
    let mut child = spawn("print=hi exit=7");
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(out.contains("hi"), "{out}");
    assert_eq!(child.wait().unwrap().code(), Some(128 + 7));
    let left = reap_orphans(Duration::from_secs(30));
    assert_eq!(left.len(), 1, "one keeper, not {left:?}");
    // Killed with ember, or (had ember gone before the keeper armed its
    // death signal) ended by itself.
    assert!(matches!(left[0], Err(libc::SIGKILL) | Ok(0)), "{left:?}");

    // Killing ember stops the VM with it: its vCPUs are its own threads, and
    // nothing is left behind.
    let mut child = spawn("print=up spin=60000");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("up") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the guest never printed"
        );
    }
    // SAFETY: sending SIGTERM to our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
    assert_eq!(reap_orphans(Duration::from_secs(30)), []);
}
