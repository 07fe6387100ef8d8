#!/usr/bin/env bash
# Simulated hosts on one machine, joined by links of a stated rate, to test real multi-node launches
# without a cluster: `deepspeed --hostfile` over ssh + pdsh, and `torchrun --nnodes N`. Needs root.
#
#   scripts/multinode_sim.sh install          apt-get install what is missing: openssh-server pdsh iproute2
#   scripts/multinode_sim.sh check            can this machine run it? exit 0, or 3 with the reason
#   scripts/multinode_sim.sh up               create the hosts and leave them running
#   scripts/multinode_sim.sh down             undo everything `up` did (idempotent, also after a crash)
#   scripts/multinode_sim.sh env              the hosts as sourceable shell variables
#   scripts/multinode_sim.sh shape RATE|off [BURST]
#       every host's link to RATE (tc's units: 500mbit, 2gbit), or unshaped; on a running simulation
#   scripts/multinode_sim.sh counters         bytes each host's interface sent and received (the kernel's count)
#   scripts/multinode_sim.sh exec K CMD...    run CMD on host K (0 .. hosts - 1)
#   scripts/multinode_sim.sh deepspeed ARGS...
#       check the hostfile, then on host 0: python -m deepspeed.launcher.runner --hostfile HOSTFILE ARGS...
#   scripts/multinode_sim.sh torchrun ARGS...
#       on each host K: python -m torch.distributed.run --nnodes HOSTS --nproc_per_node 1 --node_rank K
#       --rdzv_backend c10d --rdzv_endpoint HOST0:29400 ARGS...
#   scripts/multinode_sim.sh demo             a 10-step ZeRO-2 run and a 10-step DDP run across the hosts
#
# `exec`, `deepspeed`, `torchrun` and `demo` bring the hosts up and tear them down around
# themselves unless they are up already (a trap tears down on failure and Ctrl-C too); run `up`
# first to share one setup between many runs, as tests/test_multinode.py does.
#
# A host is a network namespace (llt-ID-h0, llt-ID-h1, ...) with one interface, $LLT_SIM_IFNAME
# (simnet0): a veth pair whose other end is a port of a bridge in a namespace of its own
# (llt-ID-sw), the cluster's switch. Each host has one address in a private 10.x.y.0/24 that no
# route of this machine uses, and its own sshd listening only on that address. With a rate, both
# ends of each host's link are shaped (`tc qdisc replace ... root tbf rate RATE burst BURST latency
# LATENCY`: the host's sending on its end, its receiving on the switch's port), as a NIC's full-duplex
# link to a non-blocking switch. (netem, for delay and loss, is missing from many kernels; tbf is
# not.) The filesystem is shared, so every host sees this checkout and its .venv, and the hosts
# share this machine's cores. Outside $LLT_SIM_DIR the script changes two things and `down` undoes
# both: a marked block at the top of the invoking user's ~/.ssh/config (the test addresses only:
# key, no host-key prompts), and /run/sshd (sshd's privilege-separation directory) when it did not
# exist. root's authorized_keys, ~/.deepspeed_env and ./.deepspeed_env are never touched: the sshds
# read their own authorized_keys and the launcher gets its environment file through DS_ENV_FILE.
#
# A simulation brought up by a command (or by `up` with LLT_SIM_OWNER=PID) belongs to that process;
# once the process is gone without its `down` (killed, crashed), the next command says so and takes
# the leftovers down. A plain `up` stays until `down`.
#
# Environment: LLT_SIM_DIR (state, keys, logs; default /tmp/llama-train-multinode-sim),
# LLT_SIM_HOSTS (hosts at `up`, 2 to 253, one rank each; default 2), LLT_SIM_RATE (each host's link
# rate at `up`, tc's units; default: unshaped), LLT_SIM_BURST (tbf's bucket; default 256kb),
# LLT_SIM_LATENCY (tbf's longest queueing; default 50ms), LLT_SIM_SUBNET (e.g. 10.213.41; default:
# a free one at random), LLT_SIM_IFNAME (simnet0), LLT_SIM_OWNER (a pid: `up` belongs to it),
# LLT_SIM_HOSTFILE (launch with this hostfile instead of the generated one), PY (.venv/bin/python),
# LLT_SIM_FRONT: 1 (`deepspeed`, and host 0's `torchrun`, start behind python -m llama_train.launch)
# or all (also every other host's `torchrun`, each behind a front of its own on the shared
# --output_dir, as a scheduler starts one per node; each host's exit code is logged).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SIM_DIR=$(realpath -m "${LLT_SIM_DIR:-/tmp/llama-train-multinode-sim}")
IFNAME=${LLT_SIM_IFNAME:-simnet0}
BURST=${LLT_SIM_BURST:-256kb}
LATENCY=${LLT_SIM_LATENCY:-50ms}
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
RDZV_PORT=29400 # each host has its own network stack: no port is taken there
HOST_MIB=512    # memory a host needs: its sshd and one rank's runtime (~360-430 MiB, strategies.py)

