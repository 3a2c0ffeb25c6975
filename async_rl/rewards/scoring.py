"""Scoring rollouts safely: a reward function that raises, hangs or crashes never stops a run.

:class:`RewardScorer` sends each batch (a rollout group) to the
:class:`~async_rl.rewards.pool.RewardPool` as one call, and only the inputs the function
fails on get an error:

* ``type: sequential``: the worker calls and times the function input by input, so each
  input's outcome comes back on its own (a hang costs ``timeout_s`` once);
* ``type: batch``: a call that raises, times out, kills its process or returns the wrong
  number of outputs is rescored one input per call, all at once in the pool, so only the
  failing inputs get the error (the function then sees 1-element lists); an output that is
  unusable (no ``overall``, not finite) fails its own input only.

A sample whose reward failed gets reward 0.0 and carries a :class:`~async_rl.records.Failure`
(``Score.failure``: kind ``reward_error`` or ``reward_timeout``, the error, the start of
the response, the child's traceback and the user's file and line); no substitute reward
ever reaches training, which is why there is no fallback reward setting. Each distinct
error is logged once with its traceback; every failure is counted. DAPO's overlong penalty
and dynamic-sampling filter live here too, since they are functions of the scores alone.
:func:`check_reward_function` is the start-up probe.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from async_rl.records import Failure
from async_rl.rewards.pool import RewardError, RewardPool, RewardTimeout

if TYPE_CHECKING:
    from async_rl.config import OverlongPenaltyConfig, RewardConfig

log = logging.getLogger(__name__)

PROBE_ANSWERS = 4
"""Ground-truth answers the start-up probe uses (each with three responses: itself, empty, a wrong one)."""
WRONG_RESPONSE = "no answer"
"""The probe's wrong response when no other ground truth differs from the one probed."""


@dataclass
class Score:
    """The reward of one sample."""

    reward: float
    """Scalar reward used for training (``overall``, plus the overlong penalty); 0.0 when ``failure`` is set."""
    components: dict[str, float] = field(default_factory=dict)
    """Named components the function returned (and ``overlong_penalty`` when applied)."""
    failure: Failure | None = None
    """Why scoring failed for this sample (the sample is then not trained), or None."""

    @property
    def correct(self) -> bool:
        """Whether validation counts the sample as solved: its ``accuracy`` component, or the
        reward when there is none, is at least 0.5 (``math``'s reward is 0.9 * accuracy + 0.1 *
        format: a well-formatted wrong answer is not solved)."""
        return self.components.get("accuracy", self.reward) >= 0.5


@dataclass
class RewardCounters:
    """Cumulative counts, for metrics (in samples unless stated)."""

    scored: int = 0
    """Samples scored (successfully or not)."""
    errors: int = 0
    """Samples whose scoring failed: the function raised, timed out, its process died, or the output was unusable."""
    timeouts: int = 0
    """Samples among ``errors`` on which the function ran longer than ``rollout.reward.timeout_s``
    (interrupted in its process, or its process group killed: see ``RewardPool.interrupted``, ``RewardPool.killed``)."""
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
            return await self._call(inputs)
        except RewardError as exc:  # a batch call failed as a whole: find the inputs it failed on
            if len(inputs) == 1:
                return [exc]
            return await self.attempt_each(inputs)

    async def attempt_each(self, inputs: list[dict[str, Any]]) -> list[Outcome]:
        """:meth:`attempt` with one pool call per input, all at once (the pool grows while they wait)."""
        return [outcome for outcomes in await asyncio.gather(*(self.attempt([item]) for item in inputs)) for outcome in outcomes]

    async def _call(self, inputs: list[dict[str, Any]]) -> list[Outcome]:
        """One pool call: each input's outcome; a :class:`RewardError` raised for a batch call that failed as a whole."""
        outputs = await self.pool.call(inputs)
        if self.cfg.type == "sequential":  # one entry per input, errors included
            return [out if isinstance(out, RewardError) else _outcome(out) for out in outputs]
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise RewardOutputError(f"reward function returned {type(outputs).__name__} of length {_len(outputs)}; "
                                    f"expected a list of {len(inputs)} dicts")
        return [_outcome(out) for out in outputs]

    def _failure(self, exc: RewardError, item: dict[str, Any]) -> Score:
        signature = exc.signature
        self.counters.errors += 1
        self.counters.timeouts += isinstance(exc, RewardTimeout)
        if signature not in self._seen_errors:
            self.counters.distinct_errors += 1
            log.warning("reward function failed (%s)%s; the sample carries the error and is not trained. Logged once:\n%s",
                        signature, f" at {exc.where}" if exc.where else "", exc.traceback_text or signature)
        self._seen_errors[signature] += 1
        kind = "reward_timeout" if isinstance(exc, RewardTimeout) else "reward_error"
        return Score(0.0, {}, Failure(kind, signature[:500], where=exc.where, input=str(item.get("response", ""))[:200],
                                      traceback=exc.traceback_text))

    def _apply_overlong(self, score: Score, length: int) -> None:
        apply_overlong(score, length, self.cfg.overlong_penalty, self.max_response_length)

    def keep_group(self, rewards: list[float]) -> bool:
        """DAPO dynamic sampling: False (and counted) when all rewards of a group are equal."""
        if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-9:
            self.counters.groups_filtered += 1
            return False
        return True


