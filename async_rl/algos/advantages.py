"""Advantage estimators: rewards -> per-token advantages.

Shapes: ``B`` sequences, ``T`` response tokens. ``rewards`` is ``[B]`` (one outcome reward per
sequence) or ``[B, T]`` (token-level rewards; outcome estimators use their masked sum),
``response_mask`` ``[B, T]`` (1 = trained token), ``group_index`` an integer ``[B]`` naming each
sequence's prompt group (sequences of one prompt share a value; groups may differ in size).
Outcome advantages are broadcast over the mask; every result is 0 on padding.

Every estimator is registered with :func:`register` and takes
``(rewards, response_mask, group_index, **options)``, returning ``(advantages, returns)``, both
``[B, T]`` (outcome estimators return the advantages twice, as verl does). Call it through
:func:`compute` (advantages only) or :func:`compute_with_returns`, by its name or, for a
user's own, by ``path/to/file.py:function`` (:func:`~async_rl.algos.options.estimator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from async_rl.plugins import Registry

from ._masked import masked_whiten
from .options import ADVANTAGE_KEY, is_user_spec, user_algorithm

Estimator = Callable[..., tuple[Tensor, Tensor]]

_REGISTRY: Registry[Estimator] = Registry("advantage estimator")
register = _REGISTRY.register
names = _REGISTRY.names

# verl's epsilon for dividing by a group's standard deviation (an all-equal group has std 0).
_STD_EPS = 1e-6


def compute(
    name: str,
    *,
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Advantages ``[B, T]`` from estimator ``name`` (one of :func:`names`); see the module docstring."""
    return compute_with_returns(
        name, rewards=rewards, response_mask=response_mask, group_index=group_index, **options
    )[0]


def compute_with_returns(
    name: str,
    *,
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)``, both ``[B, T]``, from estimator ``name``; computed without gradient.

    Computed in at least float32 (float64 rewards stay float64; integer, bool and half become float32).
    """
    user = is_user_spec(name)
    estimator = user_algorithm(name, ADVANTAGE_KEY) if user else _REGISTRY.get(name)
    _check_shapes(rewards, response_mask, group_index)
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    with torch.no_grad():
        out = estimator(rewards, response_mask.to(rewards.dtype), group_index, **options)
    return _user_result(name, out, tuple(response_mask.shape)) if user else out


def _user_result(name: str, out: Any, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """A user estimator's advantages, or (advantages, returns), checked to be ``[B, T]`` tensors."""
    pair = out if isinstance(out, tuple) else (out, out)
    if len(pair) != 2 or not all(isinstance(t, Tensor) and tuple(t.shape) == shape for t in pair):
        got = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in pair] if isinstance(out, tuple) else (
            tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__)
        raise ValueError(f"{ADVANTAGE_KEY}={name!r} returned {got}: expected advantages [B, T] = {shape}, "
                         "or (advantages, returns), both of that shape")
    return pair


def _check_shapes(rewards: Tensor, response_mask: Tensor, group_index: Tensor | None) -> None:
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    batch = response_mask.shape[0]
    if rewards.shape not in ((batch,), tuple(response_mask.shape)):
        raise ValueError(f"rewards must be [B] or [B, T] = {tuple(response_mask.shape)}, got {tuple(rewards.shape)}")
    if group_index is not None and (group_index.shape != (batch,) or group_index.is_floating_point()):
        raise ValueError(f"group_index must be an integer tensor of shape [{batch}], got {group_index}")


