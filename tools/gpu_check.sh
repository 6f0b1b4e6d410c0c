#!/usr/bin/env bash
# The GPU paths of docs/scaling.md, run once on a machine with one CUDA GPU, from the repository
# root, with no install step: PYTHONPATH=src, the tiny built-in model and a small JSONL file
# (the GPU image may lack reasoning-gym and the SmolLM2 package). Each check prints PASS/FAIL
# and the log of every command goes to $LOG_DIR (default: ./gpu-check).
#   bash tools/gpu_check.sh
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG_DIR="${LOG_DIR:-${OUT:-gpu-check}}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
WORK=$(mktemp -d)
FAILED=0
LIMIT="${LIMIT:-150}"  # seconds per check

check() {  # check NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if timeout -k 10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name (exit $?, $((SECONDS - t0)) s); last lines:"; tail -n 15 "$LOG_DIR/$name.log" | sed 's/^/    /'
    FAILED=$((FAILED + 1))
  fi
}

refused() {  # refused NAME PATTERN COMMAND...: must exit 2 at once with a one-line error matching PATTERN
  local name=$1 pattern=$2; shift 2
  timeout -k 10 60 "$@" >"$LOG_DIR/$name.log" 2>&1
  local code=$?
  if [ "$code" = 2 ] && grep -q -- "$pattern" "$LOG_DIR/$name.log"; then
    echo "PASS $name (refused: $(tail -n 1 "$LOG_DIR/$name.log"))"
  else
    echo "FAIL $name (exit $code, expected 2 and '$pattern')"; tail -n 5 "$LOG_DIR/$name.log" | sed 's/^/    /'
    FAILED=$((FAILED + 1))
  fi
}

"$PY" - "$WORK/sums.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(400):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        f.write(json.dumps({"question": f"{a} + {b} = ?", "answer": str(a + b)}) + "\n")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

DATA=(train_dataset.task=file "train_dataset.path=$WORK/sums.jsonl" train_dataset.reward=exact "fileroot=$WORK/runs")
check resolve 60 "$PY" -m a3po.cli config --preset tiny actor.device=auto rollout.device=auto actor.dtype=auto rollout.dtype=auto "${DATA[@]}"
check train-cuda-fp32 "$LIMIT" "$PY" -m a3po.cli train --preset tiny actor.device=cuda rollout.device=cuda experiment_name=fp32 "${DATA[@]}"
check train-cuda-bf16 "$LIMIT" "$PY" -m a3po.cli train --preset tiny actor.device=cuda rollout.device=cuda actor.dtype=auto rollout.dtype=auto experiment_name=bf16 "${DATA[@]}"
check train-cuda-recompute-eta2 "$LIMIT" "$PY" -m a3po.cli train --preset tiny actor.device=cuda rollout.device=cuda actor.prox_logp_method=recompute rollout.max_head_offpolicyness=2 rollout.n_workers=2 experiment_name=rc "${DATA[@]}"
check resume-cuda "$LIMIT" "$PY" -m a3po.cli train --resume "$WORK/runs/fp32" total_train_steps=9
check trainer-gpu-rollout-cpu "$LIMIT" "$PY" -m a3po.cli train --preset tiny actor.device=cuda rollout.device=cpu experiment_name=split "${DATA[@]}"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  check two-ranks-nccl "$LIMIT" "$PY" -m a3po.cli train --preset tiny actor.device=cuda rollout.device=cuda cluster.n_trainer_ranks=2 experiment_name=dp2 "${DATA[@]}"
else
  refused two-ranks-one-gpu "torch sees $GPUS" "$PY" -m a3po.cli train --preset tiny actor.device=cuda rollout.device=cuda cluster.n_trainer_ranks=2 experiment_name=dp2 "${DATA[@]}"
fi
check bench-step-cuda "$LIMIT" "$PY" -m a3po.cli bench step --model tiny-256x4 --batch 8 --repeats 2 --out "$WORK/bench-step"
echo "$FAILED check(s) failed"
rm -rf "$WORK"
exit "$FAILED"
