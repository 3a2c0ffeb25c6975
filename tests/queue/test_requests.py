"""The run's request mailbox (``async-rl scale`` -> the driver) on a real redis-server."""

from __future__ import annotations

import pytest

from async_rl.queue import ReplayQueue
from async_rl.queue.requests import MAX_SERVERS, Requests, ScaleReply

pytestmark = [pytest.mark.redis]


def test_a_request_is_taken_once_and_answered(queue: ReplayQueue, run: str) -> None:
    asker, driver = Requests(queue.client, run), Requests(queue.client, run)
    request_id = asker.post(3, 10.0)
    assert asker.reply(request_id) is None
    taken = driver.take()
    assert taken is not None and (taken.request_id, taken.servers, taken.grace_s) == (request_id, 3, 10.0)
    assert driver.take() is None  # taken once
    driver.answer(request_id, ScaleReply(True, 3, ("server-1 added", "server-2 added")))
    assert asker.reply(request_id) == ScaleReply(True, 3, ("server-1 added", "server-2 added"))


def test_what_is_not_a_request_is_dropped_and_counted(queue: ReplayQueue, run: str) -> None:
    """Garbage and a request out of bounds pushed by hand: the driver drops and counts them, then takes the real one."""
    driver = Requests(queue.client, run)
    key = f"{run}:requests"
    queue.client.rpush(key, b"\x80\x04not json", b'{"request_id": "00", "servers": 0, "grace_s": 1, "requested_at": 0}')
    request_id = Requests(queue.client, run).post(2, 0.0)
    assert driver.take().request_id == request_id and driver.undecodable == 2


@pytest.mark.parametrize(("servers", "grace_s"), [(0, 1.0), (MAX_SERVERS + 1, 1.0), (2, -1.0)])
def test_a_request_out_of_bounds_is_refused_before_it_is_posted(queue: ReplayQueue, run: str, servers: int, grace_s: float) -> None:
    with pytest.raises(ValueError, match="scale request"):
        Requests(queue.client, run).post(servers, grace_s)
    assert Requests(queue.client, run).take() is None
