"""Policy losses, off-policy correction and aggregation against values computed by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from async_rl.algos import losses

L = math.log
# Two sequences of T = 3; the last token of row 1 is padding.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
OLD = torch.full((2, 3), -1.0, dtype=torch.float64)
# Ratios pi_theta / pi_old per token (the padding entry is arbitrary).
RATIOS = [[1.5, 0.7, 1.0], [4.0, 0.5, 3.0]]
ADV = torch.tensor([[1.0, -1.0, 2.0], [-1.0, 1.0, 5.0]], dtype=torch.float64)
# Behaviour log-ratios log(pi_old / mu) for the correction tests; padding would change every
# sequence-level answer if it were counted.
BEHAV_LOG_RATIO = torch.tensor([[L(3.0), L(0.5), 0.0], [L(4.0), 0.0, L(0.25)]], dtype=torch.float64)
CORR_ADV = torch.tensor([[1.0, 2.0, 1.0], [3.0, -1.0, 9.0]], dtype=torch.float64)
METRIC_NAMES = {
    "pg_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "is_weight_mean",
    "is_weight_max",
    "is_ess",
    "masked_fraction",
    "is_clipped_fraction",
    "behav_kl",
}


def _logp(ratios: list[list[float]]) -> torch.Tensor:
    return (OLD + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)


def _ppo(
    config: dict[str, Any] | None = None, name: str = "ppo"
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    logp = _logp(RATIOS)
    loss, metrics = losses.compute(
        name, logp=logp, old_logp=OLD, behav_logp=OLD, advantages=ADV, mask=MASK, config=config
    )
    loss.backward()
    assert logp.grad is not None
    return loss, metrics, logp.grad


def _corrected(name: str, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy current policy (ratio 1, surrogate -A) with behaviour log-ratios BEHAV_LOG_RATIO."""
    logp = OLD.clone().requires_grad_(True)
    return losses.compute(
        name, logp=logp, old_logp=OLD, behav_logp=OLD - BEHAV_LOG_RATIO, advantages=CORR_ADV, mask=MASK, config=config
    )


def test_names_and_unknown_name() -> None:
    assert losses.names() == ["cispo", "decoupled_ppo", "gspo", "ppo", "tis"]
    with pytest.raises(ValueError, match="valid names: cispo, decoupled_ppo, gspo, ppo, tis"):
        _ppo(name="grpo")


