#!/bin/sh
# The inside of bench/rig.sh: runs in the nested rig's L1 guest (busybox sh,
# /dev/kvm from kvm-amd), from the directory bench/rig.sh filled. Boots the
# stock kernel + busybox initramfs under each VMM present, interleaved, and
# prints one line per boot:
#   RIG-BOOT <vmm> <vcpus> <round> <ms to /init's marker> <ms to exit> <exit status>
# then, with EXITS=1, one counted boot per VMM and vCPU count with KVM's exit
# tracepoints histogrammed (reason, port, MMIO address, MSR):
#   RIG-EXITS <vmm> <vcpus> <kind> <key> <count>
# Times come from /proc/uptime (10 ms resolution; boots here take seconds).
# Configuration (environment): ROUNDS, VCPUS ("1 2"), VMMS, CMDLINE, MEM, EXITS, DMESG, MARK.
# bench/rig-memory-inner.sh sources this file with RIG_FUNCS_ONLY=1 for its
# functions (vmm_cmd, boot) and runs its own loop; it sets PREFAULT (sync:
# every VMM's own way of committing guest memory before boot; async: ember's)
# and EVENTS (ember's --events file, whose times boot reports); VMEM, a
# virtio-mem region of that many MiB out of MEM (each VMM's own device; QEMU
# then boots q35, as QMACHINE=q35 does without a region); MARK2, a second
# console text whose arrival boot notes in MARK2_MS.
b=/bin/busybox
$b mkdir -p /tmp/rig-bin && $b --install -s /tmp/rig-bin
export PATH=/tmp/rig-bin:$PATH
# (Already mounted by the appliance's init, or not: either way.)
[ -e /proc/uptime ] || mount -t proc proc /proc
[ -d /sys/kernel ] || mount -t sysfs sys /sys
[ -e /sys/kernel/tracing/events ] || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
ROUNDS=${ROUNDS:-3}
VCPUS=${VCPUS:-"1 2"}
MEM=${MEM:-256}
CMDLINE=${CMDLINE:-"console=ttyS0 quiet panic=-1 reboot=k"}
# DMESG=1: the guest prints its kernel log after the marker (RIG-DMESG lines).
[ "${DMESG:-0}" = 1 ] && CMDLINE="$CMDLINE rig.dmesg"
# MARK: the console text whose arrival is timed; with RIG_MARK="Linux version"
# and earlyprintk=ttyS0 (no quiet) on the command line, the guest's first line:
# exec -> that line is the VMM's own set-up plus the same early kernel work.
MARK=${MARK:-RIG-INIT-OK}
K=./vmlinux
I=./initrd.cpio

# vmm_cmd VMM VCPUS: the command line that boots the guest under VMM.
vmm_cmd() {
  case $1 in
    # (`boot` is the VMM's subcommand; an older ember called it `run`.)
    ember*) sub=boot; ./$1 boot --help > /dev/null 2>&1 || sub=run
      echo "./$1 $sub --kernel $K --initrd $I --mem ${MEM}M${VMEM:+ --mem-boot $((MEM - VMEM))M} --cpus $2 --cmdline '$CMDLINE'${PREFAULT:+ --prefault $PREFAULT}${EVENTS:+ --events $EVENTS}" ;;
    qemu)
      # sync: preallocated on 2 threads, as ember's sync in the 2-CPU L1
      # (plain -mem-prealloc would take one per vCPU). A virtio-mem region
      # needs a PCI machine's device-memory area (microvm has none): q35,
      # `maxmem`, and virtio-mem-pci preallocating each block as it is plugged.
      mc=${QMACHINE:-microvm}; [ -n "${VMEM:-}" ] && mc=q35
      bm=$((MEM - ${VMEM:-0})); m="-M $mc -m ${bm}M"
      [ "${PREFAULT:-}" = sync ] && m="-object memory-backend-ram,id=rigmem,size=${bm}M,prealloc=on,prealloc-threads=2 -M $mc,memory-backend=rigmem -m ${bm}M"
      [ -n "${VMEM:-}" ] && m="$m,maxmem=${MEM}M -object memory-backend-ram,id=rigvmem,size=${VMEM}M -device virtio-mem-pci,memdev=rigvmem,requested-size=${VMEM}M$([ "${PREFAULT:-}" = sync ] && echo ,prealloc=on)"
      echo "qemu-system-x86_64 -L ./qemu-share $m -enable-kvm -cpu host -smp $2 -nodefaults -no-user-config -nographic -serial stdio -no-reboot -kernel $K -initrd $I -append '$CMDLINE'" ;;
    firecracker)
      # No API socket, no network, no drives: the boot source and machine only.
      cat > /tmp/fc-$2.json <<EOJ
{"boot-source": {"kernel_image_path": "$K", "initrd_path": "$I", "boot_args": "$CMDLINE rig.end=reboot"},
 "drives": [],
 "machine-config": {"vcpu_count": $2, "mem_size_mib": $MEM}}
