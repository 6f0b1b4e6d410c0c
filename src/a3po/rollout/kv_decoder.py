"""The local engine's own forward pass for Llama-family models: one preallocated KV cache row per sequence.

Why not the model's Hugging Face forward: on a CPU, a decode step of 64 rows spends more time
around the matmuls than in them. Its cache grows by concatenation every step (a copy of the
whole cache per layer), scaled-dot-product attention with one query token costs far more than
a plain batched matmul, and each step rebuilds masks and rotary tables. Here:
  - every sequence owns row i of a (rows, kv heads, capacity, head dim) cache per layer, written
    in place at its own length; capacity grows by doubling only when a sequence outgrows it;
  - a finished row is filled by moving the last running row into it (`keep`), so the running
    rows stay 0..B-1 without copying the others;
  - one decode step's attention is two batched matmuls per layer with the query heads grouped
    by their KV head, in fp32 whatever the weight dtype (the cache is kept in the weights'
    dtype and converted as it is read: an fp32 cache would double the memory each step
    streams, and is slower);
  - rotary cos/sin come from the model's own rotary module once per capacity, so every static
    RoPE variant the model supports is computed as the model computes it;
  - q, k, v and gate, up are one matmul each, and in bf16 on a CPU every matrix is kept in
    oneDNN's blocked layout, packed once per weight version instead of at every call;
  - identical sequences in one prefill (a group's samples of one prompt) run once.
Those fused and packed matrices are copies: after the model's weights change, the engine
calls `weights_changed`, once per version. What these choices measured is in docs/results.md.

`unsupported(model)` says why a model cannot run here (another architecture, sliding
windows, dynamic RoPE); the engine then uses the Hugging Face forward (rollout/hf_forward.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

ARCHITECTURES = ("llama", "qwen2")  # same decoder layer; qwen2 adds biases to q, k, v
STATIC_ROPE = ("default", "linear", "llama3")  # cos/sin depend on the position only


def unsupported(model) -> str | None:
    """Why `model` cannot use this forward, or None when it can."""
    cfg = model.config
    if cfg.model_type not in ARCHITECTURES:
        return f"model_type {cfg.model_type!r} (supported: {', '.join(ARCHITECTURES)})"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r} (supported: {', '.join(STATIC_ROPE)})"
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return "parameters that are not plain tensors (sharded?)"
    return None


class KVDecoder:
    def __init__(self, model, rows: int, pack: bool | None = None):
        """pack: store the linear layers' weights prepacked for oneDNN; None: where that is faster and available
        (bf16 on a CPU whose torch has the op, `can_pack`)."""
        cfg = model.config
        self.body, self.head = model.model, model.get_output_embeddings()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.rows = rows
        weight = self.body.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.length = torch.zeros(rows, dtype=torch.long, device=self.device)  # tokens cached per row
        self.capacity = 0
        self.keys: list[Tensor] = []  # per layer (rows, kv heads, capacity, head dim), the model's dtype
        self.values: list[Tensor] = []
        self.cos = self.sin = torch.empty(0)  # (capacity, head dim) in the model's dtype
        if pack is None:
            pack = self.device.type == "cpu" and self.dtype == torch.bfloat16 and can_pack()
        attn, mlp = [layer.self_attn for layer in self.body.layers], [layer.mlp for layer in self.body.layers]
        self.qkv = [_Linear([a.q_proj, a.k_proj, a.v_proj], pack) for a in attn]
        self.out = [_Linear([a.o_proj], pack) for a in attn]
        self.gate_up = [_Linear([m.gate_proj, m.up_proj], pack) for m in mlp]
        self.down = [_Linear([m.down_proj], pack) for m in mlp]
        self.lm_head = _Linear([self.head], pack and self.head.weight.dtype == torch.bfloat16)

    def weights_changed(self) -> None:
        """Rebuild the fused (and packed) matrices from the model's weights, after they were overwritten."""
        for linear in (*self.qkv, *self.out, *self.gate_up, *self.down, self.lm_head):
            linear.refresh()

    # -- what the engine calls ---------------------------------------------------------

    @torch.no_grad()
    def prefill(self, start: int, seqs: list[list[int]]) -> Tensor:
        """Run whole sequences into rows start.. (replacing what was there): their next-token logits (n, V).
        Identical sequences (a group's samples of one prompt) are computed once and their rows copied."""
        home: dict[tuple[int, ...], int] = {}  # each distinct sequence -> the first of its rows
        for r, s in enumerate(seqs):
            home.setdefault(tuple(s), r)
        unique = list(home)
        number = {s: u for u, s in enumerate(unique)}
        which = [number[tuple(s)] for s in seqs]  # each row's distinct sequence
        n, L = len(unique), max(map(len, unique))
        self._reserve(L)
        ids = torch.zeros(n, L, dtype=torch.long)
        for i, s in enumerate(unique):  # right-padded: under the causal mask padding never reaches a real token
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        lengths = torch.tensor([len(s) for s in unique], device=self.device)
        which = torch.tensor(which, device=self.device)
        rows = start + torch.tensor(list(home.values()), device=self.device)  # rows computed; the rest are copies
        cos, sin = self.cos[:L], self.sin[:L]  # (L, d), broadcast over (n, heads, L, d)
        x = self.body.embed_tokens(ids.to(self.device))  # (n, L, hidden)
        for i, layer in enumerate(self.body.layers):
            q, k, v = self._qkv(i, _norm(layer.input_layernorm, x))  # (n, L, heads or kv heads, d)
            q, k, v = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
            self.keys[i][rows, :, :L] = k
            self.values[i][rows, :, :L] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.self_attn.scaling,
                                               enable_gqa=self.kv_heads != self.heads)  # (n, heads, L, d)
            x = x + self.out[i](o.transpose(1, 2).reshape(n, L, -1))
            x = x + self._mlp(i, layer, x)
        everyone = start + torch.arange(len(seqs), device=self.device)
        if n < len(seqs):  # copies of a unique sequence's rows
            for cache in (*self.keys, *self.values):
                cache[everyone, :, :L] = cache[rows[which], :, :L]
        self.length[everyone] = lengths[which]
        return self._logits(x[torch.arange(n, device=self.device), lengths - 1])[which]

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        """Append one token to each of rows 0..B-1: their next-token logits (B, V)."""
        B = tokens.shape[0]
        pos = self.length[:B]  # (B,) where each row's token goes
        span = int(pos.max()) + 1  # cache columns any row reads
        self._reserve(span)
        row = torch.arange(B, device=self.device)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, d)
        hidden = torch.arange(span, device=self.device)[None] > pos[:, None]  # (B, span) columns past each row
        mask = torch.zeros(B, 1, 1, span, device=self.device).masked_fill_(hidden[:, None, None], float("-inf"))
        group = self.heads // self.kv_heads
        x = self.body.embed_tokens(tokens.to(self.device))  # (B, hidden)
        for i, layer in enumerate(self.body.layers):
            q, k, v = self._qkv(i, _norm(layer.input_layernorm, x))  # (B, heads or kv heads, d)
            keys, values = self.keys[i], self.values[i]
            keys[row, :, pos] = _rotate(k, cos, sin)
            values[row, :, pos] = v
            q = _rotate(q, cos, sin).view(B, self.kv_heads, group, -1).float()  # query head j reads KV head j // group
            scores = q @ keys[:B, :, :span].float().transpose(-1, -2) * layer.self_attn.scaling + mask
            o = torch.softmax(scores, -1) @ values[:B, :, :span].float()  # (B, kv, group, d)
            x = x + self.out[i](o.to(x.dtype).reshape(B, -1))
            x = x + self._mlp(i, layer, x)
        self.length[:B] += 1
        return self._logits(x)

    def park(self, row: int) -> tuple[list[Tensor], list[Tensor]]:
        """A copy of what row `row` has cached (keys and values per layer), to continue it later in any row."""
        n = int(self.length[row])
        return [k[row, :, :n].clone() for k in self.keys], [v[row, :, :n].clone() for v in self.values]

    @torch.no_grad()
    def extend(self, start: int, kept: list[tuple[list[Tensor], list[Tensor]]], news: list[list[int]]) -> Tensor:
        """Put parked caches (of c_i tokens each) into rows start.. and run each row's tokens `news[i]` after its
        cache, all rows in one pass: their next-token logits (n, V). Costs the new tokens only."""
        n = len(kept)
        c = torch.tensor([k[0][0].shape[1] for k in kept], device=self.device)  # (n,) cached tokens
        m = torch.tensor([len(x) for x in news], device=self.device)  # (n,) new tokens
        M = int(m.max())
        L = int(c.max()) + M
        self._reserve(L)
        rows = start + torch.arange(n, device=self.device)
        for r, (keys, values) in enumerate(kept):
            for cache, part in zip((*self.keys, *self.values), (*keys, *values)):
                cache[start + r, :, :part.shape[1]] = part
        ids = torch.zeros(n, M, dtype=torch.long)
        for r, x in enumerate(news):  # right-padded: a padding token sits past its row's length, never read
            ids[r, :len(x)] = torch.tensor(x, dtype=torch.long)
        pos = c[:, None] + torch.arange(M, device=self.device)[None]  # (n, M) each token's position
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (n, 1, M, d)
        allowed = torch.arange(L, device=self.device)[None, None] <= pos[:, :, None]  # (n, M, L): causal per row
        x = self.body.embed_tokens(ids.to(self.device))  # (n, M, hidden)
        for i, layer in enumerate(self.body.layers):
            q, k, v = self._qkv(i, _norm(layer.input_layernorm, x))  # (n, M, heads or kv heads, d)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            self.keys[i][rows[:, None], :, pos] = k.transpose(1, 2)  # indexed as (n, M, kv heads, d)
            self.values[i][rows[:, None], :, pos] = v
            o = F.scaled_dot_product_attention(q, self.keys[i][rows, :, :L], self.values[i][rows, :, :L],
                                               attn_mask=allowed[:, None], scale=layer.self_attn.scaling,
                                               enable_gqa=self.kv_heads != self.heads)  # (n, heads, M, d)
            x = x + self.out[i](o.transpose(1, 2).reshape(n, M, -1))
            x = x + self._mlp(i, layer, x)
        self.length[rows] = c + m
        return self._logits(x[torch.arange(n, device=self.device), m - 1])

    def keep(self, rows: list[int]) -> list[int]:
        """Keep only `rows` (ascending), as rows 0..len(rows)-1: the old row each new row holds.
        A kept row already below len(rows) stays where it is; the others fill the gaps."""
        n, kept = len(rows), set(rows)
        gaps = [i for i in range(n) if i not in kept]
        movers = [r for r in rows if r >= n]
        order = list(range(n))
        for gap, r in zip(gaps, movers):
            order[gap] = r
        if gaps:
            src, dst = torch.tensor(movers, device=self.device), torch.tensor(gaps, device=self.device)
            for cache in (*self.keys, *self.values):
                cache[dst] = cache[src]
            self.length[dst] = self.length[src]
        return order

    # -- internals ---------------------------------------------------------------------

    def _reserve(self, length: int) -> None:
        """Make room for `length` tokens per row, doubling, so a run reallocates a few times at most."""
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity, 64)
        shape = (self.rows, self.kv_heads, capacity, self.head_dim)
        grown = []
        for old in (*self.keys, *self.values) or [None] * (2 * len(self.body.layers)):
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old is not None:
                new[:, :, :self.capacity] = old
            grown.append(new)
        half = len(grown) // 2
        self.keys, self.values = grown[:half], grown[half:]
        positions = torch.arange(capacity, device=self.device)[None]
        cos, sin = self.body.rotary_emb(self.body.embed_tokens.weight[:1], positions)  # (1, capacity, d)
        self.cos, self.sin, self.capacity = cos[0], sin[0], capacity

    def _qkv(self, i: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of hidden states (..., hidden): (..., heads or kv heads, d) each."""
        qkv = self.qkv[i](h).unflatten(-1, (-1, self.head_dim))
        return qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=-2)

    def _mlp(self, i: int, layer, x: Tensor) -> Tensor:
        gate, up = self.gate_up[i](_norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
        return self.down[i](layer.mlp.act_fn(gate) * up)

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm_head(_norm(self.body.norm, x).to(self.head.weight.dtype))  # an fp32 head reads fp32


class _Linear:
    """One matmul over one or more of the model's linear layers side by side (q, k, v; gate, up): one
    call with a wider output keeps the cores busier than three narrow ones. With `pack` (bf16 on a
    CPU) the matrix is also stored in oneDNN's blocked layout once, rather than at every call."""

    def __init__(self, modules: list, pack: bool):
        self.modules, self.pack = modules, pack
        self.refresh()

    def refresh(self) -> None:
        with torch.no_grad():
            w = torch.cat([m.weight for m in self.modules]) if len(self.modules) > 1 else self.modules[0].weight
            biases = [m.bias for m in self.modules]
            self.b = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(self.modules, biases)])
            self.w = torch.ops.mkldnn._reorder_linear_weight(w, 64) if self.pack else w

    def __call__(self, x: Tensor) -> Tensor:
        if not self.pack:
            return F.linear(x, self.w, self.b)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.w, self.b, "none", [], "")
        return y.view(*x.shape[:-1], -1)


@functools.cache
def can_pack() -> bool:
    """oneDNN's prepacked linear is a private torch op: used only where it exists and runs."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=torch.bfloat16), w, None, "none", [], "")
        return bool((y == 8).all())
    except (AttributeError, RuntimeError):
        return False


def _norm(norm, x: Tensor) -> Tensor:
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding as Llama applies it: halves of the head dimension paired."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin
