"""Scoring rollouts safely: a reward function that raises never stops a run.

:class:`RewardScorer` calls the user's batch function; if the batch call raises, it
rescores item by item so that only the failing samples get the error and the fallback
reward. Each distinct error (exception type and message) is logged with its traceback
once; every failure is counted. DAPO's overlong penalty and dynamic-sampling filter live
here too, since they are functions of the scores alone.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from async_rl.rewards.registry import RewardFunction

log = logging.getLogger(__name__)


@dataclass
class Score:
    """The reward of one sample."""

    reward: float
    """Scalar reward used for training (``overall``, plus the overlong penalty)."""
    components: dict[str, float] = field(default_factory=dict)
    """Named components the function returned (and ``overlong_penalty`` when applied)."""
    error: str | None = None
    """``ExceptionType: message`` when the function failed for this sample."""


@dataclass
class RewardCounters:
    """Cumulative counts, for metrics."""

    scored: int = 0
    """Samples scored."""
    errors: int = 0
    """Samples whose reward function raised or returned something unusable."""
    distinct_errors: int = 0
    """Distinct error signatures seen (each logged once with its traceback)."""
    groups_filtered: int = 0
    """Groups dropped by dynamic sampling (all rewards equal)."""


class RewardScorer:
    """Wraps a reward function with error isolation, fallback and DAPO's overlong penalty.

    Args:
        fn: batch reward function (EasyR1 interface).
        fallback_reward: reward of a sample whose scoring failed.
        max_response_length: ``L_max`` in tokens, for the overlong penalty.
        overlong_buffer: ``L_cache`` in tokens; 0 disables the penalty.
        overlong_factor: penalty at the maximum length.
    """

    def __init__(
        self,
        fn: RewardFunction,
        fallback_reward: float = 0.0,
        max_response_length: int = 0,
        overlong_buffer: int = 0,
        overlong_factor: float = 1.0,
    ):
        self.fn = fn
        self.fallback_reward = fallback_reward
        self.max_response_length = max_response_length
        self.overlong_buffer = overlong_buffer
        self.overlong_factor = overlong_factor
        self.counters = RewardCounters()
        self._seen_errors: Counter[str] = Counter()

    def score(self, inputs: list[dict[str, Any]]) -> list[Score]:
        """Score a batch; ``inputs`` have ``response``, ``response_length``, ``ground_truth``."""
        try:
            scores = self._call(inputs)
        except Exception:  # noqa: BLE001 - rescore one by one to isolate the failing samples
            scores = []
            for item in inputs:
                try:
                    scores.extend(self._call([item]))
                except Exception as exc:  # noqa: BLE001 - a reward bug must not stop the run
                    scores.append(self._failure(exc))
        self.counters.scored += len(inputs)
        for item, s in zip(inputs, scores):
            self._apply_overlong(s, int(item["response_length"]))
        return scores

    def _call(self, inputs: list[dict[str, Any]]) -> list[Score]:
        outputs = self.fn(inputs)
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise ValueError(f"reward function returned {type(outputs).__name__} of length {_len(outputs)}; expected a list of {len(inputs)} dicts")
        return [self._validate(out) for out in outputs]

    def _validate(self, out: Any) -> Score:
        if not isinstance(out, dict) or "overall" not in out:
            raise ValueError(f"reward function output {out!r:.80} is not a dict with key 'overall'")
        overall = float(out["overall"])
        if not math.isfinite(overall):
            raise ValueError(f"reward function returned a non-finite overall reward {overall}")
        components = {k: float(v) for k, v in out.items() if k != "overall"}
        return Score(overall, components)

    def _failure(self, exc: Exception) -> Score:
        signature = f"{type(exc).__name__}: {exc}"
        self.counters.errors += 1
        if signature not in self._seen_errors:
            self.counters.distinct_errors += 1
            log.warning("reward function failed (%s); using fallback reward %s. Logged once:\n%s",
                        signature, self.fallback_reward, "".join(traceback.format_exception(exc)))
        self._seen_errors[signature] += 1
        return Score(self.fallback_reward, {}, signature[:500])

    def _apply_overlong(self, score: Score, length: int) -> None:
        """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13)."""
        if self.overlong_buffer <= 0 or score.error is not None:
            return
        start = self.max_response_length - self.overlong_buffer
        if length > start:
            penalty = -min(length - start, self.overlong_buffer) / self.overlong_buffer * self.overlong_factor
            score.components["overlong_penalty"] = penalty
            score.reward += penalty

    def keep_group(self, rewards: list[float]) -> bool:
        """DAPO dynamic sampling: False (and counted) when all rewards of a group are equal."""
        if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-9:
            self.counters.groups_filtered += 1
            return False
        return True


def _len(obj: Any) -> str:
    return str(len(obj)) if hasattr(obj, "__len__") else "n/a"
