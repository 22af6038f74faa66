#!/usr/bin/env bash
# Firecracker's snapshot load against ember's restore, Debian's stock cloud
# kernel, in ONE nested-rig run (issue 12, item 6: the anchor).
#
# The rig is `ember run --backend qemu --nested-kvm` (see bench/rig.sh): an L1
# guest under QEMU/TCG with kvm-amd loaded. Inside, bench/rig-snapshot-inner.sh
# boots the same vmlinux and busybox initramfs under each VMM to /init, whose
# script prints RIG-SNAP-READY and waits for a line on its console; snapshots
# it there (ember: `ember snapshot`; Firecracker: PATCH /vm Paused, then PUT
# /snapshot/create, Full); then restores each snapshot ROUNDS times in fresh
# processes, interleaved (ember, Firecracker, ember, ...), feeding the line on
# stdin; the guest echoes it (RIG-RESUMED) and resets. Per restore it prints
#   RIG-RESTORE <vmm> <vcpus> <round> <ms to RIG-RESUMED> <ms to exit> <status> <load ms>
# where "load ms" is Firecracker's PUT /snapshot/load request as curl times
# it (the load and resume inside the VMM, without its process start) and, for
# ember, process start -> first guest instruction from its event timeline.
# Times are from L1's clock (adjtimex, microseconds) and TCG-inflated: read
# them as ratios.
#
# Usage: bench/rig-snapshot.sh [ROUNDS]        (default 5)
# Environment:
#   EMBER_BIN      ember to measure (default: scripts/build-release)
#   EMBER_FC_BIN   Firecracker binary (static), built from its own source (REQUIRED)
#   RIG_VCPUS      vCPU counts (default "1")
set -euo pipefail
ROUNDS=${1:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

[ -n "${EMBER_FC_BIN:-}" ] && [ -x "$EMBER_FC_BIN" ] ||
  { say "rig-snapshot.sh: *** EMBER_FC_BIN (a Firecracker binary) is required: the anchor IS Firecracker ***"; exit 1; }
NAME=rig-snapshot.sh
. bench/rig-lib.sh
rig_begin
rig_need qemu-system-x86_64 > /dev/null || exit 1
# Firecracker's API is HTTP over a unix socket: curl talks to it (it enters
# the L1 with its shared libraries, as any dynamically linked --file does).
CURL=$(rig_need curl) || exit 1

rig_guest "$KDIR" "$R" "$I" "$BUSYBOX"
cat > "$I/init" <<'EOF'
#!/bin/sh
echo RIG-SNAP-READY
read -r line
echo "RIG-RESUMED $line"
# A reset ends both VMMs (Firecracker does not act on ACPI power-off).
/bin/busybox reboot -f
EOF
rig_cpio "$I" "$R/initrd.cpio"
rig_stage "$EMBER" "$R/ember"
rig_stage "$EMBER_FC_BIN" "$R/firecracker"
cp bench/rig-snapshot-inner.sh "$R/"

say "rig-snapshot.sh: ember and Firecracker; $ROUNDS restores each; vCPUs ${RIG_VCPUS:-1}; booting the rig (L1) ..."
OUT=$WORK/out
"$HOST_EMBER" run --backend qemu --nested-kvm --mem 2G --cpus 2 --timeout 3000 \
  --file "$R:/rig" --file "$BUSYBOX:/bin/busybox" --file "$CURL:/usr/bin/curl" \
  --env "ROUNDS=$ROUNDS" --env "VCPUS=${RIG_VCPUS:-1}" \
  -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-snapshot-inner.sh' | tee "$OUT" |
  grep --line-buffered '^RIG-' >&2 || true
grep -q '^RIG-RESTORE' "$OUT" || { say "rig-snapshot.sh: the rig restored nothing (output in $OUT above)"; cat "$OUT" >&2; exit 1; }

# The report: medians (min-max) per VMM and vCPU count, ratios against ember.
tr -d '\r' < "$OUT" | awk -v vcpus="${RIG_VCPUS:-1}" '
function median(a, n,   i, j, t) {
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function stat(key, col,   n, i, a, v) {
  n = 0
  for (i = 1; i <= cnt[key]; i++) { v = val[key, i, col]; if (v != "none") a[++n] = v + 0 }
  if (n == 0) return "-"
  med[key, col] = median(a, n)
  return sprintf("%.1f ms (%.1f-%.1f)", med[key, col], a[1], a[n])
}
$1 == "RIG-RESTORE" { k = $2 " " $3; cnt[k]++; val[k, cnt[k], 1] = $5; val[k, cnt[k], 2] = $6; val[k, cnt[k], 3] = $8; if ($7 != "0" && $7 != "2") bad[k]++ }
$1 == "RIG-SNAPSHOT" { snap[$2 " " $3] = sprintf("%s ms, %s", $4, $5) }
END {
  nc = split(vcpus, C, " "); nv = split("ember firecracker", V, " ")
  print "| VMM | vCPUs | exec -> guest resumed (its line), median (min-max) | exec -> exit | load/restore inside the VMM | resumed: VMM / ember | snapshot creation |"
  print "| --- | --- | --- | --- | --- | --- | --- |"
  for (c = 1; c <= nc; c++) for (v = 1; v <= nv; v++) {
    k = V[v] " " C[c]; if (!cnt[k]) continue
    m = stat(k, 1); x = stat(k, 2); l = stat(k, 3); e = "ember " C[c]
    if (!((e, 1) in med)) stat(e, 1)
    r = (med[e, 1] && med[k, 1]) ? sprintf("%.2fx", med[k, 1] / med[e, 1]) : "-"
    printf "| %s | %s | %s | %s | %s | %s | %s |%s\n", V[v], C[c], m, x, l, r, (k in snap) ? snap[k] : "-", \
      bad[k] ? " (" bad[k] " restores ended with an unexpected status)" : ""
  }
}'
