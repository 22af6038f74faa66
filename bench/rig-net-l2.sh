#!/bin/sh
# /init of the guest bench/rig-net.sh boots under each VMM (Debian's cloud
# kernel, its own virtio_net and vsock modules). rig.mode=net: iperf3 to the
# L1 (10.0.2.1) and back, then ping; rig.mode=vsock: MiB of zeroes to the
# host's PATH_5000, then a listener on port 1234 for the host's CONNECT.
# Lines starting RIG- are for bench/rig-net-inner.sh, which reads the console.
b=/bin/busybox
$b mkdir -p /proc /sys /dev
$b mount -t proc proc /proc
$b mount -t sysfs sys /sys
$b mount -t devtmpfs dev /dev
$b mkdir -p /tmp
for m in $($b cat /ko/list); do $b insmod "/ko/$m" 2> /dev/null; done
read -r cmdline < /proc/cmdline
arg() { for w in $cmdline; do case $w in "$1"=*) echo "${w#*=}" ;; esac; done; }
mode=$(arg rig.mode)
secs=$(arg rig.secs)
mib=$(arg rig.mib)
up() { read -r t _ < /proc/uptime; echo "$t"; }
if [ "$mode" = net ]; then
  $b ip link set lo up
  $b ip addr add 10.0.2.2/24 dev eth0
  $b ip link set eth0 up
  n=0
  until $b ping -c 1 -W 1 10.0.2.1 > /dev/null 2>&1 || [ $n -ge 30 ]; do n=$((n + 1)); done
  for d in /sys/bus/virtio/devices/*; do
    [ "$($b cat $d/device)" = 0x0001 ] && echo "RIG-FEATURES $($b cat $d/features)"
  done
  S=/sys/class/net/eth0/statistics
  # Frames each way and the virtio interrupts so far: how many frames a
  # transfer took (offloads) and how many interrupts it cost.
  stat() { echo "RIG-STAT $1 tx=$($b cat $S/tx_packets) rx=$($b cat $S/rx_packets) irq=$($b awk '/virtio/ { printf "%s:%s ", $NF, $2 }' /proc/interrupts)"; }
  for dir in up down; do
    r=; [ $dir = down ] && r=-R
    stat "$dir-before"
    echo "RIG-MARK $dir start"
    /usr/bin/iperf3 -c 10.0.2.1 -t "$secs" $r -f k > /tmp/iperf 2>&1
    echo "RIG-MARK $dir end"
    stat "$dir"
    # The receiver's line: its seconds and bytes.
    $b awk -v d=$dir '/receiver/ { for (i = 1; i <= NF; i++) if ($i == "sec") { split($(i - 1), t, "-"); s = t[2] - t[1]; v = $(i + 1); u = $(i + 2) }
      m = (u ~ /^K/) ? 1024 : (u ~ /^M/) ? 1048576 : (u ~ /^G/) ? 1073741824 : 1
      printf "RIG-IPERF %s %d %s\n", d, v * m, s }' /tmp/iperf
    $b grep -q receiver /tmp/iperf || $b sed "s/^/RIG-IPERF-LOG $dir /" /tmp/iperf
  done
  echo "RIG-PING $($b ping -c 30 10.0.2.1 | $b tail -1)"
fi
if [ "$mode" = vsock ]; then
  t0=$(up)
  $b dd if=/dev/zero bs=64k count=$((mib * 16)) 2> /dev/null | /usr/bin/socat -u - VSOCK-CONNECT:2:5000
  t1=$(up)
  echo "RIG-G2H $((mib * 1048576)) $t0 $t1"
  /usr/bin/socat -u VSOCK-LISTEN:1234 - | $b wc -c > /tmp/n &
  $b sleep 1
  echo "RIG-LISTENING"
  wait
  echo "RIG-H2G-DONE $($b cat /tmp/n)"
fi
case " $cmdline " in *" rig.end=reboot "*) $b reboot -f ;; esac
$b poweroff -f
