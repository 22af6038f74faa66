#!/bin/sh
# The inside of bench/rig-containers.sh: runs in the nested rig's L1 guest
# (busybox sh, /dev/kvm from kvm-amd), from /rig. Starts containerd (its
# root and state on a tmpfs of its own), imports the image, runs one warm-up
# `ctr run` of each runtime (ember's first boots the pod VM cold and saves
# the appliance's snapshot; runc's fills the caches), then ROUNDS rounds of
# `ctr run --rm` with each runtime, the order alternating. Prints
#   RIG-CTR <runtime> <round> <ms to the first line> <ms to exit> <status> <start, us>
# (round 0: the warm-up; the start on the L1's wall clock, as the shim's log
# times its lines), RIG-NOTE lines from the shim's log (its timings),
# and RIG-FAILED-LOG with the output of a run that printed no first line.
# With RIG_DOCKER=1, then the same with Docker (its own dockerd): RIG-DOCKER
# lines, as RIG-CTR's.
# Configuration (environment): ROUNDS, RIG_DOCKER, RUN_TIMEOUT (s, 300).
b=/bin/busybox
$b mkdir -p /tmp/rig-bin && $b --install -s /tmp/rig-bin
export PATH=/usr/local/bin:/usr/bin:/usr/sbin:/tmp/rig-bin:$PATH
ROUNDS=${ROUNDS:-5}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
IMAGE=localhost/rig-bench:latest
WORKLOAD='echo RIG-FIRST-LINE; cat /etc/message'
D=/tmp/ctd

now_us() { adjtimex | awk '/time.tv_sec/ { s = $2 } /time.tv_usec/ { u = $2 } END { printf "%.0f\n", s * 1000000 + u }'; }
ms_since() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "none") print "none"; else printf "%.1f", (a - b) / 1000 }'; }

# runc's cgroups, containerd's overlay snapshots (the L1 loads only its own
# modules), containerd's files on a tmpfs (overlayfs wants xattrs on its
# upper layer, which the L1's root may lack).
grep -q cgroup2 /proc/mounts || mount -t cgroup2 none /sys/fs/cgroup
grep -qw overlay /proc/filesystems || for m in $(cat ko/order); do insmod "ko/$m"; done
mkdir -p $D && mount -t tmpfs tmpfs $D
cat > $D/config.toml <<EOF
version = 2
root = "$D/root"
state = "$D/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$D/containerd.sock"
[ttrpc]
  address = "$D/containerd.sock.ttrpc"
[debug]
  level = "info"
EOF
containerd --config $D/config.toml > $D/containerd.log 2>&1 &
ctr() { command ctr --address $D/containerd.sock "$@"; }
i=0
until ctr version > /dev/null 2>&1; do
  i=$((i + 1)); [ $i -gt 600 ] && { echo "RIG-FAILED containerd did not come up"; tail -30 $D/containerd.log; exit 1; }
  usleep 200000
done
ctr images import --base-name localhost/rig-bench ./image.tar > /dev/null ||
  { echo "RIG-FAILED ctr images import"; exit 1; }

