"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from async_rl.learner.model import DistInfo
from async_rl.tiny import TinyAssetsReport, build_tiny_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssetsReport:
    """The tiny assets (tokenizer, warm-started Qwen2, addition train/val JSONL) built once
    per test session with seed 0 (about a minute on 2 cores). Treat the files as read-only:
    other test modules share them."""
    return build_tiny_assets(tmp_path_factory.mktemp("tiny_assets"), seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssetsReport:
    """The tiny vision-language assets (Idefics3 model and processor, coloured-square
    train/val JSONL with PNG data URIs) built once per test session with seed 0 (about 15 s
    on one core). Read-only, like ``tiny_assets``."""
    return build_tiny_assets(tmp_path_factory.mktemp("tiny_vlm_assets"), seed=0, task="vlm")


@pytest.fixture(scope="session")
def one_rank() -> Iterator[DistInfo]:
    """A gloo process group of one rank in the test process (FSDP2 needs a process group)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield DistInfo(0, 1, torch.device("cpu"))
    dist.destroy_process_group()