def apply_overlong(score: Score, length: int, o: OverlongPenaltyConfig, max_response_length: int) -> None:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13) added to ``score`` in place
    (``overlong_penalty`` among its components); lengths in tokens."""
    if not o.enable or o.buffer_length <= 0 or score.failure is not None:
        return
    start = max_response_length - o.buffer_length
    if length > start:
        penalty = -min(length - start, o.buffer_length) / o.buffer_length * o.penalty_factor
        score.components["overlong_penalty"] = penalty
        score.reward += penalty


async def check_reward_function(scorer: RewardScorer, answers: list[str]) -> None:
    """Start-up probe: for each of up to :data:`PROBE_ANSWERS` of ``answers`` (ground
    truths), score three responses: the ground truth itself, an empty one and a wrong one
    (another ground truth, or :data:`WRONG_RESPONSE`), each in a call of its own, all at
    once (a hang costs ``timeout_s`` once).

    Returns as soon as one input scores (the calls still running are cancelled, so a
    function that hangs on some inputs costs no start-up time). Raises :class:`RewardStartupError` if every input
    fails (raised, timed out, died, unusable output), naming each input and its error, with
    a hint and the reward process's traceback of each distinct error.
    """
    truths = [str(a) for a in answers[:PROBE_ANSWERS]] or [""]
    probe: list[dict[str, Any]] = []
    for i, truth in enumerate(truths):
        wrong = next((a for a in truths[i + 1:] + truths[:i] if a != truth), WRONG_RESPONSE if truth != WRONG_RESPONSE else "0")
        for response in dict.fromkeys((truth, "", wrong)):
            item = {"response": response, "response_length": min(len(response), scorer.max_response_length), "ground_truth": truth}
            if item not in probe:
                probe.append(item)
    calls = [asyncio.ensure_future(scorer.attempt([item])) for item in probe]
    try:
        for finished in asyncio.as_completed(calls):
            if not isinstance((await finished)[0], RewardError):
                return
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    errors = [o for call in calls if isinstance(o := call.result()[0], RewardError)]  # every one, by now
    cfg = scorer.cfg
    lines = [f"  response {item['response']!r:.60} for ground truth {item['ground_truth']!r:.60}: {exc.signature:.300}"
             + (f" (at {exc.where})" if exc.where else "") for item, exc in zip(probe, errors)]
    distinct = list({exc.signature: exc for exc in errors}.values())
    hints = list(dict.fromkeys(h for h in (_hint(exc, cfg) for exc in distinct) if h))
    tracebacks = [f"Traceback in the reward process ({exc.signature:.200}):\n{exc.traceback_text}" for exc in distinct if exc.traceback_text]
    raise RewardStartupError(
        f"rollout.reward.function={cfg.function} (type={cfg.type}) failed on all {len(probe)} start-up probe inputs "
        "(each ground-truth answer as the response, an empty response and a wrong one):\n"
        + "\n".join(lines) + "\n"
        + "".join(f"Hint: {hint}\n" for hint in hints)
        + "\n".join(tracebacks)
    )


def _hint(exc: RewardError, cfg: RewardConfig) -> str:
    sig = exc.signature
    if isinstance(exc, RewardTimeout):
        return (f"the function ran longer than rollout.reward.timeout_s={cfg.timeout_s:g} s on one input"
                + (f" (interrupted at {exc.where})" if exc.where else "") + "; raise it if it is slow, or find the hang")
    if sig.startswith("TypeError:") and ("keyword argument" in sig or "positional argument" in sig):
        return (f"the function's parameters do not match the call fn({'batch' if cfg.type == 'batch' else 'sample'}, "
                f"**rollout.reward.kwargs) with kwargs={dict(cfg.kwargs)}: pass the missing arguments "
                "(or drop the unexpected ones) with rollout.reward.kwargs")
    if sig.startswith("TypeError:") and "indices must be integers" in sig:
        return ("the function indexes its input the other way: check rollout.reward.type "
                "(batch gets a list of dicts, sequential one dict)")
    return ""


def _outcome(out: Any) -> Outcome:
    try:
        return score_output(out)
    except RewardOutputError as exc:
        return exc


def score_output(out: Any) -> Score:
    """One output of a reward function (a dict with ``overall`` and named components) as a
    :class:`Score`; raises :class:`RewardOutputError` when it is unusable (no ``overall``, a
    value that is not a number, a non-finite ``overall``)."""
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
