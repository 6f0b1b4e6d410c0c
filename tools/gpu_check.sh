#!/usr/bin/env bash
# The GPU paths of docs/scaling.md, run once on a machine with one CUDA GPU, from the repository
# root, with no install step: PYTHONPATH=src, built-in tiny models (no download) and a small JSONL
# file (the GPU image may lack reasoning-gym and the SmolLM2 package). Each check prints PASS/FAIL
# and the log of every command goes to $LOG_DIR (default: $OUT, else ./gpu-check). Checks: training
# in fp32 and bf16, recompute at eta 2, LoRA, the retry and guess environments, resume from a
# checkpoint, trainer and rollout on different devices, data parallelism (or its refusal on one GPU),
# `bench step` and `bench rollout` on the device, and last a timed pair of real runs, recompute
# against loglinear on tiny-2048x16 (about 600M parameters) in bf16, whose record (proximal share of
# the step, step time, tokens/s, the GPU named) is written to $RECORD by a3po/bench/timed_pair.py.
#   bash tools/gpu_check.sh
# Knobs, for a smaller run or the CPU path that tests/test_gpu_check.py takes:
#   DEVICE=cuda                     where every check computes (cpu: no GPU checks, nvidia-smi not asked)
#   ONLY="name ..."                 run only these checks (default: all)
#   PAIR_MODEL=tiny-2048x16 PAIR_STEPS=10 PAIR_DTYPE=bfloat16   the timed pair (PAIR_ARGS: more key=value)
#   RECORD=docs/results/gpu-check/timed-pair.json                 its record (a copy also goes to $LOG_DIR)
#   LIMIT=150                       seconds per check
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG_DIR="${LOG_DIR:-${OUT:-gpu-check}}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
WORK=$(mktemp -d)
FAILED=0
LIMIT="${LIMIT:-150}"  # seconds per check
DEVICE="${DEVICE:-cuda}"
ONLY="${ONLY:-}"
PAIR_MODEL="${PAIR_MODEL:-tiny-2048x16}" PAIR_STEPS="${PAIR_STEPS:-10}" PAIR_DTYPE="${PAIR_DTYPE:-bfloat16}"
PAIR_ARGS="${PAIR_ARGS:-}"  # more key=value overrides for both runs of the pair (split on spaces)
RECORD="${RECORD:-docs/results/gpu-check/timed-pair.json}"

wanted() {  # wanted NAME: is NAME among $ONLY (or is $ONLY empty)?
  [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]
}

check() {  # check NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local t0=$SECONDS
  if timeout -k 10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name (exit $?, $((SECONDS - t0)) s); last lines:"; tail -n 15 "$LOG_DIR/$name.log" | sed 's/^/    /'
    FAILED=$((FAILED + 1))
    return 1
  fi
}

refused() {  # refused NAME PATTERN COMMAND...: must exit 2 at once with a one-line error matching PATTERN
  local name=$1 pattern=$2; shift 2
  wanted "$name" || return 0
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
if [ "$DEVICE" != cpu ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"

D=(actor.device="$DEVICE" rollout.device="$DEVICE")
DATA=(train_dataset.task=file "train_dataset.path=$WORK/sums.jsonl" train_dataset.reward=exact "fileroot=$WORK/runs")
TINY=(--preset tiny logging.tensorboard=false "${D[@]}")
check resolve 60 "$PY" -m a3po.cli config --preset tiny actor.device=auto rollout.device=auto actor.dtype=auto rollout.dtype=auto "${DATA[@]}"
check "train-$DEVICE-fp32" "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" experiment_name=fp32 "${DATA[@]}"
check "train-$DEVICE-bf16" "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" actor.dtype=auto rollout.dtype=auto experiment_name=bf16 "${DATA[@]}"
check "train-$DEVICE-recompute-eta2" "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" actor.prox_logp_method=recompute rollout.max_head_offpolicyness=2 rollout.n_workers=2 experiment_name=rc "${DATA[@]}"
check "lora-$DEVICE" "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" actor.lora.rank=8 experiment_name=lora "${DATA[@]}"
check "env-retry-$DEVICE" "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" train_dataset.env=retry train_dataset.max_turns=2 experiment_name=retry "${DATA[@]}"
check "env-guess-$DEVICE" "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" train_dataset.env=guess train_dataset.max_turns=3 experiment_name=guess "${DATA[@]}"
# resume the fp32 run from its last checkpoint (step 6) for three more steps: each training step 1..9 logged once
check "resume-$DEVICE" "$LIMIT" "$PY" -m a3po.cli train --resume "$WORK/runs/fp32" total_train_steps=9
check "resume-$DEVICE-continued" 30 "$PY" -c "import json, sys; rows = map(json.loads, open(sys.argv[1])); sys.exit([r['step'] for r in rows if 'stale/max' in r] != list(range(1, 10)))" "$WORK/runs/fp32/metrics.jsonl"
if [ "$DEVICE" != cpu ]; then
  check trainer-gpu-rollout-cpu "$LIMIT" "$PY" -m a3po.cli train --preset tiny actor.device="$DEVICE" rollout.device=cpu experiment_name=split "${DATA[@]}"
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if [ "$GPUS" -ge 2 ]; then
    check two-ranks-nccl "$LIMIT" "$PY" -m a3po.cli train "${TINY[@]}" cluster.n_trainer_ranks=2 experiment_name=dp2 "${DATA[@]}"
  else
    refused two-ranks-one-gpu "torch sees $GPUS" "$PY" -m a3po.cli train "${TINY[@]}" cluster.n_trainer_ranks=2 experiment_name=dp2 "${DATA[@]}"
  fi
fi
check "bench-step-$DEVICE" "$LIMIT" "$PY" -m a3po.cli bench step --device "$DEVICE" --model tiny-256x4 --batch 8 --repeats 2 --out "$WORK/bench-step"
check "bench-rollout-$DEVICE" "$LIMIT" "$PY" -m a3po.cli bench rollout --device "$DEVICE" --model tiny-256x4 --batch 8 --max-new-tokens 16 --repeats 2 --out "$WORK/bench-rollout"

# The timed pair: one run per method on the same configuration, one after the other, alone on the device.
PAIR=(--preset tiny logging.tensorboard=false "${D[@]}" "actor.path=$PAIR_MODEL" "actor.dtype=$PAIR_DTYPE"
      "rollout.dtype=$PAIR_DTYPE" actor.optimizer.lr=1e-5 "total_train_steps=$PAIR_STEPS" evaluator.freq_steps=0
      evaluator.initial=false saver.freq_steps=0 train_dataset.batch_size=8 gconfig.n_samples=8
      gconfig.max_new_tokens=64 "${DATA[@]}" $PAIR_ARGS)
check pair-recompute 240 "$PY" -m a3po.cli train "${PAIR[@]}" actor.prox_logp_method=recompute experiment_name=pair-recompute
check pair-loglinear 240 "$PY" -m a3po.cli train "${PAIR[@]}" actor.prox_logp_method=loglinear experiment_name=pair-loglinear
if wanted pair-record && check pair-record 120 "$PY" -m a3po.bench.timed_pair "$WORK/runs/pair-recompute" "$WORK/runs/pair-loglinear" --out "$RECORD"; then
  cat "$LOG_DIR/pair-record.log"
  cp "$RECORD" "$LOG_DIR/timed-pair.json" 2>/dev/null
fi
echo "$FAILED check(s) failed"
rm -rf "$WORK"
exit "$FAILED"
