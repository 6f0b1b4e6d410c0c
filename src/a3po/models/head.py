"""An fp32 LM head on a bf16 model: the logits, and so every log-prob, in full precision.

In bf16 the logits of a 49k vocabulary carry errors large enough to move a token's
log-prob by a few hundredths, differently in the sampler and in the trainer; those
differences go straight into the importance ratio. Computing only the head in fp32
costs one (tokens x hidden x vocab) matmul in fp32 and removes most of them.

With tied embeddings (SmolLM2) the head and the input embedding are one tensor; the
rollout copy gets a separate fp32 head, which weight sync fills from the trainer's
`lm_head.weight` like any other weight (the trainer's state dict names both).
"""

from __future__ import annotations

import torch


def use_fp32_head(model) -> None:
    """Give `model` an untied fp32 output layer that reads its input in fp32 (no-op on an fp32 model)."""
    head = model.get_output_embeddings()
    if head.weight.dtype == torch.float32:
        return
    new = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                          dtype=torch.float32, device=head.weight.device)
    with torch.no_grad():
        new.weight.copy_(head.weight)
        if head.bias is not None:
            new.bias.copy_(head.bias)
    new.register_forward_pre_hook(lambda _, args: (args[0].float(), *args[1:]))
    model.config.tie_word_embeddings = False  # nothing may tie them again
    model.set_output_embeddings(new)
