"""Finding a reward function by built-in name or by ``path/to/file.py:function``."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any, Callable

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
    file, _, name = spec.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"reward file {file!r} (from rollout.reward.function={spec!r}) not found")
    module_spec = importlib.util.spec_from_file_location(f"async_rl_user_reward_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {file!r} (from rollout.reward.function={spec!r}) as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{file} has no function {name!r} (from rollout.reward.function={spec!r})")
    return fn


def _load_builtins() -> None:
    # Imported here so that registering happens on first use without an import cycle.
    from async_rl.rewards import builtin  # noqa: F401
