#!/bin/busybox sh
# The nested rig's suite, run by tests/nested_rig/ in ONE L1 guest (ember's
# appliance under QEMU/TCG with --nested-kvm, so /dev/kvm exists here). Each
# case boots Debian's unmodified cloud kernel (L2) with ember and reports as
#   @@ CASE start limit=S
#   @@ CASE out LINE     the case's stdout (for L2 boots: the guest console)
#   @@ CASE err LINE     its stderr
#   @@ CASE end rc=N ms=M [hung=S]
# The harness judges every case on the host; this script only runs them.
# Each case has its own time limit: a case still running after it is killed
# (its whole process group: ember and any VM it started), reported with
# rc=124 hung=S, and the next case runs.
# Environment (from the harness): RIG_VERSION, RIG_NOTE_OFF (offset of the
# PVH note's type in the vmlinux), RIG_TOKEN, RIG_L2_ARGS (extra ember args
# for every L2 boot: a way to break things on purpose), RIG_CASES (a filter),
# RIG_LIMIT_SCALE (multiplies every case's limit; default 1).
b=/bin/busybox
export PATH=/rig/bin:$PATH
cache=/root/.cache/ember/kernel/$RIG_VERSION
vmlinux=$cache/vmlinux
bz=/rig/vmlinuz
ms() { $b awk '{ printf "%d", $1 * 1000 }' /proc/uptime; }
secs() { $b awk '{ printf "%d", $1 }' /proc/uptime; }
# limit N: a case's limit of N seconds, scaled; inner N: the --timeout for the
# ember inside such a case, 10 s less, so that ember's own timeout (which
# says what timed out) fires before the watchdog.
limit() { echo $(($1 * ${RIG_LIMIT_SCALE:-1})); }
inner() { echo $(($(limit "$1") - 10)); }

# run_case NAME LIMIT CMD...: runs CMD (a command or a function of this
# script) as the leader of a process group of its own (setsid, through this
# script's `--run`), so that after LIMIT seconds the whole case can be
# killed: TERM, then KILL 5 s later.
# A case that fails after its L2 kernel reported trouble (see l2_trouble)
# runs once more, and says so (`@@ NAME panic LINE` for the first attempt's
# last console lines, then `@@ NAME retry`): Debian's kernel has, rarely (one
# boot in dozens), oopsed in interrupt context under the rig's TCG-emulated
# SVM with nothing of the VMM in the trace, once stalled (a CI run: 2 vCPUs,
# its last line a dump's `Code:`), and once warned in its XSAVE set-up
# (fpu__init_system_xstate) and then hung (a CI run, `doctor-verbose`). The
# harness prints every retry loudly; a second failure fails the case.
run_case() {
  name=$1
  limit=$(limit "$2")
  shift 2
  case " ${RIG_CASES:-all} " in *" all "* | *" $name "*) ;; *) return ;; esac
  echo "@@ $name start limit=$limit"
  for attempt in 1 2; do
    attempt_case "$@"
    [ "$rc" != 0 ] && [ -z "$hung" ] && [ "$attempt" = 1 ] &&
      l2_trouble "/tmp/$name.out" "/tmp/$name.err" || break
    $b cat "/tmp/$name.out" "/tmp/$name.err" | $b tail -n 60 | $b sed "s/^/@@ $name panic /"
    echo "@@ $name retry rc=$rc"
  done
  $b sed "s/^/@@ $name out /" "/tmp/$name.out"
  $b sed "s/^/@@ $name err /" "/tmp/$name.err"
  echo "@@ $name end rc=$rc ms=$((t1 - t0))$hung"
}

# l2_trouble FILE...: whether a case's output shows its L2 kernel in trouble:
# a panic, a register dump (any oops, warning or RCU stall has one), or a
# triple fault (ember's report of it). A console has the dump's `Code:`
# line; `ember analyze`'s report quotes only its `RIP:` line (in
# `failures.oops`), so both are looked for. The triple fault: a balloon case
# whose guest, after a deflate, crashed while touching the memory it got
# back (once, in a rig run here).
l2_trouble() {
  $b grep -q -e "Kernel panic - not syncing" -e "Code: [0-9a-f<]" -e "RIP: [0-9a-f][0-9a-f]*:" \
    -e "the guest crashed (triple fault)" "$@"
}

