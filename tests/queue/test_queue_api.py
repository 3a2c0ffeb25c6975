"""ReplayQueue against a real redis-server, one process: the API contract."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import redis
from queue_workers import make_group

from async_rl.queue import EmbeddedRedis, QueueUnavailableError, ReplayQueue
from async_rl.records import encode


def test_put_get_commit_round_trip(queue: ReplayQueue, run: str) -> None:
    groups = [make_group(i, run=run) for i in range(3)]
    ids = [queue.put(g) for g in groups]
    got = queue.get(3, timeout=5.0)
    assert [entry_id for entry_id, _ in got] == ids
    assert [group for _, group in got] == groups
    assert queue.stats()["pending"] == 3
    assert queue.commit(ids) == 3
    assert queue.commit(ids) == 0  # committing twice is harmless
    stats = queue.stats()
    assert (stats["depth"], stats["pending"]) == (0, 0)
    assert queue.get(1, timeout=0.2) == []


def test_get_returns_what_it_has_at_timeout(queue: ReplayQueue, run: str) -> None:
    queue.put(make_group(0, run=run))
    start = time.monotonic()
    got = queue.get(5, timeout=0.4)
    assert len(got) == 1
    assert time.monotonic() - start >= 0.4


def test_each_entry_goes_to_one_consumer(queue: ReplayQueue, redis_url: str, run: str) -> None:
    for i in range(4):
        queue.put(make_group(i, run=run))
    with ReplayQueue(redis_url, run) as other:
        mine = queue.get(2, timeout=1.0)
        theirs = other.get(10, timeout=0.3)
    assert len(mine) == 2 and len(theirs) == 2
    assert {g.group_id for _, g in mine}.isdisjoint(g.group_id for _, g in theirs)


def test_undecodable_entries_are_dead_lettered(
    queue: ReplayQueue, redis_url: str, run: str
) -> None:
    raw = redis.Redis.from_url(redis_url)
    bad = {
        b"\xc1garbage": "garbage",
        msgspec.msgpack.encode({"schema": "rollout_group.v0", "run_id": run}): "wrong schema",
    }
    queue.put(make_group(0, run=run))
    for payload in bad:
        raw.xadd(queue.keys.rollouts, {"group": payload})
    raw.xadd(queue.keys.rollouts, {"other": b"x"})  # no payload field at all
    queue.put(make_group(1, run=run))

    got = queue.get(4, timeout=0.5)

    assert [g.group_id for _, g in got] == ["g0", "g1"]
    dead: Any = raw.xrange(queue.keys.dead)
    assert [fields[b"raw"] for _, fields in dead] == [*bad, b""]
    assert all(fields[b"reason"] for _, fields in dead)
    assert b"no 'group' field" in dead[2][1][b"reason"]
    stats = queue.stats()
    assert stats["dead_lettered"] == 3
    assert stats["pending"] == 2  # dead-lettered entries are acknowledged, not pending
    raw.close()


def test_stale_groups_are_dropped_counted_and_acknowledged(queue: ReplayQueue, run: str) -> None:
    queue.publish_version(5)
    for i, version in enumerate([5, 4, 3, 1, 0]):
        queue.put(make_group(i, version=version, run=run))

    got = queue.get(5, max_staleness=2, timeout=0.5)

    assert [g.behaviour_version for _, g in got] == [5, 4, 3]
    stats = queue.stats()
    assert stats["dropped_stale"] == 2
    assert stats["staleness_histogram"] == {0: 1, 1: 1, 2: 1, 4: 1, 5: 1}
    assert stats["pending"] == 3
    assert {g.group_id for _, g in queue.recover(include_own=True)} == {"g0", "g1", "g2"}


def test_put_blocks_at_max_depth_then_times_out(redis_url: str, run: str) -> None:
    with ReplayQueue(redis_url, run, max_depth=2) as q:
        q.put(make_group(0, run=run))
        q.put(make_group(1, run=run))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="max_depth=2"):
            q.put(make_group(2, run=run), timeout=0.5)
        assert time.monotonic() - start >= 0.5
        assert q.stats()["depth"] == 2
        q.get(1, timeout=1.0)  # reading frees a slot even before the commit
        q.put(make_group(2, run=run), timeout=0.5)
        assert q.stats()["depth"] == 2


def test_admission_rule_single_producer(queue: ReplayQueue) -> None:
    admitted = sum(queue.try_admit(batch_size=4, max_staleness=1) for _ in range(20))
    assert admitted == (0 + 1 + 1) * 4
    queue.publish_version(2)
    admitted = sum(queue.try_admit(batch_size=4, max_staleness=1) for _ in range(20))
    assert admitted == 2 * 4
    assert queue.stats()["groups_started"] == 16
    with pytest.raises(ValueError):
        queue.publish_version(-1)


def test_released_and_dropped_groups_give_admission_slots_back(queue: ReplayQueue, run: str) -> None:
    assert sum(queue.try_admit(batch_size=2, max_staleness=0) for _ in range(5)) == 2
    queue.release_admission()  # e.g. the group was filtered by dynamic sampling
    assert queue.try_admit(batch_size=2, max_staleness=0)
    assert not queue.try_admit(batch_size=2, max_staleness=0)
    queue.publish_version(3)
    queue.put(make_group(0, version=0, run=run))  # 3 versions behind: dropped at eta = 0
    assert queue.get(1, max_staleness=0, timeout=0.3) == []
    assert queue.stats()["groups_started"] == 1  # the stale group's slot was given back


def test_recover_takes_only_entries_idle_long_enough(
    queue: ReplayQueue, redis_url: str, run: str
) -> None:
    for i in range(3):
        queue.put(make_group(i, run=run))
    with ReplayQueue(redis_url, run) as reader:
        taken = [entry_id for entry_id, _ in reader.get(3, timeout=1.0)]
    assert queue.recover() == []  # idle for less than claim_idle_s=0.3
    time.sleep(0.35)
    assert [entry_id for entry_id, _ in queue.recover()] == taken
    queue.commit(taken)
    assert queue.recover(min_idle_s=0) == []


def test_stats_reports_oldest_age(queue: ReplayQueue, run: str) -> None:
    stats = queue.stats()
    assert set(stats) == {
        "depth", "pending", "dead_lettered", "dropped_stale", "staleness_histogram",
        "oldest_age_s", "version", "groups_started", "prompt_cursor",
    }
    assert stats["oldest_age_s"] == 0.0
    queue.put(make_group(0, run=run))
    time.sleep(0.2)
    assert 0.15 < queue.stats()["oldest_age_s"] < 5.0


def test_wrong_password_fails_fast(redis_url: str, run: str) -> None:
    bad_url = redis_url.replace("://:", "://:wrong", 1)
    start = time.monotonic()
    with pytest.raises(redis.AuthenticationError):
        ReplayQueue(bad_url, run, op_timeout_s=10.0)
    assert time.monotonic() - start < 2.0  # not retried


def test_rejects_non_redis_url(run: str) -> None:
    with pytest.raises(ValueError, match="redis://"):
        ReplayQueue("http://127.0.0.1:1/", run)


def test_unreachable_redis_raises_after_op_timeout(run: str) -> None:
    server = EmbeddedRedis()
    url = server.start()
    with ReplayQueue(url, run, op_timeout_s=0.6, socket_timeout_s=0.5) as q:
        q.put(make_group(0, run=run))
        server.stop()
        start = time.monotonic()
        with pytest.raises(QueueUnavailableError, match="unreachable") as info:
            q.stats()
        assert 0.6 <= time.monotonic() - start < 3.0
    assert server.password is not None and server.password not in str(info.value)


def test_encoded_size_is_packed(run: str) -> None:
    group = make_group(0, run=run)
    assert len(encode(group)) < 400  # bytes fields, not per-token msgpack ints
