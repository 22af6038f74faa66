#!/usr/bin/env python3
"""Times commands interleaved: round 1 runs each once, round 2 again starting one later, ….

Usage: bench/interleave.py RUNS OUT.json NAME=CMD [NAME=CMD …]

CMD is a shell command line. Each run is timed two ways:
- wall: spawn to exit, what a user waits;
- cpu: user + system time of the command and every child it waited for
  (QEMU, for `ember run`). On a shared machine wall time grows with the
  load (another engineer's build takes the CPU away from a TCG boot) while
  CPU time stays the work done, so a comparison is judged on both.

Prints, per command, the median and min–max of each, in ms, and writes every
sample to OUT.json ({"NAME": {"wall": [...], "cpu": [...]}}). A run that
fails is reported at once with the end of its stderr, and the script exits 1
after the last round, so a broken command is never silently averaged away or
left out.
"""
import json
import os
import statistics
import subprocess
import sys
import time


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    runs, out = int(sys.argv[1]), sys.argv[2]
    cmds = []
    for arg in sys.argv[3:]:
        name, sep, cmd = arg.partition("=")
        if not sep or not name or not cmd:
            sys.exit(f"interleave: bad NAME=CMD `{arg}`")
        cmds.append((name, cmd))
    res = {name: {"wall": [], "cpu": [], "failed": 0} for name, _ in cmds}
    failed = False
    for r in range(runs):
        # Each round starts one command later than the last, so no command
        # always runs first (on a quiet machine the second of two runs was
        # ~55 ms slower whatever it was).
        for name, cmd in cmds[r % len(cmds):] + cmds[:r % len(cmds)]:
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, shell=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            err = p.stderr.read()
            _, status, ru = os.wait4(p.pid, 0)
            wall = (time.perf_counter() - t0) * 1e3
            rc = os.waitstatus_to_exitcode(status)
            if rc != 0:
                failed = True
                res[name]["failed"] += 1
                tail = err.decode(errors="replace").strip().splitlines()[-5:]
                print(f"FAILED: {name} (round {r + 1}) exited {rc}: {cmd}", file=sys.stderr)
                for line in tail:
                    print(f"  | {line}", file=sys.stderr)
                continue
            res[name]["wall"].append(wall)
            res[name]["cpu"].append((ru.ru_utime + ru.ru_stime) * 1e3)
        load = open("/proc/loadavg").read().split()[0]
        print(f"  round {r + 1}/{runs} done (load {load})", file=sys.stderr)
    for name, _ in cmds:
        v = res[name]
        if not v["wall"]:
            print(f"{name:44} no successful run")
            continue
        w, c = v["wall"], v["cpu"]
        print(f"{name:44} wall {statistics.median(w):7.0f} ms ({min(w):.0f}–{max(w):.0f})"
              f"   cpu {statistics.median(c):6.0f} ms ({min(c):.0f}–{max(c):.0f})   n={len(w)}"
              + (f", {v['failed']} FAILED" if v["failed"] else ""))
    with open(out, "w") as f:
        json.dump(res, f)
    if failed:
        print("interleave: some runs FAILED (above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
