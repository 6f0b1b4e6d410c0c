"""The configuration schema: every key a3po reads, its type, default, range and meaning.

Defaults live here and nowhere else; the embedded default run (`a3po train` with no
arguments) is exactly these defaults. Key names follow AReaL's where AReaL has one
(`actor.prox_logp_method`, `rollout.max_head_offpolicyness`, `gconfig.n_samples`, ...)
so that its users need not relearn them. The names of the algorithm's variants
(`choices` of prox_logp_method, behav_imp_weight_mode, ...) are read from their one
list each in a3po.algo.variants and a3po.algo.schedule, those of the enumerated settings
(dtype, device, backend, ...) from a3po.config.choices. Each field's `help` is shown by
`a3po train --help`; `choices` and the bounds `ge/gt/le/lt` are enforced at load time
by `a3po.config.load`, which also checks the combinations in `check_consistency`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from a3po.algo import variants
from a3po.algo.schedule import LR_SCHEDULES
from a3po.config.choices import (
    AUTO,
    TEXTARENA,
    Backend,
    Device,
    DpMode,
    Dtype,
    Forward,
    Launcher,
    OnFailure,
    ServiceKind,
    ToolCallFormat,
    TurnContext,
    WeightUpdate,
)


def opt(default: Any, help: str, **rules: Any) -> Any:
    """A config field: default, one-line meaning, and validation rules (choices, ge, gt, le, lt)."""
    meta = {"help": help, **rules}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


DEVICE = dict(pattern=Device.PATTERN, pattern_help=Device.PATTERN_HELP)


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class OptimizerConfig:
    lr: float = opt(2e-5, "AdamW learning rate", gt=0)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay", ge=0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = opt(0.999, "AdamW beta2", ge=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0)
    warmup_steps_proportion: float = opt(0.0, "share of total_train_steps spent in linear warm-up", ge=0, le=1)
    lr_scheduler_type: str = opt("constant", "learning-rate schedule after warm-up", choices=tuple(LR_SCHEDULES))
    gradient_clipping: float = opt(1.0, "clip the global gradient norm to this value (0 disables)", ge=0)


@dataclass
class NormConfig:
    mean_level: str = opt("group", "baseline subtracted from rewards: group mean (GRPO), batch mean, or none",
                          choices=variants.ADV_NORM_LEVELS)
    std_level: str = opt("group", "divide by the std of the group (GRPO), of the batch, or none (Dr.GRPO, RLOO)",
                         choices=variants.ADV_NORM_LEVELS)
    mean_leave1out: bool = opt(False, "leave-one-out baseline within the group (RLOO)")
    eps: float = opt(1e-5, "added to the std before dividing", gt=0)


@dataclass
class MicroBatchConfig:
    max_tokens_per_mb: int = opt(4096, "token budget of one micro-batch in the training forward/backward pass", ge=1)


@dataclass
class CorrectionConfig:
    ratio: str = opt("behav", "the ratio tis and mis read against the sampler's b: behav = exp(p - b), the behaviour "
                              "weight; current = exp(theta - b), the sampler against the weights being trained (under "
                              "loglinear and coupled PPO p = b at d <= 1, so only current sees the sampler's numerics "
                              "there; docs/design.md)", choices=variants.CORRECTION_RATIOS)
    tis: str = opt("none", "truncated importance sampling: the ratio, per token or its sequence's product, capped at "
                           "tis_cap (TIS)", choices=variants.TIS_LEVELS)
    tis_cap: float = opt(2.0, "TIS's upper bound C", gt=1)
    mis: str = opt("none", "masked importance sampling: drop the token (token: MIS, IcePop), or the whole sequence "
                           "(sequence: its product of ratios; geometric: their geometric mean), whose ratio leaves "
                           "[mis_low, mis_high]", choices=variants.MIS_KINDS)
    mis_low: float | None = opt(None, "lower bound of the mis band, inclusive (IcePop 0.5, geometric 0.99); "
                                      "null = none", ge=0)
    mis_high: float | None = opt(None, "upper bound of the mis band, inclusive (IcePop 5, geometric 1.01); null = none",
                                 gt=0)
    opsm_delta: float | None = opt(None, "off-policy sequence masking (DeepSeek-V3.2): drop each sequence whose mean "
                                         "advantage is negative and whose mean (b - theta) exceeds this; null disables",
                                   ge=0)


LORA_LR_FACTOR = 30.0  # actor.lora.lr's default, relative to actor.optimizer.lr (docs/results.md, LoRA)


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank: train low-rank adapters on a frozen base model instead of every weight; "
                       "0 = full training", ge=0)
    alpha: float | None = opt(None, "LoRA scale numerator: the adapter adds (alpha / rank) x B A to each target "
                                    "weight; null = 2 x rank", gt=0)
    dropout: float = opt(0.0, "dropout on the adapters' input while training", ge=0, lt=1)
    target_modules: list = opt([], "module names (or suffixes) that get adapters; [] = every linear layer of the "
                                   "body (embeddings and the LM head only when named)")
    lr: float | None = opt(None, "AdamW learning rate of the adapters (in place of actor.optimizer.lr); "
                                 f"null = {LORA_LR_FACTOR:g} x actor.optimizer.lr: adapters want a larger one "
                                 "(on the default task 30 x learnt on every seed and 100 x collapsed; 30 x is not "
                                 "shown better than 10 x: docs/results.md, LoRA)", gt=0)

    @property
    def alpha_value(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def scale(self) -> float:
        return self.alpha_value / max(1, self.rank)

    def learning_rate(self, full: float) -> float:
        return self.lr if self.lr is not None else LORA_LR_FACTOR * full


@dataclass
class ActorConfig:
    path: str = opt("smollm2-135m-instruct",
                    "model: built-in name (smollm2-135m-instruct, tiny, tiny-<hidden>x<layers> such as "
                    "tiny-2048x16), local Hugging Face directory, or hub id")
    device: str = opt(AUTO, "where the trainer computes: cpu, cuda, cuda:N; auto = cuda when torch sees a GPU, "
                      "else cpu", **DEVICE)
    dtype: str = opt(AUTO, "compute dtype of the training pass; bfloat16 keeps fp32 master weights; auto = bfloat16 "
                     "where actor.device computes it natively (most CUDA GPUs, AVX512-BF16/AMX CPUs), else float32",
                     choices=Dtype.CHOICES)
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    fp32_lm_head: bool = opt(False, "compute the LM head (the logits) in fp32 in the trainer and in every rollout "
                                    "engine, even where the rest runs in bf16: sampler and trainer log-probs then "
                                    "differ less (the local engine gives a tied rollout copy its own fp32 head; "
                                    "vLLM computes fp32 logits from its model-dtype head weight)")
    use_decoupled_loss: bool = opt(True, "decoupled PPO (proximal policy separate from behaviour policy); "
                                         "false = coupled PPO/GRPO")
    prox_logp_method: str = opt("loglinear", "how the proximal log-probs are obtained; loglinear is A-3PO",
                                choices=variants.PROX_METHODS)
    policy_loss: str = opt("ppo", "the surrogate: ppo (clipped ratio), cispo (clipped stop-gradient ratio times the "
                                  "log-prob, MiniMax-M1; clipped to [1 - eps_clip, 1 + eps_clip_higher]) or sapo (a "
                                  "sigmoid gate of the ratio in place of the clip, Qwen)",
                           choices=variants.POLICY_LOSSES)
    sapo_tau_pos: float = opt(1.0, "SAPO's gate temperature for positive advantages", gt=0)
    sapo_tau_neg: float = opt(1.05, "SAPO's gate temperature for negative advantages", gt=0)
    eps_clip: float = opt(0.2, "PPO clip range below 1 (and above 1 unless eps_clip_higher is set)", gt=0, lt=1)
    eps_clip_higher: float | None = opt(None, "PPO clip range above 1 (asymmetric clip); null = eps_clip", gt=0)
    c_clip: float | None = opt(3.0, "dual-clip bound for negative advantages: with A < 0 a token whose ratio passes "
                                     "this stops contributing, so no token weighs more than c_clip x the cap x |A| "
                                     "in the update (loglinear at d <= 1 has w = 1 and no other bound); null disables",
                                gt=1)
    behav_imp_weight_cap: float | None = opt(5.0, "cap on the behaviour importance weight exp(p - b); null disables",
                                             gt=1)
    behav_imp_weight_mode: str = opt("token_mask",
                                     "what the cap does: drop (mask) or clamp (truncate), per token or per sequence",
                                     choices=variants.BEHAV_WEIGHT_MODES)
    importance_sampling_level: str = opt("token", "trust-region ratio and advantage per token (PPO), per sequence "
                                                  "(GSPO: the means over its tokens), or sequence_token (GSPO-token: "
                                                  "the sequence's ratio, each token's advantage and gradient)",
                                         choices=variants.IS_LEVELS)
    m2_threshold: float | None = opt(None, "M2PO: drop tokens until the second moment of log(p/b) is below this; "
                                           "null disables", gt=0)
    loss_agg_mode: str = opt("token-mean", "how per-token losses become one number", choices=variants.AGG_MODES)
    loss_agg_norm: float = opt(1.0, "constant divisor for seq-mean-token-sum (Dr.GRPO uses max_new_tokens)", gt=0)
    ppo_n_minibatches: int = opt(1, "optimizer steps per training batch (the batch is split into this many "
                                    "minibatches); above 1 on stale data, lower actor.optimizer.lr "
                                    "(docs/training.md, 'Which proximal method when')", ge=1)
    kl_ctl: float = opt(0.0, "coefficient of the KL to the reference (initial) policy; 0 disables", ge=0)
    kl_estimator: str = opt("k3", "KL estimator (algo/kl.py); k1 is the one whose penalty in the reward has the KL's "
                                  "gradient", choices=variants.KL_ESTIMATORS)
    kl_in_reward: bool = opt(False, "charge the KL to the reward instead of the loss: each sequence's shaped reward "
                                    "loses kl_ctl x its summed per-token KL of the behaviour policy to the reference, "
                                    "before the advantages are computed")
    entropy_coef: float = opt(0.0, "entropy bonus coefficient", ge=0)
    reward_scaling: float = opt(1.0, "rewards become (r + reward_bias) * reward_scaling")
    reward_bias: float = opt(0.0, "added to rewards before scaling")
    reward_clip: float | None = opt(None, "clip shaped rewards to [-reward_clip, reward_clip]; null disables", gt=0)
    correction: CorrectionConfig = section(CorrectionConfig, "off-policy corrections of the behaviour weight "
                                                             "(docs/design.md)")
    adv_norm: NormConfig = section(NormConfig, "advantage normalisation")
    mb_spec: MicroBatchConfig = section(MicroBatchConfig, "micro-batching")
    optimizer: OptimizerConfig = section(OptimizerConfig, "optimizer")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters (LoRA)")


@dataclass
class GenerationConfig:
    n_samples: int = opt(4, "completions sampled per prompt (one group)", ge=1)
    max_new_tokens: int = opt(24, "maximum tokens generated per completion", ge=1)
    temperature: float = opt(1.0, "sampling temperature", gt=0)
    top_p: float = opt(1.0, "nucleus sampling: keep the most likely tokens while the mass ranked above a token is "
                            "below top_p; 1.0 disables. The trainer applies the same filter to its own log-probs "
                            "(docs/design.md, \"Sampling filters\")", gt=0, le=1)
    top_k: int = opt(0, "sample among the k most likely tokens; 0 disables; applied by the trainer too, as top_p",
                     ge=0)
    min_p: float = opt(0.0, "keep tokens whose probability is at least min_p times the most likely one's; 0.0 "
                            "disables; applied by the trainer too, as top_p", ge=0, lt=1)
    stop: list = opt([], "extra stop strings (the tokenizer's end-of-sequence always stops)")


@dataclass
class RolloutConfig:
    backend: str = opt(Backend.LOCAL,
                       "rollout engine in each worker: local (a3po's own sampler, any device) or vllm "
                       "(needs the vllm extra, docs/scaling.md)", choices=Backend.CHOICES)
    vllm_gpu_memory: float = opt(0.4, "with rollout.backend=vllm on a GPU: the share of that GPU's memory each "
                                      "worker's vLLM engine reserves (weights and KV cache); leave room for the "
                                      "trainer when both share a GPU, and divide by n_workers", gt=0, lt=1)
    vllm_compile: bool = opt(True, "with rollout.backend=vllm: compile the engine's model with torch.compile when it "
                                   "starts (vLLM's default); false runs it eagerly: no compilation at each start, "
                                   "for short runs and tests")
    max_head_offpolicyness: int = opt(2, "staleness bound eta: tokens are at most this many versions older than the "
                                         "trainer; 0 = synchronous", ge=0)
    max_concurrent_rollouts: int | None = opt(None, "prompt groups admitted and not yet trained on (generating or "
                                                    "queued in a worker); null = as many as the bound allows, "
                                                    "(eta + 1) x batch_size, capped at 1024 sequences", ge=1)
    n_workers: int = opt(1, "rollout worker processes", ge=1)
    torch_threads: int | None = opt(None, "torch threads per rollout worker; null = split this machine's cores", ge=1)
    lend_idle_cores: bool = opt(True, "while no rollout worker has a prompt in flight (held back by the staleness "
                                      "bound, or between steps at eta=0), the trainer computes with their threads "
                                      "too; only where the workers compute on this machine's CPU with the local "
                                      "backend under the local launcher and without rollout.lockstep (elsewhere it "
                                      "does nothing)")
    device: str = opt(AUTO, "where every rollout worker computes: cpu, cuda, cuda:N (e.g. the trainer on cuda:0, "
                      "rollout on cuda:1); auto = cuda when torch sees a GPU, else cpu", **DEVICE)
    dtype: str = opt(AUTO, "parameter dtype of the rollout engines' model copy; auto = bfloat16 where rollout.device "
                     "computes it natively (most CUDA GPUs, AVX512-BF16/AMX CPUs), else float32",
                     choices=Dtype.CHOICES)
    forward: str = opt(AUTO, "the local engine's forward pass: a3po (its own for Llama and Qwen2 models: a "
                               "preallocated KV cache written in place, batched-matmul attention in fp32) or hf (the "
                               "model's Hugging Face forward, any architecture); auto = a3po where the model is "
                               "supported, else hf", choices=Forward.CHOICES)
    weight_update: str = opt(WeightUpdate.KEEP_KV,
                             "what a worker does with sequences in flight when new weights arrive: keep_kv "
                             "(keep the KV cache older weights computed and continue with the new weights; "
                             "log-probs stay exact, only the prefix is of older weights) or reprefill "
                             "(recompute their KV cache with the new weights: exact, but one prefill of "
                             "every running sequence per version)", choices=WeightUpdate.CHOICES)
    stall_timeout_s: float = opt(600.0, "stop the run when the trainer waits on its rollout workers and none reports "
                                        "progress for this long; also the limit for a worker to start", gt=0)
    worker_timeout_s: float = opt(120.0, "a rollout worker that sends no heartbeat for this long is taken for hung, "
                                         "killed and replaced; it beats between two decode steps, so this must exceed "
                                         "the longest one (a prefill of many prompts on a big model)", ge=1)
    lockstep: bool = opt(False, "repeatable asynchronous run: the batch of step k is sampled whole by weights "
                                "max(0, k - eta) (each version is published once the batch it samples is done), "
                                "each worker generates one batch's groups as one closed engine batch and episode "
                                "turns in rounds; so a run repeats from its seed on one machine, and two runs that "
                                "differ in one setting see data of the same staleness; the trainer does not "
                                "borrow idle workers' cores (docs/training.md)")
    max_worker_restarts: int = opt(3, "rollout workers replaced after a crash or a hang over the whole run; one more "
                                      "failure stops the run", ge=0)


@dataclass
class DatasetConfig:
    task: str = opt("chain_sum",
                    "reasoning-gym task (chain_sum, basic_arithmetic, gsm_symbolic, countdown) or 'file' for path")
    task_params: dict = opt({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                            "parameters passed to the task generator")
    path: str | None = opt(None, "JSONL/Parquet file or Hugging Face dataset directory, used with task=file")
    question_key: str = opt("question", "column holding the prompt text")
    answer_key: str = opt("answer", "column holding the reference answer (GSM8K '#### 72' accepted)")
    reward: str = opt("exact", "reward function: exact (final number equals the answer), task (the task's own scorer, "
                               "may give partial credit), math_verify, or module:function")
    system_prompt: str | None = opt(None, "system message put before each question; null = the chat template's default")
    batch_size: int = opt(4, "prompts per training step", ge=1)
    size: int = opt(20000, "examples generated for a procedural task", ge=1)
    reward_timeout_s: float = opt(5.0, "a reward call running longer than this is ended (its scoring process is "
                                       "killed), scores 0 and counts as a failure", gt=0)
    max_reward_failure_frac: float = opt(0.5, "stop the run when more than this share of a step's reward calls failed",
                                         ge=0, le=1)
    dynamic_filtering: bool = opt(False, "drop groups whose rewards are all equal (no learning signal) "
                                         "and refill from the dataset")
    env: str | None = opt(None, "multi-turn episodes in an environment: retry (wrong answers get 'try again'), "
                                f"calculator (a <calc> tool), guess (higher/lower), {TEXTARENA} (a TextArena game, "
                                "train_dataset.env_id) or module:Class (docs/training.md); "
                                "null = single-turn completions scored by train_dataset.reward")
    env_id: str | None = opt(None, f"with env={TEXTARENA}: the single-player TextArena game, e.g. "
                                   "GuessTheNumber-v0 (the textarena extra)")
    max_turns: int = opt(4, "with env or agent: the most model turns (agent: model calls) per episode; "
                            "gconfig.max_new_tokens is per turn", ge=1)
    max_context_tokens: int = opt(1024, "with env or agent: the most tokens an episode's context (prompt, turns, "
                                        "observations) may reach; an episode that would pass it ends (an agent's "
                                        "request past it is refused)", ge=2)
    turn_discount: float | None = opt(None, "with env: the reward of turn k counts discount^(k-1); null = the "
                                            "environment's own (retry 0.5, guess 0.8, calculator 1)", ge=0, le=1)
    turn_context: str = opt(AUTO, "with env: each turn's context: append (one row that grows by the template's "
                                   "delta; refused for a template that renders earlier messages differently once "
                                   "more follow), rerender (each turn its own row, the conversation rendered whole "
                                   "as masked context), auto (append when the template allows it, else rerender)",
                            choices=TurnContext.CHOICES)
    agent: str | None = opt(None, "episodes run by your agent, module:function with async def run(example, client) "
                                  "-> reward, client an openai.AsyncOpenAI pointed at the policy; its completions "
                                  "train (docs/training.md, agents); null = no agent")
    tool_call_format: str = opt(AUTO, "with agent: how tool calls are read from its replies into tool_calls: auto "
                                      "(the format the chat template writes; none found: text), none (replies stay "
                                      "text), or a format named (docs/training.md, tool calls)",
                                choices=ToolCallFormat.CHOICES)
    agent_timeout_s: float = opt(120.0, "with agent: an agent's whole episode deadline; past it the episode fails and "
                                        "counts as a failure", gt=0)
    env_timeout_s: float = opt(5.0, "with env: an environment call (reset or step) running longer than this fails its "
                                    "episode (the environment's process is restarted) and counts as a failure", gt=0)


JUDGE_TEMPLATE = ("Question: {question}\nReference answer: {answer}\nStudent answer: {completion}\n"
                  "Is the student's final answer correct? Reply with a score from 0 (wrong) to 10 (correct).")


@dataclass
class RewardServiceConfig:
    kind: str = opt(ServiceKind.NONE, "a reward from a model behind HTTP, weighted into train_dataset.reward's: "
                                      "none, judge (an OpenAI-compatible chat model grades each completion with "
                                      "`template`, its score parsed from the answer) or scorer (POSTs "
                                      "{prompt, completion} batches, reads scores); docs/training.md",
                    choices=ServiceKind.CHOICES)
    url: str | None = opt(None, "judge: the server's base URL, e.g. http://127.0.0.1:8011/v1 (`a3po serve`); "
                                "scorer: the URL batches are POSTed to")
    model: str = opt("", "the model name sent with each request (judge: the served model's id)")
    api_key_env: str | None = opt(None, "name of an environment variable holding the service's API key, sent as "
                                        "'Authorization: Bearer <key>' (the key itself never enters a config file); "
                                        "null = none")
    template: str = opt(JUDGE_TEMPLATE, "judge: the user message it gets; {question}, {answer} (the reference) and "
                                        "{completion} are filled in")
    score_regex: str = opt(r"(-?[0-9]+(?:\.[0-9]+)?)", "judge: the score is the last match in its answer of this "
                                                       "regular expression's first group")
    score_max: float = opt(10.0, "judge: the parsed score is divided by this (0..10 becomes 0..1)", gt=0)
    max_tokens: int = opt(32, "judge: the most tokens the judge writes", ge=1)
    weight: float = opt(1.0, "the reward is rule_weight x train_dataset.reward + weight x the service's score")
    rule_weight: float = opt(1.0, "weight of train_dataset.reward in the sum; 0 = the service's score alone")
    batch_size: int = opt(8, "scorer: completions per request (a group of n takes ceil(n / batch_size) requests)",
                          ge=1)
    max_concurrency: int = opt(4, "requests in flight at once, per rollout worker", ge=1)
    timeout_s: float = opt(30.0, "deadline of one request", gt=0)
    retries: int = opt(3, "attempts after a failed one (no answer, a timeout, 429 or 5xx); other answers are not "
                          "retried", ge=0)
    backoff_s: float = opt(0.5, "wait before the first retry, doubled for each next one, times a random 0.5..1.5",
                           ge=0)
    on_failure: str = opt(OnFailure.ZERO, "a completion the service could not score: zero (its service score is 0, "
                                          "counted in rollout/reward_failures), drop (its group is dropped and "
                                          "refilled from the dataset) or stop (the run stops with the reason)",
                          choices=OnFailure.CHOICES)


@dataclass
class EvalConfig:
    freq_steps: int = opt(8, "evaluate held-out greedy accuracy every this many steps; 0 disables", ge=0)
    size: int = opt(64, "held-out examples (never seen in training)", ge=1)
    initial: bool = opt(True, "evaluate the initial policy before the first step (false: a study whose runs share "
                              "their initial model measures it once, e.g. with `a3po eval`)")


@dataclass
class SaverConfig:
    freq_steps: int = opt(8, "save a checkpoint every this many steps (and at the end); 0 = only at the end", ge=0)
    keep_last: int = opt(1, "checkpoints kept on disk (older ones are removed once a newer one is complete); "
                              "2 or more leave --resume one to fall back on if the newest is damaged", ge=1)
    record_steps: list = opt([], "steps whose batch is saved with the trainer's state just before their update "
                                 "(RUN_DIR/records/step_N/, about 1.6 GB each with SmolLM2), for `a3po bench "
                                 "fidelity` to replay; [] records none")


@dataclass
class LoggingConfig:
    tensorboard: bool = opt(True, "write TensorBoard event files into the run directory")
    wandb: bool = opt(False, "also log to Weights & Biases (needs `pip install wandb` and a login)")
    wandb_project: str = opt("a3po", "W&B project name")


@dataclass
class ClusterConfig:
    n_trainer_ranks: int = opt(1, "data-parallel trainer processes (torch.distributed: gloo on CPU, "
                                  "NCCL on GPU); each trains on its share of every step's batch. Under torchrun "
                                  "the launcher's WORLD_SIZE decides instead", ge=1)
    data_parallel: str = opt(DpMode.FSDP2,
                             "how the ranks hold the model: fsdp2 (parameters, gradients and optimizer "
                             "state sharded with fully_shard) or ddp (replicated, gradients averaged)",
                             choices=DpMode.CHOICES)
    timeout_s: float = opt(600.0, "longest wait of one trainer rank on the others (a collective, the start-up) "
                                  "before the run stops", gt=0)
    launcher: str = opt(Launcher.LOCAL,
                        "who starts trainer ranks 1..N-1 and the rollout workers: local (processes on "
                        "this machine, weights through shared memory) or ray (actors placed on a Ray "
                        "cluster's nodes, weights through Ray's object store)", choices=Launcher.CHOICES)
    ray_address: str | None = opt(None, "address of the Ray cluster with launcher=ray: host:port of its head, or "
                                        "auto (the cluster already running on this machine); null = RAY_ADDRESS, "
                                        "or else a Ray instance started for this run alone")
    ray_placement: str = opt("PACK", "Ray placement-group strategy for the actors: PACK (few nodes), SPREAD (many "
                                     "nodes), STRICT_PACK (one node) or STRICT_SPREAD (one actor per node)",
                             choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))


@dataclass
class Config:
    experiment_name: str = opt("a3po", "name of the run; the run directory is <fileroot>/<experiment_name>")
    fileroot: str = opt("runs", "folder holding run directories")
    seed: int = opt(1, "random seed for data order, sampling and initialisation", ge=0)
    total_train_steps: int = opt(16, "training steps (optimizer versions) to run", ge=1)
    actor: ActorConfig = section(ActorConfig, "the policy, its loss and optimizer")
    gconfig: GenerationConfig = section(GenerationConfig, "sampling")
    rollout: RolloutConfig = section(RolloutConfig, "asynchronous rollout")
    train_dataset: DatasetConfig = section(DatasetConfig, "training data and reward")
    reward_service: RewardServiceConfig = section(RewardServiceConfig, "a reward from a model served over HTTP")
    evaluator: EvalConfig = section(EvalConfig, "held-out evaluation")
    saver: SaverConfig = section(SaverConfig, "checkpoints and training records")
    logging: LoggingConfig = section(LoggingConfig, "metrics sinks")
    cluster: ClusterConfig = section(ClusterConfig, "trainer ranks and where processes run")


def check_consistency(cfg: Config) -> list[tuple[str, Any, str]]:
    """Combinations that are each valid alone but not together: (key, value, what is allowed).

    Options that only matter under another setting are blamed only when changed from
    their default, so `actor.use_decoupled_loss=false` alone is fine and a saved,
    resolved config loads again.
    """
    a, base = cfg.actor, ActorConfig()
    a_changed = {name for name in vars(a) if getattr(a, name) != getattr(base, name)}
    problems = []
    if variants.prox_traits(a.prox_logp_method).single_step_only and a.ppo_n_minibatches != 1:
        problems.append(("actor.ppo_n_minibatches", a.ppo_n_minibatches,
                         f"prox_logp_method={a.prox_logp_method} is exact only with one gradient step per sample: "
                         "set ppo_n_minibatches=1 or choose loglinear"))
    if not a.use_decoupled_loss:
        decoupled_only = ("prox_logp_method", "behav_imp_weight_cap", "behav_imp_weight_mode", "m2_threshold")
        for name in decoupled_only:
            if name in a_changed:
                problems.append((f"actor.{name}", getattr(a, name),
                                 "only meaningful with actor.use_decoupled_loss=true; set it or drop this key"))
    corr = a.correction
    if corr.mis != "none" and corr.mis_low is None and corr.mis_high is None:
        problems.append(("actor.correction.mis", corr.mis, "needs a band: set actor.correction.mis_low and/or "
                                                           "mis_high (IcePop 0.5 and 5, geometric 0.99 and 1.01)"))
    if corr.mis_low is not None and corr.mis_high is not None and corr.mis_low >= corr.mis_high:
        problems.append(("actor.correction.mis_low", corr.mis_low,
                         f"must be below actor.correction.mis_high={corr.mis_high}: the band [mis_low, mis_high] "
                         "keeps the ratios between them"))
    if not a.use_decoupled_loss and corr.ratio == "behav":
        for name, off in (("tis", "none"), ("mis", "none")):
            if getattr(corr, name) != off:
                problems.append((f"actor.correction.{name}", getattr(corr, name), (
                    "reads exp(p - b), which is 1 under coupled PPO (actor.use_decoupled_loss=false): "
                    "set actor.correction.ratio=current")))
    if a.loss_agg_mode != "seq-mean-token-sum" and "loss_agg_norm" in a_changed:
        problems.append(("actor.loss_agg_norm", a.loss_agg_norm,
                         "only used with actor.loss_agg_mode=seq-mean-token-sum"))
    if a.adv_norm.mean_leave1out and a.adv_norm.mean_level != "group":
        problems.append(("actor.adv_norm.mean_leave1out", True, "needs actor.adv_norm.mean_level=group"))
    if a.lora.rank == 0:
        for name in ("alpha", "dropout", "target_modules", "lr"):
            if getattr(a.lora, name) != getattr(base.lora, name):
                problems.append((f"actor.lora.{name}", getattr(a.lora, name),
                                 "only used with actor.lora.rank > 0; set a rank (e.g. 16) or drop this key"))
    if a.kl_in_reward and a.kl_ctl == 0:
        problems.append(("actor.kl_in_reward", True, "has no effect with actor.kl_ctl=0; set kl_ctl > 0"))
    bad = [s for s in cfg.saver.record_steps
           if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= cfg.total_train_steps]
    if bad:
        problems.append(("saver.record_steps", cfg.saver.record_steps,
                         f"step numbers from 1 to total_train_steps={cfg.total_train_steps}, e.g. [4, 8]"))
    r = cfg.rollout
    if r.max_concurrent_rollouts is not None and r.max_concurrent_rollouts < r.n_workers:
        problems.append(("rollout.max_concurrent_rollouts", r.max_concurrent_rollouts,
                         f"at least rollout.n_workers={r.n_workers}"))
    d = cfg.train_dataset
    if r.lockstep and d.dynamic_filtering:
        problems.append(("train_dataset.dynamic_filtering", True, (
            "false with rollout.lockstep=true: refills follow the order groups finish in, which timing decides")))
    if r.lockstep and r.max_concurrent_rollouts is not None and r.max_concurrent_rollouts < d.batch_size:
        problems.append(("rollout.max_concurrent_rollouts", r.max_concurrent_rollouts, (
            f"null or at least train_dataset.batch_size={d.batch_size} with rollout.lockstep=true "
            "(a batch is admitted whole)")))
    rs, rs_base = cfg.reward_service, RewardServiceConfig()
    if rs.kind == ServiceKind.NONE:
        for name in vars(rs):
            if name != "kind" and getattr(rs, name) != getattr(rs_base, name):
                problems.append((f"reward_service.{name}", getattr(rs, name),
                                 "only used with reward_service.kind=judge or scorer; set a kind or drop this key"))
    else:
        if not rs.url or not rs.url.startswith(("http://", "https://")):
            problems.append(("reward_service.url", rs.url, f"an http:// URL of the {rs.kind}"))
        if d.env is not None or d.agent is not None:
            problems.append(("reward_service.kind", rs.kind, (
                "none with train_dataset.env or agent: an environment or an agent gives its episodes' rewards "
                "itself (an agent may call a judge on its own)")))
    if d.agent is not None and d.env is not None:
        problems.append(("train_dataset.agent", d.agent, "null with train_dataset.env: an episode is run by an "
                                                         "environment or by an agent, not both"))
    if d.agent is not None and r.lockstep:
        problems.append(("rollout.lockstep", True, (
            "false with train_dataset.agent: an agent's requests arrive when its code sends them, which timing "
            "decides")))
    if d.env == TEXTARENA and not d.env_id:
        problems.append(("train_dataset.env_id", d.env_id, f"set with train_dataset.env={TEXTARENA}: the "
                                                           "single-player TextArena game, e.g. GuessTheNumber-v0"))
    if d.task == "file" and not d.path:
        problems.append(("train_dataset.path", d.path,
                         "a JSONL/Parquet file or dataset directory when train_dataset.task=file"))
    if cfg.cluster.n_trainer_ranks > 1 and a.device.startswith(f"{Device.CUDA}:"):
        problems.append(("actor.device", a.device, (
            f"cuda or auto with cluster.n_trainer_ranks={cfg.cluster.n_trainer_ranks}: each rank takes a GPU "
            "of its own (cuda:<rank>); CUDA_VISIBLE_DEVICES picks which")))
    c = cfg.cluster
    if c.launcher == Launcher.LOCAL and c.ray_address is not None:
        problems.append(("cluster.ray_address", c.ray_address, "null with cluster.launcher=local, "
                                                               "or set cluster.launcher=ray"))
    if cfg.gconfig.n_samples == 1 and a.adv_norm.mean_level == "group":
        problems.append(("gconfig.n_samples", 1, (
            "at least 2 for group-relative advantages, or set actor.adv_norm.mean_level=batch "
            "and actor.adv_norm.std_level=batch (or none)")))
    if cfg.gconfig.n_samples == 1 and a.adv_norm.std_level == "group":
        problems.append(("actor.adv_norm.std_level", "group", (
            "a group of one sample (gconfig.n_samples=1) has no spread to divide by; "
            "set actor.adv_norm.std_level=batch or none")))
    return problems + inert_keys(cfg)


def inert_keys(cfg: Config) -> list[tuple[str, Any, str]]:
    """Keys set (changed from their default) that the chosen settings never read, as check_consistency's
    problems: `train_dataset.path=x.jsonl` without `train_dataset.task=file` would train on the default
    task and look as if it had read the file. Each names the setting that would read it and the fix.

    Not here: train_dataset.size with task=file (the tiny preset sets it, and `--preset tiny
    train_dataset.task=file ...` must load and resume), and keys whose reader a launcher decides
    (cluster.data_parallel and cluster.timeout_s under torchrun's WORLD_SIZE)."""
    d, r, a, rs, c = cfg.train_dataset, cfg.rollout, cfg.actor, cfg.reward_service, cfg.cluster
    file = d.task == "file"
    env, agent = d.env is not None, d.agent is not None
    # (section, keys, read under these settings, the setting that reads them, what is set instead, the fix)
    rules = [
        ("train_dataset", ("path", "question_key", "answer_key"), file, "train_dataset.task=file",
         f"train_dataset.task is {d.task}", "set train_dataset.task=file"),
        ("train_dataset", ("task_params",), not file, "a procedural train_dataset.task (chain_sum, ...)",
         "train_dataset.task is file", "choose a procedural task"),
        ("train_dataset", ("max_turns", "max_context_tokens"), env or agent,
         "train_dataset.env or train_dataset.agent", "both are null", "set one of them"),
        ("train_dataset", ("turn_discount", "env_timeout_s", "turn_context"), env, "train_dataset.env",
         "train_dataset.env is null", "set an environment"),
        ("train_dataset", ("env_id",), d.env == TEXTARENA, f"train_dataset.env={TEXTARENA}",
         f"train_dataset.env is {d.env or 'null'}", f"set train_dataset.env={TEXTARENA}"),
        ("train_dataset", ("agent_timeout_s", "tool_call_format"), agent, "train_dataset.agent",
         "train_dataset.agent is null", "set an agent"),
        ("actor", ("kl_estimator",), a.kl_ctl > 0, "actor.kl_ctl > 0", "actor.kl_ctl is 0", "set actor.kl_ctl"),
        ("actor", ("behav_imp_weight_mode",), a.behav_imp_weight_cap is not None, "actor.behav_imp_weight_cap",
         "actor.behav_imp_weight_cap is null", "set a cap"),
        ("actor", ("sapo_tau_pos", "sapo_tau_neg"), a.policy_loss == "sapo", "actor.policy_loss=sapo",
         f"actor.policy_loss is {a.policy_loss}", "set actor.policy_loss=sapo"),
        ("actor", ("c_clip",), a.policy_loss == "ppo", "actor.policy_loss=ppo", f"actor.policy_loss is {a.policy_loss}",
         "choose ppo"),
        ("actor", ("eps_clip", "eps_clip_higher"), a.policy_loss != "sapo", "actor.policy_loss=ppo or cispo",
         "actor.policy_loss is sapo", "choose ppo or cispo"),
        ("actor.correction", ("ratio",), a.correction.tis != "none" or a.correction.mis != "none",
         "actor.correction.tis or mis", "both are none", "set one"),
        ("actor.correction", ("tis_cap",), a.correction.tis != "none", "actor.correction.tis=token or sequence",
         "actor.correction.tis is none", "set actor.correction.tis"),
        ("actor.correction", ("mis_low", "mis_high"), a.correction.mis != "none",
         "actor.correction.mis=token, sequence or geometric", "actor.correction.mis is none",
         "set actor.correction.mis"),
        ("actor.adv_norm", ("eps",), a.adv_norm.std_level != "none", "actor.adv_norm.std_level=group or batch",
         "actor.adv_norm.std_level is none", "set a std_level"),
        ("rollout", ("vllm_gpu_memory", "vllm_compile"), r.backend == Backend.VLLM, "rollout.backend=vllm",
         f"rollout.backend is {r.backend}", "set rollout.backend=vllm"),
        # reward_service.kind=none is refused with every other reward_service key above
        ("reward_service", ("template", "score_regex", "score_max", "max_tokens"), rs.kind != ServiceKind.SCORER,
         "reward_service.kind=judge", "reward_service.kind is scorer", "set reward_service.kind=judge"),
        ("reward_service", ("batch_size",), rs.kind != ServiceKind.JUDGE, "reward_service.kind=scorer",
         "reward_service.kind is judge", "set reward_service.kind=scorer"),
        ("logging", ("wandb_project",), cfg.logging.wandb, "logging.wandb=true", "logging.wandb is false",
         "set logging.wandb=true"),
        ("cluster", ("ray_placement",), c.launcher == Launcher.RAY, "cluster.launcher=ray",
         f"cluster.launcher is {c.launcher}", "set cluster.launcher=ray"),
    ]
    problems = []
    for path, names, read, reader, now, fix in rules:
        if read:
            continue
        section = cfg
        for part in path.split("."):
            section = getattr(section, part)
        default = type(section)()
        for name in names:
            value = getattr(section, name)
            if value != getattr(default, name):
                key = f"{path}.{name}"
                problems.append((key, value, f"only read with {reader}, and {now}: {fix} or drop {key}"))
    return problems
