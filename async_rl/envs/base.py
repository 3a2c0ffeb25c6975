"""The environment interface users bring from their verl-based setups, and the episode record.

An environment is written like this (synchronous, ``reset()`` without arguments), and runs
unchanged::

    class MyEnv(BaseEnvironment):
        def __init__(self, config: EnvironmentConfig):
            super().__init__(config)
        def reset(self) -> str: ...                                    # the first observation
        def step(self, action: str) -> tuple[str, float, bool, dict]:  # observation, reward, done, info
        def get_state_description(self) -> str: ...
        def get_prompt_prefix(self) -> str: return "You are a helpful assistant."

Beyond that form, ``reset`` and ``step`` may be ``async def``, and ``reset(row)`` may take the
dataset row of the episode (a dict with the row's fields). The instances live in environment
processes (:mod:`async_rl.envs.process`, one or a few per server): a plain method runs on a
thread there, an ``async`` one on that process's event loop, each call with a timeout
(:mod:`async_rl.envs.runner`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from async_rl.records import Failure


class EnvironmentConfig:
    """An environment's parameters: ``rollout.env.kwargs`` as attributes (``config.size``),
    also readable with :meth:`get` and :meth:`to_dict`."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def get(self, name: str, default: Any = None) -> Any:
        """The parameter ``name``, or ``default`` when it was not given."""
        return self.__dict__.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        """Every parameter, as given."""
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"EnvironmentConfig({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class BaseEnvironment(abc.ABC):
    """One episode's world: ``reset`` gives the first observation, ``step(action)`` answers
    each model turn with ``(observation, reward, done, info)``. One instance serves one
    episode (the environment process makes one per episode)."""

    def __init__(self, config: EnvironmentConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def reset(self) -> str:
        """Start an episode; the first observation (the user's first message).
        Subclasses may take the dataset row (``reset(self, row)``) and may be ``async``."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str | list[dict[str, str]], float, bool, dict[str, Any]]:
        """Apply the model's turn ``action`` (its text); ``(observation, reward, done, info)``.

        The observation is the user's next message, or a list of chat messages
        (``{"role": "tool", "content": ...}`` for tool results). ``info["success"]``, when
        given, is what validation counts. May be ``async``."""

    def get_state_description(self) -> str:
        """A short description of the current state (for logs and the user's own code)."""
        return ""

    def get_prompt_prefix(self) -> str:
        """The system prompt of the episode."""
        return "You are a helpful assistant."


@dataclass
class Trajectory:
    """The text view of one episode, as users' own code reads it: ``states[i]`` is the
    observation the model answered with ``actions[i]``, and ``rewards[i]``, ``dones[i]`` and
    ``infos[i]`` are what the environment returned for that action."""

    states: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    dones: list[bool] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    failure: Failure | None = None
    """Why the environment ended the episode there (``env_error``: it raised, returned something
    unusable or blocked its event loop; ``env_timeout``: a call took longer than
    ``rollout.env.step_timeout_s``); None when it did not fail."""
    step_s: float = 0.0
    """Seconds spent in the environment's ``step`` calls, all turns together."""

    def info_total(self, key: str) -> float:
        """The sum of the numeric ``info[key]`` over the steps (e.g. ``tool_calls``)."""
        return float(sum(v for info in self.infos if isinstance(v := info.get(key), (int, float))))

    @property
    def num_turns(self) -> int:
        """Model turns taken."""
        return len(self.actions)

    @property
    def done(self) -> bool:
        """The environment ended the episode (not the turn limit, nor a failure)."""
        return bool(self.dones) and self.dones[-1]

    def total_reward(self, mode: str = "sum") -> float:
        """The episode's reward: ``sum`` of the step rewards, or the ``final`` one (0.0 with no step)."""
        if mode == "sum":
            return float(sum(self.rewards))
        if mode == "final":
            return float(self.rewards[-1]) if self.rewards else 0.0
        raise ValueError(f"reward mode must be 'sum' or 'final', got {mode!r}")

    @property
    def success(self) -> bool:
        """``info["success"]`` of the last step when the environment reports it, else a total reward of at least 1."""
        if self.infos and "success" in self.infos[-1]:
            return bool(self.infos[-1]["success"])
        return self.total_reward() >= 1.0
