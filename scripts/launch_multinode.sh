#!/usr/bin/env bash
# Launch one node of a multi-node torchrun job (e.g. two DGX Sparks linked by ConnectX-7).
# Run it on every node with the same flags except --node-rank:
#   node 0:  scripts/launch_multinode.sh --node-rank 0 --master-addr 192.168.100.10 -- -m scripts.base_train --depth 20
#   node 1:  scripts/launch_multinode.sh --node-rank 1 --master-addr 192.168.100.10 -- -m scripts.base_train --depth 20
# It detects the RoCE interface and its HCAs (ibdev2netdev if installed, else /sys/class/infiniband),
# sets NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the interface and NCCL_IB_HCA to every active HCA
# on it (a Spark's ConnectX-7 port shows up as two PCIe halves, each its own HCA: naming both gives
# the full ~200 Gb/s), keeps NVLink multicast off (NCCL_NVLS_ENABLE=0), checks the MTU, and execs
# torchrun. --dry-run prints the environment and the exact command instead of running it.
# Test hooks: NANOCHAT_SYSFS_ROOT (default /) and IBDEV2NETDEV (default: ibdev2netdev on PATH).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/launch_multinode.sh --node-rank N --master-addr ADDR [options] [-- TORCHRUN_ARGS...]
  --node-rank N      this node's rank, 0..nnodes-1 (required)
  --master-addr A    IP/hostname of node 0 on the fast link (required)
  --master-port P    rendezvous TCP port on node 0 (default 29500)
  --nnodes N         number of nodes (default 2)
  --nproc N          processes (GPUs) per node (default 1: one GB10 per Spark)
  --iface IF         network interface for NCCL/Gloo sockets (default: an exported NCCL_SOCKET_IFNAME,
                     else the detected RoCE interface)
  --hca LIST         NCCL_IB_HCA value, e.g. rocep1s0f1,roceP2p1s0f1 (default: an exported NCCL_IB_HCA,
                     else the active HCAs on --iface's port)
  --dry-run          print the environment and the torchrun command; do not run
  -h, --help         this text
After --: what torchrun runs (default: -m scripts.base_train), with the repo's .venv python and the
repo on PYTHONPATH, from any directory (relative paths in it are the caller's). --flag=value works too.
Every node waits NANOCHAT_DIST_TIMEOUT seconds (default 600) for the other nodes (torchrun's rendezvous),
and every rank as long for the others: at the start (where the ranks of all nodes must run the same code,
torch and command line; NANOCHAT_ALLOW_DIFFERENT_FLAGS=1 lets the command lines differ), in a collective
and at a barrier; then it stops naming the ranks that did not come.
EOF
}
die() { echo "launch_multinode: error: $*" >&2; exit 2; }
warn() { echo "launch_multinode: WARNING: $*" >&2; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

NODE_RANK="" MASTER_ADDR_="" MASTER_PORT_=29500 NNODES=2 NPROC=1 IFACE="" HCA="" DRY_RUN=0
need_value() { [[ $# -ge 2 && -n $2 && $2 != --* ]] || die "$1: needs a value"; }
while [[ $# -gt 0 ]]; do
  if [[ $1 == --?*=* ]]; then   # --flag=value: as --flag value
    flag=${1%%=*} value=${1#*=}; shift; set -- "$flag" "$value" "$@"
  fi
  case $1 in
    --node-rank) need_value "$@"; NODE_RANK=$2; shift 2 ;;
    --master-addr) need_value "$@"; MASTER_ADDR_=$2; shift 2 ;;
    --master-port) need_value "$@"; MASTER_PORT_=$2; shift 2 ;;
    --nnodes) need_value "$@"; NNODES=$2; shift 2 ;;
    --nproc|--nproc-per-node) need_value "$@"; NPROC=$2; shift 2 ;;
    --iface) need_value "$@"; IFACE=$2; shift 2 ;;
    --hca) need_value "$@"; HCA=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
CMD=("$@")
[[ ${#CMD[@]} -gt 0 ]] || CMD=(-m scripts.base_train)

# 10#: a leading zero is not octal here ("08" is 8, "010" is 10, as torchrun's int() reads them)
is_uint "$NNODES" && (( 10#$NNODES >= 1 )) || die "--nnodes: got '$NNODES'; accepted: an integer >= 1"
NNODES=$((10#$NNODES))
[[ -n $NODE_RANK ]] || die "--node-rank: required (0..$((NNODES - 1)))"
is_uint "$NODE_RANK" && (( 10#$NODE_RANK < NNODES )) || die "--node-rank: got '$NODE_RANK'; accepted: 0..$((NNODES - 1))"
NODE_RANK=$((10#$NODE_RANK))
[[ -n $MASTER_ADDR_ ]] || die "--master-addr: required (node 0's address on the fast link)"
# "10.0.0.1:29500" (one colon: a port; an IPv6 address has several) resolves nowhere: node 0 waits
# while every other node retries it with a gai warning until torchrun's 600 s rendezvous timeout
[[ ! $MASTER_ADDR_ =~ ^[^:]*:[^:]*$ && ! $MASTER_ADDR_ =~ [[:space:]] ]] \
  || die "--master-addr: got '$MASTER_ADDR_'; accepted: node 0's host name or IP address alone (the port is --master-port)"
is_uint "$MASTER_PORT_" && (( 10#$MASTER_PORT_ >= 1 && 10#$MASTER_PORT_ <= 65535 )) \
  || die "--master-port: got '$MASTER_PORT_'; accepted: 1..65535"
MASTER_PORT_=$((10#$MASTER_PORT_))
is_uint "$NPROC" && (( 10#$NPROC >= 1 )) || die "--nproc: got '$NPROC'; accepted: an integer >= 1"
NPROC=$((10#$NPROC))

# An exported NCCL_SOCKET_IFNAME / NCCL_IB_HCA stands for --iface / --hca (checked the same way): the
# detected values would otherwise replace it without a word, or the dry run would show "HCAs none"
# while the run used the caller's NCCL_IB_HCA unchecked. The flags win.
IFACE_SRC=--iface HCA_SRC=--hca
if [[ -z $IFACE && -n ${NCCL_SOCKET_IFNAME:-} ]]; then
  IFACE=$NCCL_SOCKET_IFNAME IFACE_SRC="NCCL_SOCKET_IFNAME (from the environment; --iface overrides it)"
fi
if [[ -z $HCA && -n ${NCCL_IB_HCA:-} ]]; then
  HCA=$NCCL_IB_HCA HCA_SRC="NCCL_IB_HCA (from the environment; --hca overrides it)"
fi

SYSFS=${NANOCHAT_SYSFS_ROOT:-}; SYSFS=${SYSFS%/}   # "" (the default): /sys/...
NET=$SYSFS/sys/class/net
IB=$SYSFS/sys/class/infiniband

# ---- HCA -> netdev map, "hca netdev state" per line ----
hca_map() {
  local tool=${IBDEV2NETDEV:-ibdev2netdev}
  local out
  # "rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)"; a tool that fails falls back to sysfs (under set -e
  # and pipefail its failure would otherwise end the script without a word)
  if command -v "$tool" > /dev/null 2>&1 && out=$("$tool" 2>/dev/null); then
    awk '$4 == "==>" { s = $6; gsub(/[()]/, "", s); print $1, $5, s }' <<< "$out"
    return
  fi
  [[ -d $IB ]] || return 0
  local dev nd state
  for dev in "$IB"/*; do
    [[ -e $dev ]] || continue
    for nd in "$dev"/device/net/*; do
      [[ -e $nd ]] || continue
      state=$(cat "$NET/$(basename "$nd")/operstate" 2>/dev/null || echo unknown)
      [[ $state == up ]] && state=Up || state=Down
      echo "$(basename "$dev") $(basename "$nd") $state"
    done
  done
}
MAP=$(hca_map)

if [[ -z $IFACE ]]; then
  # prefer an active RoCE netdev that carries an IPv4 address (the one the nodes talk over)
  for nd in $(awk '$3 == "Up" { print $2 }' <<< "$MAP"); do
    if command -v ip > /dev/null 2>&1 && [[ -n $(ip -4 -o addr show dev "$nd" 2>/dev/null) ]]; then IFACE=$nd; break; fi
  done
  [[ -n $IFACE ]] || IFACE=$(awk '$3 == "Up" { print $2; exit }' <<< "$MAP")
  [[ -n $IFACE ]] || die "no active RoCE interface found (ibdev2netdev / $IB); pass --iface (and --hca)"
fi
[[ $IFACE != */* && -d $NET/$IFACE ]] \
  || die "$IFACE_SRC: '$IFACE' does not exist; available: $(ls "$NET" 2>/dev/null | tr '\n' ' ')(one interface name)"
# a port without link (a Spark's other, unplugged ConnectX-7 port): Gloo and NCCL cannot use it and
# fail only after the rendezvous, with "no usable interface"-style errors on every node
if [[ $(cat "$NET/$IFACE/operstate" 2>/dev/null) == down ]]; then
  up=$(for nd in "$NET"/*; do [[ $(cat "$nd/operstate" 2>/dev/null) != up ]] || printf '%s ' "${nd##*/}"; done)
  die "$IFACE_SRC: '$IFACE' is down (no link: cable, or the other port?); interfaces up: ${up:-none}"
fi
if [[ -n $HCA ]]; then
  # an explicit list must name HCAs this node has (NCCL matches names as prefixes, '=' exactly,
  # '^' excludes): a typo would leave NCCL on TCP sockets at a fraction of RoCE's bandwidth
  # (no $IB is no HCA: under pipefail a failing ls would end the script here without a word)
  known=$( { awk '{ print $1 }' <<< "$MAP"; ls "$IB" 2>/dev/null || true; } | LC_ALL=C sort -u | paste -sd' ' -)
  mode=${HCA:0:1}
  if [[ $mode != "^" ]]; then
    IFS=, read -ra wanted <<< "${HCA#=}"
    for name in "${wanted[@]}"; do
      name=${name%%:*}
      hit=0
      for dev in $known; do
        if [[ $mode == "=" && $dev == "$name" ]] || [[ $mode != "=" && -n $name && $dev == "$name"* ]]; then hit=1; fi
      done
      (( hit )) || die "$HCA_SRC: '$name' names no HCA on this node; available: ${known:-none (no ibdev2netdev, $IB empty)}"
    done
  fi
fi
if [[ -z $HCA ]]; then
  # Both halves of a Spark's port: every active HCA whose netdev shares the interface's port
  # suffix (enp1s0f1np1 and enP2p1s0f1np1 -> ...s0f1np1); fall back to every active HCA.
  suffix=$(sed -E 's/^en(P[0-9]+)?p[0-9]+//' <<< "$IFACE")
  HCA=$(awk -v sfx="$suffix" '$3 == "Up" && substr($2, length($2) - length(sfx) + 1) == sfx { print $1 }' \
        <<< "$MAP" | paste -sd, -)
  [[ -n $HCA ]] || HCA=$(awk '$3 == "Up" { print $1 }' <<< "$MAP" | paste -sd, -)
fi
if [[ -z $HCA ]]; then
  warn "no RDMA HCA found for $IFACE: NCCL will use TCP sockets (far below RoCE bandwidth)"
elif [[ $HCA != *,* ]] && (( $(awk '$3 == "Up"' <<< "$MAP" | wc -l) > 1 )); then
  warn "NCCL_IB_HCA=$HCA names one HCA; a Spark's ConnectX-7 port has two halves: name both for full bandwidth"
fi

MTU=$(cat "$NET/$IFACE/mtu" 2>/dev/null || echo "")
if [[ -z $MTU ]]; then
  warn "$IFACE: MTU unknown"
elif (( MTU < 9000 )); then
  warn "$IFACE: MTU $MTU < 9000. RoCE packs at most MTU-sized frames (RoCE MTU 4096 needs an Ethernet MTU" \
       ">= 4200, else 1024-byte packets), so a small MTU multiplies packets and per-packet overhead and cuts" \
       "bandwidth; set 'sudo ip link set $IFACE mtu 9000' on BOTH nodes (and the switch, if any)"
fi

# from any directory: the repo's venv, and the repo on the import path for `-m scripts.X` (the
# working directory stays the caller's, so relative paths in the command keep their meaning)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torchrun waits this long after passing a Ctrl-C / SIGTERM on
# before it SIGKILLs the workers (30 s by default), and a graceful stop finishes a step (~30 s at
# d20 on a Spark) and saves first
ENV_VARS=(NCCL_SOCKET_IFNAME="$IFACE" GLOO_SOCKET_IFNAME="$IFACE" NCCL_NVLS_ENABLE=0
          TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-3600}")
ENV_VARS+=(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}")
# The launch's first wait is torchrun's own, for every node's agent (its static rendezvous: 600 s unless
# --rdzv_conf timeout=N), before any rank's roll call: NANOCHAT_DIST_TIMEOUT, which the usage and the
# ranks promise bounds the start, was ignored there (1800 s for a node started late still ended after
# 600 s). Read here as every rank reads it (a bad value stops here, not on every rank after the wait).
RDZV_TIMEOUT=600 RDZV_CONF=()
if [[ -n ${NANOCHAT_DIST_TIMEOUT:-} ]]; then
  RDZV_TIMEOUT=$(PYTHONPATH="$REPO" "$PY" - <<'PYEOF'
import math, sys
from nanochat.roll_call import dist_timeout_s
try:
    print(math.ceil(dist_timeout_s()))   # torchrun reads whole seconds
except ValueError as e:
    print(e)
    sys.exit(2)
PYEOF
) || die "${RDZV_TIMEOUT:-NANOCHAT_DIST_TIMEOUT: $PY could not read it (see above)}"
  [[ $RDZV_TIMEOUT =~ ^[0-9]+$ ]] || die "NANOCHAT_DIST_TIMEOUT: $PY could not read it (it printed '$RDZV_TIMEOUT')"
  ENV_VARS+=(NANOCHAT_DIST_TIMEOUT="$NANOCHAT_DIST_TIMEOUT")
  RDZV_CONF=(--rdzv_conf=timeout="$RDZV_TIMEOUT")
fi

# --master-addr as torchrun's agents use it. A name that does not resolve was retried with a gai
# warning until the rendezvous timeout; on node 0, which hosts the rendezvous store, an address that
# is not its own (a typo, the other Spark's address) made its torchrun retry the connection with a
# C++ trace every second for 15 minutes. Exit 3: no such name; 4: not this node's; else not checked.
# It prints "loopback" for an address that is loopback on every node (127.x, ::1, localhost): only
# node 0 is there. A name that resolves to loopback here ("local-loopback IP") is read by every node
# through its own /etc/hosts and DNS: Debian and Ubuntu map a machine's own hostname to 127.0.1.1,
# so `--master-addr $(hostname)` on node 0 is loopback there alone, and that is fine for node 0
# (torchrun's store listens on every interface); it is wrong only on a node that is not node 0. On such
# a node, "own IP": the address is this node's own (its own address pasted into its command line).
addr_check() {
  "$PY" - "$MASTER_ADDR_" "$NODE_RANK" 2>/dev/null <<'PYEOF'
import ipaddress, socket, sys
addr, node = sys.argv[1], int(sys.argv[2])
def is_loopback(ip):
    ip = ipaddress.ip_address(ip.split("%")[0])   # "fe80::1%eth0": the zone is no part of the address
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)
try:
    literal = is_loopback(addr)
except ValueError:   # a name: "localhost" and *.localhost are loopback on every node (RFC 6761)
    name = addr.lower().rstrip(".")
    literal = name == "localhost" or name.endswith(".localhost")
try:
    infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
except (socket.gaierror, UnicodeError) as e:
    if getattr(e, "errno", None) == socket.EAI_AGAIN:   # DNS briefly away: torchrun's retries may get through
        sys.exit(0)
    print(getattr(e, "strerror", None) or e)
    sys.exit(3)
def mine(family, sockaddr):   # binds only to an address this machine has
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((sockaddr[0], 0, *sockaddr[2:]))
    except OSError:
        return False
    return True
own = [info[4][0] for info in infos if mine(info[0], info[4])]
if node == 0 and not own:
    sys.exit(4)
if literal:
    print("loopback")
elif all(is_loopback(info[4][0]) for info in infos):
    print(f"local-loopback {infos[0][4][0]}")
elif node != 0 and own:
    print(f"own {own[0]}")
PYEOF
}
addr_said=$(addr_check) && addr_rc=0 || addr_rc=$?
addr_problem=""
if (( addr_rc == 3 )); then
  addr_problem="--master-addr: got '$MASTER_ADDR_', which does not resolve here ($addr_said); accepted: node 0's IP address or a host name this node resolves"
elif (( addr_rc == 4 )); then
  addr_problem="--master-addr: got '$MASTER_ADDR_', which is not an address of this node, but --node-rank 0 hosts the rendezvous: pass node 0's own address on the fast link (here: $(echo $(hostname -I 2>/dev/null)))"
elif (( NNODES > 1 )) && [[ $addr_said == loopback ]]; then
  if (( NODE_RANK == 0 )); then
    warn "--master-addr $MASTER_ADDR_ is a loopback address: the other $((NNODES - 1)) node(s) cannot reach node 0 there"
  else
    warn "--master-addr $MASTER_ADDR_ is a loopback address: node $NODE_RANK looks for node 0 on itself there" \
         "(fine only when every node runs on this machine); pass node 0's address on the fast link"
  fi
elif [[ $addr_said == own* ]]; then   # (node >= 1)
  warn "--master-addr $MASTER_ADDR_ is an address of this node (${addr_said#* }), but --node-rank $NODE_RANK is not" \
       "node 0: it looks for node 0 on itself there (fine only when every node runs on this machine); pass node 0's" \
       "address on the fast link"
elif (( NNODES > 1 )) && [[ $addr_said == local-loopback* ]]; then
  if (( NODE_RANK == 0 )); then
    echo "launch_multinode: note: --master-addr $MASTER_ADDR_ resolves to ${addr_said#* } (loopback) on this node," \
         "as a machine's own name does through the 127.0.1.1 line Debian and Ubuntu put in /etc/hosts. That is fine" \
         "here (node 0's store listens on every interface), but each other node resolves '$MASTER_ADDR_' itself" \
         "and must get an address of node 0 it can reach ('getent hosts $MASTER_ADDR_' there): else pass node 0's IP" >&2
  else
    warn "--master-addr $MASTER_ADDR_ resolves to ${addr_said#* }, a loopback address, on this node (an /etc/hosts" \
         "line for it here?): node $NODE_RANK looks for node 0 on itself there (fine only when every node runs on this" \
         "machine); pass node 0's IP address on the fast link, or map the name to it in this node's /etc/hosts"
  fi
fi
if [[ -n $addr_problem ]]; then
  (( DRY_RUN )) || die "$addr_problem"
  warn "$addr_problem (a real launch stops here)"
fi
[[ -n $HCA ]] && ENV_VARS+=(NCCL_IB_HCA="$HCA")
[[ -n ${NCCL_DEBUG:-} ]] && ENV_VARS+=(NCCL_DEBUG="$NCCL_DEBUG")
TORCHRUN=("$PY" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC"
          --master_addr="$MASTER_ADDR_" --master_port="$MASTER_PORT_" ${RDZV_CONF[@]+"${RDZV_CONF[@]}"} "${CMD[@]}")

if (( DRY_RUN )); then
  echo "# node $NODE_RANK of $NNODES, $NPROC process(es), interface $IFACE (MTU ${MTU:-?}), HCAs ${HCA:-none}"
  for kv in "${ENV_VARS[@]}"; do   # as a shell reads it back (a repo path with a space in PYTHONPATH)
    v=${kv#*=}; [[ $v =~ ^[A-Za-z0-9_./:,=^@+%-]*$ ]] || v=$(printf '%q' "$v")
    echo "export ${kv%%=*}=$v"
  done
  printf '%q ' "${TORCHRUN[@]}"; echo
  exit 0
fi
# torchrun's static rendezvous waits silently (600 s, then "Timed out ... waiting for clients. 1/2
# clients joined") for a node that was never started or cannot reach node 0: say what it waits for
(( NNODES > 1 )) && echo "launch_multinode: node $NODE_RANK of $NNODES: waiting for all $NNODES nodes at" \
  "$MASTER_ADDR_:$MASTER_PORT_ (torchrun gives up after $RDZV_TIMEOUT s, NANOCHAT_DIST_TIMEOUT); run this on every node" \
  "with its --node-rank" >&2
export "${ENV_VARS[@]}"
exec "${TORCHRUN[@]}"
