#!/usr/bin/env bash
# Guest memory committed up front, in the nested rig (issue 13, item 5):
# Debian's unmodified cloud kernel booted by ember inside an L1 with /dev/kvm
# (`ember run --backend qemu --nested-kvm`, see bench/rig.sh), with --mem
# 512M, 4G and 8G × --prefault off, sync and async, interleaved round by
# round; exec -> /init's marker from L1's clock, the host CPU time the L1 used
# per boot (wall time under TCG is noisy), and, from ember's events file, exec
# -> first guest instruction, -> all memory committed, -> all memory visible
# (async: the balloon has given back all it took). /init loads Debian's own
# virtio_mmio and virtio_balloon modules (every mode, so every guest does the
# same work); with async it stays up until the balloon is empty again.
# QEMU microvm (-mem-prealloc, prealloc-threads=2) and Cloud Hypervisor
# (prefault=on) are the anchors: off and sync only.
#
# Issue 26's modes, `RIG_MODES="memboot memwhole"`: every VMM commits all of
# the guest's memory (ember --prefault async; the anchors their prefault/
# prealloc) and the guest loads virtio_mem too; memboot gives all but 512 MiB
# as a virtio-mem region (ember --mem-boot 512M; Cloud Hypervisor
# hotplug_method=virtio-mem, hotplugged_size all of it; QEMU q35 +
# virtio-mem-pci,prealloc=on), memwhole all of it at boot. Timed: exec ->
# /init with the virtio_mem driver bound, and exec -> all memory usable and
# committed (MemTotal grown by the whole region, any balloon back to empty,
# and, for ember, its events file's commit events). The L1 populating each
# size itself (bench/rig-populate.c) is the limit they are held against.
#
# Usage: bench/rig-memory.sh [ROUNDS]     (default 2)
# Environment:
#   EMBER_BIN      ember to measure (default: scripts/build-release)
#   EMBER_BASE_BIN a second ember, measured as `ember-base` in the same
#                  rounds, interleaved (a before/after comparison in one run)
#   RIG_SIZES      guest sizes in MiB (default "512 4096 8192")
#   RIG_MODES      default "off sync async"; a mode may add ember's options
#                  ("async,threads=1"; the anchors take sync* as sync; with
#                  "memboot,threads=1", ember alone); or "memboot memwhole"
#   RIG_L1_MEM     the L1's memory (default 10G: an 8 GiB guest committed in
#                  full must fit, with the rig's files, in the L1's RAM)
#   RIG_VCPUS      the guests' vCPU count (default 1)
#   RIG_QEMU=1     adds QEMU microvm;  EMBER_CH_BIN adds Cloud Hypervisor
#   RIG_TIMELINE=FILE  every ember boot's events file, one JSON line per boot
#                  (`<vmm>:<mode>:<MiB> <round> <json>`): where a boot's time goes
set -euo pipefail
ROUNDS=${1:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

NAME=rig-memory.sh
. bench/rig-lib.sh
rig_begin
SIZES=${RIG_SIZES:-512 4096 8192}
L1_MEM=${RIG_L1_MEM:-10G}

mkdir -p "$R/qemu-share"
rig_guest "$KDIR" "$R" "$I" "$BUSYBOX"
# Debian's modules for the balloon (insmod in dependency order).
mkdir -p "$I/lib/ko"
MODS=virtio_ring.ko\ virtio.ko\ virtio_mmio.ko\ virtio_balloon.ko
# The memboot modes': PCI's transport (Cloud Hypervisor's and q35's devices)
# and virtio_mem, loaded before the balloon.
MEMMODS=virtio_ring.ko\ virtio.ko\ virtio_mmio.ko\ virtio_pci_legacy_dev.ko\ virtio_pci_modern_dev.ko\ virtio_pci.ko\ virtio_mem.ko\ virtio_balloon.ko
for m in $MEMMODS; do
  f=$(find "$KDIR/lib/modules" -name "$m" | head -1)
  [ -n "$f" ] || { say "$NAME: $m is not in $KDIR (run \`ember setup\`)"; exit 1; }
  cp "$f" "$I/lib/ko/"
done
cat > "$I/init" <<EOF
#!/bin/sh
echo RIG-INIT-OK
b=/bin/busybox
\$b mount -t proc proc /proc
read -r cmdline < /proc/cmdline
mods="$MODS"
case " \$cmdline " in *" rig.memfull="*)
  # MemTotal (the first line of meminfo) before any driver changes it; full
  # once grown by the whole virtio-mem region (rig.memfull=MiB, 0: none).
  region=\${cmdline##*rig.memfull=}; region=\${region%% *}
  read -r _ t0 _ < /proc/meminfo
  full=\$((t0 + region * 1024 - 1024))
  mods="$MEMMODS"
  \$b mkdir -p /sys && \$b mount -t sysfs sys /sys ;;
esac
for m in \$mods; do
  \$b insmod /lib/ko/\$m || echo "RIG-INSMOD-FAILED \$m"
  if [ \$m = virtio_mem.ko ]; then
    # Bound: the driver has the device (probed as the module loads).
    n=0
    while [ \$region -gt 0 ] && [ \$n -lt 600 ]; do
      set -- /sys/bus/virtio/drivers/virtio_mem/virtio*
      [ -e "\$1" ] && break
      \$b sleep 0.05; n=\$((n + 1))
    done
    echo "RIG-MEM-BOUND region=\${region}MiB"
  fi
done
case " \$cmdline " in *" rig.memfull="*)
  # Polled without forking (the guest has one vCPU, busy plugging); at most
  # 5 minutes.
  n=0
  read -r _ t _ < /proc/meminfo
  while [ \$t -lt \$full ] && [ \$n -lt 1500 ]; do
    \$b sleep 0.2; n=\$((n + 1)); read -r _ t _ < /proc/meminfo
  done
  echo "RIG-MEM-FULL memtotal=\$t boot=\$t0 full=\$full waited=\$((n / 5))s" ;;
