#!/usr/bin/env bash
# Container start time in the nested rig (issue 27 item 7): `ctr run --rm`
# -> the workload's first output line, ember's shim on the ember backend
# (the pod VM restored from the appliance's snapshot of Debian's cloud
# kernel) against runc, the same containerd, image and L1, interleaved.
#
# The rig is `ember run --backend qemu --nested-kvm` (an L1 under QEMU/TCG
# with kvm-amd loaded). Inside, bench/rig-containers-inner.sh starts
# containerd, imports a busybox image built here with umoci, runs one
# warm-up of each runtime (ember's boots the pod VM cold and saves the
# snapshot every later pod VM is restored from), then ROUNDS rounds of each,
# the order alternating. The pod VM's root is the L1's own (read-only over
# ember's virtio-fs device), the container's root the containerd snapshot
# shared into it, as on a host. Times are on the L1's clock and inflated by
# TCG (runc's too): read the ratio.
#
# With RIG_DOCKER=1 the same L1 then measures `docker run --rm` the same
# way: Debian's dockerd (DOCKER_RAMDISK=true: runc chroots, as above) with
# ember-oci registered in its daemon.json `runtimes` on the ember backend
# (the pod VM restored from the snapshot the ctr runs saved)
# against runc, the same busybox tree `docker import`ed, a warm-up of each
# and ROUNDS alternating rounds.
#
# Usage: bench/rig-containers.sh [ROUNDS]          (default 5)
# Environment:
#   RIG_DOCKER=1    also `docker run` (needs dockerd and Debian's client,
#                   /usr/bin/docker)
#   EMBER_OCI_BIN   ember-oci for RIG_DOCKER (default: a release build of
#                   this tree)
#   EMBER_BIN       ember to measure (default: a release build of this tree)
#   EMBER_SHIM_BIN, EMBER_AGENT_BIN   the shim and the guest agent (default:
#                   release builds of this tree, beside EMBER_BIN's default)
#   RIG_OUT         keep the rig's raw output here
set -euo pipefail
ROUNDS=${1:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

NAME=rig-containers.sh
DOCKER=${RIG_DOCKER:-0}
if [ -z "${EMBER_BIN:-}" ] || [ -z "${EMBER_SHIM_BIN:-}" ] || [ -z "${EMBER_AGENT_BIN:-}" ] ||
  { [ "$DOCKER" = 1 ] && [ -z "${EMBER_OCI_BIN:-}" ]; }; then
  cargo build --locked --release --quiet -p ember -p containerd-shim-ember-v2 -p ember-agent \
    $([ "$DOCKER" = 1 ] && echo -p ember-oci)
fi
# The L1 carries the three with their libraries (as --file does), so ember
# need not be the static shipped build: the one built beside the shim.
export EMBER_BIN=${EMBER_BIN:-$PWD/target/release/ember}
SHIM=${EMBER_SHIM_BIN:-$PWD/target/release/containerd-shim-ember-v2}
AGENT=${EMBER_AGENT_BIN:-$PWD/target/release/ember-agent}
OCI=${EMBER_OCI_BIN:-$PWD/target/release/ember-oci}
. bench/rig-lib.sh
rig_begin
rig_need qemu-system-x86_64 > /dev/null || exit 1
for t in containerd ctr runc containerd-shim-runc-v2 umoci tar; do rig_need "$t" > /dev/null || exit 1; done
# Docker's part: the daemon, and Debian's client (another one on PATH may be
# newer than the daemon).
DARGS=()
TIMEOUT=2400
if [ "$DOCKER" = 1 ]; then
  rig_need dockerd > /dev/null || exit 1
  [ -x /usr/bin/docker ] || { say "$NAME: RIG_DOCKER=1 needs Debian's docker client, /usr/bin/docker"; exit 1; }
  DARGS=(--with dockerd --with /usr/bin/docker --env RIG_DOCKER=1)
  TIMEOUT=4200
fi
VER=$(basename "$KDIR")
MODS=$KDIR/lib/modules/$VER

C=$WORK/cache
mkdir -p "$R/ko" "$C/kernel/$VER/lib/modules/$VER"

# deps M...: the modules M with their dependencies (modules.dep), in load
# order, as paths relative to $MODS.
# (A module's file may spell its `_` as `-`: virtio-rng.ko.)
deps() {
  for m in "$@"; do
    awk -v m="/$m.ko:" -v h="/$(echo "$m" | tr _ -).ko:" 'index($1, m) || index($1, h) {
      n = split($0, a, /:? +/); for (i = n; i >= 2; i--) print a[i]; sub(/:$/, "", a[1]); print a[1]; found = 1 }
      END { exit !found }' "$MODS/modules.dep" ||
      grep -q -e "/$m.ko$" -e "/$(echo "$m" | tr _ -).ko$" "$MODS/modules.builtin" ||
      { say "$NAME: no module $m in $MODS"; exit 1; }
  done | awk '!seen[$0]++'
}
# The L1's overlayfs (containerd's snapshots; the L1 appliance loads only
# its own modules).
deps overlay | while read -r p; do cp "$MODS/$p" "$R/ko/" && basename "$p" >> "$R/ko/order"; done
[ -s "$R/ko/order" ] || { say "$NAME: no overlay module in $MODS"; exit 1; }
# The L2 appliance's cache: the kernel, and the modules the appliance and
# its host-root mount load (not the whole 90 MB tree).
echo "$VER" > "$C/kernel/current"
objcopy --strip-debug "$KDIR/vmlinux" "$C/kernel/$VER/vmlinux"
cp "$MODS/modules.order" "$MODS/modules.builtin" "$C/kernel/$VER/lib/modules/$VER/"
deps virtio_console virtio_pci virtio_mmio virtio_mem virtio_balloon virtio_blk virtio_rng \
  virtio_pmem nd_pmem vmw_vsock_virtio_transport virtio_net virtiofs overlay | while read -r p; do
  mkdir -p "$C/kernel/$VER/lib/modules/$VER/$(dirname "$p")"
  cp "$MODS/$p" "$C/kernel/$VER/lib/modules/$VER/$p"
