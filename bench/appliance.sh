#!/usr/bin/env bash
# Appliance benchmarks: ember's appliance against the same kernel with a plain
# busybox initramfs and against libguestfs (guestfish/supermin), all on
# QEMU/TCG; plus appliance build cost, cold and cached, against supermin.
#
# Usage: bench/appliance.sh [RUNS]      (default 5; needs `ember setup` done)
#        BENCH_ONLY=doctor bench/appliance.sh [RUNS]   (only the boot doctor's part)
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

die() {
    echo "appliance.sh: $*" >&2
    exit 1
}
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

if [[ ${BENCH_ONLY:-} != doctor ]]; then
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
fi # BENCH_ONLY

# --- The boot doctor on the appliance, and following its advice ------------
# `ember analyze --advise --verify` on the appliance's own boot: its kernel,
# initramfs and command line as `ember run` boots them before following the
# advice (q35 with SeaBIOS), the channel pointed at /dev/null so ember-init
# loads its modules and powers off. Then the appliance before (`--bios
# seabios`) and after (the defaults, which follow the advice) is timed
# interleaved with the busybox initramfs, with QEMU's default firmware
# (SeaBIOS) and with qboot. Every step that fails says so and stops the script.
echo
echo "--- boot doctor on the appliance ---"
APP=$("$EMBER" run --backend qemu --prepare-only -- true) || die "ember run --backend qemu --prepare-only -- true failed"
APP_INITRD=$(echo "$APP" | sed -E 's/.*"initrd":"([^"]*)".*/\1/')
APP_KERNEL=$(echo "$APP" | sed -E 's/.*"kernel":"([^"]*)".*/\1/')
[[ -f $APP_INITRD && -f $APP_KERNEL ]] || die "cannot read the appliance from: $APP"
APP_ARGS="EMBER_CHANNEL=/dev/null EMBER_MODULES=core,pci"
BB_CMDLINE="console=ttyS0 quiet panic=-1 cryptomgr.notests"
APP_CMDLINE="$BB_CMDLINE $APP_ARGS"
"$EMBER" analyze --backend qemu --machine q35 --accel tcg --kernel "$APP_KERNEL" \
    --initrd "$APP_INITRD" --cmdline "$APP_CMDLINE" --userspace '^reboot: Power down|^ember-init: ' \
    -n 2 -w 0 --timeout 600 --advise --verify --verify-pairs "$RUNS" --json >"$WORK/doctor.json" ||
    die "ember analyze --advise --verify failed (its stderr is above)"
cp "$WORK/doctor.json" "${DOCTOR_JSON:-/tmp/ember-appliance-doctor.json}"
python3 - "$WORK/doctor.json" <<'PY' || die "cannot read the doctor's JSON"
import json, sys
d = json.load(open(sys.argv[1]))
print(f"appliance boot (spawn to exit): {d['total']['mean']:.0f} ms ±{d['total']['sd']:.0f}")
print(f"{'advice':40} {'change':44} {'predicted':>10} {'measured (95% CI)':>26}  verdict")
for a in d["advice"]["advice"]:
    v = a.get("verified")
    m = "-"
    if v and v.get("saving_ms"):
        s = v["saving_ms"]
        m = f"{s['estimate']:.0f} ({s['low']:.0f} … {s['high']:.0f})"
    ch = a["change"]
    desc = {"cmdline_add": lambda c: "cmdline += " + c["option"], "cpus": lambda c: f"--cpus {c['cpus']}",
            "mem": lambda c: f"--mem {c['mib']}", "bios": lambda c: "--bios " + c["path"],
            "kconfig_off": lambda c: c["symbol"] + "=n", "guest": lambda c: c["what"][:44]}[ch["kind"]](ch)
    print(f"{a['id'][:40]:40} {desc[:44]:44} {a['predicted_ms']:>8.1f}ms {m:>26}  {v['verdict'] if v else 'manual'}")
c = d["advice"].get("combined")
if c:
    s = c["verified"].get("saving_ms") or {}
    print(f"all automatic changes together: predicted {c['predicted_ms']:.1f} ms, measured "
          f"{s.get('estimate', float('nan')):.1f} ms ({s.get('low', float('nan')):.0f} … {s.get('high', float('nan')):.0f})")
PY
# What the appliance's defaults follow of the advice (ember's own
# no_timer_check aside): qboot, one UART, no APIC timer calibration (TCG, one
# vCPU), no ftrace call-site check.
FOLLOWED="qboot 8250.nr_uarts nolapic_timer ftrace-check"
PREDICTED=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sum(a['predicted_ms'] for a in d['advice']['advice'] if a['id'] in sys.argv[2].split()))" "$WORK/doctor.json" "$FOLLOWED") ||
    die "no prediction in the doctor's JSON"
echo "predicted saving of the advice the appliance follows ($FOLLOWED): $PREDICTED ms"

