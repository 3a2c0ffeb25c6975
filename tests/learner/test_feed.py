"""The learner's feed on one rank with a real redis-server: records passed on as read, the
backlog, the run of drops, staleness on the groups' behaviour version."""

from __future__ import annotations

import time
import uuid

import pytest
from image_bombs import bomb_png
from learner_helpers import make_groups

from async_rl.learner.feed import BatchFeed, NoTrainableDataError, QueueReader, staleness_metrics, truncation_metrics
from async_rl.learner.model import DistInfo
from async_rl.learner.screening import Limits
from async_rl.queue import ReplayQueue
from async_rl.records import ImageRef, RolloutGroup, Sample, encode


class Hooks:
    """The publisher's side, recorded (the feed only calls it)."""

    def __init__(self, loading: bool = False) -> None:
        self.loading = loading
        self.calls: list[str] = []

    def catch_up(self, version: int) -> None:
        self.calls.append(f"catch_up {version}")

    def settle(self, wait: bool) -> None:
        self.calls.append(f"settle {wait}")
        self.loading = False


def _feed(queue: ReplayQueue, one_rank: DistInfo, batch_size: int = 2, fill_window: bool = False) -> BatchFeed:
    limits = Limits(64, 512)
    reader = QueueReader(queue, limits, max_staleness=1, batch_size=batch_size, read_timeout_s=0.2, takes_images=False,
                         model_path="tiny", run_name=queue.run, fill_window=fill_window)
    return BatchFeed(one_rank.rank, one_rank.device, limits, reader)


@pytest.mark.redis
@pytest.mark.dist
def test_a_batch_carries_the_records_as_read_and_a_deadline_keeps_what_was_read(redis_url: str, one_rank: DistInfo) -> None:
    run = f"feed-{uuid.uuid4().hex[:8]}"
    groups = make_groups(3, seed=21, run=run)
    with ReplayQueue(redis_url, run, max_depth=64) as queue:
        for g in groups[:1]:
            queue.put(g)
        feed, hooks = _feed(queue, one_rank), Hooks()
        started = time.monotonic()
        assert feed.next(2, 0, hooks, deadline=time.monotonic() + 0.5) is None  # one group is not a batch
        assert time.monotonic() - started < 5.0 and feed.reader is not None and len(feed.reader.backlog) == 1
        for g in groups[1:]:
            queue.put(g)
        data = feed.next(2, 0, hooks)
        assert data is not None and [f.screened.group for f in data.fed] == groups[:2]  # the backlog first
        assert [f.record for f in data.fed] == [encode(g) for g in groups[:2]] and all(f.entry_id for f in data.fed)
        assert hooks.calls[0] == "catch_up 0" and data.images == {}


@pytest.mark.redis
@pytest.mark.dist
def test_a_batch_waiting_for_new_groups_publishes_the_loading_version_first(redis_url: str, one_rank: DistInfo) -> None:
    run = f"feed-{uuid.uuid4().hex[:8]}"
    with ReplayQueue(redis_url, run, max_depth=64) as queue:
        queue.put(make_groups(1, seed=22, run=run)[0])
        feed, hooks = _feed(queue, one_rank), Hooks(loading=True)
        assert feed.next(2, 0, hooks, deadline=time.monotonic() + 0.3) is None
        assert "settle True" in hooks.calls  # admission may need the version before new groups come


@pytest.mark.redis
@pytest.mark.dist
def test_fill_window_holds_the_batch_until_admission_is_spent_and_nothing_is_in_flight(redis_url: str, one_rank: DistInfo) -> None:
    """learner.fill_staleness_window (eta = 1, B = 2): at version 0 the window is 4 groups. With a
    full batch queued but the window open (3 started) or a group still in flight, the feed waits;
    once all 4 are in the queue the batch comes, the oldest first."""
    run = f"feed-{uuid.uuid4().hex[:8]}"
    groups = make_groups(4, seed=24, run=run)
    with ReplayQueue(redis_url, run, max_depth=64) as queue:
        feed, hooks = _feed(queue, one_rank, fill_window=True), Hooks(loading=True)
        tickets = queue.admit(2, 1, "producer", limit=4)
        assert len(tickets) == 4  # (0 + 1 + 1) x 2: admission's whole window at version 0
        for group, ticket in zip(groups[:3], tickets[:3]):
            queue.put(group, ticket)
        assert feed.next(2, 0, hooks, deadline=time.monotonic() + 0.3) is None  # 3 queued, the 4th in flight
        assert hooks.calls[1] == "settle True"  # the version is published before the window is judged
        queue.put(groups[3], tickets[3])
        data = feed.next(2, 0, hooks, deadline=time.monotonic() + 5)
        assert data is not None and [f.screened.group for f in data.fed] == groups[:2]


@pytest.mark.redis
@pytest.mark.dist
def test_without_fill_window_a_full_batch_is_read_while_groups_are_in_flight(redis_url: str, one_rank: DistInfo) -> None:
    run = f"feed-{uuid.uuid4().hex[:8]}"
    groups = make_groups(2, seed=25, run=run)
    with ReplayQueue(redis_url, run, max_depth=64) as queue:
        tickets = queue.admit(2, 1, "producer", limit=4)
        for group, ticket in zip(groups, tickets):
            queue.put(group, ticket)
        data = _feed(queue, one_rank).next(2, 0, Hooks(), deadline=time.monotonic() + 5)
        assert data is not None and [f.screened.group for f in data.fed] == groups


