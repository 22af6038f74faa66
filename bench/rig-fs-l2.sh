#!/bin/sh
# /init of the guest bench/rig-fs.sh boots under each VMM (Debian's cloud
# kernel, its own fuse and virtiofs modules): mounts the share (tag `bench`)
# and runs the workload once to warm up (the guest's first touches of its
# memory, the L1's first faults on it; not counted), then rig.iter times,
# each phase timed by /proc/uptime.
# Lines starting RIG-FS- are for bench/rig-fs-inner.sh, which reads the console.
b=/bin/busybox
$b mount -t proc proc /proc
$b mount -t sysfs sys /sys
$b mount -t devtmpfs dev /dev
for m in $($b cat /ko/list); do $b insmod "/ko/$m" 2> /dev/null; done
read -r cmdline < /proc/cmdline
arg() { for w in $cmdline; do case $w in "$1"=*) echo "${w#*=}" ;; esac; done; }
iter=$(arg rig.iter)
mb=$(arg rig.mb)
n=$(arg rig.n)
up() { read -r t _ < /proc/uptime; echo "$t"; }
drop() { $b sync; echo 3 > /proc/sys/vm/drop_caches; }
$b mkdir -p /mnt
if $b mount -t virtiofs bench /mnt; then
  names=$(i=0; while [ $i -lt "$n" ]; do echo f$i; i=$((i + 1)); done)
  for i in $($b seq 0 "$iter"); do
    $b rm -rf /mnt/m /mnt/big
    $b mkdir /mnt/m
    drop
    t0=$(up); $b dd if=/dev/zero of=/mnt/big bs=1M count="$mb" conv=fsync 2> /dev/null; t1=$(up)
    drop
    t2=$(up); $b dd if=/mnt/big of=/dev/null bs=1M 2> /dev/null; t3=$(up)
    cd /mnt/m
    t4=$(up); $b touch $names; t5=$(up)
    drop
    t6=$(up); $b stat -c %s $names > /dev/null; t7=$(up)
    t8=$(up); $b rm $names; t9=$(up)
    cd /
    left=$($b ls /mnt/m | $b wc -l)
    [ "$left" = 0 ] || echo "RIG-FS-FAILED $left files left after rm"
    tag=RIG-FS-ITER; [ "$i" = 0 ] && tag=RIG-FS-WARMUP
    echo "$tag $i $($b awk -v a="$t0 $t1 $t2 $t3 $t4 $t5 $t6 $t7 $t8 $t9" 'BEGIN {
      split(a, t, " "); printf "%.2f %.2f %.2f %.2f %.2f", t[2] - t[1], t[4] - t[3], t[6] - t[5], t[8] - t[7], t[10] - t[9] }')"
  done
  $b rm -rf /mnt/m /mnt/big
  $b umount /mnt
  echo RIG-FS-DONE
else
  echo "RIG-FS-FAILED mount: $($b dmesg | $b tail -3)"
fi
$b poweroff -f
