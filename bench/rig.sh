#!/usr/bin/env bash
# ember against QEMU microvm, Firecracker and Cloud Hypervisor booting Debian's
# stock cloud kernel, side by side in ONE nested-rig run (issue 10, item 4).
#
# The rig is `ember run --backend qemu --nested-kvm`: an L1 guest under
# QEMU/TCG with kvm-amd loaded, so every VMM inside it runs on a /dev/kvm with
# hardware-KVM semantics. Inside, bench/rig-inner.sh boots the same vmlinux
# and busybox initramfs (whose /init prints RIG-INIT-OK, then powers off) under
# each VMM, interleaved (round by round, VMM after VMM), with 1 and 2 vCPUs,
# and times exec -> marker and exec -> exit from L1's clock; then one more
# boot per VMM with KVM's exit tracepoints histogrammed, to count the exits
# each VMM costs the guest. Times are TCG-inflated: read them as ratios.
#
# Usage: bench/rig.sh [ROUNDS]           (default 3)
# Environment:
#   EMBER_BIN        ember to measure (default: scripts/build-release)
#   EMBER_BASE_BIN   optional second ember, booted as `ember-base` (before/after)
#   EMBER_FC_BIN     Firecracker binary (static), built from its own source
#   EMBER_CH_BIN     Cloud Hypervisor binary (static), built from its own source
#   RIG_VCPUS        vCPU counts (default "1 2");  RIG_EXITS=0 skips the counted boots
#   RIG_VMMS         only these of the VMMs staged (e.g. "ember firecracker"),
#                    to iterate on one comparison; the default is all of them
#   RIG_CMDLINE      the guest command line, the same for every VMM
#   RIG_DMESG=FILE   each guest prints its kernel log and first CPU after the
#                    marker (exec -> marker is unaffected; exec -> exit is not),
#                    collected in FILE as `<vmm> <vcpus> <round> <line>`: where
#                    a boot's time goes, VMM against VMM
#   RIG_MARK         the console text timed instead of /init's marker: with
#                    RIG_MARK="Linux version" and RIG_CMDLINE="console=ttyS0
#                    earlyprintk=ttyS0 panic=-1 reboot=k" (no quiet), exec ->
#                    the guest's first line, i.e. each VMM's own set-up
# A VMM whose binary is not given is left out, and said so loudly.
set -euo pipefail
ROUNDS=${1:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
say() { printf '%s\n' "$*" >&2; }

NAME=rig.sh
. bench/rig-lib.sh
rig_begin
QEMU=$(rig_need qemu-system-x86_64) || exit 1

mkdir -p "$R/qemu-share"
# The guest: Debian's vmlinux (PVH entry for ember, QEMU and Cloud Hypervisor;
# Firecracker's ELF loader) and a busybox initramfs.
rig_guest "$KDIR" "$R" "$I" "$BUSYBOX"
cat > "$I/init" <<'EOF'
#!/bin/sh
echo RIG-INIT-OK
/bin/busybox mount -t proc proc /proc
read -r cmdline < /proc/cmdline
# Firecracker ends a VM on the guest's reset (i8042), not on ACPI power-off.
case " $cmdline " in *" rig.dmesg "*)
  # (With initcall_debug on the command line: only initcalls of 10 ms or more.)
  /bin/busybox dmesg | /bin/busybox awk '/ calling  / { next }
    / returned .* after .* usecs/ && $(NF - 1) < 10000 { next } { print "RIG-DMESG " $0 }'
  /bin/busybox sed -n '1,/^$/p' /proc/cpuinfo | /bin/busybox sed 's/^/RIG-DMESG cpuinfo /' ;;
esac
case " $cmdline " in *" rig.end=reboot "*) /bin/busybox reboot -f ;; esac
/bin/busybox poweroff -f
EOF
rig_cpio "$I" "$R/initrd.cpio"

VMMS=""
stage() { # stage NAME BINARY
  rig_stage "$2" "$R/$1"
  VMMS="$VMMS $1"
}
stage ember "$EMBER"
[ -n "${EMBER_BASE_BIN:-}" ] && stage ember-base "$EMBER_BASE_BIN"
for f in bios-microvm.bin qboot.rom linuxboot_dma.bin pvh.bin; do
  [ -e "/usr/share/qemu/$f" ] && cp -L "/usr/share/qemu/$f" "$R/qemu-share/"
done
VMMS="$VMMS qemu"
missing=""
if [ -n "${EMBER_FC_BIN:-}" ] && [ -x "$EMBER_FC_BIN" ]; then stage firecracker "$EMBER_FC_BIN"; else missing="$missing Firecracker(EMBER_FC_BIN)"; fi
if [ -n "${EMBER_CH_BIN:-}" ] && [ -x "$EMBER_CH_BIN" ]; then stage cloud-hypervisor "$EMBER_CH_BIN"; else missing="$missing Cloud-Hypervisor(EMBER_CH_BIN)"; fi
[ -n "$missing" ] && say "rig.sh: *** NOT MEASURED, no binary given:$missing ***"
cp bench/rig-inner.sh "$R/"
if [ -n "${RIG_VMMS:-}" ]; then
  keep=""
  for v in $RIG_VMMS; do
    case " $VMMS " in *" $v "*) keep="$keep $v" ;; *) say "rig.sh: RIG_VMMS names $v, which is not staged"; exit 1 ;; esac
  done
  VMMS=$keep
