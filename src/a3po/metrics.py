"""Every metric key a run logs, declared once: name, meaning or formula, unit, producer, condition.

The keys are a public interface: users chart them, `a3po bench` reads them back from
metrics.jsonl, and TensorBoard and W&B receive the same dict. They are written in a dozen
places (the loss statistics, the trainer, the loop, the evaluation), so this table is where
a reader finds them all and what each one means. It only documents: nothing at run time
reads it. tests/test_metrics.py runs real tiny runs and fails on a logged key this table
does not declare, and docs/metrics.md is generated from it (`python -m a3po.config.docs docs`).

A name holding `<placeholders>` declares a family of keys (one per worker, per staleness,
per approximation); `placeholders()` says what each one stands for. An entry whose `when`
is None is logged on every training step; the others say when they are. The formulas
use the notation of NOTATION.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import cache

from a3po.episode_end import EpisodeEnd

# Modules that write the keys, named once here so that each entry stays one line.
STATS = "a3po.algo.stats"
ENGINE = "a3po.trainer.engine"
RANKS = "a3po.trainer.parallel"
LOOP = "a3po.pipeline.loop"
RUN = "a3po.pipeline.run"
EVALUATE = "a3po.pipeline.evaluate"
SINKS = "a3po.pipeline.sinks"

NOTATION = (
    "v is the trainer's version before the step; for a generated token t, theta_t, b_t and p_t are its log-probs "
    "under the weights being trained, the behaviour policy that sampled it and the proximal policy, and d_t = v - "
    "version_t is its staleness (docs/design.md); eta is `rollout.max_head_offpolicyness` and B "
    "`train_dataset.batch_size`. Means over tokens run over generated tokens only (the loss mask): prompt tokens "
    "and padding never count. Unit 1 is a dimensionless number."
)
EVAL_STEPS = "evaluation steps: step 0 (not on --resume), then every evaluator.freq_steps steps and the last"
NO_D0 = "steps whose first minibatch has tokens of staleness 0 (always step 1)"
METRICS_MODE = "actor.prox_logp_method=metrics"
ENV = "train_dataset.env"
EPISODES = f"{ENV} or train_dataset.agent"


@dataclass(frozen=True)
class Metric:
    name: str  # the key, or a family's pattern with <placeholders>
    unit: str
    producer: tuple[str, ...]  # the modules whose code writes the key
    meaning: str  # formula or meaning, one line
    when: str | None = None  # the condition it is logged under; None = every training step


def _m(name: str, unit: str, producer: str | tuple[str, ...], meaning: str, when: str | None = None) -> Metric:
    return Metric(name, unit, producer if isinstance(producer, tuple) else (producer,), meaning, when)


# What each namespace holds, in the order the reference lists them.
NAMESPACES = {
    "": "the record itself",
    "loss": "the objective over the step's tokens (algo/stats.py)",
    "stale": "how old the trained tokens are (docs/design.md §2)",
    "mismatch": "sampler/trainer numerics, on tokens the trained weights sampled themselves",
    "prox_err": "proximal approximations against the recomputed truth (prox_logp_method=metrics)",
    "train": "the optimizer",
    "rollout": "the step's samples and the rollout workers",
    "episode": "multi-turn episodes (train_dataset.env or agent), means over the step's episodes",
    "eval": "held-out greedy evaluation",
    "sync": "what weight sync publishes per version",
    "perf": "where the step's time went",
}

REGISTRY: tuple[Metric, ...] = (
    _m("step", "version", SINKS, "policy version after the step (0: the initial evaluation); on every line"),
    # loss/
    _m("loss/total", "1", ENGINE, "the aggregated loss, averaged over the step's minibatches"),
    _m("loss/ratio_mean", "1", STATS, "mean of r_t = exp(theta_t - p_t) over tokens the loss keeps"),
    _m("loss/ratio_min", "1", STATS, "min of r_t = exp(theta_t - p_t)"),
    _m("loss/ratio_max", "1", STATS, "max of r_t = exp(theta_t - p_t)"),
    _m("loss/clipped_frac", "fraction", STATS, "share of tokens where the clipped branch of the PPO max won"),
    _m("loss/dual_clipped_frac", "fraction", STATS,
       "share of tokens bounded by the dual clip -c * A_t (actor.c_clip; 0 when unset)"),
    _m("loss/behav_weight_mean", "1", STATS, "mean of w_t = exp(p_t - b_t) before the cap (1 for coupled PPO)"),
    _m("loss/behav_weight_max", "1", STATS, "max of w_t = exp(p_t - b_t) before the cap"),
    _m("loss/behav_capped_frac", "fraction", STATS, "share of tokens with w_t above actor.behav_imp_weight_cap"),
    _m("loss/clipped_frac_d<k>", "fraction", STATS, "loss/clipped_frac over the tokens of staleness k only",
       "for each k among the step's tokens"),
    _m("loss/behav_capped_frac_d<k>", "fraction", STATS, "loss/behav_capped_frac over the tokens of staleness k only",
       "for each k among the step's tokens"),
    _m("loss/grad_share_neg_low_d", "fraction", STATS,
       "share of sum_t |dloss/dtheta_t| (each token's weight in the update) on tokens with A_t < 0 and d_t <= 2"),
    _m("loss/m2_dropped_frac", "fraction", STATS,
       "share of the loss mask's tokens removed by M2PO (actor.m2_threshold)"),
    _m("loss/tis_truncated_frac", "fraction", STATS,
       "share of tokens whose weight truncated importance sampling lowered (actor.correction.tis; 0 when none)"),
    _m("loss/tis_truncated_seq_frac", "fraction", STATS, "share of sequences with a token TIS lowered"),
    _m("loss/corr_masked_frac", "fraction", STATS,
       "share of tokens an off-policy mask dropped (actor.correction.mis, opsm_delta; 0 when none)"),
    _m("loss/corr_masked_seq_frac", "fraction", STATS, "share of sequences with a token an off-policy mask dropped"),
    _m("loss/opsm_masked_seq_frac", "fraction", STATS,
       "share of sequences off-policy sequence masking dropped: mean_t A_t < 0 and mean_t (b_t - theta_t) above "
       "actor.correction.opsm_delta"),
    _m("loss/tis_truncated_frac_d<k>", "fraction", STATS, "loss/tis_truncated_frac over the tokens of staleness k only",
       "for each k among the step's tokens"),
    _m("loss/corr_masked_frac_d<k>", "fraction", STATS, "loss/corr_masked_frac over the tokens of staleness k only",
       "for each k among the step's tokens"),
    _m("loss/approx_kl", "nats", STATS, "mean of p_t - theta_t: k1 estimate of KL(pi_prox || pi_theta)"),
    _m("loss/entropy", "nats", STATS, "mean per-token entropy of pi_theta"),
    _m("loss/kl_ref", "nats", (ENGINE, LOOP),
       "mean per-token KL estimate (actor.kl_estimator) to the reference policy: of pi_theta with the KL in the "
       "loss (trainer), of pi_behav with actor.kl_in_reward (loop)", "actor.kl_ctl > 0"),
    # stale/
    _m("stale/mean", "versions", STATS, "mean of d_t = v - version_t over the step's generated tokens"),
    _m("stale/max", "versions", STATS, "max of d_t; never above eta (rollout.max_head_offpolicyness)"),
    _m("stale/frac_d<k>", "fraction", STATS, "share of generated tokens with d_t = k; one key for every k = 0..eta"),
    # mismatch/
    _m("mismatch/abs_mean", "nats", STATS,
       "mean |theta_t - b_t| on tokens with d_t = 0 in the first minibatch: the train/rollout numerics gap", NO_D0),
    _m("mismatch/abs_max", "nats", STATS, "max |theta_t - b_t| on those tokens", NO_D0),
    _m("mismatch/k3", "nats", STATS,
       "mean of exp(theta_t - b_t) - 1 - (theta_t - b_t) there: k3 estimate of KL(pi_behav || pi_theta)", NO_D0),
    _m("mismatch/tokens", "tokens", STATS, "how many tokens the mismatch keys are over", NO_D0),
    # prox_err/: p_hat is <approx>'s proximal log-prob, p the recomputed one
    _m("prox_err/<approx>/abs", "nats", STATS, "mean |p_hat_t - p_t|", METRICS_MODE),
    _m("prox_err/<approx>/rel", "1", STATS, "mean |exp(p_hat_t - p_t) - 1|: relative error of the probability",
       METRICS_MODE),
    _m("prox_err/<approx>/sq", "nats^2", STATS, "mean (p_hat_t - p_t)^2", METRICS_MODE),
    _m("prox_err/<approx>/iw", "1", STATS,
       "mean |exp(p_hat_t - b_t) - exp(p_t - b_t)|: error of the behaviour importance weight", METRICS_MODE),
    _m("prox_err/<approx>/<err>/d<k>", "as `<err>`", STATS,
       "the same error over the tokens of staleness k only", f"{METRICS_MODE}, for each k among the step's tokens"),
    _m("prox_err/tokens/d<k>", "tokens", STATS, "how many tokens had staleness k (to pool the per-k means over steps)",
       f"{METRICS_MODE}, for each k among the step's tokens"),
    # train/
    _m("train/grad_norm", "1", ENGINE, "largest global gradient norm before clipping among the step's optimizer steps"),
    _m("train/lr", "1", ENGINE, "learning rate after the step"),
    _m("train/n_tokens", "tokens", ENGINE, "generated tokens the loss ran over (every rank's)"),
    _m("train/trainable_params", "parameters", ENGINE,
       "parameters the optimizer updates: every weight, or with actor.lora.rank > 0 the adapters'"),
    # rollout/
    _m("rollout/reward_mean", "reward", LOOP, "mean raw task reward over the step's samples (before shaping)"),
    _m("rollout/reward_std", "reward", LOOP, "standard deviation of that reward (0 for one sample)"),
    _m("rollout/solved_frac", "fraction", LOOP, "share of samples with reward >= 1"),
    _m("rollout/response_len_mean", "tokens", LOOP, "generated tokens per sample"),
    _m("rollout/truncated_frac", "fraction", LOOP, "share of samples cut at gconfig.max_new_tokens"),
    _m("rollout/reward_failures", "calls", LOOP,
       "reward calls of the step's samples that raised or timed out (scored 0), reward service failures included"),
    _m("rollout/filtered_groups", "groups", LOOP, "groups dropped by dynamic filtering for this step"),
    _m("rollout/dropped_groups", "groups", LOOP,
       "groups dropped and refilled because the reward service failed on them (reward_service.on_failure=drop)"),
    _m("rollout/reward_service_s", "s", LOOP,
       "mean time the reward service took on a group of the step, from its submission to its last score",
       "reward_service.kind=judge or scorer"),
    _m("rollout/worker_restarts", "workers", LOOP, "rollout workers replaced so far in the run (cumulative)"),
    _m("rollout/two_version_frac", "fraction", LOOP,
       "share of samples whose tokens carry more than one version (weights updated in flight)"),
    _m("rollout/groups_ahead", "groups", LOOP,
       "groups admitted for later versions when the update ended, max(0, next slot - (v + 1) * B): how far rollout "
       "ran ahead (at most eta * B)"),
    _m("rollout/groups_done_while_training", "groups", LOOP,
       "groups the workers finished during the step's advantages and PPO update"),
    _m("rollout/idle_frac", "fraction", LOOP, "mean of `rollout/idle_frac/w<i>` over the workers"),
    _m("rollout/idle_frac/w<i>", "fraction", LOOP,
       "share of worker i's time since the previous step with nothing to generate; one key per worker"),
    # episode/
    _m("episode/turns_mean", "turns", LOOP, "model turns per episode", ENV),
    _m("episode/tool_calls_mean", "calls", LOOP, "tool calls per episode (env: turns whose step set tool_call; "
       "agent: calls read from its replies into tool_calls)", EPISODES),
    _m("episode/tool_errors_mean", "calls", LOOP, "bad tool calls per episode (tool_error)", ENV),
    _m("episode/tool_calls_malformed_mean", "replies", LOOP, "an agent's replies per episode whose tool-call text "
       "could not be read (not JSON, no name, arguments not an object), returned to it as text; 0 with env", EPISODES),
    _m("episode/rerendered_tokens_mean", "tokens", LOOP, "context tokens per episode rendered again as the prompt of "
       "its later turns' rows (train_dataset.turn_context rerender, or auto with a template that does not append): "
       "prefilled and trained as context once more; 0 when turns append", ENV),
    _m("episode/success_frac", "fraction", LOOP, "share of episodes whose undiscounted reward reached 1", ENV),
    _m("episode/observation_token_frac", "fraction", LOOP,
       "observation tokens / all tokens after the prompts (observations and model turns)", ENV),
    _m("episode/env_time_frac", "fraction", LOOP,
       "mean over episodes of the time their environment calls took (waiting included) / their time in the worker",
       ENV),
    _m("episode/versions_spanned_mean", "versions", LOOP, "distinct versions among an episode's generated tokens",
       ENV),
    _m("episode/finish/<reason>", "fraction", LOOP, "share of episodes that ended for this reason", ENV),
    # eval/
    _m("eval/accuracy", "fraction", EVALUATE, "share of held-out examples whose greedy completion (episode) scores "
       ">= 1, before any turn discount", EVAL_STEPS),
    _m("eval/reward", "reward", EVALUATE, "mean reward of the held-out greedy completions (episodes, discounted)",
       EVAL_STEPS),
    _m("eval/first_turn_accuracy", "fraction", EVALUATE, "share of held-out episodes solved by the model's first "
       "turn; eval/accuracy minus it is what the later turns (feedback, tools) added", f"{EVAL_STEPS}, with {ENV}"),
    _m("eval/turns_mean", "turns", EVALUATE, "model turns per held-out greedy episode", f"{EVAL_STEPS}, with {ENV}"),
    _m("eval/tool_use_frac", "fraction", EVALUATE, "share of held-out greedy episodes that called a tool at least once",
       f"{EVAL_STEPS}, with {ENV}"),
    # perf/
    _m("perf/rollout_wait_s", "s", LOOP, "trainer time waiting for this step's prompt groups"),
    _m("perf/prox_logp_s", "s", ENGINE,
       "the proximal forward pass of version v (recompute, metrics); exactly 0 for the methods without one"),
    _m("perf/ref_kl_s", "s", LOOP, "the reference model's forward pass before the advantages",
       "actor.kl_in_reward=true"),
    _m("perf/record_s", "s", LOOP, "saving the step's batch and the trainer's state before the update "
       "(trainer/records.py)", "the steps listed in saver.record_steps"),
    _m("perf/train_s", "s", ENGINE, "forward, backward and optimizer steps of the update"),
    _m("perf/optimizer_s", "s", ENGINE, "the optimizer's share of `perf/train_s` (clipping, AdamW, schedule)"),
    _m("perf/ranks_sync_s", "s", RANKS, "gathering the whole model and the statistics on rank 0 after the update",
       "more than one trainer rank (cluster.n_trainer_ranks > 1, or torchrun)"),
    _m("perf/weight_sync_s", "s", LOOP, "publishing the new weights, waiting for the previous load included"),
    _m("sync/published_bytes", "bytes", LOOP,
       "bytes one published version puts in the weight transport (fp32): the whole model, or the adapters"),
    _m("perf/weight_load_s", "s", LOOP, "slowest worker's weight load since the previous step"),
    _m("perf/eval_s", "s", RUN, "the held-out evaluation", EVAL_STEPS),
    _m("perf/borrowed_frac", "fraction", RUN,
       "share of the trainer's decoder-layer passes this step that ran on idle rollout workers' threads too "
       "(rollout.lend_idle_cores)"),
    _m("perf/step_s", "s", LOOP, "wall time of the step: rollout wait, update, weight sync (not evaluation or "
       "checkpoint)"),
    _m("perf/tokens_per_s", "tokens/s", LOOP, "generated tokens consumed per second of `perf/step_s`"),
)


@cache
def placeholders() -> dict[str, tuple[str, str]]:
    """Each placeholder: (the regex its values match, what it stands for).

    The approximation and error names are read from algo/prox.py, the one list of each."""
    from a3po.algo.prox import APPROXIMATIONS, ApproxErrors

    errors = [f.name for f in fields(ApproxErrors)]
    return {
        "<k>": (r"[0-9]+", "a staleness d = 0, 1, 2, ..."),
        "<i>": (r"[0-9]+", "a rollout worker's index, 0 .. rollout.n_workers - 1"),
        "<approx>": ("|".join(map(re.escape, APPROXIMATIONS)),
                     f"an approximation of the proximal log-probs: {', '.join(APPROXIMATIONS)} "
                     "(behav is coupled PPO's p = b)"),
        "<err>": ("|".join(map(re.escape, errors)), f"an error kind: {', '.join(errors)}"),
        "<reason>": ("|".join(EpisodeEnd.CHOICES), f"why an episode ended: {', '.join(EpisodeEnd.CHOICES)}"),
    }


PLACEHOLDER = re.compile(r"<[a-z]+>")


def is_family(m: Metric) -> bool:
    return PLACEHOLDER.search(m.name) is not None


@cache
def _regex(name: str) -> re.Pattern:
    table = placeholders()
    parts = PLACEHOLDER.split(name)
    holes = PLACEHOLDER.findall(name)
    body = re.escape(parts[0]) + "".join(f"(?:{table[h][0]}){re.escape(p)}" for h, p in zip(holes, parts[1:]))
    return re.compile(body)


def matches(m: Metric, key: str) -> bool:
    return _regex(m.name).fullmatch(key) is not None


def declaring(key: str) -> list[Metric]:
    """The entries that declare `key`: exactly one for every key a run logs."""
    return [m for m in REGISTRY if matches(m, key)]


def namespace(m: Metric) -> str:
    return m.name.split("/", 1)[0] if "/" in m.name else ""
