"""The lanes of scripts/test.sh, seen from inside each lane's pytest (issue 43).

scripts/test.sh runs two pytest processes at once on a 2-core machine:

- lane ``stack``: the tests that start vLLM engines under Ray (markers ``vllm`` and ``ray``:
  whole ``async-rl train`` runs, pools of inference servers);
- lane ``rest``: everything else.

Two runs at once starve each other past a bound that a test asserts at default settings (a
hung engine replaced within 300 s, a full disk named within 10 s), so the ``timed`` ones (marker
``timed``) run only in lane ``stack``, one after another, while lane ``rest`` runs tests that
start no run. The other runs (the **tail**: ``vllm`` and ``ray`` and not ``timed``) have no
such bound; both lanes select them, after their own tests, and each is run by whichever lane
reaches it first (a claim file in ``$ASYNC_RL_TEST_TAIL``): so the two lanes end about
together, instead of lane ``stack`` running alone for the last quarter hour. Lane ``rest``
enters the tail only once lane ``stack`` has finished its timed tests (scripts/test.sh touches
``timed-done`` there when lane ``stack``'s timed part ends or the lane exits).

Without ``$ASYNC_RL_TEST_TAIL`` (a plain ``pytest``), nothing here changes what runs.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
import resource_markers

TAIL_ENV = "ASYNC_RL_TEST_TAIL"
"""A directory the two lanes share: claim files of tail tests, and ``timed-done``."""
LANE_ENV = "ASYNC_RL_TEST_LANE"
TIMED_DONE = "timed-done"
"""Touched in ``$ASYNC_RL_TEST_TAIL`` once lane stack's timed tests are over."""


def is_tail(item: pytest.Item) -> bool:
    """A whole run or a server pool with no wall-clock bound: either lane may run it."""
    names = {m.name for m in item.iter_markers()}
    return {"vllm", "ray"} <= names and "timed" not in names


def tail_last(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the lane's own tests in their order, then the tail, the
    longest first (tests/durations.json; unknown ones first), so that no long one starts last."""
    known = resource_markers.test_seconds()
    own = [i for i in items if not is_tail(i)]
    tail = sorted((i for i in items if is_tail(i)), key=lambda i: -known.get(i.nodeid, float("inf")))
    items[:] = own + tail


class LanePlugin:
    """Claims each tail test for this lane or leaves it to the other (registered by
    tests/conftest.py when ``$ASYNC_RL_TEST_TAIL`` is set)."""

    def __init__(self, shared: Path, lane: str) -> None:
        self.shared, self.lane = shared, lane
        self.ran: list[str] = []
        self.left: list[str] = []
        self.waited_s: float | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        tail_last(items)

    def _wait_for_timed(self) -> None:
        """Lane rest's first tail test waits until lane stack's timed tests are over."""
        if self.waited_s is not None or self.lane == "stack":
            self.waited_s = self.waited_s or 0.0
            return
        start = time.monotonic()
        while not (self.shared / TIMED_DONE).exists():
            time.sleep(0.5)
        self.waited_s = time.monotonic() - start

    def _claim(self, item: pytest.Item) -> bool:
        """True when this lane is the first to reach ``item`` (an exclusive create)."""
        name = hashlib.sha1(item.nodeid.encode()).hexdigest()[:16] + ".claim"
        try:
            fd = os.open(self.shared / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.lane} {item.nodeid}\n")
        return True

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not is_tail(item):
            return None
        if self.lane == "stack":
            (self.shared / TIMED_DONE).touch()  # every timed test ran (they come first)
        self._wait_for_timed()
        if self._claim(item):
            self.ran.append(item.nodeid)
            return None
        # The other lane runs it. Tear down what the previous test kept for this one, as its
        # own teardown would have (pytest's SetupState: the next test's setup expects it).
        item.session._setupstate.teardown_exact(nextitem)
        self.left.append(item.nodeid)
        return True

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        waited = f", after waiting {self.waited_s:.0f} s for lane stack's timed tests" if self.waited_s else ""
        write(f"lane {self.lane}: {len(self.ran)} tail tests run here{waited}; {len(self.left)} run by the other lane{':' if self.left else ''}")
        for nodeid in self.left:
            write(f"  {nodeid}")


def plugin() -> LanePlugin | None:
    """The plugin for a lane of scripts/test.sh, or None outside one."""
    shared = os.environ.get(TAIL_ENV)
    if not shared:
        return None
    return LanePlugin(Path(shared), os.environ.get(LANE_ENV, "?"))
