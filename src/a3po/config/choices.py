"""The values of the configuration's enumerated keys that code branches on, each vocabulary once.

The schema's `choices` (schema.py), `a3po bench`'s options (bench/args.py) and every
comparison of such a value (`cfg.rollout.backend == Backend.VLLM`) read these names, so
that a value is spelled in one place and a typo is an AttributeError, not a branch that
silently never runs. The values stay plain strings, as in YAML and on the command line.
Torch-free: `a3po --help` builds its choice lists from here; devices.py turns the dtype
and device names into torch objects.
"""

from __future__ import annotations

AUTO = "auto"  # dtype, device and forward: decided from the machine and the model at start-up
TEXTARENA = "textarena"  # train_dataset.env: a game of the TextArena library, train_dataset.env_id (envs/textarena.py)


class Dtype:
    """actor.dtype, rollout.dtype: the compute (or parameter) dtype."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    RESOLVED = (FLOAT32, BFLOAT16)  # what `auto` becomes (devices.resolve_dtype)
    CHOICES = (AUTO, *RESOLVED)


class Device:
    """actor.device, rollout.device: auto, cpu, cuda or cuda:N."""

    CPU = "cpu"
    CUDA = "cuda"
    PATTERN = rf"{AUTO}|{CPU}|{CUDA}(:[0-9]+)?"
    PATTERN_HELP = f"use {AUTO}, {CPU}, {CUDA} or {CUDA}:N"


class Backend:
    """rollout.backend: the inference engine in each rollout worker."""

    LOCAL = "local"  # a3po's own sampler (rollout/local.py)
    VLLM = "vllm"  # rollout/vllm_engine.py
    CHOICES = (LOCAL, VLLM)


class Forward:
    """rollout.forward: the local engine's forward pass."""

    A3PO = "a3po"  # its own KV-cache decoder (rollout/kv_decoder.py)
    HF = "hf"  # the model's Hugging Face forward (rollout/hf_forward.py)
    CHOICES = (AUTO, A3PO, HF)


class WeightUpdate:
    """rollout.weight_update: what a worker does with sequences in flight when new weights arrive."""

    REPREFILL = "reprefill"
    KEEP_KV = "keep_kv"
    CHOICES = (REPREFILL, KEEP_KV)


class Launcher:
    """cluster.launcher: who starts trainer ranks 1..N-1 and the rollout workers."""

    LOCAL = "local"
    RAY = "ray"
    CHOICES = (LOCAL, RAY)


class DpMode:
    """cluster.data_parallel: how several trainer ranks hold the model."""

    FSDP2 = "fsdp2"
    DDP = "ddp"
    CHOICES = (FSDP2, DDP)


class ServiceKind:
    """reward_service.kind: a reward from a model behind HTTP (a3po/rewards/)."""

    NONE = "none"
    JUDGE = "judge"  # an OpenAI-compatible chat model asked to grade, its score parsed from the answer
    SCORER = "scorer"  # a server that scores {prompt, completion} batches (a reward model)
    CHOICES = (NONE, JUDGE, SCORER)


class OnFailure:
    """reward_service.on_failure: what a completion the service could not score becomes."""

    ZERO = "zero"  # scores 0, counted as a reward failure
    DROP = "drop"  # its group is dropped and refilled from the dataset
    STOP = "stop"  # the run stops with the reason
    CHOICES = (ZERO, DROP, STOP)


class TurnContext:
    """train_dataset.turn_context: how an episode's next turn gets its context (rollout/episodes.py)."""

    APPEND = "append"  # one row that only grows: the observation's ids appended after the model's own tokens
    RERENDER = "rerender"  # each turn its own row: the conversation rendered whole by the template, as context
    CHOICES = (AUTO, APPEND, RERENDER)  # auto: append when the template extends a conversation by appending


class ToolCallFormat:
    """train_dataset.tool_call_format, `a3po serve --tool-call-format`: how tool calls are read out of replies.

    Each named format has its reader in serving/toolcalls.py, keyed by these names."""

    NONE = "none"  # replies are text as written, whatever they hold
    HERMES = "hermes"  # <tool_call>{json}</tool_call> (Qwen2.5, Qwen3, SmolLM2)
    MISTRAL = "mistral"  # [TOOL_CALLS][{json}, ...]
    LLAMA3 = "llama3"  # the whole reply one {"name": ..., "parameters": {...}} (Llama 3.1, 3.2)
    READ = (HERMES, MISTRAL, LLAMA3)  # in the order a chat template is matched against them
    CHOICES = (AUTO, NONE, *READ)
