"""The user's code failing, where the user looks: each distinct failure once on the console,
every failed sample in a file of the run directory.

Servers on every node report each sample their reward function or environment failed on to
the queue's failures stream (:meth:`~async_rl.queue.ReplayQueue.report_failures`); the
driver reads it about once a second and hands the reports to :class:`FailureLog`, which
appends each to ``reward_errors.jsonl`` or ``env_errors.jsonl`` and returns the console
lines: the first occurrence of each distinct failure (its kind, exception type and the
place in the user's code), at most :data:`CONSOLE_LINES_PER_MINUTE` a minute, then one line
saying how many were not shown.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from async_rl.appendlog import HeldLines
from async_rl.records import FailureReport

REWARD_FILE = "reward_errors.jsonl"
ENV_FILE = "env_errors.jsonl"
CONSOLE_LINES_PER_MINUTE = 5
"""New distinct failures printed on the console per minute at most (the files hold them all)."""

_WHOSE = {"reward_error": "the reward function raised", "reward_timeout": "the reward function timed out",
          "judge_error": "the judge (rollout.reward.judge) gave no answer", "teacher_error": "the teacher (algorithm.distill) gave no log-probs",
          "env_error": "the environment raised", "env_timeout": "an environment call timed out"}


def distinct_key(report: FailureReport) -> tuple[str, str, str]:
    """What makes two failures the same: kind, exception type and place in the user's code
    (the message when the place is unknown: it often holds the input, so it would make every
    failure look new)."""
    f = report.failure
    exc_type = f.signature.split(":", 1)[0]
    return f.kind, exc_type, f.where or f.signature


@dataclass
class FailureLog:
    """Files and console lines of a run's failure reports (the driver's, one per run).

    Args:
        run_dir: where ``reward_errors.jsonl`` and ``env_errors.jsonl`` are appended to.
        failed_samples: ``algorithm.failed_samples``, said in the console lines.
    """

    run_dir: Path
    failed_samples: str = "drop_sample"
    counts: Counter[str] = field(default_factory=Counter)
    """Reports read, by kind."""
    distinct: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """Reports read, by :func:`distinct_key`."""
    undecodable: int = 0
    """Stream entries that were not a failure report (skipped)."""
    _printed: list[float] = field(default_factory=list)
    _unshown: int = 0
    _files: dict[str, HeldLines] = field(default_factory=dict)
    """Each file's appender: rows a full disk refused are held and written with the next rows."""

    def ingest(self, reports: list[FailureReport], now: float) -> list[str]:
        """Append ``reports`` to their files; the console lines to print at ``now`` (monotonic seconds)."""
        new: list[FailureReport] = []
        by_file: dict[str, list[str]] = {}
        for r in reports:
            key = distinct_key(r)
            if key not in self.distinct:
                new.append(r)
            self.distinct[key] += 1
            self.counts[r.failure.kind] += 1
            name = ENV_FILE if r.failure.kind.startswith("env") else REWARD_FILE
            by_file.setdefault(name, []).append(json.dumps(_row(r)))
        lines: list[str] = []
        for name in sorted({*by_file, *(n for n, f in self._files.items() if f.held)}):
            out = self._files.setdefault(name, HeldLines(self.run_dir / name))
            was_failing = out.failing
            if (exc := out.write(by_file.get(name, []))) is not None and not was_failing:
                lines.append(f"{out.path} cannot be written ({exc}): its rows are held and written once the disk takes them again")
        self._printed = [t for t in self._printed if now - t < 60.0]
        if self._unshown and len(self._printed) < CONSOLE_LINES_PER_MINUTE:
            lines.append(f"{self._unshown} more distinct reward/environment failures were not shown; "
                         f"{self.run_dir / REWARD_FILE} and {self.run_dir / ENV_FILE} hold every one")
            self._printed.append(now)
            self._unshown = 0
        for r in new:
            if len(self._printed) < CONSOLE_LINES_PER_MINUTE:
                lines.append(self._line(r))
                self._printed.append(now)
            else:
                self._unshown += 1
        return lines

    def _line(self, r: FailureReport) -> str:
        f = r.failure
        kept = ("its group trains on its other samples" if self.failed_samples == "drop_sample"
                else "its group is not trained (algorithm.failed_samples=drop_group)")
        where = f" at {f.where}" if f.where else ""
        source = ENV_FILE if f.kind.startswith("env") else REWARD_FILE
        return (f"{_WHOSE[f.kind]} ({f.kind}){where}: {f.signature[:300]}; input {f.input[:120]!r} "
                f"({r.server_id}, group {r.group_id}, sample {r.sample}). The sample is not trained, {kept}; "
                f"every failure goes to {self.run_dir / source} (first of its kind shown here)")


def _row(r: FailureReport) -> dict[str, object]:
    f = r.failure
    return {"time": r.time, "kind": f.kind, "signature": f.signature, "where": f.where, "input": f.input,
            "server_id": r.server_id, "group_id": r.group_id, "sample": r.sample, "traceback": f.traceback}
