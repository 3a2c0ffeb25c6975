"""KL estimators k1, k2, k3 (with verl's clamps) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algos import kl

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),
        # r = pi_ref / pi: log r = -0.5 and 1.0; k3 = r - log r - 1.
        ("k3", [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1]),
    ],
)
def test_estimators(kind: str, expected: list[float]) -> None:
    torch.testing.assert_close(kl.estimate(kind, LOGP, REF), torch.tensor([expected]))


def test_k3_clamps_log_ratio_and_value() -> None:
    logp = torch.zeros(1, 3)
    ref = torch.tensor([[30.0, -30.0, 2.0]])
    # +-30 -> log ratio clamped to +-20; both estimates exceed 10 and are clamped; 2.0 is untouched.
    torch.testing.assert_close(kl.estimate("k3", logp, ref), torch.tensor([[10.0, 10.0, math.exp(2.0) - 3.0]]))


def test_k3_gradient_flows_to_the_policy() -> None:
    logp = torch.tensor([[-1.0]], requires_grad=True)
    kl.estimate("k3", logp, torch.tensor([[-1.5]])).sum().backward()
    # d/dlogp (e^(ref - logp) - (ref - logp) - 1) = 1 - e^(ref - logp)
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0 - math.exp(-0.5)]]))


def test_names_and_unknown_kind() -> None:
    assert kl.names() == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="valid names: k1, k2, k3"):
        kl.estimate("low_var_kl", LOGP, REF)
