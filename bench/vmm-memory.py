#!/usr/bin/env python3
"""ember's own memory (the VMM overhead) against a reference build, interleaved.

Two measures per build and round, the builds alternated (A B A B ...):

- overhead: what `cargo bench --bench vmm` reports (BENCHMARKS §1): ember's
  peak RSS (VmHWM) minus guest memory resident, from ember's own `memory`
  event, for the test guest told to end at once (`halt`), 512 MiB, 1 vCPU,
  no console;
- breakdown: where that memory is while a guest runs (`print=up spin=MS
  exit=0`; /proc/PID/smaps read once the guest has printed its line), by
  mapping: the binary's text, read-only data, relocation records and
  relocated data, the main thread's stack, the other threads' stacks (a
  private mapping right above a guard mapping: 2 MiB ones are thread
  stacks, small ones the per-thread signal stacks Rust's std sets up), the
  allocator's memory, and the private part of them all (anonymous pages,
  the relocated data's included).

Text and read-only data are clean pages of ember's file, shared through the
page cache by every ember process on the host; the kernel maps them around
each page the code touches (fault-around, and whole large folios), so they
grow with how far apart the boot path's code lies in the binary, not only
with how much code runs. The private part is what each VMM costs the host on
top of its guest.

Usage: bench/vmm-memory.py [ROUNDS]   (default 10)
  EMBER_BIN      ember to measure (default: scripts/build-release's)
  EMBER_OLD_BIN  a reference build to alternate with (e.g. one built from an
                 older commit); builds from before `ember boot` existed are
                 run as `ember run --kernel`
  EMBER_GUEST    the test guest (default: target/guests/release/ember-test-guest)
  EMBER_VCPUS    vCPUs (default 1): each vCPU thread's stack is ember's own memory
Prints medians (min-max) in KiB as Markdown tables, and the differences of
the medians from the reference. Exits 1 when ember's vCPU threads hold more
than VCPU_STACK_BUDGET_KIB of stack each (median): the run loop is meant to
keep a small frame (see `Vcpu::park`); it was 8 KiB before the crate split
and 24 KiB when an inlined snapshot path made its frame 18 KiB.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
SPIN_MS = 2000
VCPUS = os.environ.get("EMBER_VCPUS", "1")
VCPU_STACK_BUDGET_KIB = 16


def run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def vmm_subcommand(ember):
    """`boot` where the build has it, else `run` (before the crate split)."""
    has_boot = subprocess.run([ember, "boot", "--help"], capture_output=True).returncode == 0
    return "boot" if has_boot else "run"


def overhead(ember, sub, guest, tmp):
    """(peak RSS, guest resident, overhead) in KiB from ember's memory event."""
    events = os.path.join(tmp, "ev.json")
    subprocess.run([ember, sub, "--mem", "512M", "--cpus", VCPUS, "--cmdline", "halt", "--console", "none",
                    "--kernel", guest, "--events", events],
                   check=True, stdin=subprocess.DEVNULL)
    with open(events) as f:
        ev = json.load(f)
    text = next(e["text"] for e in ev["events"] if e["kind"] == "memory")
    fig = dict(kv.split("=") for kv in text.split())
    hwm, guest_kib = int(fig["vm_hwm_kib"]), int(fig["guest_resident_kib"])
    return hwm, guest_kib, hwm - guest_kib


def smaps(pid):
    """[(start, end, perms, name, {field: KiB})] of a process."""
    out, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = (lo, hi, head[1], head[5] if len(head) > 5 else "", {})
                cur[4]["offset"] = int(head[2], 16)
                out.append(cur)
            elif head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                cur[4][head[0][:-1]] = int(head[1])
    return out


