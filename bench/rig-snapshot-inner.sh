#!/bin/sh
# The inside of bench/rig-snapshot.sh: runs in the nested rig's L1 guest
# (busybox sh, /dev/kvm from kvm-amd), from the directory it filled. For each
# vCPU count: boots the guest under ember and under Firecracker to /init,
# snapshots each there, then restores each snapshot ROUNDS times, interleaved.
# Prints
#   RIG-SNAPSHOT <vmm> <vcpus> <ms> <what>
#   RIG-RESTORE <vmm> <vcpus> <round> <ms to RIG-RESUMED> <ms to exit> <status> <load ms>
# Configuration (environment): ROUNDS, VCPUS, MEM (MiB), CMDLINE.
b=/bin/busybox
$b mkdir -p /tmp/rig-bin && $b --install -s /tmp/rig-bin
export PATH=/tmp/rig-bin:$PATH
[ -e /proc/uptime ] || mount -t proc proc /proc
ROUNDS=${ROUNDS:-5}
VCPUS=${VCPUS:-1}
MEM=${MEM:-256}
CMDLINE=${CMDLINE:-"console=ttyS0 quiet panic=-1 reboot=k"}
K=./vmlinux
I=./initrd.cpio

# Microseconds on L1's wall clock (busybox date has no %N; its awk's %d is
# 32-bit, hence %.0f).
now_us() { adjtimex | awk '/time.tv_sec/ { s = $2 } /time.tv_usec/ { u = $2 } END { printf "%.0f\n", s * 1000000 + u }'; }
ms_since() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "none") print "none"; else printf "%.1f", (a - b) / 1000 }'; }
# api SOCKET METHOD PATH JSON: one Firecracker API request; prints curl's
# time for it (seconds) and fails unless the reply is a 2xx.
api() {
  code=$(curl -s -o /tmp/api.reply -w '%{http_code} %{time_total}' --unix-socket "$1" -X "$2" \
    -H 'Content-Type: application/json' -d "$4" "http://localhost$3")
  case $code in 2*) echo "${code#* }" ;; *) echo "RIG-NOTE api $2 $3: $code $(cat /tmp/api.reply)" >&2; return 1 ;; esac
}
wait_for() { # wait_for FILE TEXT: up to 600 s
  i=0
  until grep -q "$2" "$1" 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 6000 ] && return 1
    usleep 100000
  done
}
wait_sock() { # the API socket, up to 10 s
  i=0
  until [ -S "$1" ]; do i=$((i + 1)); [ $i -gt 10000 ] && return 1; usleep 1000; done
}

snapshot_ember() { # VCPUS
  rm -rf /tmp/esnap-$1 /tmp/e.sock
  ./ember boot --kernel $K --initrd $I --mem ${MEM}M --cpus "$1" --cmdline "$CMDLINE" \
    --api-socket /tmp/e.sock < /dev/null > /tmp/eboot.log 2>&1 &
  wait_for /tmp/eboot.log RIG-SNAP-READY || { echo "RIG-NOTE ember never reached /init"; tail -20 /tmp/eboot.log; return 1; }
  reply=$(./ember snapshot --api-socket /tmp/e.sock --to /tmp/esnap-$1) || { echo "RIG-NOTE ember snapshot failed"; return 1; }
  wait
  # The reply is JSON: {"ms":...,"memory_bytes":...}
  ms=$(echo "$reply" | sed -n 's/.*"ms":\([0-9.]*\).*/\1/p' | awk '{ printf "%.1f", $1 }')
  mb=$(echo "$reply" | sed -n 's/.*"memory_bytes":\([0-9]*\).*/\1/p')
  echo "RIG-SNAPSHOT ember $1 ${ms:-?} $((${mb:-0} / 1048576))MiB-written"
}

