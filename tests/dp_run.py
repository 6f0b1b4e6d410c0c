"""PPO updates of the tiny model on N trainer ranks, run by tests/test_parallel.py under torchrun.

    python -m torch.distributed.run --nproc-per-node 2 tests/dp_run.py MODE OUT [--resume DIR] [--seeds 1,2] [--lora]
        [--corrections]

Rank 0 drives, as `a3po train` does: it optionally resumes from DIR, trains one step per seed
on `fixed_batch(seed)`, saves a checkpoint into OUT and writes each step's statistics to
OUT/stats.json; the other ranks follow its commands.
"""

import argparse
import copy
import json
from pathlib import Path

import torch

from a3po.algo import normalize_advantages
from a3po.config import load_config
from a3po.models import load_policy
from a3po.trainer import checkpoint, parallel, ranks
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate

# two minibatches of 5 rows and a small token budget: the ranks get unequal rows and micro-batch counts
OVERRIDES = ["actor.dtype=float32", "actor.optimizer.lr=1e-3", "actor.ppo_n_minibatches=2",
             "actor.mb_spec.max_tokens_per_mb=24", "total_train_steps=4"]
LORA = ["actor.lora.rank=4", "actor.lora.lr=1e-2"]  # --lora: adapters only
# --corrections: a surrogate, a sequence-level mask and token TIS, whose sequences and token counts split over ranks
CORRECTIONS = ["actor.policy_loss=cispo", "actor.correction.ratio=current", "actor.correction.mis=geometric",
               "actor.correction.mis_low=0.98", "actor.correction.mis_high=1.02", "actor.correction.tis=token",
               "actor.correction.tis_cap=1.05"]


def fixed_batch(model, seed: int, n: int = 10, group: int = 5):
    """Random tokens with rewards and the initial weights' log-probs as behaviour (version 0)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    trajs = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (3 + i % 4,), generator=g).tolist()
        out = torch.randint(3, vocab, (2 + (i * 7) % 6,), generator=g).tolist()
        trajs.append(Trajectory(prompt, out, [0.0] * len(out), [0] * len(out), reward=float((i + seed) % 3 == 0)))
    batch = collate(trajs, normalize_advantages(torch.tensor([t.reward for t in trajs]), group))
    batch.logp_behav = TrainEngine(copy.deepcopy(model), load_config(None, OVERRIDES).actor, 1).compute_logp(batch)
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("out")
    ap.add_argument("--resume")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--corrections", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, [*OVERRIDES, *(LORA if args.lora else []), *(CORRECTIONS if args.corrections else []),
                             f"cluster.data_parallel={args.mode}"])
    rank, world = ranks.torchrun_rank()
    model, _ = load_policy("tiny", seed=cfg.seed)
    batches = [fixed_batch(model, int(s)) for s in args.seeds.split(",")] if rank == 0 else []
    dp = parallel.init(rank, world, args.mode, 120, torch.device("cpu"))
    engine = ranks.build_engine(cfg, model, torch.device("cpu"), dp)
    try:
        if rank > 0:
            dp.follow(ranks.follower_commands(engine))
            return
        if args.resume:
            checkpoint.load_engine(engine, args.resume)
        stats = [engine.ppo_update(b) for b in batches]
        checkpoint.save_engine(engine, args.out)
        (Path(args.out) / "stats.json").write_text(json.dumps(stats))
        dp.stop()
    finally:
        parallel.close()


if __name__ == "__main__":
    main()
