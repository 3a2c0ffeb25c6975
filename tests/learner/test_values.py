"""The critic: a token classifier with one label loaded from the policy's checkpoint, sharded like
the policy; packed-row values equal a padded forward of the plain model, with gradients."""

from __future__ import annotations

import pytest
from pathlib import Path

import torch
from learner_helpers import learner_config, make_groups, prepare_groups
from transformers import AutoConfig, AutoModelForTokenClassification

from async_rl.learner import attention
from async_rl.learner.batching import pack, unpack
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.values import token_values

pytestmark = [pytest.mark.dist]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_packed_values_equal_a_padded_forward_with_gradients(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    batch = prepare_groups(make_groups(2, seed=9), 64, 512).batch
    micro = batch.select([0, 2, 5])
    cfg = learner_config(tiny_model, tmp_path, "critic")
    torch.manual_seed(1)  # the score head is new: the same seed gives both models the same head
    config = AutoConfig.from_pretrained(tiny_model, num_labels=1)
    config.classifier_dropout = 0.0
    reference = AutoModelForTokenClassification.from_pretrained(tiny_model, config=config, dtype=torch.float32)
    torch.manual_seed(1)
    critic = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True, value_model=True)
    assert critic.training and all(p.requires_grad for p in critic.parameters())
    mask = micro.response_mask
    weights = torch.randn(mask.shape) * mask

    scores = reference(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False).logits[..., 0]
    ref_values = scores.gather(1, (micro.response_positions - 1).clamp_min(0))  # the state before each response token
    (weights * ref_values).sum().backward()

    row = pack(micro)
    kwargs = attention.attention_kwargs(critic.config._attn_implementation, row.bounds, one_rank.device)
    values = unpack(token_values(critic, row.input_ids, row.position_ids, row.logit_rows, **kwargs), row)
    again = unpack(token_values(critic, row.input_ids, row.position_ids, row.logit_rows, **kwargs), row)
    torch.testing.assert_close(again, values, rtol=0, atol=0)  # train mode, yet no dropout
    (weights * values).sum().backward()

    on = mask.bool()
    torch.testing.assert_close(values[on], ref_values[on], atol=1e-5, rtol=0)
    ref_grads = _grads(reference)
    grads = {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in _grads(critic).items()}
    assert ref_grads.keys() == grads.keys() and "score.weight" in grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
