"""actor.fp32_lm_head: the logits in fp32 on a bf16 model, in the sampler and in the trainer.

Proves: the rollout copy gets an untied fp32 head whose logits are exactly the fp32 product
of its (bf16) input and the fp32 weight; weight sync fills that head from the trainer's
`lm_head.weight` at full precision while the embedding keeps bf16; the trainer's head
runs in fp32 under bf16 autocast. (How much closer sampler and trainer get is measured, not
tested: docs/results.md, "Numerics"; the bf16 body dominates. docs/scaling.md, Devices.)
"""

import copy

import torch

from a3po.config import load_config
from a3po.models.head import use_fp32_head
from a3po.rollout.local import LocalEngine
from a3po.trainer.engine import TrainEngine
from a3po.trajectories import Trajectory, collate


def bf16_copy(model, fp32_head: bool):
    m = copy.deepcopy(model).to(torch.bfloat16)
    if fp32_head:
        use_fp32_head(m)
    return m


def test_the_head_is_fp32_untied_and_computes_in_fp32(tiny):
    model, _ = tiny
    m = bf16_copy(model, fp32_head=True)
    head, emb = m.get_output_embeddings(), m.get_input_embeddings()
    assert head.weight.dtype == torch.float32 and emb.weight.dtype == torch.bfloat16
    assert head.weight.data_ptr() != emb.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        hidden = m.base_model(input_ids=ids).last_hidden_state  # bf16
        logits = m(input_ids=ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ head.weight.T, rtol=0, atol=1e-5)


def test_weight_sync_fills_the_fp32_head_at_full_precision(tiny):
    model, tok = tiny
    trainer_state = {k: v + 1e-3 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine = LocalEngine(bf16_copy(model, fp32_head=True), eos_token_ids=[tok.eos_token_id])
    engine.update_weights(trainer_state, version=1)
    own = engine.model.state_dict()
    assert torch.equal(own["lm_head.weight"], trainer_state["lm_head.weight"])  # no bf16 rounding
    emb = "model.embed_tokens.weight"
    assert own[emb].dtype == torch.bfloat16 and torch.equal(own[emb], trainer_state[emb].to(torch.bfloat16))


def test_the_trainer_computes_the_head_in_fp32_under_bf16_autocast(tiny):
    model, tok = tiny
    trajs = [Trajectory([1, 2, 3], [4, 5, 6 + i], [-1.0] * 3, [0] * 3) for i in range(4)]
    batch = collate(trajs, pad_id=tok.pad_token_id)
    cfg = load_config(None, ["actor.dtype=bfloat16", "actor.fp32_lm_head=true"]).actor
    engine = TrainEngine(copy.deepcopy(model), cfg, 1)
    logp = engine.compute_logp(batch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = engine.model.base_model(input_ids=batch.input_ids).last_hidden_state
    head = engine.model.get_output_embeddings().weight
    expected = torch.log_softmax(hidden[:, :-1].float() @ head.T, -1).gather(-1, batch.input_ids[:, 1:, None])
    torch.testing.assert_close(logp[batch.loss_mask], expected.squeeze(-1)[batch.loss_mask[:, 1:]], rtol=0, atol=1e-5)
