"""The reward functions by name (``rollout.reward.function``): a built-in (registered by
:mod:`async_rl.rewards.builtin`, which the package imports) or ``path/to/file.py:function``."""

from __future__ import annotations

from typing import Any, Callable

from async_rl.plugins import Registry

RewardFunction = Callable[..., Any]
"""EasyR1's interface: batch ``fn(reward_inputs, **kwargs) -> list of dicts`` (one dict with
``overall`` per input) or sequential ``fn(reward_input, **kwargs) -> dict``."""

REWARDS: Registry[RewardFunction] = Registry("reward function", key="rollout.reward.function", accepts=callable, expected="a function")
"""Built-ins register with ``@REWARDS.register("name")``."""


def builtin_names() -> list[str]:
    """Names of the built-in reward functions."""
    return REWARDS.names()


def load_reward_function(spec: str) -> RewardFunction:
    """Resolve ``rollout.reward.function``: a built-in name or ``path/to/file.py:function``."""
    return REWARDS.resolve(spec)
