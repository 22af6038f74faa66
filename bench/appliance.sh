#!/usr/bin/env bash
# Appliance benchmarks: ember's appliance against the same kernel with a plain
# busybox initramfs and against libguestfs (guestfish/supermin), all on
# QEMU/TCG; plus appliance build cost, cold and cached, against supermin.
#
# Usage: bench/appliance.sh [RUNS]      (default 5; needs `ember setup` done)
# Prints medians and min–max in milliseconds, and ratios to ember.
set -euo pipefail

RUNS=${1:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
EMBER=$(scripts/build-release)
cargo build --release -q -p ember-init
export EMBER_INIT=$ROOT/target/release/ember-init
WORK=$(mktemp -d /tmp/ember-bench.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

CACHE=${EMBER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ember}
VER=$(cat "$CACHE/kernel/current" 2>/dev/null) || {
    echo "run \`ember setup\` first" >&2
    exit 1
}
VMLINUX=$CACHE/kernel/$VER/vmlinux

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# stats NAME < values  → prints "NAME median min max" and records the median.
declare -A MEDIAN
stats() {
    local name=$1 sorted n
    sorted=$(sort -g)
    n=$(echo "$sorted" | wc -l)
    local med min max
    med=$(echo "$sorted" | awk -v n="$n" 'NR==int((n+1)/2){a=$1} NR==int(n/2)+1{b=$1} END{printf "%.1f", (n%2)?a:(a+b)/2}')
    min=$(echo "$sorted" | head -1)
    max=$(echo "$sorted" | tail -1)
    MEDIAN[$name]=$med
    printf '%-44s %10s ms   (min–max %s–%s, n=%s)\n' "$name" "$med" "$min" "$max" "$n"
}

# timeit NAME CMD… : runs CMD RUNS times after one warm-up.
# (stats reads a file, not a pipe: a pipeline would run it in a subshell and
# lose MEDIAN.)
timeit() {
    local name=$1
    shift
    "$@" >/dev/null 2>&1 || { echo "$name: command failed: $*" >&2; return 1; }
    for _ in $(seq "$RUNS"); do
        local s e
        s=$(now_ms)
        "$@" >/dev/null 2>&1
        e=$(now_ms)
        echo $((e - s))
    done >"$WORK/times"
    stats "$name" <"$WORK/times"
}

ratio() { awk -v a="${MEDIAN[$1]}" -v b="${MEDIAN[$2]}" 'BEGIN{printf "%.2fx", a/b}'; }

echo "host: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); kernel $VER; $(qemu-system-x86_64 --version | head -1)"
echo "runs: $RUNS (after one warm-up each)"
echo

# --- Boot to a command and back -------------------------------------------
# A plain busybox initramfs whose init powers off, same kernel and machine.
mkdir -p "$WORK/bb/bin"
cp "$(command -v busybox)" "$WORK/bb/bin/busybox"
printf '#!/bin/busybox sh\n/bin/busybox poweroff -f\n' >"$WORK/bb/init"
chmod +x "$WORK/bb/init"
(cd "$WORK/bb" && find . | cpio -o -H newc --quiet >"$WORK/busybox.cpio")
QEMU_COMMON=(qemu-system-x86_64 -M q35 -accel tcg -cpu max -m 256M -nodefaults -no-user-config
    -nographic -display none -no-reboot -serial null)

timeit "ember run --backend qemu -- true" "$EMBER" run --backend qemu -- true
timeit "same kernel + busybox initramfs (poweroff)" \
    "${QEMU_COMMON[@]}" -kernel "$VMLINUX" -initrd "$WORK/busybox.cpio" \
    -append "console=ttyS0 quiet panic=-1"
timeit "same + ember's cmdline (cryptomgr.notests)" \
    "${QEMU_COMMON[@]}" -kernel "$VMLINUX" -initrd "$WORK/busybox.cpio" \
    -append "console=ttyS0 quiet panic=-1 cryptomgr.notests"
if command -v guestfish >/dev/null; then
    timeit "guestfish -a /dev/null run (libguestfs, TCG)" \
        env LIBGUESTFS_BACKEND=direct LIBGUESTFS_BACKEND_SETTINGS=force_tcg \
        guestfish -a /dev/null run
fi
echo
echo "ratio busybox/ember:   $(ratio "same kernel + busybox initramfs (poweroff)" "ember run --backend qemu -- true")"
echo "ratio busybox with ember's cmdline/ember: $(ratio "same + ember's cmdline (cryptomgr.notests)" "ember run --backend qemu -- true")"
[[ -n ${MEDIAN["guestfish -a /dev/null run (libguestfs, TCG)"]:-} ]] &&
    echo "ratio guestfish/ember: $(ratio "guestfish -a /dev/null run (libguestfs, TCG)" "ember run --backend qemu -- true")"
echo

# --- Appliance build: cold and cached ----------------------------------------
# A private cache holding only the kernel (symlinked), so every "cold" build
# really builds.
COLD=$WORK/cache
mkdir -p "$COLD/kernel"
ln -s "$CACHE/kernel/$VER" "$COLD/kernel/$VER"
cp "$CACHE/kernel/current" "$COLD/kernel/current"
field() { sed -E "s/.*\"$1\":([^,}]*).*/\\1/"; }
for _ in $(seq "$RUNS"); do
    rm -rf "$COLD/appliances" "$COLD/modules"
    EMBER_CACHE=$COLD "$EMBER" run --prepare-only -- sh | field ms
done >"$WORK/times"
stats "ember appliance build, cold (sh)" <"$WORK/times"
for _ in $(seq "$RUNS"); do
    EMBER_CACHE=$COLD "$EMBER" run --prepare-only -- sh | field ms
done >"$WORK/times"
stats "ember appliance lookup, cached (sh)" <"$WORK/times"
SIZE=$(EMBER_CACHE=$COLD "$EMBER" run --prepare-only -- sh | field bytes)
echo "ember appliance size (sh + libc + modules + init): $((SIZE / 1024)) KiB"
echo "ember-init size: $(stat -c %s "$EMBER_INIT") bytes"

if command -v supermin >/dev/null; then
    # A comparable supermin appliance: the same shell (dash) and libc, from
    # host packages; the build step is what runs before every libguestfs
    # launch when the cache is stale.
    supermin --prepare dash libc6 -o "$WORK/supermin.d" >/dev/null 2>&1
    for _ in $(seq "$RUNS"); do
        rm -rf "$WORK/appliance.d"
        s=$(now_ms)
        supermin --build -f ext2 --host-cpu x86_64 "$WORK/supermin.d" -o "$WORK/appliance.d" >/dev/null 2>&1
        e=$(now_ms)
        echo $((e - s))
    done >"$WORK/times"
    stats "supermin --build -f ext2 (dash + libc6)" <"$WORK/times"
    ls -l "$WORK/appliance.d" | awk 'NR>1{printf "  supermin %-7s %8d KiB (apparent)\n", $9, $5/1024}'
    du -sk "$WORK/appliance.d/root" | awk '{printf "  supermin root    %8d KiB (on disk)\n", $1}'
    echo "ratio supermin build / ember cold build: $(ratio "supermin --build -f ext2 (dash + libc6)" "ember appliance build, cold (sh)")"
fi
