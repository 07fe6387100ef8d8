#!/usr/bin/env bash
# Two simulated hosts on one machine, to test real multi-node launches without a cluster:
# `deepspeed --hostfile` over ssh + pdsh, and `torchrun --nnodes 2`. Needs root.
#
#   scripts/multinode_sim.sh install          apt-get install what is missing: openssh-server pdsh iproute2
#   scripts/multinode_sim.sh check            can this machine run it? exit 0, or 3 with the reason
#   scripts/multinode_sim.sh up               create the two hosts and leave them running
#   scripts/multinode_sim.sh down             undo everything `up` did (idempotent, also after a crash)
#   scripts/multinode_sim.sh env              the hosts as sourceable shell variables
#   scripts/multinode_sim.sh exec K CMD...    run CMD on host K (0 or 1)
#   scripts/multinode_sim.sh deepspeed ARGS...
#       check the hostfile, then on host 0: deepspeed --hostfile HOSTFILE ARGS...
#   scripts/multinode_sim.sh torchrun ARGS...
#       on each host K: torchrun --nnodes 2 --nproc_per_node 1 --node_rank K --rdzv_backend c10d
#       --rdzv_endpoint HOST0:29400 ARGS...
#   scripts/multinode_sim.sh demo             a 10-step ZeRO-2 run and a 10-step DDP run across the hosts
#
# `exec`, `deepspeed`, `torchrun` and `demo` bring the hosts up and tear them down around
# themselves unless they are up already (a trap tears down on failure and Ctrl-C too); run `up`
# first to share one setup between many runs, as tests/test_multinode.py does.
#
# A host is a network namespace (llt-ID-h0, llt-ID-h1) joined to the other by a veth pair whose
# ends are both named $LLT_SIM_IFNAME (simnet0), with one address each in a private 10.x.y.0/24
# that no route of this machine uses, and its own sshd listening only on that address. The
# filesystem is shared, so both hosts see this checkout and its .venv. Outside $LLT_SIM_DIR the
# script changes two things and `down` undoes both: a marked block at the top of the invoking
# user's ~/.ssh/config (the test addresses only: key, no host-key prompts), and /run/sshd (sshd's
# privilege-separation directory) when it did not exist. root's authorized_keys, ~/.deepspeed_env
# and ./.deepspeed_env are never touched: the sshds read their own authorized_keys and the
# launcher gets its environment file through DS_ENV_FILE.
#
# Environment: LLT_SIM_DIR (state, keys, logs; default /tmp/llama-train-multinode-sim),
# LLT_SIM_SUBNET (e.g. 10.213.41; default: a free one at random), LLT_SIM_IFNAME (simnet0),
# LLT_SIM_HOSTFILE (launch with this hostfile instead of the generated one), PY (.venv/bin/python),
# LLT_SIM_FRONT=1 (`deepspeed`, and host 0's `torchrun`, start behind python -m llama_train.launch).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SIM_DIR=$(realpath -m "${LLT_SIM_DIR:-/tmp/llama-train-multinode-sim}")
IFNAME=${LLT_SIM_IFNAME:-simnet0}
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
BIN=$(dirname "$(command -v "$PY")")
RDZV_PORT=29400 # each host has its own network stack: no port is taken there

ID=$(printf '%s' "$SIM_DIR" | sha1sum | cut -c1-6) # one simulation per state directory
NS=("llt-$ID-h0" "llt-$ID-h1")
MARK_BEGIN="# >>> llama-train multinode_sim $ID >>>"
MARK_END="# <<< llama-train multinode_sim $ID <<<"
SSH_HOME=$(getent passwd "$(id -u)" | cut -d: -f6) # ssh reads ~/.ssh from passwd, not from $HOME
SSH_CONFIG=$SSH_HOME/.ssh/config
PACKAGES=(sshd:openssh-server ssh:openssh-client ssh-keygen:openssh-client pdsh:pdsh ip:iproute2)

log() { echo "multinode_sim: $*" >&2; }
die() {
  log "$*"
  exit 1
}

find_cmd() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1"; }

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
  ip netns del "$probe"
  if [ -n "$err" ]; then
    echo "$err in a network namespace"
    return 3
  fi
}

is_up() { [ -f "$SIM_DIR/hosts.env" ] && ip netns list | grep -q "^${NS[0]}\b"; }

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

