"""`a3po bench fidelity`: how close each proximal method's update is to the exact one, with no trajectory noise.

    a3po bench fidelity --preset tiny total_train_steps=4          # a quick look, under a minute
    a3po bench fidelity --preset equivalence rollout.lockstep=true total_train_steps=12 --steps 4,8,12
    a3po bench fidelity --run RUN_DIR     # the records of a run trained with saver.record_steps=[...]

A comparison of training runs sees a method through a noisy trajectory: on the yardsticks most of
the variance of a paired difference between two methods is the trajectory's. This benchmark has none:
  1. one run (--eta 8 and --minibatches 4 unless told otherwise; --preset, --config and key=value as
     `a3po train` takes them) records, before each step of --steps, the batch that step trains on and
     the trainer's state: weights, AdamW's moments, the schedule and the RNG (trainer/records.py);
  2. every record is replayed once per arm: a fresh engine loads the recorded state and runs the same
     `ppo_update` on the recorded batch, every minibatch of it, with only the arm's actor keys changed;
  3. each arm's update is compared with recompute's (bench/agreement.py), and the policies after the
     step by their KL on held-out prompts (bench/fidelity_report.py writes the tables).

Arms (every other actor key is the run's own): recompute (the exact proximal policy; its own row is
the reference replayed a second time, the determinism check), loglinear (A-3PO), linear, coupled
(p = b, w = 1), recompute-noclip (no clip, dual clip or behaviour-weight cap: how much of the gap the
bounds make) and reuse (p = sg(theta) at every minibatch: ratio 1, a pure behaviour-weighted policy
gradient; the configuration refuses it in training beyond one minibatch, here it is an instrument). Asked
for by name: the corrections and surrogates of bench staleness and bench e2e (IcePop, geometric masking,
token TIS, CISPO, SAPO), each over its method's proximal policy: how far each moves the step from the
exact one, and on which tokens.

An arm's update u is its change of every trained parameter net of the step's carried part: the
change the same step makes with every advantage 0 (AdamW's momentum from earlier steps, weight
decay; an entropy or KL term if the run has one). Every arm shares that part, which at beta1 = 0.9
is most of a step's change once a run has momentum, so without the subtraction every cosine would
be near 1 and say nothing. Each record states the carried part's size against recompute's change.

Where the arms part: the update is split by staleness d and by the sign of A. A part's update is the
step on its tokens alone, the advantages of all other tokens set to 0 (they still count in the loss's
denominator, so each token weighs as in the whole step), net of the carried part, against recompute's
step on the same tokens. Its minibatch path is its own (theta moves by that part's gradients only), so
the parts need not add up to the whole (AdamW and the global gradient-norm clip are not linear either):
they say which tokens an arm treats differently. A part that is the whole (a lockstep batch holds one d)
is the whole step's row. With importance_sampling_level=sequence (GSPO) a sequence pools its tokens'
advantages, so a d part that cuts a sequence (an in-flight update) changes that sequence's advantage too.

The KL: --heldout prompts of the run's held-out split, each continued greedily by the recorded (pre-step)
policy; at every position of the continuation, KL(pi_rec || pi_arm) between the next-token distributions
after the two steps, at the run's temperature, over the whole vocabulary; the mean over those positions.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from a3po.algo import staleness
from a3po.algo.filters import SamplingFilter
from a3po.bench.agreement import ALL, agreement, cells, d_values, dot, flat, kl_rows, only, sum_norm
from a3po.bench.args import CORRECTION_ARMS, FIDELITY_ARMS, NO_CLIP_BOUNDS, REFERENCE, FidelityArgs
from a3po.bench.common import json_line, progress, save_report
from a3po.bench.fidelity_report import markdown, summary
from a3po.bench.runs import PlannedRun, run_one
from a3po.config import Config, ConfigError, load_config
from a3po.config.load import apply_overrides
from a3po.config.schema import ActorConfig
from a3po.data import load_task
from a3po.devices import resolve_device
from a3po.files import unique_dir
from a3po.machine import machine
from a3po.models import end_ids, load_policy
from a3po.pipeline.pool import split_threads
from a3po.rollout import GenerationRequest, generate
from a3po.rollout.local import LocalEngine
from a3po.rollout.prompts import encode_prompt
from a3po.trainer.checkpoint import CheckpointError, load_engine
from a3po.trainer.engine import TrainEngine, eval_mode
from a3po.trainer.records import read_batch, read_info, recorded

RESULTS = "results"  # results.md and results.json
# what a replayed step's own statistics keep (algo/stats.py): where its clip, dual clip and cap acted, per d too
KEPT_STATS = ("loss/clipped_frac", "loss/dual_clipped_frac", "loss/behav_capped_frac", "loss/ratio_mean",
              "loss/ratio_max", "train/grad_norm", "train/n_tokens", "loss/tis_truncated_frac",
              "loss/corr_masked_frac", "loss/corr_masked_seq_frac")
PER_D_STATS = ("loss/clipped_frac_d", "loss/behav_capped_frac_d", "loss/tis_truncated_frac_d",
               "loss/corr_masked_frac_d")


def kept(stats: dict[str, float]) -> dict[str, float]:
    return {k: x for k, x in stats.items() if k in KEPT_STATS or k.startswith(PER_D_STATS)}


@dataclass(frozen=True)
class FidelityArm:
    name: str
    label: str
    actor: dict  # the ActorConfig keys the arm sets (a section's as a dict of its keys); every other is the run's

    def config(self, run: ActorConfig) -> ActorConfig:
        return dataclasses.replace(run, **{k: dataclasses.replace(getattr(run, k), **v) if isinstance(v, dict) else v
                                           for k, v in self.actor.items()})


def correction_arm(name: str) -> FidelityArm:
    """A correction or surrogate arm of bench/args.py CORRECTION_ARMS: its method's proximal policy and its actor
    keys, parsed and typed as the command line would."""
    label, method, overrides = CORRECTION_ARMS[name]
    keys = apply_overrides({}, list(overrides))["actor"]
    return FidelityArm(name, label, {**DECOUPLED, "prox_logp_method": method, **keys})


DECOUPLED = {"use_decoupled_loss": True}
ARMS = {a.name: a for a in (
    FidelityArm("recompute", "recompute, replayed a second time (the determinism check)",
                {**DECOUPLED, "prox_logp_method": "recompute"}),
    FidelityArm("loglinear", "A-3PO: loglinear interpolation", {**DECOUPLED, "prox_logp_method": "loglinear"}),
    FidelityArm("linear", "linear interpolation", {**DECOUPLED, "prox_logp_method": "linear"}),
    FidelityArm("coupled", "coupled PPO: p = b, w = 1", {"use_decoupled_loss": False}),
    FidelityArm("recompute-noclip", "recompute without the clip, the dual clip or the cap",
                {**DECOUPLED, "prox_logp_method": "recompute", **NO_CLIP_BOUNDS}),
    FidelityArm("reuse", "p = theta: sg(theta) at every minibatch", {**DECOUPLED, "prox_logp_method": "reuse"}),
    *map(correction_arm, CORRECTION_ARMS),
)}
assert tuple(ARMS) == FIDELITY_ARMS and REFERENCE == "recompute"


def spread_steps(total: int, n: int = 4) -> list[int]:
    """`n` steps spread evenly over 1..total, the last one included."""
    return sorted({max(1, round(total * k / n)) for k in range(1, n + 1)})


def trained(engine: TrainEngine) -> list[Tensor]:
    return [p for p in engine.model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- replaying one run's records


class Replayer:
    """One run's records, replayed: its configuration, initial model and held-out prompts, loaded once."""

    def __init__(self, run_dir: Path, heldout: int):
        self.run_dir = run_dir
        self.cfg: Config = load_config(run_dir / "config.yaml")
        self.base, self.tok = load_policy(self.cfg.actor.path, seed=self.cfg.seed)
        self.device = resolve_device(self.cfg.actor.device, "actor.device")
        data = load_task(self.cfg.train_dataset, self.cfg.evaluator.size, self.cfg.seed)
        self.prompts = [encode_prompt(self.tok, ex, self.cfg.train_dataset.system_prompt)
                        for ex in data.eval[:heldout]]

    def engine(self, actor: ActorConfig, record: Path) -> TrainEngine:
        """A fresh engine for `actor`, in the recorded state."""
        g = self.cfg.gconfig
        torch.manual_seed(self.cfg.seed)  # as ranks.build_engine (LoRA's initial adapters; the record's replace them)
        engine = TrainEngine(copy.deepcopy(self.base), actor,
                             self.cfg.total_train_steps * self.cfg.actor.ppo_n_minibatches,
                             temperature=self.cfg.gconfig.temperature, device=self.device,
                             sampling=SamplingFilter(g.top_k, g.top_p, g.min_p))
        try:
            load_engine(engine, record)
        except (CheckpointError, ValueError) as e:
            raise ConfigError(f"record {record}: {e}") from None
        return engine

    def continuations(self, engine: TrainEngine) -> list[tuple[list[int], list[int]]]:
        """(prompt, greedy continuation by the engine's policy) for each held-out prompt."""
        if not self.prompts:
            return []
        g = self.cfg.gconfig
        local = LocalEngine(engine.sampling_model(), eos_token_ids=end_ids(self.base, self.tok), decode=self.tok.decode,
                            forward=self.cfg.rollout.forward)
        outs = generate(local, [GenerationRequest(p, g.max_new_tokens, rid=i, greedy=True, stop=tuple(g.stop))
                                for i, p in enumerate(self.prompts)])
        return [(p, list(o.output_ids)) for p, o in zip(self.prompts, outs)]

    @torch.no_grad()
    def kl(self, ref, model, seqs: list[tuple[list[int], list[int]]]) -> Tensor:
        """KL(ref || model) per position that predicts a continuation token, over all `seqs`: (N,)."""
        t = self.cfg.gconfig.temperature
        out = [torch.zeros(0)]
        with eval_mode(ref), eval_mode(model):
            for prompt, cont in seqs:
                if not cont:
                    continue
                ids = torch.tensor([prompt + cont], device=self.device)
                at = slice(len(prompt) - 1, len(prompt) + len(cont) - 1)  # position i predicts token i + 1
                logp = [torch.log_softmax(m(input_ids=ids).logits[0, at].double() / t, -1) for m in (ref, model)]
                out.append(kl_rows(*logp).cpu())
        return torch.cat(out)


