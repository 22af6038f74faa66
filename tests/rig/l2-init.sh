#!/bin/busybox sh
# /init of the L2 guests of the nested rig (tests/nested_rig/): Debian's
# unmodified cloud kernel, booted by ember inside the L1 guest. It prints
# facts as `@KEY VALUE` lines on the console; the test harness judges them.
# RIGCASE (from the kernel command line) says what to exercise; RIGTOKEN is
# a per-run value written to the data disk and looked for afterwards.
b=/bin/busybox
$b mount -t proc proc /proc
$b mount -t sysfs sys /sys
$b mount -t devtmpfs dev /dev
echo "@init reached"
echo "@cpus $($b cat /sys/devices/system/cpu/online)"
# Which entry path the kernel came through, from its own copy of the zero
# page: type_of_loader (0x210) is 0xb0 after a PVH entry (Linux sets it in
# init_pvh_bootparams; ember writes 0xff into a zero page); setup_sects
# (0x1f1) is non-zero only when the setup header came from a bzImage.
byte() {
  $b dd if=/sys/kernel/boot_params/data bs=1 skip="$1" count=1 2>/dev/null | $b od -An -tu1 | $b tr -d ' '
}
echo "@loader $(byte 528)"
echo "@setup_sects $(byte 497)"

# insmod the modules of group $1, in dependency order (the harness resolved it).
load() {
  for m in $($b cat "/lib/ko/$1.list"); do
    $b insmod "$m" || echo "@insmod-failed $m"
  done
}
# The block device (vdX) whose virtio serial is $1.
by_serial() {
  for x in /sys/block/vd*; do
    [ "$($b cat "$x/serial" 2>/dev/null)" = "$1" ] && $b basename "$x"
  done
}

