"""VPPO's formulas against values computed by hand (arXiv:2510.09285, its reference code)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from async_rl.algos import vppo


def test_visual_dependency_is_k3_on_the_sampled_token():
    logp = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.9), -1.0]])
    masked = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.3), -40.0]])
    dep = vppo.visual_dependency(logp, masked)
    # d = log p~ - log p; S = e^d - d - 1
    d1 = math.log(0.5)  # 0.25 / 0.5
    d2 = math.log(0.3 / 0.9)
    expected = [0.0, math.exp(d1) - d1 - 1, math.exp(d2) - d2 - 1, min(math.exp(-20) + 20 - 1, 10.0)]
    assert dep[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert dep[0, 1].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)  # 0.193147...
    assert dep[0, 3].item() == 10.0  # d clamped to -20, S clamped to 10


def test_selection_keeps_the_top_ceil_fraction_of_each_row():
    dep = torch.tensor([
        [0.1, 0.9, 0.5, 0.3, 0.0],  # 5 trained tokens: ceil(5 * 0.4) = 2 -> positions 1, 2
        [0.7, 0.2, 0.8, 0.9, 0.6],  # last two are padding: ceil(3 * 0.4) = 2 -> positions 0, 2
        [0.4, 0.4, 0.4, 0.0, 0.0],  # ties: ceil(3 * 0.4) = 2 -> the earlier tokens 0, 1
        [0.3, 0.0, 0.0, 0.0, 0.0],  # 1 trained token: ceil(0.4) = 1
    ])
    mask = torch.tensor([
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
    ], dtype=torch.float32)
    sel = vppo.select_perception_tokens(dep, mask, 0.4)
    assert sel.tolist() == [
        [0, 1, 1, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0],
    ]
    assert sel.dtype == mask.dtype
    assert vppo.select_perception_tokens(dep, mask, 1.0).tolist() == mask.tolist()
    # a mask with a hole (an environment's tokens in a multi-turn response) is never selected
    holed = torch.tensor([[1, 0, 1, 1, 1]], dtype=torch.float32)
    assert vppo.select_perception_tokens(dep[:1], holed, 0.5).tolist() == [[0, 0, 1, 1, 0]]  # ceil(4 * .5) = 2
    with pytest.raises(ValueError, match="top_p_perception_tokens"):
        vppo.select_perception_tokens(dep, mask, 0.0)


def test_advantage_scale_by_hand():
    # sequence scores s = [0.2, 0.6, 1.0] (means over trained tokens); row 3 has none
    dep = torch.tensor([[0.2, 0.2, 9.0], [0.4, 0.8, 0.0], [1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    alpha = vppo.advantage_scale(dep, mask, 0.8)
    # n = [0, 0.5, 1], mean n = 0.5, alpha = 0.8 + n * 0.2 / 0.5 = [0.8, 1.0, 1.2]; row 3 -> 1
    assert alpha.tolist() == pytest.approx([0.8, 1.0, 1.2, 1.0], abs=1e-6)
    assert alpha[:3].mean().item() == pytest.approx(1.0, abs=1e-6)
    # equal scores, or a single row: nothing to rank, every factor 1
    assert vppo.advantage_scale(torch.ones(3, 2), torch.ones(3, 2), 0.8).tolist() == [1.0, 1.0, 1.0]
    assert vppo.advantage_scale(dep[:1], mask[:1], 0.8).tolist() == [1.0]
    with pytest.raises(ValueError, match="advantage_scaling_min"):
        vppo.advantage_scale(dep, mask, 1.5)


def test_sampled_entropy_and_metrics():
    logp = torch.tensor([[-1.0, -2.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ent = vppo.sampled_entropy(logp, mask)
    assert ent.item() == pytest.approx(1.5)
    ent.backward()
    assert logp.grad.tolist() == [[-0.5, -0.5, 0.0]]  # the penalty pushes trained log-probs up
    dep = torch.tensor([[0.5, 0.1, 3.0]])
    selected = torch.tensor([[1.0, 0.0, 0.0]])
    metrics = {k: v.item() for k, v in vppo.dependency_metrics(dep, mask, selected).items()}
    assert metrics == pytest.approx({
        "vppo/selected_fraction": 0.5,
        "vppo/dependency_mean": 0.3,
        "vppo/dependency_mean_selected": 0.5,
        "vppo/dependency_mean_rejected": 0.1,
    })


def test_blacken_patches_is_seeded_and_cell_aligned():
    image = Image.new("RGB", (30, 20), (200, 100, 50))
    a, b, c = (vppo.blacken_patches(image, seed) for seed in (7, 7, 8))
    assert a.tobytes() == b.tobytes() != c.tobytes()
    pixels = np.array(a)
    black = np.random.default_rng(7).random((2, 3)) < 0.5  # ceil(20 / 14) x ceil(30 / 14) cells
    for r in range(2):
        for col in range(3):
            cell = pixels[r * 14 : (r + 1) * 14, col * 14 : (col + 1) * 14]
            assert (cell == 0).all() if black[r, col] else (cell == [200, 100, 50]).all()
    assert np.array(image).min() == 50  # the input is not modified


@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo", "gspo", "cispo"])
def test_only_selected_tokens_carry_the_policy_gradient(loss: str):
    from async_rl.algos import losses

    torch.manual_seed(0)
    logp = (torch.randn(3, 5) * 0.1 - 1.0).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 5) * 0.05
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None] * mask
    selected = vppo.select_perception_tokens(torch.rand(3, 5), mask, 0.4)
    selected[2] = 0  # a response with no selected token: none of its tokens may move
    total, _ = losses.compute(loss, logp=logp, old_logp=old, behav_logp=old, advantages=adv, mask=mask, token_weight=selected)
    total.backward()
    grad = logp.grad.abs()
    assert (grad[2] == 0).all() and (grad[:2] > 0).any()
    if loss != "gspo":  # gspo's sequence-level ratio ties every token of a response that has a selected one
        assert (grad[selected == 0] == 0).all()
        assert (grad[selected == 1] > 0).all()
    # the denominator still counts every trained token: the selected tokens' terms are not re-weighted
    full, _ = losses.compute(loss, logp=logp.detach(), old_logp=old, behav_logp=old, advantages=adv * selected, mask=mask)
    if loss != "gspo":
        assert total.item() == pytest.approx(full.item(), rel=1e-6)
