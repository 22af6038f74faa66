#!/usr/bin/env bash
# `ember run` on the host's root against virtme-ng (`vng`), which runs a
# host command the same way (the host's root over virtio-fs, QEMU with
# virtiofsd): `-- true` and `-- python3 -c pass`, the same kernel (the
# appliance's Debian kernel, the bzImage both boot), both on QEMU/TCG with
# 256 MiB and one vCPU, interleaved (bench/interleave.py: wall and CPU time,
# medians, min–max), then the ratios vng ÷ ember.
#
# Usage: bench/hostroot-vng.sh [RUNS]   (default 5; needs `ember setup` done)
# vng comes from PyPI (`pip install virtme-ng`): $VNG, else `vng` on PATH,
# else it is installed once into a venv in ember's cache.
set -euo pipefail

RUNS=${1:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# EMBER=PATH times another ember build (default: the shipped one).
EMBER=${EMBER:-$(scripts/build-release)}
cargo build --release -q -p ember-init
export EMBER_INIT=$ROOT/target/release/ember-init
CACHE=${EMBER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ember}
VER=$(cat "$CACHE/kernel/current" 2>/dev/null) || {
    echo "hostroot-vng.sh: run \`ember setup\` first" >&2
    exit 1
}
KERNEL=$CACHE/kernel/$VER/boot/vmlinuz-$VER

VNG=${VNG:-$(command -v vng || true)}
if [ -z "$VNG" ]; then
    venv=$CACHE/bench/vng-venv
    if [ ! -x "$venv/bin/vng" ]; then
        echo "hostroot-vng.sh: installing virtme-ng into $venv" >&2
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q virtme-ng
    fi
    VNG=$venv/bin/vng
fi

# The system's python3 for both (a pyenv or venv shim on the caller's PATH
# would be timed too); the same PATH for both tools, with vng's directory
# (it runs virtme-run from there) and cargo's (the Rust virtiofsd, which
# vng also starts; without one it falls back to 9p, which Debian's cloud
# kernel lacks) last.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$(dirname "$VNG"):${CARGO_HOME:-$HOME/.cargo}/bin
WORK=$(mktemp -d /tmp/ember-bench.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

echo "host: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); kernel $VER"
echo "$(qemu-system-x86_64 --version | head -1); $("$VNG" --version 2>&1 | head -1); $("$EMBER" --version)"
echo "runs: $RUNS, interleaved"
E="$EMBER run --backend qemu --kernel $KERNEL --mem 256M --cpus 1 --"
V="$VNG --run $KERNEL --disable-kvm -m 256M -p 1 --"
python3 "$ROOT/bench/interleave.py" "$RUNS" "$WORK/samples.json" \
    "ember run -- true=$E true" \
    "vng -- true=$V true" \
    "ember run -- python3 -c pass=$E python3 -c pass" \
    "vng -- python3 -c pass=$V python3 -c pass"
python3 - "$WORK/samples.json" <<'EOF'
import json, statistics, sys
s = json.load(open(sys.argv[1]))
m = lambda n, k: statistics.median(s[n][k])
for cmd in ["true", "python3 -c pass"]:
    e, v = f"ember run -- {cmd}", f"vng -- {cmd}"
    print(f"{cmd:16} vng ÷ ember: wall {m(v, 'wall') / m(e, 'wall'):.2f}x, "
          f"cpu {m(v, 'cpu') / m(e, 'cpu'):.2f}x")
EOF
