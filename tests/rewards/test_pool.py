"""The reward process pool on real processes and signals: in-process timeouts, process-group kills,
growth, crashes, kwargs, the start-up probe, cleanup."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import process_alive

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
import re
import signal
import subprocess
import time


def hang_on_request(reward_inputs):
    for item in reward_inputs:
        if item["ground_truth"] == "hang":
            time.sleep(3600)
        if item["ground_truth"] == "spin":
            spin_forever()
    return [{"overall": float(item["response"] == item["ground_truth"])} for item in reward_inputs]


def spin_forever():
    n = 0
    while True:
        n += 1


def stuck_in_c(reward_input, pid_file=""):
    """Sequential. "regex": catastrophic backtracking, C code holding the GIL; "blocked": a
    subprocess, then every signal blocked and a sleep; "hang": a plain sleep."""
    truth = reward_input["ground_truth"]
    if truth == "regex":
        re.match(r"(a+)+$", "a" * 60 + "b")
    if truth == "blocked":
        child = subprocess.Popen(["sleep", "600"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        time.sleep(3600)
    if truth == "hang":
        time.sleep(3600)  # a plain hang
    return {"overall": float(reward_input["response"] == truth)}


def swallows_the_interrupt(reward_inputs):
    try:
        time.sleep(3600)
    except BaseException:
        pass
    return [{"overall": 1.0} for _ in reward_inputs]


def slow(reward_inputs, delay_s):
    time.sleep(delay_s)
    return [{"overall": 1.0} for _ in reward_inputs]


def start_a_subprocess(reward_inputs, pid_file):
    child = subprocess.Popen(["sleep", "600"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    return [{"overall": 1.0} for _ in reward_inputs]


def exit_on_request(reward_inputs):
    if any(item["ground_truth"] == "exit" for item in reward_inputs):
        os._exit(1)
    return [{"overall": 1.0} for _ in reward_inputs]


def always_raises(reward_inputs):
    return helper_that_fails(reward_inputs)


def helper_that_fails(reward_inputs):
    raise KeyError("no such field: solution_str")


def fails_on_empty(reward_inputs):
    for item in reward_inputs:
        if not item["response"]:
            raise ValueError("empty response")
    return [{"overall": float(item["response"] == item["ground_truth"])} for item in reward_inputs]


def hangs_on_empty(reward_inputs):
    if any(not item["response"] for item in reward_inputs):
        time.sleep(3600)
    return [{"overall": float(item["response"] == item["ground_truth"])} for item in reward_inputs]


def math_verify_reward(reward_inputs):
    """A real checker that times itself with signal.alarm (SIGALRM) in the worker's main thread."""
    from math_verify import parse, verify

    return [{"overall": float(verify(parse(item["ground_truth"]), parse(item["response"])))} for item in reward_inputs]


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
    return RewardConfig(function=f"{path}:{name}", **{"num_workers": 1, **kw})


def _inputs(*pairs: tuple[str, str], length: int = 4) -> list[dict]:
    return [{"response": r, "response_length": length, "ground_truth": g} for r, g in pairs]


