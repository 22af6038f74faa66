#!/usr/bin/env python3
"""Restore -> first guest instruction: two ember builds, interleaved.

One snapshot of the test guest (256 MiB, 200 MiB touched, spinning) per vCPU
count and build (each restores its own: the state format may differ); then
ROUNDS rounds, each restoring once with A and once with B (order
alternating), in fresh processes, with --events. A restore that fails stops
the bench with its message. The
figure is the `first_guest_entry` event (us from ember's start: recorded on
vCPU 0's thread just before its first KVM_RUN), with the steps before it
(`kvm_open`: the state file read and checked; `memory_ready`: the VM, guest
memory and irqchip there; `vcpus_created`: every vCPU and the irqchip/PIT/
clock state set).

Usage: bench/restore.py EMBER_A EMBER_B [ROUNDS]   (default 30)
Prints medians (min-max) and B/A as a Markdown table.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A, B = sys.argv[1], sys.argv[2]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 30
subprocess.run(["cargo", "build", "-q", "-p", "ember-test-guest", "--release", "--target-dir",
                "target/guests"], check=True, cwd=ROOT)
GUEST = os.path.join(ROOT, "target/guests/release/ember-test-guest")
WORK = tempfile.mkdtemp(prefix="ember-restore-bench.")
STEPS = ["kvm_open", "memory_ready", "vcpus_created", "first_guest_entry"]


def snapshot(cpus, ember, name):
    sock = os.path.join(WORK, f"api{cpus}{name}.sock")
    vm = subprocess.Popen([ember, "boot", "--kernel", GUEST, "--mem", "256M", "--cpus", str(cpus),
                           "--cmdline", "print=up touch=200 print=touched spin=600000",
                           "--api-socket", sock], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    for line in vm.stdout:
        if b"touched" in line:
            break
    to = os.path.join(WORK, f"snap{cpus}{name}")
    subprocess.run([ember, "snapshot", "--api-socket", sock, "--to", to], check=True,
                   capture_output=True)
    vm.wait()
    return to


def restore(ember, snap):
    ev = os.path.join(WORK, "ev.json")
    if os.path.exists(ev):
        os.remove(ev)
    done = subprocess.run([ember, "boot", "--restore", snap, "--timeout", "0.05", "--events", ev],
                          capture_output=True)
    # 124: the timeout ended the spinning guest, as meant.
    if done.returncode != 124 or not os.path.exists(ev):
        sys.exit(f"{ember} --restore {snap}: status {done.returncode}: {done.stderr.decode()}")
    with open(ev) as f:
        events = json.load(f)["events"]
    return {k: next(e["t_us"] for e in events if e["kind"] == k) for k in STEPS}


def fmt(xs):
    return f"{statistics.median(xs) / 1000:.2f} ms ({min(xs) / 1000:.2f}–{max(xs) / 1000:.2f})"


print(f"A={A}\nB={B}\nROUNDS={ROUNDS}; load {os.getloadavg()[0]:.1f} at start\n")
print("| test guest, 256 MiB | step (µs from ember's start) | A | B | B / A |")
print("| --- | --- | --- | --- | --- |")
for cpus in (1, 2):
    snaps = {A: snapshot(cpus, A, "a"), B: snapshot(cpus, B, "b")}
    runs = {A: [], B: []}
    for r in range(ROUNDS):
        for ember in ((A, B) if r % 2 == 0 else (B, A)):
            runs[ember].append(restore(ember, snaps[ember]))
    for k in STEPS:
        a = [x[k] for x in runs[A]]
        b = [x[k] for x in runs[B]]
        print(f"| {cpus} vCPU | {k} | {fmt(a)} | {fmt(b)} | {statistics.median(b) / statistics.median(a):.2f}× |")
print(f"\nload {os.getloadavg()[0]:.1f} at the end")
subprocess.run(["rm", "-rf", WORK])
