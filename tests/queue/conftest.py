"""Fixtures for the replay-queue tests (on the session's redis-server, ``redis_url`` and ``run`` in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from async_rl.queue import ReplayQueue


@pytest.fixture
def queue(redis_url: str, run: str) -> Iterator[ReplayQueue]:
    with ReplayQueue(redis_url, run, max_depth=64, claim_idle_s=0.3) as q:
        yield q
