"""Shared-memory segments of the ipc hand-off: a real segment, mapped by another process."""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest
import torch

from async_rl.sync import ipc
from async_rl.sync.buckets import plan_buckets, tensor_specs
from async_rl.sync.ipc import IpcUnavailable, ShmReader, ShmSource, ShmWriter


def _read_in_child(source: ShmSource, buckets, out) -> None:
    reader = ShmReader()
    out.put([bytes(view[:16].tolist()) for view in reader.buckets(source, buckets)])
    reader.close()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _name(pid: int, token: str, namespace: int | None = None) -> str:
    """A segment name as the writer of process ``pid`` (in ``namespace``: default ours) makes it."""
    return f"{ipc.SHM_PREFIX}{pid}-{ipc._pid_namespace() if namespace is None else namespace}-{token}"


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


def test_segments_are_private_and_named_unguessably():
    writers = [ShmWriter(), ShmWriter()]
    try:
        names = [w.prepare(_buckets([64])).name for w in writers]
        prefix = f"{ipc.SHM_PREFIX}{os.getpid()}-{ipc._pid_namespace()}-"
        assert all(n.startswith(prefix) and len(n.removeprefix(prefix)) == 16 for n in names)  # 64 random bits each
        assert names[0] != names[1]
        assert all(os.stat(f"{ipc.SHM_DIR}/{n}").st_mode & 0o777 == 0o600 for n in names)
    finally:
        for w in writers:
            w.close()


def test_a_name_someone_else_holds_is_skipped_and_left_alone(monkeypatch):
    """A squatter on the next name (planted, or a collision) neither kills the writer nor is
    opened by it: the writer draws another name; a squatter on every name is IpcUnavailable."""
    squatter = Path(ipc.SHM_DIR) / _name(os.getpid(), "0" * 16)
    squatter.write_bytes(b"not yours")
    drawn = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(ipc.secrets, "token_hex", lambda nbytes: next(drawn))
    writer = ShmWriter()
    try:
        assert writer.prepare(_buckets([64])).name == _name(os.getpid(), "1" * 16)
        writer.close()
        monkeypatch.setattr(ipc.secrets, "token_hex", lambda nbytes: "0" * 16)
        with pytest.raises(IpcUnavailable, match="all taken"):
            writer.prepare(_buckets([64]))
        assert squatter.read_bytes() == b"not yours"
    finally:
        writer.close()
        squatter.unlink()


def _no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _no_map(*args, **kwargs) -> None:
    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))


@pytest.mark.parametrize(("target", "fail", "message"),
                         [("posix_fallocate", _no_space, "No space left"), ("SharedMemory", _no_map, "Cannot allocate memory")],
                         ids=["reserve", "map"])
def test_a_segment_that_cannot_be_reserved_or_mapped_is_ipc_unavailable_and_removed(monkeypatch, target, fail, message):
    """Filling ``/dev/shm`` between the free-space check and the write, or a failed mapping:
    IpcUnavailable (the sender's fallback to the group), and the new segment is gone."""
    ours = f"{ipc.SHM_PREFIX}{os.getpid()}-"
    before = {n for n in os.listdir(ipc.SHM_DIR) if n.startswith(ours)}
    monkeypatch.setattr(ipc.os if target == "posix_fallocate" else ipc.shared_memory, target, fail)
    with pytest.raises(IpcUnavailable, match=message):
        ShmWriter().prepare(_buckets([4096]))
    assert {n for n in os.listdir(ipc.SHM_DIR) if n.startswith(ours)} == before


def test_the_sweep_removes_dead_owners_segments_only(monkeypatch, tmp_path):
    """Real files in a stand-in for ``/dev/shm``: a dead owner's segment goes; a live owner's,
    one from another pid namespace (its pids are not ours to judge) and other names stay."""
    monkeypatch.setattr(ipc, "SHM_DIR", str(tmp_path))
    dead = _dead_pid()
    names = {
        "dead": _name(dead, "a" * 16),
        "live": _name(os.getpid(), "b" * 16),
        "parent": _name(os.getppid(), "c" * 16),
        "other namespace": _name(dead, "d" * 16, namespace=ipc._pid_namespace() + 1),
        "other name": f"{ipc.SHM_PREFIX}{dead}-0",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x" * 100)
    assert ipc.sweep_segments() == [f"removed {tmp_path / names['dead']} (0 MiB): its owner, process {dead}, is gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "dead")
    assert ipc.sweep_segments() == []