def _outcome_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """One score per sequence ``[B]``: the reward itself, or the masked sum of token rewards."""
    return rewards if rewards.dim() == 1 else (rewards * mask).sum(-1)


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Token rewards ``[B, T]``: token-level rewards as given, an outcome reward on the last trained token."""
    if rewards.dim() == 2:
        return rewards * mask
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (positions * mask).argmax(-1, keepdim=True)
    return torch.zeros_like(mask).scatter(1, last, rewards.unsqueeze(-1)) * mask


def _require_groups(group_index: Tensor | None, estimator: str) -> Tensor:
    if group_index is None:
        raise ValueError(f"advantage estimator {estimator!r} needs group_index")
    return group_index


class _Groups:
    """Per-group reductions of a ``[B]`` tensor, each broadcast back to ``[B]``."""

    def __init__(self, group_index: Tensor) -> None:
        _, self.ids = torch.unique(group_index, return_inverse=True)
        self.n_groups = int(self.ids.max()) + 1 if self.ids.numel() else 0
        self.size = self.sum(torch.ones(self.ids.shape, device=self.ids.device))

    def sum(self, values: Tensor) -> Tensor:
        totals = torch.zeros(self.n_groups, dtype=values.dtype, device=values.device)
        return totals.index_add(0, self.ids, values)[self.ids]

    def mean(self, values: Tensor) -> Tensor:
        return self.sum(values) / self.size

    def std(self, values: Tensor) -> Tensor:
        """Unbiased (Bessel) standard deviation, as ``torch.std`` in verl; 0 for a group of one."""
        centred = values - self.mean(values)
        return (self.sum(centred.square()) / (self.size - 1).clamp_min(1)).sqrt()

    def amax(self, values: Tensor) -> Tensor:
        maxima = torch.full((self.n_groups,), -torch.inf, dtype=values.dtype, device=values.device)
        return maxima.scatter_reduce(0, self.ids, values, reduce="amax")[self.ids]


def equal_reward_fraction(rewards: Tensor, group_index: Tensor) -> float:
    """Share of the groups whose sequences all got the same outcome reward: ``[B]`` rewards
    and ``[B]`` group ids -> a float in ``[0, 1]`` (a group of one counts as equal). A group
    estimator's advantages are 0 on such a group: it carries no learning signal."""
    groups = _Groups(group_index)
    if groups.n_groups == 0:
        return 0.0
    equal = groups.amax(rewards) == -groups.amax(-rewards)  # per sequence: its group's max equals its min
    per_group = torch.zeros(groups.n_groups, dtype=torch.bool, device=equal.device).index_fill(0, groups.ids[equal], True)
    return float(per_group.float().mean())


def _outcome(advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Broadcast per-sequence advantages ``[B]`` over the mask; returns equal advantages (verl)."""
    token_advantages = advantages.unsqueeze(-1) * mask
    return token_advantages, token_advantages


@register("grpo")
def grpo(
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None,
    *,
    norm_by_std: bool = True,
    eps: float = _STD_EPS,
) -> tuple[Tensor, Tensor]:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``, broadcast over the sequence's tokens.

    Options: ``norm_by_std`` (default True; False gives Dr. GRPO's ``A_i = r_i - mean_g``),
    ``eps`` (default 1e-6). ``std_g`` is unbiased; a group of one sequence gets 0.
    Shapes: ``rewards`` [B] or [B, T], ``group_index`` [B] -> ``[B, T]``.
    Sources: DeepSeekMath (arXiv:2402.03300); Dr. GRPO (arXiv:2503.20783);
    verl ``compute_grpo_outcome_advantage`` (``norm_adv_by_std_in_grpo``).
    """
    groups = _Groups(_require_groups(group_index, "grpo"))
    scores = _outcome_scores(rewards, response_mask)
    centred = scores - groups.mean(scores)
    advantages = centred / (groups.std(scores) + eps) if norm_by_std else centred
    return _outcome(advantages, response_mask)


@register("rloo")
def rloo(rewards: Tensor, response_mask: Tensor, group_index: Tensor | None) -> tuple[Tensor, Tensor]:
    """RLOO: ``A_i = r_i - (sum_g r - r_i) / (n_g - 1)``, the leave-one-out baseline.

    No options. A group of one sequence gets 0. Shapes: ``rewards`` [B] or [B, T],
    ``group_index`` [B] -> ``[B, T]``.
    Sources: Ahmadian et al., "Back to Basics" (arXiv:2402.14740); verl ``compute_rloo_outcome_advantage``.
    """
    groups = _Groups(_require_groups(group_index, "rloo"))
    scores = _outcome_scores(rewards, response_mask)
    others = (groups.sum(scores) - scores) / (groups.size - 1).clamp_min(1)
    advantages = torch.where(groups.size > 1, scores - others, torch.zeros_like(scores))
    return _outcome(advantages, response_mask)


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}``, restarted after the last trained token (verl). ``[B, T]`` -> ``[B, T]``."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


