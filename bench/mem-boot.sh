#!/usr/bin/env bash
# Boot time against memory size, and what virtio-mem (`--mem-boot`) changes:
# `ember run -- true` (spawn to exit) with 512 MiB, 4 GiB and 8 GiB of
# guest memory given at boot, against 8 GiB as 512 MiB of boot RAM plus a
# virtio-mem region the guest plugs as it boots; and spawn to "all of it
# usable" (the command waits until MemTotal passes 7.5 GiB) for the latter.
# Interleaved (bench/interleave.py): medians and min–max of wall and CPU
# time, then each case's ratio to 512 MiB.
#
# Usage: bench/mem-boot.sh [RUNS]        (default 5; needs `ember setup` done)
#   BACKEND=qemu (default): Debian's cloud kernel under QEMU/TCG, the
#     region a virtio-mem-pci device (q35);
#   BACKEND=ember: ember's own device (needs a kernel KVM runs natively, or
#     KERNEL=… CMDLINE=… for the PVM test kernel on a software KVM).
#   EMBER=PATH: the ember binary (default: scripts/build-release's).
set -euo pipefail

RUNS=${1:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
EMBER=${EMBER:-$(scripts/build-release)}
BACKEND=${BACKEND:-qemu}
cargo build --release -q -p ember-init
export EMBER_INIT=$ROOT/target/release/ember-init
WORK=$(mktemp -d /tmp/ember-bench-mem.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

run="$EMBER run --backend $BACKEND --initramfs --timeout 600"
[ -n "${KERNEL:-}" ] && run="$run --kernel $KERNEL"
[ -n "${CMDLINE:-}" ] && run="$run --cmdline '$CMDLINE'"
# Waits (at most 120 s) until MemTotal passes 7.5 GiB: all plugged, onlined.
full='i=0; while [ $(grep MemTotal /proc/meminfo | tr -dc 0-9) -lt 7864320 ] \
  && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; [ $i -lt 1200 ]'

echo "mem-boot.sh: $(date -u '+%F %H:%M UTC'), backend $BACKEND, $RUNS rounds, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
python3 bench/interleave.py "$RUNS" "$WORK/out.json" \
  "512M=$run --mem 512M -- true" \
  "4G=$run --mem 4G -- true" \
  "8G=$run --mem 8G -- true" \
  "8G-mem-boot-512M=$run --mem 8G --mem-boot 512M -- true" \
  "8G-mem-boot-512M-full=$run --mem 8G --mem-boot 512M -- sh -c '$full'"
python3 - "$WORK/out.json" <<'EOF'
import json, statistics, sys
res = json.load(open(sys.argv[1]))
base = {k: statistics.median(res["512M"][k]) for k in ("wall", "cpu")}
print("ratio to 512M (median wall, median cpu):")
for name, v in res.items():
    if v["wall"]:
        print(f"  {name:28} {statistics.median(v['wall']) / base['wall']:.2f}x"
              f"  {statistics.median(v['cpu']) / base['cpu']:.2f}x")
EOF
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