# attempt_case CMD...: one run of run_case's case ($name, $limit); sets rc,
# hung, t0 and t1.
attempt_case() {
  $b rm -f "/tmp/$name.hung"
  t0=$(ms)
  LIMIT=$limit $b setsid $b sh "$0" --run "$@" </dev/null >"/tmp/$name.out" 2>"/tmp/$name.err" &
  pid=$!
  # The watchdog. When the case ends first, its sleep outlives it harmlessly:
  # its output goes nowhere, so it holds no pipe of the suite's open.
  (
    $b sleep "$limit"
    : >"/tmp/$name.hung"
    $b kill -TERM -"$pid"
    $b sleep 5
    $b kill -KILL -"$pid"
  ) </dev/null >/dev/null 2>&1 &
  dog=$!
  wait "$pid"
  rc=$?
  $b kill "$dog" 2>/dev/null
  wait "$dog" 2>/dev/null
  t1=$(ms)
  hung=
  [ -e "/tmp/$name.hung" ] && rc=124 && hung=" hung=$limit"
}

# Debian's kernel, quiet, no PCI or legacy probing (as in ember's defaults).
# Each L2 boot takes ~4-35 s here; a guest that cannot power off (no ACPI)
# hangs until its timeout, and the case fails with status 124. LIMIT: the
# case's limit (l2 runs inside run_case, through --run).
CMDLINE="console=ttyS0 quiet panic=-1 reboot=k pci=off cryptomgr.notests 8250.nr_uarts=1 i8042.noaux i8042.nomux i8042.dumbkbd"
l2() {
  kernel=$1
  cpus=$2
  rcase=$3
  shift 3
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel "$kernel" --initrd /rig/l2.cpio --mem 256M --cpus "$cpus" --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE RIGCASE=$rcase RIGTOKEN=$RIG_TOKEN" $RIG_L2_ARGS "$@"
}

# The console both ways through COM1 (ember's stdin -> the guest's ttyS0 ->
# the guest's answer on the console -> ember's stdout). The guest says
# @uart-ready once its /init reads the console; only then does the input go
# in (bytes sent before the 8250 driver opens the port would be lost, on
# hardware too): a token line and 20 lines (1.6 KiB, 25 times the UART's
# 64-byte FIFO, so ember's flow control is exercised; every byte costs the
# guest two port reads, each an exit to ember, ~0.5 ms here). The guest
# answers with the token line and the md5 of the rest; @uart-sent-md5 is
# the md5 of what went in.
uart_lines() {
  i=0
  while [ $i -lt 20 ]; do
    echo "uart-line-$i-abcdefghijklmnopqrstuvwxyz-0123456789-ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    i=$((i + 1))
  done
}
uart() {
  fifo=/tmp/uart.in
  $b rm -f $fifo
  $b mkfifo $fifo
  echo "@uart-sent-md5 $(uart_lines | $b md5sum | $b cut -d' ' -f1)"
  # (The fifo's reader and writer open it together: neither blocks for long.)
  # The case's status is ember's.
  set -o pipefail
  l2 "$vmlinux" 1 uart <$fifo | while IFS= read -r line; do
    printf '%s\n' "$line"
    case $line in
      *@uart-ready*) { echo "uart-in-$RIG_TOKEN"; uart_lines; } >&3 ;;
    esac
  done 3>$fifo
}

