"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import datetime
import os
import uuid
from collections.abc import Iterator

import pytest
import lanes
import resource_markers
import torch
import torch.distributed as dist

from async_rl.learner.model import DistInfo
from async_rl.queue import EmbeddedRedis
from async_rl.tiny import TinyAssetsReport, build_tiny_assets
from async_rl.tiny.cache import cached_tiny_assets


@pytest.fixture(scope="session")
def tiny_assets() -> TinyAssetsReport:
    """The tiny assets (tokenizer, warm-started Qwen2, addition train/val JSONL) with seed 0,
    from the cache of :mod:`async_rl.tiny.cache` (a build of about a minute on 2 cores when
    the builder's sources changed). Read-only: other tests and later sessions share them."""
    return cached_tiny_assets("addition", 0, lambda out: build_tiny_assets(out, seed=0))


@pytest.fixture(scope="session")
def tiny_vlm_assets() -> TinyAssetsReport:
    """The tiny vision-language assets (Idefics3 model and processor, coloured-square
    train/val JSONL with PNG data URIs) with seed 0, cached like ``tiny_assets`` (a build of
    about 15 s on one core). Read-only."""
    return cached_tiny_assets("vlm", 0, lambda out: build_tiny_assets(out, seed=0, task="vlm"))


@pytest.fixture(scope="session")
def one_rank() -> Iterator[DistInfo]:
    """A gloo process group of one rank in the test process (FSDP2 needs a process group)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield DistInfo(0, 1, torch.device("cpu"))
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (with password) of the one redis-server the session shares: tests keep apart by run
    name (:func:`run`). A test that kills, pauses or fills its server starts its own."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def run() -> str:
    """A run name of its own, so every test sees fresh keys."""
    return f"test-{uuid.uuid4().hex[:12]}"


def pytest_configure(config: pytest.Config) -> None:
    """What each test starts, checked against its markers (tests/resource_markers.py)."""
    config.pluginmanager.register(resource_markers.MarkerPlugin(), "resource-markers")
    lane = lanes.plugin()
    if lane is not None:  # a lane of scripts/test.sh: its tail shared with the other lane (tests/lanes.py)
        config.pluginmanager.register(lane, "lanes")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n N``), the longest modules first (tests/durations.json), each
    module's tests in their order, so no long module starts last; in one process, file order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    order = {m: i for i, m in enumerate(resource_markers.longest_first([item.nodeid.partition("::")[0] for item in items]))}
    items.sort(key=lambda item: order[item.nodeid.partition("::")[0]])
