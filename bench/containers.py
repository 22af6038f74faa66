#!/usr/bin/env python3
"""Container start time: `ctr run` and `docker run` → the workload's first
output line, ember against runc, on the same image, interleaved.

Usage: bench/containers.py RUNS OUT.json [BIN_DIR]

BIN_DIR holds containerd-shim-ember-v2, ember-oci, ember-agent and ember
(default: target/debug, build them first: `cargo build -p ember
-p containerd-shim-ember-v2 -p ember-oci -p ember-agent`). Needs root,
containerd, dockerd (docker.io), umoci, busybox-static, QEMU.

The script starts its own containerd and dockerd (each with its own root,
state and socket in a temporary directory; dockerd in a network namespace
of its own) and stops them, whatever happens. The image is busybox, built
here: with umoci and `ctr images import` for containerd, `docker import`ed
for Docker. Four commands, each round in a rotated order:

  ctr-runc     ctr run --rm IMAGE ID sh -c 'echo first; …'
  ctr-ember    the same with --runtime io.containerd.ember.v2
  docker-runc  docker run --rm IMAGE sh -c 'echo first; …'
  docker-ember the same with --runtime ember (ember-oci, daemon.json)

Each is timed from spawning the client to the first line on its stdout
(`first`) and to its exit (`total`: the VM's shutdown and the clean-up
included). On this host ember's VMs boot on the QEMU backend under TCG (a
software KVM cannot run guest kernels fast). Prints median and min–max per
command, in ms, and ember/runc ratios; writes every sample to OUT.json.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOAD = "echo first; uname -r"


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def first_line(argv, env=None):
    """Spawns argv; returns (ms to the first stdout line, ms to exit, line)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    line = p.stdout.readline()
    t1 = time.monotonic()
    rest, err = p.communicate(timeout=600)
    t2 = time.monotonic()
    if p.returncode != 0 or line.strip() != b"first":
        raise RuntimeError(f"{argv}: status {p.returncode}, first line {line!r}, "
                           f"stderr {err.decode(errors='replace')[-400:]}")
    return (t1 - t0) * 1000, (t2 - t0) * 1000, line