def _line(path: Path, text: str) -> int:
    """The line number of the first line of ``path`` that contains ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("hang", ["hang", "spin"])
def test_a_hang_fails_only_its_input_and_the_process_lives_on(rewards, hang):
    """A sleeping or CPU-spinning hang on one input of a batch call: the timer interrupts it
    in the worker (no new process), the call is rescored one input per call, and only the
    hanging input fails, with the file and line it was interrupted at."""
    async def go():
        with RewardPool(_cfg(rewards, "hang_on_request", timeout_s=1.0)) as pool:
            scorer = RewardScorer(pool, pool.cfg, max_response_length=16)
            assert [s.reward for s in await scorer.score(_inputs(("1", "1")))] == [1.0]
            pid = pool.pids()[0]
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            t0 = time.monotonic()
            scores = await scorer.score(_inputs(("a", "a"), ("b", hang), ("c", "d")))
            elapsed = time.monotonic() - t0
            ticker.cancel()
            assert ticks >= 10  # the loop ran other tasks meanwhile
            assert [s.reward for s in scores] == [1.0, 0.0, 0.0]
            assert scores[0].failure is None and scores[2].failure is None
            failure = scores[1].failure
            assert failure.kind == "reward_timeout" and failure.input == "b"
            assert failure.signature == "RewardTimeout: the reward function ran longer than rollout.reward.timeout_s=1 s; the timer interrupted it"
            if hang == "hang":
                assert failure.where == f"{rewards}:{_line(rewards, 'time.sleep(3600)')} in hang_on_request"
                assert "time.sleep(3600)" in failure.traceback
            else:
                assert failure.where.startswith(f"{rewards}:") and failure.where.endswith(" in spin_forever")
                assert "in hang_on_request" in failure.traceback and "in spin_forever" in failure.traceback
            # the batch call and then the hanging input alone: two timer interrupts, no kill; the
            # process lives on (the other inputs, rescored meanwhile, may have grown the pool)
            assert (pool.interrupted, pool.killed, pool.restarts) == (2, 0, 0) and pid in pool.pids()
            assert 2.0 <= elapsed < 4.0
            assert (scorer.counters.errors, scorer.counters.timeouts) == (1, 1)
            assert [s.reward for s in await scorer.score(_inputs(("x", "x")))] == [1.0]  # the next call works

    asyncio.run(go())


def test_sequential_hangs_are_timed_per_input_and_c_code_is_killed_with_its_process_group(rewards, tmp_path):
    """Sequential: the worker times each input. A sleep is interrupted in-process; C code
    holding the GIL (a backtracking regex) and a function that blocks every signal are
    killed with their process group (a subprocess the function started dies too), and the
    rest of the call goes on in a fresh process."""
    pid_file = tmp_path / "child.pid"

    async def go():
        cfg = _cfg(rewards, "stuck_in_c", type="sequential", timeout_s=1.0, kwargs={"pid_file": str(pid_file)})
        with RewardPool(cfg, kill_grace_s=1.0) as pool:
            scorer = RewardScorer(pool, cfg, max_response_length=16)
            scores = await scorer.score(_inputs(("a", "a"), ("b", "hang"), ("c", "c"), ("d", "regex"), ("e", "blocked"), ("f", "f")))
            assert [s.reward for s in scores] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
            assert [s.failure.kind if s.failure else None for s in scores] == [None, "reward_timeout", None, "reward_timeout", "reward_timeout", None]
            assert scores[1].failure.where == f"{rewards}:{_line(rewards, '# a plain hang')} in stuck_in_c"
            for killed in scores[3:5]:
                assert "its process group was killed" in killed.failure.signature and killed.failure.where == ""
            assert (pool.interrupted, pool.killed, pool.restarts) == (1, 2, 2)
            child = int(pid_file.read_text())
            deadline = time.monotonic() + 2.0
            while process_alive(child) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not process_alive(child)  # the function's subprocess died with the process group
            assert [s.reward for s in await scorer.score(_inputs(("g", "g")))] == [1.0]

    asyncio.run(go())


def test_an_interrupt_the_function_swallows_still_fails_the_input(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "swallows_the_interrupt", timeout_s=0.5)) as pool:
            with pytest.raises(RewardTimeout, match="the timer interrupted it") as info:
                await pool.call(_inputs(("a", "a")))
            assert info.value.where.endswith(" in swallows_the_interrupt") and not info.value.killed
            assert (pool.interrupted, pool.killed) == (1, 0)

    asyncio.run(go())


def test_a_checker_timing_itself_with_sigalrm_works_in_the_pool(rewards):
    """math_verify times parse/verify with signal.alarm in the main thread: the worker leaves SIGALRM to it."""
    async def go():
        with RewardPool(_cfg(rewards, "math_verify_reward")) as pool:
            scorer = RewardScorer(pool, pool.cfg, max_response_length=64)
            scores = await scorer.score(_inputs(("so the answer is $\\frac{1}{2}$", "$0.5$"), ("$3$", "$4$")))
            assert [s.reward for s in scores] == [1.0, 0.0] and scorer.counters.errors == 0

    asyncio.run(go())


@pytest.mark.slow
def test_hung_calls_do_not_hold_the_workers_other_calls_need(rewards):
    """Default timeout_s and growth: with the only worker hung, a clean call gets a new
    process after grow_after_s and returns long before the hang's timeout; the hung input
    fails alone after timeout_s (the batch call, then the input alone)."""
    async def go():
        cfg = _cfg(rewards, "hang_on_request")
        assert (cfg.timeout_s, cfg.max_workers) == (5.0, 32)
        with RewardPool(cfg) as pool:
            scorer = RewardScorer(pool, cfg, max_response_length=16)
            await scorer.score(_inputs(("w", "w")))  # the first worker is up
            t0 = time.monotonic()
            hung = asyncio.create_task(scorer.score(_inputs(("a", "a"), ("b", "hang"))))
            await asyncio.sleep(0.1)
            assert [s.reward for s in await scorer.score(_inputs(("c", "c"), ("d", "d")))] == [1.0, 1.0]
            clean_s = time.monotonic() - t0
            assert clean_s < 4.0 and pool.workers == 2
            scores = await hung
            hung_s = time.monotonic() - t0
            assert [s.reward for s in scores] == [1.0, 0.0] and scores[1].failure.kind == "reward_timeout"
            assert 10.0 <= hung_s < 13.0 and (pool.interrupted, pool.killed) == (2, 0)

    asyncio.run(go())


def test_the_pool_grows_while_calls_wait_and_retires_idle_extras(rewards):
    async def go():
        cfg = _cfg(rewards, "slow", max_workers=3, kwargs={"delay_s": 2.0})
        with RewardPool(cfg, extra_idle_s=1.0) as pool:
            seen: set[int] = set()

            async def watch():
                while True:
                    seen.update(pool.pids())
                    await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch())
            t0 = time.monotonic()
            await asyncio.gather(*(pool.call(_inputs(("a", "a"))) for _ in range(5)))
            # 5 calls of 2 s: 1 worker would take 10 s; it grew to the 3 allowed
            assert pool.peak_workers == 3 and len(seen) == 3 and time.monotonic() - t0 < 8.0
            await asyncio.sleep(1.5)  # the extras idle past extra_idle_s
            watcher.cancel()
            assert pool.workers == 1 and pool.restarts == 0
            await asyncio.sleep(0.2)
            assert [pid for pid in seen if process_alive(pid)] == pool.pids()

    asyncio.run(go())


def test_a_queue_of_fast_calls_does_not_grow_the_pool(rewards):
    """Many groups in flight wait in line for fast calls (longer than grow_after_s in all), but
    each call is short: new interpreters would only take CPU from generation."""
    async def go():
        with RewardPool(_cfg(rewards, "slow", num_workers=2, kwargs={"delay_s": 0.02})) as pool:
            await pool.call(_inputs(("a", "a")))  # both workers started
            await asyncio.gather(*(pool.call(_inputs(("a", "a"))) for _ in range(150)))  # ~1.5 s of queue
            assert pool.peak_workers == 2

    asyncio.run(go())


def test_processes_still_starting_do_not_grow_the_pool(tmp_path: Path):
    """Calls that wait for workers still loading the function (here 1.5 s, an interpreter
    on a busy machine) are not held by slow calls: the pool does not grow meanwhile."""
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(1.5)\n\n\ndef score(batch):\n    return [{'overall': 1.0} for _ in batch]\n")

    async def go():
        with RewardPool(RewardConfig(function=f"{path}:score", num_workers=2)) as pool:
            await asyncio.gather(*(pool.call(_inputs(("a", "a"))) for _ in range(20)))
            assert pool.peak_workers == 2 and pool.restarts == 0

    asyncio.run(go())


def test_worker_death_is_reported_and_replaced(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "exit_on_request")) as pool:
            with pytest.raises(RewardWorkerDied, match="exit code 1"):
                await pool.call(_inputs(("a", "exit")))
            assert pool.restarts == 1
            assert await pool.call(_inputs(("a", "b"))) == [{"overall": 1.0}]
            # through the scorer: only the input the process died on fails
            scores = await RewardScorer(pool, pool.cfg, 16).score(_inputs(("a", "b"), ("c", "exit")))
            assert [s.failure.kind if s.failure else None for s in scores] == [None, "reward_error"]
            assert scores[1].failure.signature.startswith("RewardWorkerDied: ")

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
        assert f"rollout.reward.function={rewards}:compute_score" in message and "all 6 start-up probe inputs" in message
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


def test_always_raising_function_fails_the_startup_probe_naming_each_input(rewards):
    async def go():
        with RewardPool(_cfg(rewards, "always_raises", num_workers=2)) as pool:
            with pytest.raises(RewardStartupError) as info:
                await check_reward_function(RewardScorer(pool, pool.cfg, 16), ["1", "2", "3", "4", "5"])
        message = str(info.value)
        assert "failed on all 12 start-up probe inputs" in message
        where = f"(at {rewards}:{_line(rewards, 'raise KeyError')} in helper_that_fails)"
        for response, truth in [("1", "1"), ("", "1"), ("2", "1"), ("4", "4"), ("", "4"), ("1", "4")]:
            assert f"  response {response!r} for ground truth {truth!r}: KeyError: 'no such field: solution_str' {where}" in message
        assert message.count("Traceback in the reward process") == 1  # one distinct error
        assert "in helper_that_fails" in message and 'raise KeyError("no such field: solution_str")' in message

    asyncio.run(go())


def test_the_probe_accepts_a_function_that_fails_on_some_inputs_only(rewards):
    """Fails on the empty response only: accepted; the probe sends varied responses."""
    async def go():
        with RewardPool(_cfg(rewards, "fails_on_empty")) as pool:
            await check_reward_function(RewardScorer(pool, pool.cfg, 16), ["4", "4", "7"])

    asyncio.run(go())


def test_the_probe_accepts_a_function_that_hangs_on_the_empty_response_at_default_settings(rewards):
    """The issue's case: refused at start before, because every probe sent the empty
    response. The probe returns on the first input that scores, cancelling the hung calls,
    so it costs less than the default timeout_s."""
    async def go():
        with RewardPool(_cfg(rewards, "hangs_on_empty")) as pool:
            t0 = time.monotonic()
            await check_reward_function(RewardScorer(pool, pool.cfg, 16), ["1", "2", "3", "4"])
            assert time.monotonic() - t0 < pool.cfg.timeout_s
            assert pool.interrupted == 0 and pool.killed == 0

    asyncio.run(go())


def test_sequential_function_is_called_per_sample_with_kwargs(rewards):
    async def go():
        cfg = _cfg(rewards, "one_sample", type="sequential", kwargs={"bonus": 0.5})
        with RewardPool(cfg) as pool:
            assert await pool.call(_inputs(("a", "a"), ("a", "b"))) == [{"overall": 1.5}, {"overall": 0.5}]

    asyncio.run(go())


def test_load_failure_is_a_call_error_not_a_hang(tmp_path):
    async def go():
        with RewardPool(RewardConfig(function=f"{tmp_path / 'missing.py'}:f", num_workers=1)) as pool:
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


def test_close_kills_the_process_groups(rewards, tmp_path):
    pid_file = tmp_path / "child.pid"

    async def go():
        pool = RewardPool(_cfg(rewards, "start_a_subprocess", num_workers=2, kwargs={"pid_file": str(pid_file)}))
        pool.start()
        await pool.call(_inputs(("a", "a")))
        return pool

    pool = asyncio.run(go())
    pids = pool.pids()
    child = int(pid_file.read_text())
    assert len(pids) == 2 and process_alive(child)
    pool.close()
    assert not any(process_alive(pid) for pid in pids)
    deadline = time.monotonic() + 2.0
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child)


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
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5.0
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(p) for p in pids)
