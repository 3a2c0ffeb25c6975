"""Finding a reward function by built-in name or by ``path/to/file.py:function``."""

from __future__ import annotations

import difflib
from typing import Any, Callable

from async_rl.plugins import load_from_file

RewardFunction = Callable[..., Any]
"""EasyR1's interface: batch ``fn(reward_inputs, **kwargs) -> list of dicts`` (one dict with
``overall`` per input) or sequential ``fn(reward_input, **kwargs) -> dict``."""

_BUILTINS: dict[str, RewardFunction] = {}


def register(name: str) -> Callable[[RewardFunction], RewardFunction]:
    """Decorator registering a built-in reward function under ``name``."""

    def wrap(fn: RewardFunction) -> RewardFunction:
        _BUILTINS[name] = fn
        return fn

    return wrap


def builtin_names() -> list[str]:
    """Names of the built-in reward functions."""
    _load_builtins()
    return sorted(_BUILTINS)


def load_reward_function(spec: str) -> RewardFunction:
    """Resolve ``rollout.reward.function``: a built-in name or ``path/to/file.py:function``."""
    _load_builtins()
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(_BUILTINS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown reward function {spec!r}{hint}: use one of {', '.join(builtin_names())} or path/to/file.py:function")
    try:
        fn = load_from_file(spec, "rollout.reward.function", "reward")
    except AttributeError as exc:
        raise ValueError(str(exc)) from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is not a function (from rollout.reward.function)")
    return fn


def _load_builtins() -> None:
    # Imported here so that registering happens on first use without an import cycle.
    from async_rl.rewards import builtin  # noqa: F401
