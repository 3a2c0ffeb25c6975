"""Runs that always finish or say why (issue: run reliability), as a user runs them:
`async-rl train` in a subprocess on the tiny assets, with real Redis, Ray, vLLM and learner.

- a run of a LoRA policy (``learner.lora``: the adapter is what is trained, sent, checkpointed,
  resumed and served by the OpenAI API) SIGKILLed and resumed reaches its last step, training every group once and
  neither skipping nor repeating a prompt (the ledger is reconciled at each start), and the
  resume sweeps what a killed checkpoint save left, naming it on the console; its embedded
  Redis and then its learner rank, SIGKILLed during the last run, are restarted (Redis on
  its AOF, the learner from its checkpoint) and the run goes on; so is the new learner rank
  once SIGSTOPped (hung: named on the console within trainer.learner_hang_timeout_s = 50 s at
  default settings); `trainer.resume=off` and `=fresh` over a finished run are checked on
  the whole-pipeline run of tests/test_end_to_end.py;
- a reward function that fails on every probe stops the run before anything starts;
- a reward function that hangs on some samples costs those samples, not the run (the
  resumed run above uses one, at the default timeout);
- one that hangs on every real sample (default settings) is named on the console, a
  heartbeat comes while no step does, and the run stops with exit 1 naming reward_timeout;
- a run in which nothing progresses exits 1 and says what each side waits for: checked on the
  fresh run of tests/test_end_to_end.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from async_rl.config import TrainerConfig
from async_rl.learner.checkpoint import export_hf
from safetensors.torch import load_file
from run_helpers import (assert_ledger, lineage, process_alive, queue_state, redis_pid, start_train, step_versions, train_cli, wait_for_version,
                         wait_gone, write_config)

pytestmark = [pytest.mark.integration, pytest.mark.assets, pytest.mark.slow]


def _reward_file(tmp_path: Path, body: str) -> str:
    """``path:compute_score`` of a batch reward function whose per-item score is ``body``
    (an expression of ``item``, which may also sleep or raise)."""
    path = tmp_path / "reward.py"
    path.write_text(
        "import time\n\n"
        "def fail(message):\n    raise ValueError(message)\n\n"
        "def compute_score(reward_inputs):\n"
        f"    return [{{'overall': {body}}} for item in reward_inputs]\n"
    )
    return f"{path}:compute_score"


@pytest.mark.redis
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timed
def test_sigkill_and_resume_reach_the_last_step_every_time(tiny_assets, tmp_path):
    # About one response in ten ends in 3: scoring it hangs until the worker's timer interrupts
    # it (rollout.reward.timeout_s, default), which costs those samples, not the run.
    reward = _reward_file(tmp_path, "(time.sleep(3600) if item['response'].strip().endswith('3') else float(item['response'].strip() == item['ground_truth']))")
    steps = 12  # the SIGSTOP at 8 must land before the end: up to 12 queued groups (3 steps) train in seconds
    config = write_config(tiny_assets, tmp_path, steps, trainer={"save_every": 3, "val_every": 0},
                          rollout={"reward": {"function": reward}},
                          learner={"lora": {"rank": 8}, "optim": {"lr": 1e-3}})
    run_dir = tmp_path / "run"
    # Killed after a checkpoint (3), with trained-but-uncommitted steps (4, 5) and groups queued.
    # (tests/launch/test_live_run.py kills a driver and resumes too: during a drain, full weights.)
    proc = start_train(config)
    wait_for_version(proc, run_dir, 5)
    # The OpenAI API (on by default) answers with the trained adapter of the version the server holds.
    api = json.loads((run_dir / "servers.json").read_text())["servers"][0]["openai_url"]
    cards = json.loads(urllib.request.urlopen(f"{api}/models", timeout=30).read())["data"]
    served = [c["root"] for c in cards if c["root"].startswith("async-rl://policy/v")]
    assert len(served) == 1 and int(served[0].rsplit("v", 1)[1]) >= 1, cards
    proc.kill()
    proc.wait(30)
    assert wait_gone(run_dir) == [], "the killed run left processes behind"
    # What a save SIGKILLed before its commit leaves (tests/learner/test_checkpoint.py makes it
    # for real): the resume sweeps it and says so on the driver's console.
    debris = run_dir / "checkpoints" / ".tmp-step_00000006"
    (debris / "model").mkdir(parents=True, exist_ok=True)  # the run killed at 5 may have been saving 6: real debris
    (debris / "model" / "__0_0.distcp").write_bytes(b"half a shard")
    logged = len(step_versions(run_dir))  # the run killed at 5 may have logged 6 as it died
    proc = start_train(config)
    wait_for_version(proc, run_dir, 6, since=logged)
    killed = redis_pid(run_dir)
    os.kill(killed, signal.SIGKILL)  # the queue's server dies mid-run: the driver restarts it on its AOF
    wait_for_version(proc, run_dir, 7, since=logged)
    rank0 = json.loads((run_dir / "servers.json").read_text())["learners"][0]["pid"]
    os.kill(rank0, signal.SIGKILL)  # a learner rank dies: the learner restarts from the step-6 checkpoint
    proc.wait_printed("learner restarted at version 6", timeout_s=600)
    wait_for_version(proc, run_dir, 8, since=logged)  # two calls of the new group done: its hang bound is max(60 s, 3x the slowest)
    rank0 = json.loads((run_dir / "servers.json").read_text())["learners"][0]["pid"]
    os.kill(rank0, signal.SIGSTOP)  # a learner rank hangs (alive, answering nothing): restarted as a dead one is, at default settings
    stopped, printed = time.monotonic(), len(proc.output())
    proc.wait_printed("declared hung", since=printed, timeout_s=300)
    noticed_s = time.monotonic() - stopped
    output = proc.wait_output(600)
    assert proc.returncode == 0, output[-3000:]
    assert noticed_s <= TrainerConfig().learner_hang_timeout_s + 1.0, noticed_s  # the default bound runs from the call's start, before the hang
    assert re.search(r"learner rank 0 answered no call for \d+ s \(trainer.learner_hang_timeout_s, or 3x the slowest call so far\): "
                     r"declared hung; restarting the learner from its last checkpoint \(restart 2 of trainer.max_restarts=3\)", output), output[-3000:]
    assert not process_alive(rank0)
    assert f"checkpoints: removed {debris}: a checkpoint save that did not complete" in output, output[-3000:]
    assert not debris.exists()
    assert f"the embedded Redis (pid {killed}) stopped (killed by SIGKILL); restarted on its append-only file" in output, output[-3000:]
    assert "learner rank 0 died" in output and "restarting the learner from its last checkpoint (restart 1 of trainer.max_restarts=3)" in output
    assert "learner restarted at version 6" in output, output[-3000:]
    last = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "perf/tokens_per_s" in r][-1]
    assert last["queue/redis_restarts"] == 1.0 and last["learner/restarts"] == 2.0

    final = sorted((run_dir / "checkpoints").iterdir())[-1]
    saved = json.loads((final / "state.json").read_text())
    assert saved["version"] == steps and saved["lora"]["rank"] == 8  # an adapter-only checkpoint of the resumed line
    export_hf(final, tmp_path / "adapter")  # the adapter as a PEFT directory (`async-rl export` in process: tests/test_end_to_end.py runs the command)
    adapter_bytes = sum(t.nbytes for t in load_file(tmp_path / "adapter" / "adapter_model.safetensors").values())
    updates = {r["sync/update_bytes"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "sync/update_bytes" in r}
    assert updates - {0.0} == {adapter_bytes}, (updates, adapter_bytes)  # every update sent the adapter, nothing else (0: none sent)
    steps_run = lineage(run_dir)
    assert len(steps_run) == steps
    entries = [e for line in steps_run.values() for e in line["entry_ids"]]
    assert len(entries) == len(set(entries)) == 4 * steps  # each group trained once into the final model
    assert_ledger(run_dir, config)
    # At the default timeout a hung sample is known 2 x 5 s after its group's call began (the batch
    # call, then its own): these runs take a few seconds a step, so how many are known by the end
    # varies. Every one known is a timeout at the hanging line, and never stopped the run.
    failures = [json.loads(line) for line in (run_dir / "reward_errors.jsonl").read_text().splitlines()] \
        if (run_dir / "reward_errors.jsonl").exists() else []
    assert all(f["kind"] == "reward_timeout" and f["input"].strip().endswith("3") for f in failures), failures[:2]


def test_a_reward_function_failing_every_probe_stops_before_starting(tiny_assets, tmp_path):
    config = write_config(tiny_assets, tmp_path, 4, rollout={"reward": {"function": _reward_file(tmp_path, "fail('no score')")}})
    start = time.monotonic()
    proc = train_cli(config, timeout_s=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rollout.reward.function" in proc.stderr and "ValueError: no score" in proc.stderr and "Traceback" in proc.stderr
    assert not (tmp_path / "run" / "redis").exists()  # nothing was started
    assert time.monotonic() - start < 120


@pytest.mark.vllm
@pytest.mark.redis
@pytest.mark.ray
def test_a_reward_that_hangs_on_every_answer_stops_the_run_and_says_so(tiny_assets, tmp_path):
    """At default settings, a reward function that hangs on every non-empty response passes the
    start-up probe (it scores the empty one), then: the console names the timeout, a heartbeat
    says what each side does while no step comes, and the run stops naming reward_timeout
    (not another cause); the summary counts the rollout side's reward errors."""
    reward = _reward_file(tmp_path, "(time.sleep(3600) if item['response'].strip() else 0.0)")
    config = write_config(tiny_assets, tmp_path, 4, rollout={"reward": {"function": reward}}, trainer={"val_every": 0})
    proc = train_cli(config, timeout_s=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "the reward function timed out (reward_timeout) at " in proc.stdout, output[-3000:]
    beats = [line for line in proc.stdout.splitlines() if line.startswith("no learner step for ")]
    assert beats and "reward errors" in beats[-1] and "learner at version 0 waits for 4 groups" in beats[-1], output[-3000:]
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert "nothing is trainable" in error and "reward_timeout:" in error and "longer than rollout.reward.timeout_s" in error, error
    assert "raises" not in error, error
    counted = re.search(r"reward errors \(of them timeouts\)\D*(\d+) \((\d+)\)", proc.stdout)
    assert counted and int(counted[1]) == int(counted[2]) > 0, proc.stdout[-2000:]
    rows = (tmp_path / "run" / "reward_errors.jsonl").read_text().splitlines()
    assert rows and all(json.loads(r)["kind"] == "reward_timeout" for r in rows)
    state = queue_state(tmp_path / "run", config)
    assert state["stats"]["pending"] == 0  # every dropped entry was acknowledged
    assert state["stats"]["dropped"]["reward_timeout"] >= 40  # min(100, 10 x batch 4)
    assert wait_gone(tmp_path / "run") == []