done

# The image: busybox with sh and cat, and /etc/message.
L=$WORK/oci
umoci init --layout "$L"
umoci new --image "$L:latest"
umoci unpack --image "$L:latest" "$WORK/bundle" > /dev/null
mkdir -p "$WORK/bundle/rootfs/bin" "$WORK/bundle/rootfs/etc" "$WORK/bundle/rootfs/tmp"
cp "$BUSYBOX" "$WORK/bundle/rootfs/bin/busybox"
ln -s busybox "$WORK/bundle/rootfs/bin/sh"
ln -s busybox "$WORK/bundle/rootfs/bin/cat"
echo "hello from the image" > "$WORK/bundle/rootfs/etc/message"
umoci repack --image "$L:latest" "$WORK/bundle"
tar -C "$L" -cf "$R/image.tar" .
# The same tree for `docker import`.
if [ "$DOCKER" = 1 ]; then
  mkdir -p "$WORK/bundle/rootfs/proc" "$WORK/bundle/rootfs/sys" "$WORK/bundle/rootfs/dev"
  tar -C "$WORK/bundle/rootfs" -cf "$R/rootfs.tar" .
fi

rig_stage "$EMBER" "$R/ember"
rig_stage "$SHIM" "$R/containerd-shim-ember-v2"
rig_stage "$AGENT" "$R/ember-agent"
if [ "$DOCKER" = 1 ]; then
  # Beside the ember and agent the shim runs (it finds them beside itself).
  rig_stage "$OCI" "$R/ember-oci"
fi
cp "$EMBER_INIT" "$R/ember-init"
cp bench/rig-containers-inner.sh "$R/"

say "$NAME: $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds; $(containerd --version | cut -d' ' -f1,3); $(runc --version | head -1)"
say "$NAME: booting the rig (L1) ..."
OUT=$WORK/out
# The shim, its agent and ember side by side in the L1 (the shim finds
# them beside itself); the L2's init from the same build.
rig_l1 "$OUT" --mem 2G --timeout "$TIMEOUT" --file "$R:/rig" --file "$BUSYBOX:/bin/busybox" \
  --file "$C:/root/.cache/ember" --file "$R/ember:/usr/local/bin/ember" \
  --file "$R/containerd-shim-ember-v2:/usr/local/bin/containerd-shim-ember-v2" \
  --file "$R/ember-agent:/usr/local/bin/ember-agent" \
  --with containerd --with ctr --with runc --with containerd-shim-runc-v2 \
  --env "ROUNDS=$ROUNDS" --env EMBER_SHIM_BACKEND=ember --env EMBER_INIT=/rig/ember-init \
  "${DARGS[@]}" -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-containers-inner.sh'
grep -q '^RIG-CTR ' "$OUT" || { say "$NAME: the rig measured nothing"; cat "$OUT" >&2; exit 1; }
[ -n "${RIG_OUT:-}" ] && cp "$OUT" "$RIG_OUT"

say "$NAME: done at load $(cut -d' ' -f1-3 /proc/loadavg)"

