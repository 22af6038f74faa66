# Sourced by the nested-rig benches (bench/rig*.sh): the staging they do the
# same way, and the L1 run. The caller sets NAME (its name, for errors), has
# `say`, runs from the repository's root and calls rig_begin first.

# rig_begin: what every rig bench sets up first. EMBER, the ember measured
# (EMBER_BIN, or the shipped build); HOST_EMBER, the one that runs the rig
# itself (EMBER_RIG_TOOL, or EMBER); EMBER_INIT (rig_ember_init); KDIR, the
# kernel `ember setup` fetched; BUSYBOX; and WORK, a scratch directory removed
# on exit, with R=$WORK/rig (the L1's files, made) and I=$WORK/initrd (the
# L2's tree, made by rig_guest).
rig_begin() {
  EMBER=${EMBER_BIN:-$(scripts/build-release)}
  HOST_EMBER=${EMBER_RIG_TOOL:-$EMBER}
  rig_ember_init
  KDIR=$(rig_kernel) || exit 1
  BUSYBOX=$(rig_need busybox) || exit 1
  WORK=$(mktemp -d "/tmp/ember-${NAME%.sh}.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  R=$WORK/rig
  I=$WORK/initrd
  mkdir -p "$R"
}

# rig_need TOOL: the tool's path, or a loud exit.
rig_need() {
  command -v "$1" || { say "$NAME: $1 is not installed"; exit 1; }
}

# rig_kernel: the directory of the kernel `ember setup` fetched, or a loud exit.
rig_kernel() {
  local ver
  ver=$(cat "$HOME/.cache/ember/kernel/current" 2>/dev/null) ||
    { say "$NAME: no kernel in ~/.cache/ember (run \`ember setup\`)"; exit 1; }
  echo "$HOME/.cache/ember/kernel/$ver"
}

# rig_ember_init: builds ember-init (the rig's L1 is ember's appliance, whose
# /init it is) unless EMBER_INIT names one.
rig_ember_init() {
  if [ -z "${EMBER_INIT:-}" ]; then
    cargo build --locked --release --quiet -p ember-init
    export EMBER_INIT=$PWD/target/release/ember-init
  fi
}

# rig_guest KDIR RIG_DIR INITRD_TREE BUSYBOX: the L2 guest every VMM boots:
# Debian's vmlinux without its debug info (which L1 would unpack under TCG for
# nothing) as RIG_DIR/vmlinux, and a busybox tree in INITRD_TREE for the
# caller's /init; rig_cpio packs the tree once /init is written.
rig_guest() {
  objcopy --strip-debug "$1/vmlinux" "$2/vmlinux"
  mkdir -p "$3/bin" "$3/dev" "$3/proc"
  cp "$4" "$3/bin/busybox"
  ln -s busybox "$3/bin/sh"
}

# rig_cpio INITRD_TREE OUT: the tree, /init made executable, as a newc cpio.
rig_cpio() {
  chmod +x "$1/init"
  (cd "$1" && find . | cpio -o -H newc --quiet) > "$2"
}

# rig_stage BINARY DEST: a VMM binary copied into the rig, without debug info.
rig_stage() {
  objcopy --strip-debug "$1" "$2" 2>/dev/null || cp "$1" "$2"
}

# rig_l1 OUT EMBER-RUN-ARGS...: runs the rig (an L1 with /dev/kvm: `ember run
# --backend qemu --nested-kvm --cpus 2 ARGS`, with $HOST_EMBER) to its end,
# its output in OUT, the RIG-BOOT/NOTE/FAILED lines shown as they come.
# RIG-START and RIG-BOOT lines get ` cpu=TICKS` appended: the host CPU time
# (user + system, clock ticks) the L1's QEMU has used so far. Boots run one
# after another in an otherwise idle L1, so the CPU used between two RIG-BOOT
# lines is what that boot cost the host: unlike wall time, it hardly moves
# when other work on the host preempts the L1 (wall times on a shared 2-core
# machine swing by 2x from boot to boot).
rig_l1() {
  local out=$1 fifo l1 l
  shift
  fifo=$(mktemp -u /tmp/ember-rig-l1.XXXXXX)
  mkfifo "$fifo"
  "$HOST_EMBER" run --backend qemu --nested-kvm --cpus 2 "$@" > "$fifo" &
  l1=$!
  l1_cpu() {
    q=$(ps -e -o pid=,ppid=,comm= | awk -v root="$l1" '{ up[$1] = $2; name[$1] = $3 }
      END { for (p in name) if (name[p] ~ /^qemu-system/) {
        for (a = p; (a in up) && a != root && a > 1; a = up[a]) ;
        if (a == root) { print p; exit } } }')
    [ -n "$q" ] && awk '{ print $14 + $15 }' "/proc/$q/stat" 2>/dev/null
  }
  while IFS= read -r l; do
    case $l in RIG-BOOT* | RIG-START*) l="${l%$'\r'} cpu=$(l1_cpu)" ;; esac
    printf '%s\n' "$l"
  done < "$fifo" | tee "$out" | grep --line-buffered '^RIG-BOOT\|^RIG-NOTE\|^RIG-FAILED' >&2 || true
  rm -f "$fifo"
  wait "$l1" || say "$NAME: the rig ended with status $?"
}
