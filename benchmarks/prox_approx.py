"""Micro-benchmark: A-3PO's proximal approximation against the forward pass it replaces.

    python benchmarks/prox_approx.py [--batch 32] [--seq 256] [--model small|smollm2-shape] [--repeats 5]

Times, on the same (B, T) batch and in the same run:
  - recompute: one no-grad forward pass of a causal LM plus the log-softmax gather that
    turns logits into per-token log-probs (what `prox_logp_method=recompute` costs);
  - loglinear and linear: `a3po.algo.proximal_logp` from behaviour log-probs, current
    log-probs and per-token versions.
The model has random weights (compute does not depend on their values): `small` is a
~10M-parameter Llama with SmolLM2's 49k vocabulary, `smollm2-shape` has the full
SmolLM2-135M architecture. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import summary, time_call  # noqa: E402

from a3po.algo import proximal_logp  # noqa: E402

SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
}


def build_model(shape: str) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def recompute_logp(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--model", choices=list(SHAPES), default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    B, T = args.batch, args.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    logp_behav = -torch.rand(B, T - 1, generator=g) * 5
    logp_theta = logp_behav + 0.1 * torch.randn(B, T - 1, generator=g)
    versions = torch.randint(0, 5, (B, T - 1), generator=g)
    versions[:, : T // 4] = -1  # a prompt prefix
    current_version = 5

    arms = {
        "recompute (forward pass)": lambda: recompute_logp(model, ids),
        "loglinear (A-3PO)": lambda: proximal_logp("loglinear", logp_behav, logp_theta, versions, current_version),
        "linear": lambda: proximal_logp("linear", logp_behav, logp_theta, versions, current_version),
    }
    results = {}
    for name, fn in arms.items():
        reps = args.repeats if name.startswith("recompute") else max(args.repeats, 50)
        results[name] = summary(time_call(fn, reps))

    base = results["recompute (forward pass)"]["median_s"]
    print(f"proximal log-probs for a {B} x {T} batch; model '{args.model}' ({n_params / 1e6:.1f}M params), "
          f"{args.threads} thread(s), torch {torch.__version__}")
    print(f"{'method':<26}{'median':>12}{'min':>12}{'max':>12}{'recompute / this':>20}")
    for name, r in results.items():
        print(f"{name:<26}{r['median_s'] * 1e3:>10.3f}ms{r['min_s'] * 1e3:>10.3f}ms{r['max_s'] * 1e3:>10.3f}ms"
              f"{base / r['median_s']:>19.0f}x")
    record = {
        "benchmark": "prox_approx", "batch": B, "seq": T, "model": args.model, "params": n_params,
        "threads": args.threads,
        "median_s": {k.split(" ")[0]: v["median_s"] for k, v in results.items()},
        "speedup_vs_recompute": {k.split(" ")[0]: base / v["median_s"] for k, v in results.items() if not k.startswith("recompute")},
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
