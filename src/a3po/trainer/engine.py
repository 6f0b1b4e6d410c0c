"""The training engine: log-probs of a batch and the PPO update, over a Hugging Face causal LM.

    engine = TrainEngine(model, cfg.actor, total_optimizer_steps, temperature=cfg.gconfig.temperature)
    stats = engine.ppo_update(batch)         # one training step: version v -> v + 1

One training step (`ppo_update`) reads top to bottom:
  1. proximal log-probs that need a forward pass (`recompute`, `metrics`) - the pass A-3PO removes;
     like every no-grad pass (the reference policy's too) it runs in eval mode (`eval_mode`);
  2. for each of `ppo_n_minibatches` minibatches: micro-batches by token budget, each a
     forward pass with gradient, the proximal log-probs of the configured method, the
     decoupled PPO loss, backward; then grad-norm clipping and one optimizer step;
  3. version += 1, and statistics.

The step has no branch for what varies around it; each sits behind one small object:
  - the loss's settings: one frozen `LossSpec`, built once from the config (trainer/objective.py);
  - the processes: `self.ranks` (trainer/parallel.py), one process or data-parallel ranks, which
    decides each rank's share, its passes, the gradient sync and the loss scale, and brings the
    statistics and the new weights to rank 0;
  - what trains: `self.trained` (trainer/weights.py), every weight or LoRA adapters, which holds
    the reference policy, what is published and sampled from, and what checkpoints hold.

With actor.kl_ctl > 0 the reference policy is the initial weights (with LoRA, the base). Its KL
is added to the loss per token, or with actor.kl_in_reward charged to the rewards through
`reference_kl`, which the trainer calls before it computes advantages (pipeline/loop.py).

Weights stay fp32 (master copy); with dtype=bfloat16 the forward/backward run under
autocast, faster than fp32 on CPUs with AMX/AVX512-BF16 (docs/design.md §9) but much slower on
AVX2-only CPUs, which emulate bf16, hence dtype=auto. Log-probs are computed only on output
tokens and one vocabulary chunk at a time (trainer/logprobs.py). The micro-batch token
budget counts padded tokens, so micro-batches are formed from length-sorted rows and
trimmed to their own longest row (tight padding).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from a3po.algo import (
    LossTerms,
    approx_error_stats,
    approximation_errors,
    get_method,
    kl_penalty,
    loss_by_staleness,
    loss_stats,
    mismatch_stats,
    ppo_loss,
    proximal_logp,
    staleness,
)
from a3po.algo.filters import NO_FILTER, SamplingFilter
from a3po.algo.prox import ApproxErrors
from a3po.config.choices import Dtype
from a3po.config.schema import ActorConfig
from a3po.devices import resolve_dtype, synchronize, torch_dtype
from a3po.trainer.logprobs import PolicyLogp
from a3po.trainer.objective import loss_spec
from a3po.trainer.optim import build_optimizer
from a3po.trainer.parallel import OneProcess, Ranks
from a3po.trainer.weights import Weights, trained_weights
from a3po.trajectories import TrainBatch


@contextmanager
def eval_mode(module: torch.nn.Module):
    """`module` in eval mode for a no-grad log-prob pass, each submodule's own mode restored after.

    Such a pass stands for the policy itself (the proximal policy is theta of this version, the
    reference is the initial theta): in train mode dropout would draw a random mask, and the
    log-probs would be those of one random thinned network, different on every call."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@dataclass
class MicroStats:
    """What one micro-batch gives the step's statistics: its loss and, on each of its N output tokens
    (the loss mask's, in order), the loss terms and log-probs, each (N,). Ranks send theirs to rank 0
    (Ranks.finish_step), where `_stats` joins every micro-batch's into one row."""

    loss: Tensor  # () the micro-batch's loss
    terms: LossTerms
    logp: Tensor  # the current weights' (theta), detached
    prox: Tensor  # the proximal policy's
    behav: Tensor  # the behaviour policy's (the sampler's)
    entropy: Tensor
    versions: Tensor  # the version that sampled each token
    adv: Tensor  # the advantage of each token
    grad_coef: Tensor  # dloss/dtheta_t: each token's weight in the gradient
    # bool: sampled by version v itself, before this step's first optimizer step changed the weights:
    # theta and b there differ only by train/rollout numerics
    fresh: Tensor
    kl_ref: Tensor | None = None  # KL to the reference, when it is in the loss
    errors: dict[str, ApproxErrors] | None = None  # each approximation's error (prox_logp_method=metrics)


def _on(record, mask: Tensor):
    """A dataclass of (B, T) tensors (LossTerms, ApproxErrors) on the tokens of `mask` only: each (N,)."""
    return type(record)(**{f.name: getattr(record, f.name)[mask] for f in dataclasses.fields(record)})