def breakdown(ember, sub, guest):
    """KiB resident by kind of mapping while the guest spins."""
    p = subprocess.Popen([ember, sub, "--mem", "512M", "--cpus", VCPUS, "--cmdline",
                          f"print=up spin={SPIN_MS} exit=0", "--kernel", guest],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    line = p.stdout.readline()
    if b"up" not in line:
        p.kill()
        sys.exit(f"vmm-memory: {ember} printed {line!r}, not the guest's line")
    time.sleep(0.2)
    maps = smaps(p.pid)
    exe = os.path.realpath(f"/proc/{p.pid}/exe")
    p.stdout.read()
    if p.wait() != 0:
        sys.exit(f"vmm-memory: {ember} exited {p.returncode}")
    kinds = {}
    private = 0
    for i, (lo, hi, perms, name, f) in enumerate(maps):
        rss = f.get("Rss", 0)
        if not rss:
            continue
        # A thread's stack (and its signal stack) lies right above its guard.
        guarded = i > 0 and maps[i - 1][1] == lo and maps[i - 1][2].startswith("---")
        if name == exe:
            if "x" in perms:
                kind = "text"
            elif "w" in perms:
                kind = "data (relocated)"
            elif f["offset"] == 0:
                # The first segment: ELF headers and the relocation records
                # a static-pie binary reads to relocate itself at start.
                kind = "relocation records"
            else:
                kind = "rodata"
        elif name == "[stack]":
            kind = "stack: main"
        elif name.startswith("["):
            kind = "heap" if name == "[heap]" else None
        elif name:
            kind = None  # KVM's vCPU page, memfd or pmem files: not ember's own memory
        elif guarded and hi - lo >= 1 << 20:
            kind = "stacks: other threads"
        elif guarded:
            kind = "stacks: signal"
        elif hi - lo >= 2 << 20 and lo % (2 << 20) == 0:
            kind = None  # guest memory
        else:
            kind = "heap"  # musl's allocator maps small regions of its own
        if kind is None:
            continue
        kinds[kind] = kinds.get(kind, 0) + rss
        # Anonymous pages: the process's own, including the relocated data's
        # copied-on-write pages. (Not Private_Dirty: a binary written moments
        # ago has dirty page-cache pages until writeback, and smaps counts
        # its text as dirty then.)
        private += f.get("Anonymous", 0)
    kinds["private (per VMM)"] = private
    return kinds


def fmt(xs):
    if not xs:
        return "–"
    return f"{statistics.median(xs):.0f} ({min(xs)}–{max(xs)})"


def main():
    guest = os.environ.get("EMBER_GUEST") or os.path.join(
        ROOT, "target/guests/release/ember-test-guest")
    if not os.path.exists(guest):
        sys.exit(f"vmm-memory: no test guest at {guest} (cargo test builds it; or set EMBER_GUEST)")
    builds = [("ember", os.environ.get("EMBER_BIN") or run("scripts/build-release"))]
    if os.environ.get("EMBER_OLD_BIN"):
        builds.insert(0, ("reference", os.environ["EMBER_OLD_BIN"]))
    subs = {name: vmm_subcommand(b) for name, b in builds}
    res = {name: {} for name, _ in builds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ROUNDS):
            for name, ember in builds:
                hwm, g, oh = overhead(ember, subs[name], guest, tmp)
                for k, v in (("peak RSS (VmHWM)", hwm), ("guest resident", g), ("VMM overhead", oh)):
                    res[name].setdefault(k, []).append(v)
                for k, v in breakdown(ember, subs[name], guest).items():
                    res[name].setdefault(k, []).append(v)
            load = open("/proc/loadavg").read().split()[0]
            print(f"  round {r + 1}/{ROUNDS} done (load {load})", file=sys.stderr)
    for name, ember in builds:
        print(f"- {name}: `{ember} {subs[name]}`")
    print()
    keys = []
    for name, _ in builds:
        keys += [k for k in res[name] if k not in keys]
    head = " | ".join(f"{name}, KiB" for name, _ in builds)
    diff = len(builds) == 2
    print(f"| measure | {head} |" + (" ember − reference |" if diff else ""))
    print("| --- " * (len(builds) + 1 + diff) + "|")
    for k in keys:
        cells = " | ".join(fmt(res[name].get(k, [])) for name, _ in builds)
        row = f"| {k} | {cells} |"
        if diff:
            a, b = (res[name].get(k, []) for name, _ in builds)
            row += f" {statistics.median(b) - statistics.median(a):+.0f} |" if a and b else " – |"
        print(row)
    stacks = res["ember"].get("stacks: other threads", [0])
    per_vcpu = statistics.median(stacks) / int(VCPUS)
    print(f"\nember's stack per vCPU thread: {per_vcpu:.0f} KiB (budget {VCPU_STACK_BUDGET_KIB})")
    print(f"{VCPUS} vCPU(s), 512 MiB; overhead: halt at once, VmHWM − guest resident; the rest: "
          f"while the guest spins ({SPIN_MS} ms), {ROUNDS} rounds, builds alternated")
    if per_vcpu > VCPU_STACK_BUDGET_KIB:
        print(f"vmm-memory: FAILED: each vCPU thread holds {per_vcpu:.0f} KiB of stack, "
              f"over the {VCPU_STACK_BUDGET_KIB} KiB budget: look for a large frame "
              "inlined into the run loop (objdump the release build's Vcpu::run)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
