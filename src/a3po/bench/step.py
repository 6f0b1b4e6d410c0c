"""`a3po bench step`: one training step with each way of getting the proximal log-probs.

The claim under test is local: A-3PO removes one no-grad forward pass from every
`ppo_update`, so a step should get faster by that pass's share and by nothing else.
Every timed step is therefore the first step of a fresh `TrainEngine` on a deep copy of
the same initial weights and the same fixed batch, with arms alternated inside each
repeat so that drifting machine load hits them all alike. The batch is random tokens
whose behaviour log-probs are the model's own, with token versions spread over
d = 0..eta so that the interpolation really interpolates.

Two measurements:
  1. the step: wall time of `ppo_update`, split into the proximal forward pass
     (`perf/prox_logp_s`), forward/backward and optimizer (`perf/optimizer_s`), for each
     method at each minibatch count (reuse, exact only with one gradient step per sample,
     only at one: the config refuses it otherwise);
     forward/backward also as model GFLOP/s (bench/flops.py: 6 FLOPs per linear weight per
     token) and as a share of a large matmul's rate in the same dtype and thread count,
     measured in this run; with --lora-rank R each arm also with LoRA adapters of rank R, beside full
     training, with the trainer state each holds (weights and AdamW moments: bytes of the tensors; a LoRA
     row's GFLOP/s counts full training's FLOPs, though it skips the frozen weights' gradients, 2 of the 6);
     with --memory, each arm's peak resident memory, from a fresh process that loads the model, then builds
     the engine and trains two steps on the same batch (activations, gradients and AdamW state included;
     Linux only: it reads and resets the process's peak through /proc);
  2. the proximal computation alone: the recompute forward pass against
     `proximal_logp(loglinear | linear)` on the same batch's log-probs.

`--device cuda` puts the engines, the batch, the interpolation and the matmul rate on the GPU; every
clock read waits for the GPU's queued work first (devices.synchronize, also inside `ppo_update`), and
the record names the GPU. `--model tiny-2048x16` (about 600M parameters, models/tiny.py) needs no download.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from a3po.algo import proximal_logp
from a3po.algo.variants import prox_traits
from a3po.bench.args import StepBenchArgs
from a3po.bench.common import fmt_s, on_device, print_report, progress, save_report, spread
from a3po.bench.flops import MATMUL_SIZE, matmul_rate, shape_rate, training_flops
from a3po.config import load_config
from a3po.devices import device_name, resolve_device, resolve_dtype, synchronize
from a3po.files import unique_dir
from a3po.machine import machine, machine_line
from a3po.models import load_policy
from a3po.pipeline.pool import split_threads
from a3po.trainer.engine import TrainEngine, micro_batches, minibatches
from a3po.trainer.logprobs import rows_per_chunk
from a3po.trajectories import Trajectory, collate

PEAK_TIMEOUT_S = 900  # one arm's memory measurement: a model load and two steps
INTERPOLATIONS = ("loglinear", "linear")


def fixed_batch(vocab: int, engine: TrainEngine, args: StepBenchArgs, seed: int = 0):
    """Random trajectories, behaviour log-probs from the engine's own (initial) weights, versions cycling over
    v-eta..v; kept on the CPU, as the trainer receives its batches."""
    g = torch.Generator().manual_seed(seed)
    v = args.eta
    trajs = []
    for _ in range(args.batch):
        versions = [v - (j % (args.eta + 1)) for j in range(args.output_len)]
        trajs.append(Trajectory(prompt_ids=torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist(),
                                output_ids=torch.randint(0, vocab, (args.output_len,), generator=g).tolist(),
                                output_logprobs=[0.0] * args.output_len, output_versions=versions))
    batch = collate(trajs, advantages=torch.randn(args.batch, generator=g))
    batch.logp_behav = engine.compute_logp(batch).cpu()  # (B, T), 0 outside the outputs
    return batch


def arms_for(args: StepBenchArgs) -> list[tuple[str, int, int]]:
    """Every (method, minibatch count, LoRA rank) to time; a single-step-only method (variants.py) at one
    minibatch only; rank 0 is full training, --lora-rank adds its rank."""
    ranks = [0, args.lora_rank] if args.lora_rank else [0]
    return [(method, m, r) for r in ranks for m in args.minibatches for method in args.methods
            if m == 1 or not prox_traits(method).single_step_only]


def state_bytes(engine: TrainEngine) -> int:
    """What the trainer holds between steps: weights, and AdamW's moments of the trained ones."""
    moments = sum(t.nbytes for st in engine.optimizer.state.values() for t in st.values() if torch.is_tensor(t))
    return sum(p.nbytes for p in engine.model.parameters()) + moments


