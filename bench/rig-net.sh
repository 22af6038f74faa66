#!/usr/bin/env bash
# virtio-net and vsock in the nested rig, Debian's own drivers (issue 24 item 7):
# ember against QEMU microvm (userspace virtio-net, and vhost-net from the L1's
# module), Firecracker and Cloud Hypervisor, in ONE run, interleaved round by
# round.
#
# The rig is `ember run --backend qemu --nested-kvm` (an L1 under QEMU/TCG with
# kvm-amd). Inside, bench/rig-net-inner.sh puts a tap (10.0.2.1/24) and an
# iperf3 server in the L1 and boots Debian's cloud kernel with a busybox
# initramfs under each VMM, its eth0 on that tap (10.0.2.2). The guest runs
# iperf3 TCP to the L1 and back (-R), then pings the L1 (request/response
# latency); the L1 reads each VMM's CPU time (/proc/PID/stat) when each
# transfer starts and ends: host CPU per transferred GiB, with and without
# the guest's own time (guest_time). Then vsock both ways, ember against
# Firecracker (both hybrid vsock: the guest's socat to PATH_5000, and
# `CONNECT 1234` from the L1). Under TCG every figure is slow: read ratios.
#
# Usage: bench/rig-net.sh [ROUNDS]          (default 2)
# Environment:
#   EMBER_BIN       ember to measure (default: scripts/build-release)
#   EMBER_BASE_BIN  another ember, measured as the VMM `ember-base` (a change's
#                   before and after in one run)
#   EMBER_FC_BIN    Firecracker binary, built from its own source
#   EMBER_CH_BIN    Cloud Hypervisor binary, built from its own source
#   RIG_VMMS        the VMMs, of: ember ember-base qemu qemu-vhost firecracker cloud-hypervisor
#   RIG_SECS        seconds of each iperf3 direction (default 4)
#   RIG_VSOCK_MIB   MiB each vsock direction (default 16; 0 skips vsock)
set -euo pipefail
ROUNDS=${1:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

NAME=rig-net.sh
. bench/rig-lib.sh
rig_begin
QEMU=$(rig_need qemu-system-x86_64) || exit 1
IPERF3=$(rig_need iperf3) || exit 1
SOCAT=$(rig_need socat) || exit 1
IPROUTE=$(readlink -f "$(rig_need ip)") || exit 1
VER=$(basename "$KDIR")
MODS=$KDIR/lib/modules/$VER

mkdir -p "$R/qemu-share" "$R/ko"

# mods DEST NAME...: the modules with their dependencies (modules.dep) copied
# into DEST, and DEST/list naming them in load order.
mods() {
  local dest=$1 m
  shift
  : > "$dest/list"
  for m in "$@"; do
    awk -v m="/$m.ko" 'index($1, m ":") { n = split($0, a, /:? +/)
      for (i = n; i >= 2; i--) print a[i]; sub(/:$/, "", a[1]); print a[1] }' "$MODS/modules.dep"
  done | awk '!seen[$0]++' | while read -r p; do
    cp "$MODS/$p" "$dest/"
    basename "$p" >> "$dest/list"
  done
}
# closure FILE...: each program and the libraries it loads, at their paths.
closure() {
  local f
  for f in "$@"; do
    echo "$f"
    ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
  done | sort -u
}

rig_guest "$KDIR" "$R" "$I" "$BUSYBOX"
mkdir -p "$I/ko"
mods "$I/ko" virtio_mmio virtio_pci virtio_net vmw_vsock_virtio_transport
for f in $(closure "$IPERF3" "$SOCAT"); do
  mkdir -p "$I$(dirname "$f")"
  cp -L "$f" "$I$f"
done
# The L1: taps, and vhost-net for QEMU's vhost=on.
mods "$R/ko" tun vhost_net
cp bench/rig-net-l2.sh "$I/init"
rig_cpio "$I" "$R/initrd.cpio"

VMMS=""
stage() { rig_stage "$2" "$R/$1"; VMMS="$VMMS $1"; }
stage ember "$EMBER"
[ -n "${EMBER_BASE_BIN:-}" ] && stage ember-base "$EMBER_BASE_BIN"
for f in bios-microvm.bin qboot.rom linuxboot_dma.bin pvh.bin; do
  [ -e "/usr/share/qemu/$f" ] && cp -L "/usr/share/qemu/$f" "$R/qemu-share/"
