"""Built-in reward functions."""

from __future__ import annotations

import re
from typing import Any

from async_rl.rewards.registry import REWARDS

_SPACE = re.compile(r"\s+")


def _normalise(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


@REWARDS.register("exact_match")
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


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


@REWARDS.register("format")
def boxed_format(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """1.0 when the response states its final answer in ``\\boxed{...}``; else 0.0."""
    return [{"overall": float(last_boxed(item["response"]) is not None)} for item in reward_inputs]


@REWARDS.register("math")
def math_equivalence(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Boxed-answer math reward: ``overall = 0.9 * accuracy + 0.1 * format`` (EasyR1's math reward).

    The last ``\\boxed{...}`` of the response is compared with the ground truth for
    mathematical equivalence by the ``math-verify`` package (install ``async-rl[math]``).
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # raised per sample: the scorer counts it, the learner drops the group
        raise ImportError("the 'math' reward needs math-verify: pip install 'async-rl[math]'") from exc
    scores = []
    for item in reward_inputs:
        boxed = last_boxed(item["response"])
        fmt = float(boxed is not None)
        gold = str(item["ground_truth"])
        gold = gold if "\\boxed" in gold or "$" in gold else f"${gold}$"
        acc = float(boxed is not None and verify(parse(gold), parse(f"$\\boxed{{{boxed}}}$")))
        scores.append({"overall": 0.9 * acc + 0.1 * fmt, "accuracy": acc, "format": fmt})
    return scores


_FIRST_WORD = re.compile(r"[^A-Za-z]*([A-Za-z]+)")


@REWARDS.register("judge_yes_no")
def judge_yes_no(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Reads a judge's verdict (each input's ``judge``: the judge model's answer, with
    ``rollout.reward.judge``): 1.0 when its first word is ``yes``, 0.0 when it is ``no`` (any
    case). Any other answer raises: that sample's reward fails (counted, reported, not trained)
    instead of guessing."""
    scores = []
    for item in reward_inputs:
        verdict = str(item.get("judge", ""))
        word = m.group(1).lower() if (m := _FIRST_WORD.match(verdict)) else ""
        if word not in ("yes", "no"):
            raise ValueError(f"the judge's answer {verdict[:80]!r} starts with neither yes nor no")
        scores.append({"overall": float(word == "yes")})
    return scores