ID=$(printf '%s' "$SIM_DIR" | sha1sum | cut -c1-6) # one simulation per state directory
SW="llt-$ID-sw"                                     # the switch's namespace
MARK_BEGIN="# >>> llama-train multinode_sim $ID >>>"
MARK_END="# <<< llama-train multinode_sim $ID <<<"
SSH_HOME=$(getent passwd "$(id -u)" | cut -d: -f6) # ssh reads ~/.ssh from passwd, not from $HOME
SSH_CONFIG=$SSH_HOME/.ssh/config
PACKAGES=(sshd:openssh-server ssh:openssh-client ssh-keygen:openssh-client pdsh:pdsh ip:iproute2 tc:iproute2)

log() { echo "multinode_sim: $*" >&2; }
die() {
  echo "error: $*" >&2
  exit 1
}

find_cmd() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1"; }
ns_of() { echo "llt-$ID-h$1"; } # host K's namespace

missing_packages() {
  local entry
  for entry in "${PACKAGES[@]}"; do
    find_cmd "${entry%%:*}" >/dev/null || echo "${entry#*:}"
  done | sort -u
}

cmd_install() {
  local missing=()
  mapfile -t missing < <(missing_packages)
  if [ ${#missing[@]} -eq 0 ]; then
    log "openssh-server, openssh-client, pdsh and iproute2 are installed"
    return
  fi
  [ "$(id -u)" = 0 ] || die "need root to install: ${missing[*]}"
  command -v apt-get >/dev/null || die "no apt-get: install these with your package manager: ${missing[*]}"
  # never let the package start a system-wide sshd (Docker images ship this same guard)
  local guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    guard=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' >"$guard"
    chmod 755 "$guard"
  fi
  local rc=0
  {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q &&
      apt-get install -y -q --no-install-recommends "${missing[@]}"
  } >&2 || rc=$?
  [ -z "$guard" ] || rm -f "$guard"
  [ "$rc" = 0 ] || die "apt-get install ${missing[*]} failed (exit $rc)"
}

# Prints why the simulation cannot run here; exit 3. Silent and 0 when it can.
cmd_check() {
  local missing=()
  if [ "$(id -u)" != 0 ]; then
    echo "needs root (network namespaces, sshd)"
    return 3
  fi
  mapfile -t missing < <(missing_packages)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing packages: ${missing[*]} (run: make setup-multinode)"
    return 3
  fi
  local probe="llt-$ID-probe"
  ip netns del "$probe" 2>/dev/null || true # left over from a killed check
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "cannot create network namespaces here (ip netns add failed: no CAP_SYS_ADMIN?)"
    return 3
  fi
  local err=""
  ip -n "$probe" link add probea type veth peer name probeb 2>/dev/null || err="cannot create veth pairs"
  [ -n "$err" ] || ip -n "$probe" link add probebr type bridge 2>/dev/null || err="cannot create bridges"
  ip netns del "$probe"
  if [ -n "$err" ]; then
    echo "$err in a network namespace"
    return 3
  fi
}

# --- what is up, and whose it is -----------------------------------------------------------------

our_namespaces() { ip netns list | awk '{print $1}' | grep "^llt-$ID-" || true; }

is_up() { [ -f "$SIM_DIR/hosts.env" ] && ip netns list | grep -q "^$(ns_of 0)\b"; }

# "PID:START": a process, told apart from a later one given the same pid
process_id() { [ -r "/proc/$1/stat" ] && echo "$1:$(awk '{print $22}' "/proc/$1/stat")"; }

# Why what is here is a crash's leftovers (prints the reason), or exit 1 when nothing is or it is
# in order: up, and its owner (if it has one) still running.
leftovers() {
  local owner
  if [ -z "$(our_namespaces)" ] && [ ! -f "$SIM_DIR/.llama-train-sim" ]; then return 1; fi
  if ! is_up; then
    echo "a simulation left half up (namespaces: $(our_namespaces | xargs echo); state: $SIM_DIR)"
    return 0
  fi
  [ -f "$SIM_DIR/owner" ] || return 1
  owner=$(cat "$SIM_DIR/owner")
  [ "$(process_id "${owner%%:*}" || true)" != "$owner" ] || return 1
  echo "a simulation left up by process ${owner%%:*}, which is gone (state: $SIM_DIR)"
}

# --- shaping -------------------------------------------------------------------------------------

# bytes of a tc size (256kb, 1mb, 1514, 64k); empty when it does not read as one
size_bytes() {
  [[ "$1" =~ ^([0-9]+)([a-zA-Z]*)$ ]] || return 0
  local n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case "${unit,,}" in
    "" | b) echo "$n" ;;
    k | kb) echo $((n * 1024)) ;;
    m | mb) echo $((n * 1024 * 1024)) ;;
    kbit) echo $((n * 1024 / 8)) ;;
    mbit) echo $((n * 1024 * 1024 / 8)) ;;
  esac
}