def _peak_of_one_step(model: str, actor, batch, eta: int, threads: int) -> float:
    """In a fresh process: the resident-set peak (MB) of building the engine on the loaded model and training two
    steps on `batch`. The peak is reset after loading (Linux's clear_refs): converting the built-in model's file
    peaks higher than training a step does, and would hide the difference between arms."""
    torch.set_num_threads(threads)
    base, _ = load_policy(model, dtype=torch.float32, seed=0)
    Path("/proc/self/clear_refs").write_text("5")
    engine = TrainEngine(base, actor, total_optimizer_steps=2 * actor.ppo_n_minibatches)
    for _ in range(2):  # AdamW's moments exist from the first optimizer step on: the second step holds them all
        engine.version = eta
        engine.ppo_update(batch)
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024  # kB


def peak_memory(args: StepBenchArgs, actors: dict, batch) -> dict:
    """Each arm's `_peak_of_one_step`, one fresh process at a time."""
    out = {}
    for arm, actor in actors.items():
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            job = pool.submit(_peak_of_one_step, args.model, actor, batch, args.eta, args.threads)
            out[arm] = job.result(timeout=PEAK_TIMEOUT_S)
        progress(f"  {arm[0]:<10} minibatches={arm[1]}{f' lora={arm[2]}' if arm[2] else ''}: "
                 f"peak resident memory {out[arm]:.0f} MB")
    return out


def time_interpolation(batch, method: str, v: int, device: torch.device, min_repeats: int = 50,
                       min_s: float = 0.3) -> list[float]:
    """Seconds per call of the interpolation on the whole batch on `device`; repeated until it is measurable."""
    batch = batch.to(device)
    theta = batch.logp_behav + 0.05 * torch.randn_like(batch.logp_behav)
    proximal_logp(method, batch.logp_behav, theta, batch.versions, v)  # warm-up
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    while len(times) < min_repeats or time.perf_counter() < t_end:
        synchronize(device)
        t0 = time.perf_counter()
        proximal_logp(method, batch.logp_behav, theta, batch.versions, v)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def micro_batch_rows(batch, engine: TrainEngine, n_minibatches: int) -> tuple[int, int]:
    """Tokens of the first minibatch's first micro-batch, through the body (padded rows x length) and through the
    head (its output tokens, at most one vocabulary chunk of `trainer/logprobs.py`): the matmul shapes one training
    pass runs."""
    mini = batch.select(minibatches(len(batch), n_minibatches)[0])
    group = mini.select(micro_batches(mini, engine.cfg.mb_spec.max_tokens_per_mb)[0])
    head = int(group.loss_mask.sum())
    return group.input_ids.numel(), min(head, rows_per_chunk(engine.model.get_output_embeddings().weight.shape[0]))


