#!/bin/sh
# The inside of bench/rig-fs.sh: runs in the nested rig's L1 (busybox sh,
# /dev/kvm from kvm-amd), from the directory bench/rig-fs.sh filled. Mounts
# a tmpfs at /share, then boots the guest (bench/rig-fs-l2.sh) under ember
# (`--fs`) and QEMU microvm (vhost-user-fs, virtiofsd), alternating which
# goes first each round, and prints per workload iteration:
#   RIG-FS <vmm> <round> <iter> <write s> <read s> <create s> <stat s> <unlink s>
# Configuration (environment): ROUNDS, ITER, MB, N.
b=/bin/busybox
$b mkdir -p /tmp/rig-bin && $b --install -s /tmp/rig-bin
export PATH=$PATH:/tmp/rig-bin
[ -e /proc/uptime ] || mount -t proc proc /proc
[ -d /sys/kernel ] || mount -t sysfs sys /sys
mkdir -p /share
mount -t tmpfs -o size=1g tmpfs /share
K=./vmlinux
I=./initrd.cpio
C="console=ttyS0 quiet panic=-1 reboot=k rig.iter=$ITER rig.mb=$MB rig.n=$N"

# run VMM ROUND: one boot, its console read line by line.
run() {
  rm -f /tmp/console /tmp/vfs.sock
  mkfifo /tmp/console
  case $1 in
    ember)
      ./ember boot --kernel $K --initrd $I --mem 256M --cpus 1 --cmdline "$C" \
        --fs tag=bench,dir=/share < /dev/null > /tmp/console 2>&1 &
      pid=$! ;;
    qemu)
      virtiofsd --socket-path=/tmp/vfs.sock --shared-dir=/share --cache=auto \
        --sandbox=none > "/tmp/virtiofsd-$2" 2>&1 &
      n=0
      while [ ! -S /tmp/vfs.sock ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
      qemu-system-x86_64 -L ./qemu-share -M microvm,memory-backend=mem -enable-kvm -cpu host \
        -m 256M -smp 1 -object memory-backend-memfd,id=mem,size=256M,share=on \
        -nodefaults -no-user-config -nographic -serial stdio -no-reboot \
        -global virtio-mmio.force-legacy=false \
        -chardev socket,id=vfs,path=/tmp/vfs.sock -device vhost-user-fs-device,chardev=vfs,tag=bench \
        -kernel $K -initrd $I -append "$C" < /dev/null > /tmp/console 2>&1 &
      pid=$! ;;
  esac
  while IFS= read -r l; do
    l=$(printf '%s' "$l" | tr -d '\r')
    echo "$l" >> "/tmp/log-$1-$2"
    case $l in
      "RIG-FS-ITER "*) echo "RIG-FS $1 $2 ${l#RIG-FS-ITER }" ;;
      RIG-FS-FAILED*) echo "RIG-NOTE $1 $2 $l" ;;
    esac
  done < /tmp/console
  wait $pid 2> /dev/null
  st=$?
  grep -q '^RIG-FS-DONE' "/tmp/log-$1-$2" ||
    { echo "RIG-FAILED $1 $2 (status $st):"; tail -15 "/tmp/log-$1-$2"; cat "/tmp/virtiofsd-$2" 2> /dev/null; }
  # virtiofsd ends when QEMU disconnects; anything left ends with the boot.
  kill $(jobs -p) 2> /dev/null
  wait 2> /dev/null
}

echo "RIG-START $(uname -r)"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then run ember "$r"; run qemu "$r"; else run qemu "$r"; run ember "$r"; fi
done
sleep 1