@register("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None,
    *,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go of token rewards, whitened over the batch under the mask.

    Options: ``gamma`` (discount, default 1.0). Outcome rewards ``[B]`` sit on the last trained token.
    ``group_index`` is not used. Returns ``(whitened advantages, returns)``, both ``[B, T]``.
    Sources: Hu, "REINFORCE++" (arXiv:2501.03262); verl ``compute_reinforce_plus_plus_outcome_advantage``.
    """
    del group_index  # the global batch is the baseline; groups play no part
    returns = _discounted_returns(token_rewards(rewards, response_mask), response_mask, gamma)
    return masked_whiten(returns, response_mask) * response_mask, returns


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(
    rewards: Tensor, response_mask: Tensor, group_index: Tensor | None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: ``r_i - mean_g``, broadcast over tokens, then whitened over the batch.

    No options. Shapes: ``rewards`` [B] or [B, T], ``group_index`` [B] -> ``[B, T]``.
    Sources: Hu, "REINFORCE++" (arXiv:2501.03262);
    verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """
    groups = _Groups(_require_groups(group_index, "reinforce_pp_baseline"))
    scores = _outcome_scores(rewards, response_mask)
    centred = (scores - groups.mean(scores)).unsqueeze(-1) * response_mask
    advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


@register("grpo_passk")
def grpo_passk(
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None,
    *,
    norm_by_std: bool = True,
    eps: float = _STD_EPS,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO: only a group's best sample gets ``(r_max - r_second) / (std_g + eps)``; others 0.

    Options: ``norm_by_std`` (default True; False drops the division), ``eps`` (default 1e-6).
    Ties for the best go to the lowest batch index; a group of one gets 0.
    Shapes: ``rewards`` [B] or [B, T], ``group_index`` [B] -> ``[B, T]``.
    Sources: Chen et al., pass@k training (arXiv:2503.19595); verl ``compute_grpo_passk_outcome_advantage``.
    """
    groups = _Groups(_require_groups(group_index, "grpo_passk"))
    scores = _outcome_scores(rewards, response_mask)
    best_score = groups.amax(scores)
    index = torch.arange(scores.shape[0], device=scores.device, dtype=scores.dtype)
    best_index = -groups.amax(torch.where(scores == best_score, -index, -torch.inf))
    is_best = index == best_index
    second = groups.amax(torch.where(is_best, -torch.inf, scores))
    gap = best_score - second
    if norm_by_std:
        gap = gap / (groups.std(scores) + eps)
    advantages = torch.where(is_best & (groups.size > 1), gap, torch.zeros_like(scores))
    return _outcome(advantages, response_mask)


@register("opo")
def opo(rewards: Tensor, response_mask: Tensor, group_index: Tensor | None) -> tuple[Tensor, Tensor]:
    """OPO: ``A_i = r_i - sum_g(l_j r_j) / sum_g(l_j)``, a length-weighted group baseline (``l`` = trained tokens).

    No options. A group of one sequence gets 0. Shapes: ``rewards`` [B] or [B, T],
    ``group_index`` [B] -> ``[B, T]``.
    Sources: Hao et al., "On-Policy RL with Optimal Reward Baseline" (arXiv:2505.23585);
    verl ``compute_opo_outcome_advantage``.
    """
    groups = _Groups(_require_groups(group_index, "opo"))
    scores = _outcome_scores(rewards, response_mask)
    lengths = response_mask.sum(-1)
    baseline = groups.sum(lengths * scores) / groups.sum(lengths).clamp_min(1)
    return _outcome(scores - baseline, response_mask)


@register("gae")
def gae(
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None,
    *,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation for a critic: ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``; untrained tokens are skipped (they neither bootstrap nor reset).

    Options: ``values`` ``[B, T]`` (critic values, required), ``gamma`` (default 1.0),
    ``lam`` (default 1.0). ``group_index`` is not used. Returns ``(advantages whitened over the
    batch, returns = A + V)``, both ``[B, T]``.
    Sources: Schulman et al. (arXiv:1506.02438); verl ``compute_gae_advantage_return``.
    """
    del group_index  # the critic is the baseline
    per_token = token_rewards(rewards, response_mask)
    values = values.to(per_token.dtype)
    next_value = torch.zeros_like(per_token[:, 0])
    last_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(per_token)
    for t in reversed(range(per_token.shape[1])):
        delta = per_token[:, t] + gamma * next_value - values[:, t]
        step = response_mask[:, t]
        last_advantage = step * (delta + gamma * lam * last_advantage) + (1 - step) * last_advantage
        next_value = step * values[:, t] + (1 - step) * next_value
        advantages[:, t] = last_advantage
    returns = advantages + values
    return masked_whiten(advantages, response_mask) * response_mask, returns
