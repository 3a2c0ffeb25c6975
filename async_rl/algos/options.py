"""The algorithms' vocabulary: names, what each algorithm needs, and the policy loss's options.

Torch-free and importing nothing of async_rl but :mod:`async_rl.bounds`, so that the config (``algorithm.*``), the
learner and the docs read the same facts that :mod:`~async_rl.algos.advantages`,
:mod:`~async_rl.algos.losses` and :mod:`~async_rl.algos.kl` implement. Adding an algorithm:
its name in the ``Literal`` here, its entry in :data:`ESTIMATORS` or :data:`LOSSES`, and its
function registered in the module that computes it (``tests/algos/test_options.py`` checks
that the three agree).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from async_rl.bounds import bound_problems, bounded, unbounded

AdvantageName = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "grpo_passk", "opo", "gae"]
"""Advantage estimators (:mod:`~async_rl.algos.advantages`)."""
LossName = Literal["ppo", "decoupled_ppo", "tis", "gspo", "cispo"]
"""Policy losses (:mod:`~async_rl.algos.losses`)."""
KLName = Literal["k1", "k2", "k3"]
"""Per-token KL estimators (:mod:`~async_rl.algos.kl`)."""
IsLevel = Literal["none", "token", "sequence"]
MaskLevel = Literal["none", "token", "sequence", "geometric"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

KL_ESTIMATORS: tuple[str, ...] = typing.get_args(KLName)
IS_LEVELS: tuple[str, ...] = typing.get_args(IsLevel)
MASK_LEVELS: tuple[str, ...] = typing.get_args(MaskLevel)
AGG_MODES: tuple[str, ...] = typing.get_args(AggMode)


@dataclass(frozen=True)
class EstimatorInfo:
    """What an advantage estimator needs besides rewards and the response mask."""

    group: bool
    """Its baseline comes from the other samples of the same prompt: it needs ``group_index``
    and more than one sample per prompt (``rollout.n > 1``)."""
    options: tuple[str, ...] = ()
    """The keyword options it takes, named as the fields of the config's ``algorithm.advantage``."""
    critic: bool = False
    """It takes a value model's ``values`` (``learner.critic`` is trained beside the policy)."""


ESTIMATORS: dict[str, EstimatorInfo] = {
    "grpo": EstimatorInfo(group=True, options=("norm_by_std", "eps")),
    "rloo": EstimatorInfo(group=True),
    "reinforce_pp": EstimatorInfo(group=False, options=("gamma",)),
    "reinforce_pp_baseline": EstimatorInfo(group=True),
    "grpo_passk": EstimatorInfo(group=True, options=("norm_by_std", "eps")),
    "opo": EstimatorInfo(group=True),
    "gae": EstimatorInfo(group=False, options=("gamma", "lam"), critic=True),
}
"""Every advantage estimator of :data:`AdvantageName`, by name."""


@dataclass(frozen=True)
class LossInfo:
    """How a policy loss anchors its ratio and weights its tokens."""

    bypass: bool = False
    """``pi_prox := mu``: the ratio's anchor is the behaviour log-probs, so the learner never
    recomputes the proximal policy for it."""
    behaviour_weight: bool = False
    """Its definition includes the importance weight ``pi_prox / mu``, so ``is_level="none"``
    means "token" for it, and it needs a recomputed ``pi_prox`` (else the weight is 1)."""


LOSSES: dict[str, LossInfo] = {
    "ppo": LossInfo(),
    "decoupled_ppo": LossInfo(behaviour_weight=True),
    "tis": LossInfo(bypass=True),
    "gspo": LossInfo(),
    "cispo": LossInfo(),
}
"""Every policy loss of :data:`LossName`, by name."""


