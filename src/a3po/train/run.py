"""Entry point of `a3po train`.

The asynchronous system (rollout workers, trajectory queue, trainer, weight sync) is
built in the issues that follow the foundation; until then this prints the plan the
resolved configuration describes, so the command and its config handling are real.
"""

from __future__ import annotations

from a3po.algo import get_method
from a3po.config import Config


def describe(cfg: Config) -> str:
    a, g, r, d = cfg.actor, cfg.gconfig, cfg.rollout, cfg.train_dataset
    method = get_method(a.prox_logp_method) if a.use_decoupled_loss else None
    loss = (
        f"decoupled PPO, proximal log-probs by '{method.name}'"
        f" ({'one extra forward pass per step' if method.needs_recompute else 'no extra forward pass'})"
        if method else "coupled PPO/GRPO (proximal = behaviour policy)"
    )
    mode = "synchronous (eta = 0)" if r.max_head_offpolicyness == 0 else f"asynchronous, staleness bound eta = {r.max_head_offpolicyness}"
    return "\n".join([
        f"model     {a.path} ({a.dtype})",
        f"task      {d.task} {d.task_params if d.task != 'file' else d.path}, reward: {d.reward}",
        f"batch     {d.batch_size} prompts x {g.n_samples} samples, up to {g.max_new_tokens} new tokens, T={g.temperature}",
        f"loss      {loss}; clip {a.eps_clip}/{a.eps_clip_higher or a.eps_clip}, {a.ppo_n_minibatches} minibatch(es)",
        f"rollout   {mode}, {r.n_workers} worker(s)",
        f"steps     {cfg.total_train_steps}, lr {a.optimizer.lr}, eval every {cfg.evaluator.freq_steps}",
    ])


def train(cfg: Config, resume: str | None = None) -> int:
    print("a3po train: resolved plan")
    print(describe(cfg))
    print("the training loop is not built yet: this run stops after validating the configuration")
    return 0
