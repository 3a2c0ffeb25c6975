"""Finding an environment class by built-in name or by ``path/to/file.py:Class`` (``rollout.env.name``)."""

from __future__ import annotations

import difflib
from typing import Any

from async_rl.envs.base import BaseEnvironment, EnvironmentConfig
from async_rl.plugins import load_from_file

KEY = "rollout.env.name"

_BUILTINS: dict[str, type[BaseEnvironment]] = {}


def register(name: str):  # type: ignore[no-untyped-def]
    """Class decorator registering a built-in environment under ``name``."""

    def wrap(cls: type[BaseEnvironment]) -> type[BaseEnvironment]:
        _BUILTINS[name] = cls
        return cls

    return wrap


def builtin_names() -> list[str]:
    """Names of the built-in environments."""
    return sorted(_BUILTINS)


def load_environment(spec: str) -> type[BaseEnvironment]:
    """Resolve ``rollout.env.name``: a built-in name or ``path/to/file.py:Class`` (a subclass
    of :class:`~async_rl.envs.BaseEnvironment`)."""
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(_BUILTINS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        names = ", ".join(builtin_names()) or "none yet"
        raise ValueError(f"unknown environment {spec!r}{hint}: use a built-in ({names}) or path/to/file.py:Class")
    try:
        cls = load_from_file(spec, KEY, "env")
    except AttributeError as exc:
        raise ValueError(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, BaseEnvironment)):
        raise ValueError(f"{KEY}={spec!r} is not a subclass of async_rl.envs.BaseEnvironment")
    return cls


def make_environment(cls: type[BaseEnvironment], kwargs: dict[str, Any]) -> BaseEnvironment:
    """A fresh environment of ``cls`` with ``kwargs`` (``rollout.env.kwargs``) as its config."""
    return cls(EnvironmentConfig(**kwargs))
