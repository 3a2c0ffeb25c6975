"""Appending whole lines to a run's logs (JSONL files), or none of them.

A write into a full disk can land part of its bytes: a step's line cut after 595 characters,
and the line the restarted learner writes next joins it into one undecodable line (a full disk
in CI's live run did exactly this to ``learner_steps.jsonl``). :func:`append_lines` writes its
lines with one unbuffered ``write`` loop and, when one fails, truncates the file back to the
length it had, so a reader only ever sees whole lines: the ones before, or those and the new.
One writer per file (the file's owner) is assumed: a second appender's bytes could be cut off.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def append_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Append ``lines`` (each without its ``"\\n"``, which this adds) to ``path``, creating it;
    all of them or, when a write fails (``OSError``: ENOSPC, EFBIG, EIO), none: the file is
    cut back to its length before the call and the error raised for the caller to handle."""
    data = "".join(f"{line}\n" for line in lines).encode()
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start, written = os.fstat(fd).st_size, 0
        try:
            while written < len(data):  # a short write (the disk filled) is followed by one that raises
                written += os.write(fd, data[written:])
        except OSError:
            if written:
                os.ftruncate(fd, start)  # it frees space: it succeeds on a full disk
            raise
    finally:
        os.close(fd)


MAX_HELD_LINES = 100_000
"""Lines a :class:`HeldLines` keeps while its file takes none (about 100 MB of metrics at most;
past it the oldest go, counted): a disk full for the driver's 10 min wait holds a few thousand."""


class HeldLines:
    """One file's appender (its single writer) that loses no line to a failed write: the lines
    a write could not append are held, in order, and go first with the next write that
    succeeds. ``failing`` says whether the last write failed (for a caller that says so once)."""

    def __init__(self, path: str | Path, max_held: int = MAX_HELD_LINES) -> None:
        self.path = Path(path)
        self.max_held = max_held
        self.held: list[str] = []
        self.failing = False
        self.write_errors = 0
        """Writes that failed (each left its lines held)."""
        self.dropped = 0
        """Held lines given up (the oldest, past ``max_held``)."""

    def write(self, lines: Iterable[str]) -> OSError | None:
        """Append the held lines, then ``lines``; the error when that failed (all of them are then held)."""
        self.held.extend(lines)
        if len(self.held) > self.max_held:
            self.dropped += len(self.held) - self.max_held
            del self.held[: len(self.held) - self.max_held]
        try:
            append_lines(self.path, self.held)
        except OSError as exc:
            self.write_errors += 1
            self.failing = True
            return exc
        self.held.clear()
        self.failing = False
        return None
