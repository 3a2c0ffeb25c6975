"""Advantage estimators against values computed by hand (groups of unequal size, padding, ties)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from async_rl.algos import advantages

# Three groups of sizes 3, 2 and 1; rows padded to T = 3.
REWARDS = torch.tensor([0.0, 1.0, 0.0, 2.0, 4.0, 5.0])
GROUPS = torch.tensor([7, 7, 7, 3, 3, 9])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
SQRT3 = math.sqrt(3.0)


def _expected(per_sequence: list[float], mask: torch.Tensor = MASK) -> torch.Tensor:
    return torch.tensor(per_sequence).unsqueeze(-1) * mask.float()


def _compute(name: str, **options: object) -> torch.Tensor:
    return advantages.compute(name, rewards=REWARDS, group_index=GROUPS, response_mask=MASK, **options)


def _whiten(values: list[float]) -> list[float]:
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(value - mean) / math.sqrt(std**2 + 1e-8) for value in values]


def _scatter(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    """Place ``values`` on the mask's 1-entries in row-major order."""
    out = torch.zeros(mask.shape)
    out[mask.bool()] = torch.tensor(values)
    return out


def test_names_and_unknown_name() -> None:
    assert advantages.names() == sorted(
        ["gae", "grpo", "grpo_passk", "opo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
    )
    with pytest.raises(ValueError, match="valid names: gae, grpo"):
        _compute("ppo")


def test_grpo_normalises_by_unbiased_group_std() -> None:
    # group 7: mean 1/3, std 1/sqrt(3); group 3: mean 3, std sqrt(2); group 9 has one member.
    expected = _expected([-SQRT3 / 3, 2 * SQRT3 / 3, -SQRT3 / 3, -1 / math.sqrt(2), 1 / math.sqrt(2), 0.0])
    torch.testing.assert_close(_compute("grpo"), expected, atol=1e-5, rtol=1e-5)


def test_dr_grpo_only_centres() -> None:
    expected = _expected([-1 / 3, 2 / 3, -1 / 3, -1.0, 1.0, 0.0])
    torch.testing.assert_close(_compute("grpo", norm_by_std=False), expected)


def test_rloo_leave_one_out_baseline() -> None:
    expected = _expected([-0.5, 1.0, -0.5, -2.0, 2.0, 0.0])
    torch.testing.assert_close(_compute("rloo"), expected)


def test_opo_length_weighted_baseline() -> None:
    # group 7: lengths 2, 1, 3 -> baseline 1/6; group 3: lengths 2, 1 -> (4 + 4) / 3 = 8/3.
    expected = _expected([-1 / 6, 5 / 6, -1 / 6, -2 / 3, 4 / 3, 0.0])
    torch.testing.assert_close(_compute("opo"), expected)


def test_grpo_passk_rewards_only_the_best() -> None:
    expected = _expected([0.0, 1.0 * SQRT3, 0.0, 0.0, 2.0 / math.sqrt(2), 0.0])
    torch.testing.assert_close(_compute("grpo_passk"), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_compute("grpo_passk", norm_by_std=False), _expected([0.0, 1.0, 0.0, 0.0, 2.0, 0.0]))


def test_reinforce_pp_baseline_whitens_centred_rewards() -> None:
    centred = [-1 / 3, 2 / 3, -1 / 3, -1.0, 1.0, 0.0]
    tokens = [value for value, row in zip(centred, MASK) for _ in range(int(row.sum()))]
    torch.testing.assert_close(_compute("reinforce_pp_baseline"), _scatter(_whiten(tokens), MASK))


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "grpo_passk", "reinforce_pp_baseline"])
def test_all_equal_rewards_give_zero(name: str) -> None:
    result = advantages.compute(
        name, rewards=torch.full((3,), 3.0), group_index=torch.tensor([1, 1, 1]), response_mask=torch.ones(3, 2)
    )
    torch.testing.assert_close(result, torch.zeros(3, 2))


def test_token_level_rewards_are_summed_under_the_mask() -> None:
    token_rewards = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    result = advantages.compute(
        "grpo", rewards=token_rewards, group_index=torch.tensor([0, 0]), response_mask=mask, norm_by_std=False
    )
    torch.testing.assert_close(result, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]))


def test_reinforce_pp_discounted_returns_then_whitened() -> None:
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = advantages.compute_with_returns(
        "reinforce_pp", rewards=token_rewards, response_mask=mask, gamma=0.5
    )
    torch.testing.assert_close(returns * mask, torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, _scatter(_whiten([0.5, 1.0, 0.0, 2.0, 0.0]), mask))


def test_reinforce_pp_outcome_reward_sits_on_last_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    _, returns = advantages.compute_with_returns(
        "reinforce_pp", rewards=torch.tensor([1.0, 2.0]), response_mask=mask, gamma=0.5
    )
    torch.testing.assert_close(returns * mask, torch.tensor([[0.5, 1.0, 0.0], [0.5, 1.0, 2.0]]))


def test_gae_skips_untrained_tokens() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 9.0], [1.0, 1.0, 1.0], [0.5, 7.0, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]])
    adv, returns = advantages.compute_with_returns(
        "gae", rewards=rewards, response_mask=mask, values=values, gamma=0.5, lam=0.5
    )
    # Row 2 has an untrained token in the middle: same advantages as row 0 on its trained tokens.
    raw = [-0.2, 0.8, -0.5625, -0.25, 1.0, -0.2, 0.8]
    torch.testing.assert_close(adv, _scatter(_whiten(raw), mask))
    torch.testing.assert_close(returns[mask.bool()], torch.tensor([0.3, 1.0, 0.4375, 0.75, 2.0, 0.3, 1.0]))


def test_integer_rewards_and_adv_carry_no_gradient() -> None:
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    groups = torch.tensor([0, 0])
    result = advantages.compute("rloo", rewards=rewards, group_index=groups, response_mask=torch.ones(2, 1))
    assert not result.requires_grad
    integer_rewards = torch.tensor([1, 0])
    as_int = advantages.compute("rloo", rewards=integer_rewards, group_index=groups, response_mask=torch.ones(2, 1))
    torch.testing.assert_close(as_int, torch.tensor([[1.0], [-1.0]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rewards": torch.zeros(3), "group_index": None}, "needs group_index"),
        ({"rewards": torch.zeros(4), "group_index": torch.zeros(3, dtype=torch.long)}, "rewards must be"),
        ({"rewards": torch.zeros(3), "group_index": torch.zeros(3)}, "group_index must be an integer"),
    ],
)
def test_invalid_inputs(kwargs: dict[str, torch.Tensor | None], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        advantages.compute("grpo", response_mask=torch.ones(3, 2), **kwargs)


def test_equal_reward_fraction_counts_groups_without_signal() -> None:
    # REWARDS/GROUPS: group 7 (0, 1, 0) differs, group 3 (2, 4) differs, group 9 (5) is a group of one
    assert advantages.equal_reward_fraction(REWARDS, GROUPS) == pytest.approx(1 / 3)
    tied = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.5, 5.0])
    assert advantages.equal_reward_fraction(tied, GROUPS) == 1.0
    # and a group estimator's advantages are 0 exactly there
    assert advantages.compute("grpo", rewards=tied, group_index=GROUPS, response_mask=MASK).abs().max() == 0.0
    assert advantages.equal_reward_fraction(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == 0.0
