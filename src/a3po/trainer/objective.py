"""The objective a run trains with, read once from its actor config: the loss specification.

    spec = loss_spec(cfg.actor)        # algo/loss.LossSpec, passed whole to every ppo_loss call

The one place where config keys become loss settings; the loss itself (algo/loss.py) knows
no config.
"""

from __future__ import annotations

from a3po.algo.corrections import CorrectionSpec
from a3po.algo.loss import LossSpec
from a3po.config.schema import ActorConfig


def loss_spec(cfg: ActorConfig) -> LossSpec:
    """The loss settings of actor config `cfg`.

    Coupled PPO (use_decoupled_loss=false) has p = b, so w = 1: it neither caps w (whose key keeps its
    default) nor runs M2PO (which drops tokens by log(p/b); the config refuses it there). With
    kl_in_reward the KL is charged to the rewards before the advantages, so the loss has no KL term.
    The off-policy corrections pass whole: under coupled PPO the config admits only those that read
    exp(theta - b) (correction.ratio=current) and OPSM, since exp(p - b) is 1 there."""
    decoupled = cfg.use_decoupled_loss
    return LossSpec(
        eps_clip=cfg.eps_clip,
        eps_clip_higher=cfg.eps_clip_higher,
        c_clip=cfg.c_clip,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap if decoupled else None,
        behav_imp_weight_mode=cfg.behav_imp_weight_mode,
        importance_sampling_level=cfg.importance_sampling_level,
        m2_threshold=cfg.m2_threshold if decoupled else None,
        correction=CorrectionSpec(**vars(cfg.correction)),
        policy_loss=cfg.policy_loss,
        sapo_tau_pos=cfg.sapo_tau_pos,
        sapo_tau_neg=cfg.sapo_tau_neg,
        agg_mode=cfg.loss_agg_mode,
        agg_norm=cfg.loss_agg_norm,
        entropy_coef=cfg.entropy_coef,
        kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_ctl,
    )
