"""A run's identity at start (launch/run_state.py) with a real redis-server: the start-up checks
the driver calls, without starting a run."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from async_rl.config import Config, load_config, redact_url
from async_rl.launch.plan import make_plan
from async_rl.launch.run_state import (
    RUN_FILE,
    RunStateError,
    claim_run,
    make_private,
    read_dir,
    refusal,
    set_aside,
)
from async_rl.queue import ReplayQueue
from async_rl.queue.ownership import RunInUseError, RunOwnership, RunRecord
from async_rl.records import RolloutGroup, Sample


def _cfg(run_dir: Path, name: str, resume: str = "auto", *more: str) -> Config:
    return load_config(None, [f"trainer.output_dir={run_dir}", f"trainer.run_name={name}", f"trainer.resume={resume}", *more])


def _claim(url: str, cfg: Config, owner: str = "host-1", embedded: bool = False) -> str:
    """A start's checks, then its driver's end (the lease released)."""
    with RunOwnership(url, cfg.trainer.run_name) as ownership:
        run_id = claim_run(ownership, cfg, embedded=embedded, owner=owner)
        ownership.release()
    return run_id


def _group(name: str, index: int, version: int) -> RolloutGroup:
    return RolloutGroup.from_lists(name, f"g{index}", index, [3, 4], [Sample.from_lists([5, 6], [-0.5, -0.5], version, 1.0)], "srv", 0.0)


def _old_run(run_dir: Path) -> None:
    """What a finished run leaves in its output directory, beside the user's own files."""
    (run_dir / "checkpoints" / "step_00000012").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000012" / "state.json").write_text('{"version": 12}')
    (run_dir / "metrics.jsonl").write_text('{"version": 12}\n')
    (run_dir / "assets").mkdir()
    (run_dir / "assets" / "model.txt").write_text("the user's")


def test_resume_off_over_an_old_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    cfg = _cfg(run_dir, "refused", "off", f"data.train_files={data}")
    assert refusal(cfg) is None  # nothing there yet
    run_dir.mkdir()
    (run_dir / "resolved_config.yaml").write_text("{}")  # a start that failed before it ran: not a run
    assert refusal(cfg) is None
    _old_run(run_dir)
    problem = refusal(cfg)
    assert problem is not None and str(run_dir) in problem and "trainer.resume=fresh" in problem and "previous-" in problem
    assert problem in make_plan(cfg).errors  # what --dry-run and `async-rl train` print, before Redis or Ray start
    assert refusal(_cfg(run_dir, "refused", "auto")) is None


@pytest.mark.redis
def test_fresh_moves_the_old_run_aside_and_the_new_run_reads_none_of_its_groups(redis_url: str, tmp_path: Path) -> None:
    name, run_dir = f"fresh-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    run_dir.mkdir()
    old_id = _claim(redis_url, _cfg(run_dir, name))
    _old_run(run_dir)
    with ReplayQueue(redis_url, name) as queue:  # the old run left groups queued, newer than any new run's weights
        for i in range(3):
            queue.put(_group(name, i, version=12))
    assert read_dir(run_dir).run_id == old_id

    cfg = _cfg(run_dir, name, "fresh")
    aside = set_aside(cfg)
    assert aside == run_dir.resolve() / f"previous-{old_id}"
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "metrics.jsonl", RUN_FILE]  # moved, not deleted
    assert (run_dir / "assets" / "model.txt").read_text() == "the user's" and not (run_dir / "checkpoints").exists()
    new_id = _claim(redis_url, cfg)

    assert new_id != old_id and read_dir(run_dir).run_id == new_id
    with RunOwnership(redis_url, name) as ownership:
        assert ownership.record().run_id == new_id  # type: ignore[union-attr]
    with ReplayQueue(redis_url, name) as queue:
        assert queue.get(10, timeout=0.3) == [] and queue.stats()["prompt_cursor"] == 0  # none of the old groups
    with ReplayQueue(redis_url, f"{name}.previous-{old_id}") as old:
        assert [g.group_id for _, g in old.get(10, timeout=0.3)] == ["g0", "g1", "g2"]  # kept under the old id
    assert _claim(redis_url, _cfg(run_dir, name)) == new_id  # and it resumes as itself


