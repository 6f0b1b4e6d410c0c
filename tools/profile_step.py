"""Where one `a3po bench step` training pass spends its time, by kind of operator (torch.profiler).

    PYTHONPATH=src python tools/profile_step.py [--threads 1] [--minibatches 1] [--model smollm2-135m-instruct]

One warm-up step, then one profiled `ppo_update` (loglinear, so no proximal forward pass) of a fresh engine
on the benchmark's fixed batch. Each operator's own time (its children excluded) is put in one row; the
rest of the wall time, which no operator accounts for, is Python and autograd bookkeeping. The head
(chunked log-softmax, trainer/logprobs.py) and AdamW are also given whole, children included.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import a3po.trainer.logprobs as logprobs
from a3po.bench.args import StepBenchArgs
from a3po.bench.step import fixed_batch
from a3po.config import load_config
from a3po.models import load_policy
from a3po.trainer.engine import TrainEngine

KINDS = {  # operator -> row; anything else under aten:: is elementwise or a reduction
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "fused attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                        "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "(log-)softmax": ("aten::_log_softmax", "aten::_softmax", "aten::_softmax_backward_data",
                      "aten::_log_softmax_backward_data"),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous"),
    "fills and allocation": ("aten::zero_", "aten::fill_", "aten::zeros", "aten::empty", "aten::empty_strided",
                             "aten::zeros_like", "aten::empty_like", "aten::ones_like", "aten::new_zeros"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base, tok = load_policy(a.model, dtype=torch.float32, seed=0)
    actor = load_config(None, ["actor.prox_logp_method=loglinear", f"actor.ppo_n_minibatches={a.minibatches}",
                               f"actor.dtype={a.dtype}"]).actor
    args = StepBenchArgs()

    def engine() -> TrainEngine:
        e = TrainEngine(copy.deepcopy(base), actor, total_optimizer_steps=a.minibatches)
        e.version = args.eta
        return e

    batch = fixed_batch(len(tok), engine(), args)
    engine().ppo_update(batch)  # warm-up
    plain = logprobs.token_logp_entropy

    def head(*xs, **kw):
        with record_function("head forward"):
            return plain(*xs, **kw)

    logprobs.token_logp_entropy = head  # only inside this script: names the head's forward in the profile
    e = engine()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        e.ppo_update(batch)
        wall = time.perf_counter() - t0
    own = {k.key: k.self_cpu_time_total / 1e6 for k in prof.key_averages()}
    whole = {k.key: k.cpu_time_total / 1e6 for k in prof.key_averages()}
    rows = {kind: sum(own.get(op, 0.0) for op in ops) for kind, ops in KINDS.items()}
    named = {op for ops in KINDS.values() for op in ops}
    rows["other operators (elementwise, reductions)"] = sum(s for op, s in own.items()
                                                            if op.startswith("aten::") and op not in named)
    rows["Python and autograd (not in any operator)"] = wall - sum(s for op, s in own.items()
                                                                   if op.startswith("aten::"))
    print(f"one ppo_update, {a.model}, {tuple(batch.input_ids.shape)}, {a.dtype}, {a.threads} thread(s), "
          f"{a.minibatches} minibatch(es): {wall:.2f} s under the profiler\n")
    print("| where | s | share |\n|---|---:|---:|")
    for kind, s in rows.items():
        print(f"| {kind} | {s:.2f} | {s / wall:.0%} |")
    for name, key in (("head forward (children included)", "head forward"),
                      ("head backward (children included)", "_TokenLogpEntropyBackward"),
                      ("AdamW step (children included)", "Optimizer.step#AdamW.step")):
        s = whole.get(key, 0.0)
        print(f"| {name} | {s:.2f} | {s / wall:.0%} |")
    print("\ntop operators by own time:")
    for k in sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:15]:
        print(f"  {k.key:<55} {k.self_cpu_time_total / 1e6:6.2f} s  {k.count:6d} calls")


if __name__ == "__main__":
    main()
