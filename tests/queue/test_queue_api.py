"""ReplayQueue against a real redis-server, one process: the API contract."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import redis
from queue_workers import make_group
from reply_cutter import ReplyCutter

from async_rl.queue import Drop, EmbeddedRedis, QueueUnavailableError, ReplayQueue, Staleness, Ticket, TicketEndedError
from async_rl.queue.admission import IDLE_LOOP_TTL_MS, admission_limit
from async_rl.records import Failure, FailureReport, RolloutGroup, decode, encode


@pytest.mark.redis
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


@pytest.mark.redis
def test_get_returns_what_it_has_at_timeout(queue: ReplayQueue, run: str) -> None:
    queue.put(make_group(0, run=run))
    start = time.monotonic()
    got = queue.get(5, timeout=0.4)
    assert len(got) == 1
    assert time.monotonic() - start >= 0.4


@pytest.mark.redis
def test_each_entry_goes_to_one_consumer(queue: ReplayQueue, redis_url: str, run: str) -> None:
    for i in range(4):
        queue.put(make_group(i, run=run))
    with ReplayQueue(redis_url, run) as other:
        mine = queue.get(2, timeout=1.0)
        theirs = other.get(10, timeout=0.3)
    assert len(mine) == 2 and len(theirs) == 2
    assert {g.group_id for _, g in mine}.isdisjoint(g.group_id for _, g in theirs)


@pytest.mark.redis
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


@pytest.mark.redis
def test_only_an_entry_holding_an_admission_slot_gives_one_back(queue: ReplayQueue, redis_url: str, run: str) -> None:
    """Poison entries written straight into the stream took no admission slot, so dead-lettering
    them gives none back (it used to: 3 of them left ``groups_started - version * B`` at -3 at
    the end of a run), nor does dropping a group put without a ticket; a dropped ticketed group
    gives its slot back, and reconciling counts only the entries that hold one."""
    raw = redis.Redis.from_url(redis_url)
    batch = 2
    tickets = queue.admit(batch, 1, "server-0", limit=3)
    assert [t.index for t in tickets] == [0, 1, 2] and queue.stats()["groups_started"] == 3
    for t in tickets:
        queue.put(make_group(t.index, version=0, run=run), t)
    for i in range(3):
        raw.xadd(queue.keys.rollouts, {"group": b"\xc1poison %d" % i})
    queue.put(make_group(7, version=0, run=run))  # outside admission: no slot

    got = queue.get(7, timeout=0.5)
    assert sorted(g.prompt_id for _, g in got) == [0, 1, 2, 7]
    stats = queue.stats()
    assert stats["dead_lettered"] == 3 and stats["groups_started"] == 3  # the poison held no slot

    by_prompt = {g.prompt_id: (entry_id, g) for entry_id, g in got}
    queue.drop([(*by_prompt[7], Drop("stale", "test")), (*by_prompt[2], Drop("stale", "test"))])
    assert queue.stats()["groups_started"] == 2  # group 2's slot back, none for group 7

    queue.commit([by_prompt[0][0]])  # trained: its slot stays counted
    found = queue.reconcile(0, batch)
    assert (found.queued, found.groups_started) == (1, 1)  # group 1 pending: holds a slot; the trained one is gone
    queue.commit([by_prompt[1][0]])
    found = queue.reconcile(1, batch)
    assert found.groups_started == 1 * batch  # the ledger balances: groups_started - version * B - left == 0
    raw.close()


@pytest.mark.redis
def test_stale_groups_are_dropped_counted_and_acknowledged(queue: ReplayQueue, run: str) -> None:
    for i, version in enumerate([5, 4, 3, 1, 0]):
        queue.put(make_group(i, version=version, run=run))

    got = queue.get(5, Staleness(version=5, max_staleness=2), timeout=0.5)

    assert [g.behaviour_version for _, g in got] == [5, 4, 3]
    stats = queue.stats()
    assert stats["dropped_stale"] == 2
    assert stats["pending"] == 3
    assert {g.group_id for _, g in queue.recover(include_own=True)} == {"g0", "g1", "g2"}


@pytest.mark.redis
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


def _admit_all(queue: ReplayQueue, batch_size: int, max_staleness: int, tries: int = 20) -> list[Ticket]:
    return [t for _ in range(tries) for t in queue.admit(batch_size, max_staleness, "test")]


@pytest.mark.redis
def test_admission_rule_single_producer(queue: ReplayQueue) -> None:
    first = _admit_all(queue, batch_size=4, max_staleness=1)
    assert len(first) == (0 + 1 + 1) * 4
    queue.publish_version(2)
    second = _admit_all(queue, batch_size=4, max_staleness=1)
    assert len(second) == 2 * 4
    assert [t.index for t in first + second] == list(range(16))  # each admission claims the next prompt
    stats = queue.stats()
    assert stats["groups_started"] == 16 and stats["inflight"] == 16 and stats["prompt_cursor"] == 16
    with pytest.raises(ValueError):
        queue.publish_version(-1)


@pytest.mark.redis
def test_the_admission_limit_is_the_scripts_bound(queue: ReplayQueue) -> None:
    """``admission_limit`` (what the driver and the feed compute) is the bound the Lua script admits to."""
    for version, eta, batch in ((0, 0, 3), (2, 1, 4), (5, 3, 2)):
        queue.publish_version(version)
        _admit_all(queue, batch_size=batch, max_staleness=eta, tries=50)
        assert queue.stats()["groups_started"] == admission_limit(version, eta, batch)


@pytest.mark.redis
def test_a_call_gets_at_most_its_producers_share_of_a_batch(queue: ReplayQueue) -> None:
    """With the producers recorded (the driver's pool: servers x worker loops), one admission
    call gets at most ceil(B / producers): a version opens B slots and each loop gets its
    share, rather than the first to ask taking them all for its free slots; the rule's bound
    is unchanged, and a loop asks again for more."""
    assert len(queue.admit(8, 0, "a", limit=8)) == 8  # none recorded: as many as the rule allows
    queue.publish_version(1)
    queue.set_producers(3)
    assert [len(queue.admit(8, 0, owner, limit=8)) for owner in "abcd"] == [3, 3, 2, 0]  # ceil(8 / 3), then what is left
    queue.publish_version(2)
    queue.set_producers(16)
    assert len(queue.admit(8, 0, "a", limit=8)) == 1
    with pytest.raises(ValueError, match="at least 1 producer"):
        queue.set_producers(0)


@pytest.mark.redis
def test_a_loop_holding_its_share_of_the_window_gets_no_more(queue: ReplayQueue) -> None:
    """With the producers recorded, a loop holding ceil((eta + 1) x B / producers) open
    tickets gets none until it holds fewer (a slot the others would otherwise wait a version
    for), and one holding fewer gets the difference at most; the shares round up, so loops
    that all ask fill the window (B 4, eta 1, 3 loops: a share of 3, the window 8)."""
    queue.set_producers(3)
    assert len(queue.admit(4, 1, "a", limit=8, held=0)) == 2  # ceil(4 / 3) a call
    assert len(queue.admit(4, 1, "a", limit=8, held=2)) == 1  # its share of the window: 3
    assert queue.admit(4, 1, "a", limit=8, held=3) == []
    got = [len(queue.admit(4, 1, owner, limit=8, held=held)) for owner, held in (("b", 0), ("b", 2), ("c", 0))]
    assert got == [2, 1, 2]  # the window's 8: a 3, b 3, c 2 (what is left)
    assert queue.admit(4, 1, "c", limit=8, held=2) == []  # the rule's bound, as before
    with pytest.raises(ValueError, match="held=-1"):
        queue.admit(4, 1, "a", held=-1)


@pytest.mark.redis
def test_a_refused_idle_loop_gets_the_next_slot_before_busy_ones(queue: ReplayQueue) -> None:
    """An idle loop (no open ticket: a new or replaced server) that admission refuses is
    recorded; while it keeps asking, busy loops leave it a slot, so the next one opened goes
    to an accelerator with nothing to do. Once it stops asking (its entry expires) the busy
    loops get the slots again (B 4, eta 0, 2 loops: a share of 2 a call and of the window)."""
    queue.set_producers(2)
    assert len(queue.admit(4, 0, "a", limit=8, held=0)) == 2
    assert len(queue.admit(4, 0, "b", limit=8, held=0)) == 2
    assert queue.admit(4, 0, "new", limit=8, held=0) == []  # the window is full: "new" waits, recorded
    queue.publish_version(1)  # 4 slots open
    assert len(queue.admit(4, 0, "a", limit=8, held=0)) == 2  # idle too (its groups were put): its share
    assert len(queue.admit(4, 0, "b", limit=8, held=1)) == 1  # one of the two left...
    assert queue.admit(4, 0, "b", limit=8, held=1) == []  # ...the other is kept for "new"
    assert len(queue.admit(4, 0, "new", limit=8, held=0)) == 1
    assert queue.client.zcard(queue.keys.idle) == 0
    queue.publish_version(2)
    assert len(queue.admit(4, 0, "late", limit=8, held=0)) == 2  # slots open: an idle loop is served, not recorded
    assert len(queue.admit(4, 0, "a", limit=8, held=0)) == 2  # the window is full again
    queue.client.zadd(queue.keys.idle, {"gone": 0})  # a loop that stopped asking long ago
    assert queue.admit(4, 0, "new2", limit=8, held=0) == []
    assert queue.client.zrange(queue.keys.idle, 0, -1) == [b"new2"]  # the next refusal dropped the old entry
    assert 0 < queue.client.pttl(queue.keys.idle) <= IDLE_LOOP_TTL_MS  # and the set expires unless one asks again


@pytest.mark.redis
def test_raise_version_never_lowers_the_published_version(queue: ReplayQueue) -> None:
    """The driver's watchdog races the learner's announcements: it may only raise the version."""
    queue.publish_version(5)
    assert not queue.raise_version(4) and not queue.raise_version(5) and queue.stats()["version"] == 5
    assert queue.raise_version(7) and queue.stats()["version"] == 7


@pytest.mark.redis
def test_a_waiting_producer_wakes_on_a_published_version_and_only_on_a_rise(queue: ReplayQueue) -> None:
    """Producers on a closed admission block on the versions stream (no 20 ms polling): a rise,
    by the learner or the watchdog, wakes them at once; the same or a lower version does not;
    a version published before the wait began still wakes a waiter that passes its last id."""
    start = time.monotonic()
    assert queue.wait_for_version("0-0", 0.3) == "0-0" and time.monotonic() - start >= 0.3  # none published: the timeout
    queue.publish_version(1)
    seen = queue.wait_for_version("0-0", 5.0)
    assert seen != "0-0"
    for same_or_lower in (lambda: queue.publish_version(1), lambda: queue.publish_version(0), lambda: queue.raise_version(0)):
        same_or_lower()
        assert queue.wait_for_version(seen, 0.2) == seen
    queue.publish_version(3)  # before the wait: its id is newer than the waiter's
    start = time.monotonic()
    newer = queue.wait_for_version(seen, 5.0)
    assert newer != seen and time.monotonic() - start < 1.0
    assert queue.raise_version(4) and queue.wait_for_version(newer, 5.0) != newer
    assert queue.client.xlen(queue.keys.versions) == 3


@pytest.mark.redis
def test_one_call_admits_as_many_as_the_rule_allows_returned_prompts_first(queue: ReplayQueue) -> None:
    first = queue.admit(5, 0, "server-0#0", limit=3)
    assert [t.index for t in first] == [0, 1, 2] and len({t.claim for t in first}) == 3
    assert queue.abandon(first[1], return_prompt=True)
    rest = queue.admit(5, 0, "server-0#0", limit=8)  # 5 - 2 open: three more, prompt 1 first
    assert [t.index for t in rest] == [1, 3, 4] and queue.admit(5, 0, "server-0#0", limit=8) == []
    stats = queue.stats()
    assert stats["groups_started"] == 5 and stats["inflight"] == 5 and stats["prompt_cursor"] == 5
    with pytest.raises(ValueError, match="limit=0"):
        queue.admit(5, 0, "server-0#0", limit=0)


@pytest.mark.redis
def test_a_ticket_ends_once_and_returned_prompts_are_served_first(queue: ReplayQueue, run: str) -> None:
    t0, t1, t2 = _admit_all(queue, batch_size=3, max_staleness=0)
    assert queue.admit(3, 0, "test") == []
    queue.put(make_group(0, run=run), t0)
    assert queue.abandon(t1, return_prompt=True)  # e.g. the worker stopped: prompt 1 comes back
    assert queue.abandon(t2, return_prompt=False)  # e.g. filtered by dynamic sampling: prompt 2 is done
    assert not queue.abandon(t2, return_prompt=True)  # a second end changes nothing
    with pytest.raises(TicketEndedError):
        queue.put(make_group(1, run=run), t1)
    stats = queue.stats()
    assert stats["groups_started"] == 1 and stats["inflight"] == 0 and stats["returned_prompts"] == 1
    assert [t.index for t in _admit_all(queue, batch_size=3, max_staleness=0)] == [1, 3]


@pytest.mark.redis
def test_dropped_groups_give_admission_slots_back(queue: ReplayQueue, run: str) -> None:
    (ticket,) = _admit_all(queue, batch_size=1, max_staleness=0)
    queue.put(make_group(0, version=0, run=run), ticket)  # 3 versions behind the reader: dropped at eta = 0
    assert queue.get(1, Staleness(version=3, max_staleness=0), timeout=0.3) == []
    assert queue.stats()["groups_started"] == 0 and queue.last_screen.dropped == {"stale": 1}


@pytest.mark.redis
def test_future_groups_are_dropped_counted_and_their_prompts_served_again(queue: ReplayQueue, run: str) -> None:
    # A learner resumed at version 2 (eta = 1) meets groups of weights up to version 5 that a
    # crashed run generated after its last checkpoint: |2 - v| <= 1 is trained, the rest not.
    tickets = _admit_all(queue, batch_size=2, max_staleness=2)  # (0 + 2 + 1) * 2 = 6 slots
    versions = [1, 2, 3, 4, 5, 0]
    for ticket, version in zip(tickets, versions):
        queue.put(make_group(ticket.index, version=version, run=run), ticket)
    got = queue.get(6, Staleness(version=2, max_staleness=1), timeout=0.5)
    assert [g.behaviour_version for _, g in got] == [1, 2, 3]
    report = queue.last_screen
    assert report.dropped == {"future": 2, "stale": 1}
    assert report.trailing == {"stale": 1}  # a future drop loses nothing: not a sign of "nothing trainable"
    stats = queue.stats()
    assert stats["dropped"] == {"future": 2, "stale": 1} and stats["pending"] == 3 and stats["depth"] == 0
    assert stats["groups_started"] == 3  # the dropped groups' slots are free again
    # The future groups' prompts (3, 4) come back and are claimed before new ones; the stale one (5) counts as done.
    assert queue._client.lrange(queue.keys.returned, 0, -1) == [b"3", b"4"]
    assert [t.index for t in _admit_all(queue, batch_size=2, max_staleness=2)] == [3, 4, 6]


@pytest.mark.redis
def test_drop_after_reading_releases_like_a_drop_at_read_time(queue: ReplayQueue, run: str) -> None:
    (ticket,) = _admit_all(queue, batch_size=1, max_staleness=0)
    queue.put(make_group(ticket.index, version=7, run=run), ticket)
    ((entry_id, group),) = queue.recover(include_own=True) or queue.get(1, timeout=0.5)
    drop = Staleness(version=0, max_staleness=2).judge(group)
    assert drop is not None and drop.reason == "future" and drop.return_prompt
    queue.drop([(entry_id, group, drop)])
    stats = queue.stats()
    assert (stats["pending"], stats["groups_started"], stats["dropped"], stats["returned_prompts"]) == (0, 0, {"future": 1}, 1)
    assert queue.last_screen.dropped == {"future": 1} and not queue.last_screen.trailing


@pytest.mark.redis
def test_check_drops_or_dead_letters_and_reports_the_run_of_drops(queue: ReplayQueue, run: str) -> None:
    for i in range(5):
        queue.put(make_group(i, run=run))

    def check(group: RolloutGroup, payload: bytes) -> Drop | None:
        assert decode(payload) == group  # the record as read, for a consumer that passes it on
        return {"g1": Drop("reward_error", "boom"), "g3": Drop("bad_token", "id 999", dead_letter=True),
                "g4": Drop("reward_error", "boom")}.get(group.group_id)

    got = queue.get(5, timeout=0.5, check=check)
    assert [g.group_id for _, g in got] == ["g0", "g2"]
    report = queue.last_screen
    assert report.kept == 2 and report.dropped == {"reward_error": 2, "bad_token": 1} and report.trailing == {"reward_error": 1, "bad_token": 1}
    stats = queue.stats()
    assert stats["dropped"] == {"reward_error": 2} and stats["dead_lettered"] == 1 and stats["pending"] == 2
    dead = queue._client.xrange(queue.keys.dead)
    assert dead[0][1][b"reason"] == b"bad_token: id 999"


@pytest.mark.redis
def test_reconcile_returns_orphaned_prompts_and_recounts_started_groups(queue: ReplayQueue, run: str) -> None:
    tickets = _admit_all(queue, batch_size=4, max_staleness=1)  # 8 admitted; the producer then "dies"
    for t in tickets[:3]:
        queue.put(make_group(t.index, run=run), t)
    found = queue.reconcile(version=1, batch_size=4)  # a checkpoint at version 1 holds 4 trained groups
    assert (found.returned, found.queued, found.groups_started_before, found.groups_started) == (5, 3, 8, 1 * 4 + 3)
    stats = queue.stats()
    assert stats["version"] == 1 and stats["inflight"] == 0 and stats["returned_prompts"] == 5
    # The returned prompts come first, in order; then the cursor goes on.
    assert [t.index for t in _admit_all(queue, batch_size=4, max_staleness=1)] == [3, 4, 5, 6, 7]
    with pytest.raises(TicketEndedError):  # a producer of the killed run cannot put anymore
        queue.put(make_group(3, run=run), tickets[3])


@pytest.mark.redis
def test_a_live_reconcile_keeps_the_running_producers_tickets(queue: ReplayQueue, run: str) -> None:
    """A learner restarted from its checkpoint while the workers run: their tickets stay open and count."""
    tickets = _admit_all(queue, batch_size=4, max_staleness=1)  # 8 admitted
    for t in tickets[:3]:
        queue.put(make_group(t.index, run=run), t)
    found = queue.reconcile(version=0, batch_size=4, live=True)
    assert (found.returned, found.queued, found.groups_started_before, found.groups_started) == (0, 3, 8, 0 * 4 + 3 + 5)
    stats = queue.stats()
    assert stats["version"] == 0 and stats["inflight"] == 5 and stats["returned_prompts"] == 0
    for t in tickets[3:]:  # the running producers' puts still land
        queue.put(make_group(t.index, run=run), t)
    assert queue.stats()["groups_started"] == 8


@pytest.mark.redis
def test_release_owner_ends_only_the_dead_producers_tickets(queue: ReplayQueue, run: str) -> None:
    dead = queue.admit(10, 0, "server-0#1", limit=3)
    [alive] = queue.admit(10, 0, "server-0#10")  # a name that starts like the dead one's is not matched
    queue.put(make_group(0, run=run), dead[0])
    assert queue.release_owner("server-0#1") == 2
    assert queue.release_owner("server-0#1") == 0  # nothing left: a second call changes nothing
    stats = queue.stats()
    assert stats["inflight"] == 1 and stats["groups_started"] == 2 and stats["returned_prompts"] == 2
    with pytest.raises(TicketEndedError):  # a late put of the dead producer cannot land
        queue.put(make_group(1, run=run), dead[1])
    queue.put(make_group(3, run=run), alive)
    assert [t.index for t in _admit_all(queue, batch_size=10, max_staleness=0)][:2] == [1, 2]
    with pytest.raises(ValueError, match="owner"):
        queue.release_owner("server 0")


@pytest.mark.redis
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


@pytest.mark.redis
def test_stats_reports_oldest_age(queue: ReplayQueue, run: str) -> None:
    stats = queue.stats()
    assert set(stats) == {
        "depth", "pending", "dead_lettered", "dropped_stale",
        "oldest_age_s", "version", "groups_started", "prompt_cursor", "dropped", "inflight", "returned_prompts",
    }
    assert stats["oldest_age_s"] == 0.0
    queue.put(make_group(0, run=run))
    time.sleep(0.2)
    assert 0.15 < queue.stats()["oldest_age_s"] < 5.0


@pytest.mark.redis
def test_wrong_password_fails_fast(redis_url: str, run: str) -> None:
    bad_url = redis_url.replace("://:", "://:wrong", 1)
    start = time.monotonic()
    with pytest.raises(redis.AuthenticationError):
        ReplayQueue(bad_url, run, op_timeout_s=10.0)
    assert time.monotonic() - start < 2.0  # not retried


def test_rejects_non_redis_url(run: str) -> None:
    with pytest.raises(ValueError, match="redis://"):
        ReplayQueue("http://127.0.0.1:1/", run)


@pytest.mark.redis
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


@pytest.mark.redis
def test_a_retried_admission_returns_the_same_ticket(queue: ReplayQueue) -> None:
    """A retry after a lost reply (same call id) must not claim a second prompt."""
    ledger = queue._ledger
    [first] = ledger.admit(4, 0, "test", call_id="call-1")
    assert ledger.admit(4, 0, "test", call_id="call-1") == [first]
    [second] = ledger.admit(4, 0, "test", call_id="call-2")
    assert second.index == first.index + 1
    more = ledger.admit(4, 0, "test", call_id="call-3", limit=9)
    assert [t.index for t in more] == [2, 3] and ledger.admit(4, 0, "test", call_id="call-3", limit=9) == more
    stats = queue.stats()
    assert stats["groups_started"] == 4 and stats["inflight"] == 4


@pytest.mark.redis
def test_get_rides_out_a_redis_stall_longer_than_the_socket_timeout(redis_url: str, run: str) -> None:
    """A reply slower than the socket timeout (an fsync, a loaded machine) is retried for
    ``op_timeout_s``, even when the get's own wait is shorter: it is not a dead Redis."""
    with ReplayQueue(redis_url, run, max_depth=8, socket_timeout_s=0.5, op_timeout_s=10.0) as q:
        redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", 1500, "ALL")
        start = time.monotonic()
        assert q.get(1, Staleness(0, 0), timeout=0.2) == []
        assert 1.0 < time.monotonic() - start < 10.0


@pytest.mark.redis
def test_failure_reports_round_trip_and_undecodable_entries_are_skipped(queue: ReplayQueue, redis_url: str, run: str) -> None:
    """Servers on any node report their failed samples through the queue; the driver reads
    them after a cursor, and an entry that is not a report is counted, never decoded as code."""
    assert queue.last_failure_id() == "0-0"
    reports = [FailureReport(Failure("reward_timeout", "RewardTimeout: 5 s", "r.py:3 in f", "2+2"), "server-0", f"{run}:1", k, 1.0)
               for k in range(3)]
    queue.report_failures(reports[:2])
    cursor, read, bad = queue.read_failures("0-0")
    assert read == reports[:2] and bad == 0
    redis.Redis.from_url(redis_url).xadd(f"{run}:failures", {b"report": b"\x93not a report"})
    queue.report_failures(reports[2:])
    cursor, read, bad = queue.read_failures(cursor)
    assert read == reports[2:] and bad == 1
    assert queue.read_failures(cursor)[1:] == ([], 0) and queue.last_failure_id() == cursor


@pytest.mark.redis
def test_every_write_retried_after_a_lost_reply_applies_once(redis_url: str, run: str) -> None:
    """Each script call's reply is lost once (a real proxy cuts the connection after Redis
    ran it); the queue retries on a new connection with the same call id. The ledger, the
    counters and the streams change once, and the retry returns the first reply."""
    cutter = ReplyCutter(redis_url)
    try:
        with ReplayQueue(cutter.url, run, max_depth=64) as q:
            def lost(op: Any) -> Any:
                cutter.arm()
                before = cutter.cuts
                result = op()
                assert cutter.cuts == before + 1  # the first reply really was lost
                return result

            tickets = [t for _ in range(4) for t in lost(lambda: q.admit(4, 0, "server-0#1"))]
            assert [t.index for t in tickets] == [0, 1, 2, 3] and q.stats()["groups_started"] == 4
            assert lost(lambda: q.abandon(tickets[3], return_prompt=True)) is True  # not "already ended"
            assert q.stats()["groups_started"] == 3
            for t, version in zip(tickets[:2], (0, 3)):
                q.put(make_group(t.index, version=version, run=run), t)

            # The learner drops both groups (one stale, one dead-lettered) in one script.
            def check(group: RolloutGroup, payload: bytes) -> Drop | None:
                return Drop("bad_token", "id 999", dead_letter=True) if group.group_id == "g1" else None

            assert lost(lambda: q.get(2, Staleness(version=3, max_staleness=0), timeout=0.5, check=check)) == []
            stats = q.stats()
            assert stats["groups_started"] == 1 and stats["dropped_stale"] == 1 and stats["dead_lettered"] == 1
            assert q._client.xlen(q.keys.dead) == 1 and stats["pending"] == 0

            assert lost(lambda: q.release_owner("server-0#1")) == 1  # ticket 2 was still open
            assert q.stats()["groups_started"] == 0 and q._client.lrange(q.keys.returned, 0, -1) == [b"3", b"2"]

            q.put(make_group(9, run=run))
            (entry_id, _), = q.get(1, timeout=0.5)
            assert lost(lambda: q.commit([entry_id])) == 1 and q.stats()["pending"] == 0

            lost(lambda: q.add_rollout_stats({"groups_put": 2.0}))
            assert q.rollout_stats() == {"groups_put": 2.0}
            report = FailureReport(Failure("reward_error", "ValueError: x", "r.py:1 in f", "1+1"), "server-0", f"{run}:1", 0, 1.0)
            lost(lambda: q.report_failures([report]))
            assert q.read_failures("0-0")[1] == [report]

            found = lost(lambda: q.reconcile(version=0, batch_size=4))
            assert (found.returned, found.groups_started_before, found.groups_started, found.returned_waiting) == (0, 0, 0, 2)
    finally:
        cutter.close()
