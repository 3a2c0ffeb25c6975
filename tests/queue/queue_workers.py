"""Record factory and the bodies of producer/consumer processes (spawned by the tests)."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.synchronize import Event

from async_rl.queue import ReplayQueue
from async_rl.records import RolloutGroup, Sample

SPAWN = mp.get_context("spawn")  # fresh interpreters, like real rollout workers


def make_group(index: int, version: int = 0, run: str = "test") -> RolloutGroup:
    """A small group whose ``group_id`` is ``g{index}`` and behaviour version ``version``."""
    versions = [version + 1, version, version]  # the minimum sits mid-response
    sample = Sample.from_lists([index, 1, 2], [-0.5, -0.25, -1.0], versions, 1.0)
    return RolloutGroup.from_lists(run, f"g{index}", index, [3, 4], [sample], "srv", 0.01)


def produce(url: str, run: str, indices: range, done: mp.Queue[str], max_depth: int = 256) -> None:
    """Put one group per index, reporting each group id once ``put`` has returned."""
    with ReplayQueue(url, run, max_depth=max_depth) as q:
        for i in indices:
            q.put(make_group(i, run=run), timeout=60.0)
            done.put(f"g{i}")


def consume(url: str, run: str, batch: int, committed: mp.Queue[str], stop: Event) -> None:
    """Get, commit, report committed group ids; exit once ``stop`` is set and the queue is dry."""
    with ReplayQueue(url, run) as q:
        while True:
            items = q.get(batch, timeout=0.3)
            q.commit(entry_id for entry_id, _ in items)
            for _, group in items:
                committed.put(group.group_id)
            if not items and stop.is_set():
                return


def take_and_hang(url: str, run: str, n: int, taken: mp.Queue[list[str]]) -> None:
    """Get ``n`` entries, report their ids, then wait (uncommitted) to be killed."""
    with ReplayQueue(url, run) as q:
        taken.put([entry_id for entry_id, _ in q.get(n, timeout=10.0)])
        time.sleep(600)


def admit(
    url: str, run: str, batch_size: int, max_staleness: int, go: Event, admitted: mp.Queue[int]
) -> None:
    """Try to admit (1, 2 or 3 groups a call) until refused; report how many this process got."""
    with ReplayQueue(url, run) as q:
        go.wait()
        count, calls = 0, 0
        while tickets := q.admit(batch_size, max_staleness, "test", limit=1 + calls % 3):
            count += len(tickets)
            calls += 1
        admitted.put(count)


def draw_prompts(url: str, run: str, n: int, go: Event, drawn: mp.Queue[list[int]]) -> None:
    """Claim ``n`` prompt indices by admission, 1 to 3 a call (the rule never binds here); report them."""
    with ReplayQueue(url, run) as q:
        go.wait()
        tickets: list = []
        while len(tickets) < n:
            tickets += q.admit(10**9, 0, "test", limit=min(n - len(tickets), 1 + len(tickets) % 3))
        drawn.put([t.index for t in tickets])