# The burst must hold the largest packet the host sends (a 64 KiB GSO segment; tbf splits larger
# ones to MTU-sized packets only when they do not fit), else tbf drops it and TCP stalls silently.
check_burst() {
  local bytes
  bytes=$(size_bytes "$1")
  [ -n "$bytes" ] || die "LLT_SIM_BURST=$1 is not a size tc reads (e.g. 256kb, 1mb)"
  [ "$bytes" -ge 65536 ] || die "LLT_SIM_BURST=$1 is below 64kb: tbf would drop every full-size packet (a 64 KiB segment); use 256kb"
}

shaping() { [ -n "$1" ] && [ "$1" != off ]; } # $1 = a rate: does it shape?

# tc's refusal of rate $1, burst $2 (one line), tried on a probe namespace's veth; silent when it takes it.
tc_refuses() {
  local probe="llt-$ID-probe" out rc=0
  ip netns del "$probe" 2>/dev/null || true
  ip netns add "$probe"
  ip -n "$probe" link add probea type veth peer name probeb
  out=$(ip netns exec "$probe" tc qdisc add dev probea root tbf rate "$1" burst "$2" latency "$LATENCY" 2>&1) || rc=$?
  ip netns del "$probe"
  [ "$rc" = 0 ] || echo "$out" | head -n 1
}

check_rate() { # $1 = rate, $2 = burst: dies with tc's reason when it would refuse them
  local why
  shaping "$1" || return 0
  check_burst "$2"
  why=$(tc_refuses "$1" "$2")
  [ -z "$why" ] || die "link rate '$1' (burst $2, latency $LATENCY) refused: tc says: $why; give a rate like 500mbit or 2gbit"
}

# Every link to $1 (tc's rate units), or unshaped for "off"/""; $2 = burst. Both ends of each link.
apply_shape() {
  local rate=$1 burst=$2 k end ns dev
  check_rate "$rate" "$burst"
  for k in $(seq 0 $((SIM_HOSTS - 1))); do
    for end in "$(ns_of "$k") $IFNAME" "$SW p$k"; do
      read -r ns dev <<<"$end"
      if shaping "$rate"; then
        ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency "$LATENCY"
      else
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
      fi
    done
  done
  sed -i "s/^SIM_RATE=.*/SIM_RATE=${rate:-off}/" "$SIM_DIR/hosts.env"
}

