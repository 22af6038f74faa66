#!/usr/bin/env python3
"""Snapshots against cold boots, interleaved, on this host's KVM.

- test guest, 256 MiB: exec -> first guest instruction (the `first_guest_entry`
  event), cold boot vs `ember boot --restore`;
- test guest, 256 MiB with 200 MiB touched: snapshot creation time and bytes
  written (memory file, state file);
- PVM test kernel (busybox /init waiting for a command on its console), 256 MiB:
  exec -> first guest instruction, and exec -> the command's output, cold boot
  (boot to /init, then the command) vs restore of a snapshot taken at /init.

Usage: bench/snapshot.py [ROUNDS]   (default 3; a cold PVM boot takes 20-60 s)
       EMBER_BIN=path/to/ember bench/snapshot.py   (skip scripts/build-release)
Prints medians (min-max) and ratios as a Markdown table.
"""

import json
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
PVM_CMDLINE = ("console=ttyS0 noxsave noint3selftest nofxsaveleak "
               "clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase "
               "noinvpcid nopcid nopku mitigations=off reboot=k panic=-1")
COMMAND = "echo answer-$((6*7))\n"


def run(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, **kw).stdout.strip()


# EMBER_BIN: an ember already built as shipped (else scripts/build-release builds it).
EMBER = os.environ.get("EMBER_BIN") or run("scripts/build-release")
run("cargo", "build", "-q", "-p", "ember-test-guest", "--release", "--target-dir", "target/guests")
GUEST = os.path.join(ROOT, "target/guests/release/ember-test-guest")
KERNEL = os.path.join(run("scripts/pvm-kernel"), "vmlinux")
WORK = tempfile.mkdtemp(prefix="ember-snap-bench.")
INITRD = os.path.join(WORK, "busybox.cpio")
run("cargo", "run", "-q", "--example", "busybox-initrd", "--", INITRD)


