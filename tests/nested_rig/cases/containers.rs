//! Containers on the ember backend (issue 27) with Debian's kernel:
//! containerd in the L1, `ctr run --rm --runtime io.containerd.ember.v2`
//! with the shim on the ember backend twice. The first pod VM boots the
//! cloud kernel on the L1's root and saves the appliance's snapshot; the
//! second is restored from it.

use crate::rig::rig;

#[test]
fn ctr_run_on_the_ember_backend_boots_then_restores_the_pod_vm_and_leaves_nothing() {
    let r = rig();
    if let Err(why) = &r.containers {
        panic!("the containers case could not be staged: {why}");
    }
    let c = r.case("containers");
    let why = c.dump();
    assert_eq!(c.rc, Some(0), "the case's steps\n{why}");
    // The word the shim adds to the pod VM's command line: the L2's kernel
    // says it; the L1's (the same release) does not.
    let mark = format!("rigctr={}", r.token);
    let l1 = c.fact("ctr-l1-cmdline").unwrap_or_default();
    assert!(!l1.split(' ').any(|w| w == mark), "{why}");
    let count = |key: &str| -> Option<u32> {
        c.fact(key)
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    let before = count("ctr-snapshots-0").expect("the snapshot count before");
    for run in [1, 2] {
        let out = c.facts(&format!("ctr-{run}"));
        assert_eq!(
            out.first().copied(),
            Some(common_message()),
            "run {run}: the image's /etc/message\n{why}"
        );
        assert_eq!(
            out.get(1).copied(),
            Some(r.version.as_str()),
            "run {run}: the guest kernel's release (Debian's cloud kernel)\n{why}"
        );
        assert!(
            out.get(2).is_some_and(|l| l.split(' ').any(|w| w == mark)),
            "run {run}: the container's kernel was booted by the shim's ember (its command line has `{mark}`)\n{why}"
        );
        assert_eq!(out.len(), 3, "run {run}: nothing else on its output\n{why}");
        assert_eq!(
            count(&format!("ctr-rc-{run}")),
            Some(7),
            "run {run}: ctr's exit status is the container's\n{why}"
        );
        // The first run saves the snapshot, the second restores it (and
        // makes no other).
        assert_eq!(
            count(&format!("ctr-snapshots-{run}")),
            Some(before + 1),
            "run {run}: the appliance's snapshots\n{why}"
        );
        assert_eq!(
            count(&format!("ctr-shims-{run}")),
            Some(0),
            "run {run}: a shim outlived --rm\n{why}"
        );
        assert_eq!(
            count(&format!("ctr-bundle-mounts-{run}")),
            Some(0),
            "run {run}: the container's mounts outlived --rm\n{why}"
        );
        let ms = c
            .fact(&format!("ctr-rc-{run}"))
            .and_then(|l| l.split_once("ms="))
            .map_or("?", |(_, ms)| ms);
        eprintln!("nested rig: ctr run {run} (ember backend) {ms} ms (L1 clock)");
    }
    // The shim's own account: two pod VMs, each agent on the L2's kernel.
    let shim = c.facts("ctr-shim");
    let answered: Vec<&&str> = shim
        .iter()
        .filter(|l| l.contains("agent answered"))
        .collect();
    assert_eq!(answered.len(), 2, "the shim's log\n{why}");
    for l in answered {
        assert!(
            l.contains(&format!("(guest kernel {})", r.version)),
            "the agent's kernel\n{why}"
        );
        eprintln!("nested rig: {l}");
    }
    // Once containerd is stopped: no process, no mount left.
    assert_eq!(c.fact("ctr-left-ps"), Some(""), "processes left\n{why}");
    assert_eq!(count("ctr-left-mounts"), Some(0), "mounts left\n{why}");
}

/// The image's `/etc/message` (the harness's image builder writes it).
fn common_message() -> &'static str {
    crate::common::containers::MESSAGE
}
