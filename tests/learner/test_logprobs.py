"""Packed rows and the chunked LM head give the log-probs, entropies and gradients of one
padded forward pass over the whole ``[n, T, V]`` logits (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learner_helpers import make_groups
from reference_logprobs import padded_logprobs
from transformers import AutoModelForCausalLM

from async_rl.config import KernelsConfig
from async_rl.learner import attention
from async_rl.learner.batching import pack, prepare, unpack
from async_rl.learner.logprobs import ChunkedLogProbs, LogProbHead, install_logprob_head, token_logprobs


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_full_logits_with_gradients(temperature: float) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(300, 16).requires_grad_()
    targets = torch.randint(0, 300, (37,))
    a, b = torch.randn(37), torch.randn(37)

    logp, entropy = ChunkedLogProbs.apply(hidden, weight, targets, temperature, 8, True)
    (a * logp + b * entropy).sum().backward()
    got = (logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    log_probs = torch.log_softmax((hidden @ weight.T) / temperature, -1)
    ref_logp = log_probs.gather(1, targets[:, None])[:, 0]
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    (a * ref_logp + b * ref_entropy).sum().backward()
    for mine, ref in zip(got, (ref_logp, ref_entropy, hidden.grad, weight.grad)):
        torch.testing.assert_close(mine, ref.detach(), atol=1e-5, rtol=1e-5)


def test_logprob_gradient_alone_and_no_entropy() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(10, 8).requires_grad_()
    weight = torch.randn(50, 8).requires_grad_()
    targets = torch.randint(0, 50, (10,))
    logp, entropy = ChunkedLogProbs.apply(hidden, weight, targets, 1.0, 3, False)
    assert not entropy.requires_grad and entropy.abs().sum() == 0
    logp.sum().backward()
    ref = torch.log_softmax(hidden.detach() @ weight.detach().T, -1)
    expected_grad = (torch.nn.functional.one_hot(targets, 50) - ref.exp()) @ weight.detach()
    torch.testing.assert_close(hidden.grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_separate_padded_sequences_with_gradients(tiny_model: Path) -> None:
    """Three samples in one row (positions restart, per-sample causal attention, chunked head)
    against a padded batch through the unmodified model: log-probs, entropies, gradients."""
    batch = prepare(make_groups(2, seed=7), 64, 512).batch
    micro = batch.select([0, 3, 5])
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    packed = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                  attn_implementation=attention.choose(KernelsConfig(), torch.device("cpu")))
    install_logprob_head(packed, chunk_tokens=5)
    mask = micro.response_mask
    a, b = torch.randn(mask.shape) * mask, torch.randn(mask.shape) * mask

    ref_logp, ref_entropy = padded_logprobs(reference, micro.input_ids, micro.attention_mask, micro.response_positions, 0.8)
    ((a * ref_logp + b * ref_entropy) * mask).sum().backward()

    row = pack(micro)
    assert row.input_ids.shape == (1, int(micro.lengths.sum()))  # no padding
    flat_logp, flat_entropy = token_logprobs(packed, row.input_ids, row.position_ids, row.logit_rows, row.targets, temperature=0.8,
                                             with_entropy=True, entropy_grad=True,
                                             **attention.attention_kwargs(packed.config._attn_implementation, row.bounds, torch.device("cpu")))
    logp, entropy = unpack(flat_logp, row), unpack(flat_entropy, row)
    ((a * logp + b * entropy) * mask).sum().backward()

    on = mask.bool()
    torch.testing.assert_close(logp[on], ref_logp[on], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[on], ref_entropy[on], atol=1e-5, rtol=0)
    ref_grads, grads = _grads(reference), _grads(packed)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_head_refuses_a_plain_forward(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    weight = model.lm_head.weight
    install_logprob_head(model, 4)
    assert isinstance(model.lm_head, LogProbHead) and model.lm_head.weight is weight  # same parameter: names, tying, sharding
    with pytest.raises(RuntimeError, match="token_logprobs"):
        model(input_ids=torch.tensor([[3, 4]]))
