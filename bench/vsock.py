#!/usr/bin/env python3
"""virtio-vsock throughput: the test guest's vsock driver against host
programs on ember's hybrid vsock sockets, each direction, interleaved.

Each round boots the test guest twice in fresh ember processes (order
alternating):
- guest -> host: `vsock=connect` sends SIZE bytes to `PATH_5000`, where this
  script reads them as fast as it can (timed from the connection to the last
  byte; then this script closes its side and the guest ends);
- host -> guest: `vsock=serve`; this script connects to PATH with
  `CONNECT 1234`, writes SIZE bytes and shuts its side down; the guest keeps
  them and echoes them all once it has seen the end of file. Host -> guest is
  timed from the OK line to the first echoed byte (the guest has everything
  by then), and the echo itself is a second guest -> host figure.
Bytes are checked in both directions (the echo byte for byte; the guest's
stream against its pattern).

Usage: bench/vsock.py [EMBER] [ROUNDS] [SIZE_MIB]   (defaults: target/release/ember, 10, 64)
Prints MiB/s medians (min-max) as a Markdown table. With EMBER_FC_BIN set,
nothing more happens here: a Firecracker comparison needs Debian's kernel in
the nested rig (not written yet).
"""

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBER = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target/release/ember")
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
MIB = int(sys.argv[3]) if len(sys.argv) > 3 else 64
SIZE = MIB << 20

subprocess.run(["cargo", "build", "-q", "-p", "ember-test-guest", "--release", "--target-dir",
                os.path.join(ROOT, "target/guests")], cwd=ROOT, check=True)
GUEST = os.path.join(ROOT, "target/guests/release/ember-test-guest")


def pattern(seed, i):
    x = (i * 0x9E3779B9 + seed * 7919) & (2**64 - 1)
    return (x ^ (x >> 13) ^ (i >> 8)) & 0xFF


def boot(uds, cmdline):
    return subprocess.Popen(
        [EMBER, "boot", "--kernel", GUEST, "--mem", "512M", "--timeout", "300",
         "--vsock", f"cid=3,uds={uds}", "--cmdline", cmdline],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(vm):
    out, err = vm.communicate(timeout=300)
    if vm.returncode != 0:
        sys.exit(f"ember exited {vm.returncode}:\n{out}{err}")
    return out


def guest_to_host(d):
    uds = os.path.join(d, "g.sock")
    lst = socket.socket(socket.AF_UNIX)
    lst.bind(uds + "_5000")
    lst.listen(1)
    vm = boot(uds, f"vsockport=5000 vsockbytes={SIZE} vsocksecs=120 vsock=connect")
    s, _ = lst.accept()
    t0 = time.perf_counter()
    got = 0
    first = b""
    while got < SIZE:
        c = s.recv(1 << 20)
        if not c:
            sys.exit(f"EOF after {got} bytes")
        if len(first) < 4096:
            first += c[:4096 - len(first)]
        got += len(c)
    secs = time.perf_counter() - t0
    assert all(b == pattern(1, i) for i, b in enumerate(first)), "guest bytes differ"
    # Nothing back: the guest finishes at our end of file.
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    s.close()
    lst.close()
    out = finish(vm)
    if f"sent={SIZE} received=0 ok" not in out:
        sys.exit(f"guest: {out}")
    return SIZE / secs / (1 << 20)


def host_to_guest(d):
    uds = os.path.join(d, "h.sock")
    vm = boot(uds, "vsockport=1234 vsocksecs=120 vsock=serve")
    for _ in range(500):
        if os.path.exists(uds):
            break
        time.sleep(0.01)
    s = socket.socket(socket.AF_UNIX)
    s.connect(uds)
    s.sendall(b"CONNECT 1234\n")
    line = b""
    while not line.endswith(b"\n"):
        line += s.recv(1)
    assert line.startswith(b"OK "), line
    data = os.urandom(1 << 20) * MIB
    t0 = time.perf_counter()
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    back = bytearray()
    c = s.recv(1 << 20)
    t1 = time.perf_counter()
    back += c
    while True:
        c = s.recv(1 << 20)
        if not c:
            break
        back += c
    t2 = time.perf_counter()
    if back != data:
        sys.exit(f"echo differs ({len(back)} of {len(data)} bytes)")
    finish(vm)
    return SIZE / (t1 - t0) / (1 << 20), SIZE / (t2 - t1) / (1 << 20)


def row(name, xs):
    return f"| {name} | {statistics.median(xs):.0f} | {min(xs):.0f}-{max(xs):.0f} |"


g2h, h2g, echo = [], [], []
with tempfile.TemporaryDirectory() as d:
    for r in range(ROUNDS):
        for kind in (["g2h", "h2g"] if r % 2 == 0 else ["h2g", "g2h"]):
            sub = os.path.join(d, f"{r}-{kind}")
            os.mkdir(sub)
            if kind == "g2h":
                g2h.append(guest_to_host(sub))
            else:
                a, b = host_to_guest(sub)
                h2g.append(a)
                echo.append(b)
print(f"{ROUNDS} rounds, {MIB} MiB each way, {EMBER}")
print("| direction | MiB/s (median) | min-max |")
print("|---|---|---|")
print(row("guest -> host (PATH_5000)", g2h))
print(row("host -> guest (CONNECT 1234)", h2g))
print(row("guest -> host (the echo)", echo))
