"""Benchmark: generated tokens per second of the local rollout engine against Hugging Face `model.generate`.

    python benchmarks/rollout_throughput.py [--models tiny-256x4,smollm2-135m-instruct] [--batch 16]
        [--max-new-tokens 32] [--repeats 3] [--threads N] [--dtype float32|bfloat16] [--no-mixed]

For each model, in the same run and with the same weights, prompts and sampling settings
(temperature 1, top-p 1, no top-k; chat-templated short sums such as "What is 7 + 12?"):
  - local:  `LocalEngine` + `a3po.rollout.generate`, one batch of `--batch` requests;
  - hf:     `model.generate(do_sample=True)` on the same batch, left-padded with an attention mask.
End-of-sequence stopping is off in both arms (`eos_token_ids=[]`, `eos_token_id=None`), so
every sequence runs to `--max-new-tokens`; the tokens each arm actually generated are
counted and must agree. The arms alternate within each repeat (median and min..max over
`--repeats`, after a short untimed warm-up call each), and the ratio local/hf is reported.

Unless --no-mixed, a second workload shows continuous batching: 2 x batch requests whose
max_new_tokens are drawn between max_new_tokens/4 and max_new_tokens:
  - local-mixed: all requests submitted at once to one engine with max_batch=batch; a
    finished row is refilled from the queue at once;
  - hf-mixed:    static batches of `--batch` requests, each generated to the longest
    request in it; only the tokens the requests asked for count as useful.
Throughput there is useful tokens per second. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import summary  # noqa: E402

from a3po.models import load_policy  # noqa: E402
from a3po.rollout import GenerationRequest, generate  # noqa: E402
from a3po.rollout.local import LocalEngine  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def arithmetic_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """`n` chat-templated questions "What is a + b?" as token ids (no special tokens added twice)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q = f"What is {rng.randint(1, 20)} + {rng.randint(1, 20)}?"
        messages = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def local_generate(model, pad_id: int, prompts: list[list[int]], max_new: list[int], max_batch: int, seed: int) -> int:
    """Generated tokens of one `generate` call on a fresh engine with end-of-sequence stopping off."""
    engine = LocalEngine(model, eos_token_ids=[], pad_id=pad_id, max_batch=max_batch, seed=seed)
    reqs = [GenerationRequest(p, max_new_tokens=n, rid=i, temperature=1.0, top_p=1.0, seed=seed * 100_003 + i)
            for i, (p, n) in enumerate(zip(prompts, max_new))]
    return sum(len(c.output_ids) for c in generate(engine, reqs))