def run(args: StepBenchArgs) -> dict:
    if args.threads is None:
        args.threads = split_threads(1, None)[1]
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")  # a GPU that is not there: one line before anything loads
    dtype = resolve_dtype(args.dtype, device)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    base, tok = load_policy(args.model, dtype=torch.float32, seed=0)
    out = unique_dir(Path(args.out))  # once there is something to measure: a bad model leaves no empty folder
    arms = arms_for(args)
    actors = {(method, m, r): load_config(None, [f"actor.prox_logp_method={method}", f"actor.ppo_n_minibatches={m}",
                                                 f"actor.dtype={dtype}", f"actor.lora.rank={r}"]).actor
              for method, m, r in arms}

    def fresh_engine(arm) -> TrainEngine:
        engine = TrainEngine(copy.deepcopy(base), actors[arm], total_optimizer_steps=arm[1], device=device)
        engine.version = args.eta  # tokens carry versions eta-2..eta: staleness 0..eta
        return engine

    first = fresh_engine(arms[0])
    batch = fixed_batch(len(tok), first, args)  # arms[0] trains the full model: base's weights
    rate = matmul_rate(getattr(torch, dtype), device=device)
    shapes = {m: micro_batch_rows(batch, first, m) for m in args.minibatches}

    def shape_rates() -> dict[int, float]:
        return {m: shape_rate(base, *shapes[m], getattr(torch, dtype), backward=True, device=device)
                for m in args.minibatches}

    shape_samples = {m: [r] for m, r in shape_rates().items()}  # again after every repeat: the load drifts
    del first
    name = device_name(device)
    flops = training_flops(base, batch.input_ids.numel())
    progress(f"  matmul rate, {dtype}, {args.threads} thread(s): {rate:.0f} GFLOP/s; "
             f"forward/backward {flops / 1e12:.2f} TFLOP per step")
    for m, (body_rows, head_rows) in shapes.items():
        progress(f"  its own matmul shapes at {m} minibatch(es) ({body_rows} tokens per micro-batch, head at "
                 f"{head_rows}), forward and backward: {shape_samples[m][0]:.0f} GFLOP/s")
    progress(f"bench step: batch {tuple(batch.input_ids.shape)}, {len(arms)} arms x {args.repeats} repeats "
             f"(+{args.warmup} warm-up), on {device} ({name}), {args.threads} thread(s), {dtype}; writing to {out}")

    samples: dict = {a: {"step": [], "prox": [], "train": [], "optimizer": [], "forwards": [], "state": [],
                         "trainable": []} for a in arms}
    warm = batch.select([0])
    for rep in range(-args.warmup, args.repeats):
        for arm in arms:
            engine = fresh_engine(arm)
            forwards = []  # counted, not timed: which arms pay the proximal pass is a fact, not a measurement
            engine.model.base_model.register_forward_hook(lambda *_, forwards=forwards: forwards.append(1))
            synchronize(device)
            t0 = time.perf_counter()
            stats = engine.ppo_update(warm if rep < 0 else batch)
            synchronize(device)
            dt = time.perf_counter() - t0
            held = state_bytes(engine)
            del engine  # one engine (weights, grads, AdamW state) alive at a time
            tag = "warm-up" if rep < 0 else f"repeat {rep + 1}/{args.repeats}"
            lora = f" lora={arm[2]}" if arm[2] else ""
            progress(f"  {arm[0]:<10} minibatches={arm[1]}{lora} {tag}: step {dt:.2f} s, "
                     f"prox {stats['perf/prox_logp_s']:.2f} s")
            if rep >= 0:
                s = samples[arm]
                s["step"].append(dt)
                s["prox"].append(stats["perf/prox_logp_s"])
                s["train"].append(stats["perf/train_s"])
                s["optimizer"].append(stats["perf/optimizer_s"])
                s["forwards"].append(len(forwards))
                s["state"].append(held)
                s["trainable"].append(stats["train/trainable_params"])

        if rep >= 0:
            for m, r in shape_rates().items():
                shape_samples[m].append(r)

    peaks = peak_memory(args, actors, batch) if args.memory else {}
    steps = []
    for method, m, r in arms:
        s = samples[(method, m, r)]
        ref = samples.get(("recompute", m, r))
        med = statistics.median(s["step"])
        fwd_bwd = statistics.median(t - o for t, o in zip(s["train"], s["optimizer"]))
        steps.append({
            "method": method, "minibatches": m, "lora_rank": r, **spread(s["step"], "step"),
            "state_mb": max(s["state"]) / 1e6, "trainable_params": max(s["trainable"]),
            "peak_rss_mb": peaks.get((method, m, r)),
            "prox_logp_s": statistics.median(s["prox"]),
            "forwards": max(s["forwards"]),  # model forward passes in one step (every micro-batch counts)
            "fwd_bwd_s": fwd_bwd, "fwd_bwd_gflops": flops / fwd_bwd / 1e9, "of_matmul": flops / fwd_bwd / 1e9 / rate,
            # each repeat's pass against the shapes timed right after its round: both at that round's load
            "shape_gflops": statistics.median(shape_samples[m]),
            "of_shapes": statistics.median(flops / (t - o) / 1e9 / r for t, o, r in
                                           zip(s["train"], s["optimizer"], shape_samples[m][1:])),
            "optimizer_s": statistics.median(s["optimizer"]),
            "other_s": statistics.median(st - t - p for st, t, p in zip(s["step"], s["train"], s["prox"])),
            "prox_share": statistics.median(p / t for p, t in zip(s["prox"], s["step"])),
            "speedup_vs_recompute": statistics.median(ref["step"]) / med if ref else None,
        })

    forward = [p for (method, _, r), s in samples.items() if method == "recompute" and r == 0 for p in s["prox"]]
    prox = []
    if forward:
        prox.append({"method": "recompute (forward pass)", **spread(forward, "time"), "speedup_vs_forward": 1.0})
    for method in INTERPOLATIONS:
        t = time_interpolation(batch, method, args.eta, device)
        prox.append({"method": method, **spread(t, "time"),
                     "speedup_vs_forward": statistics.median(forward) / statistics.median(t) if forward else None})

    B, T = batch.input_ids.shape
    record = {
        "benchmark": "step", "model": args.model, "params": sum(p.numel() for p in base.parameters()),
        "dtype": dtype, "batch": B, "seq": T, "torch": torch.__version__, "args": asdict(args),
        "device": str(device), "device_name": name,
        "machine": machine(), "matmul_gflops": rate, "fwd_bwd_tflop": flops / 1e12,
        "wall_s": time.perf_counter() - t_start, "loadavg_1m": [load_start, os.getloadavg()[0]],
        "steps": steps, "prox": prox,
    }
    save_report(out, "step", record, markdown(record))
    return record


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [
        f"### Training step (`ppo_update`), {r['batch']} x {r['seq']} tokens",
        "",
        f"Model `{r['model']}` ({r['params'] / 1e6:.1f}M params), {r['dtype']}, {on_device(r)}"
        f"{a['threads']} thread(s), "
        f"median of {a['repeats']} repeats after {a['warmup']} warm-up; staleness 0..{a['eta']}; torch {r['torch']}; "
        f"{machine_line(r['machine'])}; load average {r['loadavg_1m'][0]:.2f} at start, {r['loadavg_1m'][1]:.2f} "
        f"at end. fwd/bwd GFLOP/s: {r['fwd_bwd_tflop']:.2f} TFLOP of linear-layer matmuls per step (bench/flops.py) "
        f"over the fwd/bwd time; of matmul: its share of a {MATMUL_SIZE}x{MATMUL_SIZE} {r['dtype']} matmul's rate "
        f"at the same thread count, measured in this run ({r['matmul_gflops']:.0f} GFLOP/s); shapes GFLOP/s: the "
        f"rate the model's own linear-layer shapes reach alone at the arm's micro-batch size, forward and both "
        f"gradient matmuls (bench/flops.py `shape_rate`), timed after every round (median), and of shapes: the "
        f"median over rounds of fwd/bwd GFLOP/s as a share of the shapes' rate in the same round.",
        "",
        "| prox method | minibatches | LoRA rank | step (s) | min..max | forward passes | prox forward (s) "
        "| fwd/bwd (s) | fwd/bwd GFLOP/s | of matmul | shapes GFLOP/s | of shapes | optimizer (s) | prox share "
        "| recompute / this | trained params | weights + AdamW (MB) | peak RSS (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r["steps"]:
        sp = f"{s['speedup_vs_recompute']:.2f}x" if s["speedup_vs_recompute"] else "-"
        lines.append(f"| {s['method']} | {s['minibatches']} | {s.get('lora_rank') or '-'} | {s['step_median_s']:.2f} "
                     f"| {s['step_min_s']:.2f}..{s['step_max_s']:.2f} | {s['forwards']} | {s['prox_logp_s']:.2f} "
                     f"| {s['fwd_bwd_s']:.2f} | {s['fwd_bwd_gflops']:.0f} | {s['of_matmul']:.0%} "
                     f"| {s['shape_gflops']:.0f} | {s['of_shapes']:.0%} "
                     f"| {s['optimizer_s']:.2f} | {s['prox_share']:.0%} | {sp} "
                     f"| {s.get('trainable_params', 0) / 1e6:.2f}M | {s.get('state_mb', 0):.0f} "
                     f"| {_opt_mb(s.get('peak_rss_mb'))} |")
    lines += ["", "### Proximal log-probs alone, same batch", "",
              "| computed by | median | min..max | forward / this |", "|---|---:|---:|---:|"]
    for p in r["prox"]:
        sp = f"{p['speedup_vs_forward']:,.0f}x" if p["speedup_vs_forward"] else "-"
        lines.append(f"| {p['method']} | {fmt_s(p['time_median_s'])} "
                     f"| {fmt_s(p['time_min_s'])}..{fmt_s(p['time_max_s'])} | {sp} |")
    return "\n".join(lines) + "\n"


def _opt_mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def main(args: StepBenchArgs) -> int:
    record = run(args)
    print_report("step", record, markdown(record))
    return 0
