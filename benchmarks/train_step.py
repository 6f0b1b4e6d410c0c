"""Benchmark: one training step (`TrainEngine.ppo_update`) with each way of getting the proximal log-probs.

    python benchmarks/train_step.py [--model smollm2-135m-instruct] [--dtype auto|bfloat16|float32] [--batch 8]
        [--prompt-len 40] [--output-len 64] [--minibatches 1,4] [--repeats 3] [--warmup 1] [--threads N]

Arms, at each `actor.ppo_n_minibatches` in --minibatches:
  - recompute: an extra no-grad forward pass of the whole batch before the update (the pass A-3PO removes);
  - loglinear: A-3PO's interpolation, no extra pass;
  - reuse:     p = sg(theta), no extra pass; only at 1 minibatch (the config refuses reuse with more).
Every timed step is the first step of a fresh `TrainEngine` on a deep copy of the same
initial weights, on the same fixed batch: `--batch` sequences of `--prompt-len` random
prompt tokens and `--output-len` random output tokens, whose behaviour log-probs are the
model's own (`compute_logp`, version 0: the step is on-policy) and whose advantages are
fixed random numbers. So every arm also pays AdamW's state allocation once per step, the
same in all arms. Arms alternate inside each repeat, after `--warmup` untimed warm-up steps
each on the first row only (cheap; it warms the kernels and allocator of that code path).
Only one engine lives at a time (model, gradients and AdamW state: ~2 GB for SmolLM2).

`--dtype auto` resolves as actor.dtype=auto does (`resolve_dtype`): bfloat16 where the hardware
computes it natively (AVX512-BF16 or AMX, as on the machine of DESIGN §6), else float32: on an
AVX2-only CPU, torch's bf16 matmuls are several times slower than fp32 (11x on a whole step).

Reported per arm: wall time of `ppo_update` (median, min..max), the time spent in the
proximal log-prob forward pass (`perf/prox_logp_s` from the step's stats) and its share of
the step, the minibatch phase (`perf/train_s`), and the step-time speedup of loglinear and
reuse over recompute at the same minibatch count. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import summary  # noqa: E402

from a3po.config import load_config  # noqa: E402
from a3po.models import load_policy  # noqa: E402
from a3po.train.engine import TrainEngine, resolve_dtype  # noqa: E402
from a3po.trajectories import Trajectory, collate  # noqa: E402


def fixed_batch(model, vocab: int, engine: TrainEngine, n: int, prompt_len: int, output_len: int, seed: int = 0):
    """Random-token trajectories whose behaviour log-probs are the model's own (on-policy at version 0)."""
    g = torch.Generator().manual_seed(seed)
    trajs = [Trajectory(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                        output_ids=torch.randint(0, vocab, (output_len,), generator=g).tolist(),
                        output_logprobs=[0.0] * output_len, output_versions=[0] * output_len, group_id=i)
             for i in range(n)]
    adv = torch.randn(n, generator=g)  # (B,)
    batch = collate(trajs, advantages=adv)
    batch.logp_behav = engine.compute_logp(batch, model)  # (B, T), 0 outside the outputs
    return batch