# --- bringing the hosts up -----------------------------------------------------------------------

# How many hosts `up` makes; dies with the reason when the machine cannot hold them.
host_count() {
  local n=${LLT_SIM_HOSTS:-2} avail_mib
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] ||
    die "LLT_SIM_HOSTS=$n: the simulation needs a whole number of hosts >= 2"
  [ "$n" -le 253 ] || die "LLT_SIM_HOSTS=$n: one /24 holds at most 253 hosts"
  avail_mib=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
  [ $((n * HOST_MIB)) -le "$avail_mib" ] ||
    die "LLT_SIM_HOSTS=$n: this machine cannot hold $n hosts (each needs ~$HOST_MIB MiB for its sshd and one rank; $avail_mib MiB available): use at most $((avail_mib / HOST_MIB))"
  echo "$n"
}

# A 10.x.y.0/24 that this machine neither has an address in nor routes anywhere but its default route.
pick_subnet() {
  if [ -n "${LLT_SIM_SUBNET:-}" ]; then
    echo "$LLT_SIM_SUBNET"
    return
  fi
  local default via candidate tries
  default=$(ip -4 route show default | awk 'NR == 1 {print "via " $3 " dev " $5}')
  for tries in $(seq 50); do
    candidate="10.$((200 + RANDOM % 50)).$((RANDOM % 256))"
    ip -4 -o addr show | grep -q " inet ${candidate//./\\.}\." && continue
    via=$(ip -4 route get "$candidate.1" 2>/dev/null) || {
      echo "$candidate"
      return
    }
    [ -n "$default" ] && [[ "$via" == *"$default"* ]] && {
      echo "$candidate"
      return
    }
  done
  die "no free 10.x.y.0/24 found in $tries tries; set LLT_SIM_SUBNET"
}

ssh_config_block() { # "$@" = the hosts' addresses
  cat <<EOF
$MARK_BEGIN
# the simulated hosts of $ROOT/scripts/multinode_sim.sh; \`multinode_sim.sh down\` removes this block
Host $*
    User $(id -un)
    IdentityFile $SIM_DIR/client_key
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
    ConnectTimeout 5
$MARK_END
EOF
}

sshd_config() { # $1 = address to listen on, $2 = host index
  cat <<EOF
ListenAddress $1
HostKey $SIM_DIR/host_key
PidFile $SIM_DIR/sshd$2.pid
AuthorizedKeysFile $SIM_DIR/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
X11Forwarding no
AllowTcpForwarding no
EOF
}

# The state directory, marked as ours so that `down` may delete it (and nothing else).
claim_sim_dir() {
  [ ! -e "$SIM_DIR" ] || [ -f "$SIM_DIR/.llama-train-sim" ] || die "$SIM_DIR exists and is not ours"
  mkdir -p "$SIM_DIR"
  chmod 700 "$SIM_DIR"
  touch "$SIM_DIR/.llama-train-sim"
}

# The switch (a bridge in its own namespace) and a host per address, each linked to a port of it.
create_hosts() {
  local addr=("$@") k ns
  ip netns add "$SW"
  ip -n "$SW" link add br0 type bridge
  ip -n "$SW" link set br0 up
  for k in "${!addr[@]}"; do
    ns=$(ns_of "$k")
    ip netns add "$ns"
    ip link add "llt${ID}h$k" netns "$ns" type veth peer name "llt${ID}p$k" netns "$SW"
    ip -n "$ns" link set "llt${ID}h$k" name "$IFNAME"
    ip -n "$SW" link set "llt${ID}p$k" name "p$k"
    ip -n "$SW" link set "p$k" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "${addr[k]}/24" dev "$IFNAME"
    ip -n "$ns" link set "$IFNAME" up
  done
}

