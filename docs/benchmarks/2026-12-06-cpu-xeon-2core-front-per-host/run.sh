#!/usr/bin/env bash
# One run of the multi-host stop with a front per host, on the simulated hosts that are up in
# $LLT_SIM_DIR (scripts/multinode_sim.sh up): `torchrun --nnodes 2` with each host's torchrun behind
# its own front (LLT_SIM_FRONT=all) on one shared --output_dir, one SIGTERM to host 0's front once
# step 3 is logged; then the same command with `--resume auto` and two steps more. Writes
# runK.log and runK-resume.log beside this script and prints the run's row of results.md.
#
#   bash docs/benchmarks/2026-12-06-cpu-xeon-2core-front-per-host/run.sh K [WORK]
#
# WORK (default /tmp/llt-front-per-host) holds the corpus, its token cache and each run's --output_dir.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
K=${1:?usage: run.sh K [WORK]}
WORK=${2:-/tmp/llt-front-per-host}
PY=$ROOT/.venv/bin/python
OUT=$WORK/run$K
LOG=$HERE/run$K.log
STEPS=400
export LLT_SIM_FRONT=all OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions} # as the tests build them

mkdir -p "$WORK"
rm -rf "$OUT"
[ -s "$WORK/corpus.jsonl" ] || "$PY" -c '
import json, sys
from pydoc_data.topics import topics
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics))
' "$WORK/corpus.jsonl"
FLAGS=(--preset debug --max_seq_len 32 --batch_size 4 --learning_rate 3e-3 --warmup_steps 5
  --log_interval 1 --eval_batches 4 --dtype float32 --no_export --data_path "$WORK/corpus.jsonl"
  --data_output_path "$WORK" --output_dir "$OUT")
sim() { bash "$ROOT/scripts/multinode_sim.sh" torchrun train_ddp.py "${FLAGS[@]}" "$@"; }

last_step() { grep -oE "step +[0-9]+/$1" "$2" | tail -n 1 | grep -oE '[0-9]+' | head -n 1; }

# the stop: one SIGTERM to host 0's front once step 3 is logged
sim --max_steps "$STEPS" >"$LOG" 2>&1 &
run=$!
until grep -qE "step +3/$STEPS" "$LOG"; do
  kill -0 "$run" 2>/dev/null || { echo "run $K: ended before step 3 (see $LOG)" >&2; exit 1; }
  sleep 0.2
done
front=$(pgrep -f "llama_train.launch .*--node_rank 0 .*$OUT " | head -n 1)
kill -TERM "$front"
rc=0
wait "$run" || rc=$?
# the step logged last before host 0's front said it was signalled
signalled=$(sed -n "/llama_train.launch\] SIGTERM/q; s|.* step *\([0-9]*\)/$STEPS .*|\1|p" "$LOG" | tail -n 1)
code() { grep -oE "multinode_sim: host $1 exited [0-9]+" "$LOG" | grep -oE '[0-9]+$' || echo "-"; }
saved=$(sed 's/step_0*//' "$OUT/checkpoints/latest" 2>/dev/null || echo "-")
for _ in $(seq 60); do # up to 60 s for every process of the run to be gone, on either host
  pgrep -f "$OUT" >/dev/null || break
  sleep 1
done
left=$(pgrep -fc "$OUT" || true)
source <(bash "$ROOT/scripts/multinode_sim.sh" env)
for ns in "$SIM_NS0" "$SIM_NS1"; do # what runs in a host's namespace but its sshd
  left=$((left + $(ip netns pids "$ns" | grep -vcxF "$(cat "$SIM_DIR/sshd${ns##*-h}.pid")" || true)))
done
stop_left=$([ -e "$OUT/llama_train.stop" ] && echo "stop file left" || echo "")

# the same command, resumed, two steps more
more=$((${saved/-/0} + 2))
resume_rc=0
sim --max_steps "$more" --resume auto >"$HERE/run$K-resume.log" 2>&1 || resume_rc=$?
resumed=$(grep -oE "resumed from .* at step [0-9]+" "$HERE/run$K-resume.log" | grep -oE '[0-9]+$' || echo "-")
reached=$(last_step "$more" "$HERE/run$K-resume.log")
tracebacks=$(cat "$LOG" "$HERE/run$K-resume.log" | grep -c Traceback || true)

echo "| $K | $rc | $(code 0) | $(code 1) | $signalled | $saved | $left ${stop_left} | $resume_rc | $resumed | ${reached:--} | $tracebacks |"
