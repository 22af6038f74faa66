#!/usr/bin/env bash
# virtio-fs in the nested rig (issue 25 item 5): ember's own device
# (`ember boot --fs`, served in ember's I/O thread) against QEMU microvm's
# vhost-user-fs device served by the Rust virtiofsd, in ONE run, boots
# interleaved round by round (order alternating).
#
# The rig is `ember run --backend qemu --nested-kvm` (an L1 under QEMU/TCG
# with kvm-amd). Inside, bench/rig-fs-inner.sh puts the share on a tmpfs in
# the L1 and boots Debian's cloud kernel (its own fuse and virtiofs modules,
# a busybox initramfs: bench/rig-fs-l2.sh) under each VMM, both serving that
# same directory. Each boot runs the workload once to warm up (its first
# pass is up to 5x slower: the guest's and the L1's first touches of guest
# memory; not counted), then ITER times, each phase timed by the guest's
# /proc/uptime (10 ms steps):
#   write   dd MB MiB from /dev/zero into the share, bs=1M, conv=fsync
#   read    dd it back to /dev/null after the guest's caches are dropped
#   create  one `touch` of N new empty files
#   stat    one `stat` of the N files after the caches are dropped (LOOKUP+GETATTR)
#   unlink  one `rm` of the N files
# Both servers keep entries and attributes 1 s (ember's fixed timeout;
# virtiofsd --cache=auto), neither has the writeback cache or DAX;
# virtiofsd runs with --sandbox=none (the L1's root is an initramfs, where
# its namespace sandbox cannot pivot_root; ember does not chroot either).
# Under TCG every figure is slow and the guest's own kernel is in each: read
# the ratios.
#
# Usage: bench/rig-fs.sh [ROUNDS]          (default 3)
# Environment:
#   EMBER_BIN    ember to measure (default: scripts/build-release)
#   VIRTIOFSD    the vhost-user-fs daemon (default: virtiofsd on PATH)
#   ITER=2 MB=64 N=100   workload repetitions per boot, file MiB, small files
set -euo pipefail
ROUNDS=${1:-3}
ITER=${ITER:-2}
MB=${MB:-64}
N=${N:-100}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

NAME=rig-fs.sh
. bench/rig-lib.sh
rig_begin
QEMU=$(rig_need qemu-system-x86_64) || exit 1
VIRTIOFSD=${VIRTIOFSD:-$(rig_need virtiofsd)} || exit 1
VER=$(basename "$KDIR")
MODS=$KDIR/lib/modules/$VER

mkdir -p "$R/qemu-share"

rig_guest "$KDIR" "$R" "$I" "$BUSYBOX"
# The L2's modules with their dependencies (modules.dep), in load order.
mkdir -p "$I/ko"
for m in virtio_mmio virtiofs; do
  awk -v m="/$m.ko" 'index($1, m ":") { n = split($0, a, /:? +/)
    for (i = n; i >= 2; i--) print a[i]; sub(/:$/, "", a[1]); print a[1] }' "$MODS/modules.dep"
done | awk '!seen[$0]++' | while read -r p; do
  cp "$MODS/$p" "$I/ko/"
  basename "$p" >> "$I/ko/list"
done
[ -s "$I/ko/list" ] || { say "$NAME: no virtiofs module in $MODS"; exit 1; }
cp bench/rig-fs-l2.sh "$I/init"
rig_cpio "$I" "$R/initrd.cpio"
rig_stage "$EMBER" "$R/ember"
for f in bios-microvm.bin qboot.rom linuxboot_dma.bin pvh.bin; do
  [ -e "/usr/share/qemu/$f" ] && cp -L "/usr/share/qemu/$f" "$R/qemu-share/"
done
cp bench/rig-fs-inner.sh "$R/"

say "$NAME: $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds × $ITER; $MB MiB, $N files"
say "$NAME: $("$VIRTIOFSD" --version 2>&1 | head -1); $("$QEMU" --version | head -1); booting the rig (L1) ..."
OUT=$WORK/out
rig_l1 "$OUT" --mem 2G --timeout 1500 --file "$R:/rig" --file "$QEMU:/usr/bin/qemu-system-x86_64" \
  --file "$VIRTIOFSD:/usr/bin/virtiofsd" --file "$BUSYBOX:/bin/busybox" \
  --env "ROUNDS=$ROUNDS" --env "ITER=$ITER" --env "MB=$MB" --env "N=$N" \
  -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-fs-inner.sh'
grep -q '^RIG-FS ' "$OUT" || { say "$NAME: the rig measured nothing"; cat "$OUT" >&2; exit 1; }
[ -n "${RIG_OUT:-}" ] && cp "$OUT" "$RIG_OUT"
say "$NAME: done at load $(cut -d' ' -f1-3 /proc/loadavg)"

# RIG-FS <vmm> <round> <iter> <write s> <read s> <create s> <stat s> <unlink s>
tr -d '\r' < "$OUT" | awk -v mb="$MB" -v n="$N" '
function median(a, c,   i, j, t) {
  for (i = 2; i <= c; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (c % 2) ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2
}
function add(k, v) { cnt[k]++; val[k, cnt[k]] = v }
function stat(k,   c, i, a) {
  c = cnt[k]; for (i = 1; i <= c; i++) a[i] = val[k, i]
  med[k] = median(a, c)
  return sprintf("%.4g (%.4g–%.4g)", med[k], a[1], a[c])
}
$1 == "RIG-FS" && NF == 9 {
  for (p = 5; p <= 9; p++) if ($p <= 0) $p = 0.005   # under one 10 ms step
  add($2 " write", mb / $5); add($2 " read", mb / $6)
  add($2 " create", n / $7); add($2 " stat", n / $8); add($2 " unlink", n / $9)
}
END {
  split("write|read|create|stat|unlink", P, "|")
  split("write, MiB/s|read, MiB/s|create, files/s|stat, files/s|unlink, files/s", L, "|")
  print "| phase | ember, median (min–max) | QEMU + virtiofsd | ember / QEMU |"
  print "| --- | --- | --- | --- |"
  for (i = 1; i <= 5; i++) {
    e = "ember " P[i]; q = "qemu " P[i]
    if (!cnt[e] || !cnt[q]) continue
    se = stat(e); sq = stat(q)
    printf "| %s | %s | %s | %.2f× |\n", L[i], se, sq, med[e] / med[q]
  }
  printf "\nsamples: ember %d, QEMU %d\n", cnt["ember write"], cnt["qemu write"]
}'