write_keys() {
  ssh-keygen -q -t ed25519 -N '' -C "llama-train multinode_sim client" -f "$SIM_DIR/client_key"
  ssh-keygen -q -t ed25519 -N '' -C "llama-train multinode_sim host" -f "$SIM_DIR/host_key"
  cp "$SIM_DIR/client_key.pub" "$SIM_DIR/authorized_keys"
}

# One sshd per host, inside its namespace, listening on its address only; "$@" = addresses.
start_sshds() {
  local addr=("$@") k
  if [ ! -d /run/sshd ]; then
    mkdir -m 0755 /run/sshd
    touch "$SIM_DIR/created-run-sshd"
  fi
  for k in "${!addr[@]}"; do
    sshd_config "${addr[k]}" "$k" >"$SIM_DIR/sshd$k.conf"
    ip netns exec "$(ns_of "$k")" "$(find_cmd sshd)" -f "$SIM_DIR/sshd$k.conf" -E "$SIM_DIR/sshd$k.log"
  done
}

# Our block on top of the user's ~/.ssh/config (created when missing; `down` undoes both).
add_ssh_config_block() {
  if [ ! -d "$SSH_HOME/.ssh" ]; then
    mkdir -m 700 "$SSH_HOME/.ssh"
    touch "$SIM_DIR/created-ssh-dir"
  fi
  if [ ! -e "$SSH_CONFIG" ]; then
    install -m 600 /dev/null "$SSH_CONFIG"
    touch "$SIM_DIR/created-ssh-config"
  fi
  # on top, so that our options win over a `Host *` further down; `cat >` keeps inode and mode
  { ssh_config_block "$@" && cat "$SSH_CONFIG"; } >"$SIM_DIR/ssh_config.new"
  cat "$SIM_DIR/ssh_config.new" >"$SSH_CONFIG"
  rm "$SIM_DIR/ssh_config.new"
}

# The hostfile, the ranks' .deepspeed_env and hosts.env (what `env` prints); "$@" = addresses.
write_host_files() {
  local addr=("$@") k
  {
    echo "# $# simulated hosts (scripts/multinode_sim.sh), one rank each"
    printf '%s slots=1\n' "$@"
  } >"$SIM_DIR/hostfile"
  # What the launcher exports to every rank on every host (.deepspeed_env format: KEY=VALUE
  # lines, nothing else). Without the interface names gloo and NCCL pick an address by the
  # machine's hostname, which is not reachable from the other hosts. Without PATH a rank gets
  # sshd's default PATH: the launcher runs its own python by absolute path, but DeepSpeed's JIT
  # ops build with whatever `ninja` PATH finds, and a different ninja than the local runs use
  # rebuilds the op in the shared ~/.cache/torch_extensions (~40 s) every time the two alternate.
  # TORCH_EXTENSIONS_DIR, where set (the tests set it): the ops built there, not rebuilt elsewhere.
  {
    echo "GLOO_SOCKET_IFNAME=$IFNAME"
    echo "NCCL_SOCKET_IFNAME=$IFNAME"
    echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"
    echo "PATH=$PATH"
    [ -z "${TORCH_EXTENSIONS_DIR:-}" ] || echo "TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"
  } >"$SIM_DIR/deepspeed_env"
  {
    echo "SIM_DIR=$SIM_DIR"
    echo "SIM_HOSTS=$#"
    for k in "${!addr[@]}"; do
      echo "SIM_NS$k=$(ns_of "$k")"
      echo "SIM_ADDR$k=${addr[k]}"
    done
    echo "SIM_SWITCH_NS=$SW"
    echo "SIM_IFNAME=$IFNAME"
    echo "SIM_RATE=off"
    echo "SIM_HOSTFILE=$SIM_DIR/hostfile"
    echo "SIM_DS_ENV_FILE=$SIM_DIR/deepspeed_env"
    echo "SIM_RDZV_ENDPOINT=$1:$RDZV_PORT"
  } >"$SIM_DIR/hosts.env"
}

