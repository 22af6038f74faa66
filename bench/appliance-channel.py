#!/usr/bin/env python3
"""Throughput of `ember run`'s stdout on the ember backend (the appliance's
channel), two ember binaries interleaved, on the PVM test kernel, from the
appliance's snapshot.

Each round runs, for each binary: `ember run --backend ember -- true` (the
run's fixed cost: restore, command, power-off) and `ember run --backend
ember -- head -c BYTES /dev/zero`, its stdout counted on the host. The
throughput is BYTES over the difference of the two wall times. Each binary
has its own cache, warmed by one untimed run (a cold boot that makes its
snapshot). The order of the binaries alternates per round.

Usage: EMBER_PVM_KERNEL=DIR bench/appliance-channel.py [ROUNDS] [BYTES] NAME=EMBER[,INIT] …
  INIT: the ember-init the binary runs (EMBER_INIT), if not its own.
Prints per binary the median (min-max) of each time and of the throughput,
with the load average, as Markdown.
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The PVM test kernel's command line (tests/common/mod.rs PVM_CMDLINE).
PVM_CMDLINE = (
    "console=ttyS0 noxsave noint3selftest nofxsaveleak "
    "clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase noinvpcid nopcid nopku "
    "mitigations=off reboot=k panic=-1"
)


def run(binary, init, cache, kernel, cmd):
    """Runs `ember run` with `cmd`; returns (seconds, stdout bytes)."""
    env = dict(os.environ, EMBER_CACHE=cache)
    env.pop("EMBER_LOG", None)
    if init:
        env["EMBER_INIT"] = init
    help_text = subprocess.run([binary, "run", "--help"], capture_output=True, text=True).stdout
    # Older binaries boot the initramfs without being asked (no host root).
    root = ["--initramfs"] if "--initramfs" in help_text else []
    argv = [binary, "run", "--backend", "ember", *root, "--mem", "128M",
            "--kernel", kernel, "--cmdline", PVM_CMDLINE, "--timeout", "900", "--", *cmd]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    n = 0
    while chunk := p.stdout.read(1 << 16):
        n += len(chunk)
    err = p.stderr.read()
    rc = p.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"{binary} {cmd}: exit {rc}\n{err.decode(errors='replace')[-2000:]}")
    return wall, n


def med(xs):
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main():
    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and args[0].isdigit() else 3
    size = int(args.pop(0)) if args and args[0].isdigit() else 8 << 20
    kdir = os.environ.get("EMBER_PVM_KERNEL")
    if not kdir or not args:
        sys.exit(__doc__)
    kernel = os.path.join(kdir, "vmlinux")
    bins = []
    for a in args:
        name, _, rest = a.partition("=")
        binary, _, init = rest.partition(",")
        bins.append((name, binary, init or None))
    scratch = tempfile.mkdtemp(prefix="ember-bench-channel-")
    try:
        caches = {name: os.path.join(scratch, name) for name, _, _ in bins}
        for name, binary, init in bins:
            run(binary, init, caches[name], kernel, ["true"])
        res = {name: {"true": [], "head": [], "kbs": []} for name, _, _ in bins}
        loads = []
        for r in range(rounds):
            order = bins[r % len(bins):] + bins[:r % len(bins)]
            for name, binary, init in order:
                t, _ = run(binary, init, caches[name], kernel, ["true"])
                h, n = run(binary, init, caches[name], kernel, ["head", "-c", str(size), "/dev/zero"])
                if n != size:
                    sys.exit(f"{name}: {n} bytes of {size}")
                res[name]["true"].append(t)
                res[name]["head"].append(h)
                res[name]["kbs"].append(size / 1024 / max(h - t, 1e-3))
                loads.append(os.getloadavg()[0])
                print(f"round {r + 1} {name}: true {t:.1f} s, head {h:.1f} s, "
                      f"{res[name]['kbs'][-1]:.0f} KiB/s", file=sys.stderr)
        print(f"{rounds} rounds, {size} bytes, load {min(loads):.1f}-{max(loads):.1f}\n")
        print("| binary | `true` s | `head -c` s | stdout KiB/s |")
        print("|---|---|---|---|")
        for name, _, _ in bins:
            x = res[name]
            print(f"| {name} | {med(x['true'])} | {med(x['head'])} | {med(x['kbs'])} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
