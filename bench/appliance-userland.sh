#!/usr/bin/env bash
# The busybox base layer's cost: `ember run -- true` with and without
# `--bare`, interleaved (A B A B …), N runs each after one warm-up of each
# (which also builds both appliances into the cache). Prints each side's
# median and min-max wall time and the ratio.
#   bench/appliance-userland.sh [N] [ember run options…]
set -euo pipefail
n=${1:-5}; shift || true
ember=${EMBER:-ember}
t() { local s e; s=$(date +%s%N); "$ember" run "$@" -- true >/dev/null; e=$(date +%s%N); echo $(( (e - s) / 1000000 )); }
t "$@" >/dev/null; t --bare "$@" >/dev/null
a=(); b=()
for _ in $(seq "$n"); do a+=("$(t "$@")"); b+=("$(t --bare "$@")"); done
stats() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {m=(NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2; printf "%d %d %d", m, v[1], v[NR]}'; }
read -r ma mina maxa <<<"$(stats "${a[@]}")"
read -r mb minb maxb <<<"$(stats "${b[@]}")"
size() { "$ember" run "$@" --prepare-only -- true | sed 's/.*"bytes":\([0-9]*\).*/\1/'; }
echo "with busybox: median ${ma} ms (min ${mina}, max ${maxa}); initramfs $(size "$@") bytes"
echo "--bare:       median ${mb} ms (min ${minb}, max ${maxb}); initramfs $(size --bare "$@") bytes"
awk -v a="$ma" -v b="$mb" 'BEGIN {printf "ratio with/bare: %.3f\n", a/b}'
