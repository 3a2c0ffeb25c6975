"""Rollout workers hosted in their server's Ray actor, writing straight to a real redis-server.

The servers are :class:`FakeServer` actors (a fixed token rate, no vLLM: this tests the data
path and the ticket ownership, not generation); the pool, hosts, workers, reward pools,
Redis and Ray are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import ray

from async_rl.config import RewardConfig
from async_rl.data.prompts import PromptRow
from async_rl.launch.ray_cluster import init_ray
from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.records import decode
from async_rl.rollout.fake_engine import FakeServer
from async_rl.rollout.host import WorkerHostSpec
from async_rl.rollout.pool import ServerPool, ServerSpec
from async_rl.rollout.types import Sampling
from async_rl.rollout.worker import WorkerSettings
from async_rl.sync.auth import RunSecret, SyncEndpoint

pytestmark = [pytest.mark.ray]

RUN = "host-test"


@pytest.fixture(scope="module")
def ray_local():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _spec(url: str, workers: int = 1) -> WorkerHostSpec:
    settings = WorkerSettings(run_id=RUN, server_id="", n=2, sampling=Sampling(max_tokens=8), batch_size=10_000,
                              max_staleness=0, max_inflight=8, shuffle=False)
    return WorkerHostSpec(url, RUN, max_depth=100_000, op_timeout_s=10.0, settings=settings, workers=workers,
                          reward=RewardConfig(function="exact_match", num_workers=1), max_response_length=8, stats_period_s=0.2)


@pytest.mark.redis
@pytest.mark.slow
def test_a_killed_host_loses_no_prompt_and_its_replacement_goes_on(ray_local, tmp_path):
    rows = [PromptRow(i + 1, f"question {i}", str(i % 10)) for i in range(10_000)]
    with EmbeddedRedis(tmp_path / "redis") as url, ReplayQueue(url, RUN, max_depth=100_000) as queue:
        pool = ServerPool(ServerSpec({"tokens_per_s": 2000.0}, num_cpus=0, server_cls=FakeServer), 2,
                          workers=_spec(url), rows=ray.put(rows), on_lost=queue.release_owner)

        async def go() -> list[dict[str, float]]:
            await pool.start()
            while queue.stats()["depth"] < 20:
                await asyncio.sleep(0.1)
            victim = (await pool.handle(0).health.remote()).pid
            os.kill(victim, signal.SIGKILL)
            while not await pool.heal(version=0, max_lag_s=60.0):
                await asyncio.sleep(0.2)
            assert (await pool.handle(0).health.remote()).pid != victim
            put = queue.stats()["depth"]
            while queue.stats()["depth"] < put + 20:  # the replacement and the survivor go on
                await asyncio.sleep(0.1)
            totals = await pool.stop_workers(grace_s=5.0)
            await pool.shutdown()
            return totals

        totals = asyncio.run(go())
        stats = queue.stats()
        queued = [g.prompt_id for _, g in queue.get(100_000, timeout=1.0)]
        returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
        assert pool.restarts == 1 and stats["inflight"] == 0
        assert stats["groups_started"] == len(queued)
        assert sorted(queued + returned) == list(range(stats["prompt_cursor"]))  # none skipped, none twice
        # Counters reach Redis: the stopped hosts' final totals are all in; the killed host
        # lost at most its last flush period.
        rollout = queue.rollout_stats()
        assert sum(t["groups_put"] for t in totals) > 0
        assert sum(t["groups_put"] for t in totals) <= rollout["groups_put"] <= len(queued)
        assert rollout["tokens_generated"] > 0 and rollout.get("reward_errors", 0.0) == 0


@pytest.mark.redis
def test_workers_held_at_start_begin_only_when_asked(ray_local, tmp_path):
    """``start(workers=False)``: the servers serve (a validation of the starting weights) and
    no group is generated until ``start_workers()``."""
    rows = [PromptRow(i + 1, f"question {i}", str(i % 10)) for i in range(1000)]
    with EmbeddedRedis(tmp_path / "redis") as url, ReplayQueue(url, RUN, max_depth=100_000) as queue:
        pool = ServerPool(ServerSpec({"tokens_per_s": 2000.0}, num_cpus=0, server_cls=FakeServer), 1,
                          workers=_spec(url), rows=ray.put(rows), on_lost=queue.release_owner)

        async def go() -> None:
            await pool.start(workers=False)
            completions = await pool.generate(0, [1, 2, 3], 2, Sampling(max_tokens=4))
            assert len(completions) == 2
            await asyncio.sleep(1.0)
            assert queue.stats()["groups_started"] == 0  # no worker admitted a group
            await pool.start_workers()
            while queue.stats()["depth"] < 5:
                await asyncio.sleep(0.1)
            await pool.start_workers()  # a second call starts nothing more
            await pool.stop_workers(grace_s=5.0)
            await pool.shutdown()

        asyncio.run(go())
        assert queue.stats()["inflight"] == 0


@pytest.mark.redis
@pytest.mark.slow
def test_the_pool_scales_up_and_down_while_it_produces_and_loses_no_prompt(ray_local, tmp_path):
    """1 -> 3 -> 1 servers while the workers produce: the new servers produce too (their
    own ticket owners), the drained ones stop admitting and give back what they could not
    finish; every prompt started is queued or returned exactly once, no ticket stays open."""
    rows = [PromptRow(i + 1, f"question {i}", str(i % 10)) for i in range(10_000)]
    with EmbeddedRedis(tmp_path / "redis") as url, ReplayQueue(url, RUN, max_depth=100_000) as queue:
        producers: list[int] = []  # what the pool recorded for admission's share, in order

        def resized(n: int) -> None:
            producers.append(n)
            queue.set_producers(n)

        pool = ServerPool(ServerSpec({"tokens_per_s": 2000.0}, num_cpus=0, server_cls=FakeServer), 1,
                          workers=_spec(url), rows=ray.put(rows), on_lost=queue.release_owner, on_resize=resized)

        def queued_by() -> set[str]:
            return {decode(fields[b"group"]).server_id for _, fields in queue._client.xrange(queue.keys.rollouts)}

        async def produced(more: int, by: tuple[int, ...] = ()) -> None:
            """``more`` groups queued, a group of each server in ``by`` among them (tokens
            generated are not enough: on a loaded machine a group may still be scoring)."""
            start = queue.stats()["depth"]
            while queue.stats()["depth"] < start + more or not {f"server-{i}" for i in by} <= queued_by():
                await asyncio.sleep(0.1)

        async def go() -> tuple[list[str], list[str], list[int]]:
            await pool.start()
            await produced(10)
            up = await pool.scale_to(3, grace_s=5.0)
            assert pool.indices == [0, 1, 2] and [h.server_id for h in await pool.health()] == ["server-0", "server-1", "server-2"]
            await produced(30, by=(1, 2))
            leaving = [(await pool.handle(i).health.remote()).pid for i in (1, 2)]
            down = await pool.scale_to(2, grace_s=10.0)  # server-2 finishes what it generated
            down += await pool.scale_to(1, grace_s=0.0)  # no grace: what server-1 has in flight goes back to the queue
            # Only server-0's own tickets are open (their number is not bounded by its 8
            # generation slots: a group scoring or being put holds its ticket, not a slot).
            owners = {record.decode().split()[1] for record in queue._client.hvals(queue.keys.inflight)}
            assert pool.indices == [0] and owners <= {"server-0#0"}, owners
            await produced(10)
            await pool.stop_workers(grace_s=5.0)
            await pool.shutdown()
            return up, down, leaving

        up, down, leaving = asyncio.run(go())
        loops = _spec(url).workers  # worker loops a server
        assert producers[0] == loops and 3 * loops in producers and producers[-1] == loops, producers
        assert int(queue._client.hget(queue.keys.counters, "producers")) == loops
        assert up == ["server-1 added", "server-2 added"]
        assert [line.split(" (")[0] for line in down] == ["server-2 drained and stopped", "server-1 drained and stopped"]
        assert not any(os.path.exists(f"/proc/{pid}") for pid in leaving)  # their processes are gone
        stats = queue.stats()
        groups = [g for _, g in queue.get(100_000, timeout=1.0)]
        queued = [g.prompt_id for g in groups]
        returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
        assert {g.server_id for g in groups} == {"server-0", "server-1", "server-2"}
        assert pool.restarts == 0 and stats["inflight"] == 0
        assert stats["groups_started"] == len(queued)
        assert sorted(queued + returned) == list(range(stats["prompt_cursor"]))  # none skipped, none twice


@pytest.mark.redis
@pytest.mark.slow
def test_random_scale_changes_beside_the_health_loop_lose_no_prompt(ray_local, tmp_path):
    """Eight seeded changes of the pool's size (1 to 3 servers) at random moments, each with a
    grace of 0, 5 or 30 s, while the workers produce (slow servers: groups are in flight when a
    drain starts) and the driver's health loop (``heal``) runs beside them, as in a run: every
    change leaves the pool at the size asked, nothing is replaced, every prompt started is
    queued or returned exactly once and no ticket stays open."""
    rng = random.Random(0)
    rows = [PromptRow(i + 1, f"question {i}", str(i % 10)) for i in range(10_000)]
    with EmbeddedRedis(tmp_path / "redis") as url, ReplayQueue(url, RUN, max_depth=100_000) as queue:
        pool = ServerPool(ServerSpec({"tokens_per_s": 200.0}, num_cpus=0, server_cls=FakeServer), 1,
                          workers=_spec(url), rows=ray.put(rows), on_lost=queue.release_owner)

        async def healing(stop: asyncio.Event) -> list[str]:
            actions: list[str] = []
            while not stop.is_set():
                actions += await pool.heal(version=0, max_lag_s=60.0)
                await asyncio.sleep(0.2)  # not from rng: the changes' draws stay the seed's
            return actions

        async def go() -> tuple[list[tuple[int, float, list[str]]], list[str]]:
            await pool.start()
            # A health taken while the server started (CI: heal then replaced the new server-4).
            await pool.health()
            assert await pool.heal(version=0, max_lag_s=60.0, healths=["server-0 is starting"]) == []
            stop = asyncio.Event()
            healer = asyncio.create_task(healing(stop))
            changes = []
            for _ in range(8):
                await asyncio.sleep(rng.uniform(0.0, 3.0))
                n, grace = rng.choice([k for k in (1, 2, 3) if k != pool.num_servers]), rng.choice((0.0, 5.0, 30.0))
                lines = await asyncio.wait_for(pool.scale_to(n, grace), 120)
                assert pool.num_servers == n, (n, grace, lines)
                changes.append((n, grace, lines))
            stop.set()
            actions = await healer
            await pool.stop_workers(grace_s=5.0)
            await pool.shutdown()
            return changes, actions

        changes, actions = asyncio.run(go())
        assert actions == [] and pool.restarts == 0, actions
        assert {grace for _, grace, _ in changes} == {0.0, 5.0, 30.0}  # the seed draws every grace
        for _, _, lines in changes:
            assert lines and all(line.endswith(" added") or " drained and stopped (" in line for line in lines), lines
        stats = queue.stats()
        queued = [g.prompt_id for _, g in queue.get(100_000, timeout=1.0)]
        returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
        assert stats["inflight"] == 0 and stats["groups_started"] == len(queued)
        assert sorted(queued + returned) == list(range(stats["prompt_cursor"]))  # none skipped, none twice


class StartHangs(FakeServer):
    """A :class:`FakeServer` whose start never returns (it records its pid in
    ``engine_kwargs["marker"]``), as an engine that never answers would leave it."""

    async def start(self, sync=None, control_timeout_s: float = 10.0):
        with open(self.engine_kwargs["marker"], "w") as f:
            f.write(str(os.getpid()))
        self.step = "registering for weight updates"
        await asyncio.Event().wait()  # the hang


def test_an_added_server_whose_start_hangs_is_reported_with_its_stacks_and_killed(ray_local, tmp_path, caplog):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class lives in this test module
    marker = tmp_path / "hung.pid"
    pool = ServerPool(ServerSpec({"tokens_per_s": 2000.0, "marker": str(marker)}, num_cpus=0, server_cls=StartHangs, start_timeout_s=10.0), 0)
    with caplog.at_level("WARNING", logger="async_rl.rollout.pool"), pytest.raises(TimeoutError) as failed:
        asyncio.run(pool.add(workers=False))
    assert str(failed.value) == ("server-0 did not start within 10 s, at step: registering for weight updates "
                                 "(its stacks are in the driver's log)")
    assert "in start" in caplog.text and "asyncio.Event().wait()" in caplog.text  # the hung coroutine's stack, to the line
    assert pool.indices == []
    hung = int(marker.read_text())
    for _ in range(100):  # its actor was killed
        if not os.path.exists(f"/proc/{hung}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{hung}")


class StartRecords(FakeServer):
    """A :class:`FakeServer` that appends its pid and each ``start``'s weight sender address
    (or None) to the file ``engine_kwargs["marker"]`` + its server id."""

    async def start(self, sync=None, control_timeout_s: float = 10.0):
        with open(f"{self.engine_kwargs['marker']}.{self.server_id}", "a") as f:
            f.write(json.dumps([os.getpid(), sync.address if sync is not None else None]) + "\n")
        return await super().start(sync, control_timeout_s)


def _starts(marker: Path) -> dict[str, list[list]]:
    return {p.name.rsplit(".", 1)[1]: [json.loads(line) for line in p.read_text().splitlines()]
            for p in marker.parent.glob(f"{marker.name}.server-*")}


def test_servers_start_before_their_weight_sender_is_known_and_die_if_it_never_is(ray_local, tmp_path):
    """``start(sync=awaitable)`` (the driver's start, while the learner starts): each server
    starts without a sender, registers once the awaitable gives it (it becomes ``spec.sync``),
    and is killed if the awaitable raises (the learner did not start)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class lives in this test module
    endpoint = SyncEndpoint("tcp://127.0.0.1:40123", RunSecret.generate())

    async def run(marker: Path, outcome: BaseException | None) -> ServerPool:
        pool = ServerPool(ServerSpec({"tokens_per_s": 2000.0, "marker": str(marker)}, num_cpus=0, server_cls=StartRecords), 2)
        known: asyncio.Future = asyncio.get_running_loop().create_future()
        starting = asyncio.create_task(pool.start(workers=False, sync=known))
        while len(_starts(marker)) < 2:  # both started without a sender, which is not known yet
            assert not starting.done(), starting
            await asyncio.sleep(0.1)
        known.set_result(endpoint) if outcome is None else known.set_exception(outcome)
        try:
            await starting
        finally:
            if outcome is None:
                await pool.shutdown()
        return pool

    registered = tmp_path / "registered"
    pool = asyncio.run(run(registered, None))
    assert pool.spec.sync == endpoint
    starts = _starts(registered)
    assert sorted(starts) == ["server-0", "server-1"]
    assert all([address for _, address in calls] == [None, endpoint.address] for calls in starts.values()), starts

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="the learner did not start"):
        asyncio.run(run(failed, RuntimeError("the learner did not start")))
    starts = _starts(failed)
    assert all([address for _, address in calls] == [None] for calls in starts.values()), starts  # never registered
    pids = [calls[0][0] for calls in starts.values()]
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):  # their actors were killed
        assert time.monotonic() < deadline, pids
        time.sleep(0.1)