esac
case " \$cmdline " in *" rig.balloon "*)
  # Up until the balloon has given back all it took: inflated == deflated,
  # four times in a row; or nothing inflated 5 s after the driver came up
  # (all memory was committed before it did). At most 20 minutes.
  vm() { \$b awk -v k="\$1" '\$1 == k { print \$2 }' /proc/vmstat; }
  n=0; same=0
  while [ \$n -lt 2400 ] && [ \$same -lt 4 ]; do
    i=\$(vm balloon_inflate); d=\$(vm balloon_deflate)
    if [ "\$i" = "\$d" ] && { [ "\$i" -gt 0 ] || [ \$n -ge 10 ]; }; then same=\$((same + 1)); else same=0; fi
    \$b sleep 0.5; n=\$((n + 1))
  done
  echo "RIG-BALLOON inflate=\$i deflate=\$d waited=\$((n / 2))s" ;;
esac
\$b poweroff -f
EOF
rig_cpio "$I" "$R/initrd.cpio"

VMMS=ember
rig_stage "$EMBER" "$R/ember"
if [ -n "${EMBER_BASE_BIN:-}" ]; then
  [ -x "$EMBER_BASE_BIN" ] || { say "$NAME: EMBER_BASE_BIN=$EMBER_BASE_BIN is not executable"; exit 1; }
  rig_stage "$EMBER_BASE_BIN" "$R/ember-base"
  VMMS="ember-base ember"
fi
FILES=(--file "$R:/rig" --file "$BUSYBOX:/bin/busybox")
if [ "${RIG_QEMU:-0}" = 1 ]; then
  QEMU=$(rig_need qemu-system-x86_64) || exit 1
  for f in bios-microvm.bin qboot.rom linuxboot_dma.bin pvh.bin; do
    [ -e "/usr/share/qemu/$f" ] && cp -L "/usr/share/qemu/$f" "$R/qemu-share/"
  done
  # q35 (the memboot mode's virtio-mem-pci): SeaBIOS.
  for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/kvmvapic.bin; do
    [ -e "$f" ] && cp -L "$f" "$R/qemu-share/"
  done
  FILES+=(--file "$QEMU:/usr/bin/qemu-system-x86_64")
  VMMS="$VMMS qemu"
else
  say "$NAME: *** QEMU microvm NOT MEASURED (RIG_QEMU=1 adds it) ***"
