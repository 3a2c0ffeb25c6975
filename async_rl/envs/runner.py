"""Running one episode: reset -> (model turn -> environment step) until done or the turn limit.

The runner owns the environment's calls, never the model: the caller's ``act(new_messages)``
gets the chat messages added since its last turn (first the system prompt and the first
observation, then each observation) and returns the model's reply text; the token-level
caller appends exactly those messages' tokens to what the model generated (token-exact
trajectories). Every environment call runs off the event loop (a synchronous method on a
thread of the runner's own pool, so a slow one never holds up the queue's or reward
pool's threads; an ``async`` one on the loop) with a timeout. An environment that raises
or times out ends its episode: the :class:`Trajectory` carries the error and the run goes
on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from async_rl.envs.base import BaseEnvironment, Trajectory

Message = dict[str, str]
Act = Callable[[list[Message]], Awaitable["str | None"]]
"""``await act(new_messages) -> reply text``: one model turn after the messages added since
the last; None when the model cannot take another turn (its token budget is spent)."""

ENV_THREADS = 64
"""Threads for synchronous environment calls, per process. A call that hangs past its
timeout keeps its thread until it returns (Python cannot stop a thread): the episode ends
at the timeout, and the thread is lost to the pool meanwhile."""

_executor: ThreadPoolExecutor | None = None


class EnvError(RuntimeError):
    """An environment call raised (the message is ``method: ExceptionType: message``)."""


class EnvTimeout(EnvError):
    """An environment call took longer than its timeout."""


def _threads() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="env")
    return _executor


async def call_env(method: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``method(*args)`` off the event loop, bounded by ``timeout_s`` seconds; raises
    :class:`EnvTimeout` or :class:`EnvError` (with the cause chained)."""
    name = getattr(method, "__qualname__", repr(method))
    if inspect.iscoroutinefunction(method):
        pending: Awaitable[Any] = method(*args)
    else:
        pending = asyncio.get_running_loop().run_in_executor(_threads(), lambda: method(*args))
    try:
        return await asyncio.wait_for(pending, timeout_s)
    except asyncio.TimeoutError:
        raise EnvTimeout(f"{name} took longer than {timeout_s:g} s") from None
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure ends the episode, not the run
        raise EnvError(f"{name}: {type(exc).__name__}: {exc}") from exc


def _takes_row(reset: Callable[..., Any]) -> bool:
    """Whether ``reset`` accepts the dataset row (a bound method with a parameter)."""
    params = [p for p in inspect.signature(reset).parameters.values() if p.kind not in (p.VAR_KEYWORD,)]
    return bool(params)


def _messages(observation: Any) -> list[Message]:
    """An observation as chat messages: a string is the user's message; a list must hold
    ``{"role": str, "content": str}`` dicts (:class:`EnvError` names the bad one)."""
    if not isinstance(observation, list):
        return [{"role": "user", "content": str(observation)}]
    for i, m in enumerate(observation):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise EnvError(f"step returned observation message {i} that is not {{'role': str, 'content': str}}: {m!r:.80}")
    if not observation:
        raise EnvError("step returned an empty list of observation messages")
    return [{"role": m["role"], "content": m["content"]} for m in observation]


def _step_result(out: Any) -> tuple[list[Message], float, bool, dict[str, Any]]:
    """Check the shape of ``step``'s return; :class:`EnvError` names what is wrong."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise EnvError(f"step must return (observation, reward, done, info), got {type(out).__name__} {out!r:.80}")
    observation, reward, done, info = out
    messages = _messages(observation)
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"step returned a reward that is not a number: {reward!r:.80}") from None
    if not isinstance(info, Mapping):
        raise EnvError(f"step returned info of type {type(info).__name__}, not a dict")
    return messages, reward, bool(done), dict(info)


async def run_episode(
    env: BaseEnvironment,
    act: Act,
    *,
    max_turns: int,
    step_timeout_s: float,
    row: Mapping[str, Any] | None = None,
) -> Trajectory:
    """One episode of ``env`` with the model behind ``act``; at most ``max_turns`` model turns
    (fewer when ``act`` returns None).

    ``row`` (the dataset row) is passed to ``reset`` when it takes an argument. The model's
    own failures (``act`` raising) propagate: they are the caller's to retry or count.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    trajectory = Trajectory()
    try:
        args = (dict(row or {}),) if _takes_row(env.reset) else ()
        observation = str(await call_env(env.reset, *args, timeout_s=step_timeout_s))
        prefix = await call_env(env.get_prompt_prefix, timeout_s=step_timeout_s)
    except EnvError as exc:
        trajectory.error = str(exc)
        return trajectory
    new: list[Message] = ([{"role": "system", "content": str(prefix)}] if prefix else []) + [{"role": "user", "content": observation}]
    for _ in range(max_turns):
        action = await act(new)
        if action is None:
            break
        trajectory.states.append(observation)
        trajectory.actions.append(action)
        t0 = time.monotonic()
        try:
            new, reward, done, info = _step_result(await call_env(env.step, action, timeout_s=step_timeout_s))
        except EnvError as exc:
            trajectory.error = str(exc)
            break
        finally:
            trajectory.step_s += time.monotonic() - t0
        trajectory.rewards.append(reward)
        trajectory.dones.append(done)
        trajectory.infos.append(info)
        if done:
            break
        observation = "\n".join(m["content"] for m in new)
    return trajectory