# The DeepSpeed launcher's own first check, from the host it runs on: ssh to each host works.
wait_for_ssh() {
  local addr=("$@") k tries
  for k in "${!addr[@]}"; do
    for tries in $(seq 50); do
      ip netns exec "$(ns_of 0)" ssh "${addr[k]}" true 2>/dev/null && break
      [ "$tries" -lt 50 ] || {
        tail -n 20 "$SIM_DIR/sshd$k.log" >&2 || true
        die "ssh to host $k (${addr[k]}) does not work"
      }
      sleep 0.2
    done
  done
}

cmd_up() {
  local why subnet hosts addr=() k
  if why=$(leftovers); then
    echo "error: $why: taking it down; run the command again" >&2
    cmd_down
    exit 1
  fi
  if is_up; then
    load_hosts
    [ -z "${LLT_SIM_HOSTS:-}" ] || [ "$LLT_SIM_HOSTS" = "$SIM_HOSTS" ] ||
      die "a simulation of $SIM_HOSTS hosts is up in $SIM_DIR, not LLT_SIM_HOSTS=$LLT_SIM_HOSTS: run 'scripts/multinode_sim.sh down' first"
    log "already up (state in $SIM_DIR)"
    return
  fi
  hosts=$(host_count)
  why=$(cmd_check) || die "cannot simulate hosts here: $why"
  check_rate "${LLT_SIM_RATE:-}" "$BURST"
  claim_sim_dir
  [ -z "${LLT_SIM_OWNER:-}" ] || process_id "$LLT_SIM_OWNER" >"$SIM_DIR/owner"
  # from here on, a failure undoes what was done so far
  trap 'rc=$?; [ "$rc" = 0 ] || { log "up failed, tearing down (exit $rc)"; cmd_down; }; exit $rc' EXIT
  subnet=$(pick_subnet)
  for k in $(seq 1 "$hosts"); do addr+=("$subnet.$k"); done
  create_hosts "${addr[@]}"
  write_keys
  start_sshds "${addr[@]}"
  add_ssh_config_block "${addr[@]}"
  write_host_files "${addr[@]}"
  load_hosts
  apply_shape "${LLT_SIM_RATE:-}" "$BURST"
  wait_for_ssh "${addr[@]}"
  trap - EXIT
  log "up: $hosts hosts ${addr[*]} behind a switch, interface $IFNAME, links ${LLT_SIM_RATE:-unshaped}; state in $SIM_DIR"
}