ssh_config_block() {
  cat <<EOF
$MARK_BEGIN
# the simulated hosts of $ROOT/scripts/multinode_sim.sh; \`multinode_sim.sh down\` removes this block
Host $1 $2
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

# Two namespaces joined by a veth pair, both ends named $IFNAME; $1, $2 = the hosts' addresses.
create_hosts() {
  local addr=("$@") k
  ip netns add "${NS[0]}"
  ip netns add "${NS[1]}"
  ip link add "llt${ID}a" netns "${NS[0]}" type veth peer name "llt${ID}b" netns "${NS[1]}"
  ip -n "${NS[0]}" link set "llt${ID}a" name "$IFNAME"
  ip -n "${NS[1]}" link set "llt${ID}b" name "$IFNAME"
  for k in 0 1; do
    ip -n "${NS[k]}" link set lo up
    ip -n "${NS[k]}" addr add "${addr[k]}/24" dev "$IFNAME"
    ip -n "${NS[k]}" link set "$IFNAME" up
  done
}

write_keys() {
  ssh-keygen -q -t ed25519 -N '' -C "llama-train multinode_sim client" -f "$SIM_DIR/client_key"
  ssh-keygen -q -t ed25519 -N '' -C "llama-train multinode_sim host" -f "$SIM_DIR/host_key"
  cp "$SIM_DIR/client_key.pub" "$SIM_DIR/authorized_keys"
}

# One sshd per host, inside its namespace, listening on its address only; $1, $2 = addresses.
start_sshds() {
  local addr=("$@") k
  if [ ! -d /run/sshd ]; then
    mkdir -m 0755 /run/sshd
    touch "$SIM_DIR/created-run-sshd"
  fi
  for k in 0 1; do
    sshd_config "${addr[k]}" "$k" >"$SIM_DIR/sshd$k.conf"
    ip netns exec "${NS[k]}" "$(find_cmd sshd)" -f "$SIM_DIR/sshd$k.conf" -E "$SIM_DIR/sshd$k.log"
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

# The hostfile, the ranks' .deepspeed_env and hosts.env (what `env` prints); $1, $2 = addresses.
write_host_files() {
  cat >"$SIM_DIR/hostfile" <<EOF
# two simulated hosts (scripts/multinode_sim.sh), one rank each
$1 slots=1
$2 slots=1
EOF
  # What the launcher exports to every rank on every host (.deepspeed_env format: KEY=VALUE
  # lines, nothing else). Without the interface names gloo and NCCL pick an address by the
  # machine's hostname, which is not reachable from the other host. Without PATH a rank gets
  # sshd's default PATH: the launcher runs its own python by absolute path, but DeepSpeed's JIT
  # ops build with whatever `ninja` PATH finds, and a different ninja than the local runs use
  # rebuilds the op in the shared ~/.cache/torch_extensions (~40 s) every time the two alternate.
  cat >"$SIM_DIR/deepspeed_env" <<EOF
GLOO_SOCKET_IFNAME=$IFNAME
NCCL_SOCKET_IFNAME=$IFNAME
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PATH=$PATH
EOF
  cat >"$SIM_DIR/hosts.env" <<EOF
SIM_DIR=$SIM_DIR
SIM_NS0=${NS[0]}
SIM_NS1=${NS[1]}
SIM_ADDR0=$1
SIM_ADDR1=$2
SIM_IFNAME=$IFNAME
SIM_HOSTFILE=$SIM_DIR/hostfile
SIM_DS_ENV_FILE=$SIM_DIR/deepspeed_env
SIM_RDZV_ENDPOINT=$1:$RDZV_PORT
EOF
}

# The DeepSpeed launcher's own first check, from the host it runs on: ssh to each host works.
wait_for_ssh() {
  local addr=("$@") k tries
  for k in 0 1; do
    for tries in $(seq 50); do
      ip netns exec "${NS[0]}" ssh "${addr[k]}" true 2>/dev/null && break
      [ "$tries" -lt 50 ] || {
        tail -n 20 "$SIM_DIR/sshd$k.log" >&2 || true
        die "ssh to host $k (${addr[k]}) does not work"
      }
      sleep 0.2
    done
  done
}

cmd_up() {
  if is_up; then
    log "already up (state in $SIM_DIR)"
    return
  fi
  local why subnet addr=()
  why=$(cmd_check) || die "cannot simulate hosts here: $why"
  claim_sim_dir
  # from here on, a failure undoes what was done so far
  trap 'rc=$?; [ "$rc" = 0 ] || { log "up failed, tearing down"; cmd_down; }; exit $rc' EXIT
  subnet=$(pick_subnet)
  addr=("$subnet.1" "$subnet.2")
  create_hosts "${addr[@]}"
  write_keys
  start_sshds "${addr[@]}"
  add_ssh_config_block "${addr[@]}"
  write_host_files "${addr[@]}"
  wait_for_ssh "${addr[@]}"
  trap - EXIT
  log "up: host0 ${addr[0]} (${NS[0]}), host1 ${addr[1]} (${NS[1]}), interface $IFNAME; state in $SIM_DIR"
}

# Undo `up`, however far it got. Ends only the processes inside our own namespaces.
cmd_down() {
  local ns pids=() k
  for ns in "${NS[@]}"; do
    ip netns list | grep -q "^$ns\b" || continue
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
    ip netns del "$ns" # its end of the veth pair goes with it
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
  if is_up; then
    load_hosts
    "$@"
    return
  fi
  trap 'rc=$?; cmd_down; exit $rc' EXIT
  cmd_up
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
  [[ "$k" == 0 || "$k" == 1 ]] || die "exec: host must be 0 or 1, got $k"
  ip netns exec "${NS[k]}" "$@"
}

run_deepspeed() {
  local hostfile=${LLT_SIM_HOSTFILE:-$SIM_HOSTFILE}
  check_hostfile "$hostfile" --resolve --deepspeed_env "$SIM_DS_ENV_FILE"
  cd "$ROOT" # the launcher starts the remote ranks in its own working directory
  # DS_ENV_FILE: the launcher reads this .deepspeed_env and exports it to the ranks on every host
  # LLT_SIM_FRONT=1: behind python -m llama_train.launch, as scripts/run_deepspeed.sh starts it
  local front=()
  [ "${LLT_SIM_FRONT:-0}" = 0 ] || front=("$PY" -m llama_train.launch)
  ip netns exec "$SIM_NS0" env DS_ENV_FILE="$SIM_DS_ENV_FILE" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "${front[@]}" "$BIN/deepspeed" --hostfile "$hostfile" "$@"
}

# --local_addr and --rdzv_conf is_host: torchrun finds out which node hosts the rendezvous store,
# and what address the others reach it by, from the machine's hostname. Both simulated hosts
# share this machine's hostname, which resolves to neither of their addresses, so we say it.
run_torchrun() {
  cd "$ROOT"
  local k addr pids=() rc=0 front
  for k in 0 1; do
    addr="SIM_ADDR$k"
    front=()
    [ "${LLT_SIM_FRONT:-0}" = 0 ] || [ "$k" != 0 ] || front=("$PY" -m llama_train.launch)
    ip netns exec "${NS[k]}" env GLOO_SOCKET_IFNAME="$SIM_IFNAME" NCCL_SOCKET_IFNAME="$SIM_IFNAME" \
      OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
      "${front[@]}" "$BIN/torchrun" --nnodes 2 --nproc_per_node 1 --node_rank "$k" --rdzv_backend c10d \
      --rdzv_endpoint "$SIM_RDZV_ENDPOINT" --rdzv_id "llt-$ID" --local_addr "${!addr}" \
      --rdzv_conf "is_host=$((k == 0))" \
      "$@" > >(sed -u "s/^/[host$k] /") 2>&1 &
    pids+=($!)
  done
  # the first host to fail takes the other down instead of leaving it waiting for its peer
  local done_pid pid left=("${pids[@]}") rest
  while [ ${#left[@]} -gt 0 ]; do
    wait -n -p done_pid "${left[@]}" || {
      rc=$?
      log "a host failed (exit $rc): stopping the other"
      kill -TERM "${left[@]}" 2>/dev/null || true
      wait "${left[@]}" 2>/dev/null || true
      break
    }
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
  log "deepspeed --hostfile across the two hosts (ZeRO-2) -> $out/deepspeed"
  run_deepspeed train_deepspeed.py --deepspeed_config ds_configs/zero2.json "${flags[@]}" \
    --output_dir "$out/deepspeed"
  log "torchrun --nnodes 2 across the two hosts -> $out/ddp"
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
      is_up || die "not up"
      cat "$SIM_DIR/hosts.env"
      ;;
    exec) with_hosts run_exec "$@" ;;
    deepspeed)
      # a hostfile of your own is checked before anything is set up
      [ -z "${LLT_SIM_HOSTFILE:-}" ] || check_hostfile "$LLT_SIM_HOSTFILE"
      with_hosts run_deepspeed "$@"
      ;;
    torchrun) with_hosts run_torchrun "$@" ;;
    demo) with_hosts run_demo ;;
    *)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
      exit 2
      ;;
  esac
}

main "$@"
