#!/bin/sh
# Regenerates the sample boot-lab reports in this directory:
#   analyze.txt, timeline.svg, timeline.html, timeline.png  (Debian cloud kernel, QEMU/TCG, initcall_debug)
#   bench.txt           (the same kernel, quiet, 10 boots after 3 warm-ups)
#   bench-vs-quiet.txt  (initcall_debug+ignore_loglevel vs quiet, interleaved)
#   bench-ember.txt, analyze-ember.txt  (the ember test guest under --backend ember)
#   bench-ember-console.txt  (ember: the cost of ~6 kB more console output, via --vs)
# Usage: docs/boot-lab/make-sample.sh   (from the repository root)
set -eu
out=$(dirname "$0")
cache=${EMBER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ember}/kernel
ver=$(cat "$cache/current")   # written by `ember setup`
kernel=${KERNEL:-$cache/$ver/boot/vmlinuz-$ver}
cargo build --release --quiet
cargo build -p ember-test-guest --release --quiet --target-dir target/guests
ember=target/release/ember
guest=target/guests/release/ember-test-guest
qemu="--backend qemu --machine q35 --kernel $kernel --busybox-init"

$ember analyze $qemu --cmdline 'console=ttyS0 panic=-1 initcall_debug ignore_loglevel' \
    -n 5 -w 1 --svg "$out/timeline.svg" --html "$out/timeline.html" > "$out/analyze.txt"
$ember bench $qemu --cmdline 'console=ttyS0 panic=-1 quiet' -n 10 -w 3 > "$out/bench.txt"
$ember bench $qemu --cmdline 'console=ttyS0 panic=-1 initcall_debug ignore_loglevel' \
    --vs 'cmdline=console=ttyS0 panic=-1 quiet' -n 6 -w 1 > "$out/bench-vs-quiet.txt"

cmdline='console=ttyS0 mark=0x42 print=ember-lab:_begin_work spin=20 print=ember-lab:_end_work'
$ember bench --backend ember --kernel $guest --cmdline "$cmdline" -n 20 -w 3 > "$out/bench-ember.txt"
$ember analyze --backend ember --kernel $guest --cmdline "$cmdline" -n 10 -w 2 --min-ms 0 > "$out/analyze-ember.txt"
# Console cost on ember, measured: 50 extra lines of 60 characters (echoed once more
# in the banner's copy of the command line), interleaved with boots without them.
lines=$(python3 -c "print(' '.join(['print=' + 'x' * 59] * 50))")
$ember bench --backend ember --kernel $guest --cmdline 'console=ttyS0' --vs "cmdline+=$lines" \
    --metric shutdown -n 10 -w 2 > "$out/bench-ember-console.txt"

profile=$(mktemp -d)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --screenshot="$out/timeline.png" --window-size=1400,900 \
    "file://$(realpath "$out/timeline.html")" 2>/dev/null
rm -rf "$profile"
