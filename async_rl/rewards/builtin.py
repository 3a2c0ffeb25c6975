"""Built-in reward functions."""

from __future__ import annotations

import re
from typing import Any

from async_rl.rewards.registry import register

_SPACE = re.compile(r"\s+")


def _normalise(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


@register("exact_match")
def exact_match(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """1.0 when the response, whitespace-normalised, equals the ground truth; else 0.0.

    Meant for short-answer tasks such as the tiny arithmetic task, whose responses are the
    bare answer.
    """
    scores = []
    for item in reward_inputs:
        hit = float(_normalise(item["response"]) == _normalise(str(item["ground_truth"])))
        scores.append({"overall": hit, "accuracy": hit})
    return scores
