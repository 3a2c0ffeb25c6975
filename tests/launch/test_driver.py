"""The driver's handling of a learner step's metrics, without the processes it starts: a
learning check reaches the driver's console once and its flag every metrics sink; the
learner group's hang bound."""

from __future__ import annotations

import asyncio
import json

from async_rl.config import load_config
from async_rl.launch.driver import _Run
from async_rl.launch.learner_group import HangBound
from async_rl.launch.learning_checks import WINDOW_STEPS
from async_rl.launch.tracking import Tracker


def test_a_learning_check_is_said_on_the_console_once_and_flagged_in_every_step(tmp_path, capsys):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "logging.console=true", "logging.wandb.enable=false",
                             "rollout.max_response_length=4"])
    driver = _Run(cfg)
    run, reporter = driver.run, driver.reporter
    run.tracker = Tracker(cfg, tmp_path, 100)

    async def rollout_now() -> dict[str, float]:  # the queue's counters: no Redis here
        return {}

    reporter.rollout_now = rollout_now
    try:
        for version in range(1, 2 * WINDOW_STEPS + 1):  # every response cut at the budget, step after step
            asyncio.run(reporter.log_step({"version": float(version), "perf/tokens_per_s": 1.0, "batch/truncated_fraction": 1.0}))
    finally:
        run.tracker.close()
    console = capsys.readouterr().out
    said = [line for line in console.splitlines() if line.startswith("warn/token_budget: ")]
    assert len(said) == 1 and "rollout.max_response_length=4" in said[0], console[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flags = [r["warn/token_budget"] for r in records]
    assert flags == [0.0] * (WINDOW_STEPS - 1) + [1.0] * (WINDOW_STEPS + 1)
    assert all(r["warn/is_weights_clipped"] == 0.0 for r in records)


def test_the_learner_hang_bound_forgets_a_slow_first_call_once_a_later_one_finished(tmp_path):
    """``trainer.learner_hang_timeout_s`` (50 s) is the floor; 10x it while a learner group's
    first call (the model's load) runs; 3x that first call until a later call finished; then
    3x the slowest later call. A load slowed to 120 s by a busy machine once stretched the bound
    of every step after it to 360 s (CI: a SIGSTOPped rank not named within 300 s)."""
    bound = HangBound(load_config(None, [f"trainer.output_dir={tmp_path}"]).trainer.learner_hang_timeout_s)
    assert bound.bound_s() == 500.0
    bound.record(120.0)
    assert bound.bound_s() == 360.0
    bound.record(5.0)
    assert bound.bound_s() == 50.0
    bound.record(30.0)
    assert bound.bound_s() == 90.0
    bound.record(10.0)
    assert bound.bound_s() == 90.0  # the slowest later call, not the last