def hf_generate(model, pad_id: int, prompts: list[list[int]], max_new_tokens: int, seed: int) -> int:
    """Generated tokens of one left-padded `model.generate` call with end-of-sequence stopping off."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros(len(prompts), L, dtype=torch.long)  # (B, L)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        attn[i, L - len(p):] = 1
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                         max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=pad_id)
    return out.shape[0] * (out.shape[1] - L)  # (B, L + new): no row stops early without an eos


def hf_static_batches(model, pad_id: int, prompts: list[list[int]], max_new: list[int], batch: int, seed: int) -> int:
    """Static batching of a mixed workload: each batch runs to its longest request; returns the useful tokens."""
    useful = 0
    for k in range(0, len(prompts), batch):
        n = max_new[k:k + batch]
        made = hf_generate(model, pad_id, prompts[k:k + batch], max(n), seed + k)
        assert made == len(n) * max(n), (made, n)
        useful += sum(n)
    return useful


def measure(arms: dict[str, Callable[[int], int]], warmups: dict[str, Callable[[], object]],
            repeats: int) -> dict[str, dict]:
    """Tokens/s of each arm, arms alternating inside each repeat, after one small untimed warm-up call each."""
    for fn in warmups.values():
        fn()
    secs: dict[str, list[float]] = {k: [] for k in arms}
    toks: dict[str, set[int]] = {k: set() for k in arms}
    for rep in range(repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            n = fn(rep)
            secs[name].append(time.perf_counter() - t0)
            toks[name].add(n)
            print(f"  {name:<12} repeat {rep + 1}/{repeats}: {n} tokens in {secs[name][-1]:.2f} s",
                  file=sys.stderr, flush=True)
    out = {}
    for name in arms:
        (n,) = toks[name]  # the same token count every repeat
        s = summary(secs[name])
        rates = [n / t for t in secs[name]]
        out[name] = {**s, "tokens": n, "tok_s": statistics.median(rates),
                     "tok_s_min": min(rates), "tok_s_max": max(rates)}
    return out


def bench_model(name: str, args) -> dict:
    t_load = time.perf_counter()
    model, tok = load_policy(name, dtype=DTYPES[args.dtype], seed=0)
    t_load = time.perf_counter() - t_load
    pad = tok.pad_token_id
    B, N = args.batch, args.max_new_tokens
    prompts = arithmetic_prompts(tok, B)
    arms = {
        "local": lambda rep: local_generate(model, pad, prompts, [N] * B, B, seed=rep + 1),
        "hf": lambda rep: hf_generate(model, pad, prompts, N, seed=rep + 1),
    }
    warmups = {  # first calls pay one-time costs (allocator, kernels); a short one is enough
        "local": lambda: local_generate(model, pad, prompts[:2], [2, 2], B, seed=0),
        "hf": lambda: hf_generate(model, pad, prompts[:2], 2, seed=0),
    }
    if args.mixed:
        rng = random.Random(1)
        mixed_prompts = arithmetic_prompts(tok, 2 * B, seed=1)
        mixed_new = [rng.randint(max(1, N // 4), N) for _ in mixed_prompts]
        arms["local-mixed"] = lambda rep: local_generate(model, pad, mixed_prompts, mixed_new, B, seed=rep + 1)
        arms["hf-mixed"] = lambda rep: hf_static_batches(model, pad, mixed_prompts, mixed_new, B, seed=rep + 1)
    print(f"{name}: loaded in {t_load:.1f} s", file=sys.stderr, flush=True)
    res = measure(arms, warmups, args.repeats)
    assert res["local"]["tokens"] == res["hf"]["tokens"] == B * N, {k: v["tokens"] for k, v in res.items()}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "prompt_len": [min(map(len, prompts)), max(map(len, prompts))],
        "load_s": t_load,
        "arms": res,
    }


def print_table(results: dict[str, dict], args) -> None:
    print(f"rollout throughput: batch {args.batch}, max_new_tokens {args.max_new_tokens}, {args.dtype}, "
          f"{args.threads} thread(s), {args.repeats} repeats, torch {torch.__version__}")
    print(f"{'model':<32}{'arm':<13}{'tokens':>8}{'tok/s median':>14}{'min..max':>18}{'s/call':>9}{'local/hf':>10}")
    for model, r in results.items():
        arms = r["arms"]
        for arm, a in arms.items():
            if arm == "local":
                ratio = f"{a['tok_s'] / arms['hf']['tok_s']:.2f}x"
            elif arm == "local-mixed":
                ratio = f"{a['tok_s'] / arms['hf-mixed']['tok_s']:.2f}x"
            else:
                ratio = ""
            spread = f"{a['tok_s_min']:.0f}..{a['tok_s_max']:.0f}"
            label = f"{model} ({r['params'] / 1e6:.1f}M)" if arm == "local" else ""
            print(f"{label:<32}{arm:<13}{a['tokens']:>8}{a['tok_s']:>14.0f}{spread:>18}{a['median_s']:>9.2f}"
                  f"{ratio:>10}")
    if args.mixed:
        print("mixed: 2 x batch requests with max_new_tokens in [max_new_tokens/4, max_new_tokens]; "
              "tokens = useful tokens (hf-mixed also computes padding steps that are thrown away)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-256x4,smollm2-135m-instruct", help="comma-separated actor.path values")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32",
                    help="model weights and compute dtype, both arms")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false", help="skip the continuous-batching workload")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0, load_start = time.perf_counter(), os.getloadavg()[0]
    if load_start > 0.5:
        print(f"warning: load average {load_start:.1f} at start: other processes may share the cores and timings "
              f"may be noisy (with --threads {args.threads})", file=sys.stderr)

    results = {m: bench_model(m, args) for m in args.models.split(",")}
    print_table(results, args)
    print(f"load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    ratio = lambda r, a, b: round(r["arms"][a]["tok_s"] / r["arms"][b]["tok_s"], 3)  # noqa: E731
    record = {
        "benchmark": "rollout_throughput", "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "models": {m: {
            "params": r["params"],
            "tok_s": {arm: round(a["tok_s"], 1) for arm, a in r["arms"].items()},
            "tok_s_min": {arm: round(a["tok_s_min"], 1) for arm, a in r["arms"].items()},
            "tok_s_max": {arm: round(a["tok_s_max"], 1) for arm, a in r["arms"].items()},
            "local_over_hf": ratio(r, "local", "hf"),
            **({"local_mixed_over_hf_mixed": ratio(r, "local-mixed", "hf-mixed")} if args.mixed else {}),
        } for m, r in results.items()},
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