def build_rootfs(root):
    rootfs = os.path.join(root, "rootfs")
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev"):
        os.makedirs(os.path.join(rootfs, d))
    shutil.copy(shutil.which("busybox"), os.path.join(rootfs, "bin/busybox"))
    for a in ("sh", "echo", "uname", "cat"):
        os.symlink("busybox", os.path.join(rootfs, "bin", a))
    return rootfs


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    runs, out = int(sys.argv[1]), sys.argv[2]
    bindir = os.path.abspath(sys.argv[3] if len(sys.argv) > 3 else "target/debug")
    for b in ("containerd-shim-ember-v2", "ember-oci", "ember-agent", "ember"):
        if not os.access(os.path.join(bindir, b), os.X_OK):
            sys.exit(f"containers: {b} missing in {bindir}")
    tmp = tempfile.mkdtemp(prefix="ember-bench-containers-")
    netns = f"ember-bench-{os.getpid()}"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}",
               EMBER_SHIM_BACKEND="qemu", EMBER_OCI_BACKEND="qemu")
    procs = []
    try:
        ctr, rootfs = containerd_with_image(tmp, env, procs)
        image = "localhost/bench:latest"
        # dockerd, in a namespace of its own, with ember-oci registered.
        run(["ip", "netns", "add", netns])
        run(["ip", "-n", netns, "link", "set", "lo", "up"])
        with open(os.path.join(tmp, "daemon.json"), "w") as f:
            json.dump({"runtimes": {"ember": {"path": os.path.join(bindir, "ember-oci")}}}, f)
        dsock = os.path.join(tmp, "docker.sock")
        dlog = open(os.path.join(tmp, "dockerd.log"), "w")
        procs.append(subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{netns}", "dockerd",
             "--config-file", os.path.join(tmp, "daemon.json"), "--data-root", f"{tmp}/d-data",
             "--exec-root", f"{tmp}/d-exec", "--pidfile", f"{tmp}/docker.pid",
             "-H", f"unix://{dsock}", "--iptables=false", "--ip-masq=false",
             "--bip", "10.213.9.1/24"], stdout=dlog, stderr=dlog, env=env))
        docker = ["/usr/bin/docker", "-H", f"unix://{dsock}"]
        wait_up(docker + ["version"])
        tar = subprocess.run(["tar", "-C", rootfs, "-c", "."], check=True, capture_output=True).stdout
        subprocess.run(docker + ["import", "-", "bench:latest"], input=tar, check=True, capture_output=True)

        n = [0]

        def ctr_run(runtime):
            n[0] += 1
            extra = ["--runtime", runtime] if runtime else []
            return ctr + ["run", "--rm"] + extra + [image, f"bench{n[0]}", "sh", "-c", WORKLOAD]

        def docker_run(runtime):
            extra = ["--runtime", runtime] if runtime else []
            return docker + ["run", "--rm"] + extra + ["bench:latest", "sh", "-c", WORKLOAD]

        cmds = [
            ("ctr-runc", lambda: ctr_run(None)),
            ("ctr-ember", lambda: ctr_run("io.containerd.ember.v2")),
            ("docker-runc", lambda: docker_run(None)),
            ("docker-ember", lambda: docker_run("ember")),
        ]
        res = {name: {"first": [], "total": []} for name, _ in cmds}
        # A warm-up of each (image unpacking, the appliance's cache), not counted.
        for name, argv in cmds:
            first_line(argv(), env)
        for r in range(runs):
            for i in range(len(cmds)):
                name, argv = cmds[(r + i) % len(cmds)]
                f, t, _ = first_line(argv(), env)
                res[name]["first"].append(f)
                res[name]["total"].append(t)
                print(f"round {r + 1} {name}: first line {f:.0f} ms, exit {t:.0f} ms", flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\n{runs} runs each, load {os.getloadavg()[0]:.1f}")
        print(f"{'command':14} {'first line median (min–max)':34} {'exit median (min–max)'}")
        for name, _ in cmds:
            fs, ts = res[name]["first"], res[name]["total"]
            print(f"{name:14} {statistics.median(fs):7.0f} ms ({min(fs):.0f}–{max(fs):.0f})"
                  f"{'':13} {statistics.median(ts):7.0f} ms ({min(ts):.0f}–{max(ts):.0f})")
        for tool in ("ctr", "docker"):
            e = statistics.median(res[f"{tool}-ember"]["first"])
            r_ = statistics.median(res[f"{tool}-runc"]["first"])
            print(f"{tool}: ember / runc, first line: {e / r_:.1f}x")
    finally:
        teardown(procs, tmp, [netns])


def containerd_with_image(tmp, env, procs):
    """Starts a containerd of its own under `tmp` (appended to `procs`, for
    `teardown`) and imports a busybox image built with umoci as
    localhost/bench:latest: the `ctr` command line that talks to it, and the
    image's root directory."""
    rootfs = build_rootfs(tmp)
    sock = os.path.join(tmp, "containerd.sock")
    with open(os.path.join(tmp, "containerd.toml"), "w") as f:
        f.write(f'version = 2\nroot = "{tmp}/c-root"\nstate = "{tmp}/c-state"\n'
                f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n')
    log = open(os.path.join(tmp, "containerd.log"), "w")
    procs.append(subprocess.Popen(["containerd", "--config", os.path.join(tmp, "containerd.toml")],
                                  stdout=log, stderr=log, env=env))
    ctr = ["ctr", "--address", sock]
    wait_up(ctr + ["version"])
    layout = os.path.join(tmp, "oci")
    run(["umoci", "init", "--layout", layout])
    run(["umoci", "new", "--image", f"{layout}:latest"])
    run(["umoci", "unpack", "--image", f"{layout}:latest", os.path.join(tmp, "bundle")])
    shutil.rmtree(os.path.join(tmp, "bundle/rootfs"))
    shutil.copytree(rootfs, os.path.join(tmp, "bundle/rootfs"), symlinks=True)
    run(["umoci", "repack", "--image", f"{layout}:latest", os.path.join(tmp, "bundle")])
    run(["tar", "-C", layout, "-cf", os.path.join(tmp, "image.tar"), "."])
    run(ctr + ["images", "import", "--base-name", "localhost/bench", os.path.join(tmp, "image.tar")])
    return ctr, rootfs


def teardown(procs, tmp, namespaces):
    """Stops the daemons in `procs` (last started first), kills what a
    failure left mentioning `tmp` (shims, supervisors, VMs), unmounts what is
    mounted below it, deletes the network namespaces and removes `tmp`."""
    for p in reversed(procs):
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if tmp.encode() in f.read():
                        os.kill(int(pid), 9)
            except OSError:
                pass
    time.sleep(1)
    with open("/proc/self/mountinfo") as f:
        points = [l.split()[4] for l in f if l.split()[4].startswith(tmp)]
    for p in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", p], capture_output=True)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(tmp, ignore_errors=True)


def wait_up(argv):
    deadline = time.monotonic() + 90
    while subprocess.run(argv, capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{argv[0]} did not come up")
        time.sleep(0.25)


if __name__ == "__main__":
    main()
