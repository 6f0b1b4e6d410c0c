"""`a3po bench rollout`: tokens/s of the rollout engines per dtype, against `model.generate`,
and how far each engine's behaviour log-probs are from the trainer's.

    a3po bench rollout [--model M] [--device cpu] [--dtypes float32,bfloat16]
                       [--engines local,local-hf,generate[,vllm]] [--trainer-dtype auto] [--batch 64] [--group 1]
                       [--max-new-tokens 24] [--repeats 3] [--threads 1] [--out DIR]

`--device cuda` puts the model, the prompts, the trainer and the matmul rate on the GPU and waits for
its queued work before every clock read; the record names the GPU (vLLM places itself wherever it runs).

Why both in one run: `rollout.dtype` trades generation speed against the gap between the
log-probs b the engine reports for its tokens and the trainer's θ for the same tokens.
Decoupled PPO corrects for that gap (the behaviour weight exp(p − b)), so a faster dtype
is worth it only if the gap it opens stays small next to the policy's own staleness.

Throughput arms, on the same prompts (chat-templated "What is a + b?", encoded as the
rollout worker encodes its prompts; with `--group G`, batch / G distinct prompts each asked
G times, as a run's groups of gconfig.n_samples), the same weights (the bfloat16 model is a cast of the
float32 one, as a worker's copy is) and the same sampling settings (temperature 1, top-p 1,
no top-k), for each dtype:
  - local:    `LocalEngine` + `a3po.rollout.generate`, one batch of `--batch` requests, on the
              forward `rollout.forward=auto` picks (a3po's KV decoder for Llama and Qwen2);
  - local-hf: the same on the model's Hugging Face forward (`rollout.forward=hf`);
  - generate: `model.generate(do_sample=True)` on the same batch, left-padded with a mask;
  - vllm:     `VLLMEngine` (rollout.backend=vllm), one engine per dtype started once before the
              timing (its start-up, compilation included, is reported apart), the same requests
              and seeds. Only where vLLM is installed (`.venv-vllm/bin/a3po bench rollout`).
End-of-sequence stopping is off everywhere, so every row runs to `--max-new-tokens` and the
arms' token counts must agree (checked). Arms alternate within each repeat, after one short
untimed warm-up call each, so drifting machine load hits them alike; tokens/s is the median
and min..max over `--repeats`. Next to it, the model GFLOP/s it achieved (bench/flops.py: the
linear layers' matmuls for every prompt token and every sampled token but the last) and its
share of a large matmul's rate in the arm's dtype, measured in this run at `--threads`.

The gap: the completions each local, local-hf or vLLM engine sampled in its first timed repeat are scored by
the trainer's own code path, `TrainEngine.compute_logp` (actor dtype `--trainer-dtype`,
resolved as `actor.dtype=auto` is: bfloat16 where the device computes it natively), temperature
1. Over the generated tokens, with θ the trainer's and b the engine's log-probs: mean and max
|θ − b|, and k3 = mean(exp(θ − b) − (θ − b) − 1), an unbiased estimate of KL(behaviour ‖ trainer)
because the tokens were drawn from the behaviour distribution.

In-flight weight updates (`--update-every K`, 0 = off): the local engine in `rollout.dtype`'s
default resolution (bfloat16 where native) receives new weights every K decode steps, as a
worker does while the trainer publishes versions, once per `rollout.weight_update` mode:
  - reprefill: every running sequence is prefilled again with the new weights;
  - keep_kv:   the KV cache is kept and decoding continues with the new weights.
The weights loaded are the model's own (so both modes sample the same kind of text and the
token counts agree); what is measured is what each mode costs a rollout-bound worker.

Multi-turn episodes (`--turns T`, 0 = off): the local engine in the default rollout dtype
runs `--batch` episodes of T turns; after each turn a fixed observation ("Your answer is
wrong. Try again.") is appended as the chat template's delta, as a multi-turn run appends
an environment's answer, and the next turn's prompt is the whole context. Twice, arms
alternating: with each episode's KV cache kept between turns (the request's session, as the
worker does) and without (every turn prefilled whole). Per turn: the context length, the
prompt tokens each arm computed, and its seconds.
"""

from __future__ import annotations

