"""`async-rl train` end to end on the tiny setup: real Redis, Ray, vLLM, FSDP2 learner, W&B offline.

Runs the CLI in a subprocess (as a user would) and checks that the pipeline really ran. A
SIGTERM while Redis does not answer (a final checkpoint, nothing left running) is checked on
the shared run of tests/launch/test_live_run.py. The whole pipeline's run is then resumed with
``trainer.resume=off`` (refused) and ``=fresh`` (a new run beside the old, moved aside), which
then stalls (a reward function that hangs) and exits saying what each side waits for.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from control_attack import attack, tap_frame
from listening import Listener, table, tree_listeners
from run_helpers import (
    ROOT,
    lineage,
    queue_state,
    start_train,
    step_versions,
    train_cli,
    wait_for_version,
    wait_gone,
    write_config,
)
from wandb_records import history

from async_rl.launch.plots import PLOTS
from async_rl.launch.ray_cluster import LOOPBACK

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.ray, pytest.mark.vllm, pytest.mark.assets, pytest.mark.slow]


def test_train_runs_the_whole_pipeline(tiny_assets, tmp_path):
    """The quickstart end to end, with a reward function (EasyR1 batch form) that raises on the
    responses ending in 7: only those samples are left out, and the console names the error.
    While it trains, every process of the run (Ray's daemons, the driver, the learner, the
    server and its vLLM processes, Redis) listens on 127.0.0.1 only (docs/security.md, "Ports"),
    and an intruder sends the weight sender's control socket garbage, a forged Hello, an
    oversized frame and a real server's frame read off the wire: the run trains to the end,
    each is counted and named on the console, and no server is replaced. A served model
    (``models.judge``) runs beside it: listed in ``servers.json``, its API on loopback, its
    metrics in every step, its processes gone with the run's; it is also the run's
    distillation teacher (``algorithm.distill``, with the task reward and its top 5 at every
    position), scoring every sample."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(items):\n"
                      "    return [score(i) for i in items]\n\n\n"
                      "def score(item):\n"
                      "    if item['response'].strip().endswith('7'):\n"
                      "        raise ValueError('cannot parse ' + item['response'])\n"
                      "    return {'overall': float(item['response'].strip() == item['ground_truth'])}\n")
    # A served model beside the policy (models.judge, no core of its own): started, listed, listening on loopback, stopped.
    judge = {"judge": {"model_path": str(tiny_assets.model_dir), "cpus_per_server": 0, "vllm": {"max_model_len": 256}}}
    # It also teaches (algorithm.distill, the task reward weighted in, its top 5 a position): the same tiny model, so the
    # policy's tokenizer.
    config = write_config(tiny_assets, tmp_path, steps=4, rollout={"reward": {"function": f"{reward}:compute_score"}}, models=judge,
                          algorithm={"distill": {"teacher": "judge", "reward_coef": 1.0, "top_k": 5}})
    run_dir = tmp_path / "run"
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with out.open("w") as stdout, err.open("w") as stderr:
        running = subprocess.Popen([sys.executable, "-m", "async_rl.cli", "train", str(config)], cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
    intrusion: dict[str, object] = {}
    intruder = threading.Thread(target=_intrude, args=(run_dir, intrusion), daemon=True)
    intruder.start()
    try:
        found = _listeners_until_the_first_step(running, run_dir)
        running.wait(timeout=900)
    finally:
        running.kill()
        intruder.join(60)
    proc = subprocess.CompletedProcess(running.args, running.returncode, out.read_text(), err.read_text())
    (tmp_path / "train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = " ".join(x.name for x in found)
    assert all(n in names for n in ("gcs_server", "raylet", "LearnerActor", "InferenceServer", "redis-server")), table(found)
    assert [x for x in found if x.address != LOOPBACK] == [], table(found)
    assert "run summary" in proc.stdout
    failures = [json.loads(line) for line in (run_dir / "reward_errors.jsonl").read_text().splitlines()]
    assert failures and all(f["kind"] == "reward_error" and f["input"].strip().endswith("7") for f in failures)
    assert failures[0]["where"] == f"{reward}:7 in score" and "ValueError: cannot parse" in failures[0]["traceback"]
    named = [line for line in proc.stdout.splitlines() if line.startswith("the reward function raised (reward_error)")]
    assert len(named) == 1 and f"at {reward}:7 in score: ValueError: cannot parse" in named[0], proc.stdout[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/tokens_per_s" in r]
    vals = [r for r in records if "val/greedy_accuracy" in r]
    assert [r["version"] for r in steps] == [1, 2, 3, 4]  # versions advanced
    assert all(r["staleness/max"] <= 2 for r in steps)  # every trained group within eta
    assert vals[0]["version"] == 0 and vals[-1]["version"] == 4  # servers generated with the new weights
    assert vals[0]["val/max_version"] == 0  # the baseline ran before the first update: the starting weights alone
    assert (run_dir / "resolved_config.yaml").is_file()
    servers = json.loads((run_dir / "servers.json").read_text())["servers"]
    assert [s["server_id"] for s in servers] == ["server-0"] and servers[0]["openai_url"].startswith("http://127.0.0.1:")
    assert f"OpenAI-compatible API: {servers[0]['openai_url']}" in proc.stdout
    served = json.loads((run_dir / "servers.json").read_text())["models"]
    assert [(s["model"], s["server_id"]) for s in served] == [("judge", "judge-0")] and served[0]["openai_url"].startswith("http://127.0.0.1:")
    assert steps[-1]["models/judge/servers"] == 1.0 and steps[-1]["models/judge/failed"] == 0.0 and steps[-1]["models/actor_restarts"] == 0.0
    assert all("distill/reverse_kl" in r for r in steps) and steps[-1]["models/judge/requests"] >= 16 * 4  # every sample scored
    # The top 5 travelled with every sample to the loss (the teacher is the starting policy: the term starts near 0).
    assert all(math.isfinite(r["actor/distill_top_k_kl"]) for r in steps) and abs(steps[0]["actor/distill_top_k_kl"]) < 0.01
    assert steps[-1]["rollout/teacher_errors"] == 0.0
    # W&B holds every record, the validations (which arrive after later steps) included.
    rows = history(run_dir)
    assert len(rows) == len(records) and "Tried to log to step" not in proc.stdout + proc.stderr
    assert [(r["version"], r["val/greedy_accuracy"]) for _, r in rows if "val/greedy_accuracy" in r] == \
           [(r["version"], r["val/greedy_accuracy"]) for r in vals]
    assert sorted(p.name for p in run_dir.glob("*.png")) == sorted(PLOTS) and "validation_accuracy.png" in proc.stdout

    counted = {k.removeprefix("sync/control_dropped/"): v for k, v in steps[-1].items() if k.startswith("sync/control_dropped/")}
    assert "sent" in intrusion and counted == intrusion["sent"], (counted, intrusion)  # nothing of the run's own was dropped
    assert "the weight sender dropped control messages" in proc.stdout and steps[-1]["rollout/server_restarts"] == 0
    dropped = steps[-1].get("counters/dropped/reward_error", 0) + 4 * steps[-1].get("queue/dropped/reward_error", 0)
    samples = sum(r["batch/samples"] for r in steps)
    assert dropped > 0 and samples / (samples + dropped) > 0.5, (samples, dropped)  # the groups' other samples trained

    learner_lines = [json.loads(line) for line in (run_dir / "learner_steps.jsonl").read_text().splitlines()]
    trained = [e for line in learner_lines for e in line["entry_ids"]]
    assert len(trained) == len(set(trained)) == 16  # 4 steps x 4 groups, none twice
    final = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert json.loads((final / "state.json").read_text())["version"] == 4
    assert wait_gone(run_dir) == []
    # What the run wrote is this user's only (docs/security.md): the AOF, logs, checkpoints, W&B files.
    readable = [f"{oct(p.stat().st_mode & 0o777)} {p}" for p in [run_dir, *run_dir.rglob("*")]
                if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert readable == [], readable[:20]
    state = queue_state(run_dir, config)
    assert state["stats"]["pending"] == 0  # every consumed entry was committed
    _export_serves_in_vllm(final, tmp_path / "export")
    _resume_off_and_fresh(config, run_dir, state, tmp_path)


def _resume_off_and_fresh(config: Path, run_dir: Path, state: dict, tmp_path: Path) -> None:
    """Over the finished run, which left groups queued (made by weights up to its last
    version): ``trainer.resume=off`` is refused before anything starts; ``trainer.resume=fresh``
    moves the run aside, intact, and trains none of the groups it left queued. The fresh run's
    reward function then hangs on every call (the test raises a flag after its second step): with
    nothing progressing for trainer.stall_timeout_s, it exits 1 saying what each side waits for."""
    assert state["queued"], "the finished run left no group queued: nothing to check a fresh start against"
    old_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    trained = sorted(lineage(run_dir))
    off = train_cli(config, "trainer.resume=off", timeout_s=300)
    assert off.returncode == 1 and "trainer.resume=fresh" in off.stderr and str(run_dir) in off.stderr, off.stderr[-2000:]
    flag = tmp_path / "hang-now"
    reward = tmp_path / "hangs_on_flag.py"
    reward.write_text("import os\nimport time\n\n\ndef compute_score(items):\n"
                      f"    if os.path.exists({str(flag)!r}):\n        time.sleep(3600)\n"
                      "    return [{'overall': float(i['response'].strip() == i['ground_truth'])} for i in items]\n")
    proc = start_train(config, "trainer.resume=fresh", "trainer.total_steps=10000", "trainer.val_every=0", f"rollout.reward.function={reward}:compute_score",
                       "rollout.reward.timeout_s=600", "trainer.stall_timeout_s=10")
    try:
        deadline = time.monotonic() + 300
        while _run_id(run_dir) in (None, old_id):  # the old run moved aside, the new one claimed the directory
            assert proc.poll() is None and time.monotonic() < deadline, proc.output()[-3000:]
            time.sleep(0.5)
        wait_for_version(proc, run_dir, 2)
        flag.touch()  # every reward call hangs from now on (at rollout.reward.timeout_s=600): nothing progresses
        output = proc.wait_output(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output[-3000:]
    assert "no progress for" in output and "trainer.stall_timeout_s=10" in output, output[-3000:]
    assert re.search(r"learner at version \d+ waits for 4 groups", output) and "groups in flight" in output, output[-3000:]
    assert wait_gone(run_dir) == []
    aside = run_dir / f"previous-{old_id}"
    assert {"checkpoints", "learner_steps.jsonl", "metrics.jsonl", "redis", "run.json"} <= {p.name for p in aside.iterdir()}
    assert sorted(lineage(aside)) == trained  # the old run, intact
    versions = sorted(lineage(run_dir))
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 2, versions
    steps_logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    staleness = [r["staleness/mean"] for r in steps_logged if "staleness/mean" in r]
    assert len(staleness) >= 2 and min(staleness) >= 0, staleness  # every group trained was generated by this run's weights
    assert "future" not in queue_state(run_dir, config)["stats"]["dropped"]  # the old groups never reached the new queue


def _run_id(run_dir: Path) -> str | None:
    """The id in the run directory's run.json, None before it is written."""
    try:
        return json.loads((run_dir / "run.json").read_text())["run_id"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def _intrude(run_dir: Path, into: dict[str, object], timeout_s: float = 600) -> None:
    """Once the run's server is up, read one of its control frames off the wire and attack the
    weight sender's control socket (:mod:`control_attack`); ``into["sent"]``: the drops it must
    cause (``into["error"]`` if it could not)."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            doc = json.loads((run_dir / "servers.json").read_text()) if (run_dir / "servers.json").exists() else {}
            if doc.get("servers") and doc.get("weight_sync_address"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("no server in servers.json")
            time.sleep(0.5)
        into["sent"] = attack(doc["weight_sync_address"], tap_frame(doc["servers"][0]["pid"]))
    except Exception as exc:  # noqa: BLE001 - reported by the test's assertion
        into["error"] = f"{type(exc).__name__}: {exc}"


def _listeners_until_the_first_step(proc: subprocess.Popen[str], run_dir: Path, timeout_s: float = 600) -> list[Listener]:
    """The listening sockets of the run's processes (:func:`listening.tree_listeners`), listed
    about once a second from the moment its servers are up (``servers.json``) until its first
    learner step is logged, the weight sync's included: all of them together."""
    found: set[Listener] = set()
    deadline = time.monotonic() + timeout_s
    while not ((run_dir / "servers.json").exists() and found and step_versions(run_dir)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run ended (exit {proc.returncode}) or took {timeout_s} s before its first step")
        if (run_dir / "servers.json").exists():
            found.update(tree_listeners(proc.pid))
        time.sleep(1.0)
    return sorted(found)


def test_the_multiturn_quickstart_trains_on_episodes(tiny_assets, tmp_path):
    """configs/multiturn_quickstart.yaml for 2 steps: groups of 3-turn episodes of the built-in
    environment reach the learner, and validation plays greedy episodes before and after. The
    environment (the seed's BaseEnvironment form) raises on about a third of second turns: those
    episodes fail alone, as env_error, named once on the console; their groups train on the rest."""
    env = tmp_path / "flaky_env.py"
    env.write_text("from async_rl.envs.builtin import AdditionFeedback\n\n\n"
                   "class Flaky(AdditionFeedback):\n"
                   "    def step(self, action):\n"
                   "        if self.turns == 1 and action.strip()[-1:] in ('1', '4', '7'):\n"
                   "            raise KeyError('no feedback for ' + action.strip())\n"
                   "        return super().step(action)\n")
    config = write_config(tiny_assets, tmp_path, steps=2, base="multiturn_quickstart.yaml", rollout={"env": {"name": f"{env}:Flaky"}})
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    (tmp_path / "train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/tokens_per_s" in r]
    assert [r["version"] for r in steps] == [1, 2]
    # env/* are deltas of the servers' counters, flushed once a second: a 2-step run may log only
    # the first few episodes, so these hold for what was logged ...
    episodes = [r for r in records if "env/turns_mean" in r]
    assert all(1.0 <= r["env/turns_mean"] <= 3.0 and r["env/timeouts"] == 0 for r in episodes)
    # ... and the trained samples show the feedback turns: one turn is at most max_turn_tokens (8)
    # plus the template's closing tokens; a second adds the feedback message and another reply.
    assert any(r["batch/response_length_max"] > 8 + 4 for r in steps), [r["batch/response_length_max"] for r in steps]
    assert [r["version"] for r in records if "val/greedy_accuracy" in r] == [0, 2]
    failures = [json.loads(line) for line in (run_dir / "env_errors.jsonl").read_text().splitlines()]
    assert failures and all(f["kind"] == "env_error" and f["where"] == f"{env}:7 in step" for f in failures), failures[:2]
    named = [line for line in proc.stdout.splitlines() if line.startswith("the environment raised (env_error)")]
    assert len(named) == 1 and f"at {env}:7 in step: KeyError" in named[0], proc.stdout[-3000:]
    assert not (run_dir / "reward_errors.jsonl").exists() and "reward_error" not in proc.stdout
    assert wait_gone(run_dir) == []

def test_the_vlm_quickstart_trains_on_images_with_vppo(tiny_vlm_assets, tmp_path):
    """configs/vlm_quickstart.yaml for 3 steps: prompts with images go through the servers, the
    queue (each image stored once) and the learner, which trains with VPPO's token selection."""
    config = write_config(tiny_vlm_assets, tmp_path, steps=3, base="vlm_quickstart.yaml")
    run_dir = tmp_path / "run"
    proc = train_cli(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/tokens_per_s" in r]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(0.4 <= r["vppo/selected_fraction"] < 1.0 and r["time/perception"] > 0 for r in steps)
    assert all(r["vppo/scale_min"] >= 0.9 - 1e-6 for r in steps)  # advantage_scaling_min of the config
    assert [r["version"] for r in records if "val/greedy_accuracy" in r] == [0, 2, 3]
    assert not any(k.startswith("counters/dropped/") and k != "counters/dropped/image_token" for r in steps for k in r)
    assert wait_gone(run_dir) == []
    state = queue_state(run_dir, config)
    started = state["stats"]["groups_started"]
    assert state["stats"]["pending"] == 0 and 0 < state["images"] <= started  # one key per image content


def _export_serves_in_vllm(checkpoint: Path, out: Path) -> None:
    """`async-rl export` of the trained checkpoint loads in vLLM with the log-probs transformers gives it."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    res = subprocess.run([sys.executable, "-m", "async_rl.cli", "export", str(checkpoint), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, seed=0)
    prompt = [1, 5, 9, 13, 2]
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True))[0].outputs[0]
    llm.llm_engine.engine_core.shutdown()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + list(got.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1)
    expected = logp.gather(1, ids[0, len(prompt) :, None])[:, 0]
    served = torch.tensor([step[t].logprob for step, t in zip(got.logprobs, got.token_ids)])
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-3)
