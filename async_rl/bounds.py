"""Declared ranges of numeric dataclass fields, and the one check that reads them.

A numeric field states its range beside its default, where it is declared::

    eps: float = bounded(1e-6, gt=0)
    seed: int = unbounded(1, "random.Random takes every int")

:func:`bound_problems` walks a dataclass instance (nested ones included) and returns one
message per number outside its field's :class:`Bound`, naming the dotted key, the value and
the range; NaN and infinities are outside every range. The config (``config.validate``) and
the policy loss's options (``algos.options.LossOptions``) both check through it, so each
range is written once, and ``async-rl config docs`` prints it.

Imports nothing of async_rl: ``algos.options`` and ``config`` read it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

BOUND = "bound"
"""The key of a field's :class:`Bound` in its ``dataclasses.field`` metadata."""

T = TypeVar("T")


@dataclass(frozen=True)
class Bound:
    """The values a numeric field accepts: the finite numbers within the given limits (at most
    one lower, ``ge`` or ``gt``, and one upper, ``le`` or ``lt``), plus the ``also`` values (a
    sentinel such as -1 for "off"). A field without limits says why in ``unbounded``; every
    value must still be finite. A null of an ``Optional`` field is always accepted."""

    ge: float | None = None
    """Smallest value accepted (inclusive)."""
    gt: float | None = None
    """Values must be above this one (exclusive)."""
    le: float | None = None
    """Largest value accepted (inclusive)."""
    lt: float | None = None
    """Values must be below this one (exclusive)."""
    also: tuple[float, ...] = ()
    """Values accepted outside the limits."""
    unbounded: str = ""
    """Why the field has no limits (e.g. a seed: every int is one); empty when it has some."""

    def __post_init__(self) -> None:
        """Refuse a declaration that is contradictory or leaves the range unexplained (a bug
        in the declaring module, so ``ValueError`` at import)."""
        if (self.ge is not None and self.gt is not None) or (self.le is not None and self.lt is not None):
            raise ValueError(f"{self!r}: give at most one lower limit (ge or gt) and one upper limit (le or lt)")
        if any(x is not None for x in (self.ge, self.gt, self.le, self.lt)) == bool(self.unbounded):
            raise ValueError(f"{self!r}: give limits, or no limits and the reason in unbounded")

    def allows(self, value: Any) -> bool:
        """Whether ``value`` is a number in the range (NaN and infinities never are)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        """The range in words that follow "must be": ``in (0, 1]``, ``>= 1``, ``-1 or >= 1``, ``finite``."""
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if low and high:
            text = f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
        elif low:
            text = f"{'>=' if low[0] == '[' else '>'} {low[1]}"
        elif high:
            text = f"{'<=' if high[0] == ']' else '<'} {high[1]}"
        else:
            return "finite"
        return " or ".join([*(str(v) for v in self.also), text])


def bounded(default: T, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, also: tuple[float, ...] = ()) -> T:
    """A dataclass field with ``default`` whose values (each item, for a list) must lie in the
    range the limits give (see :class:`Bound`); a list default is copied for each instance."""
    metadata = {BOUND: Bound(ge=ge, gt=gt, le=le, lt=lt, also=also)}
    if isinstance(default, list):
        items = list(default)
        return field(default_factory=lambda: list(items), metadata=metadata)  # type: ignore[return-value]
    return field(default=default, metadata=metadata)


def unbounded(default: T, reason: str) -> T:
    """A numeric dataclass field with ``default`` and no limits, for ``reason``; its values must still be finite."""
    return field(default=default, metadata={BOUND: Bound(unbounded=reason)})


def bound_of(f: dataclasses.Field[Any]) -> Bound | None:
    """The :class:`Bound` declared on field ``f``, or None."""
    return f.metadata.get(BOUND)


def bound_problems(obj: Any, prefix: str = "") -> list[str]:
    """One message per number of the dataclass instance ``obj`` (nested dataclass values
    included) outside its field's bound, e.g. ``rollout.top_p=0.0 must be in (0, 1]``: the
    key is ``prefix`` + the field's dotted path (``[i]`` for a list's item)."""
    problems: list[str] = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            problems.extend(bound_problems(value, key + "."))
            continue
        if isinstance(value, dict) and all(dataclasses.is_dataclass(v) for v in value.values()):  # sections by name
            for name, section in value.items():
                problems.extend(bound_problems(section, f"{key}.{name}."))
            continue
        bound = bound_of(f)
        if bound is None or value is None:
            continue
        items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        null = " or null" if type(None) in typing.get_args(hints[f.name]) else ""
        problems.extend(f"{item_key}={v!r} must be {_wanted(bound, v)}{null}" for item_key, v in items if not bound.allows(v))
    return problems


def _wanted(bound: Bound, value: Any) -> str:
    """What a value that does not fit ``bound`` must be instead: its range, and what the value lacks."""
    rule = bound.describe()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "a finite number" if rule == "finite" else f"a number {rule}"
    if not math.isfinite(value) and rule != "finite":
        return f"finite and {rule}"
    return rule