@dataclass
class Step:
    """One replayed step: the update net of the carried part (P,), what ppo_update logged, the engine after it."""

    update: Tensor
    stats: dict[str, float]
    engine: TrainEngine


def replay(rp: Replayer, record: Path, arms: list[str], split: list[str],
           log: Callable[[str], None] = progress) -> dict:
    """Every arm's update on `record` against recompute's, whole and per part (module docstring)."""
    t0 = time.perf_counter()
    info, batch = read_info(record), read_batch(record)
    v = info["version"]
    parts = cells(staleness(batch.versions, v), batch.advantages, batch.loss_mask, split)
    run_actor = rp.cfg.actor
    ref_actor = ARMS[REFERENCE].config(run_actor)
    head = {"run": str(rp.run_dir), "step": info["step"], "version": v, "sequences": len(batch),
            "minibatches": run_actor.ppo_n_minibatches, "tokens": int(batch.loss_mask.sum()),
            "signal_tokens": int(parts[ALL].sum()), "d": d_values(staleness(batch.versions, v), batch.loss_mask)}
    if not parts[ALL].any():  # every advantage 0 (a batch of equal rewards): no arm has an update to compare
        log(f"  step {info['step']}: every advantage is 0, nothing to compare")
        return {**head, "heldout_tokens": 0, "carried_share": None, "wall_s": time.perf_counter() - t0,
                "reference_stats": {}, "rows": []}

    # 1. The carried part: the step with every advantage 0. The pre-step policy continues the held-out prompts.
    engine = rp.engine(ref_actor, record)
    before = flat(trained(engine))
    seqs = rp.continuations(engine)
    engine.ppo_update(replace(batch, advantages=torch.zeros_like(batch.advantages)))
    carried = flat(trained(engine)) - before
    del engine

    def step(actor: ActorConfig, adv: Tensor) -> Step:
        engine = rp.engine(actor, record)
        stats = engine.ppo_update(replace(batch, advantages=adv))
        u = flat(trained(engine))
        u -= before
        u -= carried
        return Step(u, kept(stats), engine)

    # 2. Per part (the whole batch first): recompute's step, then every arm's against it.
    rows: list[dict] = []
    reference: dict[str, dict] = {}  # recompute's own statistics, per part
    carried_share = float("nan")
    for name, mask in parts.items():
        if name != ALL and torch.equal(mask, parts[ALL]):
            rows += [{**r, "cell": name} for r in rows if r["cell"] == ALL and r["arm"] != REFERENCE]
            continue
        adv = batch.advantages if name == ALL else only(batch.advantages, mask)
        ref = step(ref_actor, adv)
        reference[name] = ref.stats
        ref_policy = ref.engine.sampling_model() if name == ALL and seqs else None
        if name == ALL:
            carried_share = math.sqrt(dot(carried, carried)) / max(sum_norm(ref.update, carried), 1e-30)
        ref.engine = None  # its optimizer state goes; the policy stays for the KL
        for arm in arms:
            if arm == REFERENCE and name != ALL:
                continue  # the determinism check runs once, on the whole step
            s = step(ARMS[arm].config(run_actor), adv)
            kl = rp.kl(ref_policy, s.engine.sampling_model(), seqs) if ref_policy is not None else None
            a = agreement(s.update, ref.update)
            rows.append({"arm": arm, "cell": name, "tokens": int(mask.sum()), "cos": a.cos, "rel_norm": a.rel_norm,
                         "rel_err": a.rel_err, "kl": kl.mean().item() if kl is not None and kl.numel() else None,
                         "kl_max": kl.max().item() if kl is not None and kl.numel() else None,
                         "stats": s.stats})
            log(f"  step {info['step']} {name:<6} {arm:<17} cos {a.cos:.6f}  |u|/|u_rec| {a.rel_norm:.4f}  "
                f"|u - u_rec|/|u_rec| {a.rel_err:.3g}" + (f"  KL {rows[-1]['kl']:.3g}" if kl is not None else ""))
            del s
    return {**head, "heldout_tokens": sum(len(c) for _, c in seqs), "carried_share": carried_share,
            "wall_s": time.perf_counter() - t0, "reference_stats": reference, "rows": rows}


