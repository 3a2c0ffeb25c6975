"""The reward process pool on real processes: timeouts, crashes, kwargs, start-up probe, cleanup."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_rl.config import RewardConfig
from async_rl.rewards import (
    RewardCallError,
    RewardPool,
    RewardScorer,
    RewardStartupError,
    RewardTimeout,
    RewardWorkerDied,
    check_reward_function,
)

REWARDS = '''
import os
import time


def hang_on_request(reward_inputs):
    if any(item["ground_truth"] == "hang" for item in reward_inputs):
        time.sleep(3600)
    return [{"overall": float(item["response"] == item["ground_truth"])} for item in reward_inputs]


def exit_on_request(reward_inputs):
    if any(item["ground_truth"] == "exit" for item in reward_inputs):
        os._exit(1)
    return [{"overall": 1.0} for _ in reward_inputs]


def always_raises(reward_inputs):
    return helper_that_fails(reward_inputs)


def helper_that_fails(reward_inputs):
    raise KeyError("no such field: solution_str")


def compute_score(reward_inputs, max_response_length, overlong_buffer_length, overlong_penalty_factor):
    """EasyR1's dapo reward, reduced: accuracy plus its own overlong penalty."""
    scores = []
    for item in reward_inputs:
        accuracy = 1.0 if item["response"] == item["ground_truth"] else -1.0
        start = max_response_length - overlong_buffer_length
        excess = max(item["response_length"] - start, 0)
        overlong = -min(excess / overlong_buffer_length, 1.0) * overlong_penalty_factor
        scores.append({"overall": accuracy + overlong, "accuracy": accuracy, "overlong": overlong})
    return scores


def one_sample(reward_input, bonus=0.0):
    return {"overall": float(reward_input["response"] == reward_input["ground_truth"]) + bonus}
