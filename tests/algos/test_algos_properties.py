"""Hypothesis properties of the estimators and losses on random inputs."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.algos import advantages, losses
from async_rl.algos.options import AGG_MODES, IS_LEVELS, MASK_LEVELS

SETTINGS = settings(max_examples=40, deadline=None)
Batch = dict[str, torch.Tensor]

sizes = st.tuples(st.integers(1, 4), st.integers(1, 5))
options = st.fixed_dictionaries(
    {
        "clip_low": st.floats(0.0, 0.5),
        "clip_high": st.floats(0.0, 0.5),
        "clip_c": st.none() | st.floats(1.5, 5.0),
        "is_level": st.sampled_from(IS_LEVELS),
        "is_cap": st.none() | st.floats(1.0, 5.0),
        "mask_level": st.sampled_from(MASK_LEVELS),
        "mask_lower": st.floats(0.0, 1.0),
        "mask_upper": st.floats(1.0, 5.0),
        "agg_mode": st.sampled_from(AGG_MODES),
    }
)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """Random ``[B, T]`` log-probs, advantages and a mask with at least one trained token."""
    batch, length = draw(sizes)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def normal(scale: float) -> torch.Tensor:
        return torch.randn(batch, length, generator=generator, dtype=torch.float64) * scale

    mask = (torch.rand(batch, length, generator=generator) < 0.7).to(torch.float64)
    mask[0, 0] = 1.0
    logp = -normal(1.0).abs()
    return {"logp": logp, "old": logp + normal(0.3), "behav": logp + normal(0.3), "adv": normal(1.0), "mask": mask}


def _loss_and_grad(
    name: str, logp: torch.Tensor, old: torch.Tensor, behav: torch.Tensor, batch: Batch, config: dict[str, Any]
) -> tuple[float, torch.Tensor, dict[str, float]]:
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = losses.compute(
        name, logp=leaf, old_logp=old, behav_logp=behav, advantages=batch["adv"], mask=batch["mask"], config=config
    )
    loss.backward()
    assert leaf.grad is not None
    return loss.item(), leaf.grad, metrics


@SETTINGS
@given(batch=batches(), config=options, name=st.sampled_from(losses.names()))
def test_on_policy_gradient_is_the_policy_gradient(batch: Batch, config: dict[str, Any], name: str) -> None:
    """With logp == old_logp == behav_logp every loss's gradient is that of -A log pi."""
    logp = batch["logp"]
    _, grad, metrics = _loss_and_grad(name, logp, logp, logp, batch, config)
    leaf = logp.clone().requires_grad_(True)
    losses.aggregate(-batch["adv"] * leaf, batch["mask"], config["agg_mode"]).backward()
    torch.testing.assert_close(grad, leaf.grad)
    assert metrics["masked_fraction"] == 0.0
    assert math.isclose(metrics["is_ess"], 1.0)


@SETTINGS
@given(batch=batches(), config=options)
def test_decoupled_ppo_is_ppo_when_behaviour_is_proximal(batch: Batch, config: dict[str, Any]) -> None:
    old = batch["old"]
    decoupled = _loss_and_grad("decoupled_ppo", batch["logp"], old, old, batch, config)
    ppo = _loss_and_grad("ppo", batch["logp"], old, old, batch, config)
    assert math.isclose(decoupled[0], ppo[0], rel_tol=1e-9, abs_tol=1e-12)
    torch.testing.assert_close(decoupled[1], ppo[1])


@SETTINGS
@given(
    batch=batches(),
    level=st.sampled_from(["token", "sequence"]),
    cap=st.floats(1.0, 3.0),
    name=st.sampled_from(["decoupled_ppo", "tis", "gspo"]),
)
def test_truncated_weights_never_exceed_the_cap(batch: Batch, level: str, cap: float, name: str) -> None:
    config = {"is_level": level, "is_cap": cap}
    *_, metrics = _loss_and_grad(name, batch["logp"], batch["old"], batch["behav"], batch, config)
    assert metrics["is_weight_max"] <= cap
    assert 0.0 < metrics["is_ess"] <= 1.0 + 1e-9
    weights = losses.importance_weight(batch["old"] - batch["behav"], batch["mask"], level, cap)
    assert weights.max().item() <= cap


group_batches = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-5.0, 5.0), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


def _reference_group_advantage(name: str, rewards: list[float], groups: list[int], lengths: list[int]) -> list[float]:
    """Per-sequence advantages written as verl's per-group loops (``core_algos.py``)."""
    members: dict[int, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        members[group].append(i)
    out = [0.0] * len(rewards)
    for ids in members.values():
        scores = [rewards[i] for i in ids]
        n = len(ids)
        if n == 1:
            continue
        mean = sum(scores) / n
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
        for i in ids:
            if name == "grpo":
                out[i] = (rewards[i] - mean) / (std + 1e-6)
            elif name == "rloo":
                out[i] = rewards[i] - (sum(scores) - rewards[i]) / (n - 1)
            else:  # opo
                weights = [lengths[j] for j in ids]
                out[i] = rewards[i] - sum(w * s for w, s in zip(weights, scores)) / sum(weights)
    return out


@SETTINGS
@given(data=group_batches, lengths_seed=st.integers(0, 1000), name=st.sampled_from(["grpo", "rloo", "opo"]))
def test_group_estimators_match_reference_and_centre_groups(
    data: tuple[list[float], list[int]], lengths_seed: int, name: str
) -> None:
    rewards, groups = data
    lengths = [1 + (lengths_seed + 7 * i) % 4 for i in range(len(rewards))]
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)
    result = advantages.compute(
        name, rewards=torch.tensor(rewards, dtype=torch.float64), group_index=torch.tensor(groups), response_mask=mask
    )
    expected = _reference_group_advantage(name, rewards, groups, lengths)
    torch.testing.assert_close(result[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(result, result[:, :1] * mask)
    if name in ("grpo", "rloo"):  # zero mean per group
        sums: dict[int, float] = defaultdict(float)
        for value, group in zip(result[:, 0].tolist(), groups):
            sums[group] += value
        assert all(abs(total) < 1e-6 for total in sums.values())