# ----------------------------------------------------------------------------- the command


class RecordingFailed(RuntimeError):
    """The run that was to record the batches stopped; its log says why."""


def recording_configs(args: FidelityArgs) -> list[Config]:
    """The configuration of each recording run, one per seed, checked before anything is written."""
    base = load_config(args.config, args.overrides, preset=args.preset)
    steps = args.steps or spread_steps(base.total_train_steps)
    late = [s for s in steps if s > base.total_train_steps]
    if late:
        raise ConfigError(f"--steps: {late[0]} is beyond total_train_steps={base.total_train_steps}")
    extra = [f"rollout.max_head_offpolicyness={args.eta}", f"actor.ppo_n_minibatches={args.minibatches}",
             f"saver.record_steps=[{','.join(map(str, steps))}]", "evaluator.freq_steps=0", "evaluator.initial=false"]
    return [load_config(args.config, [*args.overrides, *extra, f"seed={seed}"], preset=args.preset)
            for seed in range(base.seed, base.seed + args.seeds)]


def record_runs(configs: list[Config], bench_dir: Path, keep_checkpoints: bool) -> list[Path]:
    """Train the recording runs, each as `a3po train` in a child process (bench/runs.py); their folders."""
    dirs = []
    for i, cfg in enumerate(configs):
        r = run_one(PlannedRun(f"seed{cfg.seed}", cfg, {"seed": cfg.seed}), bench_dir, f"[{i + 1}/{len(configs)}]",
                    lambda rows, cfg: {})
        if not r["ok"]:
            raise RecordingFailed(f"the recording run failed (exit {r['returncode']}): {r['error']}  [log: {r['log']}]")
        if not keep_checkpoints:
            shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
        dirs.append(Path(r["run_dir"]))
    return dirs


