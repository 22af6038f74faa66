//! End-to-end: `ctr run --runtime io.containerd.ember.v2` on the ember
//! backend (`EMBER_SHIM_BACKEND=ember`), the pod VM the appliance's
//! snapshot of the PVM test kernel with the host's root and the pod's
//! share: the first container's VM boots and makes it, the second's is
//! restored from it. The agent talks over the appliance's channel.
//!
//! The test starts its own containerd (root, state, sockets and ember's
//! cache in its scratch directory) and builds a busybox image with umoci.
//! Needs root, containerd, umoci, busybox (static) and EMBER_PVM_KERNEL
//! (built with cgroup v2: the agent puts each container in its cgroup).

use crate::common;

use common::containers::{
    Containerd, MESSAGE, RUNTIME, build_companions, mounts_under, processes_mentioning,
};

use common::{PVM_CMDLINE, Scratch, init_binary, pvm_kernel_dir, require_kvm};
use std::path::Path;
use std::time::{Duration, Instant};

const IMAGE: &str = "localhost/ember-pvm-test:latest";
/// The snapshot's cold boot of the emulated guest kernel on a loaded host.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The release a kernel image says it is (its `Linux version X` banner).
fn release_of(vmlinux: &Path) -> String {
    let image = std::fs::read(vmlinux).unwrap();
    let mark = b"Linux version ";
    let at = image
        .windows(mark.len())
        .position(|w| w == mark)
        .expect("a Linux version banner in the kernel");
    let rest = &image[at + mark.len()..];
    let end = rest.iter().position(|&b| b == b' ').unwrap();
    text(&rest[..end])
}

#[test]
fn ctr_run_restores_the_pod_vm_from_the_appliance_snapshot() {
    let test = "shim_pvm";
    if !require_kvm(test) {
        return;
    }
    let Some(kdir) = pvm_kernel_dir(test) else {
        return;
    };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "{test}: containerd needs root");
    for tool in ["containerd", "ctr", "umoci", "busybox"] {
        assert!(
            ember::backend::find_binary(tool).is_some(),
            "{test}: `{tool}` is not installed (scripts/install-deps --test)"
        );
    }
    let init = init_binary().unwrap_or_else(|e| panic!("{test}: {e}"));
    let bin = build_companions(&["containerd-shim-ember-v2", "ember-agent"]);
    let scratch = Scratch::new(test);
    let cache = scratch.path("cache");
    let kernel = kdir.join("vmlinux");
    let release = release_of(&kernel);
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(release, host_release.trim());
    let c = Containerd::start(
        Some(&scratch.path("containerd")),
        &bin,
        &[
            ("EMBER_SHIM_BACKEND", "ember".as_ref()),
            ("EMBER_SHIM_KERNEL", kernel.as_os_str()),
            ("EMBER_SHIM_CMDLINE", PVM_CMDLINE.as_ref()),
            ("EMBER_SHIM_BOOT_TIMEOUT", "540".as_ref()),
            ("EMBER_CACHE", cache.as_os_str()),
            ("EMBER_INIT", init.as_os_str()),
        ],
    );
    c.import_image(IMAGE, &["sh"]);

    // The first makes the snapshot (the guest boots), the second restores it.
    for id in ["p1", "p2"] {
        let start = Instant::now();
        let out = c.run(
            &[
                "run",
                "--rm",
                "--runtime",
                RUNTIME,
                IMAGE,
                id,
                "sh",
                "-c",
                // Shell builtins only: each exec from the image over
                // virtio-fs costs the emulated guest kernel a minute
                // on a loaded host.
                "read m </etc/message; read r </proc/sys/kernel/osrelease; \
                 read c </proc/self/cgroup; echo \"$m\"; echo \"$r\"; echo \"$c\"; exit 7",
            ],
            b"",
            RUN_TIMEOUT,
        );
        eprintln!("{test}: ctr run {id} took {:?}", start.elapsed());
        let stdout = text(&out.stdout);
        let why = format!(
            "stdout {stdout:?} stderr {}\n{}",
            text(&out.stderr),
            c.log()
        );
        assert_eq!(out.status.code(), Some(7), "{why}");
        // The agent put it in its own cgroup (v2: one `0::` line).
        assert_eq!(
            stdout,
            format!("{MESSAGE}\n{release}\n0::/ember/{id}\n"),
            "{why}"
        );
        assert_eq!(c.shims(), Vec::<u32>::new(), "a shim outlived --rm");
        assert_eq!(
            common::appliance_snapshots(&cache).len(),
            1,
            "{id}: the first makes the snapshot, the second restores it"
        );
    }
    // Nothing left behind: no VMM (a restore names the cache), mount or shim.
    let dir = scratch.path("");
    let needle = cache.display().to_string();
    assert_eq!(processes_mentioning(&needle), Vec::new());
    let mounts: Vec<String> = mounts_under(&dir)
        .into_iter()
        .filter(|m| !m.contains("/snapshots/"))
        .collect();
    assert_eq!(mounts, Vec::<String>::new(), "mounts left behind");
}
