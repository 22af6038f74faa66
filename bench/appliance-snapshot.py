#!/usr/bin/env python3
"""The appliance from its snapshot against its cold boot, interleaved, on the
PVM test kernel (`ember run --backend ember`, src/appliance/warm.rs).

- first run: a cold boot that snapshots the appliance at READY, then the
  command (once, in a fresh cache);
- cold: `ember run --no-snapshot` (the whole appliance booted for the command);
- restored: `ember run` restoring the snapshot, the command's files in its
  per-run root image.

Each: exec of `ember run` -> the command's output line, and -> ember's exit.
(Restore -> first guest instruction is bench/snapshot.py's: `ember run` stops
its VMM as soon as the command's status arrives, before it writes `--events`.)

Usage: bench/appliance-snapshot.py [ROUNDS]   (default 3; a cold boot is 20-60 s)
       EMBER_BIN=path/to/ember bench/appliance-snapshot.py   (skip scripts/build-release)
Prints medians (min-max) and the ratio as Markdown.
"""

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
COMMAND = ["sh", "-c", "echo answer-$((6*7))"]


def run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()


EMBER = os.environ.get("EMBER_BIN") or run("scripts/build-release")
run("cargo", "build", "-q", "--release", "-p", "ember-init")
INIT = os.path.join(ROOT, "target/release/ember-init")
KERNEL = os.path.join(run("scripts/pvm-kernel"), "vmlinux")
WORK = tempfile.mkdtemp(prefix="ember-appliance-snap-bench.")
ENV = dict(os.environ, EMBER_CACHE=os.path.join(WORK, "cache"), EMBER_INIT=INIT)
ENV.pop("EMBER_LOG", None)


def ember_run(*extra):
    """Seconds from exec to the output line and to exit."""
    start = time.monotonic()
    p = subprocess.Popen([EMBER, "run", "--backend", "ember", "--kernel", KERNEL, "--mem", "256M",
                          "--cmdline", PVM_CMDLINE, "--timeout", "900", *extra,
                          "--", *COMMAND],
                         env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    out, t_out = b"", None
    while True:
        sel.select()
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        out += chunk
        if t_out is None and b"answer-42\n" in out:
            t_out = time.monotonic() - start
    err = p.stderr.read()
    code = p.wait()
    t_exit = time.monotonic() - start
    if code != 0 or t_out is None:
        raise SystemExit(f"ember run failed ({code}): {out!r}\n{err.decode(errors='replace')}")
    return t_out, t_exit


def fmt(xs, unit, digits=2):
    return f"{statistics.median(xs):.{digits}f} {unit} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


first_out, first_exit = ember_run()
snaps = os.listdir(os.path.join(WORK, "cache", "snapshots"))
assert len([s for s in snaps if not s.startswith(".")]) == 1, snaps
cold, warm = {"out": [], "exit": []}, {"out": [], "exit": []}
for r in range(ROUNDS):
    o, e = ember_run("--no-snapshot")
    cold["out"].append(o)
    cold["exit"].append(e)
    o, e = ember_run()
    warm["out"].append(o)
    warm["exit"].append(e)
    print(f"round {r + 1}/{ROUNDS}: cold {cold['out'][-1]:.2f} s, restored {o:.2f} s", file=sys.stderr)

ratio = statistics.median(cold["out"]) / statistics.median(warm["out"])
print(f"ember {EMBER}, {ROUNDS} rounds, command {' '.join(COMMAND)!r}, 256 MiB\n")
print("| what | cold boot (`--no-snapshot`) | restored | cold / restored |")
print("| --- | --- | --- | --- |")
print(f"| exec → the command's output | {fmt(cold['out'], 's')} | {fmt(warm['out'], 's')} | **{ratio:.1f}×** |")
print(f"| exec → ember's exit | {fmt(cold['exit'], 's')} | {fmt(warm['exit'], 's')} | "
      f"{statistics.median(cold['exit']) / statistics.median(warm['exit']):.1f}× |")
print(f"\nfirst run (cold boot + snapshot at READY + the command): output at {first_out:.2f} s, "
      f"exit at {first_exit:.2f} s")
shutil.rmtree(WORK, ignore_errors=True)
