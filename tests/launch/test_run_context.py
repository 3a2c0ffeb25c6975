"""launch.run_context: the driver's queue calls wait out a full disk (pure logic: the call is a
function that fails as a Redis away for its whole timeout would)."""

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.launch.outages import Outages
from async_rl.launch.run_context import RunContext
from async_rl.queue import QueueUnavailableError


def _run(tmp_path: Path) -> RunContext:
    run = RunContext(load_config(None, []), tmp_path)
    run.outages = Outages(tmp_path, None, 60.0, run.stop, lambda line: None, run.fail, run.recoveries)
    return run


def _away_then(answers: list[object]):
    """A queue call: raises QueueUnavailableError for each ``None`` in ``answers``, then returns the next one."""
    calls = []

    def call():
        calls.append(1)
        answer = answers.pop(0)
        if answer is None:
            raise QueueUnavailableError("Redis unreachable until the deadline")
        return answer

    return call, calls


def test_a_queue_call_that_fails_while_redis_waits_for_disk_space_is_tried_again_once_it_is_back(tmp_path):
    async def main():
        run = _run(tmp_path)
        run.outages.disk_full_since = 0.0  # the embedded Redis stopped on a full disk
        call, calls = _away_then([None, {"inflight": 3}])
        asyncio.get_running_loop().call_later(1.5, lambda: setattr(run.outages, "disk_full_since", None))
        assert await run.redis(call) == {"inflight": 3}
        assert len(calls) == 2 and run.failure is None

    asyncio.run(main())


def test_a_queue_call_fails_at_once_without_a_disk_wait_and_when_the_run_stops_during_one(tmp_path):
    async def main():
        run = _run(tmp_path)
        call, calls = _away_then([None])
        with pytest.raises(QueueUnavailableError):
            await run.redis(call)  # Redis away for another reason: the caller decides
        run.outages.disk_full_since = 0.0
        call, calls = _away_then([None, "never read"])
        asyncio.get_running_loop().call_later(1.5, run.stop.set)  # a signal, or the space wait's own bound
        with pytest.raises(QueueUnavailableError):
            await run.redis(call)
        assert len(calls) == 1

    asyncio.run(main())
