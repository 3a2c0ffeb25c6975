"""Scoring rollouts safely: a reward function that raises, hangs or crashes never stops a run.

:class:`RewardScorer` sends each batch to the :class:`~async_rl.rewards.pool.RewardPool`
as one call. If the call raises (:class:`~async_rl.rewards.pool.RewardCallError`) or
returns something unusable, it rescores item by item (each its own pool call, with the
timeout) so that only the failing samples get the error; if the call timed out or its
process died, every sample of the call gets the error (retrying item by item would
multiply the hang).

A sample whose reward failed gets reward 0.0 and carries the error
(``Score.failure``, then ``Sample.error`` and ``Sample.error_kind``), and the learner drops
every group that holds such a sample (counted as ``dropped/reward_error``): no substitute
reward ever reaches training, which is why there is no fallback reward setting. Each
distinct error is logged once with its traceback; every failure is counted. DAPO's
overlong penalty and dynamic-sampling filter live here too, since they are functions of
the scores alone. :func:`check_reward_function` is the start-up probe.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from async_rl.records import Failure
from async_rl.rewards.pool import RewardCallError, RewardError, RewardPool, RewardTimeout

if TYPE_CHECKING:
    from async_rl.config import RewardConfig

log = logging.getLogger(__name__)

PROBE_SAMPLES = 4
"""Ground-truth answers the start-up probe scores (each with an empty response)."""


@dataclass
class Score:
    """The reward of one sample."""

    reward: float
    """Scalar reward used for training (``overall``, plus the overlong penalty); 0.0 when ``error`` is set."""
    components: dict[str, float] = field(default_factory=dict)
    """Named components the function returned (and ``overlong_penalty`` when applied)."""
    failure: Failure | None = None
    """Why scoring failed for this sample (the sample is then not trained), or None."""


@dataclass
class RewardCounters:
    """Cumulative counts, for metrics (in samples unless stated)."""

    scored: int = 0
    """Samples scored (successfully or not)."""
    errors: int = 0
    """Samples whose scoring failed: the function raised, timed out, its process died, or the output was unusable."""
    timeouts: int = 0
    """Samples among ``errors`` whose reward call exceeded ``rollout.reward.timeout_s``."""
    distinct_errors: int = 0
    """Distinct error signatures seen (each logged once with its traceback)."""
    groups_filtered: int = 0
    """Groups dropped by dynamic sampling (all rewards equal)."""


class RewardOutputError(RewardError):
    """The function returned something unusable (wrong length, no ``overall``, non-finite, not a number)."""


class RewardStartupError(RuntimeError):
    """The start-up probe failed on every sample; the message says why and how to fix it."""


Outcome = Union[Score, RewardError]
"""A sample's score, or why it has none."""


class RewardScorer:
    """Scores batches through a :class:`RewardPool`, with error isolation and DAPO's overlong penalty.

    Args:
        pool: a started reward pool (several scorers may share one).
        cfg: ``rollout.reward`` (overlong penalty settings).
        max_response_length: ``L_max`` in tokens, for the overlong penalty.
    """

    def __init__(self, pool: RewardPool, cfg: RewardConfig, max_response_length: int):
        self.pool = pool
        self.cfg = cfg
        self.max_response_length = max_response_length
        self.counters = RewardCounters()
        self._seen_errors: Counter[str] = Counter()

    async def score(self, inputs: list[dict[str, Any]]) -> list[Score]:
        """Score a batch; ``inputs`` have ``response``, ``response_length`` (tokens) and ``ground_truth``.

        Never raises for a failing reward function: failed samples get reward 0.0 and the error.
        """
        scores = [o if isinstance(o, Score) else self._failure(o, item) for o, item in zip(await self.attempt(inputs), inputs)]
        self.counters.scored += len(inputs)
        for item, s in zip(inputs, scores):
            self._apply_overlong(s, int(item["response_length"]))
        return scores

    async def attempt(self, inputs: list[dict[str, Any]]) -> list[Outcome]:
        """Each sample's :class:`Score` (before the overlong penalty) or its error; nothing counted or logged."""
        try:
            return list(await self._call(inputs))
        except (RewardCallError, RewardOutputError) as exc:
            if len(inputs) == 1:
                return [exc]
            return list(await asyncio.gather(*(self._attempt_one(item) for item in inputs)))
        except RewardError as exc:  # timeout or died: the same error for every sample of the call
            return [exc] * len(inputs)

    async def _attempt_one(self, item: dict[str, Any]) -> Outcome:
        try:
            return (await self._call([item]))[0]
        except RewardError as exc:
            return exc

    async def _call(self, inputs: list[dict[str, Any]]) -> list[Score]:
        outputs = await self.pool.call(inputs)
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise RewardOutputError(f"reward function returned {type(outputs).__name__} of length {_len(outputs)}; "
                                    f"expected a list of {len(inputs)} dicts")
        return [_validate(out) for out in outputs]

    def _failure(self, exc: RewardError, item: dict[str, Any]) -> Score:
        signature = exc.signature
        self.counters.errors += 1
        self.counters.timeouts += isinstance(exc, RewardTimeout)
        if signature not in self._seen_errors:
            self.counters.distinct_errors += 1
            log.warning("reward function failed (%s); the sample carries the error and its group is not trained. Logged once:\n%s",
                        signature, exc.traceback_text or signature)
        self._seen_errors[signature] += 1
        kind = "reward_timeout" if isinstance(exc, RewardTimeout) else "reward_error"
        return Score(0.0, {}, Failure(kind, signature[:500], input=str(item.get("response", ""))[:200], traceback=exc.traceback_text))

    def _apply_overlong(self, score: Score, length: int) -> None:
        """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13); lengths in tokens."""
        o = self.cfg.overlong_penalty
        if not o.enable or o.buffer_length <= 0 or score.failure is not None:
            return
        start = self.max_response_length - o.buffer_length
        if length > start:
            penalty = -min(length - start, o.buffer_length) / o.buffer_length * o.penalty_factor
            score.components["overlong_penalty"] = penalty
            score.reward += penalty

    def keep_group(self, rewards: list[float]) -> bool:
        """DAPO dynamic sampling: False (and counted) when all rewards of a group are equal."""
        if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-9:
            self.counters.groups_filtered += 1
            return False
        return True


