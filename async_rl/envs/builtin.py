"""Built-in environments (``rollout.env.name`` by name).

``addition_feedback``: the tiny addition task (``async_rl.tiny.addition``) as a game of
several turns. The model answers a row's problem; a wrong answer gets "Higher." or "Lower."
(or "Answer with one number." when the reply is not one integer; the messages are
:func:`feedback`'s) and another turn, until it
is right or ``rollout.env.max_turns`` is spent. The reward of the winning step is
``1 - turn_penalty * (turns - 1)``; every other step gives 0, so ``rollout.env.reward=sum``
(the default) rewards solving it, and solving it sooner.

``addition_slow_feedback``: the same game whose feedback comes from a slow tool, a checker
that answers after a heavy-tailed wait (lognormal: median ``latency_median_s``, 99th
percentile ``latency_p99_s``; it sleeps, it does not compute). An agent that waits on tools,
at no cost to the CPU: what asynchronous rollouts are for (issue 44).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any

from async_rl.envs.base import BaseEnvironment, EnvironmentConfig
from async_rl.envs.registry import ENVIRONMENTS

_INT = re.compile(r"-?\d+")

HIGHER, LOWER, CORRECT, NOT_A_NUMBER = "Higher.", "Lower.", "Correct.", "Answer with one number."
FEEDBACK = (HIGHER, LOWER, CORRECT, NOT_A_NUMBER)
"""Every message of ``addition_feedback`` (the tiny multi-turn assets teach their tokenizer these)."""


def extract_answer(text: str) -> str | None:
    """The integer a completion states, or None when the completion (surrounding
    whitespace aside) is anything but one integer.

    Strict on purpose: the tiny model answers with the bare number, and an RL reward
    that accepted a number buried in other text would reward junk around it.
    """
    stripped = text.strip()
    return stripped if _INT.fullmatch(stripped) else None


def feedback(said: int | None, answer: int) -> str:
    """``addition_feedback``'s reply to the model's answer ``said`` (None: not one integer)."""
    if said is None:
        return NOT_A_NUMBER
    return CORRECT if said == answer else HIGHER if said < answer else LOWER


@ENVIRONMENTS.register("addition_feedback")
class AdditionFeedback(BaseEnvironment):
    """Solve ``problem`` (``answer`` is an integer) with higher/lower feedback.

    Parameters (``rollout.env.kwargs``): ``turn_penalty`` (default 0.25): how much less a
    win is worth for each extra turn, floored at 0.1 so any win beats none.
    """

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.turn_penalty = float(config.get("turn_penalty", 0.25))
        self.answer = 0
        self.turns = 0
        self.last = ""

    def reset(self, row: dict[str, Any]) -> str:
        try:
            self.answer = int(str(row["answer"]).strip())
        except (KeyError, ValueError):
            raise ValueError(f"addition_feedback needs an integer 'answer' in the row, got {row.get('answer')!r}") from None
        self.turns = 0
        self.last = ""
        return str(row["problem"])

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.turns += 1
        said = extract_answer(action)
        self.last = feedback(None if said is None else int(said), self.answer)
        if self.last == CORRECT:
            return self.last, max(0.1, 1.0 - self.turn_penalty * (self.turns - 1)), True, {"success": True}
        return self.last, 0.0, False, {"success": False}

    def get_state_description(self) -> str:
        return f"turn {self.turns}: {self.last or 'no answer yet'}"

    def get_prompt_prefix(self) -> str:
        return ""  # the tiny model is trained without a system prompt


LATENCY_MEDIAN_S, LATENCY_P99_S = 0.3, 3.0
"""``addition_slow_feedback``'s default tool latency: lognormal, median 0.3 s, p99 3 s (sigma 0.99)."""
_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@ENVIRONMENTS.register("addition_slow_feedback")
class SlowAdditionFeedback(AdditionFeedback):
    """``addition_feedback`` whose every step waits for a slow tool before it answers.

    Parameters (``rollout.env.kwargs``), beside ``turn_penalty``: ``latency_median_s``
    (default 0.3) and ``latency_p99_s`` (default 3.0), the lognormal wait of each step in
    seconds; ``latency_seed`` (default: none, a fresh draw per episode) makes the waits of
    an episode a function of the seed and its problem. A wait past
    ``rollout.env.step_timeout_s`` (30 s by default: about 2 steps in a million at the default
    latency) fails its episode as ``env_timeout``, as a real tool's would. Each step's
    ``info["tool_wait_s"]`` is the wait it drew.
    """

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.median_s = float(config.get("latency_median_s", LATENCY_MEDIAN_S))
        p99_s = float(config.get("latency_p99_s", LATENCY_P99_S))
        if not 0 < self.median_s <= p99_s:
            raise ValueError(f"addition_slow_feedback needs 0 < latency_median_s <= latency_p99_s, got {self.median_s} and {p99_s}")
        self.sigma = math.log(p99_s / self.median_s) / _Z99
        self.seed = config.get("latency_seed")
        self.rng = random.Random()

    def reset(self, row: dict[str, Any]) -> str:
        observation = super().reset(row)
        if self.seed is not None:
            self.rng.seed(f"{self.seed}|{observation}")
        return observation

    def latency_s(self) -> float:
        """One draw of the tool's wait, seconds."""
        return self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:  # type: ignore[override]
        wait = self.latency_s()
        await asyncio.sleep(wait)
        observation, reward, done, info = super().step(action)
        return observation, reward, done, {**info, "tool_wait_s": wait}