fi

say "rig.sh: VMMs:$VMMS; $ROUNDS rounds; vCPUs ${RIG_VCPUS:-1 2}; booting the rig (L1) ..."
OUT=$WORK/out
rig_l1 "$OUT" --mem 2G --timeout 3000 \
  --file "$R:/rig" --file "$QEMU:/usr/bin/qemu-system-x86_64" --file "$BUSYBOX:/bin/busybox" \
  --env "ROUNDS=$ROUNDS" --env "VMMS=$VMMS" --env "VCPUS=${RIG_VCPUS:-1 2}" \
  --env "EXITS=${RIG_EXITS:-1}" ${RIG_CMDLINE:+--env "CMDLINE=$RIG_CMDLINE"} \
  ${RIG_DMESG:+--env "DMESG=1"} ${RIG_MARK:+--env "MARK=$RIG_MARK"} \
  -- /bin/busybox sh -c 'cd /rig && exec /bin/busybox sh ./rig-inner.sh'
grep -q '^RIG-BOOT' "$OUT" || { say "rig.sh: the rig produced no boot (output in $OUT above)"; cat "$OUT" >&2; exit 1; }
if [ -n "${RIG_DMESG:-}" ]; then
  tr -d '\r' < "$OUT" | sed -n 's/^RIG-DMESG //p' > "$RIG_DMESG"
  say "rig.sh: the guests' kernel logs are in $RIG_DMESG"
fi

# The report: medians (min-max) per VMM and vCPU count, ratios against ember.
tr -d '\r' < "$OUT" | awk -v vmms="$VMMS" -v vcpus="${RIG_VCPUS:-1 2}" -v tick="$((1000 / $(getconf CLK_TCK)))" '
function median(a, n,   i, j, t) {
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function stat(key, col,   n, i, a, v) {
  n = 0
  for (i = 1; i <= cnt[key]; i++) { v = val[key, i, col]; if (v != "none") a[++n] = v + 0 }
  if (n == 0) return "-"
  med[key, col] = median(a, n)
  return sprintf("%.2f s (%.2f-%.2f)", med[key, col] / 1000, a[1] / 1000, a[n] / 1000)
}
function cpu_of(f) { return (f ~ /^cpu=[0-9]+$/) ? substr(f, 5) + 0 : "" }
$1 == "RIG-START" { last = cpu_of($2) }
$1 == "RIG-BOOT" && $4 != "count" { k = $2 " " $3; cnt[k]++; val[k, cnt[k], 1] = $5; val[k, cnt[k], 2] = $6; if ($7 != "0") bad[k]++
  c = cpu_of($NF); val[k, cnt[k], 3] = (c != "" && last != "") ? (c - last) * tick : "none"; last = c }
$1 == "RIG-EXITS" { ex[$2 " " $3, $4] += $6; if ($4 == "kvm_exit") why[$2 " " $3, $5] = $6
  if ($4 == "kvm_pio" && $6 >= 20) pio[$2 " " $3] = pio[$2 " " $3] sprintf(" 0x%x:%d", $5, $6) }
END {
  nv = split(vmms, V, " "); nc = split(vcpus, C, " ")
  print "| VMM | vCPUs | exec -> /init marker, median (min-max) | exec -> exit | host CPU per boot | marker: VMM / ember | exit: VMM / ember | CPU: VMM / ember | exits per boot (to VMM userspace) |"
  print "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for (c = 1; c <= nc; c++) for (v = 1; v <= nv; v++) {
    k = V[v] " " C[c]; if (!cnt[k]) continue
    m = stat(k, 1); x = stat(k, 2); u = stat(k, 3); e = "ember " C[c]
    if (!((e, 1) in med)) { stat(e, 1); stat(e, 2); stat(e, 3) }
    r1 = (med[e, 1] && med[k, 1]) ? sprintf("%.2fx", med[k, 1] / med[e, 1]) : "-"
    r2 = (med[e, 2] && med[k, 2]) ? sprintf("%.2fx", med[k, 2] / med[e, 2]) : "-"
    r3 = (med[e, 3] && med[k, 3]) ? sprintf("%.2fx", med[k, 3] / med[e, 3]) : "-"
    printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s (%s) |%s\n", V[v], C[c], m, x, u, r1, r2, r3, \
      ((k, "kvm_exit") in ex) ? ex[k, "kvm_exit"] : "-", ((k, "kvm_userspace_exit") in ex) ? ex[k, "kvm_userspace_exit"] : "-", \
      bad[k] ? " (" bad[k] " boots ended with a non-zero status)" : ""
  }
  print ""
  print "Exits per boot by SVM exit code (0x7b I/O, 0x400 nested page fault, 0x7c MSR, 0x60 host interrupt, 0x64 virtual interrupt, 0x72 CPUID, 0x78 HLT):"
  for (c = 1; c <= nc; c++) for (v = 1; v <= nv; v++) {
    k = V[v] " " C[c]; if (!((k, "kvm_exit") in ex)) continue
    line = ""
    for (code = 0; code <= 1100; code++) if ((k, code) in why && why[k, code] >= 20) line = line sprintf(" 0x%x:%d", code, why[k, code])
    printf "- %s, %s vCPU: %s; port I/O:%s\n", V[v], C[c], line, pio[k]
  }
}'