import copy
import os
import random
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from a3po.bench.args import ROLLOUT_ENGINES, Engine, RolloutBenchArgs
from a3po.bench.common import fmt_s, on_device, print_report, progress, save_report, spread
from a3po.bench.flops import MATMUL_SIZE, generation_flops, matmul_rate, shape_rate
from a3po.config import ConfigError, load_config
from a3po.config.choices import AUTO, Dtype, Forward, WeightUpdate
from a3po.data import Example
from a3po.devices import device_name, native_bf16, resolve_device, resolve_dtype, synchronize, torch_dtype
from a3po.files import unique_dir
from a3po.machine import machine, machine_line
from a3po.models import ModelSourceError, load_policy
from a3po.rollout import Completion, GenerationRequest, generate, vllm_engine
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import ChatTurns, encode_prompt
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate

UPDATE_MODES = (WeightUpdate.KEEP_KV, WeightUpdate.REPREFILL)  # rollout.weight_update, as engines "update:<mode>"
SAMPLERS = (Engine.LOCAL, Engine.LOCAL_HF, Engine.VLLM)  # the engines that report log-probs (generate only times)
Sampler = Callable[[list[list[int]], int, int], list[Completion]]  # (prompts, max_new_tokens, seed) -> completions


@dataclass(frozen=True)
class Arm:
    engine: str  # one of ROLLOUT_ENGINES, or update:<mode>
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.engine} {self.dtype}"


