"""Built-in environments (``rollout.env.name`` by name).

``addition_feedback``: the tiny addition task (``async_rl.tiny.addition``) as a game of
several turns. The model answers a row's problem; a wrong answer gets "Higher." or "Lower."
(or "Answer with one number." when the reply is not one integer; the messages are
:func:`feedback`'s) and another turn, until it
is right or ``rollout.env.max_turns`` is spent. The reward of the winning step is
``1 - turn_penalty * (turns - 1)``; every other step gives 0, so ``rollout.env.reward=sum``
(the default) rewards solving it, and solving it sooner.
"""

from __future__ import annotations

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
