"""The algorithms' vocabulary: names, what each algorithm needs, and the policy loss's options.

Torch-free and importing nothing of async_rl but :mod:`async_rl.bounds` and :mod:`async_rl.plugins`, so
that the config (``algorithm.*``), the learner and the docs read the same facts that
:mod:`~async_rl.algos.advantages`, :mod:`~async_rl.algos.losses` and :mod:`~async_rl.algos.kl`
implement. Adding a built-in algorithm: its name in the ``Literal`` here, its entry in
:data:`ESTIMATORS` or :data:`LOSSES`, and its function registered in the module that computes
it (``tests/algos/test_options.py`` checks that the three agree).

A user's own estimator or loss needs no edit of the package: ``algorithm.advantage.name`` and
``algorithm.loss.name`` also take ``path/to/file.py:function``, whose needs the function
declares with :func:`estimator` or :func:`policy_loss` (docs/algorithms.md, "Your own
estimator or loss"); :func:`algorithm_problems` checks it when the config loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from async_rl.bounds import bound_problems, bounded, unbounded
from async_rl.plugins import FILE_FORM, load_from_module, load_module

F = TypeVar("F", bound=Callable[..., Any])

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
ADVANTAGE_OPTIONS = ("norm_by_std", "eps", "gamma", "lam")
"""The options an estimator may take: the fields of the config's ``algorithm.advantage`` besides its name."""
ADVANTAGE_KEY = "algorithm.advantage.name"
LOSS_KEY = "algorithm.loss.name"


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


# --------------------------------------------------------------------------- a user's own


def estimator(*, group: bool, options: tuple[str, ...] = (), critic: bool = False) -> Callable[[F], F]:
    """Declare what a user's advantage estimator needs (a decorator; see :class:`EstimatorInfo`).
    The function is called as ``fn(rewards, response_mask, group_index, **options)`` (shapes as
    :mod:`~async_rl.algos.advantages`; ``values=`` too when ``critic``) and returns the
    advantages ``[B, T]``, or ``(advantages, returns)``."""
    info = EstimatorInfo(group=group, options=tuple(options), critic=critic)

    def declare(fn: F) -> F:
        fn.estimator_info = info  # type: ignore[attr-defined]
        return fn

    return declare


def policy_loss(*, bypass: bool = False, behaviour_weight: bool = False) -> Callable[[F], F]:
    """Declare how a user's policy loss anchors and weights (a decorator; see :class:`LossInfo`).
    The function is called as ``fn(logp, prox_logp, advantages, mask, options)`` (``[B, T]``
    tensors, ``options`` a :class:`LossOptions`) and returns the per-token loss ``[B, T]``, or
    a :class:`~async_rl.algos.losses.PolicyTerms`; the importance weight, the rejection mask,
    the aggregation and the KL and entropy terms are applied around it as for every loss."""
    info = LossInfo(bypass=bypass, behaviour_weight=behaviour_weight)

    def declare(fn: F) -> F:
        fn.loss_info = info  # type: ignore[attr-defined]
        return fn

    return declare


def is_user_spec(name: str) -> bool:
    """Whether ``name`` names a user's function (``path/to/file.py:function``), not a built-in."""
    return ":" in name


def user_algorithm(spec: str, key: str) -> Callable[..., Any]:
    """The function of ``spec`` (``path/to/file.py:function``); its file is loaded once per
    process (an estimator and a loss of one file share its module). The errors name ``key``
    (``FileNotFoundError``, ``ImportError``, ``AttributeError``, or ``ValueError`` for an
    object that is not a function)."""
    fn = load_from_module(spec, key, "estimator" if key == ADVANTAGE_KEY else "policy loss", load_module)
    if not callable(fn):
        raise ValueError(f"{key}={spec!r} is {type(fn).__name__}, not a function")
    return fn


def estimator_info(name: str) -> EstimatorInfo:
    """What estimator ``name`` needs: a built-in's entry, or a user function's declaration
    (undeclared: no groups, no options, no critic)."""
    if not is_user_spec(name):
        return ESTIMATORS[name]
    return getattr(user_algorithm(name, ADVANTAGE_KEY), "estimator_info", EstimatorInfo(group=False))


def loss_info(name: str) -> LossInfo:
    """How loss ``name`` anchors and weights: a built-in's entry, or a user function's declaration."""
    if not is_user_spec(name):
        return LOSSES[name]
    return getattr(user_algorithm(name, LOSS_KEY), "loss_info", LossInfo())


def algorithm_problems(advantage: str, loss: str) -> list[str]:
    """One message per estimator or loss name that cannot be used, naming its key: an unknown
    built-in (with the closest name), a file or function that does not load, a declaration of
    the wrong type or of options ``algorithm.advantage`` lacks, a signature that cannot take
    the call the learner makes."""
    problems: list[str] = []
    for key, name, builtins, attribute, kind, call in (
        (ADVANTAGE_KEY, advantage, ESTIMATORS, "estimator_info", EstimatorInfo, ("rewards", "response_mask", "group_index")),
        (LOSS_KEY, loss, LOSSES, "loss_info", LossInfo, ("logp", "prox_logp", "advantages", "mask", "options")),
    ):
        if not is_user_spec(name):
            if name not in builtins:
                close = difflib.get_close_matches(name, list(builtins), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{key}={name!r} is not a built-in{hint}: expected one of {', '.join(map(repr, builtins))}, "
                                f"or your own as {FILE_FORM} (docs/algorithms.md)")
            continue
        try:
            fn = user_algorithm(name, key)
        except (OSError, ImportError, AttributeError, ValueError, SyntaxError) as exc:
            problems.append(f"{key}={name!r}: {type(exc).__name__}: {exc}")
            continue
        info = getattr(fn, attribute, kind(group=False) if kind is EstimatorInfo else kind())
        if not isinstance(info, kind):
            problems.append(f"{key}={name!r}: its {attribute} is {type(info).__name__}, not {kind.__name__} "
                            f"(declare it with async_rl.algos.options.{'estimator' if kind is EstimatorInfo else 'policy_loss'})")
            continue
        extra = [o for o in getattr(info, "options", ()) if o not in ADVANTAGE_OPTIONS]
        if extra:
            problems.append(f"{key}={name!r} declares options {extra} that algorithm.advantage does not have "
                            f"(it has {', '.join(ADVANTAGE_OPTIONS)})")
            continue
        args = [*call, *(["values"] if getattr(info, "critic", False) else []), *getattr(info, "options", ())]
        try:
            inspect.signature(fn).bind(*call, **{a: None for a in args[len(call):]})
        except TypeError as exc:
            problems.append(f"{key}={name!r} cannot be called as {fn.__name__}({', '.join(call)}"
                            f"{''.join(f', {a}=...' for a in args[len(call):])}): {exc}")
        except ValueError:  # no signature to read (a builtin): let the call decide
            pass
    return problems


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
