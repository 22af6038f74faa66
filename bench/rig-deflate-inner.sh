#!/bin/sh
# The inside of bench/rig-deflate.sh: runs in the nested rig's L1 guest, from
# the directory bench/rig-deflate.sh filled. Boots the L2 under each VMM of
# VMMS (side by side), then CYCLES times, VMM after VMM: inflate INFLATE MiB,
# wait for the guest's `@inflated C`, deflate, wait for its `TOUCH cycle=C`
# line. Prints per VMM and cycle:
#   RIG-CYCLE <vmm> <cycle> ok|bad|crash|hang <seconds> [what]
#   RIG-BOOTED <vmm>                       (each boot, first and after a crash)
#   RIG-TAIL <vmm> <line>                  (a crash's or hang's console tail)
b=/bin/busybox
$b mkdir -p /tmp/rig-bin && $b --install -s /tmp/rig-bin
export PATH=/tmp/rig-bin:$PATH
[ -e /proc/uptime ] || mount -t proc proc /proc
CMDLINE="console=ttyS0 quiet panic=-1 reboot=k"
K=./vmlinux
I=./initrd.cpio
now() { read -r t _ < /proc/uptime; echo "${t%.*}"; }

# start VMM: boots it in the background; its console in /tmp/VMM.console.
start() {
  con=/tmp/$1.console
  : > "$con"
  case $1 in
    ember)
      rm -f /tmp/ember.sock
      # shellcheck disable=SC2086 # EMBER_ARGS is a list of options
      ./ember boot --kernel $K --initrd $I --mem "${MEM}M" --cpus 1 --cmdline "$CMDLINE" \
        --balloon --balloon-no-reporting --api-socket /tmp/ember.sock $EMBER_ARGS \
        </dev/null >"$con" 2>&1 &
      ;;
    qemu)
      # QMP over a pipe pair (busybox has no unix-socket client).
      rm -f /tmp/qmp.in /tmp/qmp.out
      mkfifo /tmp/qmp.in /tmp/qmp.out
      qemu-system-x86_64 -L ./qemu-share -M pc -enable-kvm -cpu host -m "${MEM}M" -smp 1 \
        -nodefaults -no-user-config -nographic -serial stdio -no-reboot \
        -kernel $K -initrd $I -append "$CMDLINE" -device virtio-balloon-pci,id=balloon0 \
        -chardev pipe,id=qmp,path=/tmp/qmp -mon chardev=qmp,mode=control \
        </dev/null >"$con" 2>&1 &
      ;;
  esac
  eval "pid_$1=$!"
  if [ "$1" = qemu ]; then
    cat /tmp/qmp.out >> /tmp/qmp.log &
    qmp_reader=$!
    exec 4>/tmp/qmp.in
    echo '{"execute":"qmp_capabilities"}' >&4
  fi
  echo "RIG-BOOTED $1"
}

# stop VMM: ends it (after a crash or a hang, or at the end).
stop() {
  eval "p=\$pid_$1"
  kill "$p" 2>/dev/null
  wait "$p" 2>/dev/null
  if [ "$1" = qemu ]; then exec 4>&-; kill "$qmp_reader" 2>/dev/null; fi
  return 0
}

# balloon VMM MIB: the balloon's size, MIB.
balloon() {
  case $1 in
    ember) ./ember ctl --api-socket /tmp/ember.sock balloon --target-mib "$2" >/dev/null ;;
    qemu) echo "{\"execute\":\"balloon\",\"arguments\":{\"value\":$(((MEM - $2) << 20))}}" >&4 ;;
  esac
}

# wait_for VMM PATTERN: until the console has PATTERN (0); the VMM exited or
# the kernel panicked or oopsed (1); STEP_S seconds passed (2).
wait_for() {
  con=/tmp/$1.console
  eval "p=\$pid_$1"
  end=$(($(now) + STEP_S))
  while :; do
    tr -d '\r' < "$con" | grep -q "$2" && return 0
    grep -q 'Kernel panic\|triple fault\|Oops\|BUG:' "$con" && { why="console: $(grep -m1 'Kernel panic\|triple fault\|Oops\|BUG:' "$con" | tr -d '\r')"; return 1; }
    kill -0 "$p" 2>/dev/null || { wait "$p"; why="the VMM exited with status $?"; return 1; }
    [ "$(now)" -ge "$end" ] && { why="no '$2' in ${STEP_S} s"; return 2; }
    sleep 0.5
  done
}

# failed VMM CYCLE KIND T0: reports a crash or hang with the console's tail
# and boots the VMM again.
failed() {
  echo "RIG-CYCLE $1 $2 $3 $(($(now) - $4)) $why"
  tr -d '\r' < "/tmp/$1.console" | tail -25 | sed "s/^/RIG-TAIL $1 $2 /"
  stop "$1"
  start "$1"
  wait_for "$1" '@ready' || echo "RIG-NOTE $1 did not come up again: $why"
  eval "cyc_$1=1"
}

free -m | sed 's/^/RIG-NOTE L1 /'
for v in $VMMS; do start "$v"; done
for v in $VMMS; do
  wait_for "$v" '@ready' || { echo "RIG-NOTE $v did not boot: $why"; tail -30 "/tmp/$v.console" | sed "s/^/RIG-TAIL $v 0 /"; }
  eval "cyc_$v=1"
  echo "RIG-NOTE $v $(tr -d '\r' < "/tmp/$v.console" | grep '@ready')"
done
for c in $(seq "$CYCLES"); do
  for v in $VMMS; do
    # (The guest counts its own cycles from 1 after each boot.)
    eval "g=\$cyc_$v"
    t0=$(now)
    balloon "$v" "$INFLATE"
    wait_for "$v" "^@inflated $g " || { k=$?; [ $k = 1 ] && failed "$v" "$c" crash "$t0" || failed "$v" "$c" hang "$t0"; continue; }
    balloon "$v" 0
    wait_for "$v" "^TOUCH cycle=$g " || { k=$?; [ $k = 1 ] && failed "$v" "$c" crash "$t0" || failed "$v" "$c" hang "$t0"; continue; }
    line=$(tr -d '\r' < "/tmp/$v.console" | grep "^TOUCH cycle=$g ")
    case $line in *" bad=0 "*) r=ok ;; *) r=bad ;; esac
    echo "RIG-CYCLE $v $c $r $(($(now) - t0)) $line"
    echo "RIG-NOTE $v cycle $c: $r in $(($(now) - t0)) s ($(tr -d '\r' < "/tmp/$v.console" | grep "^@deflated $g "))"
    eval "cyc_$v=$((g + 1))"
  done
done
for v in $VMMS; do stop "$v"; done
sleep 2
