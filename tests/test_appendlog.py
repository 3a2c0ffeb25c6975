"""Whole lines or none: a write cut short by a full disk leaves no part of a line behind,
and a held line is written, in order, once the file takes lines again.

A short write is provoked without root or a mount: ``RLIMIT_FSIZE`` (in a subprocess, so the
test process keeps its own limit) makes the kernel write up to the limit and fail the rest
with EFBIG, as a disk that fills mid-write does with ENOSPC. ``/dev/full`` refuses every byte.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

from async_rl.appendlog import HeldLines, append_lines

CUT_SHORT = """
import json, os, resource, signal, sys
from async_rl.appendlog import append_lines
path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's default (to die)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    append_lines(path, ["x" * 300])
except OSError as exc:
    print(json.dumps({"errno": exc.errno, "size": os.path.getsize(path)}))
"""


def test_a_write_cut_short_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    append_lines(path, [json.dumps({"version": 1}), json.dumps({"version": 2})])
    before = path.read_bytes()
    # Room for 100 bytes more: the kernel writes them, then refuses the rest of the 301.
    out = subprocess.run([sys.executable, "-c", CUT_SHORT, str(path), str(len(before) + 100)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)
    assert said == {"errno": errno.EFBIG, "size": len(before)}, said  # EFBIG; cut back to the lines before
    assert path.read_bytes() == before
    append_lines(path, [json.dumps({"version": 3})])  # the next writer's line starts a line of its own
    assert [json.loads(line)["version"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_nothing_to_write_touches_nothing(tmp_path: Path) -> None:
    append_lines(tmp_path / "none.jsonl", [])
    assert not (tmp_path / "none.jsonl").exists()


def test_held_lines_go_first_and_in_order_once_the_file_takes_them(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.symlink_to("/dev/full")  # every write: ENOSPC
    out = HeldLines(path)
    exc = out.write(["a"])
    assert exc is not None and exc.errno == errno.ENOSPC and out.failing
    assert out.write(["b", "c"]) is not None and out.held == ["a", "b", "c"] and out.write_errors == 2
    path.unlink()  # the disk takes lines again
    assert out.write(["d"]) is None and not out.failing and out.held == []
    assert path.read_text().splitlines() == ["a", "b", "c", "d"]


def test_past_its_bound_the_oldest_held_lines_go_and_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.symlink_to("/dev/full")
    out = HeldLines(path, max_held=3)
    for line in "abcde":
        out.write([line])
    assert out.held == ["c", "d", "e"] and out.dropped == 2


def test_the_failure_log_holds_rows_a_full_disk_refused(tmp_path: Path) -> None:
    from async_rl.launch.failures import REWARD_FILE, FailureLog
    from async_rl.records import Failure, FailureReport

    name = REWARD_FILE
    report = FailureReport(Failure("reward_error", "ValueError: x", "r.py:1 in f", input="", traceback=""), "server-0", "run:1", 0, 1.0)
    (tmp_path / name).symlink_to("/dev/full")
    log = FailureLog(tmp_path)
    lines = log.ingest([report], now=0.0)
    assert any("cannot be written" in line and "held" in line for line in lines), lines
    assert not any("cannot be written" in line for line in log.ingest([], now=1.0))  # said once per outage
    (tmp_path / name).unlink()
    log.ingest([], now=2.0)  # no new report: the held row is written all the same
    assert [json.loads(line)["sample"] for line in (tmp_path / name).read_text().splitlines()] == [0]
