"""The local rollout engine: an in-process, continuously batched sampler over a Hugging Face causal LM.

    engine = LocalEngine(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode)
    engine.submit(GenerationRequest(prompt_ids, max_new_tokens=24, rid=0, seed=1))
    while engine.num_pending:
        finished = engine.step()

Each running sequence is one row of the forward's KV cache. Each `step` admits queued
requests (prefilled together into free rows), samples one token for every running row,
retires finished ones, and runs one decode forward pass for the rest. So new requests
join while others run, and a finished sequence frees its row at once.

The forward pass is a3po's own for Llama-family models (rollout/kv_decoder.py: a
preallocated cache, written in place) or the model's Hugging Face forward for any other
(rollout/hf_forward.py); `forward` ("auto", "a3po", "hf", config `rollout.forward`) chooses.

`update_weights` copies new weights in place between two steps. What happens to the
sequences in flight is `reprefill_on_update` (config `rollout.weight_update`):
  - True ("reprefill"): they are prefilled again with the new weights, so their KV cache
    and next-token logits are exact for the new version; every token sampled afterwards
    carries it. Costs one prefill of every running sequence per version.
  - False ("keep_kv"): their KV cache, computed by older weights, is kept and decoding
    continues with the new weights. Each token still records the exact log-prob it was
    drawn with (so the behaviour weight p/b stays valid) and the version of the weights
    that computed its logits; only the prefix's influence is of older weights. The token
    drawn right after the update comes from logits the old weights computed and so
    carries the old version.

Multi-turn episodes (a request with a `session`): when such a sequence finishes, its row's
KV cache is copied aside; the session's next request, whose prompt extends the sequence,
takes it back and computes only the new tokens (an observation, the previous turn's last
token). New weights since then: under "reprefill" the kept caches are dropped and the next
turn is prefilled whole on the new weights, under "keep_kv" they are used as for sequences
in flight. Only the a3po forward keeps caches; the Hugging Face one prefills every turn.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from a3po.config.choices import AUTO, Forward
from a3po.rollout import kv_decoder
from a3po.rollout.engine import Completion, GenerationRequest
from a3po.rollout.hf_forward import HFForward
from a3po.rollout.sampling import alternatives, distribution, draw


@dataclass
class _Running:
    request: GenerationRequest
    completion: Completion
    generator: torch.Generator
    stop_ids: frozenset = field(default_factory=frozenset)
    kept: tuple | None = None  # the session's parked cache, for the prompt's first len(kept tokens) tokens

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.completion.output_ids


def make_forward(model, rows: int, forward: str = AUTO):
    """The forward pass `forward` (rollout.forward) names for `model`; "a3po" on a model it cannot run is a
    ValueError saying why."""
    if forward not in Forward.CHOICES:
        raise ValueError(f"forward {forward!r}: choose from {', '.join(Forward.CHOICES)}")
    why = kv_decoder.unsupported(model) if forward != Forward.HF else "asked for"
    if why is None:
        return kv_decoder.KVDecoder(model, rows)
    if forward == Forward.A3PO:
        raise ValueError(f"rollout.forward=a3po cannot run this model: {why}; use rollout.forward=auto or hf")
    return HFForward(model)


class LocalEngine:
    def __init__(
        self,
        model,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        max_batch: int = 64,
        seed: int = 0,
        version: int = 0,
        reprefill_on_update: bool = True,
        forward: str = AUTO,
    ):
        from a3po.models.lora import has_adapters

        if has_adapters(model):  # its forward here would read the base weights alone and sample the base model
            raise ValueError("the local engine samples plain models: fold the LoRA adapters in first "
                             "(models/lora.py merged or Folder)")
        self.model = model.eval()
        self.forward = make_forward(model, max_batch, forward)
        self.eos = frozenset(int(i) for i in eos_token_ids)
        self.decode = decode
        self.max_batch = max_batch
        self.version = version
        self.reprefill_on_update = reprefill_on_update
        self._seed = seed
        self._n_seen = 0
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Running] = []  # row i of the forward's cache is _running[i]
        self._logits: Tensor | None = None  # (B, V) logits for each row's next token
        self._logits_version: Tensor | None = None  # (B,) version of the weights that computed them
        self._kept: OrderedDict[Hashable, tuple[tuple, list[int]]] = OrderedDict()  # session -> (cache, its tokens)
        self.max_kept = 2 * max_batch  # the oldest kept cache is dropped past this many (its turn then prefills)

    # -- interface ------------------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        return len(self._waiting) + len(self._running)

    def close(self) -> None:
        """Nothing outlives the process."""

    def release(self, session: Hashable) -> None:
        self._kept.pop(session, None)

    def submit(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.rid!r} has an empty prompt")
        self._waiting.append(request)

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        own = self.model.state_dict()
        unknown = [k for k in weights if k not in own]
        if unknown:
            raise KeyError(f"weights not in the rollout model: {unknown[:3]}")
        for name, value in weights.items():
            own[name].copy_(value)
        self.forward.weights_changed()
        self.version = version
        if self.reprefill_on_update:
            self._kept.clear()  # computed by older weights: the next turns are prefilled on these
        if self._running and self.reprefill_on_update:
            self._logits = self.forward.prefill(0, [r.tokens for r in self._running])
            self._logits_version.fill_(version)

    @torch.no_grad()
    def step(self) -> list[Completion]:
        self._admit()
        if not self._running:
            return []
        tokens, logps, tops = self._sample()
        finished, keep = [], []
        rows = zip(self._running, tokens.tolist(), logps.tolist(), self._logits_version.tolist(), tops)
        for i, (r, tok, lp, ver, top) in enumerate(rows):
            c = r.completion
            c.output_ids.append(tok)
            c.output_logprobs.append(lp)
            c.output_versions.append(ver)
            if r.request.top_logprobs:
                c.output_top_logprobs.append(top)
            if tok in r.stop_ids or self._hit_stop_string(r):
                c.finish_reason = "stop"
            elif len(c.output_ids) >= r.request.max_new_tokens:
                c.finish_reason = "length"
            else:
                keep.append(i)
                continue
            finished.append(c)
            if r.request.session is not None and hasattr(self.forward, "park"):
                self._park(i, r)
        if finished:
            order = self.forward.keep(keep)
            self._running = [self._running[i] for i in order]
            self._logits_version = self._logits_version[order]
            tokens = tokens[order]
        if self._running:
            self._logits = self.forward.decode(tokens)
            self._logits_version = torch.full_like(self._logits_version, self.version)
        else:
            self._logits = self._logits_version = None
        return finished

    # -- internals ------------------------------------------------------------------------

    def _park(self, row: int, r: _Running) -> None:
        session = r.request.session
        self._kept.pop(session, None)
        cache = self.forward.park(row)
        self._kept[session] = (cache, r.tokens[:cache[0][0].shape[1]])
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)

    def _admit(self) -> None:
        new = []
        while self._waiting and len(self._running) + len(new) < self.max_batch:
            req = self._waiting.popleft()
            seed = req.seed if req.seed is not None else self._seed * 1_000_003 + self._n_seen
            self._n_seen += 1
            gen = torch.Generator().manual_seed(seed)
            stop_ids = self.eos | frozenset(req.stop_token_ids)
            run = _Running(req, Completion(req.rid, list(req.prompt_ids)), gen, stop_ids)
            kept = self._kept.pop(req.session, None) if req.session is not None else None
            if kept is not None and len(kept[1]) < len(req.prompt_ids) and req.prompt_ids[:len(kept[1])] == kept[1]:
                run.kept = kept
            new.append(run)
        if not new:
            return
        new.sort(key=lambda r: r.kept is not None)  # rows: fresh prompts prefilled together, then continued sessions
        fresh = [r for r in new if r.kept is None]
        parts = []
        start = len(self._running)
        if fresh:
            parts.append(self.forward.prefill(start, [r.tokens for r in fresh]))
            for r in fresh:
                r.completion.prefilled = len(r.request.prompt_ids)
        resumed = new[len(fresh):]
        if resumed:
            parts.append(self.forward.extend(start + len(fresh), [r.kept[0] for r in resumed],
                                             [r.request.prompt_ids[len(r.kept[1]):] for r in resumed]))
            for r in resumed:
                r.completion.prefilled = len(r.request.prompt_ids) - len(r.kept[1])
                r.kept = None
        logits = torch.cat(parts)
        versions = torch.full((len(new),), self.version, dtype=torch.long)
        if self._running:
            logits = torch.cat([self._logits, logits])
            versions = torch.cat([self._logits_version, versions])
        self._logits, self._logits_version = logits, versions
        self._running.extend(new)

    def _sample(self) -> tuple[Tensor, Tensor, list[tuple[tuple[int, float], ...]]]:
        """Each row's token, its log-prob, and the alternatives its request asked for (empty for the others)."""
        rs = [r.request for r in self._running]
        greedy = torch.tensor([r.greedy for r in rs])
        p = distribution(self._logits, torch.tensor([r.temperature for r in rs]), torch.tensor([r.top_k for r in rs]),
                         torch.tensor([r.top_p for r in rs]), greedy, torch.tensor([r.min_p for r in rs]))
        tokens, logps = draw(p, greedy, [r.generator for r in self._running])
        return tokens, logps, alternatives(p, [r.top_logprobs for r in rs])

    def _hit_stop_string(self, r: _Running) -> bool:
        if not r.request.stop or self.decode is None:
            return False
        tail = self.decode(r.completion.output_ids[-16:])
        return any(s in tail for s in r.request.stop)
