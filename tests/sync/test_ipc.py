"""Shared-memory segments of the ipc hand-off: a real segment, mapped by another process."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from async_rl.sync import ipc
from async_rl.sync.buckets import plan_buckets, tensor_specs
from async_rl.sync.ipc import IpcUnavailable, ShmReader, ShmSource, ShmWriter


def _read_in_child(source: ShmSource, buckets, out) -> None:
    reader = ShmReader()
    out.put([bytes(view[:16].tolist()) for view in reader.buckets(source, buckets)])
    reader.close()


def _buckets(nbytes: list[int]):
    specs = tensor_specs([(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(nbytes)])
    return plan_buckets(specs, 2**20, solo_bytes=1)


def test_another_process_reads_what_the_writer_packed_and_the_segment_is_reused():
    buckets = _buckets([64, 4096, 100])
    writer = ShmWriter()
    try:
        source = writer.prepare(buckets)
        assert source.offsets == (0, 64, 64 + 4096) and source.nbytes == 64 + 4096 + 100
        for i, bucket in enumerate(buckets):
            writer.bucket(source, i, bucket.nbytes).fill_(i + 1)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(source, buckets, out))
        child.start()
        assert out.get(timeout=60) == [bytes([i + 1] * 16) for i in range(3)]
        child.join(60)
        assert child.exitcode == 0
        # The reader's exit did not remove the sender's segment, and a smaller update reuses it.
        assert os.path.exists(f"{ipc.SHM_DIR}/{source.name}")
        assert writer.prepare(_buckets([32])).name == source.name
        # A larger one gets a new segment; the old one is unlinked.
        bigger = writer.prepare(_buckets([10_000]))
        assert bigger.name != source.name and not os.path.exists(f"{ipc.SHM_DIR}/{source.name}")
    finally:
        writer.close()
    assert not os.path.exists(f"{ipc.SHM_DIR}/{bigger.name}")


def test_too_little_shared_memory_is_refused_before_writing(monkeypatch):
    monkeypatch.setattr(ipc.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    with pytest.raises(IpcUnavailable, match="1000|MiB free"):
        ShmWriter().prepare(_buckets([4096]))


def test_a_missing_segment_is_reported():
    with pytest.raises(IpcUnavailable, match="cannot map"):
        ShmReader().buckets(ShmSource("asyncrl-no-such-segment", (0,), 8), _buckets([8]))
