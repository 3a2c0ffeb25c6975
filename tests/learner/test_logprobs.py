"""Packed rows and the chunked LM head give the log-probs, entropies and gradients of one
padded forward pass over the whole ``[n, T, V]`` logits (float32, CPU)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from learner_helpers import learner_config, make_groups, prepare_groups
from reference_logprobs import padded_logprobs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from async_rl.config import KernelsConfig
from async_rl.learner import attention
from async_rl.learner.batching import pack, unpack
from async_rl.learner.logprobs import ChunkedLogProbs, LogProbHead, install_logprob_head, token_logprobs
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.train_step import Trainer
from async_rl.records import RolloutGroup, Sample

VOCAB = 151936


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("k", [1, 4])
def test_chunked_head_equals_full_logits_with_gradients(temperature: float, k: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(300, 16).requires_grad_()
    targets = torch.randint(0, 300, (37, k))
    if k > 1:
        targets[:5, 1] = targets[:5, 0]  # a token twice at a position (a sampled token also in the teacher's top-k)
    a, b = torch.randn(37, k), torch.randn(37)

    logp, entropy = ChunkedLogProbs.apply(hidden, weight, targets, temperature, 8, True)
    assert logp.shape == (37, k)
    ((a * logp).sum() + (b * entropy).sum()).backward()
    got = (logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    log_probs = torch.log_softmax((hidden @ weight.T) / temperature, -1)
    ref_logp = log_probs.gather(1, targets)
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    ((a * ref_logp).sum() + (b * ref_entropy).sum()).backward()
    for mine, ref in zip(got, (ref_logp, ref_entropy, hidden.grad, weight.grad)):
        torch.testing.assert_close(mine, ref.detach(), atol=1e-5, rtol=1e-5)


def test_logprob_gradient_alone_and_no_entropy() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(10, 8).requires_grad_()
    weight = torch.randn(50, 8).requires_grad_()
    targets = torch.randint(0, 50, (10,))
    logp, entropy = ChunkedLogProbs.apply(hidden, weight, targets[:, None], 1.0, 3, False)
    assert not entropy.requires_grad and entropy.abs().sum() == 0
    logp.sum().backward()
    ref = torch.log_softmax(hidden.detach() @ weight.detach().T, -1)
    expected_grad = (torch.nn.functional.one_hot(targets, 50) - ref.exp()) @ weight.detach()
    torch.testing.assert_close(hidden.grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_separate_padded_sequences_with_gradients(tiny_model: Path) -> None:
    """Three samples in one row (positions restart, per-sample causal attention, chunked head)
    against a padded batch through the unmodified model: log-probs, entropies, gradients."""
    batch = prepare_groups(make_groups(2, seed=7), 64, 512).batch
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


class _Shapes(TorchDispatchMode):
    """Counts the tensors of each shape that operations return."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[tuple[int, ...], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.count[tuple(t.shape)] = self.count.get(tuple(t.shape), 0) + 1
        return out


def test_packed_attention_backward_builds_no_whole_row_tensor_per_sample() -> None:
    """64 samples in one packed row: the backward builds a handful of whole-row gradients, not
    one per sample and input (a slice's backward zero-fills the whole row: 22 % of a quickstart
    learner step, quadratic in the samples per row), and equals one sample at a time."""
    torch.manual_seed(0)
    lengths = [5 + i % 7 for i in range(64)]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v = (torch.randn(1, 2, bounds[-1], 8, requires_grad=True) for _ in range(3))
    module = torch.nn.Module().eval()
    out, _ = attention.packed_sdpa(module, q, k, v, None, packed_bounds=bounds)
    grad = torch.randn_like(out)
    with _Shapes() as seen:
        out.backward(grad)
    assert seen.count.get(tuple(q.shape), 0) <= 12, seen.count  # 7 now, whatever the samples; 385 with slices
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (t.detach()[:, :, a:b].requires_grad_() for t in (q, k, v))
        one, _ = attention.packed_sdpa(module, qs, ks, vs, None)
        one.backward(grad[:, a:b])
        torch.testing.assert_close(one, out[:, a:b])
        for whole, part in ((q, qs), (k, ks), (v, vs)):
            torch.testing.assert_close(whole.grad[:, :, a:b], part.grad)


class _LargestTensors(TorchDispatchMode):
    """Records the shape of every tensor an operation returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.dist
@pytest.mark.slow
def test_a_learner_step_with_the_real_vocabulary_builds_no_tokens_by_vocab_or_row_by_row_tensor(
    one_rank: DistInfo, tmp_path: Path
) -> None:
    """151,936-token vocabulary, 4096-token packed rows of samples of at most 600 tokens, chunks
    of 512: no tensor of the step (forward or backward) is larger than one ``[512, vocab]``
    chunk (a ``[tokens, vocab]`` logits tensor would be) or has two dimensions above 600 (a
    ``[row, row]`` attention matrix would)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    cfg = learner_config(tmp_path / "model", tmp_path, "vocab", "learner.max_tokens_per_microbatch=4096", "learner.logprob_chunk_tokens=512",
                         "data.max_prompt_length=100", "rollout.max_response_length=500", "algorithm.loss.entropy_coef=0.01")
    rng = random.Random(0)
    groups = []
    for g in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(50, 100))]
        samples = [Sample.from_lists(toks := [rng.randrange(VOCAB) for _ in range(rng.randint(300, 500))], [-11.0] * len(toks), 0, rng.random())
                   for _ in range(4)]
        groups.append(RolloutGroup.from_lists("vocab", f"g{g}", g, prompt, samples, "s", 0.0, created_at=0.0))
    batch = prepare_groups(groups, 4096, VOCAB).batch
    policy = load_sharded(str(tmp_path / "model"), cfg.learner, one_rank.device, trainable=True)
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, one_rank, 2, 0)
    with _LargestTensors() as seen:
        result = trainer.step(batch, 0)
    assert result.optimizer_steps == 1 and batch.lengths.sum() > 3500  # one packed row of 3500+ tokens
    big = sorted(s for s in seen.shapes if sum(d > 600 for d in s) >= 2 or math.prod(s) > 512 * VOCAB)
    assert big == [], big
    assert (512, VOCAB) in seen.shapes  # the chunks did run
