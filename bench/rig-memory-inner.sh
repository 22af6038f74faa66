#!/bin/sh
# The inside of bench/rig-memory.sh: runs in the nested rig's L1 guest, from
# the directory bench/rig-memory.sh filled, with bench/rig-inner.sh's
# functions. For each round, size (MiB) and mode, interleaved, one boot per
# VMM that has the mode (ember: off, sync, async; QEMU microvm and Cloud
# Hypervisor: off, sync = their own prealloc/prefault):
#   RIG-BOOT <vmm>:<mode>:<MiB> <vcpus> <round> <ms to /init's marker> <ms to exit> <status> \
#       [<entry> <committed> <visible> (ember: ms from its exec, its events file)]
# With TIMELINE=1, each ember boot's events file follows as one line:
#   RIG-EVENTS <vmm>:<mode>:<MiB> <round> <json>
# The modes memboot and memwhole (issue 26) boot a guest that loads
# virtio_mem, says RIG-MEM-BOUND once the driver is bound (timed as the
# marker) and RIG-MEM-FULL once MemTotal has grown by the whole virtio-mem
# region and any balloon has given back what it took; every VMM commits all
# memory (ember: --prefault async; the others: their prefault/prealloc).
# memboot: all but 512 MiB a virtio-mem region (each VMM's own device; QEMU
# on q35); memwhole: all of it given at boot. One more line per boot, and one
# per size and round for the L1 populating that much memory itself (the
# limit; bench/rig-populate.c):
#   RIG-MEMBOOT <vmm>:<mode>:<MiB> <round> <ms to RIG-MEM-FULL> <ms to all committed> <ms to both>
#   RIG-BOOT host:populate:<MiB> 2 <round> <ms> <ms> 0
# (ember: all committed is its events file's last commit event; the others
# commit before the guest runs, or, QEMU's virtio-mem, before a plug is done.)
# Configuration (environment): ROUNDS, SIZES ("512 4096 8192"), MODES ("off
# sync async"; a mode may add ember's options: "async,threads=1"), VMMS
# ("ember"), VCPUS (one count), CMDLINE, TIMELINE.
RIG_FUNCS_ONLY=1
. ./rig-inner.sh
SIZES=${SIZES:-"512 4096 8192"}
MODES=${MODES:-"off sync async"}
VMMS=${VMMS:-ember}
BASE_CMDLINE=$CMDLINE
BASE_MARK=$MARK
# ev_ms KEY: ember's time of event KEY from its events file (ms since its
# exec), or none.
ev_ms() {
  (tr -d '\n' < "$EVENTS" | tr '{' '\n') 2>/dev/null | awk -v k="\"$1\"" 'index($0, k) {
    sub(/.*"t_us":/, ""); sub(/,.*/, ""); printf "%d", $0 / 1000; f = 1; exit } END { if (!f) print "none" }'
}
# latest MS...: the largest of the times, none if any is none.
latest() {
  echo "$@" | awk '{ m = 0; for (i = 1; i <= NF; i++) { if ($i == "none") { print "none"; exit } if ($i + 0 > m) m = $i + 0 } print m }'
}
# avail_kib: the L1's MemAvailable.
avail_kib() { awk '/^MemAvailable:/ { print $2 }' /proc/meminfo; }
free -m | sed 's/^/RIG-NOTE L1 /'
echo RIG-START
for r in $(seq "$ROUNDS"); do
  # The VMMs' order reversed every other round: a boot's predecessor (its
  # freed memory, the L1's caches) weighs on no VMM more than another.
  vmms=$VMMS
  [ $((r % 2)) = 0 ] && vmms=$(echo "$VMMS" | awk '{ for (i = NF; i > 0; i--) printf "%s ", $i }')
  for MEM in $SIZES; do
    case " $MODES " in *" memboot "* | *" memwhole "*)
      pop=$(./rig-populate "$MEM" 2) && echo "RIG-BOOT host:populate:$MEM 2 $r $pop $pop 0" ;;
    esac
    for mode in $MODES; do
      for v in $vmms; do
        # (A mode may carry ember's options: `async,threads=1`.)
        case $v:$mode in ember*) ;; *:sync* | *:mem*) PREFAULT=sync ;; *:off) PREFAULT= ;; *) continue ;; esac
        EVENTS=; CMDLINE=$BASE_CMDLINE; MARK=$BASE_MARK; MARK2=; VMEM=; QMACHINE=
        case $v in ember*) EVENTS=/tmp/rig-events.json; PREFAULT=$mode ;; esac
        case $mode in
          # async: /init stays up until the balloon has given back all it took.
          async*) CMDLINE="$CMDLINE rig.balloon" ;;
          mem*)
            # (memboot,OPTS: ember's --prefault async,OPTS; ember only.)
            kind=${mode%%,*}
            case $v in
              ember*) PREFAULT=async${mode#"$kind"}; CMDLINE="$CMDLINE rig.balloon" ;;
              *) [ "$kind" = "$mode" ] || continue ;;
            esac
            [ "$kind" = memboot ] && [ "$MEM" -gt 512 ] && VMEM=$((MEM - 512))
            [ "$kind" = memboot ] && QMACHINE=q35
            # The kernel onlines what is plugged (as the appliance has it).
            CMDLINE="$CMDLINE memhp_default_state=online memory_hotplug.online_policy=auto-movable"
            CMDLINE="$CMDLINE rig.memfull=${VMEM:-0}"; MARK=RIG-MEM-BOUND; MARK2=RIG-MEM-FULL ;;
        esac
        avail0=$(avail_kib)
        boot "$v" "$VCPUS" "$r" "$v:$mode:$MEM"
        # The next boot starts once the L1 has this one's memory back: the
        # process that unmaps it (ember's teardown keeper) may carry another
        # name than the one boot waits for, and freeing gigabytes while the
        # next guest boots would be charged to that boot.
        n=0
        while [ "$(avail_kib)" -lt $((avail0 - 131072)) ] && [ $n -lt 600 ]; do
          sleep 0.1; n=$((n + 1))
        done
        if [ "${TIMELINE:-0}" = 1 ] && [ -n "$EVENTS" ]; then
          echo "RIG-EVENTS $v:$mode:$MEM $r $(tr -d '\n' < "$EVENTS")"
        fi
        case $mode in mem*)
          # Committed: ember's last commit event (the region's own committer
          # only with one); the others commit before the guest runs or plugs.
          c=0
          if [ -n "$EVENTS" ]; then
            c=$(latest "$(ev_ms memory_committed)" "$(ev_ms memory_visible)")
            [ -n "$VMEM" ] && c=$(latest "$c" "$(ev_ms hotplug_committed)")
          fi
          echo "RIG-MEMBOOT $v:$mode:$MEM $r $MARK2_MS $c $(latest "$MARK2_MS" "$c")"
          grep RIG-MEM-FULL "/tmp/boot-$v:$mode:$MEM-$VCPUS-$r.log" | sed "s/^/RIG-NOTE $v:$mode:$MEM $r /" ;;
        esac
        grep RIG-BALLOON "/tmp/boot-$v:$mode:$MEM-$VCPUS-$r.log" | sed "s/^/RIG-NOTE $v:$mode:$MEM $r /"
      done
    done
  done
done
# (The host notes the L1's CPU time as each RIG-BOOT line arrives: the L1
# must outlive the last one by a moment.)
sleep 2
