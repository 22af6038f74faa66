#!/usr/bin/env bash
# A real Linux boot on this host's software KVM: ember against QEMU microvm
# (KVM), interleaved, on the patched minimal kernel from ../shared/pvm-test-kernel.
# Measures exec → the line /init prints (then stops the VMM: without an i8042,
# QEMU microvm cannot end this kernel's reboot, so "exit" is not comparable).
#
# Usage: bench/linux-pvm.sh [ROUNDS]   (default 3; each boot takes 20-60 s here)
set -euo pipefail
ROUNDS=${1:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
EMBER=$(scripts/build-release)
K=$(scripts/pvm-kernel)
WORK=$(mktemp -d /tmp/ember-linux-bench.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# The /init: prints the marker, then reboots (as in tests/linux_pvm/linux_pvm.rs).
INITRD=$WORK/init.cpio
cargo run -q --release --example tiny-initrd -- "$INITRD" EMBER-INIT-OK
CMDLINE="console=ttyS0 noxsave noint3selftest nofxsaveleak clearcpuid=151,297,580,308,158,306,534,311,312,59,141 nofsgsbase noinvpcid nopcid nopku mitigations=off reboot=k panic=-1"

# time_to_marker CMD... → ms from exec to the marker line on stdout.
time_to_marker() {
  local start fifo=$WORK/out pid ms=timeout
  rm -f "$fifo"; mkfifo "$fifo"
  start=$(date +%s%N)
  "$@" >"$fifo" 2>/dev/null & pid=$!
  while IFS= read -r line; do
    if [[ $line == *EMBER-INIT-OK* ]]; then ms=$(( ($(date +%s%N) - start) / 1000000 )); break; fi
  done <"$fifo"
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  echo "$ms"
}

ember=(); qemu=()
for r in $(seq "$ROUNDS"); do
  e=$(time_to_marker "$EMBER" boot --kernel "$K/vmlinux" --initrd "$INITRD" --mem 64M --cmdline "$CMDLINE")
  q=$(time_to_marker qemu-system-x86_64 -M microvm,x-option-roms=off,rtc=off -accel kvm -cpu qemu64 -m 64M -smp 1 \
        -nodefaults -no-user-config -nographic -serial stdio -no-reboot -kernel "$K/vmlinux" -initrd "$INITRD" -append "$CMDLINE")
  echo "round $r: ember ${e} ms, qemu microvm ${q} ms" >&2
  ember+=("$e"); qemu+=("$q")
done
stat() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {m=(NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2; printf "%.0f ms (%d–%d)", m, v[1], v[NR]}'; }
echo "| VMM | exec → /init's line, median (min–max) |"
echo "| --- | --- |"
echo "| ember (PVH vmlinux) | $(stat "${ember[@]}") |"
echo "| QEMU microvm, KVM | $(stat "${qemu[@]}") |"
em=$(printf '%s\n' "${ember[@]}" | sort -n | awk '{v[NR]=$1} END {print (NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2}')
qm=$(printf '%s\n' "${qemu[@]}" | sort -n | awk '{v[NR]=$1} END {print (NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2}')
awk -v e="$em" -v q="$qm" 'BEGIN {printf "\nratio QEMU / ember (medians): %.2f×\n", q / e}'