async def check_reward_function(scorer: RewardScorer, answers: list[str]) -> None:
    """Start-up probe: score up to :data:`PROBE_SAMPLES` of ``answers`` (ground truths),
    each with an empty response (``""``, length 0).

    Returns if at least one sample scores. Raises :class:`RewardStartupError` if every
    sample fails (raised, timed out, died, unusable output), with the first failure's
    traceback from the reward process and a hint.
    """
    probe = [{"response": "", "response_length": 0, "ground_truth": a} for a in (answers[:PROBE_SAMPLES] or [""])]
    outcomes = await scorer.attempt(probe)
    errors = [o for o in outcomes if isinstance(o, RewardError)]
    if len(errors) < len(outcomes):
        return
    first = errors[0]
    cfg = scorer.cfg
    hint = _hint(first, cfg)
    raise RewardStartupError(
        f"rollout.reward.function={cfg.function} (type={cfg.type}) failed on all {len(probe)} start-up probe samples "
        f"(ground-truth answers with an empty response): {first.signature}\n"
        + (f"Hint: {hint}\n" if hint else "")
        + (f"Traceback in the reward process:\n{first.traceback_text}" if first.traceback_text else "")
    )


def _hint(exc: RewardError, cfg: RewardConfig) -> str:
    sig = exc.signature
    if isinstance(exc, RewardTimeout):
        return f"a call took longer than rollout.reward.timeout_s={cfg.timeout_s:g} s; raise it or find the hang"
    if sig.startswith("TypeError:") and ("keyword argument" in sig or "positional argument" in sig):
        return (f"the function's parameters do not match the call fn({'batch' if cfg.type == 'batch' else 'sample'}, "
                f"**rollout.reward.kwargs) with kwargs={dict(cfg.kwargs)}: pass the missing arguments "
                "(or drop the unexpected ones) with rollout.reward.kwargs")
    if sig.startswith("TypeError:") and "indices must be integers" in sig:
        return ("the function indexes its input the other way: check rollout.reward.type "
                "(batch gets a list of dicts, sequential one dict)")
    return ""


def _validate(out: Any) -> Score:
    if not isinstance(out, dict) or "overall" not in out:
        raise RewardOutputError(f"reward function output {out!r:.80} is not a dict with key 'overall'")
    try:
        overall = float(out["overall"])
        components = {str(k): float(v) for k, v in out.items() if k != "overall"}
    except (TypeError, ValueError) as exc:
        raise RewardOutputError(f"reward function output {out!r:.80} has a value that is not a number: {exc}") from None
    if not math.isfinite(overall):
        raise RewardOutputError(f"reward function returned a non-finite overall reward {overall}")
    return Score(overall, components)


def _len(obj: Any) -> str:
    return str(len(obj)) if hasattr(obj, "__len__") else "n/a"
