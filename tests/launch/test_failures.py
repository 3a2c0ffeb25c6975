"""The driver's failure log: every report on file, each distinct failure once on the console, rate-limited."""

from __future__ import annotations

import json
from pathlib import Path

from async_rl.launch.failures import CONSOLE_LINES_PER_MINUTE, ENV_FILE, REWARD_FILE, FailureLog
from async_rl.records import Failure, FailureReport


def _report(kind: str, signature: str, where: str = "", sample: int = 0) -> FailureReport:
    return FailureReport(Failure(kind, signature, where, input="x = 1/0", traceback="Traceback ..."), "server-0", "run:7", sample, 1.0)


def test_each_distinct_failure_is_printed_once_and_every_one_is_on_file(tmp_path: Path) -> None:
    log = FailureLog(tmp_path)
    first = [_report("reward_error", "ZeroDivisionError: division by zero", "my_reward.py:12 in score", k) for k in range(3)]
    lines = log.ingest(first + [_report("env_timeout", "EnvTimeout: Countdown.step took longer than 30 s")], now=0.0)
    assert len(lines) == 2
    assert lines[0].startswith("the reward function raised (reward_error) at my_reward.py:12 in score: ZeroDivisionError: division by zero; "
                               "input 'x = 1/0' (server-0, group run:7, sample 0)")
    assert str(tmp_path / REWARD_FILE) in lines[0] and "its group trains on its other samples" in lines[0]
    assert lines[1].startswith("an environment call timed out (env_timeout): EnvTimeout")
    # the same place in the user's code with another message (the input in it) is not new
    assert log.ingest([_report("reward_error", "ZeroDivisionError: other text", "my_reward.py:12 in score")], now=1.0) == []
    rows = [json.loads(line) for line in (tmp_path / REWARD_FILE).read_text().splitlines()]
    assert [r["sample"] for r in rows] == [0, 1, 2, 0] and rows[0]["traceback"] == "Traceback ..." and rows[0]["where"] == "my_reward.py:12 in score"
    assert len((tmp_path / ENV_FILE).read_text().splitlines()) == 1
    assert log.counts == {"reward_error": 4, "env_timeout": 1}


def test_console_lines_are_rate_limited_and_the_rest_summarised(tmp_path: Path) -> None:
    log = FailureLog(tmp_path, failed_samples="drop_group")
    many = [_report("reward_error", f"ValueError: case {k}", f"r.py:{k} in f") for k in range(CONSOLE_LINES_PER_MINUTE + 3)]
    lines = log.ingest(many, now=0.0)
    assert len(lines) == CONSOLE_LINES_PER_MINUTE and "algorithm.failed_samples=drop_group" in lines[0]
    assert log.ingest([], now=30.0) == []  # the minute is not over
    later = log.ingest([], now=61.0)
    assert later[0].startswith("3 more distinct reward/environment failures were not shown")
