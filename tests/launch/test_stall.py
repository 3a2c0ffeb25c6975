"""What a run without learner steps waits for (launch/stall.py), and the driver's wait on its
learner ranks with a hang bound: pure logic."""

from __future__ import annotations

import asyncio
import time

import pytest

from async_rl.launch.learner_group import RankHung, all_ranks
from async_rl.launch.stall import Snapshot, blame, provable_version


def _snap(**kw) -> Snapshot:
    base = dict(learner_version=273, published=272, groups_started=4400, max_staleness=2, batch_size=16, depth=0, inflight=0,
                servers=[("server-0", 273)])
    return Snapshot(**{**base, **kw})  # type: ignore[arg-type]


def test_the_scale_down_stall_is_resolved_from_the_servers_acknowledgements() -> None:
    """Issue 42's measured stall: learner and server-0 at 273, admission shut at 272, server-1 gone."""
    snap = _snap()
    assert snap.limit == (272 + 2 + 1) * 16 == snap.groups_started
    assert provable_version(snap) == 273
    assert "the learner's announcement: every server holds version 273" in blame(snap)


@pytest.mark.parametrize(("kw", "expected"), [
    ({"servers": [("server-0", 273), ("server-1", 272)]}, None),  # one still holds 272: nothing newer is proven
    ({"servers": [("server-0", 275)]}, 273),  # never past the learner's own version (a restarted learner's line)
    ({"published": 273}, None),  # nothing to do
    ({"servers": [("server-0", 273), "server-1: TimeoutError"]}, None),  # an unhealthy server's weights are unknown
    ({"servers": []}, None),
])
def test_the_provable_version_is_the_oldest_held_and_never_past_the_learner(kw, expected) -> None:
    assert provable_version(_snap(**kw)) == expected


@pytest.mark.parametrize(("kw", "named"), [
    ({"servers": ["server-1 did not answer its health check within 30 s"]}, "the inference servers: server-1 did not answer"),
    ({"depth": 16}, "the learner: 16 groups are queued for it"),
    ({"groups_started": 4000, "inflight": 32}, "the inference servers: 32 groups are in flight and too few finish"),
    ({"groups_started": 4000}, "the rollout workers: admission is open and no group is in flight"),
    # the running_sum benchmark's 1000-row version-0 validation took 2 min: not the workers' fault
    ({"learner_version": 0, "published": 0, "groups_started": 0, "workers_started": False}, "the first validation:"),
    ({"servers": [("server-0", 273), ("server-1", 271)]}, "the weight updates: admission waits for version 273 to reach every server (server-1 holds 271"),
    ({"published": 273, "groups_started": 4416, "inflight": 5}, "admission is closed at version 273"),
])
def test_each_stall_names_the_component_it_waits_on(kw, named) -> None:
    assert named in blame(_snap(**kw))


def test_ranks_that_answer_no_call_within_the_bound_are_declared_hung() -> None:
    async def answer(after_s: float) -> str:
        await asyncio.sleep(after_s)
        return "ok"

    assert asyncio.run(all_ranks([answer(0.01), answer(0.02)], timeout_s=5.0)) == ["ok", "ok"]
    with pytest.raises(RankHung, match=r"learner rank 1 answered no call for 0 s .*declared hung"):
        asyncio.run(all_ranks([answer(0.01), answer(60)], timeout_s=0.2))
    with pytest.raises(RankHung, match=r"learner ranks 0, 1 answered no call"):
        asyncio.run(all_ranks([answer(60), answer(60)], timeout_s=0.2))


def test_a_rank_waiting_on_a_queue_that_is_down_is_not_hung() -> None:
    """The hang clock runs from when the queue answered again: a rank that waits while Redis is
    down (a full disk, a restart) answers in time; one silent for the bound after it is hung."""
    async def answer(after_s: float) -> str:
        await asyncio.sleep(after_s)
        return "ok"

    async def outage(down_s: float, answer_after_s: float, timeout_s: float) -> list[str]:
        back = time.monotonic() + down_s  # the queue is down until then, so it "answers again" at every moment before

        def queue_back_at() -> float:
            return min(time.monotonic(), back)

        return await all_ranks([answer(0.01), answer(answer_after_s)], timeout_s=timeout_s, queue_back_at=queue_back_at)

    assert asyncio.run(outage(down_s=0.6, answer_after_s=0.7, timeout_s=0.3)) == ["ok", "ok"]  # 0.1 s after the queue's return
    with pytest.raises(RankHung, match=r"learner rank 1 answered no call for 0 s"):
        asyncio.run(outage(down_s=0.3, answer_after_s=60, timeout_s=0.3))