fi
if [ -n "${EMBER_CH_BIN:-}" ]; then
  [ -x "$EMBER_CH_BIN" ] || { say "$NAME: EMBER_CH_BIN=$EMBER_CH_BIN is not executable"; exit 1; }
  rig_stage "$EMBER_CH_BIN" "$R/cloud-hypervisor"
  VMMS="$VMMS cloud-hypervisor"
else
  say "$NAME: *** Cloud Hypervisor NOT MEASURED (EMBER_CH_BIN) ***"
fi
cp bench/rig-inner.sh bench/rig-memory-inner.sh "$R/"
gcc -static -O2 -pthread -o "$R/rig-populate" bench/rig-populate.c ||
  { say "$NAME: cannot build bench/rig-populate.c statically (gcc, libc6-dev)"; exit 1; }

say "$NAME: $VMMS; sizes $SIZES MiB; modes ${RIG_MODES:-off sync async}; $ROUNDS rounds; L1 $L1_MEM; $(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
OUT=$WORK/out
rig_l1 "$OUT" --mem "$L1_MEM" --timeout 3000 "${FILES[@]}" \
  --env "ROUNDS=$ROUNDS" --env "VMMS=$VMMS" --env "VCPUS=${RIG_VCPUS:-1}" --env "SIZES=$SIZES" \
  ${RIG_MODES:+--env "MODES=$RIG_MODES"} ${RIG_TIMELINE:+--env "TIMELINE=1"} ${RIG_LOGALL:+--env "LOGALL=1"} \
  -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-memory-inner.sh'
say "$NAME: ended $(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -q '^RIG-BOOT' "$OUT" || { say "$NAME: the rig produced no boot (output in $OUT above)"; cat "$OUT" >&2; exit 1; }
if [ -n "${RIG_TIMELINE:-}" ]; then
  tr -d '\r' < "$OUT" | sed -n 's/^RIG-EVENTS //p' > "$RIG_TIMELINE"
  say "$NAME: the events files are in $RIG_TIMELINE"
fi

