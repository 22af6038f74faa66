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
# Configuration (environment): ROUNDS, SIZES ("512 4096 8192"), MODES ("off
# sync async"; a mode may add ember's options: "async,threads=1"), VMMS
# ("ember"), VCPUS (one count), CMDLINE, TIMELINE.
RIG_FUNCS_ONLY=1
. ./rig-inner.sh
SIZES=${SIZES:-"512 4096 8192"}
MODES=${MODES:-"off sync async"}
VMMS=${VMMS:-ember}
BASE_CMDLINE=$CMDLINE
free -m | sed 's/^/RIG-NOTE L1 /'
echo RIG-START
for r in $(seq "$ROUNDS"); do
  for MEM in $SIZES; do
    for mode in $MODES; do
      for v in $VMMS; do
        # (A mode may carry ember's options: `async,threads=1`.)
        case $v:$mode in ember*) ;; *:sync*) PREFAULT=sync ;; *:off) PREFAULT= ;; *) continue ;; esac
        EVENTS=; CMDLINE=$BASE_CMDLINE
        case $v in ember*) EVENTS=/tmp/rig-events.json; PREFAULT=$mode ;; esac
        # async: /init stays up until the balloon has given back all it took.
        case $mode in async*) CMDLINE="$CMDLINE rig.balloon" ;; esac
        boot "$v" "$VCPUS" "$r" "$v:$mode:$MEM"
        if [ "${TIMELINE:-0}" = 1 ] && [ -n "$EVENTS" ]; then
          echo "RIG-EVENTS $v:$mode:$MEM $r $(tr -d '\n' < "$EVENTS")"
        fi
        grep RIG-BALLOON "/tmp/boot-$v:$mode:$MEM-$VCPUS-$r.log" | sed "s/^/RIG-NOTE $v:$mode:$MEM $r /"
      done
    done
  done
done
# (The host notes the L1's CPU time as each RIG-BOOT line arrives: the L1
# must outlive the last one by a moment.)
sleep 2
