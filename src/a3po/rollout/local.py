"""The local rollout engine: an in-process, continuously batched sampler over a Hugging Face causal LM.

    engine = LocalEngine(model, eos_token_ids=[tok.eos_token_id], decode=tok.decode)
    engine.submit(GenerationRequest(prompt_ids, max_new_tokens=24, rid=0, seed=1))
    while engine.num_pending:
        finished = engine.step()

Sequences share one left-padded KV cache. Each `step` admits queued requests (prefilled
together, then merged into the running batch), samples one token for every running
sequence, retires finished ones, and runs one decode forward pass for the rest. So new
requests join while others run, and a finished sequence frees its row at once.

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
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from a3po.rollout.engine import Completion, GenerationRequest
from a3po.rollout.sampling import draw, sampling_logp


@dataclass
class _Running:
    request: GenerationRequest
    completion: Completion
    generator: torch.Generator
    stop_ids: frozenset = field(default_factory=frozenset)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.completion.output_ids


class LocalEngine:
    def __init__(
        self,
        model,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        max_batch: int = 64,
        pad_id: int = 0,
        seed: int = 0,
        version: int = 0,
        reprefill_on_update: bool = True,
    ):
        self.model = model.eval()
        self.device = next(model.parameters()).device  # every tensor a forward pass reads is made there
        self.eos = frozenset(int(i) for i in eos_token_ids)
        self.decode = decode
        self.max_batch = max_batch
        self.pad_id = pad_id
        self.version = version
        self.reprefill_on_update = reprefill_on_update
        self._seed = seed
        self._n_seen = 0
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Running] = []
        self._cache = None  # DynamicCache over the running rows, left-padded
        self._attn: Tensor | None = None  # (B, L) long, 1 on real tokens
        self._next_pos: Tensor | None = None  # (B,) position of the next token
        self._logits: Tensor | None = None  # (B, V) logits for the next token
        self._logits_version: Tensor | None = None  # (B,) version of the weights that computed them
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # -- interface ------------------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        return len(self._waiting) + len(self._running)

    def close(self) -> None:
        """Nothing outlives the process."""

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
        self.version = version
        if self._running and self.reprefill_on_update:
            self._cache, self._attn, self._next_pos, self._logits = self._prefill([r.tokens for r in self._running])
            self._logits_version.fill_(version)

    @torch.no_grad()
    def step(self) -> list[Completion]:
        self._admit()
        if not self._running:
            return []
        tokens, logps = self._sample()
        finished, keep = [], []
        rows = zip(self._running, tokens.tolist(), logps.tolist(), self._logits_version.tolist())
        for i, (r, tok, lp, ver) in enumerate(rows):
            c = r.completion
            c.output_ids.append(tok)
            c.output_logprobs.append(lp)
            c.output_versions.append(ver)
            if tok in r.stop_ids or self._hit_stop_string(r):
                c.finish_reason = "stop"
                finished.append(c)
            elif len(c.output_ids) >= r.request.max_new_tokens:
                c.finish_reason = "length"
                finished.append(c)
            else:
                keep.append(i)
        if finished:
            self._keep_rows(keep, tokens)
        else:
            self._decode(tokens)
        return finished

    # -- internals ------------------------------------------------------------------------

    def _admit(self) -> None:
        new = []
        while self._waiting and len(self._running) + len(new) < self.max_batch:
            req = self._waiting.popleft()
            seed = req.seed if req.seed is not None else self._seed * 1_000_003 + self._n_seen
            self._n_seen += 1
            gen = torch.Generator().manual_seed(seed)
            stop_ids = self.eos | frozenset(req.stop_token_ids)
            new.append(_Running(req, Completion(req.rid, list(req.prompt_ids)), gen, stop_ids))
        if not new:
            return
        cache, attn, pos, logits = self._prefill([r.tokens for r in new])
        versions = torch.full((len(new),), self.version, dtype=torch.long)
        if not self._running:
            self._cache, self._attn, self._next_pos, self._logits = cache, attn, pos, logits
            self._logits_version = versions
        else:
            self._merge(cache, attn, pos, logits)
            self._logits_version = torch.cat([self._logits_version, versions])
        self._running.extend(new)

    def _forward(self, ids: Tensor, attn: Tensor, pos: Tensor, cache) -> Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        return out.logits[:, -1].float()  # (B, V)

    def _prefill(self, seqs: list[list[int]]):
        """Left-padded prefill of whole sequences: (cache, attention mask, next positions, next-token logits)."""
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
            attn[i, L - len(s):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        cache = DynamicCache()
        logits = self._forward(ids, attn, pos, cache)
        return cache, attn, attn.sum(-1), logits

    def _merge(self, cache, attn: Tensor, pos: Tensor, logits: Tensor) -> None:
        """Append prefilled rows to the running batch, left-padding the shorter side."""
        L_old, L_new = self._attn.shape[1], attn.shape[1]
        L = max(L_old, L_new)
        for own, other in zip(self._cache.layers, cache.layers):
            own.keys = torch.cat([_left_pad(own.keys, L), _left_pad(other.keys, L)], 0)
            own.values = torch.cat([_left_pad(own.values, L), _left_pad(other.values, L)], 0)
        self._attn = torch.cat([_left_pad(self._attn, L, dim=1), _left_pad(attn, L, dim=1)], 0)
        self._next_pos = torch.cat([self._next_pos, pos])
        self._logits = torch.cat([self._logits, logits])

    def _sample(self) -> tuple[Tensor, Tensor]:
        rs = [r.request for r in self._running]
        logits = self._logits
        on = lambda values: torch.tensor(values, device=logits.device)
        greedy = on([r.greedy for r in rs])
        logp = sampling_logp(
            logits, on([r.temperature for r in rs]), on([r.top_k for r in rs]), on([r.top_p for r in rs]),
        )  # (B, V)
        tokens = draw(logp, [r.generator for r in self._running])
        raw = torch.log_softmax(logits, -1) if greedy.any() else logp  # raw log-probs only for greedy rows
        tokens = torch.where(greedy, raw.argmax(-1), tokens)
        chosen = torch.where(greedy[:, None], raw, logp).gather(-1, tokens[:, None]).squeeze(-1)
        bad = ~torch.isfinite(chosen)  # rounding past the last kept token
        if bad.any():
            tokens = torch.where(bad, logp.argmax(-1), tokens)
            chosen = torch.where(greedy[:, None], raw, logp).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, chosen

    def _hit_stop_string(self, r: _Running) -> bool:
        if not r.request.stop or self.decode is None:
            return False
        tail = self.decode(r.completion.output_ids[-16:])
        return any(s in tail for s in r.request.stop)

    def _decode(self, tokens: Tensor) -> None:
        """One decode forward pass for every running row with its newest token."""
        self._attn = torch.cat([self._attn, self._attn.new_ones(len(tokens), 1)], 1)
        self._logits = self._forward(tokens[:, None], self._attn, self._next_pos[:, None], self._cache)
        self._logits_version = torch.full_like(self._logits_version, self.version)
        self._next_pos = self._next_pos + 1

    def _keep_rows(self, keep: list[int], tokens: Tensor) -> None:
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache = self._attn = self._next_pos = self._logits = self._logits_version = None
            return
        rows = torch.tensor(keep, dtype=torch.long)
        idx = rows.to(self.device)
        attn = self._attn[idx]
        start = int((attn.sum(0) > 0).to(torch.int8).argmax())  # drop columns that are padding in every row
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self._attn, self._next_pos, self._logits = attn[:, start:], self._next_pos[idx], self._logits[idx]
        self._logits_version = self._logits_version[rows]  # bookkeeping, on the CPU
        self._decode(tokens[idx])


def _left_pad(t: Tensor, length: int, dim: int = 2) -> Tensor:
    """Zero-pad `t` on the left along `dim` to `length`."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim)
