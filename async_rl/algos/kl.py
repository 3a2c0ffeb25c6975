"""Per-token KL estimators between a policy and a reference policy, the KL penalty in the
reward, and its coefficient's controllers.

Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html); names and clamps as
in verl ``verl/trainer/ppo/core_algos.py::kl_penalty``. Samples are drawn from the policy whose
log-probabilities are ``logp``; every estimator targets ``KL(pi || pi_ref)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from async_rl.plugins import Registry

from ._masked import masked_mean

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


def penalize_rewards(token_scores: Tensor, token_kl: Tensor, mask: Tensor, coef: float) -> tuple[Tensor, Tensor]:
    """KL in the reward, as verl's ``apply_kl_penalty``: ``r_t = s_t - coef * kl_t`` on trained tokens.

    Shapes: ``token_scores`` (e.g. the outcome reward on the last trained token), ``token_kl``
    (an :func:`estimate` against the reference policy) and ``mask`` ``[B, T]``. Returns
    ``(token rewards [B, T], current_kl)``, where ``current_kl`` (a scalar tensor) is the mean
    over sequences of each sequence's mean KL per trained token: what a controller's
    :meth:`~AdaptiveKLController.update` takes.
    """
    mask = mask.to(token_scores.dtype)
    rewards = (token_scores - coef * token_kl.to(token_scores.dtype)) * mask
    return rewards, masked_mean(token_kl.to(token_scores.dtype), mask, dim=-1).mean()


@dataclass
class FixedKLController:
    """A constant KL coefficient (verl ``FixedKLController``); ``update`` changes nothing."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays ``value``."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. (arXiv:1909.08593, section 2.2; verl
    ``AdaptiveKLController``): after each batch, ``value *= 1 + clip(KL / target_kl - 1, -0.2, 0.2)
    * n_steps / horizon``, so the coefficient grows while the measured KL is above ``target_kl``
    and shrinks while it is below, by at most 20% per ``horizon`` samples.

    Args:
        init_kl_coef: starting coefficient (> 0).
        target_kl: the KL per token to hold (nats, > 0).
        horizon: samples over which a 20% error changes the coefficient by 20% (> 0).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        for name, v in (("init_kl_coef", init_kl_coef), ("target_kl", target_kl), ("horizon", horizon)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"AdaptiveKLController: {name} must be a finite number > 0, got {v!r}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust ``value`` after a batch of ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
