#!/usr/bin/env python3
"""The shim's own start time on the ember backend: from containerd's create
request to the restored guest's first instruction, in its parts.

Usage: bench/container_start.py RUNS OUT.json KERNEL_DIR [BIN_DIR [BASE_BIN_DIR]]

KERNEL_DIR holds the PVM test kernel's vmlinux (scripts/pvm-kernel prints
it). BIN_DIR holds containerd-shim-ember-v2, ember-agent and ember (default
target/release: `cargo build --release -p ember -p containerd-shim-ember-v2
-p ember-agent`); ember-init is $EMBER_INIT, else beside them, else
target/release's (`cargo build --release -p ember-init`). Needs root,
containerd, umoci, busybox-static, iproute2.

BASE_BIN_DIR, if given, holds another build's three binaries (the same
ember-init): its shim is registered as runtime io.containerd.emberbase.v2
(a link on containerd's PATH; the shim finds its ember and agent beside its
own file), and each round runs both builds, in alternating order, on the
same containerd, image and namespace. Each build boots the pod VM once and
saves its own snapshot (the ember binary is part of its key).

The script starts its own containerd (root, state, socket and ember's cache
in a temporary directory) with EMBER_SHIM_BACKEND=ember, and two network
namespaces joined by a veth pair: each container runs in the first
(`ctr run --with-ns network:…`), so its VM gets a tap there joined to the
veth by tc redirects. A first run boots the pod VM and saves the
appliance's snapshot (not counted); then RUNS runs of `ctr run --rm`, each
restoring it. Every process of a start (the shim, `ember run`, the VMM)
appends its stages to the file EMBER_STAGES names, on CLOCK_MONOTONIC
(ember_vmm::events::stage), so each part is a difference of two stamps:

  shim: rootfs       the create request → containerd's snapshot mounted
  shim: pod share    → the root bound into the pod's shared directory
  shim: to spawn     → `ember run` about to be spawned
  ember run: exec    → `ember run`'s main
  tap + tc           → the tap in the pod's namespace, tc redirects both ways
  appliance          → the host-root appliance found in the cache
  snapshot lookup    → the snapshot's spec (restore directory, shares)
  VMM spawn prep     → the VMM's command made (`ember boot --restore`)
  VMM exec           → the VMM's main
  restore: kvm+state → /dev/kvm opened, the snapshot's state read
  restore: memory    → guest memory mapped from the snapshot
  restore: vcpus     → vCPUs created and set
  restore: devices   → virtio devices (the shares, the tap, vsock) restored
  restore: go        → vCPU 0 enters the guest (KVM_RUN)

The shares are ember's own virtio-fs devices (no virtiofsd process on this
backend): their cost is in `restore: devices`. Prints median and min–max
per part in ms and the total; writes every sample to OUT.json (per build,
with a base).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from containers import containerd_with_image, run, teardown

# (label, stage that ends the part); each part starts at the previous stage.
PARTS = [
    ("shim: rootfs", "shim_rootfs_mounted"),
    ("shim: pod share", "shim_pod_dir"),
    ("shim: to spawn", "shim_spawn_vm"),
    ("ember run: exec", "run_main"),
    ("tap + tc", "run_netns_tap_tc"),
    ("appliance", "run_assembled"),
    ("snapshot lookup", "run_warm_spec"),
    ("VMM spawn prep", "run_spawn_vmm"),
    ("VMM exec", "vmm_main"),
    ("restore: kvm+state", "kvm_open"),
    ("restore: memory", "memory_ready"),
    ("restore: vcpus", "vcpus_created"),
    ("restore: devices", "devices_restored"),
    ("restore: go", "first_guest_entry"),
]
FIRST = "shim_create"
PVM_CMDLINE = ("console=ttyS0 noxsave noint3selftest nofxsaveleak "
               "clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase noinvpcid "
               "nopcid nopku mitigations=off reboot=k panic=-1")


def starts(path):
    """The stages file split into starts: {stage: ns} from each shim_create on."""
    out = []
    with open(path) as f:
        lines = sorted((int(ns), name) for ns, _pid, name in (l.split() for l in f if l.strip()))
    for ns, name in lines:
        if name == FIRST:
            out.append({})
        if out and name not in out[-1]:
            out[-1][name] = ns
    return out


def parts_of(stamps):
    missing = [s for s in [FIRST] + [s for _, s in PARTS] if s not in stamps]
    if missing:
        raise RuntimeError(f"stages missing: {missing} (have {sorted(stamps, key=stamps.get)})")
    res, prev = {}, stamps[FIRST]
    for label, stage in PARTS:
        res[label] = (stamps[stage] - prev) / 1e6
        prev = stamps[stage]
    res["total"] = (stamps[PARTS[-1][1]] - stamps[FIRST]) / 1e6
    return res


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    runs, out, kdir = int(sys.argv[1]), sys.argv[2], os.path.abspath(sys.argv[3])
    bindir = os.path.abspath(sys.argv[4] if len(sys.argv) > 4 else "target/release")
    basedir = os.path.abspath(sys.argv[5]) if len(sys.argv) > 5 else None
    for d in [bindir] + ([basedir] if basedir else []):
        for b in ("containerd-shim-ember-v2", "ember-agent", "ember"):
            if not os.access(os.path.join(d, b), os.X_OK):
                sys.exit(f"container_start: {b} missing in {d}")
    init = os.environ.get("EMBER_INIT") or next(
        (p for p in (os.path.join(bindir, "ember-init"), "target/release/ember-init")
         if os.access(p, os.X_OK)), None)
    if not init:
        sys.exit("container_start: no ember-init (set EMBER_INIT)")
    kernel = os.path.join(kdir, "vmlinux")
    if not os.path.isfile(kernel):
        sys.exit(f"container_start: no vmlinux in {kdir}")
    tmp = tempfile.mkdtemp(prefix="ember-bench-start-")
    pod_ns, peer_ns = f"ember-start-{os.getpid()}", f"ember-peer-{os.getpid()}"
    stages = os.path.join(tmp, "stages")
    # The builds: name → the runtime whose shim containerd runs.
    builds = {"ember": "io.containerd.ember.v2"}
    links = os.path.join(tmp, "bin")
    os.mkdir(links)
    if basedir:
        builds["base"] = "io.containerd.emberbase.v2"
        os.symlink(os.path.join(basedir, "containerd-shim-ember-v2"),
                   os.path.join(links, "containerd-shim-emberbase-v2"))
    env = dict(os.environ, PATH=f"{bindir}:{links}:{os.environ.get('PATH', '')}",
               EMBER_SHIM_BACKEND="ember", EMBER_SHIM_KERNEL=kernel,
               EMBER_SHIM_CMDLINE=PVM_CMDLINE, EMBER_SHIM_BOOT_TIMEOUT="840", EMBER_CACHE=os.path.join(tmp, "cache"),
               EMBER_STAGES=stages, EMBER_INIT=os.path.abspath(init))
    procs = []
    try:
        # The pod's namespace: a veth to a peer namespace, addressed and routed.
        for ns in (pod_ns, peer_ns):
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "-n", pod_ns, "link", "add", "eth0", "type", "veth",
             "peer", "name", "peer0", "netns", peer_ns])
        run(["ip", "-n", pod_ns, "addr", "add", "10.213.10.2/24", "dev", "eth0"])
        run(["ip", "-n", pod_ns, "link", "set", "eth0", "up"])
        run(["ip", "-n", pod_ns, "route", "add", "default", "via", "10.213.10.1"])
        run(["ip", "-n", peer_ns, "addr", "add", "10.213.10.1/24", "dev", "peer0"])
        run(["ip", "-n", peer_ns, "link", "set", "peer0", "up"])

        ctr, _ = containerd_with_image(tmp, env, procs)

        def ctr_run(i, runtime):
            argv = ctr + ["run", "--rm", "--runtime", runtime,
                          "--with-ns", f"network:/var/run/netns/{pod_ns}",
                          "localhost/bench:latest", f"start{i}", "sh", "-c", "echo first"]
            p = subprocess.run(argv, capture_output=True, env=env, timeout=900)
            if p.returncode != 0 or p.stdout.strip() != b"first":
                raise RuntimeError(f"ctr run: status {p.returncode}, stdout {p.stdout!r}, "
                                   f"stderr {p.stderr.decode(errors='replace')[-600:]}")

        for name, runtime in builds.items():
            t = time.monotonic()
            ctr_run(f"first-{name}", runtime)
            print(f"{name}: the first run (boots the pod VM, saves the snapshot): "
                  f"{time.monotonic() - t:.0f} s", flush=True)
        samples = {name: [] for name in builds}
        n = len(starts(stages))
        for i in range(1, runs + 1):
            order = list(builds.items())
            if i % 2 == 0:
                order.reverse()
            for name, runtime in order:
                ctr_run(f"{name}{i}", runtime)
                got = starts(stages)
                n += 1
                if len(got) != n:
                    raise RuntimeError(f"{len(got)} starts in the stages file after {n} runs")
                p = parts_of(got[-1])
                samples[name].append(p)
                print(f"run {i} {name}: {p['total']:.1f} ms to the first guest instruction "
                      f"(tap + tc {p['tap + tc']:.1f}, restore "
                      f"{sum(p[k] for k, _ in PARTS[9:]):.1f})", flush=True)
        with open(out, "w") as f:
            json.dump(samples if basedir else samples["ember"], f, indent=1)
        load = os.getloadavg()
        print(f"\n{runs} restores each, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
              f"binaries in {bindir}" + (f", base in {basedir}" if basedir else ""))
        print(f"{'part':20} " + "  ".join(f"{name + ' median':>12}  {'min–max':>13}"
                                           for name in builds) + " (ms)")
        for label in [label for label, _ in PARTS] + ["total"]:
            cols = []
            for name in builds:
                v = [s[label] for s in samples[name]]
                cols.append(f"{statistics.median(v):12.2f}  {min(v):6.2f}–{max(v):6.2f}")
            print(f"{label:20} " + "  ".join(cols))
        if basedir:
            for label in ("tap + tc", "total"):
                m = {name: statistics.median(s[label] for s in samples[name]) for name in builds}
                print(f"{label}: base ÷ ember = {m['base'] / m['ember']:.2f}×")
    finally:
        teardown(procs, tmp, [pod_ns, peer_ns])


if __name__ == "__main__":
    main()