@pytest.mark.redis
@pytest.mark.dist
def test_a_run_of_dropped_groups_stops_the_feed_with_the_reasons(redis_url: str, one_rank: DistInfo) -> None:
    """The stop message names the real cause: an environment's error is not blamed on the reward function."""
    run = f"feed-{uuid.uuid4().hex[:8]}"
    error = "Countdown.step: KeyError: 'turn'"
    failed = [RolloutGroup.from_lists(run, f"bad{i}", i, [3, 4], [Sample.from_lists([5], [-1.0], 0, 0.0, error=error, error_kind="env_error")],
                                      "s", 0.0)
              for i in range(20)]
    with ReplayQueue(redis_url, run, max_depth=64) as queue:
        for g in failed:
            queue.put(g)
        with pytest.raises(NoTrainableDataError, match=r"the last 20 groups read were all dropped \(env_error: 20\)") as caught:
            _feed(queue, one_rank).next(2, 0, Hooks(), deadline=time.monotonic() + 30)
    message = str(caught.value)
    assert "env_error: the environment raises" in message and f"(last: sample 0: {error})" in message
    assert "reward" not in message


@pytest.mark.redis
@pytest.mark.dist
def test_a_resumed_backlog_is_judged_at_the_version_each_group_is_trained_at(redis_url: str, one_rank: DistInfo) -> None:
    """After a resume from version 0, the groups a crashed learner had read at versions 1 and 2
    (eta = 1) are trained again at 1 and 2; one of weights 5 (never trainable by then) is
    dropped as future and its prompt served again."""
    run = f"feed-{uuid.uuid4().hex[:8]}"
    groups = [g for version in (0, 0, 1, 1, 2, 2, 5) for g in make_groups(1, seed=30 + version, version=version, run=run)]
    groups = [RolloutGroup.from_lists(run, f"g{i}", i, list(g.prompt_array()), g.samples, "srv", 0.0) for i, g in enumerate(groups)]
    with ReplayQueue(redis_url, run, max_depth=64, consumer="learner-0") as crashed:
        for g in groups:
            crashed.put(g)
        assert len(crashed.get(7, timeout=1.0)) == 7  # read, never committed: pending on learner-0
    with ReplayQueue(redis_url, run, max_depth=64, consumer="learner-0") as queue:
        feed, hooks = _feed(queue, one_rank), Hooks()
        assert feed.reader is not None
        feed.reader.recover()
        trained = []
        for version in range(3):
            data = feed.next(2, version, hooks)
            assert data is not None
            trained.append([f.screened.group.behaviour_version for f in data.fed])
        assert trained == [[0, 0], [1, 1], [2, 2]]
        assert feed.next(2, 3, hooks, deadline=time.monotonic() + 0.5) is None
        stats = queue.stats()
        assert stats["dropped"] == {"future": 1} and stats["returned_prompts"] == 1 and stats["pending"] == 6
        assert queue._client.lrange(queue.keys.returned, 0, -1) == [b"6"]


def test_staleness_is_measured_on_the_groups_behaviour_version() -> None:
    old, new = make_groups(1, seed=1, version=3)[0], make_groups(1, seed=2, version=5)[0]
    metrics = staleness_metrics([old, new, new], 6)
    assert metrics["staleness/mean"] == pytest.approx(5 / 3) and metrics["staleness/max"] == 3.0
    assert {k: v for k, v in metrics.items() if "hist" in k} == {"staleness/hist/1": 2.0, "staleness/hist/3": 1.0}
    assert all(isinstance(v, float) for v in metrics.values())


def test_truncation_counts_the_samples_the_token_budget_ended() -> None:
    def sample(finish: str, turns: float | None = None, error: str | None = None) -> Sample:
        return Sample.from_lists([5, 6], [-0.1, -0.2], 0, 0.0, {} if turns is None else {"turns": turns}, finish, error)

    def group(*samples: Sample) -> RolloutGroup:
        return RolloutGroup.from_lists("r", "g", 0, [1, 2], list(samples), "s", 0.0)

    single = [group(sample("length"), sample("stop"), sample("length", error="ValueError: x")), group(sample("stop"))]
    assert truncation_metrics(single, None) == {"batch/truncated_fraction": pytest.approx(1 / 3)}  # the failed sample is left out
    # episodes of at most 3 turns: the budget ended the first two; max_turns the third; the environment the last
    episodes = [group(sample("length", 1.0), sample("length", 2.0), sample("length", 3.0), sample("stop", 1.0))]
    assert truncation_metrics(episodes, 3) == {"batch/truncated_fraction": pytest.approx(2 / 4)}
    assert truncation_metrics([group(sample("length", error="E: x"))], None) == {"batch/truncated_fraction": 0.0}


@pytest.mark.redis
@pytest.mark.dist
def test_an_image_bomb_in_the_queue_is_dead_lettered_and_the_feed_goes_on(redis_url: str, one_rank: DistInfo) -> None:
    run = f"feed-{uuid.uuid4().hex[:8]}"
    good, other = make_groups(2, seed=23, run=run)
    bomb = RolloutGroup.from_lists(run, "bomb", 7, [3, 4], list(good.samples), "s", 0.0,
                                   images=[ImageRef("b" * 64, 30000, 30000)])
    limits = Limits(64, 512, max_image_pixels=1024 * 1024)
    with ReplayQueue(redis_url, run, max_depth=64) as queue:
        queue.put_images([("b" * 64, bomb_png(30000, 30000))], ttl_s=600)
        for g in (bomb, good, other):
            queue.put(g)
        reader = QueueReader(queue, limits, max_staleness=1, batch_size=2, read_timeout_s=0.2, takes_images=True,
                             model_path="tiny-vlm", run_name=run)
        data = BatchFeed(one_rank.rank, one_rank.device, limits, reader).next(2, 0, Hooks(), deadline=time.monotonic() + 30)
        assert data is not None and [f.screened.group.group_id for f in data.fed] == [good.group_id, other.group_id]
        assert queue.stats()["dead_lettered"] == 1