def arms_for(minibatches: list[int]) -> list[tuple[str, int]]:
    out = []
    for m in minibatches:
        out += [("recompute", m), ("loglinear", m)] + ([("reuse", m)] if m == 1 else [])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="actor.path (tiny-256x4 for a quick run)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="actor.dtype; auto = bfloat16 where the hardware computes it natively, else float32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--minibatches", default="1,4", help="comma-separated actor.ppo_n_minibatches values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed one-row steps per arm before the timed ones")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.dtype = resolve_dtype(args.dtype)  # shown resolved in the table
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    if load_start > 0.5:
        print(f"warning: load average {load_start:.1f} at start: other processes may share the cores and timings "
              f"may be noisy (with --threads {args.threads})", file=sys.stderr)

    base, tok = load_policy(args.model, dtype=torch.float32, seed=0)
    arms = arms_for([int(m) for m in args.minibatches.split(",")])
    actors = {(method, m): load_config(None, [f"actor.prox_logp_method={method}", f"actor.ppo_n_minibatches={m}",
                                              f"actor.dtype={args.dtype}"]).actor for method, m in arms}

    def fresh_engine(arm) -> TrainEngine:
        """A new engine on a copy of the initial weights: every timed step starts from the same state."""
        return TrainEngine(copy.deepcopy(base), actors[arm], total_optimizer_steps=arm[1])

    t0 = time.perf_counter()
    batch = fixed_batch(base, len(tok), fresh_engine(arms[0]), args.batch, args.prompt_len, args.output_len)
    print(f"batch {tuple(batch.input_ids.shape)}, behaviour log-probs in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)

    step_s: dict = {a: [] for a in arms}
    prox_s: dict = {a: [] for a in arms}
    train_s: dict = {a: [] for a in arms}
    warm = batch.select([0])
    for rep in range(-args.warmup, args.repeats):
        for arm in arms:
            engine = fresh_engine(arm)
            t0 = time.perf_counter()
            stats = engine.ppo_update(warm if rep < 0 else batch)
            dt = time.perf_counter() - t0
            del engine
            tag = "warm-up (1 row)" if rep < 0 else f"repeat {rep + 1}/{args.repeats}"
            print(f"  {arm[0]:<10} mb={arm[1]} {tag}: step {dt:.2f} s, prox {stats['perf/prox_logp_s']:.2f} s",
                  file=sys.stderr, flush=True)
            if rep >= 0:
                step_s[arm].append(dt)
                prox_s[arm].append(stats["perf/prox_logp_s"])
                train_s[arm].append(stats["perf/train_s"])

    res = {}
    for arm in arms:
        s = summary(step_s[arm])
        base_s = statistics.median(step_s[("recompute", arm[1])])
        res[arm] = {**s, "prox_s": statistics.median(prox_s[arm]), "train_s": statistics.median(train_s[arm]),
                    "prox_share": statistics.median(p / t for p, t in zip(prox_s[arm], step_s[arm])),
                    "speedup": base_s / s["median_s"]}

    n_params = sum(p.numel() for p in base.parameters())
    B, T = batch.input_ids.shape
    print(f"ppo_update on {B} x {T} tokens ({args.prompt_len} prompt + {args.output_len} output); model '{args.model}' "
          f"({n_params / 1e6:.1f}M params), actor.dtype={args.dtype}, {args.threads} thread(s), "
          f"{args.repeats} repeats after {args.warmup} warm-up, torch {torch.__version__}")
    print(f"{'prox method':<12}{'minibatches':>12}{'step median':>13}{'min..max':>16}{'prox logp':>11}{'share':>8}"
          f"{'train':>9}{'recompute / this':>18}")
    for (method, m), r in res.items():
        spread = f"{r['min_s']:.2f}..{r['max_s']:.2f}s"
        print(f"{method:<12}{m:>12}{r['median_s']:>12.2f}s{spread:>16}{r['prox_s']:>10.2f}s{r['prox_share']:>8.0%}"
              f"{r['train_s']:>8.2f}s{r['speedup']:>17.2f}x")
    print("step = wall time of ppo_update; prox logp = perf/prox_logp_s (the extra forward pass); "
          "train = perf/train_s (minibatch forward/backward and optimizer steps)")
    print(f"load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    record = {
        "benchmark": "train_step", "model": args.model, "params": n_params, "dtype": args.dtype,
        "batch": B, "seq": T, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "arms": [{"method": method, "minibatches": m, "step_median_s": round(r["median_s"], 4),
                  "step_min_s": round(r["min_s"], 4), "step_max_s": round(r["max_s"], 4),
                  "prox_logp_s": round(r["prox_s"], 4), "prox_share": round(r["prox_share"], 4),
                  "train_s": round(r["train_s"], 4),
                  "speedup_vs_recompute": round(r["speedup"], 4)} for (method, m), r in res.items()],
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