if [ "$RIGCASE" = virtio ]; then
  load core
  for d in /sys/bus/virtio/devices/*; do
    [ -e "$d/device" ] && echo "@virtio-device $($b cat "$d/device")"
  done

  load blk
  data=$(by_serial rigdata)
  ro=$(by_serial rigro)
  echo "@blk-devices data=$data ro=$ro"
  $b mkdir -p /mnt/data /mnt/ro /mnt/root
  if [ -n "$data" ] && $b mount -t ext4 "/dev/$data" /mnt/data; then
    # Written and fsync'd (busybox-static has no fsync applet: dd's conv=fsync).
    echo "$RIGTOKEN" | $b dd of=/mnt/data/token conv=fsync 2>/dev/null && $b sync &&
      echo "@blk-readback $($b cat /mnt/data/token)" &&
      $b umount /mnt/data && echo "@blk-write ok"
  fi
  if [ -n "$ro" ]; then
    echo "@blk-ro-flag $($b cat "/sys/block/$ro/ro")"
    if $b dd if=/dev/zero of="/dev/$ro" bs=4096 count=1 conv=fsync 2>/dev/null; then
      echo "@blk-ro-write accepted"
    else
      echo "@blk-ro-write refused"
    fi
    $b mount -t ext4 -o ro "/dev/$ro" /mnt/ro && echo "@blk-ro-marker $($b cat /mnt/ro/marker)"
    $b umount /mnt/ro 2>/dev/null
  fi

  load rng
  echo "@rng-current $($b cat /sys/class/misc/hw_random/rng_current 2>/dev/null)"
  echo "@rng-bytes $($b dd if=/dev/hwrng bs=64 count=1 2>/dev/null | $b wc -c)"
  for i in 1 2; do
    echo "@rng-sample $($b dd if=/dev/hwrng bs=16 count=1 2>/dev/null | $b od -An -tx1 | $b tr -d ' \n')"
  done

  load pmem
  echo "@pmem-queue-dax $($b cat /sys/block/pmem0/queue/dax 2>/dev/null)"
  if $b mount -t ext4 -o dax /dev/pmem0 /mnt/root; then
    echo "@pmem-mount $($b grep ' /mnt/root ' /proc/mounts)"
    # The pmem file system serves as a root: its own busybox runs in it.
    echo "@pmem-root $($b chroot /mnt/root /bin/busybox cat /marker)"
    $b umount /mnt/root
  fi

  load balloon
  for d in /sys/bus/virtio/drivers/virtio_balloon/virtio*; do
    [ -e "$d" ] && echo "@balloon-bound $($b basename "$d") features=$($b cat "$d/features")"
  done
fi
# The balloon's page counters (/proc/vmstat counts pages inflated and deflated).
vm() { $b awk -v k="$1" '$1 == k { print $2 }' /proc/vmstat; }
# Uses 150 MiB of memory (more than the prefault window, and more than the
# guest has while the socket case's balloon is inflated).
touch_memory() {
  $b mkdir -p /mnt/t
  $b grep -q ' /mnt/t ' /proc/mounts || $b mount -t tmpfs -o size=200m tmpfs /mnt/t
  $b dd if=/dev/zero of=/mnt/t/fill bs=1M count=150 2>/dev/null &&
    echo "@touched $($b du -k /mnt/t/fill | $b cut -f1)"
}
# MemTotal in KiB.
mt() { $b awk '/^MemTotal:/ { print $2 }' /proc/meminfo; }
if [ "$RIGCASE" = balloon ]; then
  load core
  # The virtio-mem region beside the balloon (the suite's --mem-boot): the
  # driver plugs it all and the kernel onlines it (memhp_default_state).
  load mem
  n=0
  until [ "$(mt)" -ge 340000 ] || [ $n -gt 300 ]; do n=$((n + 1)); $b sleep 0.2; done
  echo "@mem-plugged $(mt)"
  load balloon
  # Resident free memory for the balloon to take (ember offers no free page
  # reporting here, so freed memory stays resident until the balloon takes it).
  touch_memory >/dev/null
  $b rm /mnt/t/fill
  echo "@filled free_kib=$($b awk '/^MemFree:/ { print $2 }' /proc/meminfo)"
  # The host inflates the balloon to 160 MiB (40960 pages), then deflates it.
  n=0
  until [ "$(vm balloon_inflate)" -ge 40960 ] && [ "$(vm balloon_deflate)" -ge "$(vm balloon_inflate)" ]; do
    n=$((n + 1))
    [ $n -gt 3000 ] && break
    $b sleep 0.2
  done
  # A page the driver migrates (compaction) reaches the device as one more
  # inflate and one more deflate, counted by the guest as balloon_migrate.
  echo "@balloon-vmstat inflate=$(vm balloon_inflate) deflate=$(vm balloon_deflate) migrate=$(vm balloon_migrate)"
  # (Read before the host can start the cycles below: it waits for @touched.)
  i0=$(vm balloon_inflate)
  touch_memory
  # Memory that comes back must be the guest's own and intact (issue 26):
  # the host inflates 64 MiB and deflates, three times; after each deflate
  # /bin/memtouch maps 64 MiB (from the free lists the deflate refilled),
  # writes every word, reads every word back and says TOUCH-OK or TOUCH-BAD.
  for c in 1 2 3; do
    n=0
    until [ $(($(vm balloon_inflate) - i0)) -ge 16384 ] && [ "$(vm balloon_deflate)" -ge "$(vm balloon_inflate)" ]; do
      n=$((n + 1))
      [ $n -gt 3000 ] && break
      $b sleep 0.2
    done
    i0=$(vm balloon_inflate)
    echo "@deflate-touch $c $(/bin/memtouch) inflated=$(vm balloon_inflate) deflated=$(vm balloon_deflate)"
  done
  # The host measures, resizes the virtio-mem region (down, then up), then
  # shuts the VM down through its socket; each MemTotal it sees meanwhile.
  last=
  n=0
  while [ $n -lt 3000 ]; do
    m=$(mt)
    [ "$m" != "$last" ] && echo "@memtotal $m" && last=$m
    n=$((n + 1))
    $b sleep 0.2
  done
fi
if [ "$RIGCASE" = prefault ]; then
  load core
  load balloon
  echo "@balloon-loaded inflate=$(vm balloon_inflate)"
  # The virtio-mem region (the suite's --mem-boot): ember commits it from
  # now on and raises the requested size as it goes.
  load mem
  # The commit ends when the balloon has given back all it took: wait until
  # the counts agree and stay so.
  n=0
  same=0
  while [ $n -lt 600 ] && [ $same -lt 6 ]; do
    i=$(vm balloon_inflate)
    if [ "$i" -gt 0 ] && [ "$i" = "$(vm balloon_deflate)" ]; then same=$((same + 1)); else same=0; fi
    $b sleep 0.5
    n=$((n + 1))
  done
  # A page the driver migrates (compaction) reaches the device as one more
  # inflate and one more deflate, counted by the guest as balloon_migrate.
  echo "@balloon-vmstat inflate=$(vm balloon_inflate) deflate=$(vm balloon_deflate) migrate=$(vm balloon_migrate)"
  touch_memory
  n=0
  until [ "$(mt)" -ge 340000 ] || [ $n -gt 1500 ]; do n=$((n + 1)); $b sleep 0.2; done
  echo "@mem-plugged $(mt)"
  # The host unplugs the region and plugs it again: each MemTotal seen,
  # until it is full again after being short (at most 5 minutes).
  full=$(mt)
  last=
  shrunk=
  n=0
  while [ $n -lt 1500 ]; do
    m=$(mt)
    [ "$m" != "$last" ] && echo "@memtotal $m" && last=$m
    [ "$m" -lt 262144 ] && shrunk=1
    [ -n "$shrunk" ] && [ "$m" -ge "$full" ] && break
    n=$((n + 1))
    $b sleep 0.2
  done
  # (The host reads ember's RSS once the plug is acknowledged.)
  $b sleep 3
fi
if [ "$RIGCASE" = snapshot ]; then
  # Bound at boot: the DSDT's VGEN device, matched by its _HID.
  echo "@vmgenid-bound $($b ls /sys/bus/acpi/drivers/vmgenid 2>/dev/null | $b grep -c '^VMGENCTR')"
  echo "@snapshot-ready"
  # The host snapshots here; each restore feeds one command line.
  read -r cmd
  # The new generation ID arrives as an interrupt whose handling (GED
  # thread, ACPI notify queue, vmgenid) runs asynchronously: wait for the
  # reseed before drawing randomness (at most 60 s).
  i=0
  while [ $i -lt 600 ] && ! $b dmesg | $b grep -q 'virtual machine fork'; do
    $b usleep 100000
    i=$((i + 1))
  done
  echo "@vmfork $($b dmesg | $b grep -c 'crng reseeded due to virtual machine fork') waited=$((i * 100))ms"
  echo "@urandom $($b dd if=/dev/urandom bs=16 count=1 2>/dev/null | $b od -An -tx1 | $b tr -d ' \n')"
  echo "@uuid $($b cat /proc/sys/kernel/random/uuid)"
  eval "$cmd"
fi
if [ "$RIGCASE" = vsock ]; then
  # vsock both ways with Debian's own vmw_vsock_virtio_transport and socat
  # (appended to this initramfs by the suite): 1 MiB to host port 5000
  # (ember connects it to PATH_5000, where the L1's socat listens), then a
  # listener on port 1234 for the L1's `CONNECT 1234`. The harness compares
  # the checksums each side prints.
  load core
  load vsock
  s=/usr/bin/socat
  $b mkdir -p /tmp
  $b dd if=/dev/urandom of=/tmp/g2h bs=64k count=16 2>/dev/null
  echo "@vsock-g2h-md5 $($b md5sum /tmp/g2h | $b cut -d' ' -f1)"
  $s -u FILE:/tmp/g2h VSOCK-CONNECT:2:5000 && echo "@vsock-g2h sent"
  $s -u VSOCK-LISTEN:1234 CREATE:/tmp/h2g &
  sp=$!
  $b sleep 1
  echo "@vsock-listening"
  wait $sp
  echo "@vsock-h2g-md5 $($b md5sum /tmp/h2g | $b cut -d' ' -f1)"
fi
if [ "$RIGCASE" = fs ]; then
  # Debian's own virtiofs driver on ember's virtio-fs device: read the host's
  # file, write one back, a read-only share refusing a write; then wait for
  # the host's snapshot, and after the restore run the command it sends
  # (which reads the share again). The harness compares the checksums.
  load core
  load fs
  $b mkdir -p /mnt /ro
  $b mount -t virtiofs share /mnt || echo "@fs-mount-failed share"
  $b mount -t virtiofs ro /ro || echo "@fs-mount-failed ro"
  echo "@fs-h2g-md5 $($b md5sum /mnt/h2g | $b cut -d' ' -f1)"
  $b dd if=/dev/urandom of=/mnt/g2h bs=64k count=16 2>/dev/null
  echo "@fs-g2h-md5 $($b md5sum /mnt/g2h | $b cut -d' ' -f1)"
  echo "@fs-before $($b cat /mnt/before)"
  $b touch /ro/x 2>/dev/null && echo "@fs-ro-written" || echo "@fs-ro-refused"
  echo "@fs-ro-read $($b cat /ro/text)"
  exec 3</mnt/before
  echo "@fs-snapshot-ready"
  read -r cmd
  eval "$cmd"
fi
if [ "$RIGCASE" = net ]; then
  # Debian's own virtio_net on ember's virtio-net, on a tap in the L1 (the
  # L1 has no other network: nothing leaves it): eth0 up with IPv4 and a ULA,
  # a ping each, TCP both ways over both (socat, appended to this initramfs
  # by the suite, as is ethtool), then a snapshot; the restore comes onto
  # another tap and MAC, and the console brings `net_restored NEWMAC` (then
  # a line to end on). Each side prints the checksums of what it sent and
  # got; the harness compares them.
  load core
  load net
  s=/usr/bin/socat
  $b mkdir -p /tmp
  md5() { $b md5sum "$1" | $b cut -d' ' -f1; }
  # net_send TAG ADDRESS: 128 KiB of random bytes to a socat ADDRESS.
  net_send() {
    $b dd if=/dev/urandom of="/tmp/$1" bs=64k count=2 2>/dev/null
    echo "@net-$1-md5 $(md5 "/tmp/$1")"
    $s -u FILE:"/tmp/$1" "$2" && echo "@net-$1 sent"
  }
  # net_recv TAG ADDRESS: what the L1 sends once @net-TAG-listening shows.
  net_recv() {
    $s -u "$2" CREATE:"/tmp/$1" &
    sp=$!
    $b sleep 1
    echo "@net-$1-listening"
    wait $sp
    echo "@net-$1-md5 $(md5 "/tmp/$1")"
  }
  for d in /sys/bus/virtio/devices/*; do
    [ "$($b cat "$d/device")" = 0x0001 ] && echo "@net-features $($b cat "$d/features")"
  done
  n=/proc/sys/net/ipv6/conf/eth0
  # The ULA usable at once (no duplicate detection), and kept over the
  # address change after the restore.
  echo 0 >$n/accept_dad
  echo 1 >$n/keep_addr_on_down
  $b ip link set lo up
  $b ip link set eth0 up
  $b ip addr add 10.0.2.2/24 dev eth0
  $b ip -6 addr add fd00:2::2/64 dev eth0
  $b ip addr show eth0 | $b sed 's/^/@net-addr /'
  echo "@net-mtu $($b cat /sys/class/net/eth0/mtu)"
  # The offloads the kernel turned on for eth0 (ethtool, appended as socat).
  for e in /usr/sbin/ethtool /sbin/ethtool; do
    [ -x $e ] && $e -k eth0 | $b sed 's/^[[:space:]]*/@net-ethtool /' && break
  done
  $b ping -c 1 -W 10 10.0.2.1 >/dev/null && echo "@net-ping ok"
  $b ping6 -c 1 -W 10 fd00:2::1 >/dev/null && echo "@net-ping6 ok"
  net_send up4 TCP4:10.0.2.1:5001
  net_send up6 TCP6:[fd00:2::1]:5003
  net_recv down4 TCP4-LISTEN:5002
  net_recv down6 TCP6-LISTEN:5004
  # The link's changes so far: the restore must add to them.
  cc=$($b cat /sys/class/net/eth0/carrier_changes)
  net_restored() {
    i=0
    while [ $i -lt 300 ] && { [ "$($b cat /sys/class/net/eth0/carrier_changes)" -le "$cc" ] ||
      [ "$($b cat /sys/class/net/eth0/carrier)" != 1 ]; }; do
      $b usleep 100000
      i=$((i + 1))
    done
    echo "@net-link carrier_changes=$cc->$($b cat /sys/class/net/eth0/carrier_changes) carrier=$($b cat /sys/class/net/eth0/carrier) waited=$((i * 100))ms"
    # What a guest agent would do on the link change: take the new MAC and
    # forget the old tap's.
    $b ip link set eth0 address "$1"
    $b ip neigh flush dev eth0 >/dev/null 2>&1
    $b ip addr show eth0 | $b sed 's/^/@net-addr-restored /'
    $b ping -c 1 -W 10 10.0.2.1 >/dev/null && echo "@net-ping-restored ok"
    $b ping6 -c 1 -W 10 fd00:2::1 >/dev/null && echo "@net-ping6-restored ok"
    net_send up4r TCP4:10.0.2.1:5005
    net_recv down6r TCP6-LISTEN:5006
    # The L1 reads its neighbour table while the link is up, then says end.
    read -r _
  }
  echo "@net-snapshot-ready"
  read -r cmd
  eval "$cmd"
fi
if [ "$RIGCASE" = uart ]; then
  # The console is COM1 (console=ttyS0): read what the host sends through
  # ember's stdin, without the tty echoing it back.
  $b stty -echo 2>/dev/null
  echo "@uart-ready"
  IFS= read -r first
  echo "@uart-got $first"
  echo "@uart-md5 $($b head -n 20 | $b md5sum | $b cut -d' ' -f1)"
fi
echo "@done"
$b poweroff -f