# Undo `up`, however far it got. Ends only the processes inside our own namespaces.
cmd_down() {
  local ns pids=() k
  for ns in $(our_namespaces); do
    mapfile -t pids < <(ip netns pids "$ns")
    if [ ${#pids[@]} -gt 0 ]; then
      kill -TERM "${pids[@]}" 2>/dev/null || true
      for k in $(seq 25); do
        mapfile -t pids < <(ip netns pids "$ns")
        [ ${#pids[@]} -gt 0 ] || break
        sleep 0.2
      done
      [ ${#pids[@]} -eq 0 ] || kill -KILL "${pids[@]}" 2>/dev/null || true
    fi
    ip netns del "$ns" # its ends of the veth pairs go with it
  done
  if [ -f "$SSH_CONFIG" ] && grep -qxF "$MARK_BEGIN" "$SSH_CONFIG"; then
    sed "/^$MARK_BEGIN\$/,/^$MARK_END\$/d" "$SSH_CONFIG" >"$SSH_CONFIG.llt-$ID"
    cat "$SSH_CONFIG.llt-$ID" >"$SSH_CONFIG"
    rm -f "$SSH_CONFIG.llt-$ID"
  fi
  if [ -f "$SIM_DIR/created-ssh-config" ] && [ ! -s "$SSH_CONFIG" ]; then rm -f "$SSH_CONFIG"; fi
  if [ -f "$SIM_DIR/created-ssh-dir" ]; then rmdir "$SSH_HOME/.ssh" 2>/dev/null || true; fi
  if [ -f "$SIM_DIR/created-run-sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
  if [ -f "$SIM_DIR/.llama-train-sim" ]; then rm -rf "$SIM_DIR"; fi
  log "down: namespaces, sshds and ssh config block removed"
}

load_hosts() {
  # shellcheck disable=SC1091
  source "$SIM_DIR/hosts.env"
}

# Runs "$@" with the hosts up: brings them up (and down again on any exit) unless they already are.
with_hosts() {
  if is_up && ! leftovers >/dev/null; then
    load_hosts
    "$@"
    return
  fi
  trap 'rc=$?; cmd_down; exit $rc' EXIT
  LLT_SIM_OWNER=$$ cmd_up
  trap 'rc=$?; cmd_down; exit $rc' EXIT # cmd_up resets it on success
  load_hosts
  # in the background: bash runs a trap only once the foreground command is done, and a
  # Ctrl-C should tear down now (which ends the command too: it runs inside the hosts)
  "$@" &
  wait $!
}

check_hostfile() { # $1 = hostfile, rest: more validator flags
  local rc=0
  "$PY" "$ROOT/scripts/check_hostfile.py" "$@" >&2 || rc=$?
  [ "$rc" = 0 ] || {
    log "not launching: fix $1 first"
    exit "$rc"
  }
}

run_exec() {
  local k=$1
  shift
  [[ "$k" =~ ^[0-9]+$ ]] && [ "$k" -lt "$SIM_HOSTS" ] || die "exec: host must be 0 .. $((SIM_HOSTS - 1)), got $k"
  ip netns exec "$(ns_of "$k")" "$@"
}

cmd_shape() {
  [ $# -ge 1 ] || die "shape: give a rate (e.g. 500mbit, 2gbit) or off"
  is_up || die "shape: no simulation is up in $SIM_DIR (run 'scripts/multinode_sim.sh up' first)"
  load_hosts
  apply_shape "$1" "${2:-$BURST}"
  log "links: ${1/off/unshaped}"
}

# host K tx_bytes rx_bytes, one line per host: what its interface sent and received
cmd_counters() {
  is_up || die "counters: no simulation is up in $SIM_DIR"
  load_hosts
  local k stats
  for k in $(seq 0 $((SIM_HOSTS - 1))); do
    stats=$(ip netns exec "$(ns_of "$k")" cat "/sys/class/net/$IFNAME/statistics/tx_bytes" \
      "/sys/class/net/$IFNAME/statistics/rx_bytes")
    echo "$k" $stats
  done
}

# Is host $1's launcher started behind python -m llama_train.launch? (LLT_SIM_FRONT, checked in main)
front_on() {
  case "${LLT_SIM_FRONT:-0}" in
    1) [ "$1" = 0 ] ;;
    all) true ;;
    *) false ;;
  esac
}

check_front() {
  case "${LLT_SIM_FRONT:-0}" in
    0 | 1 | all) ;;
    *) die "LLT_SIM_FRONT=$LLT_SIM_FRONT: use 1 (a front before host 0's launcher) or all (a front per host)" ;;
  esac
}

run_deepspeed() {
  local hostfile=${LLT_SIM_HOSTFILE:-$SIM_HOSTFILE}
  check_hostfile "$hostfile" --resolve --deepspeed_env "$SIM_DS_ENV_FILE"
  cd "$ROOT" # the launcher starts the remote ranks in its own working directory
  # DS_ENV_FILE: the launcher reads this .deepspeed_env and exports it to the ranks on every host
  # LLT_SIM_FRONT: behind python -m llama_train.launch, as scripts/run_deepspeed.sh starts it
  local front=()
  ! front_on 0 || front=("$PY" -m llama_train.launch)
  ip netns exec "$SIM_NS0" env DS_ENV_FILE="$SIM_DS_ENV_FILE" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "${front[@]}" "$PY" -m deepspeed.launcher.runner --hostfile "$hostfile" "$@"
}

# --local_addr and --rdzv_conf is_host: torchrun finds out which node hosts the rendezvous store,
# and what address the others reach it by, from the machine's hostname. The simulated hosts all
# share this machine's hostname, which resolves to none of their addresses, so we say it.
run_torchrun() {
  cd "$ROOT"
  local k addr pids=() rc=0 front
  local -A host_of=() # a host's launcher (or front): its pid -> the host's index
  for k in $(seq 0 $((SIM_HOSTS - 1))); do
    addr="SIM_ADDR$k"
    front=()
    ! front_on "$k" || front=("$PY" -m llama_train.launch)
    ip netns exec "$(ns_of "$k")" env GLOO_SOCKET_IFNAME="$SIM_IFNAME" NCCL_SOCKET_IFNAME="$SIM_IFNAME" \
      OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
      "${front[@]}" "$PY" -m torch.distributed.run --nnodes "$SIM_HOSTS" --nproc_per_node 1 \
      --node_rank "$k" --rdzv_backend c10d --rdzv_endpoint "$SIM_RDZV_ENDPOINT" --rdzv_id "llt-$ID" \
      --local_addr "${!addr}" --rdzv_conf "is_host=$((k == 0))" \
      "$@" > >(sed -u "s/^/[host$k] /") 2>&1 &
    pids+=($!)
    host_of[$!]=$k
  done
  # the first host to fail takes the others down instead of leaving them waiting for their peer
  local done_pid pid left=("${pids[@]}") rest code
  while [ ${#left[@]} -gt 0 ]; do
    code=0
    wait -n -p done_pid "${left[@]}" || code=$?
    log "host ${done_pid:+${host_of[$done_pid]}} exited $code"
    if [ "$code" != 0 ]; then
      rc=$code
      log "a host failed (exit $rc): stopping the others"
      kill -TERM "${left[@]}" 2>/dev/null || true
      wait "${left[@]}" 2>/dev/null || true
      break
    fi
    rest=()
    for pid in "${left[@]}"; do [ "$pid" = "$done_pid" ] || rest+=("$pid"); done
    left=("${rest[@]}")
  done
  return "$rc"
}

run_demo() {
  local out=${DEMO_OUTPUT:-$ROOT/outputs/multinode_sim}
  local flags=(--preset debug --max_seq_len 64 --batch_size 4 --dtype float32 --max_steps 10
    --log_interval 1 --data_output_path "$ROOT/data_cache" --no_export)
  log "deepspeed --hostfile across the $SIM_HOSTS hosts (ZeRO-2) -> $out/deepspeed"
  run_deepspeed train_deepspeed.py --deepspeed_config ds_configs/zero2.json "${flags[@]}" \
    --output_dir "$out/deepspeed"
  log "torchrun --nnodes $SIM_HOSTS across the hosts -> $out/ddp"
  run_torchrun train_ddp.py "${flags[@]}" --output_dir "$out/ddp"
}

main() {
  # Ctrl-C and kill exit through the EXIT traps below, which tear down what was set up
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local cmd=${1:-}
  [ $# -eq 0 ] || shift
  case "$cmd" in
    install) cmd_install ;;
    check) cmd_check ;;
    up) cmd_up ;;
    down) cmd_down ;;
    env)
      is_up || die "no simulation is up in $SIM_DIR"
      cat "$SIM_DIR/hosts.env"
      ;;
    shape) cmd_shape "$@" ;;
    counters) cmd_counters ;;
    exec) with_hosts run_exec "$@" ;;
    deepspeed)
      check_front
      # a hostfile of your own is checked before anything is set up
      [ -z "${LLT_SIM_HOSTFILE:-}" ] || check_hostfile "$LLT_SIM_HOSTFILE"
      with_hosts run_deepspeed "$@"
      ;;
    torchrun)
      check_front
      with_hosts run_torchrun "$@"
      ;;
    demo)
      check_front
      with_hosts run_demo
      ;;
    *)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
      exit 2
      ;;
  esac
}

main "$@"