class Vm:
    """An ember process whose console lines are timestamped as they arrive."""

    def __init__(self, args):
        self.start = time.monotonic()
        self.p = subprocess.Popen([EMBER, "boot", *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.p.stdout, selectors.EVENT_READ)
        self.buf = b""

    def send(self, text):
        self.p.stdin.write(text.encode())
        self.p.stdin.flush()

    def wait_for(self, marker, limit=600):
        """Seconds from exec until a console line contains `marker`."""
        deadline = time.monotonic() + limit
        while True:
            for line in self.buf.split(b"\n")[:-1]:
                if marker.encode() in line:
                    t = time.monotonic() - self.start
                    self.buf = self.buf[self.buf.index(line) + len(line) + 1:]
                    return t
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise SystemExit(f"no {marker!r} within {limit} s")
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                raise SystemExit(f"ember ended before {marker!r}")
            self.buf += chunk

    def end(self):
        self.p.kill()
        self.p.wait()


def first_entry_us(events):
    with open(events) as f:
        ev = json.load(f)["events"]
    return next(e["t_us"] for e in ev if e["kind"] == "first_guest_entry")


def snapshot(sock, to):
    out = run(EMBER, "snapshot", "--api-socket", sock, "--to", to)
    return json.loads(out)


def fmt(xs, unit, scale=1.0, digits=2):
    xs = [x * scale for x in xs]
    return f"{statistics.median(xs):.{digits}f} {unit} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


# Snapshots to restore from: the test guest spinning (after touching 200 MiB),
# the PVM kernel waiting at /init.
sock = os.path.join(WORK, "api.sock")
creates = []
for r in range(ROUNDS):
    vm = Vm(["--kernel", GUEST, "--mem", "256M", "--cmdline",
             "print=up touch=200 print=touched spin=600000", "--api-socket", sock])
    vm.wait_for("touched", 120)
    creates.append(snapshot(sock, os.path.join(WORK, "tg")))
    vm.p.wait()
vm = Vm(["--kernel", KERNEL, "--initrd", INITRD, "--mem", "256M", "--cmdline", PVM_CMDLINE,
         "--api-socket", sock])
vm.wait_for("EMBER-SNAPSHOT-READY")
pvm_snap = snapshot(sock, os.path.join(WORK, "pvm"))
vm.p.wait()

tg_cold, tg_restore, pvm = [], [], {"cold_entry": [], "restore_entry": [], "cold_cmd": [], "restore_cmd": []}
for r in range(ROUNDS):
    ev = os.path.join(WORK, "ev.json")
    # Test guest: cold boot, then restore, alternating.
    for _ in range(5):
        subprocess.run([EMBER, "boot", "--kernel", GUEST, "--mem", "256M", "--cmdline", "print=up exit=0",
                        "--events", ev], check=True, capture_output=True)
        tg_cold.append(first_entry_us(ev))
        subprocess.run([EMBER, "boot", "--restore", os.path.join(WORK, "tg"), "--timeout", "0.05",
                        "--events", ev], capture_output=True)
        tg_restore.append(first_entry_us(ev))
    # PVM: cold boot to /init then the command; restore then the command.
    vm = Vm(["--kernel", KERNEL, "--initrd", INITRD, "--mem", "256M", "--cmdline", PVM_CMDLINE,
             "--events", ev])
    vm.wait_for("EMBER-SNAPSHOT-READY")
    vm.send(COMMAND)
    pvm["cold_cmd"].append(vm.wait_for("answer-42"))
    vm.wait_for("EMBER-CMD-DONE")
    vm.p.wait()
    pvm["cold_entry"].append(first_entry_us(ev))
    vm = Vm(["--restore", os.path.join(WORK, "pvm"), "--events", ev])
    vm.send(COMMAND)
    pvm["restore_cmd"].append(vm.wait_for("answer-42"))
    vm.wait_for("EMBER-CMD-DONE")
    vm.p.wait()
    pvm["restore_entry"].append(first_entry_us(ev))
    print(f"round {r + 1}: PVM cold {pvm['cold_cmd'][-1]:.2f} s, restore {pvm['restore_cmd'][-1]:.3f} s",
          file=sys.stderr)

med = statistics.median
print(f"ROUNDS={ROUNDS}; test guest: {len(tg_cold)} boots and restores each\n")
print("| what | cold boot | restore | cold / restore |")
print("| --- | --- | --- | --- |")
print(f"| test guest, 256 MiB: exec → first guest instruction | {fmt(tg_cold, 'ms', 1e-3)} | "
      f"{fmt(tg_restore, 'ms', 1e-3)} | {med(tg_cold) / med(tg_restore):.2f}× |")
print(f"| PVM Linux, 256 MiB: exec → first guest instruction | {fmt(pvm['cold_entry'], 'ms', 1e-3)} | "
      f"{fmt(pvm['restore_entry'], 'ms', 1e-3)} | {med(pvm['cold_entry']) / med(pvm['restore_entry']):.2f}× |")
print(f"| PVM Linux, 256 MiB: exec → `echo` command's output | {fmt(pvm['cold_cmd'], 's', 1, 2)} | "
      f"{fmt(pvm['restore_cmd'], 's', 1, 3)} | {med(pvm['cold_cmd']) / med(pvm['restore_cmd']):.0f}× |")
print()
print("| snapshot of | time | memory file bytes written | state file |")
print("| --- | --- | --- | --- |")
print(f"| test guest, 256 MiB, 200 MiB touched | {fmt([c['ms'] for c in creates], 'ms', 1, 0)} | "
      f"{fmt([c['memory_bytes'] for c in creates], 'MiB', 1 / 2**20, 1)} | "
      f"{creates[0]['state_bytes'] / 1024:.0f} KiB |")
print(f"| PVM Linux at /init, 256 MiB | {pvm_snap['ms']:.0f} ms | {pvm_snap['memory_bytes'] / 2**20:.1f} MiB | "
      f"{pvm_snap['state_bytes'] / 1024:.0f} KiB |")
shutil.rmtree(WORK)