@pytest.mark.redis
def test_two_runs_of_one_name_on_one_redis(redis_url: str, tmp_path: Path) -> None:
    name = f"shared-{uuid.uuid4().hex[:6]}"
    first, second = _cfg(tmp_path / "a", name), _cfg(tmp_path / "b", name)
    with RunOwnership(redis_url, name) as live:
        first_id = claim_run(live, first, embedded=False, owner="host-1")
        with pytest.raises(RunInUseError) as in_use:  # the first one runs
            _claim(redis_url, second, owner="host-2")
        message = str(in_use.value)
        assert f"trainer.run_name={name!r}" in message and redact_url(redis_url) in message and first_id in message
        assert "pick another trainer.run_name" in message
        with pytest.raises(RunInUseError):  # trainer.resume=fresh does not move a live run's queue aside
            _claim(redis_url, _cfg(tmp_path / "b", name, "fresh"), owner="host-2")
        live.release()  # the first one ended
    with pytest.raises(RunStateError) as other:  # its queue is still the first run's
        _claim(redis_url, second, owner="host-2")
    message = str(other.value)
    assert f"holds the queue of run {first_id} (output dir {(tmp_path / 'a').resolve()})" in message
    assert f"resume that run with trainer.output_dir={(tmp_path / 'a').resolve()}" in message and "another trainer.run_name" in message
    assert not (tmp_path / "b" / RUN_FILE).exists()  # a refused start leaves no run behind
    assert _claim(redis_url, first) == first_id  # the first one resumes


@pytest.mark.redis
def test_a_directory_and_a_queue_of_different_runs_are_refused(redis_url: str, tmp_path: Path) -> None:
    name, run_dir = f"mixed-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_FILE).write_text(json.dumps({"run_id": "run-x", "output_dir": str(run_dir), "host": "h", "started_at": 1.0}))
    with RunOwnership(redis_url, name) as ownership:
        ownership.set_record(RunRecord("run-y", str(run_dir.resolve()), "h", 2.0))
    with pytest.raises(RunStateError, match=f"holds the queue of run run-y .* but {run_dir.resolve()} holds run run-x"):
        _claim(redis_url, _cfg(run_dir, name))


@pytest.mark.redis
def test_resume_off_over_another_runs_queue_is_refused(redis_url: str, tmp_path: Path) -> None:
    name = f"leftover-{uuid.uuid4().hex[:6]}"
    with ReplayQueue(redis_url, name) as queue:  # a run without a run id (before they existed) left data
        queue.put(_group(name, 0, version=3))
    with pytest.raises(RunStateError, match="trainer.resume=off, but .* holds queue data of a run without a run id.*trainer.resume=fresh"):
        _claim(redis_url, _cfg(tmp_path / "run", name, "off"))
    with pytest.raises(RunStateError, match="holds no run"):  # trainer.resume=auto in an empty directory: not its data either
        _claim(redis_url, _cfg(tmp_path / "run", name))


@pytest.mark.redis
def test_a_run_from_before_run_ids_is_adopted_on_resume(redis_url: str, tmp_path: Path) -> None:
    name, run_dir = f"legacy-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    _old_run(run_dir)
    with ReplayQueue(redis_url, name) as queue:
        queue.put(_group(name, 0, version=3))
    run_id = _claim(redis_url, _cfg(run_dir, name))
    assert read_dir(run_dir).run_id == run_id
    with RunOwnership(redis_url, name) as ownership:
        assert ownership.record().run_id == run_id  # type: ignore[union-attr]
    with ReplayQueue(redis_url, name) as queue:
        assert queue.stats()["depth"] == 1  # its queue is untouched


def test_make_private_closes_the_runs_files_and_leaves_the_rest(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for path in (run_dir / "checkpoints" / "step_00000002", run_dir / "previous-old" / "redis", run_dir / "assets"):
        path.mkdir(parents=True)
    files = [run_dir / "metrics.jsonl", run_dir / "checkpoints" / "step_00000002" / "state.json",
             run_dir / "previous-old" / "redis" / "redis.conf", run_dir / "assets" / "train.jsonl"]
    for path in files:
        path.write_text("{}")
        path.chmod(0o644)
    for path in [run_dir, *(p for p in run_dir.rglob("*") if p.is_dir())]:
        path.chmod(0o755)
    make_private(run_dir)
    mode = {str(p.relative_to(run_dir)): p.stat().st_mode & 0o777 for p in [run_dir, *run_dir.rglob("*")]}
    assert mode == {
        ".": 0o700, "metrics.jsonl": 0o600,
        "checkpoints": 0o700, "checkpoints/step_00000002": 0o700, "checkpoints/step_00000002/state.json": 0o600,
        "previous-old": 0o700, "previous-old/redis": 0o700, "previous-old/redis/redis.conf": 0o600,
        "assets": 0o755, "assets/train.jsonl": 0o644,  # not the run's: the quickstart's assets live here
    }