'''


@pytest.fixture()
def rewards(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def _cfg(path: Path, name: str, **kw) -> RewardConfig:
    return RewardConfig(function=f"{path}:{name}", **{"num_workers": 1, "timeout_s": 5.0, **kw})


def _inputs(*pairs: tuple[str, str], length: int = 4) -> list[dict]:
    return [{"response": r, "response_length": length, "ground_truth": g} for r, g in pairs]


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_hung_call_times_out_is_replaced_and_the_loop_stays_responsive(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "hang_on_request", timeout_s=1.0)) as pool:
            scorer = RewardScorer(pool, pool.cfg, max_response_length=16)
            assert [s.reward for s in await scorer.score(_inputs(("1", "1"), ("2", "3")))] == [1.0, 0.0]
            old_pid = pool.pids()[0]
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            t0 = time.monotonic()
            hung = await scorer.score(_inputs(("a", "a"), ("b", "hang")))
            elapsed = time.monotonic() - t0
            ticker.cancel()
            assert 1.0 <= elapsed < 3.0
            assert ticks >= 10  # the loop ran other tasks while the call hung
            # no per-item retry after a timeout: every sample of the call carries the error
            assert all(s.reward == 0.0 and s.failure.signature.startswith("RewardTimeout: ") for s in hung)
            assert (scorer.counters.errors, scorer.counters.timeouts, scorer.pool.restarts) == (2, 2, 1)
            assert pool.pids()[0] != old_pid
            await asyncio.sleep(0.2)
            assert not _alive(old_pid)  # SIGKILLed and reaped
            assert [s.reward for s in await scorer.score(_inputs(("x", "x")))] == [1.0]  # the next call works

    asyncio.run(go())


def test_worker_death_is_reported_and_replaced(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "exit_on_request")) as pool:
            with pytest.raises(RewardWorkerDied, match="exit code 1"):
                await pool.call(_inputs(("a", "exit")))
            assert pool.restarts == 1
            assert await pool.call(_inputs(("a", "b"))) == [{"overall": 1.0}]

    asyncio.run(go())


def test_cancelled_call_kills_and_replaces_its_process(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "hang_on_request", num_workers=2)) as pool:
            await asyncio.gather(pool.call(_inputs(("a", "a"))), pool.call(_inputs(("a", "a"))))
            task = asyncio.create_task(pool.call(_inputs(("a", "hang"))))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.restarts == 1
            # both slots are free again: two concurrent calls complete
            assert await asyncio.gather(pool.call(_inputs(("a", "a"))), pool.call(_inputs(("b", "a")))) == [
                [{"overall": 1.0}], [{"overall": 0.0}]
            ]

    asyncio.run(go())


def test_easyr1_dapo_function_needs_its_kwargs(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "compute_score")) as pool:
            with pytest.raises(RewardStartupError) as info:
                await check_reward_function(RewardScorer(pool, pool.cfg, 16), ["1", "2"])
        message = str(info.value)
        assert f"rollout.reward.function={rewards}:compute_score" in message
        assert "missing 3 required positional arguments" in message and "rollout.reward.kwargs" in message
        assert "Traceback" in message

        kwargs = {"max_response_length": 16, "overlong_buffer_length": 4, "overlong_penalty_factor": 1.0}
        with RewardPool(_cfg(rewards, "compute_score", kwargs=kwargs)) as pool:
            scorer = RewardScorer(pool, pool.cfg, 16)
            await check_reward_function(scorer, ["1", "2"])
            scores = await scorer.score(_inputs(("7", "7"), ("7", "8")) + _inputs(("7", "7"), length=14))
        assert [s.reward for s in scores] == pytest.approx([1.0, -1.0, 0.5])
        assert scores[2].components == {"accuracy": 1.0, "overlong": -0.5}

    asyncio.run(go())


def test_always_raising_function_fails_the_startup_probe_with_its_traceback(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "always_raises", num_workers=2)) as pool:
            with pytest.raises(RewardStartupError) as info:
                await check_reward_function(RewardScorer(pool, pool.cfg, 16), ["1", "2", "3", "4", "5"])
        message = str(info.value)
        assert "KeyError: 'no such field: solution_str'" in message and "all 4 start-up probe samples" in message
        assert "in helper_that_fails" in message and 'raise KeyError("no such field: solution_str")' in message

    asyncio.run(go())


def test_sequential_function_is_called_per_sample_with_kwargs(rewards):
    async def go():
        cfg = _cfg(rewards, "one_sample", type="sequential", kwargs={"bonus": 0.5})
        with RewardPool(cfg) as pool:
            assert await pool.call(_inputs(("a", "a"), ("a", "b"))) == [{"overall": 1.5}, {"overall": 0.5}]

    asyncio.run(go())


def test_load_failure_is_a_call_error_not_a_hang(tmp_path):
    async def go():
        with RewardPool(RewardConfig(function=f"{tmp_path / 'missing.py'}:f", num_workers=1, timeout_s=5.0)) as pool:
            with pytest.raises(RewardCallError, match="FileNotFoundError: reward function file .* not found") as info:
                await pool.call(_inputs(("a", "a")))
            assert "Traceback" in info.value.traceback_text
            assert pool.restarts == 0

    asyncio.run(go())


def test_builtin_names_resolve_in_the_worker():
    async def go():
        with RewardPool(RewardConfig(function="exact_match", num_workers=1)) as pool:
            assert await pool.call(_inputs((" 4 ", "4"))) == [{"overall": 1.0, "accuracy": 1.0}]

    asyncio.run(go())


def test_close_leaves_no_process_alive(rewards):
    async def go():
        pool = RewardPool(_cfg(rewards, "hang_on_request", num_workers=2, timeout_s=0.5))
        pool.start()
        with pytest.raises(RewardTimeout):
            await pool.call(_inputs(("a", "hang")))
        return pool

    pool = asyncio.run(go())
    pids = pool.pids()
    assert len(pids) == 2 and pool.restarts == 1
    pool.close()
    assert not any(_alive(pid) for pid in pids)


DRIVER = """
import asyncio, sys
from async_rl.config import RewardConfig
from async_rl.rewards import RewardPool


async def main():
    pool = RewardPool(RewardConfig(function=sys.argv[1], num_workers=2, timeout_s=3600.0))
    pool.start()
    hung = [asyncio.create_task(pool.call([{"response": "", "response_length": 0, "ground_truth": "hang"}])) for _ in range(2)]
    await asyncio.sleep(1.0)  # both workers are now inside the hung function, not reading their pipes
    print(" ".join(map(str, pool.pids())), flush=True)
    await asyncio.gather(*hung)


asyncio.run(main())
"""


def test_workers_die_with_a_sigkilled_parent(rewards):
    parent = subprocess.Popen([sys.executable, "-c", DRIVER, f"{rewards}:hang_on_request"], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
