#!/bin/sh
# The inside of bench/rig-net.sh: runs in the nested rig's L1 (busybox sh,
# /dev/kvm from kvm-amd), from the directory bench/rig-net.sh filled. Makes
# tap0 (10.0.2.1/24) with an iperf3 server behind it, then boots the guest
# (bench/rig-net-l2.sh) under each VMM, interleaved, and prints per boot:
#   RIG-NET <vmm> <round> <up|down> <bytes> <secs> <CPU ticks> <CPU ticks without guest time> <ticks/s>
#   RIG-RR <vmm> <round> <ping RTT avg ms>
#   RIG-VSOCK <vmm> <round> <g2h|h2g> <bytes> <secs>
#   RIG-NOTE <vmm> <round> RIG-STAT <dir> tx=<frames> rx=<frames> irq=<virtio interrupts>
#     (the guest's counters before and after each transfer)
# Configuration (environment): ROUNDS, VMMS, SECS, VSOCK_MIB.
b=/bin/busybox
$b mkdir -p /tmp/rig-bin && $b --install -s /tmp/rig-bin
# The carried iperf3 and socat before anything of busybox's.
export PATH=$PATH:/tmp/rig-bin
[ -e /proc/uptime ] || mount -t proc proc /proc
[ -d /sys/kernel ] || mount -t sysfs sys /sys
ROUNDS=${ROUNDS:-2}
SECS=${SECS:-4}
VSOCK_MIB=${VSOCK_MIB:-16}
HZ=$(getconf CLK_TCK 2> /dev/null || echo 100)
K=./vmlinux
I=./initrd.cpio
MAC=02:00:00:00:00:02
for m in $(cat ko/list); do insmod "ko/$m" 2> /dev/null; done
[ -e /dev/net/tun ] || { mkdir -p /dev/net; mknod /dev/net/tun c 10 200; }
[ -e /dev/vhost-net ] || mknod /dev/vhost-net c 10 238
./ip tuntap add tap0 mode tap || echo "RIG-NOTE no tap: $(ls /dev/net 2>&1)"
./ip addr add 10.0.2.1/24 dev tap0
./ip link set tap0 up
iperf3 -s -D -B 10.0.2.1 || echo "RIG-NOTE iperf3 server did not start"

# vmm_cmd VMM MODE: the command line that boots the guest under VMM.
vmm_cmd() {
  c="console=ttyS0 quiet panic=-1 reboot=k rig.mode=$2 rig.secs=$SECS rig.mib=$VSOCK_MIB"
  case $1 in
    ember | ember-base)
      v=; [ "$2" = vsock ] && v="--vsock cid=3,uds=/tmp/v.sock"
      echo "./$1 boot --kernel $K --initrd $I --mem 256M --cpus 1 --cmdline '$c' --net tap=tap0,mac=$MAC $v" ;;
    qemu | qemu-vhost)
      vh=off; [ "$1" = qemu-vhost ] && vh=on
      echo "qemu-system-x86_64 -L ./qemu-share -M microvm -enable-kvm -cpu host -m 256M -smp 1 -nodefaults -no-user-config -nographic -serial stdio -no-reboot -global virtio-mmio.force-legacy=false -netdev tap,id=n0,ifname=tap0,script=no,downscript=no,vnet_hdr=on,vhost=$vh -device virtio-net-device,netdev=n0,mac=$MAC -kernel $K -initrd $I -append '$c'" ;;
    firecracker)
      v=; [ "$2" = vsock ] && v=', "vsock": {"guest_cid": 3, "uds_path": "/tmp/v.sock"}'
      cat > /tmp/fc.json << EOJ
{"boot-source": {"kernel_image_path": "$K", "initrd_path": "$I", "boot_args": "$c rig.end=reboot"},
 "drives": [],
 "network-interfaces": [{"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "$MAC"}],
 "machine-config": {"vcpu_count": 1, "mem_size_mib": 256}$v}
EOJ
      echo "./firecracker --no-api --config-file /tmp/fc.json --level Error" ;;
    cloud-hypervisor)
      echo "./cloud-hypervisor --kernel $K --initramfs $I --cmdline '$c' --cpus boot=1 --memory size=256M --serial tty --console off --net tap=tap0,mac=$MAC" ;;
  esac
}