# The balloon driven through the control socket (issue 13), judged from here
# (L1 is the L2 guest's host): ember's resident memory falls when Debian's
# virtio_balloon inflates to the target set with `ember ctl`, the statistics
# arrive, and after a deflate the guest can use that memory again (ember's
# resident memory grows as it touches it). The guest first touches and frees
# 150 MiB, and the balloon offers no free page reporting, so the pages the
# balloon takes are mostly resident ones.
BALLOON_MIB=160
rss_kib() { $b awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null; }
# wait_line FILE PATTERN: until FILE has a line matching PATTERN, or the
# case's time is up (then says so, and fails).
wait_line() {
  until $b grep -q "$2" "$1" 2>/dev/null; do
    [ "$(secs)" -ge "$CASE_END" ] && echo "@timeout no line '$2' in $1" && return 1
    $b sleep 0.2
  done
}
# vsock both ways between the L2 (Debian's vsock transport, socat
# VSOCK-CONNECT/VSOCK-LISTEN) and this L1 (socat on ember's hybrid vsock
# sockets): the guest's 1 MiB arrives at PATH_5000, and ours goes in through
# PATH with `CONNECT 1234` (retried until the guest listens; the first line
# back is `OK <host port>`). Both sides print checksums; the harness compares.
vsock_case() {
  d=/tmp/vsock
  $b rm -rf $d && $b mkdir -p $d
  $b dd if=/dev/urandom of=$d/h2g bs=64k count=16 2>/dev/null
  echo "@vsock-h2g-src-md5 $($b md5sum $d/h2g | $b cut -d' ' -f1)"
  socat -u UNIX-LISTEN:$d/v.sock_5000 CREATE:$d/g2h &
  lp=$!
  $b cat /rig/l2.cpio /rig/socat.cpio >$d/l2.cpio
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel "$vmlinux" --initrd $d/l2.cpio --mem 256M --cpus 1 --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE RIGCASE=vsock RIGTOKEN=$RIG_TOKEN" $RIG_L2_ARGS \
    --vsock cid=3,uds=$d/v.sock </dev/null >$d/con 2>$d/err &
  pid=$!
  wait_line $d/con '^@vsock-listening' && vsock_connect
  wait "$pid"
  rc=$?
  $b kill $lp 2>/dev/null
  echo "@vsock-g2h-recv-md5 $($b md5sum $d/g2h | $b cut -d' ' -f1)"
  $b cat $d/con
  $b sed 's/^/@stderr /' $d/err
  return $rc
}
# virtio-fs: the L2 (Debian's virtiofs) reads a share and writes into it,
# a read-only share refuses a write; ember snapshots it with the share
# mounted, the host changes the share, and a restore in a fresh ember reads
# it again (the old file, the new one, one held open across the snapshot)
# and writes. Both sides print checksums; the harness compares.
fs_case() {
  d=/tmp/fs
  $b rm -rf $d && $b mkdir -p $d/share $d/ro $d/snap
  $b dd if=/dev/urandom of=$d/share/h2g bs=64k count=16 2>/dev/null
  echo "@fs-h2g-src-md5 $($b md5sum $d/share/h2g | $b cut -d' ' -f1)"
  echo "from the host" >$d/share/before
  echo "read only" >$d/ro/text
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel "$vmlinux" --initrd /rig/l2.cpio --mem 256M --cpus 1 --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE RIGCASE=fs" $RIG_L2_ARGS --api-socket $d/api.sock \
    --fs tag=share,dir=$d/share --fs tag=ro,dir=$d/ro,ro </dev/null >$d/con 2>$d/err &
  pid=$!
  src=1
  wait_line $d/con '^@fs-snapshot-ready' && ember snapshot --api-socket $d/api.sock --to $d/snap/dir && src=0
  [ $src = 0 ] || $b kill $pid 2>/dev/null
  wait $pid
  brc=$?
  $b cat $d/con
  $b sed 's/^/@stderr /' $d/err
  echo "@fs-g2h-host-md5 $($b md5sum $d/share/g2h | $b cut -d' ' -f1)"
  echo "@fs-snapshot-rc $src boot-rc $brc"
  [ $src = 0 ] || return 1
  echo "written while saved" >$d/share/after
  echo 'echo "@fs-again $($b cat /mnt/before)"; echo "@fs-after $($b cat /mnt/after)"; echo "@fs-held $($b cat <&3)"; echo restored >/mnt/restored' |
    ember boot --restore $d/snap/dir --timeout "$((LIMIT - 10))" >$d/con2 2>&1
  rrc=$?
  $b cat $d/con2
  echo "@fs-restored-host $($b cat $d/share/restored 2>&1)"
  echo "@fs-restore-rc $rrc"
  return $rrc
}
vsock_connect() {
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    { printf 'CONNECT 1234\n'; $b cat $d/h2g; } | socat - UNIX-CONNECT:$d/v.sock >$d/ok 2>>$d/err
    ok=$($b head -n 1 $d/ok)
    case $ok in OK\ *) echo "@vsock-ok-line $ok" && return 0 ;; esac
    $b sleep 1
  done
  echo "@vsock-no-ok"
  return 1
}
# Networking between the L2 (Debian's own virtio_net on ember's virtio-net)
# and this L1, on taps in the L1's own network namespace (the L1 has no
# other network: no traffic leaves it). The L2 pings both ways of addressing
# (10.0.2.2 and fd00:2::2), sends 128 KiB over TCP to us over IPv4 and IPv6
# and takes as much from us over each, then is snapshotted; the restore
# comes onto another tap and MAC, and after the link change the guest pings
# and moves data both ways again. Both sides print checksums; the harness
# compares them.
net_case() {
  d=/tmp/net
  $b rm -rf $d && $b mkdir -p $d
  ip=
  for p in /usr/sbin/ip /usr/bin/ip /sbin/ip /bin/ip; do
    [ -z "$ip" ] && $p -V 2>/dev/null | $b grep -q iproute2 && ip=$p
  done
  [ -n "$ip" ] || { echo "@net-no-iproute2 (the L1 carries ip: --with ip)"; return 1; }
  for m in $($b cat /rig/ko/order); do $b insmod /rig/ko/$m || echo "@net-insmod-failed $m"; done
  # tap0 for the boot, tap1 (another host MAC too) for the restore.
  for t in 0 1; do
    $ip tuntap add tap$t mode tap && $ip link set tap$t address 02:00:00:00:00:a$t up || return 1
  done
  net_host_addrs tap0 || return 1
  for t in down4 down6 down6r; do
    $b dd if=/dev/urandom of=$d/$t bs=64k count=2 2>/dev/null
    echo "@net-host-$t-src-md5 $($b md5sum $d/$t | $b cut -d' ' -f1)"
  done
  socat -u TCP4-LISTEN:5001,reuseaddr CREATE:$d/up4 &
  l1=$!
  socat -u TCP6-LISTEN:5003,reuseaddr CREATE:$d/up6 &
  l2=$!
  socat -u TCP4-LISTEN:5005,reuseaddr CREATE:$d/up4r &
  l3=$!
  $b cat /rig/l2.cpio /rig/socat.cpio /rig/ethtool.cpio >$d/l2.cpio
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel "$vmlinux" --initrd $d/l2.cpio --mem 256M --cpus 1 --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE RIGCASE=net RIGTOKEN=$RIG_TOKEN" $RIG_L2_ARGS \
    --net tap=tap0,mac=02:00:00:00:00:01 --api-socket $d/api </dev/null >$d/con 2>$d/err &
  pid=$!
  net_boot_steps
  steps=$?
  [ $steps = 0 ] || $b kill $pid 2>/dev/null
  wait $pid
  brc=$?
  $b cat $d/con
  $b sed 's/^/@stderr /' $d/err
  echo "@net-snapshot-rc $src boot-rc=$brc"
  rrc=1
  if [ $steps = 0 ] && [ "$src" = 0 ]; then
    $ip link del tap0
    net_host_addrs tap1
    # The guest's console: the command after the restore, then (once the
    # download is in and the L1's neighbour table read, while the link is
    # still up) the line that lets it end.
    {
      echo "net_restored 02:00:00:00:00:02"
      {
        wait_line $d/con2 '^@net-down6r-listening' && net_push down6r "TCP6:[fd00:2::2]:5006"
        echo "@net-host-neigh $($ip neigh show dev tap1 | $b tr '\n' ' ')"
      } >$d/host2
      echo end
    } | ember boot --restore $d/snap --timeout "$((LIMIT - 10))" \
      --net tap=tap1,mac=02:00:00:00:00:02 >$d/con2 2>$d/err2
    rrc=$?
    $b cat $d/host2 $d/con2
    $b sed 's/^/@stderr /' $d/err2
  fi
  echo "@net-restore-rc $rrc"
  $b kill $l1 $l2 $l3 2>/dev/null
  for t in up4 up6 up4r; do
    echo "@net-host-$t-md5 $($b md5sum $d/$t 2>/dev/null | $b cut -d' ' -f1)"
  done
  [ "$brc" = 0 ] && [ "$rrc" = 0 ]
}
# net_host_addrs TAP: the L1's addresses, on TAP.
net_host_addrs() {
  $ip addr add 10.0.2.1/24 dev "$1" && $ip -6 addr add fd00:2::1/64 dev "$1" nodad
}
# The boot's side of net_case, to the first step that fails (so the guest's
# console is still printed): the two downloads, then the snapshot (src).
net_boot_steps() {
  src=1
  wait_line $d/con '^@net-down4-listening' && net_push down4 TCP4:10.0.2.2:5002 &&
    wait_line $d/con '^@net-down6-listening' && net_push down6 "TCP6:[fd00:2::2]:5004" &&
    wait_line $d/con '^@net-snapshot-ready' || return 1
  ember snapshot --api-socket $d/api --to $d/snap
  src=$?
}
# net_push TAG ADDRESS: the file TAG to the guest's listener at ADDRESS.
net_push() {
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    socat -u FILE:$d/$1 "$2" 2>>$d/err && echo "@net-host-$1 sent" && return 0
    $b sleep 1
  done
  echo "@net-host-$1-not-sent"
  return 1
}
# wait_actual SOCKET PAGES: until the balloon holds PAGES pages, or the
# case's time is up (as wait_line).
wait_actual() {
  while :; do
    j=$(ember ctl --api-socket "$1" balloon-stats 2>&1)
    a=$(echo "$j" | $b sed -n 's/.*"actual_pages":\([0-9]*\).*/\1/p')
    [ "$a" = "$2" ] && return 0
    [ "$(secs)" -ge "$CASE_END" ] && echo "@timeout actual=$a want=$2 (balloon-stats: $j)" && return 1
    $b sleep 0.5
  done
}
balloon_socket() {
  s=/tmp/balloon.sock
  con=/tmp/balloon.console
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel "$vmlinux" --initrd /rig/l2.cpio --mem 384M --mem-boot 256M --cpus 1 --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE memhp_default_state=online_movable RIGCASE=balloon RIGTOKEN=$RIG_TOKEN" $RIG_L2_ARGS \
    --balloon --balloon-no-reporting --api-socket "$s" </dev/null >"$con" 2>/tmp/balloon.err &
  pid=$!
  balloon_steps
  steps=$?
  ember ctl --api-socket "$s" shutdown >/dev/null 2>&1 || kill "$pid"
  wait "$pid"
  rc=$?
  $b cat "$con"
  $b sed 's/^/@stderr /' /tmp/balloon.err
  [ $steps = 0 ] || return $steps
  return $rc
}
# balloon_socket's steps, to the first that fails (a wait that runs out of
# the case's time), so that the guest's console is still printed.
balloon_steps() {
  wait_line "$con" '^@filled' || return 1
  $b sleep 2
  echo "@rss-filled $(rss_kib $pid)"
  echo "@ctl-inflate $(ember ctl --api-socket "$s" balloon --target-mib $BALLOON_MIB)"
  wait_actual "$s" $((BALLOON_MIB * 256)) || return 1
  $b sleep 1
  echo "@rss-inflated $(rss_kib $pid)"
  # The driver posts its statistics when it starts; a request returns the
  # buffer and the driver answers with fresh numbers.
  ember ctl --api-socket "$s" balloon-stats >/dev/null
  $b sleep 3
  echo "@stats $(ember ctl --api-socket "$s" balloon-stats)"
  echo "@ctl-deflate $(ember ctl --api-socket "$s" balloon --target-mib 0)"
  wait_actual "$s" 0 || return 1
  echo "@rss-deflated $(rss_kib $pid)"
  wait_line "$con" '^@touched' || return 1
  $b sleep 1
  echo "@rss-touched $(rss_kib $pid)"
  # Three times 64 MiB inflated and deflated; the guest writes and verifies
  # what came back after each (its @deflate-touch lines).
  for c in 1 2 3; do
    ember ctl --api-socket "$s" balloon --target-mib 64 >/dev/null
    wait_actual "$s" 16384 || return 1
    ember ctl --api-socket "$s" balloon --target-mib 0 >/dev/null
    wait_actual "$s" 0 || return 1
    wait_line "$con" "^@deflate-touch $c " || return 1
  done
  # The virtio-mem region (one 128 MiB block) unplugged and plugged again
  # through the socket; the guest prints each MemTotal it sees.
  echo "@ctl-mem-shrink $(ember ctl --api-socket "$s" mem --size 256M)"
  wait_plugged "$s" 0 || return 1
  wait_line "$con" '^@memtotal [12][0-9][0-9][0-9][0-9][0-9]' || return 1
  echo "@rss-unplugged $(rss_kib $pid)"
  echo "@ctl-mem-grow $(ember ctl --api-socket "$s" mem --size 384M)"
  wait_plugged "$s" 134217728 || return 1
  until [ "$($b grep -c '^@memtotal 3' "$con")" -ge 2 ]; do
    [ "$(secs)" -ge "$CASE_END" ] && echo "@timeout no second full MemTotal" && return 1
    $b sleep 0.2
  done
}
# The prefault-async case's boot: --prefault async with the balloon's fence
# and a virtio-mem region, with a control socket.
prefault_socket() {
  s=/tmp/prefault.sock
  con=/tmp/prefault.console
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel "$vmlinux" --initrd /rig/l2.cpio --mem 384M --mem-boot 256M --cpus 1 --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE memhp_default_state=online_movable RIGCASE=prefault RIGTOKEN=$RIG_TOKEN" $RIG_L2_ARGS \
    --prefault async,window=64M,chunk=8M,rate=4M,driver-timeout=300 --events /tmp/prefault.json \
    --api-socket "$s" </dev/null >"$con" 2>/tmp/prefault.err &
  pid=$!
  prefault_steps
  steps=$?
  # The guest powers off once it has seen the region back (or fails a step).
  [ $steps = 0 ] || ember ctl --api-socket "$s" shutdown >/dev/null 2>&1 || kill "$pid"
  wait "$pid"
  rc=$?
  $b cat "$con"
  $b sed 's/^/@stderr /' /tmp/prefault.err
  [ $steps = 0 ] || return $steps
  return $rc
}
# prefault_socket's steps: the region plugged (all of it committed first),
# unplugged through the socket (ember's RSS falls), plugged again: each
# block is committed again before its plug is acknowledged, so ember's RSS
# is back up before the guest touches any of it.
prefault_steps() {
  wait_line "$con" '^@mem-plugged' || return 1
  echo "@ctl-mem-shrink $(ember ctl --api-socket "$s" mem --size 256M)"
  wait_plugged "$s" 0 || return 1
  # (No `$`: the serial console's lines end in CR LF.)
  wait_line "$con" '^@memtotal [12][0-9][0-9][0-9][0-9][0-9][^0-9]' || return 1
  echo "@rss-unplugged $(rss_kib $pid)"
  echo "@ctl-mem-grow $(ember ctl --api-socket "$s" mem --size 384M)"
  wait_plugged "$s" 134217728 || return 1
  echo "@rss-replugged $(rss_kib $pid)"
}
# wait_plugged SOCKET BYTES: until the virtio-mem region has BYTES plugged,
# or the case's time is up (as wait_line).
wait_plugged() {
  while :; do
    j=$(ember ctl --api-socket "$1" mem 2>&1)
    a=$(echo "$j" | $b sed -n 's/.*"plugged_bytes":\([0-9]*\).*/\1/p')
    [ "$a" = "$2" ] && return 0
    [ "$(secs)" -ge "$CASE_END" ] && echo "@timeout plugged=$a want=$2 (mem: $j)" && return 1
    $b sleep 0.5
  done
}
# The boot doctor (its cases below).
doctor() {
  ember analyze --backend ember --kernel "$vmlinux" --busybox-init --cpus 1 -n 1 -w 0 \
    --timeout "$((LIMIT - 10))" --advise --profile-boots 0 --json --cmdline "console=ttyS0 panic=-1 reboot=k pci=off $1" \
    --save "/tmp/$2.json"
}

