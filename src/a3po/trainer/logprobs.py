"""Per-token log-probs and entropy from hidden states, one vocabulary chunk at a time.

With SmolLM2's 49k vocabulary a (B*T, V) logits tensor for a 16 x 128 batch is 400 MB
in fp32, and autograd would keep it, its softmax and its log-softmax alive until the
backward pass. `token_logp_entropy` computes log pi(target) and the entropy row-chunk by
row-chunk, keeps only the hidden states, and recomputes each chunk's logits in the
backward pass, so at most one (chunk, V) block exists at any time.

Gradients, with z the temperature-scaled logits of one row, p = softmax(z), t the target:
    d log p_t / d z   = onehot(t) - p
    d H / d z_j       = -p_j (log p_j + H)
and z = h W^T / temperature. With a sampling filter (gconfig.top_k, top_p, min_p) p is the filtered,
renormalised distribution the engine samples from: the dropped tokens' p_j is 0, so they get no
gradient, and the filter's choice of tokens is a constant of the step (as the sampled token is).
"""

from __future__ import annotations

import torch
from torch import Tensor

from a3po.algo.filters import NO_FILTER, SamplingFilter, filter_logits

CHUNK_ELEMENTS = 1 << 24  # 16M logits (64 MB in fp32) per chunk


def rows_per_chunk(vocab: int) -> int:
    """Rows of one (rows, vocab) logits block: the head's matmul shape."""
    return max(1, CHUNK_ELEMENTS // vocab)


def _acc_dtype(t: Tensor) -> torch.dtype:
    """Softmax statistics run in fp32 (fp64 when given fp64, for gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_log_softmax(h: Tensor, w: Tensor, temperature: float, filt: SamplingFilter, targets: Tensor) -> Tensor:
    """log p (n, V) of one chunk's temperature-scaled logits, in fp32 (fp64 for fp64 input). With a sampling filter,
    of the filtered distribution: -inf on the tokens it drops, each target always kept."""
    z = (h @ w.T).to(_acc_dtype(h))  # (n, V)
    if temperature != 1.0:
        z /= temperature
    if filt.active:
        z = filter_logits(z, *filt.rows(len(z), z.device), keep=targets)  # keeps fp32 (fp64)
    return torch.log_softmax(z, dim=-1)  # one fused pass, cheaper than logsumexp and a subtraction


def _entropy(p: Tensor, q: Tensor) -> Tensor:
    """(n,) from p and its log q; q must be finite: a filtered-out token's -inf is the caller's to zero (its p is
    0, so it adds nothing), done only under a filter because the copy costs a pass over (n, V)."""
    return -(p * q).sum(-1)


class _TokenLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
                filt: SamplingFilter):
        ctx.set_materialize_grads(False)
        w = weight.to(hidden.dtype)
        n = rows_per_chunk(weight.shape[0])
        logp = torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden), device=hidden.device)
        entropy = torch.zeros_like(logp)
        for s in range(0, hidden.shape[0], n):
            q = _chunk_log_softmax(hidden[s : s + n], w, temperature, filt, targets[s : s + n])
            logp[s : s + n] = q.gather(-1, targets[s : s + n, None]).squeeze(-1)
            if with_entropy:
                entropy[s : s + n] = _entropy(q.exp(), q.nan_to_num(neginf=0.0) if filt.active else q)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.filt = temperature, filt
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        # Per chunk, with q = log p: dL/dz = [onehot(t) - p] g_logp - g_ent p (q + H), over the
        # temperature; built in place on q so that one (n, V) block plus p is alive. Both
        # matmuls run in the forward's compute dtype (bf16 under autocast, as autocast's own
        # linear layers do), with the weight gradient summed over chunks in fp32.
        hidden, weight, targets = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        acc = _acc_dtype(hidden)
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        n = rows_per_chunk(weight.shape[0])
        for s in range(0, hidden.shape[0], n):
            h, t = hidden[s : s + n], targets[s : s + n]
            q = _chunk_log_softmax(h, w, ctx.temperature, ctx.filt, t)
            p = q.exp()  # (n, V), computed once for both the entropy and the gradient
            if ctx.filt.active:
                q.nan_to_num_(neginf=0.0)  # filtered-out tokens: p = 0, so no gradient and no entropy from them
            if g_entropy is not None:
                ge = g_entropy[s : s + n].to(acc)[:, None]
                gz = q.add_(_entropy(p, q)[:, None]).mul_(ge).neg_()  # -g_ent (q + H)
            else:
                gz = q.zero_()
            if g_logp is not None:
                gl = g_logp[s : s + n].to(acc)[:, None]
                gz.sub_(gl)
                gz.mul_(p)
                gz.scatter_add_(-1, t[:, None], gl)
            else:
                gz.mul_(p)
            if ctx.temperature != 1.0:
                gz /= ctx.temperature
            gz_c = gz.to(w.dtype)
            if grad_h is not None:
                grad_h[s : s + n] = (gz_c @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w.add_(gz_c.T @ h.to(w.dtype))  # upcast inside the add: no fp32 copy of the (V, H) product
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None


def token_logp_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                       with_entropy: bool = True, filt: SamplingFilter = NO_FILTER) -> tuple[Tensor, Tensor]:
    """hidden (N, H), lm-head weight (V, H), targets (N,) -> (log pi(target), entropy),
    each (N,) fp32 (fp64 for fp64 input), of the distribution `filt` leaves (algo/filters.py).

    with_entropy=False skips the entropy (returned as zeros) where nobody reads it, as in
    the no-grad proximal pass: one exp and one product over the vocabulary less."""
    return _TokenLogpEntropy.apply(hidden, weight, targets, float(temperature), with_entropy, filt)


# On a CPU, up to this many tokens per sequence the model's plain matmul attention ("eager") runs the
# step faster than the fused scaled-dot-product kernel, whose backward is dear at short lengths; around
# 512 tokens the two are even and beyond that the fused kernel wins (docs/results.md). Eager's cost is
# memory: B x heads x T^2 attention weights per layer.
CPU_EAGER_ATTENTION_MAX_LEN = 256


class PolicyLogp(torch.nn.Module):
    """A causal LM whose forward ends in the chunked log-probs of the given targets.

    One module from tokens to log-probs, because data parallelism hooks a module's forward:
    FSDP2 gathers the sharded embedding, final norm and LM head around the root's forward,
    and the LM head here is used outside the Hugging Face model's own forward."""

    def __init__(self, model, temperature: float, autocast_dtype: torch.dtype | None, fp32_head: bool,
                 filt: SamplingFilter = NO_FILTER):
        super().__init__()
        self.model = model
        self.temperature, self.autocast_dtype, self.fp32_head, self.filt = temperature, autocast_dtype, fp32_head, filt

    def forward(self, input_ids: Tensor, attention_mask: Tensor, pred_mask: Tensor,
                with_entropy: bool = True) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy (N,) of the tokens `pred_mask` (B, T-1) marks: position i predicts token i + 1."""
        device = input_ids.device.type
        if device == "cpu":  # every layer reads this at call time, a checkpointed one again in the backward pass
            short = input_ids.shape[1] <= CPU_EAGER_ATTENTION_MAX_LEN
            self.model.config._attn_implementation = "eager" if short else "sdpa"
        with torch.autocast(device, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            hidden = self.model.base_model(input_ids=input_ids,
                                           attention_mask=attention_mask.long()).last_hidden_state  # (B, T, H)
        h = hidden[:, :-1][pred_mask]  # (N, H)
        if self.fp32_head:
            h = h.float()  # the head's matmul then runs on the fp32 master weight
        targets = input_ids[:, 1:][pred_mask]  # (N,)
        return token_logp_entropy(h, self.model.get_output_embeddings().weight, targets, self.temperature,
                                  with_entropy, self.filt)