done
VMMS="$VMMS qemu qemu-vhost"
missing=""
if [ -n "${EMBER_FC_BIN:-}" ] && [ -x "$EMBER_FC_BIN" ]; then stage firecracker "$EMBER_FC_BIN"; else missing="$missing Firecracker(EMBER_FC_BIN)"; fi
if [ -n "${EMBER_CH_BIN:-}" ] && [ -x "$EMBER_CH_BIN" ]; then stage cloud-hypervisor "$EMBER_CH_BIN"; else missing="$missing Cloud-Hypervisor(EMBER_CH_BIN)"; fi
[ -n "$missing" ] && say "$NAME: *** NOT MEASURED, no binary given:$missing ***"
[ -n "${RIG_VMMS:-}" ] && VMMS=$RIG_VMMS
cp bench/rig-net-inner.sh "$R/"

say "$NAME: VMMs:$VMMS; $ROUNDS rounds; booting the rig (L1) ..."
OUT=$WORK/out
# (iproute2's ip where busybox's would not shadow it: busybox has no tuntap.)
rig_l1 "$OUT" --mem 2G --timeout 1500 --with iperf3 --with socat --file "$IPROUTE:/rig/ip" \
  --file "$R:/rig" --file "$QEMU:/usr/bin/qemu-system-x86_64" --file "$BUSYBOX:/bin/busybox" \
  --env "ROUNDS=$ROUNDS" --env "VMMS=$VMMS" --env "SECS=${RIG_SECS:-4}" \
  --env "VSOCK_MIB=${RIG_VSOCK_MIB:-16}" \
  -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-net-inner.sh'
grep -q '^RIG-NET ' "$OUT" || { say "$NAME: the rig measured nothing"; cat "$OUT" >&2; exit 1; }
[ -n "${RIG_OUT:-}" ] && cp "$OUT" "$RIG_OUT"

# The report: medians (min-max) per VMM, ratios against ember.
tr -d '\r' < "$OUT" | awk -v vmms="$VMMS" '
function median(a, n,   i, j, t) {
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function stat(key,   n, i, a) {
  n = cnt[key]; if (!n) return "-"
  for (i = 1; i <= n; i++) a[i] = val[key, i]
  med[key] = median(a, n)
  return sprintf("%.4g (%.4g-%.4g)", med[key], a[1], a[n])
}
function add(key, v) { cnt[key]++; val[key, cnt[key]] = v }
# RIG-NET <vmm> <round> <dir> <bytes> <secs> <cpu ticks> <cpu ticks without guest time> <hz>
$1 == "RIG-NET" && $6 > 0 { k = $2 " " $4; add(k " mbps", $5 * 8 / $6 / 1e6)
  if ($5 > 0) { add(k " cpu", $7 / $9 / ($5 / 2^30)); add(k " own", $8 / $9 / ($5 / 2^30)) } }
# RIG-RR <vmm> <round> <avg ms>
$1 == "RIG-RR" { add($2 " rr", $4) }
# RIG-VSOCK <vmm> <round> <dir> <bytes> <secs>
$1 == "RIG-VSOCK" && $6 > 0 { add($2 " vsock " $4, $5 / $6 / 2^20) }
END {
  nv = split(vmms, V, " ")
  print "| VMM | metric | median (min-max) | VMM / ember |"
  print "| --- | --- | --- | --- |"
  split("up mbps|down mbps|up cpu|down cpu|up own|down own|rr", M, "|")
  split("iperf3 guest->L1, Mbit/s|iperf3 L1->guest, Mbit/s|CPU s per GiB, guest->L1|CPU s per GiB, L1->guest|CPU s per GiB without guest time, guest->L1|same, L1->guest|ping RTT avg, ms", N, "|")
  for (m = 1; m <= 7; m++) for (v = 1; v <= nv; v++) {
    k = V[v] " " M[m]; if (!cnt[k]) continue
    s = stat(k); e = "ember " M[m]; if (!(e in med)) stat(e)
    printf "| %s | %s | %s | %s |\n", V[v], N[m], s, (med[e] ? sprintf("%.2fx", med[k] / med[e]) : "-")
  }
  for (d = 1; d <= 2; d++) for (v = 1; v <= nv; v++) {
    dir = (d == 1) ? "g2h" : "h2g"; k = V[v] " vsock " dir; if (!cnt[k]) continue
    s = stat(k); e = "ember vsock " dir; if (!(e in med)) stat(e)
    printf "| %s | vsock %s, MiB/s | %s | %s |\n", V[v], (d == 1) ? "guest->L1" : "L1->guest", s, (med[e] ? sprintf("%.2fx", med[k] / med[e]) : "-")
  }
}'
