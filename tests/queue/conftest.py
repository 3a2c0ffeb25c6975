"""Fixtures for the replay-queue tests: one real redis-server per test session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from async_rl.queue import EmbeddedRedis, ReplayQueue


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (with password) of a redis-server shared by the session; runs keep tests apart."""
    data_dir: Path = tmp_path_factory.mktemp("redis")
    with EmbeddedRedis(data_dir) as url:
        yield url


@pytest.fixture
def run() -> str:
    """A run name of its own, so every test sees fresh keys."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def queue(redis_url: str, run: str) -> Iterator[ReplayQueue]:
    with ReplayQueue(redis_url, run, max_depth=64, claim_idle_s=0.3) as q:
        yield q
