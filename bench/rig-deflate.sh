#!/usr/bin/env bash
# The deflate crash of issue 26 (item 3), reproduced on purpose in the nested
# rig: one L1 (`ember run --backend qemu --nested-kvm`, see bench/rig.sh)
# boots Debian's unmodified cloud kernel twice side by side, under ember
# (`--balloon --balloon-no-reporting`, driven through its control socket) and
# under QEMU (pc, virtio-balloon-pci, driven through QMP `balloon`). CYCLES
# times, alternating the two VMMs cycle by cycle: inflate the balloon by
# RIG_INFLATE MiB, deflate it, and in the guest write and read back every
# 8-byte word of RIG_TOUCH MiB of freshly mapped memory (the pages the deflate
# put back on the free lists; bench/rig-deflate-touch.c, one `TOUCH` line per
# cycle). Counted per VMM: cycles completed, verification failures (a word
# that did not read back) and crashes (the VMM exited: triple fault, panic
# with panic=-1; a panic/Oops on the console; or a step that hung past
# RIG_STEP_S), each with the console's tail; a crashed guest is booted again
# and the cycles go on.
#
# Usage: bench/rig-deflate.sh [CYCLES]     (default 50)
# Environment:
#   EMBER_BIN     ember to measure (default: scripts/build-release)
#   RIG_MEM       the L2's memory in MiB (default 384)
#   RIG_INFLATE   MiB inflated per cycle (default 64)
#   RIG_TOUCH     MiB written and verified per cycle (default RIG_INFLATE)
#   RIG_STEP_S    seconds one step (inflate, deflate + verify) may take (default 300)
#   RIG_VMMS      default "ember qemu"
#   RIG_EMBER_ARGS  more `ember boot` options (e.g. "--mem-boot 256M": the
#                 balloon case of tests/rig/suite.sh, with virtio-mem beside it)
set -euo pipefail
CYCLES=${1:-50}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

NAME=rig-deflate.sh
. bench/rig-lib.sh
rig_begin
MEM=${RIG_MEM:-384}
INFLATE=${RIG_INFLATE:-64}
TOUCH=${RIG_TOUCH:-$INFLATE}
VMMS=${RIG_VMMS:-ember qemu}

rig_guest "$KDIR" "$R" "$I" "$BUSYBOX"
gcc -static -O2 -o "$I/bin/touch-check" bench/rig-deflate-touch.c ||
  { say "$NAME: cannot build bench/rig-deflate-touch.c statically (gcc, libc6-dev)"; exit 1; }
# Debian's modules: the balloon on virtio-mmio (ember) or PCI (QEMU).
mkdir -p "$I/lib/ko"
MODS="virtio_ring.ko virtio.ko virtio_mmio.ko virtio_pci_legacy_dev.ko virtio_pci_modern_dev.ko virtio_pci.ko virtio_balloon.ko"
for m in $MODS; do
  f=$(find "$KDIR/lib/modules" -name "$m" | head -1)
  [ -n "$f" ] || { say "$NAME: $m is not in $KDIR (run \`ember setup\`)"; exit 1; }
  cp "$f" "$I/lib/ko/"
done
# The guest follows the host: each cycle it waits for RIG_INFLATE MiB more
# inflated pages, then for the balloon to be empty again, then checks.
cat > "$I/init" <<EOF
#!/bin/sh
b=/bin/busybox
\$b mount -t proc proc /proc
for m in $MODS; do \$b insmod /lib/ko/\$m 2>/dev/null; done
vm() { \$b awk -v k="\$1" '\$1 == k { print \$2 }' /proc/vmstat; }
free() { \$b awk '/^MemFree:/ { print \$2 }' /proc/meminfo; }
c=1
echo "@ready free_kib=\$(free)"
while :; do
  i0=\$(vm balloon_inflate)
  until [ \$((\$(vm balloon_inflate) - i0)) -ge $((INFLATE * 256)) ]; do \$b sleep 0.2; done
  echo "@inflated \$c free_kib=\$(free)"
  until [ "\$(vm balloon_deflate)" -ge "\$(vm balloon_inflate)" ]; do \$b sleep 0.2; done
  echo "@deflated \$c free_kib=\$(free)"
  /bin/touch-check $TOUCH \$c
  c=\$((c + 1))
done
EOF
rig_cpio "$I" "$R/initrd.cpio"

rig_stage "$EMBER" "$R/ember"
FILES=(--file "$R:/rig" --file "$BUSYBOX:/bin/busybox")
case " $VMMS " in *" qemu "*)
  QEMU=$(rig_need qemu-system-x86_64) || exit 1
  mkdir -p "$R/qemu-share"
  for f in bios-256k.bin kvmvapic.bin linuxboot_dma.bin pvh.bin; do
    for d in /usr/share/qemu /usr/share/seabios; do
      [ -e "$d/$f" ] && { cp -L "$d/$f" "$R/qemu-share/"; break; }
    done
  done
  FILES+=(--file "$QEMU:/usr/bin/qemu-system-x86_64") ;;
esac
cp bench/rig-deflate-inner.sh "$R/"

say "$NAME: $VMMS; L2 ${MEM} MiB, inflate $INFLATE MiB, verify $TOUCH MiB per cycle; $CYCLES cycles; $(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
OUT=${RIG_DEFLATE_LOG:-$WORK/out}
rig_l1 "$OUT" --mem 2G --timeout $((600 + CYCLES * 120)) "${FILES[@]}" \
  --env "CYCLES=$CYCLES" --env "VMMS=$VMMS" --env "MEM=$MEM" --env "INFLATE=$INFLATE" \
  --env "STEP_S=${RIG_STEP_S:-300}" --env "EMBER_ARGS=${RIG_EMBER_ARGS:-}" \
  -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-deflate-inner.sh'
say "$NAME: ended $(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -aq '^RIG-CYCLE' "$OUT" || { say "$NAME: the rig completed no cycle:"; tr -d '\r' < "$OUT" | tail -60 >&2; exit 1; }

# RIG-CYCLE <vmm> <cycle> ok|bad|crash|hang <seconds> [what]; the crashes'
# console tails first.
tr -d '\r' < "$OUT" | grep -a '^RIG-TAIL' >&2 || true
tr -d '\r' < "$OUT" | awk -v vmms="$VMMS" '
$1 == "RIG-CYCLE" { n[$2]++; r[$2, $4]++; if ($4 == "ok") t[$2] += $5 }
$1 == "RIG-BOOTED" { boots[$2]++ }
END {
  print "| VMM | cycles run | completed and verified | verification failures | crashes (exit/panic) | hangs | guest boots | mean s per good cycle |"
  print "| --- | --- | --- | --- | --- | --- | --- | --- |"
  nv = split(vmms, V, " ")
  for (i = 1; i <= nv; i++) { v = V[i]
    printf "| %s | %d | %d | %d | %d | %d | %d | %s |\n", v, n[v], r[v, "ok"], r[v, "bad"], r[v, "crash"], r[v, "hang"], boots[v],
      r[v, "ok"] ? sprintf("%.1f", t[v] / r[v, "ok"]) : "-" }
}'
