"""Run ownership against a real redis-server: the run record, the driver's lease (TTL and
renewal at their defaults), and moving a run's keys aside."""

from __future__ import annotations

import threading
import time

import pytest
from queue_workers import make_group

from async_rl.config import redact_url
from async_rl.queue import ReplayQueue
from async_rl.queue.ownership import (
    LEASE_TTL_S,
    LeaseLostError,
    RunInUseError,
    RunOwnership,
    RunRecord,
)

pytestmark = [pytest.mark.redis]


def test_a_second_run_of_the_same_name_is_refused_while_the_first_holds_the_lease(redis_url: str, run: str) -> None:
    with RunOwnership(redis_url, run) as first, RunOwnership(redis_url, run) as second:
        first.acquire("run-a", "host-1")
        started = time.monotonic()
        with pytest.raises(RunInUseError) as refused:
            second.acquire("run-b", "host-2")
        assert time.monotonic() - started < 1.0  # another run's lease: refused at once
        message = str(refused.value)
        assert f"trainer.run_name={run!r}" in message and redact_url(redis_url) in message and "run-a" in message
        assert "pick another trainer.run_name" in message and "***" in message  # the password is not printed
        lease = second.lease()
        assert lease is not None and (lease.run_id, lease.owner) == ("run-a", "host-1") and 0 < lease.ttl_s <= LEASE_TTL_S
        first.release()
        second.acquire("run-b", "host-2")  # free once the first let go


def test_a_driver_whose_lease_lapsed_retakes_it_or_learns_another_took_it(redis_url: str, run: str) -> None:
    with RunOwnership(redis_url, run) as first, RunOwnership(redis_url, run) as second:
        first.acquire("run-a", "host-1")
        first._client.delete(first.keys.lease)  # it lapsed: Redis was unreachable for longer than LEASE_TTL_S
        first.renew()  # nobody took it meanwhile: renewed
        assert first.lease().owner == "host-1"  # type: ignore[union-attr]
        first._client.delete(first.keys.lease)
        second.acquire("run-b", "host-2")
        with pytest.raises(LeaseLostError, match="driver host-2 \\(run run-b\\) took"):
            first.renew()


def test_a_killed_drivers_lease_lapses_and_its_run_resumes(redis_url: str, run: str) -> None:
    with RunOwnership(redis_url, run) as killed, RunOwnership(redis_url, run) as resumed:
        killed.acquire("run-a", "host-1")
        # Its driver was SIGKILLed LEASE_TTL_S - 1.5 s ago: the lease has 1.5 s left, and nobody renews it.
        killed._client.pexpire(killed.keys.lease, 1500)
        started = time.monotonic()
        resumed.acquire("run-a", "host-2")
        assert 1.0 < time.monotonic() - started < 5.0
        assert resumed.lease() is not None and resumed.lease().owner == "host-2"  # type: ignore[union-attr]


def test_a_live_driver_of_the_same_run_keeps_it(redis_url: str, run: str) -> None:
    with RunOwnership(redis_url, run) as live, RunOwnership(redis_url, run) as second:
        live.acquire("run-a", "host-1")
        live._client.pexpire(live.keys.lease, 1500)  # its last renewal was a while ago...
        stop = threading.Event()

        def renew() -> None:
            time.sleep(1.0)
            while not stop.is_set():  # ...and it renews again, as a live driver does
                live.renew()
                stop.wait(0.5)

        renewer = threading.Thread(target=renew)
        renewer.start()
        try:
            with pytest.raises(RunInUseError, match="already running.*host-1 keeps renewing"):
                second.acquire("run-a", "host-2")
        finally:
            stop.set()
            renewer.join()
        assert second.lease().owner == "host-1"  # type: ignore[union-attr]


def test_take_over_ignores_a_lease_left_in_the_runs_own_redis(redis_url: str, run: str) -> None:
    with RunOwnership(redis_url, run) as before, RunOwnership(redis_url, run) as after:
        before.acquire("run-a", "host-1")
        after.acquire("run-b", "host-2", take_over=True)
        assert after.lease().run_id == "run-b"  # type: ignore[union-attr]
        before.release()  # not its lease any more: nothing happens
        assert after.lease() is not None
        after.release()
        assert after.lease() is None


def test_record_data_and_moving_a_run_aside(redis_url: str, run: str) -> None:
    with RunOwnership(redis_url, run) as owner, ReplayQueue(redis_url, run) as queue:
        assert owner.record() is None and not owner.holds_data()  # an opened queue alone holds nothing
        record = RunRecord("run-a", "/runs/a", "host", 1.5)
        owner.set_record(record)
        assert owner.record() == record
        queue.put(make_group(0, run=run))
        queue.put_images([("a" * 64, b"png")], ttl_s=600)
        assert owner.holds_data()
        owner.acquire("run-b", "host-2")
        moved = owner.move_aside(f"{run}.previous-run-a")
        assert moved == 4  # the record, the stream, the image, the put's dedup record
        assert owner.record() is None and not owner.holds_data() and owner.lease() is not None  # the lease stays
        with ReplayQueue(redis_url, f"{run}.previous-run-a") as old:
            assert [g.group_id for _, g in old.get(5, timeout=0.3)] == ["g0"]  # still readable under its new name
            assert 0 < old._client.pttl(old.keys.image("a" * 64)) <= 600_000  # TTLs kept
    with RunOwnership(redis_url, run) as owner, ReplayQueue(redis_url, run) as queue:  # the driver opens its queue after the move
        assert queue.get(5, timeout=0.3) == []  # the run name starts empty
        queue.put(make_group(1, run=run))
        with pytest.raises(FileExistsError, match="exist already"):
            owner.move_aside(f"{run}.previous-run-a")
