"""Tiny verifiable task: integer addition ("What is 47+385?" -> "432").

Why this task. It is verifiable by exact match, deterministic to generate, needs no
network, and its difficulty is a dial (operand digits) that a ~0.5M-parameter model
sits on the steep part of: the warm-start reaches the 10-60% greedy band in about a
minute of CPU SFT, and the same training continued keeps raising accuracy (see
``async_rl.tiny.text``), so the task is learnable and RL has room to show improvement instead
of facing either a solved task or one the model cannot learn at all.

Rows follow EasyR1's format: ``{"problem": str, "answer": str}`` (one JSON object per
line). ``is_correct`` judges a completion as strictly as the multi-turn environment
(``addition_feedback``, whose answer parsing and messages live with it in
:mod:`async_rl.envs.builtin`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from async_rl.envs.builtin import extract_answer


@dataclass(frozen=True)
class Row:
    """One task example in EasyR1's JSONL format."""

    problem: str
    answer: str

    def to_json(self) -> str:
        return json.dumps({"problem": self.problem, "answer": self.answer}, ensure_ascii=False)


@dataclass(frozen=True)
class AdditionTask:
    """Sums ``a + b`` with ``a`` of ``a_digits`` digits and ``b`` of ``b_digits`` digits
    (no leading zeros)."""

    a_digits: int = 2
    b_digits: int = 2

    def sample(self, rng: random.Random) -> Row:
        a = rng.randint(10 ** (self.a_digits - 1), 10**self.a_digits - 1)
        b = rng.randint(10 ** (self.b_digits - 1), 10**self.b_digits - 1)
        return Row(problem=f"What is {a}+{b}?", answer=str(a + b))

    @property
    def num_problems(self) -> int:
        """Number of distinct problems the task can produce."""
        return 9 * 10 ** (self.a_digits - 1) * 9 * 10 ** (self.b_digits - 1)


def make_splits(
    task: AdditionTask, seed: int, n_train: int, n_val: int
) -> tuple[list[Row], list[Row]]:
    """Draw ``n_train + n_val`` distinct problems with ``random.Random(seed)``; the
    first ``n_train`` are train, the rest validation, so the splits are disjoint. A larger
    ``n_val`` with the same seed and ``n_train`` extends the validation split: the same rows
    first, then new ones. ``task`` is any task with ``sample(rng) -> Row`` and
    ``num_problems`` (the running sum's too)."""
    if n_train + n_val > task.num_problems:
        raise ValueError(
            f"{n_train + n_val} problems requested; {task} has only {task.num_problems}"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[Row] = []
    while len(rows) < n_train + n_val:
        row = task.sample(rng)
        if row.problem not in seen:
            seen.add(row.problem)
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the completion's integer with the reference answer."""
    got = extract_answer(completion)
    return got is not None and got == answer.strip()


def write_jsonl(rows: Iterable[Row], path: Path) -> None:
    """Write rows as UTF-8 JSONL (one object per line, trailing newline)."""
    path.write_text("".join(row.to_json() + "\n" for row in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[Row]:
    """Read rows written by ``write_jsonl`` (or any JSONL with problem/answer)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            rows.append(Row(problem=str(obj["problem"]), answer=str(obj["answer"])))
    return rows
