"""The worker's ticket lifecycle under cancellation, on a real redis-server and a real
reward pool; the inference server is a stand-in coroutine (this tests the worker's
bookkeeping, not generation): however a stop lands, no ticket stays open and every
claimed prompt is either queued or returned."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from async_rl.config import RewardConfig
from async_rl.data.prompts import PromptRow
from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.rewards import RewardPool, RewardScorer
from async_rl.rollout.types import Completion, GenerateFn, Sampling
from async_rl.rollout.worker import RolloutWorker, WorkerSettings

pytestmark = [pytest.mark.redis]


async def _generate(prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
    await asyncio.sleep(random.uniform(0.0, 0.004))
    return [Completion([5, 6], [-0.5, -0.7], [0, 0], "stop", "11") for _ in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_a_stop_at_any_moment_leaves_no_open_ticket(seed: int) -> None:
    random.seed(seed)
    rows = [PromptRow(i + 1, f"{i}+1", str(i + 1)) for i in range(50)]
    with EmbeddedRedis() as url, ReplayQueue(url, run="tickets", max_depth=10_000) as queue, \
            RewardPool(RewardConfig(num_workers=1)) as rewards:
        settings = WorkerSettings(run_id="tickets", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                                  batch_size=1000, max_staleness=0, max_inflight=16, shuffle=False)

        async def cut_short(delay_s: float) -> int:
            worker = RolloutWorker(settings, queue, rows, lambda text: [1, 2, 3], RewardScorer(rewards, rewards.cfg, 4), lambda: _generate)
            task = asyncio.create_task(worker.run(asyncio.Event()))
            await asyncio.sleep(delay_s)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return worker.counters.groups_put

        put = 0
        for _ in range(8):
            put += asyncio.run(cut_short(random.uniform(0.0, 0.3)))
            stats = queue.stats()
            assert stats["inflight"] == 0 and stats["groups_started"] == put
        queued = [g.prompt_id for _, g in queue.get(10_000, timeout=0.5)]
        returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
        assert len(queued) == put
        assert sorted(queued + returned) == list(range(queue.stats()["prompt_cursor"]))  # none skipped, none twice


def test_groups_being_scored_do_not_hold_generation_back(tmp_path) -> None:
    """``max_inflight`` bounds the groups *generating*: while a slow reward function scores
    two groups, the worker (max_inflight=2) goes on sampling new ones; admission still
    bounds every group in flight."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text("import time\n\ndef compute_score(inputs):\n    time.sleep(1.5)\n    return [{'overall': 0.0} for _ in inputs]\n")
    calls = 0

    async def generate(prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        nonlocal calls
        calls += 1
        return [Completion([5, 6], [-0.5, -0.7], [0, 0], "stop", "11") for _ in range(n)]

    rows = [PromptRow(i + 1, f"{i}+1", str(i + 1)) for i in range(50)]
    with EmbeddedRedis() as url, ReplayQueue(url, run="slots", max_depth=10_000) as queue, \
            RewardPool(RewardConfig(function=f"{reward}:compute_score", num_workers=8, max_workers=8)) as rewards:
        settings = WorkerSettings(run_id="slots", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                                  batch_size=3, max_staleness=0, max_inflight=2, shuffle=False)

        async def run() -> None:
            worker = RolloutWorker(settings, queue, rows, lambda text: [1, 2, 3], RewardScorer(rewards, rewards.cfg, 4), lambda: generate)
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            await asyncio.sleep(1.0)  # no group has finished scoring yet
            stop.set()
            await task

        asyncio.run(run())
        assert calls == 3  # admission's bound ((0 + 0 + 1) x batch 3), not max_inflight's 2
        assert queue.stats()["inflight"] == 0


def _admission_calls(settings: WorkerSettings, generate: GenerateFn, producers: int = 0) -> tuple[list[tuple[int, int, int]], dict]:
    """A worker of ``settings`` run for 12 groups on a real Redis (``producers`` recorded when
    not 0): ``(limit asked, held, tickets got)`` of each of its admission calls, and the
    queue's stats after it."""
    rows = [PromptRow(i + 1, f"{i}+1", str(i + 1)) for i in range(50)]
    with EmbeddedRedis() as url, ReplayQueue(url, run=settings.run_id, max_depth=10_000) as queue, \
            RewardPool(RewardConfig(num_workers=1)) as rewards:
        if producers:
            queue.set_producers(producers)
        calls: list[tuple[int, int, int]] = []
        admit = queue.admit

        def spy(batch_size: int, max_staleness: int, owner: str, limit: int = 1, held: int = 0) -> list:
            tickets = admit(batch_size, max_staleness, owner, limit, held)
            calls.append((limit, held, len(tickets)))
            return tickets

        queue.admit = spy  # type: ignore[method-assign]

        async def run() -> None:
            worker = RolloutWorker(settings, queue, rows, lambda text: [1, 2, 3], RewardScorer(rewards, rewards.cfg, 4), lambda: generate)
            await worker.run(asyncio.Event(), max_groups=12)

        asyncio.run(run())
        return calls, queue.stats()


def test_free_slots_are_claimed_in_one_admission_call() -> None:
    """When a version opens admission, a worker claims every free slot in one round trip
    (not one call per group, each waiting for the server's busy event loop)."""
    settings = WorkerSettings(run_id="burst", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                              batch_size=12, max_staleness=0, max_inflight=16, shuffle=False)
    calls, stats = _admission_calls(settings, _generate)
    assert [(limit, got) for limit, _, got in calls if got][0] == (12, 12)  # max_groups left 12 of the 16 slots to ask for; the rule gave all
    assert stats["groups_started"] == 12 and stats["inflight"] == 0


def test_a_worker_holds_no_more_than_its_share_of_the_window() -> None:
    """With 4 producers recorded, B 8 and eta 1, a worker of 16 free slots holds at most
    ceil(2 x 8 / 4) = 4 open tickets: it counts its own for each admission call, and asks
    again as its groups end (the other loops' share is left to them)."""

    async def slow(prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        await asyncio.sleep(0.05)
        return [Completion([5, 6], [-0.5, -0.7], [0, 0], "stop", "11") for _ in range(n)]

    settings = WorkerSettings(run_id="share", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                              batch_size=8, max_staleness=1, max_inflight=16, shuffle=False)
    calls, stats = _admission_calls(settings, slow, producers=4)
    assert calls[0][1:] == (0, 2) and max(held + got for _, held, got in calls) == 4, calls  # ceil(8 / 4) a call, 4 held at most
    assert sum(got for _, _, got in calls) == 12 and stats["inflight"] == 0


def test_a_closed_admission_is_waited_on_not_polled_and_a_published_version_opens_it_at_once() -> None:
    """At the default ``admit_wait_s`` (1 s): while the staleness bound holds a worker back it
    asks Redis about once a second (it polled every 20 ms, a core of Redis at 1,024 servers:
    benchmarks/scale_sim.py), and a version published by the learner starts its next groups
    within a fraction of that second, as polling did; a stop ends its wait at once."""
    rows = [PromptRow(i + 1, f"{i}+1", str(i + 1)) for i in range(50)]
    with EmbeddedRedis() as url, ReplayQueue(url, run="wait", max_depth=10_000) as queue, \
            RewardPool(RewardConfig(num_workers=1)) as rewards:
        settings = WorkerSettings(run_id="wait", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                                  batch_size=2, max_staleness=0, max_inflight=4, shuffle=False)
        calls: list[tuple[float, int]] = []  # (when, tickets) of every admission call
        admit = queue.admit

        def spy(batch_size: int, max_staleness: int, owner: str, limit: int = 1, held: int = 0) -> list:
            tickets = admit(batch_size, max_staleness, owner, limit, held)
            calls.append((time.monotonic(), len(tickets)))
            return tickets

        queue.admit = spy  # type: ignore[method-assign]

        async def run() -> tuple[float, float]:
            worker = RolloutWorker(settings, queue, rows, lambda text: [1, 2, 3], RewardScorer(rewards, rewards.cfg, 4), lambda: _generate)
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            await asyncio.sleep(2.5)  # version 0's 2 groups, then the bound holds
            published = time.monotonic()
            await asyncio.to_thread(queue.publish_version, 1)
            # The spy records a call once its reply is back: Redis counts the groups first.
            while not any(got and t > published for t, got in calls):
                await asyncio.sleep(0.01)
            opened = next(t for t, got in calls if got and t > published) - published
            await asyncio.sleep(0.3)
            stopping = time.monotonic()
            stop.set()
            await task
            return opened, time.monotonic() - stopping

        opened, stopped = asyncio.run(run())
        closed = [t for t, got in calls if not got]
        assert 1 <= len(closed) <= 5, len(closed)  # about one a second while held back, not 50
        assert opened < 0.5 and stopped < 0.5, (opened, stopped)
        assert queue.stats()["inflight"] == 0 and queue.stats()["groups_started"] == 4


def test_a_stop_while_redis_is_paused_never_blocks_the_event_loop() -> None:
    """The worker runs on its server's event loop: ending its tickets while Redis does not
    answer (``CLIENT PAUSE``) happens off the loop, which keeps serving every few ms; once
    Redis answers, every ticket is ended and its prompt returned."""
    rows = [PromptRow(i + 1, f"{i}+1", str(i + 1)) for i in range(50)]
    hang = asyncio.Event()  # never set: generation is in flight when the stop comes

    async def generate(prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        await hang.wait()
        raise AssertionError("unreachable")

    with EmbeddedRedis() as url, ReplayQueue(url, run="paused", max_depth=100) as queue, \
            RewardPool(RewardConfig(num_workers=1)) as rewards:
        settings = WorkerSettings(run_id="paused", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                                  batch_size=1000, max_staleness=0, max_inflight=4, shuffle=False)

        async def stop_during_pause() -> float:
            worker = RolloutWorker(settings, queue, rows, lambda text: [1, 2, 3], RewardScorer(rewards, rewards.cfg, 4), lambda: generate)
            task = asyncio.create_task(worker.run(asyncio.Event()))
            while (await asyncio.to_thread(queue.stats))["inflight"] < 4:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(queue._client.execute_command, "CLIENT", "PAUSE", 3000, "ALL")
            longest, last = 0.0, time.monotonic()
            task.cancel()
            while not task.done():  # the loop's heartbeat while the tickets end
                await asyncio.sleep(0.01)
                now = time.monotonic()
                longest, last = max(longest, now - last), now
            await asyncio.gather(task, return_exceptions=True)
            return longest

        paused_at = time.monotonic()
        longest = asyncio.run(stop_during_pause())
        assert time.monotonic() - paused_at > 2.5  # the tickets waited for Redis...
        assert longest < 0.5, f"the event loop stalled for {longest:.1f} s"  # ...and the loop did not
        stats = queue.stats()
        assert stats["inflight"] == 0 and stats["groups_started"] == 0 and stats["returned_prompts"] == 4


def test_a_worker_waits_for_a_redis_that_does_not_answer_and_goes_on() -> None:
    """Redis paused (``CLIENT PAUSE``) for longer than the worker's queue calls retry, as a
    restart or a full disk leaves it: the worker neither fails nor drops a group; it waits,
    counts the wait (``queue_wait_s``) and goes on once Redis answers; every claimed prompt
    is queued or returned exactly once and no ticket stays open."""
    rows = [PromptRow(i + 1, f"{i}+1", str(i + 1)) for i in range(50)]
    with EmbeddedRedis() as url, ReplayQueue(url, run="away", max_depth=10_000) as queue, \
            ReplayQueue(url, run="away", max_depth=10_000, op_timeout_s=1.0, socket_timeout_s=0.5) as workers_queue, \
            RewardPool(RewardConfig(num_workers=1)) as rewards:
        settings = WorkerSettings(run_id="away", server_id="server-0", n=2, sampling=Sampling(max_tokens=4),
                                  batch_size=1000, max_staleness=0, max_inflight=4, shuffle=False)

        async def pause_and_go_on() -> tuple[int, int, float]:
            worker = RolloutWorker(settings, workers_queue, rows, lambda text: [1, 2, 3], RewardScorer(rewards, rewards.cfg, 4),
                                   lambda: _generate)
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            while worker.counters.groups_put < 5:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(queue._client.execute_command, "CLIENT", "PAUSE", 4000, "ALL")
            before = worker.counters.groups_put
            await asyncio.sleep(4.5)
            assert not task.done(), task
            while worker.counters.groups_put < before + 5:  # it goes on
                assert not task.done(), task
                await asyncio.sleep(0.02)
            stop.set()
            await task
            return before, worker.counters.groups_put, worker.counters.queue_wait_s

        before, put, waited = asyncio.run(pause_and_go_on())
        assert waited >= 1.0 and put >= before + 5, (waited, before, put)  # a call waited out its whole 1 s; it went on
        stats = queue.stats()
        queued = [g.prompt_id for _, g in queue.get(10_000, timeout=0.5)]
        returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
        assert stats["inflight"] == 0 and len(queued) == put == stats["groups_started"]
        assert sorted(queued + returned) == list(range(stats["prompt_cursor"]))  # none skipped, none twice