# The report: medians (min-max) per VMM, mode and size; ratios against the
# smallest size.
grep -Eq '^RIG-BOOT [^ ]+:(off|sync|async)' "$OUT" && tr -d '\r' < "$OUT" | awk -v sizes="$SIZES" -v vmms="$VMMS" -v modes="${RIG_MODES:-off sync async}" -v tick="$((1000 / $(getconf CLK_TCK)))" '
function median(a, n,   i, j, t) {
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function stat(key, col,   n, i, a, v) {
  n = 0
  for (i = 1; i <= cnt[key]; i++) { v = val[key, i, col]; if (v != "none" && v != "") a[++n] = v + 0 }
  if (n == 0) return "-"
  med[key, col] = median(a, n)
  return sprintf("%.2f s (%.2f-%.2f)", med[key, col] / 1000, a[1] / 1000, a[n] / 1000)
}
function cpu_of(f) { return (f ~ /^cpu=[0-9]+$/) ? substr(f, 5) + 0 : "" }
$1 == "RIG-START" { last = cpu_of($2) }
$1 == "RIG-BOOT" { k = $2; cnt[k]++; val[k, cnt[k], 1] = $5; val[k, cnt[k], 2] = $6; if ($7 != "0") bad[k]++
  c = cpu_of($NF); val[k, cnt[k], 3] = (c != "" && last != "") ? (c - last) * tick : "none"; last = c
  if (NF >= 11) { val[k, cnt[k], 4] = $8; val[k, cnt[k], 5] = $9; val[k, cnt[k], 6] = $10 } }
END {
  ns = split(sizes, S, " "); nv = split(vmms, V, " "); nm = split(modes, M, " ")
  print "| VMM | prefault | memory | exec -> /init marker | host CPU per boot | marker / " S[1] " MiB | CPU / " S[1] " MiB | exec -> first guest instruction | exec -> all committed | exec -> all visible | exec -> exit |"
  print "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for (v = 1; v <= nv; v++) for (m = 1; m <= nm; m++) for (s = 1; s <= ns; s++) {
    k = V[v] ":" M[m] ":" S[s]; if (!cnt[k] || M[m] ~ /^mem/) continue
    b = V[v] ":" M[m] ":" S[1]
    mk = stat(k, 1); u = stat(k, 3); x = stat(k, 2); en = stat(k, 4); co = stat(k, 5); vi = stat(k, 6)
    if (!((b, 1) in med)) { stat(b, 1); stat(b, 3) }
    r1 = (med[b, 1] && med[k, 1]) ? sprintf("%.2fx", med[k, 1] / med[b, 1]) : "-"
    r3 = (med[b, 3] && med[k, 3]) ? sprintf("%.2fx", med[k, 3] / med[b, 3]) : "-"
    printf "| %s | %s | %s MiB | %s | %s | %s | %s | %s | %s | %s | %s |%s\n", V[v], M[m], S[s], mk, u, r1, r3, en, co, vi, x, \
      bad[k] ? " (" bad[k] " boots ended with a non-zero status)" : ""
  }
}'
# The memboot modes: to /init with virtio_mem bound (the marker), against
# the smallest size; to all memory usable and committed, against the L1's
# own populate of that size.
grep -q '^RIG-MEMBOOT' "$OUT" && tr -d '\r' < "$OUT" | awk -v sizes="$SIZES" -v vmms="$VMMS" -v modes="${RIG_MODES:-}" -v tick="$((1000 / $(getconf CLK_TCK)))" '
function median(a, n,   i, j, t) {
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
# stat(key, col): "median s (min-max)", the median kept in med[key, col].
function stat(key, col,   n, i, a, v) {
  n = 0
  for (i = 1; i <= cnt[key, col]; i++) { v = val[key, col, i]; if (v != "none" && v != "") a[++n] = v + 0 }
  if (n == 0) return "-"
  med[key, col] = median(a, n)
  return sprintf("%.2f s (%.2f-%.2f)", med[key, col] / 1000, a[1] / 1000, a[n] / 1000)
}
function add(key, col, v) { val[key, col, ++cnt[key, col]] = v }
function ratio(a, b) { return (a && b) ? sprintf("%.2fx", a / b) : "-" }
function cpu_of(f) { return (f ~ /^cpu=[0-9]+$/) ? substr(f, 5) + 0 : "" }
$1 == "RIG-START" { last = cpu_of($2) }
$1 == "RIG-BOOT" { c = cpu_of($NF); add($2, "marker", $5); if (c != "" && last != "") add($2, "cpu", (c - last) * tick); last = c }
$1 == "RIG-MEMBOOT" { add($2, "full", $4); add($2, "committed", $5); add($2, "ready", $6) }
END {
  ns = split(sizes, S, " "); nv = split(vmms, V, " "); nm = split(modes, M, " ")
  name["memboot"] = "virtio-mem, 512 MiB at boot"; name["memwhole"] = "all at boot"
  print ""
  print "| VMM | memory | size | exec -> /init, virtio_mem bound | / " S[1] " MiB | exec -> all usable and committed | / the L1 populating it | guest MemTotal full | host: all committed | host CPU per boot |"
  print "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for (s = 1; s <= ns; s++) { h = "host:populate:" S[s]; stat(h, "marker") }
  for (v = 1; v <= nv; v++) for (m = 1; m <= nm; m++) { if (M[m] !~ /^mem/) continue
    b = V[v] ":" M[m] ":" S[1]; stat(b, "marker")
    for (s = 1; s <= ns; s++) {
      k = V[v] ":" M[m] ":" S[s]; if (!cnt[k, "marker"]) continue
      mk = stat(k, "marker"); rd = stat(k, "ready"); fu = stat(k, "full"); u = stat(k, "cpu")
      co = (V[v] ~ /^ember/) ? stat(k, "committed") : "before boot or plug"
      kind = M[m]; opts = sub(/,.*/, "", kind) ? " (" substr(M[m], length(kind) + 2) ")" : ""
      printf "| %s | %s%s | %s MiB | %s | %s | %s | %s | %s | %s | %s |\n", V[v], name[kind], opts, S[s], mk, ratio(med[k, "marker"], med[b, "marker"]), \
        rd, ratio(med[k, "ready"], med["host:populate:" S[s], "marker"]), fu, co, u
    }
  }
  for (s = 1; s <= ns; s++) { h = "host:populate:" S[s]
    printf "| the L1 populating it (2 threads) | | %s MiB | | | %s | 1 | | | %s |\n", S[s], stat(h, "marker"), stat(h, "cpu") }
}'
tr -d '\r' < "$OUT" | grep -a '^RIG-NOTE\|^RIG-FAILED' >&2 || true