EOJ
      echo "./firecracker --no-api --config-file /tmp/fc-$2.json --level Error" ;;
    # (prefault=on covers the virtio-mem region too: all of it before boot.)
    cloud-hypervisor) echo "./cloud-hypervisor --kernel $K --initramfs $I --cmdline '$CMDLINE' --cpus boot=$2 --memory size=$((MEM - ${VMEM:-0}))M${VMEM:+,hotplug_method=virtio-mem,hotplug_size=${VMEM}M,hotplugged_size=${VMEM}M}$([ "${PREFAULT:-}" = sync ] && echo ,prefault=on) --serial tty --console off" ;;
  esac
}

# new_pids NAME PIDS: the live (not zombie) processes named NAME not in PIDS.
new_pids() {
  for q in $(pidof "$1"); do
    case " $2 " in *" $q "*) continue ;; esac
    read -r _ _ s _ < "/proc/$q/stat" 2> /dev/null && [ "$s" != Z ] && echo "$q"
  done
}

# boot VMM VCPUS ROUND [LABEL]: one timed boot, reported under LABEL (VMM).
# With EVENTS set, the boot line ends with three times from ember's own
# clock (ms since its exec, from the events file): first guest instruction,
# all memory committed, all memory visible to the guest ("none": never).
boot() {
  cmd=$(vmm_cmd "$1" "$2")
  log=/tmp/boot-${4:-$1}-$2-$3.log
  p=${cmd%% *}
  p=${p##*/}
  before=$(pidof "$p")
  [ -n "${EVENTS:-}" ] && rm -f "$EVENTS"
  read -r t0 _ < /proc/uptime
  { eval "$cmd" < /dev/null 2>&1; echo "RIG-STATUS $?"; } | {
    m=; st=; m2=
    while IFS= read -r l; do
      case $l in
        *$MARK*) read -r m _ < /proc/uptime ;;
        *${MARK2:-$MARK}*) read -r m2 _ < /proc/uptime ;;
        RIG-STATUS*) st=${l#RIG-STATUS } ;;
        RIG-DMESG*) echo "RIG-DMESG $1 $2 $3 ${l#RIG-DMESG }" ;;
      esac
      printf '%s\n' "$l" >> "$log"
      [ "${LOGALL:-0}" = 1 ] && echo "RIG-LOG $l"
    done
    echo "${m:-none} ${st:-none} ${m2:-none}" > /tmp/mark
  }
  read -r t1 _ < /proc/uptime
  read -r m st m2 < /tmp/mark
  # ember leaves unmapping guest memory to a keeper process that outlives it:
  # the next boot must not start while it frees (gigabytes, with --prefault).
  # (Only processes of that name this boot started: the L1 has others.)
  while [ -n "$(new_pids "$p" "$before")" ]; do sleep 0.1; done
  ms() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "none") print "none"; else printf "%d", (a - b) * 1000 }'; }
  ev=
  if [ -n "${EVENTS:-}" ]; then
    for k in first_guest_entry memory_committed memory_visible; do
      ev="$ev $( (tr -d '\n' < "$EVENTS" | tr '{' '\n') 2>/dev/null | awk -v k="\"$k\"" 'index($0, k) {
        sub(/.*"t_us":/, ""); sub(/,.*/, ""); printf "%d", $0 / 1000; f = 1; exit } END { if (!f) print "none" }')"
    done
  fi
  MARK2_MS=$(ms "$m2" "$t0")
  echo "RIG-BOOT ${4:-$1} $2 $3 $(ms "$m" "$t0") $(ms "$t1" "$t0") $st$ev"
  if [ "$m" = none ]; then echo "RIG-FAILED-LOG ${4:-$1} $2 $3:"; tail -20 "$log"; fi
}

# (bench/rig-memory-inner.sh: the functions only.)
[ "${RIG_FUNCS_ONLY:-0}" = 1 ] && return 0

T=/sys/kernel/tracing
HISTS="kvm_exit:exit_reason kvm_userspace_exit:reason kvm_pio:port kvm_mmio:gpa kvm_msr:ecx"
hist() { # hist on|off
  for h in $HISTS; do
    ev=${h%%:*}; key=${h#*:}
    t="hist:keys=$key:vals=hitcount:sort=hitcount.descending:size=512"
    [ "$1" = off ] && t="!$t"
    echo "$t" > $T/events/kvm/$ev/trigger || { echo "RIG-NOTE no histogram trigger for $ev"; return 1; }
  done
}

# (bench/rig.sh notes the host CPU time the L1 has used at this line and at each RIG-BOOT.)
echo RIG-START
for r in $(seq "$ROUNDS"); do
  for c in $VCPUS; do
    for v in $VMMS; do boot "$v" "$c" "$r"; done
  done
done

if [ "${EXITS:-1}" = 1 ]; then
  for c in $VCPUS; do
    for v in $VMMS; do
      hist on || break
      boot "$v" "$c" count > /dev/null
      for h in $HISTS; do
        ev=${h%%:*}
        grep '^{' $T/events/kvm/$ev/hist | tr -d '{}:' | awk -v v="$v" -v c="$c" -v e="$ev" '{print "RIG-EXITS", v, c, e, $2, $4}'
      done
      hist off
    done
  done
fi
# (The host notes the L1's CPU time as each RIG-BOOT line arrives: the L1
# must outlive the last one by a moment.)
sleep 2