def test_a_moved_weight_sender_reaches_starting_servers_and_replaces_running_ones(ray_local, tmp_path):
    """``move_sender`` (a restarted learner's rank 0 on another node): a server still in its
    first start has no process of the pool's to replace (the CI failure of 2026-12-03 was
    ``ray.kill(None)`` there) and registers with the new sender when it gets to it, although
    the driver's awaitable still gives the old one; a running server is replaced and its new
    process registers with the newest."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class lives in this test module
    secret = RunSecret.generate()
    old, new, newer = (SyncEndpoint(f"tcp://127.0.0.1:{port}", secret) for port in (40123, 40124, 40125))
    marker = tmp_path / "registered"

    async def run() -> None:
        pool = ServerPool(ServerSpec({"tokens_per_s": 2000.0, "marker": str(marker)}, num_cpus=0, server_cls=StartRecords), 2)
        known: asyncio.Future = asyncio.get_running_loop().create_future()
        starting = asyncio.create_task(pool.start(workers=False, sync=known))
        try:
            while len(_starts(marker)) < 2:  # both in their first start, without a sender
                await asyncio.sleep(0.1)
            await pool.move_sender(new, "registered with the old weight sender")
            assert pool.restarts == 0
            known.set_result(old)
            await starting
            assert pool.spec.sync == new
            await pool.move_sender(newer, "registered with the old weight sender")
            assert pool.restarts == 2 and pool.spec.sync == newer
        finally:
            await pool.shutdown()

    asyncio.run(run())
    starts = _starts(marker)
    assert sorted(starts) == ["server-0", "server-1"]
    for calls in starts.values():
        assert [address for _, address in calls] == [None, new.address, newer.address], calls
        assert calls[0][0] == calls[1][0] != calls[2][0], calls  # the first process registered with new, a second one with newer