def test_ppo_clip_values_metrics_and_gradients() -> None:
    loss, metrics, grad = _ppo()
    # Per token: -1.2 (clipped at 1.2), 0.8 (clipped at 0.8), -2, 4.0, -0.5; padding excluded.
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0 + 4.0 - 0.5) / 5)
    assert set(metrics) == METRIC_NAMES
    assert metrics["pg_loss"] == pytest.approx(loss.item())
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-(L(1.5) + L(0.7) + L(4.0) + L(0.5)) / 5)
    # Clipped tokens and padding get zero gradient; the others -A * r / N.
    expected = torch.tensor([[0.0, 0.0, -2.0], [4.0, -0.5, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(grad, expected)


def test_ppo_dual_clip_caps_negative_advantages() -> None:
    loss, metrics, grad = _ppo({"clip_c": 3.0})
    # Token (1, 0): A = -1, r = 4 -> min(4, 3) = 3, and no gradient through the bound.
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0 + 3.0 - 0.5) / 5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert grad[1, 0].item() == 0.0


def test_ppo_clip_higher() -> None:
    loss, metrics, _ = _ppo({"clip_high": 0.6})
    # r = 1.5 now lies inside [0.8, 1.6]: unclipped -1.5.
    assert loss.item() == pytest.approx((-1.5 + 0.8 - 2.0 + 4.0 - 0.5) / 5)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 5)


def test_aggregation_modes() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 2 has no token
    expected = {
        "token-mean": 18 / 5,
        "seq-mean-token-sum": (3 + 15) / 2,
        "seq-mean-token-mean": (1.5 + 5.0) / 2,
        "seq-mean-token-sum-norm": (3 / 3 + 15 / 3) / 2,
    }
    for mode, value in expected.items():
        assert losses.aggregate(values, mask, mode).item() == pytest.approx(value), mode
        assert losses.aggregate(values, torch.zeros_like(mask), mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown agg_mode"):
        losses.aggregate(values, mask, "sum")


def test_agg_mode_reaches_the_loss() -> None:
    loss, _, _ = _ppo({"agg_mode": "seq-mean-token-mean"})
    assert loss.item() == pytest.approx(((-1.2 + 0.8 - 2.0) / 3 + (4.0 - 0.5) / 2) / 2)


@pytest.mark.parametrize(
    ("name", "config", "expected_loss"),
    [
        ("ppo", {}, -(1 + 2 + 1 + 3 - 1) / 5),
        # token weights min(pi_old / mu, 2) = 2, 0.5, 1 | 2, 1
        ("decoupled_ppo", {}, -(2 + 1 + 1 + 6 - 1) / 5),
        ("ppo", {"is_level": "token"}, -(2 + 1 + 1 + 6 - 1) / 5),
        ("decoupled_ppo", {"is_cap": None}, -(3 + 1 + 1 + 12 - 1) / 5),
        # sequence weights: 3 * 0.5 * 1 = 1.5 | 4 (padding excluded) -> capped at 2
        ("decoupled_ppo", {"is_level": "sequence"}, -(1.5 * 4 + 2 * 2) / 5),
    ],
)
def test_importance_weights(name: str, config: dict[str, Any], expected_loss: float) -> None:
    loss, _ = _corrected(name, config)
    assert loss.item() == pytest.approx(expected_loss)


def test_importance_weight_metrics() -> None:
    _, metrics = _corrected("decoupled_ppo", {})
    weights = [2.0, 0.5, 1.0, 2.0, 1.0]
    mean = sum(weights) / 5
    assert metrics["is_weight_mean"] == pytest.approx(mean)
    assert metrics["is_weight_max"] == pytest.approx(2.0)
    normalised = [w / mean for w in weights]
    assert metrics["is_ess"] == pytest.approx(1 / (sum(w * w for w in normalised) / 5))
    assert metrics["masked_fraction"] == 0.0
    assert metrics["is_clipped_fraction"] == pytest.approx(2 / 5)  # 3 and 4 truncated at is_cap 2
    _, uncapped = _corrected("decoupled_ppo", {"is_cap": None})
    assert uncapped["is_clipped_fraction"] == 0.0
    ratios = [3.0, 0.5, 1.0, 4.0, 1.0]  # behav_kl: k3 of pi_old against mu on trained tokens
    assert metrics["behav_kl"] == pytest.approx(sum(r - L(r) - 1 for r in ratios) / 5)


@pytest.mark.parametrize(
    ("config", "expected_loss", "expected_masked"),
    [
        # token ratios 3, 0.5, 1 | 4, 1: 0.5 and 4 fall outside [0.6, 3.5]
        ({"mask_level": "token", "mask_lower": 0.6, "mask_upper": 3.5}, -(1 + 1 - 1) / 3, 2 / 5),
        # sequence ratios 1.5 | 4 (1 if padding counted)
        ({"mask_level": "sequence", "mask_lower": 0.6, "mask_upper": 3.5}, -(1 + 2 + 1) / 3, 2 / 5),
        ({"mask_level": "sequence", "mask_lower": 0.6, "mask_upper": 1.2}, 0.0, 1.0),
        # geometric means 1.5^(1/3) = 1.145 | 4^(1/2) = 2 (1 if padding counted)
        ({"mask_level": "geometric", "mask_lower": 0.6, "mask_upper": 1.2}, -(1 + 2 + 1) / 3, 2 / 5),
    ],
)
def test_rejection(config: dict[str, Any], expected_loss: float, expected_masked: float) -> None:
    loss, metrics = _corrected("ppo", config)
    assert loss.item() == pytest.approx(expected_loss)
    assert metrics["masked_fraction"] == pytest.approx(expected_masked)


def test_rejected_tokens_get_no_gradient() -> None:
    logp = OLD.clone().requires_grad_(True)
    config = {"mask_level": "token", "mask_lower": 0.6, "mask_upper": 3.5}
    loss, _ = losses.compute(
        "ppo", logp=logp, old_logp=OLD, behav_logp=OLD - BEHAV_LOG_RATIO, advantages=CORR_ADV, mask=MASK, config=config
    )
    loss.backward()
    assert logp.grad is not None
    expected = torch.tensor([[-1.0, 0.0, -1.0], [0.0, 1.0, 0.0]], dtype=torch.float64) / 3
    torch.testing.assert_close(logp.grad, expected)


def test_importance_weight_carries_no_gradient() -> None:
    old = OLD.clone().requires_grad_(True)
    behav = (OLD - BEHAV_LOG_RATIO).requires_grad_(True)
    logp = OLD.clone().requires_grad_(True)
    loss, _ = losses.compute("decoupled_ppo", logp=logp, old_logp=old, behav_logp=behav, advantages=CORR_ADV, mask=MASK)
    loss.backward()
    assert behav.grad is None
    assert logp.grad is not None
    # d/dlogp of -A * w * r at r = 1 is -A * w: the weight is a constant.
    expected = -CORR_ADV * torch.tensor([[2.0, 0.5, 1.0], [2.0, 1.0, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, expected)


def test_tis_bypass_anchors_on_the_behaviour_policy() -> None:
    logp = _logp(RATIOS)
    tis_loss, tis_metrics = losses.compute(
        "tis", logp=logp, old_logp=None, behav_logp=OLD, advantages=ADV, mask=MASK
    )
    ignored_old, _ = losses.compute(
        "tis", logp=logp, old_logp=OLD + 5.0, behav_logp=OLD, advantages=ADV, mask=MASK
    )
    _, ppo_metrics, _ = _ppo()
    assert tis_loss.item() == pytest.approx(ppo_metrics["pg_loss"])
    assert ignored_old.item() == pytest.approx(tis_loss.item())
    # The correction compares sg(pi_theta) with mu: behav_kl is the k3 of the ratios themselves.
    ratios = [1.5, 0.7, 1.0, 4.0, 0.5]
    assert tis_metrics["behav_kl"] == pytest.approx(sum(r - L(r) - 1 for r in ratios) / 5)


def test_tis_rejection_and_weight_use_detached_current_policy() -> None:
    logp = _logp([[1.1, 1.0, 1.0], [1.0, 1.0, 1.0]])
    config = {"is_level": "token", "is_cap": None, "mask_level": "token", "mask_lower": 0.5, "mask_upper": 1.05}
    loss, metrics = losses.compute(
        "tis", logp=logp, old_logp=None, behav_logp=OLD, advantages=-torch.ones_like(OLD), mask=MASK, config=config
    )
    # Token (0, 0) has ratio 1.1 > 1.05 and is rejected; all other ratios are 1.
    assert metrics["masked_fraction"] == pytest.approx(1 / 5)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64) / 4)
    # Without rejection, token (0, 0) (A = -1, r = 1.1 inside the clip range) has loss w * r with
    # w = sg(r): gradient r * w = 1.21, not the 2 r^2 = 2.42 of an undetached weight.
    logp.grad = None
    loss, _ = losses.compute(
        "tis", logp=logp, old_logp=None, behav_logp=OLD, advantages=-torch.ones_like(OLD), mask=MASK,
        config={"is_level": "token", "is_cap": None},
    )
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(1.21 / 5)


def test_gspo_sequence_ratio_with_straight_through_gradient() -> None:
    logp = _logp([[2.0, 1.0, 0.5], [4.0, 1.0, 100.0]])
    advantages = torch.ones_like(OLD)
    loss, metrics = losses.compute("gspo", logp=logp, old_logp=OLD, behav_logp=OLD, advantages=advantages, mask=MASK)
    # s_0 = (2 * 1 * 0.5)^(1/3) = 1 -> -1 per token; s_1 = (4 * 1)^(1/2) = 2 -> clipped to 1.2.
    assert loss.item() == pytest.approx((-1.0 * 3 - 1.2 * 2) / 5)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64) / 5)