# The runtimes' table of one report, for awk with -v tag=… (its lines:
# <tag> <runtime> <round> <ms to the first line> <ms to exit> <status>
# <start us>; round 0 is the warm-up), -v head=… (the table's first line)
# and -v ratio=… (before the ratio line); its medians in med[runtime, 1|2].
RUNTIMES_AWK='
function median(a, c,   i, j, t) {
  for (i = 2; i <= c; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (c % 2) ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2
}
function stat(k, col,   c, i, a) {
  c = cnt[k]; for (i = 1; i <= c; i++) a[i] = val[k, i, col]
  med[k, col] = median(a, c)
  return sprintf("%.0f ms (%.0f–%.0f)", med[k, col], a[1], a[c])
}
$1 == tag && $3 == 0 { warm[$2] = sprintf("%s ms (exit %s ms, status %s)", $4, $5, $6) }
$1 == tag && $3 > 0 {
  if ($4 == "none" || $6 != 0) bad[$2]++
  else { cnt[$2]++; val[$2, cnt[$2], 1] = $4; val[$2, cnt[$2], 2] = $5 }
}
END {
  print head
  print "| --- | --- | --- | --- | --- |"
  split("ember runc", R, " ")
  for (i = 1; i <= 2; i++) {
    k = R[i]; if (!cnt[k]) { printf "| %s | - | - | %s | 0 (%d failed) |\n", k, warm[k], bad[k]; continue }
    f = stat(k, 1); x = stat(k, 2)
    printf "| %s | %s | %s | %s | %d%s |\n", k, f, x, warm[k], cnt[k], bad[k] ? " (" bad[k] " failed)" : ""
  }
  if (cnt["ember"] && cnt["runc"])
    printf "\n%sember / runc, first line: %.2f×; exit: %.2f×\n", ratio, med["ember", 1] / med["runc", 1], med["ember", 2] / med["runc", 2]
}
'

# RIG-CTR lines; the shim's RIG-NOTE lines, one "booting the pod VM" and
# one "agent answered" per ember run, in the runs' order: they split
# ember's first line into exec -> the shim starts ember (containerd, the
# shim's start and the rootfs mounts), -> the agent answers (the restore),
# -> the first line (the container's creation and start in the guest, its
# output relayed).
tr -d '\r' < "$OUT" | awk -v tag=RIG-CTR -v ratio= \
  -v head='| runtime | ctr run -> first line, median (min–max) | -> exit | warm-up run (first line) | runs |' "$RUNTIMES_AWK"'
# time="2026-11-29T19:35:09.10658532Z" -> seconds into the day.
function tod(l,   t) { match(l, /T[0-9:.]+Z/); t = substr(l, RSTART + 1, RLENGTH - 2); split(t, h, ":"); return h[1] * 3600 + h[2] * 60 + h[3] }
$1 == "RIG-CTR" && $2 == "ember" { ne++; er[ne] = $3; et0[ne] = ($7 / 1e6) % 86400; efirst[ne] = $4 }
$1 == "RIG-NOTE" && /booting the pod VM/ { nb++; boot[nb] = tod($0) }
$1 == "RIG-NOTE" && /agent answered/ { na++; ans[na] = tod($0) }
END {
  # The phases of the restored runs (round > 0), when every run has its two lines.
  if (nb != ne || na != ne || ne < 2) { printf "\n(phases: %d runs, %d boot and %d answer lines: not split)\n", ne, nb, na; exit }
  for (i = 1; i <= ne; i++) {
    if (er[i] == 0 || efirst[i] == "none") continue
    n++; p["shim", n] = (boot[i] - et0[i]) * 1000; p["restore", n] = (ans[i] - boot[i]) * 1000
    p["guest", n] = efirst[i] - (ans[i] - et0[i]) * 1000
  }
  if (!n) exit
  printf "\nember, where the first line'\''s time goes (median of %d restored runs, min–max):\n", n
  split("shim restore guest", P, " ")
  split("exec -> the shim starts the pod VM (containerd, the shim, the rootfs mounts)|the pod VM started -> its agent answers (restore from the snapshot)|the agent answered -> the first line (container created and started in the guest, output relayed)", L, "|")
  for (j = 1; j <= 3; j++) {
    for (i = 1; i <= n; i++) a[i] = p[P[j], i]
    m = median(a, n)
    printf "  %s: %.0f ms (%.0f–%.0f)\n", L[j], m, a[1], a[n]
  }
}'

[ "$DOCKER" = 1 ] || exit 0
echo
tr -d '\r' < "$OUT" | awk -v tag=RIG-DOCKER -v ratio='docker: ' \
  -v head='| docker run --runtime | -> first line, median (min–max) | -> exit | warm-up run (first line) | runs |' "$RUNTIMES_AWK"
