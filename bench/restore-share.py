#!/usr/bin/env python3
"""The appliance's restore -> first guest instruction with its virtio-fs
shares against without, interleaved, on the PVM test kernel.

Two appliance snapshots, each made by one `ember run --backend ember` in a
fresh cache (a cold boot each, minutes on this host's emulated guest kernel):
- with shares: the host's root (`ember-root`, `/`) and one `--share`, both
  mounted in the snapshot (src/appliance/run.rs, `premount_words`);
- without: the initramfs appliance (`--initramfs`: its per-run pmem slot, no
  virtio-fs device).
Then ROUNDS rounds, each restoring both once (order alternating) with
`ember boot --restore SNAP --events`, in fresh processes: the shared one
with the share on another directory each round (`--fs tag=,dir=`: the
device opens it on restore), the other with a pmem slot of the recorded
size. Both connect their channel to a socket listening here and are stopped
by `--timeout` 0.5 s. The figure is the `first_guest_entry` event (us from
ember's start, vCPU 0's first KVM_RUN), with the steps before it.

Usage: bench/restore-share.py [ROUNDS]   (default 30)
       EMBER_BIN=path/to/ember EMBER_PVM_KERNEL=DIR bench/restore-share.py
       BENCH_WORK=DIR bench/restore-share.py   (kept: a second run restores the
       snapshots made there by the first, made by the same ember)
Prints medians (min-max) and the difference as Markdown.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
PVM_CMDLINE = ("console=ttyS0 noxsave noint3selftest nofxsaveleak "
               "clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase "
               "noinvpcid nopcid nopku mitigations=off reboot=k panic=-1")
STEPS = ["kvm_open", "memory_ready", "vcpus_created", "first_guest_entry"]


def run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()


EMBER = os.environ.get("EMBER_BIN") or run("scripts/build-release")
run("cargo", "build", "-q", "--release", "-p", "ember-init")
INIT = os.path.join(ROOT, "target/release/ember-init")
KERNEL = os.path.join(os.environ.get("EMBER_PVM_KERNEL") or run("scripts/pvm-kernel"), "vmlinux")
KEEP = os.environ.get("BENCH_WORK")
WORK = KEEP or tempfile.mkdtemp(prefix="ember-restore-share-bench.")
CACHE = os.path.join(WORK, "cache")
ENV = dict(os.environ, EMBER_CACHE=CACHE, EMBER_INIT=INIT)
ENV.pop("EMBER_LOG", None)
SHARES = [os.path.join(WORK, f"share{i}") for i in range(2)]
for i, d in enumerate(SHARES):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "f"), "w") as f:
        f.write(f"{i}\n")


def state(snap):
    """The snapshot's state as JSON, after its binary header: magic (8
    bytes), format version (4), payload length (8), CRC32 (4) — whose bytes
    may hold a `{` (crates/ember-vmm/src/snapshot/mod.rs, `encode`)."""
    with open(os.path.join(snap, "state"), "rb") as f:
        b = f.read()
    n = int.from_bytes(b[12:20], "little")
    return json.loads(b[24:24 + n])


def make_snapshots():
    """Both appliance snapshots, made at once: (with shares, without)."""
    if os.path.isdir(os.path.join(CACHE, "snapshots")):
        return find_snapshots()
    common = [EMBER, "run", "--backend", "ember", "--kernel", KERNEL, "--mem", "256M",
              "--cmdline", PVM_CMDLINE, "--timeout", "1800"]
    runs = [subprocess.Popen(common + extra + ["--", "true"], env=ENV, cwd=WORK,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
            for extra in (["--share", f"{SHARES[0]}:/data"], ["--initramfs"])]
    for p in runs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"making a snapshot failed ({p.returncode}): {err.decode()}")
    return find_snapshots()


def find_snapshots():
    snaps = [os.path.join(CACHE, "snapshots", d) for d in os.listdir(os.path.join(CACHE, "snapshots"))
             if not d.startswith(".")]
    shared = [s for s in snaps if any(d["config"]["kind"] == "fs" for d in state(s)["devices"])]
    plain = [s for s in snaps if s not in shared]
    if len(shared) != 1 or len(plain) != 1:
        sys.exit(f"expected one snapshot of each kind, found {snaps}")
    return shared[0], plain[0]


def pmem_slot(n):
    """A fresh file of the size of the appliance's pmem slot (`SLOT_BYTES`
    in src/appliance/warm.rs), sparse: the guest mounts it only once told to."""
    path = os.path.join(WORK, f"slot{n}.img")
    with open(path, "wb") as f:
        f.truncate(128 << 20)
    return path


def restore(snap, extra):
    ev = os.path.join(WORK, "ev.json")
    if os.path.exists(ev):
        os.remove(ev)
    done = subprocess.run([EMBER, "boot", "--restore", snap, "--channel", CHANNEL,
                           "--console", "none", "--timeout", "0.5", "--events", ev, *extra],
                          capture_output=True)
    # 124: the timeout ended the guest (waiting for its command), as meant.
    if done.returncode != 124 or not os.path.exists(ev):
        sys.exit(f"--restore {snap}: status {done.returncode}: {done.stderr.decode()} "
                 f"(kept: {WORK})")
    with open(ev) as f:
        events = json.load(f)["events"]
    return {k: next(e["t_us"] for e in events if e["kind"] == k) for k in STEPS}


def fmt(xs):
    return f"{statistics.median(xs) / 1000:.2f} ms ({min(xs) / 1000:.2f}–{max(xs) / 1000:.2f})"


print(f"EMBER={EMBER}\nROUNDS={ROUNDS}; load {os.getloadavg()[0]:.1f} at start")
SHARED, PLAIN = make_snapshots()
print(f"snapshots made; load {os.getloadavg()[0]:.1f}\n")
CHANNEL = os.path.join(WORK, "channel.sock")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
if os.path.exists(CHANNEL):
    os.remove(CHANNEL)
listener.bind(CHANNEL)
listener.listen(64)
runs = {"shared": [], "plain": []}
for r in range(ROUNDS):
    kinds = ("shared", "plain") if r % 2 == 0 else ("plain", "shared")
    for kind in kinds:
        if kind == "shared":
            extra = ["--fs", "tag=ember-root,dir=/,ro", "--fs", f"tag=ember-share0,dir={SHARES[r % 2]},ro"]
            runs[kind].append(restore(SHARED, extra))
        else:
            slot = pmem_slot(r)
            runs[kind].append(restore(PLAIN, ["--pmem", slot]))
            os.remove(slot)
    # Connections the restored guests made, never served.
    listener.setblocking(False)
    try:
        while True:
            listener.accept()[0].close()
    except BlockingIOError:
        pass
    listener.setblocking(True)
print("| appliance, PVM kernel, 256 MiB | step (from ember's start) | without shares (initramfs, pmem slot) "
      "| with the host's root and one share | difference |")
print("| --- | --- | --- | --- | --- |")
for k in STEPS:
    a = [x[k] for x in runs["plain"]]
    b = [x[k] for x in runs["shared"]]
    diff = (statistics.median(b) - statistics.median(a)) / 1000
    print(f"| 1 vCPU | {k} | {fmt(a)} | {fmt(b)} | {diff:+.2f} ms |")
print(f"\nload {os.getloadavg()[0]:.1f} at the end")
listener.close()
if not KEEP:
    subprocess.run(["rm", "-rf", WORK])