def _joined(records: list):
    """Dataclasses of (N_i,) tensors as one of (1, sum N_i): every micro-batch's tokens in one row."""
    return type(records[0])(**{f.name: _row([getattr(r, f.name) for r in records])
                               for f in dataclasses.fields(records[0])})


def _row(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts)[None]


def micro_batches(batch: TrainBatch, max_tokens: int) -> list[list[int]]:
    """Row groups whose padded size (rows x longest row) fits the token budget; one long row may exceed it."""
    lengths = batch.attention_mask.sum(-1).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def minibatches(n_rows: int, n: int) -> list[list[int]]:
    """`n` contiguous, near-equal row ranges (groups of a prompt stay together when sizes divide)."""
    bounds = [round(k * n_rows / n) for k in range(n + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(n) if bounds[k + 1] > bounds[k]]


class TrainEngine:
    def __init__(self, model, cfg: ActorConfig, total_optimizer_steps: int, temperature: float = 1.0,
                 device: torch.device | str = "cpu", ranks: Ranks | None = None,
                 sampling: SamplingFilter = NO_FILTER):
        self.device = torch.device(device)
        self.model = model.float().to(self.device)
        self.cfg = cfg
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.temperature, self.sampling = temperature, sampling  # the distribution the engine samples from
        self.version = 0
        self.ranks: Ranks = ranks or OneProcess()
        self.method = get_method(cfg.prox_logp_method) if cfg.use_decoupled_loss else None
        self.spec = loss_spec(cfg)
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("models whose output layer has a bias are not supported by the chunked log-prob path yet")
        if cfg.gradient_checkpointing:  # transformers 5 renamed it; older releases only have the old name
            enable = (getattr(self.model, "activation_checkpointing_enable", None)
                      or self.model.gradient_checkpointing_enable)
            enable()
        self.model.config.use_cache = False
        # the forward's compute dtype under autocast; fp32 runs without autocast
        self.autocast = torch_dtype(self.dtype) if self.dtype != Dtype.FLOAT32 else None
        self.trained: Weights = trained_weights(self.model, cfg, self._policy_of)  # LoRA attaches its adapters here
        self.policy = self._policy_of(self.model)
        # rank 0's whole model (the model itself in one process): what weight sync publishes, evaluation
        # samples from and checkpoints hold
        self.whole = self.ranks.whole_copy(self.model)
        self.policy = self.ranks.wrap(self.policy)
        optim_cfg = dataclasses.replace(cfg.optimizer, lr=self.trained.learning_rate(cfg.optimizer.lr))
        self.optimizer, self.scheduler = build_optimizer([p for p in self.policy.parameters() if p.requires_grad],
                                                         optim_cfg, total_optimizer_steps)
        self.trainable_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @property
    def ref_model(self):
        """The frozen reference model, where the KL needs a second copy (full weights, actor.kl_ctl > 0)."""
        return self.trained.ref_model

    def _policy_of(self, model) -> PolicyLogp:
        return PolicyLogp(model, self.temperature, self.autocast, self.cfg.fp32_lm_head, self.sampling)

    # -- forward --------------------------------------------------------------------------

    def _logp(self, policy, batch: TrainBatch, with_entropy: bool = True) -> tuple[Tensor, Tensor]:
        """(log-probs, entropy) of every output token, on its own position: both (B, T), 0 elsewhere
        (entropy all 0 without with_entropy: the no-grad passes never read it)."""
        pred_mask = batch.loss_mask[:, 1:]  # (B, T-1): hidden at position i predicts token i + 1
        logp_tok, ent_tok = policy(batch.input_ids, batch.attention_mask, pred_mask, with_entropy)
        full_mask = torch.zeros_like(batch.loss_mask)
        full_mask[:, 1:] = pred_mask
        logp = torch.zeros(batch.input_ids.shape, dtype=logp_tok.dtype, device=logp_tok.device)
        ent = torch.zeros(batch.input_ids.shape, dtype=ent_tok.dtype, device=ent_tok.device)
        return logp.masked_scatter(full_mask, logp_tok), ent.masked_scatter(full_mask, ent_tok)

    @torch.no_grad()
    def compute_logp(self, batch: TrainBatch, model=None, rows: list[int] | None = None) -> Tensor:
        """Log-probs (B, T) of the current weights (or of another causal LM `model`, such as the reference),
        without gradient, in eval mode (`eval_mode`), micro-batched, on `rows` only when given (0 on the
        others). With several ranks, for the current weights, a collective; another model's pass is this
        rank's alone."""
        policy, ranks = (self.policy, self.ranks) if model is None else (self._policy_of(model), OneProcess())
        batch = batch.to(self.device)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        with eval_mode(policy):
            for p in ranks.passes(self._micro_groups(batch, list(range(len(batch))) if rows is None else rows),
                                  filler=[0]):
                logp, _ = self._logp(policy, batch.select(p.rows), with_entropy=False)
                if p.counts:
                    out[p.rows, : logp.shape[1]] = logp.float()
        return out

    def _micro_groups(self, batch: TrainBatch, rows: list[int]) -> list[list[int]]:
        """`rows` of `batch` in micro-batches (`micro_batches`), as row numbers of `batch`; none for no rows."""
        if not rows:
            return []
        return [[rows[i] for i in g] for g in micro_batches(batch.select(rows), self.cfg.mb_spec.max_tokens_per_mb)]

    @torch.no_grad()
    def reference_kl(self, batch: TrainBatch) -> Tensor:
        """Per-token KL estimate (B, T) to the reference policy on the sampled tokens, 0 elsewhere:
        what actor.kl_in_reward charges each sequence's reward (rank 0 alone: no collective).

        It compares the behaviour log-probs with the reference's: the tokens were drawn from pi_behav,
        so the estimator is the one for KL(pi_behav || pi_ref), and the only forward pass is the
        reference's (micro-batched like compute_logp).
        """
        if self.cfg.kl_ctl == 0:
            raise ValueError("no reference model: actor.kl_ctl is 0")
        batch = batch.to(self.device)
        with self.trained.reference_model(self.whole) as reference:
            ref = self.compute_logp(batch, reference)
        kl = kl_penalty(batch.logp_behav, ref, self.cfg.kl_estimator)
        return torch.where(batch.loss_mask, kl, torch.zeros((), dtype=kl.dtype)).cpu()  # beside the rewards

    # -- one training step ----------------------------------------------------------------

    def ppo_update(self, batch: TrainBatch) -> dict[str, float]:
        """One training step. With several ranks, rank 0 calls it and the others follow (parallel.py);
        each trains on its share of every minibatch, and rank 0 alone returns the statistics."""
        self.ranks.announce("ppo_update", batch)
        v = self.version
        batch = batch.to(self.device)
        self.model.train()
        stats: dict[str, float] = {}
        minis = minibatches(len(batch), self.cfg.ppo_n_minibatches)
        own = [self.ranks.share(rows) for rows in minis]  # the rows this rank trains on

        # 1. Proximal log-probs that cost a forward pass of version v (of this rank's rows).
        logp_v, stats["perf/prox_logp_s"] = None, 0.0  # exactly 0 where no pass runs
        if self.method and self.method.needs_recompute:
            synchronize(self.device)  # each perf/ clock waits for the device's queued work (devices.py)
            t0 = time.perf_counter()
            logp_v = self.compute_logp(batch, rows=[i for rows in own for i in rows])
            synchronize(self.device)
            stats["perf/prox_logp_s"] = time.perf_counter() - t0

        # 2. One optimizer step per minibatch, gradients accumulated over micro-batches. The loss
        #    keeps the whole minibatch's token and sequence counts whatever share a rank trains on.
        t0 = time.perf_counter()
        pieces: list[MicroStats] = []
        grad_norms = []
        opt_s = 0.0
        for k, (rows, mine) in enumerate(zip(minis, own)):
            mini = batch.select(rows)
            n_tokens, n_seqs = mini.n_tokens, int((mini.loss_mask.sum(-1) > 0).sum())
            passes = self.ranks.passes(self._micro_groups(batch, mine), filler=rows[:1])
            for j, p in enumerate(passes):
                mb = batch.select(p.rows)
                rec = logp_v[p.rows, : mb.input_ids.shape[1]] if logp_v is not None else None
                with self.ranks.sync_grads(self.policy, last=j == len(passes) - 1):
                    piece = self._micro_step(mb, rec, v, n_tokens, n_seqs, first_minibatch=k == 0,
                                             scale=p.loss_scale)
                if p.counts:
                    pieces.append(piece)
            synchronize(self.device)
            t_opt = time.perf_counter()
            grad_norms.append(self._optimizer_step())
            synchronize(self.device)
            opt_s += time.perf_counter() - t_opt
        stats["perf/train_s"] = time.perf_counter() - t0
        stats["perf/optimizer_s"] = opt_s  # part of train_s: clipping, AdamW, scheduler

        # 3. Version bump; the new weights into rank 0's whole copy, statistics over every rank's tokens.
        self.version += 1
        self.model.eval()
        return self.ranks.finish_step(self.policy, self.whole, pieces,
                                      lambda every, synced: {**stats, **synced, **self._stats(every, v, grad_norms)})

    def _micro_step(self, mb: TrainBatch, logp_v: Tensor | None, v: int, n_tokens: int, n_seqs: int,
                    first_minibatch: bool, scale: float = 1) -> MicroStats:
        """Forward, loss and backward of one micro-batch; `scale` multiplies the loss that backward sees
        (the rank count under data parallelism, 0 for a pass that only keeps FSDP2's ranks in step)."""
        logp, entropy = self._logp(self.policy, mb)
        if self.method is None:
            prox = mb.logp_behav  # coupled PPO: p = b
        else:
            prox = proximal_logp(self.method.name, mb.logp_behav, logp, mb.versions, v, logp_v)
        kl = None
        if self.spec.kl_coef > 0:  # the KL to the reference is a term of the loss
            with torch.no_grad(), self.trained.reference_policy(self.policy) as ref_policy, eval_mode(ref_policy):
                ref, _ = self._logp(ref_policy, mb, with_entropy=False)
            kl = kl_penalty(logp, ref, self.cfg.kl_estimator)
        loss, terms = ppo_loss(logp, prox, mb.logp_behav, mb.advantages, mb.loss_mask, self.spec,
                               n_tokens=n_tokens, n_seqs=n_seqs, entropy=entropy, kl=kl)
        self.ranks.alone(lambda: _check_finite(loss, v))
        grad_coef = torch.autograd.grad(loss, logp, retain_graph=True)[0]  # through the loss only: cheap
        (loss * scale if scale != 1 else loss).backward()
        m = mb.loss_mask
        errors = None
        if self.method is not None and self.method.reports_errors:
            errs = approximation_errors(logp_v, mb.logp_behav, logp, mb.versions, v)
            errors = {name: _on(e, m) for name, e in errs.items()}
        return MicroStats(
            loss=loss.detach(), terms=_on(terms, m), logp=logp.detach()[m], prox=prox[m], behav=mb.logp_behav[m],
            entropy=entropy.detach()[m], versions=mb.versions[m], adv=mb.advantages[m], grad_coef=grad_coef[m],
            fresh=(mb.versions[m] == v) & first_minibatch,
            kl_ref=kl.detach()[m] if kl is not None else None, errors=errors,
        )

    def _optimizer_step(self) -> float:
        clip = self.cfg.optimizer.gradient_clipping
        params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError("gradient norm is not finite; "
                                     "lower actor.optimizer.lr or enable gradient_clipping")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _stats(self, pieces: list[MicroStats], v: int, grad_norms: list[float]) -> dict[str, float]:
        """Statistics over every output token of the step (all micro-batches joined into one row, (1, N)),
        and of its optimizer steps."""
        logp = _row([p.logp for p in pieces])
        mask = torch.ones_like(logp, dtype=torch.bool)  # every token of the row is an output token
        out = loss_stats(_joined([p.terms for p in pieces]), mask, logp, _row([p.prox for p in pieces]),
                         _row([p.entropy for p in pieces]))
        d = staleness(_row([p.versions for p in pieces]), v)
        out.update(loss_by_staleness(_joined([p.terms for p in pieces]), d, _row([p.adv for p in pieces]),
                                     _row([p.grad_coef for p in pieces])))
        out["train/n_tokens"] = float(mask.sum())
        out["loss/total"] = float(sum(p.loss for p in pieces) / max(1, self.cfg.ppo_n_minibatches))
        out.update(mismatch_stats(logp, _row([p.behav for p in pieces]), _row([p.fresh for p in pieces])))
        if pieces[0].kl_ref is not None:  # the KL in the loss; in the reward it is logged where it is computed
            out["loss/kl_ref"] = float(_row([p.kl_ref for p in pieces]).mean())
        if pieces[0].errors is not None:
            errs = {name: _joined([p.errors[name] for p in pieces]) for name in pieces[0].errors}
            out.update(approx_error_stats(errs, mask, _row([p.versions for p in pieces]), v))
        out["train/grad_norm"] = max(grad_norms)
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        out["train/trainable_params"] = float(self.trainable_params)
        return out

    # -- checkpoints and weight export ----------------------------------------------------

    def weights(self) -> dict[str, Tensor]:
        """What weight sync publishes, on rank 0 (trainer/weights.py): every weight under its Hugging Face
        name, tied ones included, or with LoRA the adapters' tensors and their scale only.

        Live views, not copies: the sync copies them once, straight into shared memory."""
        return self.trained.published(self.whole)

    def sampling_model(self):
        """The policy as a plain causal LM for a sampler (evaluation), on rank 0 (trainer/weights.py)."""
        return self.trained.sampling_model(self.whole)


def _check_finite(loss: Tensor, v: int) -> None:
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()} at version {v}; "
                                 "lower actor.optimizer.lr or check rewards/log-probs")