def records_of(run_dir: Path, steps: list[int] | None) -> list[Path]:
    """The records of `run_dir` to replay (those of `steps` when given); a ConfigError if there are none."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--run {run_dir}: not a run folder (it has no config.yaml)")
    found = {read_info(p)["step"]: p for p in recorded(run_dir)}
    if not found:
        raise ConfigError(f"--run {run_dir}: it holds no records; train it with saver.record_steps=[...]")
    missing = [s for s in steps or [] if s not in found]
    if missing:
        raise ConfigError(f"--steps: {run_dir} holds no record of step {missing[0]}; "
                          f"it has {', '.join(map(str, found))}")
    return [found[s] for s in sorted(steps or found)]


def run(args: FidelityArgs, argv: list[str]) -> dict:
    torch.set_num_threads(args.threads or split_threads(1, None)[1])
    t0 = time.perf_counter()
    if args.run is not None:  # a bad folder, like a bad configuration, is one line before anything is written
        runs = [Path(args.run)]
        records_of(runs[0], args.steps)
        fileroot = runs[0].parent
    else:
        configs = recording_configs(args)
        fileroot = Path(configs[0].fileroot)
    out = unique_dir(Path(args.out) if args.out else fileroot / "bench-fidelity")
    if args.run is None:
        progress(f"bench fidelity: {len(configs)} recording run(s) in {out}")
        runs = record_runs(configs, out, args.keep_checkpoints)
    arms = [a for a in FIDELITY_ARMS if a in args.arms]
    records = []
    for run_dir in runs:
        rp = Replayer(run_dir, args.heldout)
        todo = records_of(run_dir, args.steps if args.run is not None else None)
        progress(f"bench fidelity: replaying {len(todo)} record(s) of {run_dir} x {len(arms)} arm(s)"
                 + (f", split by {', '.join(args.split)}" if args.split else ""))
        for rec in todo:
            records.append(replay(rp, rec, arms, args.split))
    record = {"benchmark": "fidelity", "command": shlex.join(["a3po", "bench", "fidelity", *argv]),
              "args": dataclasses.asdict(args), "machine": machine(), "torch": torch.__version__,
              "arms": {a: ARMS[a].label for a in arms}, "runs": [str(r) for r in runs],
              "wall_s": time.perf_counter() - t0, "summary": summary(records), "records": records}
    save_report(out, RESULTS, record, markdown(record))
    return record


def main(args: FidelityArgs, argv: list[str]) -> int:
    try:
        record = run(args, argv)
    except RecordingFailed as e:
        progress(f"a3po: bench fidelity: {e}")
        return 1
    text = markdown(record)
    print(text)
    print(f"written: {record['out']}/{RESULTS}.md, {record['out']}/{RESULTS}.json")
    print(json_line({k: x for k, x in record.items() if k not in ("args", "records")}))  # the pooled table
    return 0