snapshot_fc() { # VCPUS
  rm -rf /tmp/fcsnap-$1 /tmp/fc.sock && mkdir -p /tmp/fcsnap-$1
  cat > /tmp/fc-$1.json <<EOJ
{"boot-source": {"kernel_image_path": "$K", "initrd_path": "$I", "boot_args": "$CMDLINE"},
 "drives": [],
 "machine-config": {"vcpu_count": $1, "mem_size_mib": $MEM}}
EOJ
  # Its console input stays open (a pipe from sleep) until it is killed.
  sleep 100000 | ./firecracker --api-sock /tmp/fc.sock --config-file /tmp/fc-$1.json --level Error > /tmp/fcboot.log 2>&1 &
  wait_for /tmp/fcboot.log RIG-SNAP-READY || { echo "RIG-NOTE firecracker never reached /init"; tail -20 /tmp/fcboot.log; return 1; }
  pause_s=$(api /tmp/fc.sock PATCH /vm '{"state": "Paused"}') || return 1
  create_s=$(api /tmp/fc.sock PUT /snapshot/create \
    "{\"snapshot_type\": \"Full\", \"snapshot_path\": \"/tmp/fcsnap-$1/state\", \"mem_file_path\": \"/tmp/fcsnap-$1/mem\"}") || return 1
  kill $(pidof firecracker) $(pidof sleep) 2>/dev/null
  wait
  echo "RIG-SNAPSHOT firecracker $1 $(awk -v p="$pause_s" -v c="$create_s" 'BEGIN { printf "%.1f", (p + c) * 1000 }') pause+create"
}

# restore VMM VCPUS ROUND: one timed restore; the guest reads "go" and resets.
restore() {
  log=/tmp/restore-$1-$2-$3.log
  rm -f /tmp/fcr.sock /tmp/load /tmp/ev.json
  t0=$(now_us)
  {
    case $1 in
      ember) echo go | ./ember boot --restore /tmp/esnap-$2 --timeout 120 --events /tmp/ev.json 2>&1 ;;
      firecracker)
        echo go | ./firecracker --api-sock /tmp/fcr.sock --level Error 2>&1 &
        wait_sock /tmp/fcr.sock &&
          api /tmp/fcr.sock PUT /snapshot/load "{\"snapshot_path\": \"/tmp/fcsnap-$2/state\", \
\"mem_backend\": {\"backend_type\": \"File\", \"backend_path\": \"/tmp/fcsnap-$2/mem\"}, \"resume_vm\": true}" > /tmp/load
        wait $! ;;
    esac
    echo "RIG-STATUS $?"
  } | {
    m=none; st=none
    while IFS= read -r l; do
      case $l in
        *RIG-RESUMED*) m=$(now_us) ;;
        RIG-STATUS*) st=${l#RIG-STATUS } ;;
      esac
      printf '%s\n' "$l" >> "$log"
    done
    echo "$m $st" > /tmp/mark
  }
  t1=$(now_us)
  read -r m st < /tmp/mark
  case $1 in
    # (--events writes one key per line: the t_us line precedes its kind.)
    ember) load=$(awk -F': ' '/"t_us"/ { t = $2; sub(/,$/, "", t) }
      /"first_guest_entry"/ { printf "%.1f", t / 1000; exit }' /tmp/ev.json 2>/dev/null) ;;
    firecracker) load=$(awk '{ printf "%.1f", $1 * 1000 }' /tmp/load 2>/dev/null) ;;
  esac
  echo "RIG-RESTORE $1 $2 $3 $(ms_since "$m" "$t0") $(ms_since "$t1" "$t0") $st ${load:-none}"
  if [ "$m" = none ]; then echo "RIG-FAILED-LOG $1 $2 $3:"; tail -20 "$log"; fi
}

for n in $VCPUS; do
  snapshot_ember "$n" || echo "RIG-FAILED ember snapshot, $n vCPUs"
  snapshot_fc "$n" || echo "RIG-FAILED firecracker snapshot, $n vCPUs"
  for r in $(seq "$ROUNDS"); do
    restore ember "$n" "$r"
    restore firecracker "$n" "$r"
  done
done
echo "RIG-DONE"
