"""`a3po bench e2e`: the paper's comparison as real training runs, side by side.

Each arm is a complete `a3po train` in its own process, on one configuration that
differs between arms only in the keys the arm names (below): same model, task, seeds,
number of steps and data order (DataOrder depends on the seed alone). Arms alternate
within each seed so that drifting machine load falls on all of them.

Time is the training loop's own (the sum of `perf/step_s`: collecting the batch, the
update, weight sync), without process start-up and evaluation; held-out accuracy is
measured at step 0 and after the last step only, so that evaluation pauses never hand
the asynchronous arms free generation time. Results are written after every finished
run: an interrupted benchmark keeps what it measured, and `--out DIR` on the same
directory continues it, skipping the runs already done (bench/runs.py, shared with
`a3po bench staleness`).

    a3po bench e2e --seeds 2                              # the full comparison
    a3po bench e2e --preset tiny total_train_steps=3      # a quick look
    python -m a3po.bench.e2e DIR                           # the tables again from DIR/results.json
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from a3po.bench.args import ARM_NAMES, E2EArgs
from a3po.bench.runs import RESULTS, Arm, Benchmark, PlannedRun, run_benchmark, summarize_run
from a3po.bench.stub_scorer import StubScorer
from a3po.config import ConfigError, load_config
from a3po.files import write_json

ARMS = {a.name: a for a in (
    Arm("sync", "synchronous GRPO (eta = 0, coupled loss)",
        ("rollout.max_head_offpolicyness=0", "actor.use_decoupled_loss=false")),
    Arm.trains_with("recompute", "async decoupled PPO, proximal policy recomputed", "recompute", one_step=True),
    Arm.trains_with("loglinear", "async A-3PO (loglinear interpolation)", "loglinear", one_step=True),
    Arm.trains_with("linear", "async, linear interpolation in probability", "linear", one_step=True),
    Arm.trains_with("reuse", "async, p = sg(theta), one minibatch", "reuse", one_step=True),
    Arm.trains_with("metrics", "async recompute, logging every approximation's error", "metrics", one_step=True),
    Arm.trains_with("lora", "A-3PO training LoRA adapters of rank 16 on the frozen base (actor.lora.rank=16)",
                    "loglinear", "actor.lora.rank=16"),
    Arm.trains_with("ranks2", "A-3PO with 2 data-parallel trainer ranks (FSDP2)", "loglinear",
                    "cluster.n_trainer_ranks=2"),
    Arm.trains_with("ray", "A-3PO with the rollout worker a Ray actor, weights through Ray's object store",
                    "loglinear", "cluster.launcher=ray"),
    Arm.trains_with("service", "A-3PO with the exact reward from a reward service on 127.0.0.1 that answers after "
                    "--service-delay-s (bench/stub_scorer.py) instead of the rule", "loglinear",
                    "reward_service.kind=scorer", "reward_service.rule_weight=0"),
    Arm.trains_with("lockstep", "A-3PO with rollout.lockstep=true: each batch sampled whole by version k - eta, "
                    "a run repeatable from its seed (what that costs in speed)", "loglinear", "rollout.lockstep=true"),
)}
assert tuple(ARMS) == ARM_NAMES


def arm_configs(args: E2EArgs, service_url: str | None = None) -> list[PlannedRun]:
    """Every (arm, seed) configuration, validated before anything runs (`args` is checked: its arms exist);
    service_url: where the service arm's reward service answers."""
    base = load_config(args.config, args.overrides, preset=args.preset)
    out = []
    for i in range(args.seeds):
        seed = base.seed + i
        for name in args.arms:
            arm = ARMS[name]
            extra = [*arm.overrides, f"seed={seed}", f"evaluator.freq_steps={base.total_train_steps}"]
            if name == "service":
                extra.append(f"reward_service.url={service_url}")
            try:
                cfg = load_config(args.config, [*args.overrides, *extra], preset=args.preset)
            except ConfigError as e:
                raise ConfigError(f"arm '{name}' ({' '.join(arm.overrides)}): {e}") from None
            out.append(PlannedRun(run_key(arm.name, seed), cfg, {"arm": arm.name, "seed": seed}))
    return out


def run_key(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def run(args: E2EArgs, argv: list[str]) -> tuple[dict, int]:
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(StubScorer(args.service_delay_s)).url if "service" in args.arms else None
        bench = Benchmark(
            name="e2e", plan=arm_configs(args, url), summarize=summarize_run, write=write_results,
            description=f"{', '.join(args.arms)} x {args.seeds} seed(s)",
            key_of=lambda r: run_key(r["arm"], r["seed"]),  # results written before runs carried their key
        )
        return run_benchmark(bench, args, argv)


def write_results(bench_dir: Path, header: dict, runs: list[dict], wall_s: float) -> dict:
    from a3po.bench.report import aggregate, approx_quality, markdown, plot

    record = {**header, "wall_s": wall_s, "runs": runs, "table": aggregate(runs), "approx": approx_quality(runs)}
    record["plots"] = plot(runs, bench_dir / "plots")
    write_json(bench_dir / RESULTS, record)
    (bench_dir / "results.md").write_text(markdown(record, bench_dir))
    return record


def regenerate(bench_dir: Path) -> dict:
    """results.md, the tables and the plots again from bench_dir/results.json alone (nothing trains)."""
    record = json.loads((bench_dir / RESULTS).read_text())
    header = {k: v for k, v in record.items() if k not in ("wall_s", "runs", "table", "approx", "plots")}
    return write_results(bench_dir, header, record["runs"], record["wall_s"])


def main(args: E2EArgs, argv: list[str]) -> int:
    record, status = run(args, argv)
    if record["runs"]:
        print((Path(record["out"]) / "results.md").read_text())
        print(f"written: {record['out']}/results.md, {RESULTS}, plots/")
    return status


if __name__ == "__main__":  # python -m a3po.bench.e2e DIR [DIR ...]
    import sys

    for folder in sys.argv[1:] or ["."]:
        regenerate(Path(folder))
        print(f"wrote {Path(folder) / 'results.md'}")
