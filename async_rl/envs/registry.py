"""The environment classes by name (``rollout.env.name``): a built-in (registered by
:mod:`async_rl.envs.builtin`, which the package imports) or ``path/to/file.py:Class``."""

from __future__ import annotations

from typing import Any

from async_rl.envs.base import BaseEnvironment, EnvironmentConfig
from async_rl.plugins import Registry


def _is_environment_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseEnvironment)


ENVIRONMENTS: Registry[type[BaseEnvironment]] = Registry(
    "environment", key="rollout.env.name", accepts=_is_environment_class, expected="a subclass of async_rl.envs.BaseEnvironment"
)
"""Built-ins register with ``@ENVIRONMENTS.register("name")``."""


def builtin_names() -> list[str]:
    """Names of the built-in environments."""
    return ENVIRONMENTS.names()


def load_environment(spec: str) -> type[BaseEnvironment]:
    """Resolve ``rollout.env.name``: a built-in name or ``path/to/file.py:Class`` (a subclass
    of :class:`~async_rl.envs.BaseEnvironment`)."""
    return ENVIRONMENTS.resolve(spec)


def make_environment(cls: type[BaseEnvironment], kwargs: dict[str, Any]) -> BaseEnvironment:
    """A fresh environment of ``cls`` with ``kwargs`` (``rollout.env.kwargs``) as its config."""
    return cls(EnvironmentConfig(**kwargs))