# --- Guest work, independent of the host's load ------------------------------
# QEMU's -icount shift=0,sleep=off: the guest's clock advances 1 ns per guest
# instruction (and jumps over idle time), so the kernel's timestamp of its
# power-down line counts the work each initramfs makes the guest do, the same
# on a loaded machine as on a quiet one (it leaves out the firmware, which runs
# before the kernel's clock, and the cost of device emulation).
echo
echo "--- guest work: the kernel's clock at power-down under -icount (1 ns per instruction) ---"
icount_ms() {
    local out
    out=$(qemu-system-x86_64 -M q35 -accel tcg -cpu max -m 256M -nodefaults -no-user-config \
        -nographic -display none -no-reboot -serial stdio -icount shift=0,sleep=off \
        -bios /usr/share/qemu/qboot.rom -kernel "$VMLINUX" "$@" </dev/null 2>&1) ||
        die "QEMU -icount failed: $*"
    echo "$out" | tr -d '\r' | sed -nE 's/.*\[ *([0-9.]+)\] reboot: Power down.*/\1/p' | tail -1 |
        awk '{printf "%.1f", $1 * 1000}'
}
# The appliance's own command line as `ember run` boots it now (the advice it
# follows included), its channel pointed at /dev/null; and busybox given the
# same kernel options, for a like-for-like row.
APP_NOW=$(echo "$APP" | python3 -c 'import json,sys; print(json.load(sys.stdin)["cmdline"])' |
    sed -E 's#EMBER_CHANNEL=[^ ]*#EMBER_CHANNEL=/dev/null#') || die "no cmdline in: $APP"
BB_SAME=$(echo "$APP_NOW" | tr ' ' '\n' | grep -v '^EMBER_' | tr '\n' ' ')
G_BB=$(icount_ms -initrd "$WORK/busybox.cpio" -append "$BB_CMDLINE")
G_BB_SAME=$(icount_ms -initrd "$WORK/busybox.cpio" -append "$BB_SAME")
G_APP0=$(icount_ms -initrd "$APP_INITRD" -append "$APP_CMDLINE" -device virtio-serial-pci)
G_APP=$(icount_ms -initrd "$APP_INITRD" -append "$APP_NOW" -device virtio-serial-pci)
[[ -n $G_BB && -n $G_BB_SAME && -n $G_APP0 && -n $G_APP ]] ||
    die "no power-down line under -icount (busybox: '$G_BB' / '$G_BB_SAME', appliance: '$G_APP0' / '$G_APP')"
echo "appliance now: $APP_NOW"
printf '%-52s %10s ms\n' "busybox initramfs ($BB_CMDLINE)" "$G_BB" \
    "busybox initramfs, the appliance's kernel options" "$G_BB_SAME" \
    "appliance before the advice ($APP_CMDLINE)" "$G_APP0" \
    "appliance now (its own command line)" "$G_APP"
awk -v a="$G_APP" -v b="$G_BB" -v s="$G_BB_SAME" -v z="$G_APP0" 'BEGIN{
    printf "appliance now / bare busybox (guest work): %.3fx; / busybox with the same options: %.3fx; now / before: %.3fx\n", a/b, a/s, a/z}'

echo
echo "--- the appliance before and after following the advice, interleaved ($RUNS rounds) ---"
# Before and after as QEMU boots them (the channel at /dev/null: ember-init
# loads its modules and powers off), so the saving is the advice's alone;
# then the appliance as `ember run -- true` runs it, against busybox bare, as
# QEMU boots it by default (SeaBIOS), with qboot, and with the appliance's
# kernel options too (like for like).
BB_QEMU="${QEMU_COMMON[*]} -kernel $VMLINUX -initrd $WORK/busybox.cpio"
APP_QEMU="${QEMU_COMMON[*]} -kernel $VMLINUX -initrd $APP_INITRD -device virtio-serial-pci"
QBOOT_ROM=/usr/share/qemu/qboot.rom
python3 bench/interleave.py "$RUNS" "$WORK/interleaved.json" \
    "appliance before the advice=$APP_QEMU -append '$APP_CMDLINE'" \
    "appliance after the advice=$APP_QEMU -bios $QBOOT_ROM -append '$APP_NOW'" \
    "ember run -- true=$EMBER run --backend qemu -- true" \
    "busybox (QEMU's default: SeaBIOS)=$BB_QEMU -append '$BB_CMDLINE'" \
    "busybox + qboot=$BB_QEMU -bios $QBOOT_ROM -append '$BB_CMDLINE'" \
    "busybox + qboot + the appliance's options=$BB_QEMU -bios $QBOOT_ROM -append '$BB_SAME'" ||
    die "interleaved runs failed (above)"
python3 - "$WORK/interleaved.json" "$PREDICTED" <<'PY' || die "cannot summarise the interleaved runs"
import json, statistics as st, sys
d, predicted = json.load(open(sys.argv[1])), float(sys.argv[2])
before, after = d["appliance before the advice"], d["appliance after the advice"]
run = d["ember run -- true"]
for kind in ("wall", "cpu"):
    saving = [b - a for b, a in zip(before[kind], after[kind])]
    m, mean = st.median(saving), st.mean(saving)
    print(f"{kind}: saving per round (before − after) median {m:.0f} ms, mean {mean:.0f} ms "
          f"({min(saving):.0f}–{max(saving):.0f}); predicted {predicted:.0f} ms: "
          f"predicted/measured (mean) {predicted / mean if mean else float('nan'):.2f}")
    r = st.median(run[kind])
    for name in ("busybox (QEMU's default: SeaBIOS)", "busybox + qboot", "busybox + qboot + the appliance's options"):
        print(f"{kind}: ember run -- true / {name}: {r / st.median(d[name][kind]):.3f}x")
PY