# Snapshot and restore (its cases below).
snap=/tmp/snap
snap_boot() {
  $b rm -rf $snap "$snap.out" && $b mkdir -p $snap
  # shellcheck disable=SC2086 # RIG_L2_ARGS is a list of arguments
  ember boot --kernel /rig/vmlinuz-generic --initrd /rig/l2.cpio --mem 256M --cpus 2 --timeout "$((LIMIT - 10))" \
    --cmdline "$CMDLINE RIGCASE=snapshot" --api-socket $snap.sock $RIG_L2_ARGS </dev/null >$snap.out 2>&1 &
  pid=$!
  until $b grep -q '^@snapshot-ready' $snap.out 2>/dev/null; do
    if [ "$(secs)" -ge "$CASE_END" ] || ! $b kill -0 $pid 2>/dev/null; then
      $b cat $snap.out
      echo "no @snapshot-ready (the case's time is up, or ember ended)"
      $b kill $pid 2>/dev/null
      return 1
    fi
    $b usleep 100000
  done
  ember snapshot --api-socket $snap.sock --to $snap/dir
  src=$?
  wait $pid
  brc=$?
  $b cat $snap.out
  echo "snapshot-rc=$src boot-rc=$brc"
  [ $src = 0 ] && [ $brc = 0 ]
}
snap_restore() {
  t0=$(ms)
  echo "echo answer-\$(($1 * 7)); \$b uname -r" | ember boot --restore $snap/dir --timeout "$((LIMIT - 10))"
  rc=$?
  echo "restore-ms=$(($(ms) - t0))"
  return $rc
}
# Containers on the ember backend (issue 27): containerd started here (its
# root and state on a tmpfs of its own), the image the harness built with
# umoci, and `ctr run --rm --runtime io.containerd.ember.v2` twice with the
# shim on the ember backend: the first pod VM boots Debian's cloud kernel on
# this L1's root and saves the appliance's snapshot, the second is restored
# from it. The container prints the image's file, its kernel's release and
# command line (EMBER_SHIM_CMDLINE's word marks the L2's kernel: the L1 runs
# the same release) and exits 7. Then nothing may be left: no shim, no
# ember, no mount of the containers', and containerd stopped here.
ctr_case() {
  d=/tmp/ctd
  $b grep -qw overlay /proc/filesystems || for m in $($b cat /rig/ko/order); do $b insmod /rig/ko/$m 2>/dev/null; done
  $b grep -q cgroup2 /proc/mounts || $b mount -t cgroup2 none /sys/fs/cgroup
  $b mkdir -p $d && $b mount -t tmpfs tmpfs $d || return 1
  printf '%s\n' 'version = 2' "root = \"$d/root\"" "state = \"$d/state\"" \
    'disabled_plugins = ["io.containerd.grpc.v1.cri"]' '[grpc]' "  address = \"$d/sock\"" \
    '[ttrpc]' "  address = \"$d/sock.ttrpc\"" >$d/config.toml
  echo "@ctr-l1-cmdline $($b cat /proc/cmdline)"
  snaps=/root/.cache/ember/snapshots
  before=$($b ls $snaps 2>/dev/null | $b tr '\n' ' ')
  PATH=/rig/ctr:$PATH EMBER_SHIM_BACKEND=ember EMBER_SHIM_CMDLINE="rigctr=$RIG_TOKEN" \
    EMBER_BIN=/usr/local/bin/ember containerd --config $d/config.toml >$d/log 2>&1 &
  cpid=$!
  ctr_steps
  steps=$?
  $b kill $cpid 2>/dev/null
  wait $cpid
  # The shim's lines (the pod VM's start, the agent's answer and kernel).
  $b grep -e 'pod VM' -e 'agent answered' $d/log | $b sed 's/^/@ctr-shim /'
  [ $steps = 0 ] || $b tail -n 40 $d/log | $b sed 's/^/@ctr-log /'
  $b umount $d/root/io.containerd.snapshotter.v1.overlayfs/snapshots/*/fs 2>/dev/null
  $b umount $d && $b rmdir $d
  echo "@ctr-left-ps $(ctr_procs . | $b tr '\n' ';')"
  echo "@ctr-left-mounts $($b grep -c -e $d -e ember-containers /proc/mounts)"
  # The snapshot the case made (its memory is in this L1's RAM) goes with it.
  for s in $($b ls $snaps 2>/dev/null); do
    case " $before " in *" $s "*) ;; *) $b rm -rf "${snaps:?}/$s" ;; esac
  done
  return $steps
}
# ctr_procs PATTERN: the live processes of ctr_case (containerd, its shims,
# their ember) whose command line matches PATTERN, one `PID ARGS` a line.
# Zombies are gone (the L1's init reaps the shims' orphans late).
ctr_procs() {
  for p in /proc/[0-9]*; do
    $b grep -q '^State:.*Z' $p/status 2>/dev/null && continue
    a=$($b tr '\0' ' ' <$p/cmdline 2>/dev/null)
    case $a in *containerd* | */usr/local/bin/ember* | */rig/ctr/*) ;; *) continue ;; esac
    echo "${p#/proc/} $a" | $b grep -e "$1"
  done
}
# ctr_case's steps, to the first that fails (the log is still printed).
ctr_steps() {
  n=0
  until ctr --address $d/sock version >/dev/null 2>&1; do
    n=$((n + 1)) && [ $n -gt 300 ] && echo "@ctr-no-containerd" && return 1
    $b usleep 200000
  done
  ctr --address $d/sock images import --base-name localhost/rig /rig/ctr/image.tar >/dev/null || return 1
  echo "@ctr-snapshots-0 $($b ls $snaps 2>/dev/null | $b wc -l)"
  for run in 1 2; do
    t0=$(ms)
    ctr --address $d/sock run --rm --runtime io.containerd.ember.v2 localhost/rig:latest "rig-$run" \
      sh -c 'cat /etc/message; uname -r; cat /proc/cmdline; exit 7' >$d/out 2>&1
    rc=$?
    $b sed "s/^/@ctr-$run /" $d/out
    echo "@ctr-rc-$run $rc ms=$(($(ms) - t0))"
    echo "@ctr-snapshots-$run $($b ls $snaps 2>/dev/null | $b wc -l)"
    echo "@ctr-shims-$run $(ctr_procs containerd-shim-ember | $b grep -c .)"
    echo "@ctr-bundle-mounts-$run $($b grep -c -e "$d/state" -e ember-containers /proc/mounts)"
  done
}
# A case, run by run_case in a process group of its own. CASE_END: when a
# case's own waits give up (the uptime, s), 20 s before its limit, so that a
# case that waited in vain still prints what it has (a guest's console)
# before the watchdog kills it.
if [ "${1:-}" = --run ]; then
  shift
  CASE_END=$(($(secs) + LIMIT - 20))
  "$@"
  exit
fi

$b mkdir -p /rig/bin && $b --install -s /rig/bin
echo "@@ l1 out uptime_ms=$(ms) kvm=$($b ls /dev/kvm 2>&1) cpus=$($b nproc)"

# The 64-bit boot protocol on an ELF: the same vmlinux without its PVH note
# (its type byte zeroed, so ember finds no PVH entry).
$b cp "$vmlinux" /tmp/vmlinux64
printf '\000' | $b dd of=/tmp/vmlinux64 bs=1 seek="$RIG_NOTE_OFF" conv=notrunc 2>/dev/null

for cpus in 1 2; do
  run_case "boot-bzimage-$cpus" 120 l2 "$bz" "$cpus" boot
  run_case "boot-pvh-$cpus" 120 l2 "$vmlinux" "$cpus" boot
  run_case "boot-elf64-$cpus" 120 l2 /tmp/vmlinux64 "$cpus" boot
done

ro_sum=$($b md5sum /rig/ro.img | $b cut -d' ' -f1)
run_case virtio 180 l2 "$vmlinux" 2 virtio \
  --disk /rig/data.img,serial=rigdata --disk /rig/ro.img,ro,serial=rigro \
  --rng --pmem /rig/root.img --balloon
# What reached the disk images, seen from here (L1: the L2 guest's host).
run_case virtio-host 30 sh -c "echo token-copies=\$($b grep -c '$RIG_TOKEN' /rig/data.img); \
  echo ro-unchanged=\$([ \"\$($b md5sum /rig/ro.img | $b cut -d' ' -f1)\" = $ro_sum ] && echo yes || echo no)"

run_case balloon-socket 480 balloon_socket

# --prefault async with Debian's kernel: the background commit (paced, so it
# is still running when the driver comes up) ends, the unmodified driver
# inflates to the fence and deflates it all as memory is committed, and the
# guest then uses more than the boot window. The same boot has a virtio-mem
# region (one 128 MiB block): its commit starts as virtio_mem binds, the
# driver plugs it as it is committed, and the socket unplugs and plugs it
# again (prefault_steps).
run_case prefault-async 300 prefault_socket
run_case prefault-async-events 30 sh -c 'cat /tmp/prefault.json; echo'
run_case uart 120 uart
run_case vsock 240 vsock_case
run_case fs 300 fs_case
run_case net 300 net_case

# The appliance on the ember backend (ember-init and this cache, in L2).
run_case appliance 120 ember run --backend ember --initramfs --timeout "$(inner 120)" -- sh -c 'uname -r; echo err >&2; exit 7'
run_case console 120 sh -c "echo stdin-$RIG_TOKEN | ember run --backend ember --initramfs --timeout $(inner 120) -- cat"

# The appliance with --prefault async: ember-init loads virtio_balloon before
# the other device drivers (here virtio_rng), so the fence is up early; the
# command waits until the balloon is empty again (memory committed).
run_case appliance-prefault 300 ember run --backend ember --initramfs --timeout "$(inner 300)" --mem 512M --rng \
  --prefault async,window=128M,chunk=16M,rate=8M,driver-timeout=300 --events /tmp/app-prefault.json -- sh -c '
    vm() { awk -v k="$1" "\$1 == k { print \$2 }" /proc/vmstat; }
    n=0; same=0
    while [ $n -lt 300 ] && [ $same -lt 3 ]; do
      i=$(vm balloon_inflate); d=$(vm balloon_deflate)
      if [ "$i" -gt 0 ] && [ "$i" = "$d" ]; then same=$((same + 1)); else same=0; fi
      sleep 1; n=$((n + 1))
    done
    echo "vmstat inflate=$i deflate=$d"
    cut -d" " -f1 /proc/modules | tr "\n" " "; echo'
run_case appliance-prefault-events 30 sh -c 'cat /tmp/app-prefault.json; echo'

# Snapshot and restore (Debian's GENERIC kernel: the cloud one has no vmgenid
# driver): boot to /init with a control socket, snapshot there, then restore
# twice in fresh ember processes, each running a command fed on its console.
if [ -e /rig/vmlinuz-generic ]; then
  run_case snap-boot 360 snap_boot
  run_case snap-restore-1 180 snap_restore 6
  run_case snap-restore-2 180 snap_restore 7
fi

# ember analyze on the ember backend: one stock boot's timeline.
run_case analyze 180 ember analyze --backend ember --kernel "$vmlinux" --busybox-init --cpus 2 \
  -n 1 -w 0 --timeout "$(inner 180)" --cmdline "console=ttyS0 panic=-1 reboot=k pci=off" --save /tmp/analyze.json
run_case analyze-json 30 sh -c 'cat /tmp/analyze.json; echo'

# The boot doctor on the ember backend (no profile boot: that needs the kernel
# source): with the kernel log on the serial console it advises `quiet` and
# predicts the saving from this boot's own per-character cost; under `quiet`
# it does not.
run_case doctor-verbose 240 doctor "" doctor-verbose
run_case doctor-quiet 180 doctor quiet doctor-quiet
# The verbose boot's recording (every console line), for `ember analyze --load`.
run_case doctor-verbose-boot 30 sh -c 'cat /tmp/doctor-verbose.json; echo'
# Containers on the ember backend: the harness staged /rig/ctr when it could
# (else the case's test fails, saying why).
[ -e /rig/ctr/image.tar ] && run_case containers 300 ctr_case
echo "@@ l1 out done uptime_ms=$(ms)"