def arithmetic_prompts(tokenizer, n: int, seed: int = 0, group: int = 1) -> list[list[int]]:
    """`n` short sums as token ids, through the chat template exactly as a rollout worker encodes its prompts;
    each of n / group questions `group` times in a row."""
    rng = random.Random(seed)
    questions = [f"What is {rng.randint(1, 20)} + {rng.randint(1, 20)}?" for _ in range(n // group)]
    return [encode_prompt(tokenizer, Example(q, "", i), None) for i, q in enumerate(questions) for _ in range(group)]


def local_sample(model, forward: str, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]:
    """One batch on a fresh engine whose batch holds every request, end-of-sequence stopping off."""
    engine = LocalEngine(model, eos_token_ids=[], max_batch=len(prompts), seed=seed, forward=forward)
    requests = [GenerationRequest(p, max_new_tokens, rid=i, seed=seed * 100_003 + i) for i, p in enumerate(prompts)]
    return generate(engine, requests)


def updating_sample(model, every: int, reprefill: bool, prompts: list[list[int]], max_new_tokens: int,
                    seed: int) -> list[Completion]:
    """`local_sample` while new weights (the model's own, as fp32 copies) arrive every `every` decode steps."""
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    engine = LocalEngine(model, eos_token_ids=[], max_batch=len(prompts), seed=seed,
                         reprefill_on_update=reprefill)
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(p, max_new_tokens, rid=i, seed=seed * 100_003 + i))
    done, steps = [], 0
    while engine.num_pending:
        done += engine.step()
        steps += 1
        if steps % every == 0:
            engine.update_weights(weights, engine.version + 1)
    return sorted(done, key=lambda c: c.rid)


FEEDBACK = "Your answer is wrong. Try again."


def episode_turns(model, tokenizer, keep: bool, turns: int, prompts: list[list[int]], max_new_tokens: int,
                  seed: int) -> list[dict]:
    """`turns` turns of every prompt's episode on one engine, a fixed observation after each; per turn the mean
    context length, the prompt tokens computed (all of them without `keep`) and the seconds the turn took."""
    engine = LocalEngine(model, eos_token_ids=[], max_batch=len(prompts), seed=seed)
    obs = ChatTurns(tokenizer).observation(FEEDBACK, "user", inline=False, ended_by_eos=False)
    contexts = [list(p) for p in prompts]
    out = []
    for k in range(turns):
        requests = [GenerationRequest(c, max_new_tokens, rid=i, seed=seed * 100_003 + 1000 * k + i,
                                      session=i if keep else None) for i, c in enumerate(contexts)]
        t0 = time.perf_counter()
        done = generate(engine, requests)
        out.append({"turn": k + 1, "context": statistics.fmean(map(len, contexts)),
                    "computed": statistics.fmean(c.prefilled for c in done), "s": time.perf_counter() - t0})
        contexts = [c.prompt_ids + c.output_ids + obs for c in done]
    return out


def multi_turn(model, tokenizer, args: RolloutBenchArgs, prompts: list[list[int]]) -> dict:
    """Kept against fresh KV per turn, arms alternating over the repeats: the median seconds per turn."""
    runs: dict[str, list[list[dict]]] = {"kept": [], "fresh": []}
    episode_turns(model, tokenizer, True, 2, prompts[:2], 2, 0)  # warm-up
    for rep in range(args.repeats):
        for arm in runs:
            runs[arm].append(episode_turns(model, tokenizer, arm == "kept", args.turns, prompts, args.max_new_tokens,
                                           rep + 1))
            progress(f"  multi-turn {arm:<5} repeat {rep + 1}/{args.repeats}: "
                     f"{sum(t['s'] for t in runs[arm][-1]):.2f} s for {args.turns} turns")
    rows = []
    for k in range(args.turns):
        row = {"turn": k + 1, "context": runs["kept"][0][k]["context"]}
        for arm, reps in runs.items():
            row[f"{arm}_computed"] = reps[0][k]["computed"]
            row[f"{arm}_s"] = statistics.median(r[k]["s"] for r in reps)
        rows.append(row)
    total = {arm: statistics.median(sum(t["s"] for t in r) for r in reps) for arm, reps in runs.items()}
    return {"turns": rows, "fresh_over_kept": total["fresh"] / total["kept"]}


def hf_sample(model, pad_id: int, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]:
    """One left-padded `model.generate` call, end-of-sequence stopping off (no log-probs: only timed)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros_like(ids)  # (B, L), 1 on real tokens
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        attn[i, L - len(p):] = 1
    torch.manual_seed(seed)
    ids, attn = ids.to(model.device), attn.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                         max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=pad_id)
    return [Completion(i, p, out[i, L:].tolist()) for i, p in enumerate(prompts)]  # out: (B, L + new)


def vllm_sample(engine, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]:
    """One batch on a long-lived vLLM engine (started without end-of-sequence ids, so no row stops early)."""
    return generate(engine, [GenerationRequest(p, max_new_tokens, rid=i, seed=seed * 100_003 + i)
                             for i, p in enumerate(prompts)])


def start_vllm(model, tokenizer, dtype: str, batch: int, threads: int, stack: ExitStack):
    """A VLLMEngine on `model`'s weights and the seconds its start took; closed when `stack` closes."""
    t0 = time.perf_counter()
    engine = vllm_engine.VLLMEngine.from_model(model, tokenizer, dtype=dtype, max_batch=batch, seed=0, eos_token_ids=())
    stack.callback(engine.close)
    torch.set_num_threads(threads)  # the arms share one thread budget, whatever vLLM's start chose
    return engine, time.perf_counter() - t0


def samplers(base, tokenizer, args: RolloutBenchArgs, stack: ExitStack) -> tuple[dict[Arm, Sampler], dict[str, float]]:
    """Every engine per dtype, and each vLLM engine's start-up seconds. A float32 model is `base` itself,
    others are casts of it (same weights), all on `base`'s device. With update_every, the local engine's two
    weight-update modes in the rollout default dtype too."""
    update_dtype = resolve_dtype(AUTO, base.device)
    pad_id = tokenizer.pad_token_id
    models = {d: base if d == Dtype.FLOAT32 else copy.deepcopy(base).to(torch_dtype(d))
              for d in {*args.dtypes, update_dtype}}
    forwards = {Engine.LOCAL: AUTO, Engine.LOCAL_HF: Forward.HF}  # rollout.forward of each local arm
    arms: dict[Arm, Sampler] = {}
    started: dict[str, float] = {}
    for d in args.dtypes:
        for e in (e for e in ROLLOUT_ENGINES if e in args.engines):
            if e == Engine.VLLM:
                progress(f"  starting vLLM ({d}) ...")
                engine, started[d] = start_vllm(models[d], tokenizer, d, args.batch, args.threads, stack)
                progress(f"  vLLM ({d}) ready in {started[d]:.1f} s")
                arms[Arm(e, d)] = partial(vllm_sample, engine)
            elif e == Engine.GENERATE:
                arms[Arm(e, d)] = partial(hf_sample, models[d], pad_id)
            else:
                arms[Arm(e, d)] = partial(local_sample, models[d], forwards[e])
    if args.update_every and Engine.LOCAL in args.engines:
        for mode in UPDATE_MODES:
            arms[Arm(f"update:{mode}", update_dtype)] = partial(updating_sample, models[update_dtype],
                                                                args.update_every, mode == WeightUpdate.REPREFILL)
    return arms, started


def measure(arms: dict[Arm, Sampler], prompts: list[list[int]], max_new_tokens: int, repeats: int,
            device: torch.device) -> tuple[dict[Arm, list[float]], dict[Arm, list[Completion]]]:
    """Seconds per call of every arm, arms alternating inside each repeat, and each arm's first timed completions
    (each call's clock waits for `device`'s queued work)."""
    for sample in arms.values():  # first calls pay one-time costs (allocator, kernels); a short one is enough
        sample(prompts[:2], 2, 0)
    secs: dict[Arm, list[float]] = {a: [] for a in arms}
    first: dict[Arm, list[Completion]] = {}
    expected = len(prompts) * max_new_tokens
    for rep in range(repeats):
        for arm, sample in arms.items():
            synchronize(device)
            t0 = time.perf_counter()
            completions = sample(prompts, max_new_tokens, rep + 1)
            synchronize(device)
            secs[arm].append(time.perf_counter() - t0)
            n = sum(len(c.output_ids) for c in completions)
            if n != expected:
                raise RuntimeError(f"{arm.name} generated {n} tokens, expected {expected}: did a row stop early?")
            first.setdefault(arm, completions)
            progress(f"  {arm.name:<18} repeat {rep + 1}/{repeats}: {n} tokens in {secs[arm][-1]:.2f} s "
                     f"({n / secs[arm][-1]:.0f} tok/s)")
    return secs, first


def logprob_gap(trainer: TrainEngine, completions: list[Completion]) -> dict:
    """Trainer log-probs θ against the engine's b on every generated token: mean/max |θ − b| and k3 KL(b ‖ θ)."""
    batch = collate([Trajectory(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions) for c in completions])
    theta = trainer.compute_logp(batch).cpu()[batch.loss_mask].double()  # (N,)
    d = theta - batch.logp_behav[batch.loss_mask].double()  # (N,) θ − b
    return {"tokens": d.numel(), "abs_mean": float(d.abs().mean()), "abs_max": float(d.abs().max()),
            "k3_kl": float((d.exp() - d - 1).mean())}


def arm_rows(secs: dict[Arm, list[float]], tokens: int, dtypes: list[str], flops: float,
             rates: dict[str, float], shape_rates: dict[str, float]) -> list[dict]:
    """One row per arm: tokens/s spread, seconds per call, model GFLOP/s and its share of the matmul rate
    and of the decode shapes' rate in the arm's dtype, and its speed against generate, against the local
    engine (vLLM's and local-hf's rows) and against the same engine in the first dtype."""
    med = {a: statistics.median(tokens / s for s in t) for a, t in secs.items()}

    def over(arm: Arm, other: Arm) -> float | None:
        return med[arm] / med[other] if other in med and arm != other else None

    rows = []
    for arm, t in secs.items():
        sampler = arm.engine in SAMPLERS
        gflops = flops / statistics.median(t) / 1e9
        rows.append({
            "engine": arm.engine, "dtype": arm.dtype, "tokens": tokens,
            **spread([tokens / s for s in t], "tok_per_s", unit=""), **spread(t, "call"),
            "gflops": gflops, "of_matmul": gflops / rates[arm.dtype], "of_shapes": gflops / shape_rates[arm.dtype],
            "over_generate": over(arm, Arm(Engine.GENERATE, arm.dtype)) if sampler else None,
            "over_local": (over(arm, Arm(Engine.LOCAL, arm.dtype)) if arm.engine in (Engine.VLLM, Engine.LOCAL_HF)
                           else None),
            "over_first_dtype": (1.0 if arm.dtype == dtypes[0] else over(arm, Arm(arm.engine, dtypes[0])))
            if not arm.engine.startswith("update:") else None,
        })
    return rows


def load_model(name: str):
    """The float32 model and its tokenizer; a model that cannot be loaded is the user's one-line error."""
    try:
        return load_policy(name, dtype=torch.float32, seed=0)
    except ModelSourceError as e:
        raise ConfigError(str(e)) from e


def run(args: RolloutBenchArgs) -> dict:
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    trainer_dtype = resolve_dtype(args.trainer_dtype, device)
    if Engine.VLLM in args.engines and not vllm_engine.installed():
        raise ConfigError("--engines vllm: vLLM is not installed in this environment; run the benchmark with "
                          ".venv-vllm/bin/a3po (make install-vllm, docs/scaling.md) or leave vllm out of --engines")
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    base, tok = load_model(args.model)
    base.to(device)
    out = unique_dir(Path(args.out))  # only once there is something to measure: no empty folders left behind
    prompts = arithmetic_prompts(tok, args.batch, group=args.group)
    name = device_name(device)
    progress(f"bench rollout: {args.model}, {args.batch} requests x {args.max_new_tokens} new tokens, "
             f"engines {','.join(args.engines)}, on {device} ({name}), {args.threads} thread(s); writing to {out}")
    rates, shape_rates = {}, {}
    for d in sorted({*args.dtypes, resolve_dtype(AUTO, device)}):
        rates[d] = matmul_rate(torch_dtype(d), device=device)
        # a decode step's matmuls: every request's one new token through each linear layer and the head
        shape_rates[d] = shape_rate(base, args.batch, args.batch, torch_dtype(d), backward=False, device=device)
        progress(f"  matmul rate, {d}, {args.threads} thread(s): {rates[d]:.0f} GFLOP/s; the model's own "
                 f"decode shapes ({args.batch} rows): {shape_rates[d]:.0f} GFLOP/s")
    with ExitStack() as engines:  # vLLM engines, closed (their /dev/shm folders removed) however this ends
        arms, vllm_start = samplers(base, tok, args, engines)
        progress(f"  {len(arms)} arms x {args.repeats} repeats")
        secs, first = measure(arms, prompts, args.max_new_tokens, args.repeats, device)
    episodes = None
    if args.turns and Engine.LOCAL in args.engines:
        dtype = resolve_dtype(AUTO, device)
        progress(f"  multi-turn arm: {args.batch} episodes x {args.turns} turns, {dtype}")
        episodes = {"dtype": dtype, **multi_turn(base if dtype == Dtype.FLOAT32 else
                                                 copy.deepcopy(base).to(torch_dtype(dtype)), tok, args, prompts)}

    # only after the last generation: TrainEngine makes the float32 model its own (it turns use_cache off)
    trainer = TrainEngine(base, load_config(None, [f"actor.dtype={trainer_dtype}"]).actor, total_optimizer_steps=1,
                          temperature=1.0, device=device)
    gaps = [{"engine": a.engine, "dtype": a.dtype, **logprob_gap(trainer, first[a])}
            for a in first if a.engine in SAMPLERS]
    rows = arm_rows(secs, args.batch * args.max_new_tokens, args.dtypes,
                    generation_flops(base, [len(p) for p in prompts], args.max_new_tokens), rates, shape_rates)
    local = {r["dtype"]: r["tok_per_s_median"] for r in rows if r["engine"] == Engine.LOCAL}
    record = {
        "benchmark": "rollout", "model": args.model, "params": sum(p.numel() for p in base.parameters()),
        "batch": args.batch, "group": args.group, "max_new_tokens": args.max_new_tokens, "matmul_gflops": rates,
        "shape_gflops": shape_rates,
        "prompt_len": [min(map(len, prompts)), max(map(len, prompts))],
        "threads": args.threads, "repeats": args.repeats, "dtypes": args.dtypes, "engines": args.engines,
        "trainer_dtype": trainer_dtype, "vllm_start_s": vllm_start,
        "device": str(device), "device_name": name,
        "machine": {**machine(), "native_bf16": native_bf16(device)}, "torch": torch.__version__, "args": asdict(args),
        "wall_s": time.perf_counter() - t_start, "loadavg_1m": [load_start, os.getloadavg()[0]],
        "arms": rows, "gap": gaps,
        "local_bf16_over_fp32": (local[Dtype.BFLOAT16] / local[Dtype.FLOAT32]
                                 if {Dtype.FLOAT32, Dtype.BFLOAT16} <= set(local) else None),
        "update_every": args.update_every,
        "keep_kv_over_reprefill": _ratio(rows, *(f"update:{mode}" for mode in UPDATE_MODES)),
        "multi_turn": episodes,
    }
    save_report(out, "rollout", record, markdown(record))
    return record


def _ratio(rows: list[dict], a: str, b: str) -> float | None:
    med = {r["engine"]: r["tok_per_s_median"] for r in rows}
    return med[a] / med[b] if a in med and b in med else None


def markdown(r: dict) -> str:
    first = r["dtypes"][0]
    lines = [
        f"### Rollout throughput, {r['batch']} requests x {r['max_new_tokens']} new tokens"
        + (f", {r['batch'] // r['group']} prompts x {r['group']} samples" if r["group"] > 1 else ""),
        "",
        (f"Model `{r['model']}` ({r['params'] / 1e6:.1f}M params), {r['threads']} thread(s), median of "
         f"{r['repeats']} repeats (arms alternated), temperature 1, no end-of-sequence stop, prompts of "
         f"{r['prompt_len'][0]}-{r['prompt_len'][1]} tokens; torch {r['torch']}; "
         f"{on_device(r)}{machine_line(r['machine'])}; "
         f"load average {r['loadavg_1m'][0]:.2f} at start, {r['loadavg_1m'][1]:.2f} at end. "
         "GFLOP/s: the model's linear-layer matmuls (bench/flops.py); of matmul: its share of a "
         f"{MATMUL_SIZE}x{MATMUL_SIZE} matmul's rate in the same dtype and thread count, measured in this run ("
         + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in r["matmul_gflops"].items()) + "); of shapes: its share "
         "of the rate the model's own decode matmuls (its linear layers and head at one row per request) reach "
         "alone (bench/flops.py `shape_rate`: " + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in
                                                              r["shape_gflops"].items()) + ")."),
        "",
        f"| engine | dtype | tokens | tok/s | min..max | per call | GFLOP/s | of matmul | of shapes | vs generate "
        f"| vs local | vs {first} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in r["arms"]:
        ratios = " | ".join(f"{a[k]:.2f}x" if a[k] is not None else "-"
                            for k in ("over_generate", "over_local", "over_first_dtype"))
        lines.append(f"| {a['engine']} | {a['dtype']} | {a['tokens']} | {a['tok_per_s_median']:.1f} "
                     f"| {a['tok_per_s_min']:.1f}..{a['tok_per_s_max']:.1f} | {fmt_s(a['call_median_s'])} "
                     f"| {a['gflops']:.0f} | {a['of_matmul']:.0%} | {a['of_shapes']:.0%} | {ratios} |")
    if r["vllm_start_s"]:
        lines += ["", "vLLM start-up, before the timing (compilation included): " + ", ".join(
            f"{d} {s:.1f} s" for d, s in r["vllm_start_s"].items()) + "."]
    if r["keep_kv_over_reprefill"] is not None:
        lines += ["", f"`update:<mode>`: the local engine with new weights every {r['update_every']} decode steps "
                      f"(`rollout.weight_update`); keep_kv / reprefill = **{r['keep_kv_over_reprefill']:.2f}x**."]
    if r.get("multi_turn"):
        m = r["multi_turn"]
        lines += ["", f"### Multi-turn episodes: {r['batch']} episodes x {len(m['turns'])} turns ({m['dtype']})", "",
                  "Each turn's prompt is the whole context (the previous turns and a fixed observation after each). "
                  "kept: each episode's KV cache kept between turns (the worker's sessions); fresh: every turn "
                  "prefilled whole. Computed: prompt tokens the engine ran per episode, mean; seconds: median "
                  f"over repeats. Fresh / kept over all turns: **{m['fresh_over_kept']:.2f}x**.", "",
                  "| turn | context tokens | computed, kept | computed, fresh | s, kept | s, fresh |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for t in m["turns"]:
            lines.append(f"| {t['turn']} | {t['context']:.0f} | {t['kept_computed']:.0f} | {t['fresh_computed']:.0f} "
                         f"| {t['kept_s']:.2f} | {t['fresh_s']:.2f} |")
    lines += [
        "",
        f"### Behaviour log-probs b against the trainer's θ ({r['trainer_dtype']})",
        "",
        (f"`TrainEngine.compute_logp` (actor.dtype={r['trainer_dtype']}, temperature 1) on the completions each "
         "local, local-hf or vLLM engine sampled in its first timed repeat, over the generated tokens; "
         "k3 = mean(exp(θ − b) − (θ − b) − 1) estimates KL(behaviour ‖ trainer)."),
        "",
        "| engine | rollout dtype | tokens | mean abs(θ − b) | max abs(θ − b) | k3 KL |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for g in r["gap"]:
        lines.append(f"| {g['engine']} | {g['dtype']} | {g['tokens']} | {g['abs_mean']:.3g} | {g['abs_max']:.3g} "
                     f"| {g['k3_kl']:.3g} |")
    return "\n".join(lines) + "\n"


def main(args: RolloutBenchArgs) -> int:
    record = run(args)
    print_report("rollout", record, markdown(record))
    return 0
