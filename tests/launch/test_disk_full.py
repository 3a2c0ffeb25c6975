"""A run whose disk fills up (issue 42): `async-rl train` with its output directory on a small
tmpfs of its own, which a filler file then fills while it trains, at default settings.

The embedded Redis cannot write its append-only file and exits, or the learner cannot write
(whichever writes first); the console names the full disk within 10 s; the run waits (longer than queue.timeout_s, so the learner and the driver
lose the queue meanwhile) instead of failing, and once the filler is removed it restarts Redis
on its AOF, restarts what lost the queue from its checkpoint, and reaches its last step with
every group trained once and no prompt lost. Before, Redis was restarted once into the same
full disk, "could not be restarted" showed its start-up banner, and the run exited 1.

It mounts a tmpfs (root, as CI runs): the test fails, naming why, where mounting is not allowed.
"""

from __future__ import annotations

import errno
import subprocess
import time
from pathlib import Path

import pytest
from run_helpers import assert_ledger, lineage, start_train, step_versions, wait_for_version, wait_gone, write_config

from async_rl.queue.embedded import MIN_FREE_BYTES

pytestmark = pytest.mark.integration

DISK_MB = 512
"""The run's disk: room for what the pre-start check asks (2 checkpoints, a 128 MB AOF reserve, 256 MB of logs)."""
FULL_FOR_S = 90.0
"""How long the disk stays full: past queue.timeout_s (60 s), so every client of the queue gives up once."""


@pytest.fixture()
def small_disk(tmp_path: Path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"this test mounts a tmpfs (run it as root, as CI does): {mounted.stderr}"
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(filler: Path) -> None:
    """Write ``filler`` until its disk has no byte left (the run writes meanwhile: no size is known in advance)."""
    with open(filler, "wb", buffering=0) as f:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096, b"\0"):
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


def test_a_full_disk_is_named_waited_out_and_the_run_finishes(tiny_assets, tmp_path, small_disk):
    steps = 24
    run_dir = small_disk / "run"  # the console's log (train.log, beside the config) is on another disk, as a terminal is
    config = write_config(tiny_assets, tmp_path, steps, trainer={"save_every": 4, "val_every": 0, "output_dir": str(run_dir)},
                          rollout={"openai_api": False})
    proc = start_train(config)
    try:
        wait_for_version(proc, run_dir, 8)
        filler = small_disk / "filler"
        _fill(filler)
        filled, printed = time.monotonic(), len(proc.output())
        proc.wait_printed("is full", since=printed, timeout_s=120)
        named_s = time.monotonic() - filled
        at_full = max(step_versions(run_dir), default=0)
        time.sleep(max(0.0, FULL_FOR_S - (time.monotonic() - filled)))
        assert proc.poll() is None, f"the run ended while its disk was full:\n{proc.output()[-3000:]}"
        filler.unlink()
        output = proc.wait_output(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert named_s <= 10.0, named_s
    said = output[printed:]
    # Whichever writer meets the full disk first names it: the embedded Redis (its AOF) or the
    # learner (a checkpoint, its metrics); both wait, then go on.
    redis_named = f"the disk of {run_dir / 'redis'} (mounted at {small_disk}) is full" in said
    learner_named = f"the disk of {run_dir} (mounted at {small_disk}) has " in said and "the learner stopped:" in said
    assert redis_named or learner_named, said[-3000:]
    assert "the run waits up to 10 min" in said, said[-3000:]
    assert "disk space is back after" in said, said[-3000:]
    assert not redis_named or "restarted on its append-only file" in said, said[-3000:]
    print(f"disk full named after {named_s:.1f} s at step {at_full}; MIN_FREE_BYTES={MIN_FREE_BYTES}")
    assert sorted(lineage(run_dir)) == list(range(1, steps + 1))
    assert_ledger(run_dir, config)
    assert wait_gone(run_dir) == []