# run TOOL RUNTIME ROUND: one timed `ctr run --rm` or `docker run --rm`.
n=0
run() {
  n=$((n + 1))
  log=/tmp/$1-$2-$3.log
  case $1-$2 in
    ctr-ember) opts="--runtime io.containerd.ember.v2" ;;
    # runc cannot pivot_root away from the L1's initramfs root (Docker's
    # DOCKER_RAMDISK case): it chroots instead.
    ctr-runc) opts="--no-pivot" ;;
    # No network, as ctr's containers: only their loopback.
    docker-*) opts="--network none --runtime $2" ;;
  esac
  t0=$(now_us)
  {
    # A run that hangs fails (and the rig goes on) after RUN_TIMEOUT s.
    # shellcheck disable=SC2086 # opts is a list of arguments
    case $1 in
      ctr) timeout "$RUN_TIMEOUT" ctr --address $D/containerd.sock run --rm $opts $IMAGE "bench-$2-$n" sh -c "$WORKLOAD" 2>&1 ;;
      docker) timeout "$RUN_TIMEOUT" /usr/bin/docker -H unix://$G/docker.sock run --rm $opts $DIMAGE sh -c "$WORKLOAD" 2>&1 ;;
    esac
    echo "RIG-STATUS $?"
  } | {
    m=none; st=none
    while IFS= read -r l; do
      case $l in
        RIG-FIRST-LINE*) [ $m = none ] && m=$(now_us) ;;
        RIG-STATUS*) st=${l#RIG-STATUS } ;;
      esac
      printf '%s\n' "$l" >> "$log"
    done
    echo "$m $st" > /tmp/mark
  }
  t1=$(now_us)
  read -r m st < /tmp/mark
  tag=RIG-CTR; [ "$1" = docker ] && tag=RIG-DOCKER
  echo "$tag $2 $3 $(ms_since "$m" "$t0") $(ms_since "$t1" "$t0") $st $t0"
  if [ "$m" = none ] || [ "$st" != 0 ]; then
    echo "RIG-FAILED-LOG $1 $2 $3:"; tail -20 "$log"
    case $1 in ctr) tail -20 $D/containerd.log ;; docker) tail -20 $G/dockerd.log ;; esac
  fi
}

# rounds TOOL: a warm-up of each runtime, then ROUNDS alternating rounds.
rounds() {
  run "$1" ember 0
  run "$1" runc 0
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then run "$1" ember "$r"; run "$1" runc "$r"; else run "$1" runc "$r"; run "$1" ember "$r"; fi
  done
}

rounds ctr
# The shim's own timings (the pod VM's start, the agent's answer).
grep -e 'agent answered' -e 'booting the pod VM' $D/containerd.log | sed 's/^/RIG-NOTE /'
kill %1 2>/dev/null
wait
# The appliance's snapshots the pod VMs were restored from (a count that
# grows with every run would mean cold boots).
snapshots() { echo "RIG-NOTE snapshots after $1: $(ls "${HOME:-/root}/.cache/ember/snapshots" 2>/dev/null | wc -l)"; }
snapshots ctr

# Docker (RIG_DOCKER=1): its own dockerd (and the containerd it starts),
# files on a tmpfs, no bridge or iptables; ember-oci registered as the
# runtime `ember` on the ember backend (beside the ember and agent the shim
# runs: its pod VMs restore the snapshot the ctr runs saved), runc chrooting
# (DOCKER_RAMDISK).
if [ "${RIG_DOCKER:-0}" = 1 ]; then
  G=/tmp/dkr
  mkdir -p $G && mount -t tmpfs tmpfs $G
  # The backend by the environment, not runtimeArgs: those make dockerd
  # wrap the runtime in a #!/bin/sh script, and the L1 has no /bin/sh.
  echo '{"runtimes": {"ember": {"path": "/rig/ember-oci"}}}' > $G/daemon.json
  DOCKER_RAMDISK=true EMBER_OCI_BACKEND=ember dockerd --config-file $G/daemon.json --data-root $G/data --exec-root $G/exec \
    --pidfile $G/docker.pid -H unix://$G/docker.sock --bridge=none --iptables=false \
    --ip-masq=false --ip-forward=false --userland-proxy=false > $G/dockerd.log 2>&1 &
  dpid=$!
  export DOCKER_CONFIG=$G/client
  docker() { /usr/bin/docker -H unix://$G/docker.sock "$@"; }
  DIMAGE=rig-bench-docker:latest
  i=0
  until docker version > /dev/null 2>&1; do
    i=$((i + 1)); [ $i -gt 1500 ] && { echo "RIG-FAILED dockerd did not come up"; tail -30 $G/dockerd.log; exit 1; }
    usleep 200000
  done
  if docker import - $DIMAGE < ./rootfs.tar > /dev/null; then
    # shellcheck disable=SC2016 # a Go template, not the shell's
    echo "RIG-NOTE docker: $(docker info --format '{{.ServerVersion}}, storage {{.Driver}}, cgroup {{.CgroupVersion}}, runtimes {{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>&1)"
    rounds docker
  else
    echo "RIG-FAILED docker import"; tail -20 $G/dockerd.log
  fi
  kill $dpid 2>/dev/null
  wait
  snapshots docker
fi
echo "RIG-DONE"