def test_cispo_keeps_gradient_on_clipped_tokens() -> None:
    ratios = [[1.5, 0.7, 1.0], [1.1, 0.5, 3.0]]
    logp = _logp(ratios)
    loss, metrics = losses.compute("cispo", logp=logp, old_logp=OLD, behav_logp=OLD, advantages=ADV, mask=MASK)
    weights = [[1.2, 0.8, 1.0], [1.1, 0.8]]
    tokens = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    expected = sum(-weights[b][t] * ADV[b, t].item() * (-1.0 + L(ratios[b][t])) for b, t in tokens) / 5
    assert loss.item() == pytest.approx(expected)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 5)
    loss.backward()
    assert logp.grad is not None
    expected_grad = torch.tensor([[-1.2, 0.8, -2.0], [1.1, -0.8, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, expected_grad)


@pytest.mark.parametrize(("kind", "expected"), [("k3", 0.5 / 4), ("k1", 0.0), ("k2", 0.5 * L(2.0) ** 2 * 2 / 4)])
def test_kl_to_reference_term(kind: str, expected: float) -> None:
    logp = torch.full((2, 2), -1.0)
    ref = logp + torch.tensor([[0.0, L(2.0)], [L(0.5), 0.0]])
    mask = torch.ones(2, 2)
    loss, metrics = losses.compute(
        "ppo", logp=logp, old_logp=logp, behav_logp=logp, advantages=torch.zeros(2, 2), mask=mask,
        config={"kl_coef": 0.1, "kl_kind": kind}, ref_logp=ref,
    )
    assert metrics["kl_loss"] == pytest.approx(expected, abs=1e-7)
    assert loss.item() == pytest.approx(0.1 * expected, abs=1e-7)
    assert set(metrics) == METRIC_NAMES | {"kl_loss"}


def test_entropy_bonus() -> None:
    logits = torch.tensor([[[0.0, 0.0], [0.0, L(3.0)]]], requires_grad=True)
    entropy = losses.entropy_from_logits(logits)
    torch.testing.assert_close(entropy, torch.tensor([[L(2.0), -(0.25 * L(0.25) + 0.75 * L(0.75))]]))
    logp = torch.full((1, 2), -1.0)
    loss, metrics = losses.compute(
        "ppo", logp=logp, old_logp=logp, behav_logp=logp, advantages=torch.zeros(1, 2), mask=torch.ones(1, 2),
        config={"entropy_coef": 0.01}, entropy=entropy,
    )
    assert metrics["entropy"] == pytest.approx(entropy.mean().item())
    assert loss.item() == pytest.approx(-0.01 * entropy.mean().item())
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_missing_inputs_raise() -> None:
    logp = torch.zeros(1, 2)
    common: dict[str, Any] = {"logp": logp, "behav_logp": logp, "advantages": logp, "mask": torch.ones(1, 2)}
    with pytest.raises(ValueError, match="needs old_logp"):
        losses.compute("ppo", old_logp=None, **common)
    with pytest.raises(ValueError, match="needs ref_logp"):
        losses.compute("ppo", old_logp=logp, config={"kl_coef": 0.1}, **common)
    with pytest.raises(ValueError, match="needs entropy"):
        losses.compute("ppo", old_logp=logp, config={"entropy_coef": 0.1}, **common)