# cpu PID: utime+stime and that without guest_time, in ticks.
cpu() { awk '{ print $14 + $15, $14 + $15 - $43 }' "/proc/$1/stat" 2> /dev/null || echo "0 0"; }

# run VMM MODE ROUND: one boot, its console read line by line.
run() {
  cmd=$(vmm_cmd "$1" "$2")
  rm -f /tmp/v.sock /tmp/v.sock_5000 /tmp/console
  mkfifo /tmp/console
  if [ "$2" = vsock ]; then
    # The guest's connection to port 5000 arrives at PATH_5000.
    socat -u UNIX-LISTEN:/tmp/v.sock_5000 - | wc -c > /tmp/g2h &
  fi
  sh -c "exec $cmd" < /dev/null > /tmp/console 2>&1 &
  pid=$!
  while IFS= read -r l; do
    l=$(printf '%s' "$l" | tr -d '\r')
    echo "$l" >> "/tmp/log-$1-$2-$3"
    case $l in
      "RIG-MARK "*" start") set -- "$1" "$2" "$3"; c0=$(cpu $pid) ;;
      "RIG-MARK "*" end") c1=$(cpu $pid); d=${l#RIG-MARK }; d=${d% end}
        eval "cpu_$d='$(echo "$c0 $c1" | awk '{ print $3 - $1, $4 - $2 }')'" ;;
      "RIG-IPERF "*) set -- "$1" "$2" "$3" ${l#RIG-IPERF }
        eval "c=\$cpu_$4"
        echo "RIG-NET $1 $3 $4 $5 $6 $c $HZ"; set -- "$1" "$2" "$3" ;;
      "RIG-PING "*) echo "RIG-RR $1 $3 $(echo "$l" | awk -F/ '/round-trip/ { print $4 }')" ;;
      "RIG-FEATURES "*) [ "$3" = 1 ] && echo "RIG-NOTE $1 ${l#RIG-}" ;;
      "RIG-G2H "*) echo "$l" | awk -v v="$1" -v r="$3" '{ print "RIG-VSOCK", v, r, "g2h", $2, $4 - $3 }' ;;
      RIG-LISTENING)
        read -r h0 _ < /proc/uptime
        { printf 'CONNECT 1234\n'; dd if=/dev/zero bs=64k count=$((VSOCK_MIB * 16)) 2> /dev/null; } |
          socat -u - UNIX-CONNECT:/tmp/v.sock & ;;
      "RIG-H2G-DONE "*)
        read -r h1 _ < /proc/uptime
        echo "RIG-VSOCK $1 $3 h2g ${l#RIG-H2G-DONE } $(awk -v a="$h0" -v b="$h1" 'BEGIN { print b - a }')" ;;
      "RIG-IPERF-LOG "* | "RIG-STAT "*) echo "RIG-NOTE $1 $3 $l" ;;
    esac
  done < /tmp/console
  wait $pid 2> /dev/null
  st=$?
  [ "$2" = vsock ] && echo "RIG-NOTE $1 $3 vsock g2h bytes at PATH_5000: $(cat /tmp/g2h 2> /dev/null)"
  grep -q '^RIG-IPERF \|^RIG-H2G-DONE' "/tmp/log-$1-$2-$3" ||
    { echo "RIG-FAILED $1 $2 $3 (status $st):"; tail -15 "/tmp/log-$1-$2-$3"; }
  # Whatever of this boot is still running (a vsock socat) ends with it.
  kill $(jobs -p) 2> /dev/null
  wait 2> /dev/null
}

echo "RIG-START $(uname -r)"
for r in $(seq "$ROUNDS"); do
  for v in $VMMS; do run "$v" net "$r"; done
done
if [ "$VSOCK_MIB" -gt 0 ]; then
  for r in $(seq "$ROUNDS"); do
    for v in $VMMS; do
      case $v in ember | firecracker) run "$v" vsock "$r" ;; esac
    done
  done
fi
sleep 1
