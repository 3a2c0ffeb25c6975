"""How long a run still needs: measured step, validation and checkpoint times at their cadence.

A run's remaining time is not steps left x mean step time. Periodic validations run on the
inference servers while the learner trains and slow the steps they overlap (rollouts compete
with validation for the engine); the last validation runs alone after the last step;
checkpoints stop the learner at ``trainer.save_every`` and once more at the end. The model
measures each of these from what the driver logs and adds them up:

    remaining = steps left x mean step time (outside validations and checkpoints)
              + periodic validations left x their measured slowdown of training
              + checkpoints left x measured checkpoint time
              + the final validation's duration (measured on the first, which also runs alone)

Pure logic, fed with times (seconds, any monotonic clock) by :class:`~async_rl.launch.tracking.Tracker`.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW = 256
"""Recent step intervals (and validations) the model keeps: rates follow the run as it changes."""


@dataclass
class EtaModel:
    """Remaining wall time of a run of ``total_steps`` learner steps."""

    total_steps: int
    save_every: int
    """``trainer.save_every``: steps between checkpoints."""
    val_every: int
    """``trainer.val_every``: steps between validations (0: none)."""
    _last_step: tuple[int, float] | None = None
    _steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    """(end time, seconds without checkpoint) of recent step intervals."""
    _checkpoints: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    _validations: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=16))
    """(start, end) times of recent validations that ran while the learner trained."""
    _alone_s: float | None = None
    """Duration of the validation before the first step: as long as the last one, which also runs alone."""

    def step(self, version: int, now: float, checkpoint_s: float = 0.0) -> None:
        """The learner reached ``version`` at ``now``; ``checkpoint_s`` of that step saved a checkpoint.

        The first step only starts the clock (start-up is not a step's time)."""
        if checkpoint_s > 0:
            self._checkpoints.append(checkpoint_s)
        if self._last_step is not None and version > self._last_step[0]:
            per_step = (now - self._last_step[1] - checkpoint_s) / (version - self._last_step[0])
            self._steps.append((now, max(per_step, 0.0)))
        self._last_step = (version, now)

    def validation(self, end: float, seconds: float) -> None:
        """A validation of ``seconds`` ended at ``end``."""
        if self._last_step is None:  # before the first step: the servers did nothing else
            self._alone_s = seconds
        else:
            self._validations.append((end - seconds, end))

    def step_s(self) -> float | None:
        """Mean seconds per step outside validations, or None before two steps (the mean, not
        the median: the occasional slow step is part of what the remaining steps will take)."""
        if not self._steps:
            return None
        outside = [s for t, s in self._steps if not _within(t, self._validations)]
        return statistics.mean(outside or [s for _, s in self._steps])

    def validation_overhead_s(self, step_s: float) -> float:
        """Seconds a periodic validation adds to training: what the steps that ended while it
        ran took beyond ``step_s`` each, averaged over the validations measured (0 before one)."""
        oldest = self._steps[0][0] if self._steps else float("inf")
        measured = [(start, end) for start, end in self._validations if start >= oldest]
        if not measured:
            return 0.0
        extra = sum(s - step_s for t, s in self._steps if _within(t, measured))
        return max(extra, 0.0) / len(measured)

    def remaining_s(self, version: int) -> float | None:
        """Seconds until the run's last validation ends, from ``version``; None before two steps."""
        step_s = self.step_s()
        if step_s is None:
            return None
        done, total = version, self.total_steps
        left = max(total - done, 0)
        saves = _multiples(done, total, self.save_every) + (1 if total % self.save_every else 0)
        seconds = left * step_s + saves * (statistics.mean(self._checkpoints) if self._checkpoints else 0.0)
        if self.val_every and (self._validations or self._alone_s is not None):
            periodic = _multiples(done, total - 1, self.val_every)  # the last one runs alone: below
            seconds += periodic * self.validation_overhead_s(step_s)
            seconds += self._alone_s if self._alone_s is not None else statistics.mean(end - start for start, end in self._validations)
        return seconds


def _within(t: float, windows: Iterable[tuple[float, float]]) -> bool:
    """Whether time ``t`` falls in one of the (start, end) ``windows``."""
    return any(start <= t <= end for start, end in windows)


def _multiples(done: int, last: int, every: int) -> int:
    """How many multiples of ``every`` lie in ``(done, last]``."""
    return max(last // every - done // every, 0)
