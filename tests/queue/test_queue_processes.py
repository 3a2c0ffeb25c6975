"""Many real processes on one real redis-server: back-pressure, admission, crashes."""

from __future__ import annotations

import os
import queue as stdlib_queue
import signal
import time
from collections import Counter
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
from queue_workers import SPAWN, admit, consume, draw_prompts, make_group, produce, take_and_hang

from async_rl.queue import ReplayQueue

pytestmark = [pytest.mark.integration, pytest.mark.redis]


def _start(target: Any, *args: Any) -> BaseProcess:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _join_all(procs: list[BaseProcess], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"


def _drain(results: Any, count: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    return [results.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(count)]


def test_put_blocks_at_max_depth_until_the_learner_consumes(redis_url: str, run: str) -> None:
    done = SPAWN.Queue()
    producer = _start(produce, redis_url, run, range(7), done, 4)
    assert _drain(done, 4, 30.0) == ["g0", "g1", "g2", "g3"]
    with pytest.raises(stdlib_queue.Empty):
        done.get(timeout=0.5)  # the fifth put is blocked
    with ReplayQueue(redis_url, run) as learner:
        assert learner.stats()["depth"] == 4
        assert len(learner.get(3, timeout=5.0)) == 3
        assert _drain(done, 3, 10.0) == ["g4", "g5", "g6"]
        _join_all([producer])
        assert learner.stats()["depth"] == 4


def test_admission_is_exact_across_four_producers(redis_url: str, run: str) -> None:
    batch_size, max_staleness = 8, 1
    with ReplayQueue(redis_url, run) as q:
        # v=2 allows (2 + 1 + 1) * 8 = 32 groups; publishing v=3 allows 8 more.
        for version, expected in ((2, 32), (3, 8)):
            q.publish_version(version)
            go, admitted = SPAWN.Event(), SPAWN.Queue()
            procs = [_start(admit, redis_url, run, batch_size, max_staleness, go, admitted)
                     for _ in range(4)]
            go.set()
            assert sum(_drain(admitted, 4, 60.0)) == expected
            _join_all(procs)
        assert q.stats()["groups_started"] == 40


def test_dataset_cursor_has_no_duplicates_or_gaps(redis_url: str, run: str) -> None:
    go, drawn = SPAWN.Event(), SPAWN.Queue()
    procs = [_start(draw_prompts, redis_url, run, 1000, go, drawn) for _ in range(3)]
    go.set()
    indices = [i for batch in _drain(drawn, 3, 60.0) for i in batch]
    _join_all(procs)
    assert sorted(indices) == list(range(3000))


def test_killed_consumer_entries_are_recovered_exactly(redis_url: str, run: str) -> None:
    with ReplayQueue(redis_url, run, claim_idle_s=0.5) as learner:
        for i in range(8):
            learner.put(make_group(i, run=run))
        taken_q = SPAWN.Queue()
        victim = _start(take_and_hang, redis_url, run, 5, taken_q)
        taken = _drain(taken_q, 1, 30.0)[0]
        assert len(taken) == 5
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10.0)
        assert victim.exitcode == -signal.SIGKILL

        untouched = learner.get(8, timeout=0.3)
        assert [g.group_id for _, g in untouched] == ["g5", "g6", "g7"]
        assert learner.recover() == []  # younger than claim_idle_s: could be a live consumer
        time.sleep(0.6)
        recovered = learner.recover()
        assert [entry_id for entry_id, _ in recovered] == taken
        assert [g.group_id for _, g in recovered] == ["g0", "g1", "g2", "g3", "g4"]

        assert learner.recover() == []  # its own pending entries are not "recovered"
        again = learner.recover(include_own=True)  # ...unless asked, as after a restart
        assert sorted(entry_id for entry_id, _ in again) == sorted(
            entry_id for entry_id, _ in recovered + untouched
        )
        learner.commit(entry_id for entry_id, _ in again)
        time.sleep(0.6)
        assert learner.recover(include_own=True) == []
        assert learner.get(1, timeout=0.2) == []
        stats = learner.stats()
        assert (stats["depth"], stats["pending"]) == (0, 0)


def test_four_producers_two_consumers_exactly_once(redis_url: str, run: str) -> None:
    per_producer, producers = 2000, 4
    total = per_producer * producers
    done, committed, stop = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
    consumers = [_start(consume, redis_url, run, 32, committed, stop) for _ in range(2)]
    procs = [
        _start(produce, redis_url, run, range(p * per_producer, (p + 1) * per_producer), done, 64)
        for p in range(producers)
    ]
    assert len(_drain(done, total, 120.0)) == total
    seen = Counter(_drain(committed, total, 60.0))
    stop.set()
    _join_all(procs + consumers)
    assert seen == Counter(f"g{i}" for i in range(total))
    with pytest.raises(stdlib_queue.Empty):
        committed.get(timeout=0.1)
    with ReplayQueue(redis_url, run) as q:
        stats = q.stats()
    assert (stats["depth"], stats["pending"], stats["dead_lettered"]) == (0, 0, 0)