@dataclass(frozen=True)
class LossOptions:
    """Every option of the policy loss, with its default (the config's ``algorithm.loss`` section
    holds the same fields, plus the loss's ``name``). Read from a config by :meth:`from_any`."""

    clip_low: float = bounded(0.2, ge=0, lt=1)
    """PPO lower clip: the ratio is clipped below at ``1 - clip_low``."""
    clip_high: float = bounded(0.2, ge=0)
    """PPO upper clip: the ratio is clipped above at ``1 + clip_high``; above ``clip_low`` it is DAPO's clip-higher (which uses 0.28)."""
    clip_c: float | None = bounded(None, gt=1)
    """Dual-clip constant (e.g. 3.0; Ye et al., arXiv:1912.09729): for negative advantages the per-token loss is capped at ``-clip_c * A``; null disables dual-clip."""
    is_level: IsLevel = "none"
    """Behaviour importance weight ``pi_train / mu`` for every loss: per ``token``, per ``sequence`` (product over the sequence), or ``none`` (weight 1). ``decoupled_ppo`` always carries it (``none`` means ``token`` there)."""
    is_cap: float | None = bounded(2.0, ge=1)
    """Truncation of the importance weight, ``w = min(w, is_cap)`` (TIS), at least 1 so that on-policy tokens are never scaled down; null for no truncation."""
    mask_level: MaskLevel = "none"
    """Masked importance sampling (rejection): ``token`` drops tokens whose ratio leaves [mask_lower, mask_upper], ``sequence`` sequences whose ratio product does, ``geometric`` sequences whose geometric-mean ratio does; ``none`` keeps everything."""
    mask_lower: float = bounded(0.5, ge=0, le=1)
    """Lower bound of the accepted ratio for masked importance sampling."""
    mask_upper: float = bounded(2.0, ge=1)
    """Upper bound of the accepted ratio for masked importance sampling."""
    agg_mode: AggMode = "token-mean"
    """How token losses are reduced to a scalar: ``token-mean`` (over all trained tokens of the batch), ``seq-mean-token-sum``, ``seq-mean-token-mean`` (token mean per sequence, then mean over sequences) or ``seq-mean-token-sum-norm`` (token sum per sequence divided by ``T``, then mean over sequences; Dr. GRPO). Sequences without trained tokens do not count."""
    kl_coef: float = bounded(0.0, ge=0)
    """Weight of the KL penalty to the frozen reference policy in the loss; 0 loads no reference model (unless ``algorithm.kl_in_reward``)."""
    kl_kind: KLName = "k3"
    """KL estimator of that penalty (Schulman's k1/k2/k3; k3 with verl's clamps)."""
    entropy_coef: float = unbounded(0.0, "a negative weight is an entropy penalty")
    """Weight of the entropy bonus subtracted from the loss; 0 = off."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid loss options: " + "; ".join(problems))

    def problems(self, prefix: str = "") -> list[str]:
        """One message per option out of its range (the bound declared on each numeric field) or
        not one of its choices, each naming ``prefix + option`` and its value."""
        choices = [("is_level", IS_LEVELS), ("mask_level", MASK_LEVELS), ("agg_mode", AGG_MODES), ("kl_kind", KL_ESTIMATORS)]
        return bound_problems(self, prefix) + [
            f"{prefix}{name}={getattr(self, name)!r} must be one of {', '.join(allowed)}" for name, allowed in choices if getattr(self, name) not in allowed
        ]

    @classmethod
    def from_any(cls, config: Mapping[str, Any] | object | None) -> LossOptions:
        """Options from a dict, or from any object with attributes of the same names (e.g. the
        config's ``algorithm.loss`` section, whose ``name`` is ignored).

        Missing names take the defaults; a dict key that is not an option raises ``ValueError``,
        as does an option out of its range.
        """
        if config is None:
            return cls()
        if type(config) is cls:
            return config
        fields = [field.name for field in dataclasses.fields(cls)]
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - set(fields))
            if unknown:
                raise ValueError(f"unknown loss option(s) {unknown}; valid options: {fields}")
            return cls(**config)
        return cls(**{name: getattr(config, name) for name in fields if hasattr(config, name)})
