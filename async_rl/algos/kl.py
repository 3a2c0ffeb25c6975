"""Per-token KL estimators between a policy and a reference policy.

Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html); names and clamps as
in verl ``verl/trainer/ppo/core_algos.py::kl_penalty``. Samples are drawn from the policy whose
log-probabilities are ``logp``; every estimator targets ``KL(pi || pi_ref)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._registry import Registry

Estimator = Callable[[Tensor, Tensor], Tensor]

_REGISTRY: Registry[Estimator] = Registry("KL estimator")
register = _REGISTRY.register
names = _REGISTRY.names

# verl clamps the k3 log-ratio to +-20 before exp and the estimate to +-10 (numerical safety).
_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


def estimate(kind: str, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` with estimator ``kind`` (one of :func:`names`).

    Shapes: ``logp``, ``ref_logp`` ``[B, T]`` -> ``[B, T]``. Gradients flow through both inputs.
    """
    return _REGISTRY.get(kind)(logp, ref_logp)


@register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``log pi - log pi_ref``: unbiased, high variance, can be negative. ``[B, T]`` -> ``[B, T]``.

    Schulman (2020) k1; verl ``kl_penalty`` "kl"/"k1".
    """
    return logp - ref_logp


@register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``0.5 * (log pi - log pi_ref)^2``: biased, low variance, non-negative. ``[B, T]`` -> ``[B, T]``.

    Schulman (2020) k2; verl ``kl_penalty`` "mse"/"k2".
    """
    return 0.5 * (logp - ref_logp).square()


@register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``r - log r - 1`` with ``r = pi_ref / pi``: unbiased, low variance, non-negative. ``[B, T]`` -> ``[B, T]``.

    Schulman (2020) k3; verl ``kl_penalty`` "low_var_kl"/"k3", including its clamps: ``log r`` to
    [-20, 20] and the estimate to [-10, 10].
    """
    log_ratio = (ref_logp - logp).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-_K3_VALUE_BOUND, _K3_VALUE_BOUND)
