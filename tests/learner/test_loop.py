"""The learner loop with real ranks (spawned processes, gloo) and a real redis-server:
1 rank == 2 ranks, exact resume after SIGKILL with every queue entry trained once, and a
resume on another number of ranks (2 -> 1 -> 2) equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
from learner_helpers import learner_config, make_groups, start_ranks
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification

from async_rl.learner.checkpoint import checkpoint_dir, export_hf, list_checkpoints
from async_rl.queue import ReplayQueue

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.dist, pytest.mark.slow]
TIMEOUT_S = 240


def _fill(redis_url: str, run: str, groups: int) -> list[str]:
    with ReplayQueue(redis_url, run, max_depth=64) as q:
        return [q.put(g) for g in make_groups(groups, seed=7, run=run)]


def _wait(procs: list, deadline_s: float = TIMEOUT_S) -> None:
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            for q in procs:
                q.kill()
            pytest.fail("learner ranks did not finish in time")
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _train(tiny_model: Path, redis_url: str, out: Path, world_size: int, steps: int, *overrides: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    run = f"loop-{uuid.uuid4().hex[:8]}"
    _fill(redis_url, run, 4 * steps)
    cfg = learner_config(tiny_model, out, run, f"trainer.total_steps={steps}", *overrides)
    _wait(start_ranks(world_size, cfg, redis_url, out / "done"))
    export = export_hf(list_checkpoints(out)[-1], out / "export")
    lines = [json.loads(line) for line in (out / "learner_steps.jsonl").read_text().splitlines()]
    return load_file(export / "model.safetensors"), lines


def test_one_rank_and_two_ranks_give_the_same_parameters(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    # Two mini-batches: each rank's share of micro-batches differs between 1 and 2 ranks.
    common = ("learner.ppo_mini_batches=2", "learner.optim.lr=1e-4")
    one, steps_one = _train(tiny_model, redis_url, tmp_path / "one", 1, 3, *common)
    two, steps_two = _train(tiny_model, redis_url, tmp_path / "two", 2, 3, *common)
    assert [s["version"] for s in steps_two] == [1, 2, 3]
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=2e-5)
    base = load_file(tiny_model / "model.safetensors")
    assert max(float((one[k] - base[k]).abs().max()) for k in base) > 1e-4  # training moved the weights
    for a, b in zip(steps_one, steps_two):
        assert a["metrics"]["actor/pg_loss"] == pytest.approx(b["metrics"]["actor/pg_loss"], abs=1e-5)


# State beyond the policy that a resume must restore, or steps 3 and 4 give other advantages and
# weights: an adaptive KL-in-reward coefficient that moves by 40% a step, the policy's LR warm-up
# (over 3 steps), and a critic (GAE) with its optimizer and schedule.
ADAPTIVE_KL = ("algorithm.kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.5",
               "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=8", "learner.optim.warmup_steps=3",
               "algorithm.advantage.name=gae", "learner.critic.optim.lr=1e-3", "learner.critic.optim.warmup_steps=2")


Trained = tuple[dict[str, torch.Tensor], list[dict]]
"""The exported weights (name -> tensor) and the ``learner_steps.jsonl`` lines of a run."""


@pytest.fixture(scope="module")
def straight_two_ranks(tiny_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """An uninterrupted run of 4 steps on 2 ranks with :data:`ADAPTIVE_KL`, on the 16 groups
    of ``_fill`` (4 a step, in queue order): what the resume tests must reproduce."""
    return _train(tiny_model, redis_url, tmp_path_factory.mktemp("straight"), 2, 4, *ADAPTIVE_KL)


def _positions(lines: list[dict], ids: list[str]) -> dict[int, list[int]]:
    """Version -> the queue positions (in ``ids``) of the groups its step trained; the last
    line of a version counts (a resumed run retrains a version that was not checkpointed)."""
    position = {entry_id: i for i, entry_id in enumerate(ids)}
    return {s["version"]: sorted(position[e] for e in s["entry_ids"]) for s in lines}


def test_resume_after_sigkill_equals_an_uninterrupted_run(straight_two_ranks: Trained, tiny_model: Path, redis_url: str,
                                                         tmp_path: Path) -> None:
    straight, steps_straight = straight_two_ranks
    coefs = [s["metrics"]["reward/kl_coef"] for s in steps_straight]
    assert len(set(coefs)) == 4, coefs  # the controller moved every step

    out, run = tmp_path / "crashed", f"loop-{uuid.uuid4().hex[:8]}"
    ids = _fill(redis_url, run, 16)
    cfg = learner_config(tiny_model, out, run, *ADAPTIVE_KL)  # save_every=2, total_steps=4
    procs = start_ranks(2, cfg, redis_url, out / "done", max_steps=3)
    end = time.monotonic() + TIMEOUT_S
    while not all((out / f"done.{r}").exists() for r in range(2)):
        assert time.monotonic() < end and all(p.is_alive() for p in procs), "first launch failed"
        time.sleep(0.2)
    for p in procs:  # step 3 is trained but neither checkpointed nor committed
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert [c.name for c in list_checkpoints(out)] == [checkpoint_dir(out, 2).name]
    with ReplayQueue(redis_url, run) as q:
        assert q.stats()["pending"] == 4  # step 3's groups

    _wait(start_ranks(2, cfg, redis_url, out / "done"))  # trainer.resume=auto
    resumed = load_file(export_hf(list_checkpoints(out)[-1], out / "export") / "model.safetensors")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6)

    lines = [json.loads(line) for line in (out / "learner_steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in lines] == [1, 2, 3, 3, 4]  # step 3 ran twice: killed, then redone
    assert [s["metrics"]["reward/kl_coef"] for s in lines[3:]] == pytest.approx(coefs[2:], rel=1e-12)  # restored, not reset
    # The critic, its optimizer and schedule; the policy's schedule. The losses relative to their size:
    # the same 2 ranks still round float32 sums differently (a value loss of 336 differed by 8.6e-6 in CI, 2.6e-8 of it).
    for key in ("critic/vf_loss", "critic/lr", "actor/lr"):
        assert [s["metrics"][key] for s in lines[3:]] == pytest.approx([s["metrics"][key] for s in steps_straight[2:]], rel=1e-6, abs=1e-6), key
    critic = AutoModelForTokenClassification.from_pretrained(export_hf(list_checkpoints(out)[-1], out / "critic", critic=True))
    assert critic.config.num_labels == 1 and critic(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 1)
    lineage = _positions(lines, ids)
    assert lineage[3] == _positions(lines[2:3], ids)[3]  # the same groups were retrained
    assert sorted(i for v in lineage.values() for i in v) == list(range(16))  # each group in exactly one step
    straight_ids = [list(range(4 * (s["version"] - 1), 4 * s["version"])) for s in steps_straight]
    assert [lineage[v] for v in (1, 2, 3, 4)] == straight_ids  # same order as the straight run
    with ReplayQueue(redis_url, run) as q:
        stats = q.stats()
    assert stats["pending"] == 0 and stats["depth"] == 0


def test_resume_on_another_number_of_ranks_equals_an_uninterrupted_run(straight_two_ranks: Trained, tiny_model: Path, redis_url: str,
                                                                       tmp_path: Path) -> None:
    """Steps 1-2 on 2 ranks, step 3 on 1, step 4 on 2, each leg stopped with a final checkpoint
    and the next resuming it (``trainer.resume=auto``): the straight 2-rank run's weights (within
    the 1-rank == 2-rank tolerance), schedules, KL controller, critic and groups."""
    straight, steps_straight = straight_two_ranks
    run = f"loop-{uuid.uuid4().hex[:8]}"
    ids = _fill(redis_url, run, 16)
    cfg = learner_config(tiny_model, tmp_path, run, *ADAPTIVE_KL)  # total_steps=4 on every leg: the straight run's LR schedule
    legs = ((2, 2), (1, 1), (2, None))  # (ranks, steps): the last leg trains to total_steps
    for leg, (ranks, steps) in enumerate(legs):
        _wait(start_ranks(ranks, cfg, redis_url, tmp_path / f"leg{leg}", max_steps=steps, finish=True))
    rng = {c.name: sorted(f.name for f in (c / "rng").iterdir()) for c in list_checkpoints(tmp_path)}
    assert rng == {checkpoint_dir(tmp_path, 3).name: ["rank_0.pt"], checkpoint_dir(tmp_path, 4).name: ["rank_0.pt", "rank_1.pt"]}
    notes = [json.loads((tmp_path / f"leg{leg}.0").read_text())["resharded"] for leg in range(len(legs))]
    assert notes[0] is None
    assert notes[1].startswith("resuming a checkpoint of 2 ranks on 1: ") and "RNG states saved by rank 1 are not used" in notes[1]
    assert notes[2].startswith("resuming a checkpoint of 1 rank on 2: ") and "no RNG state was saved for rank 1" in notes[2]

    resumed = load_file(export_hf(list_checkpoints(tmp_path)[-1], tmp_path / "export") / "model.safetensors")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=2e-5)
    lines = [json.loads(line) for line in (tmp_path / "learner_steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in lines] == [1, 2, 3, 4]  # each leg went on from the previous one's version
    for key in ("actor/lr", "critic/lr"):  # the optimizers' schedules carried over, not restarted
        assert [s["metrics"][key] for s in lines] == pytest.approx([s["metrics"][key] for s in steps_straight], rel=1e-12), key
    # The state each step started from: weights, Adam moments, the KL coefficient. A 1-rank step
    # sums in another order than a 2-rank one: float32 rounding, relative to the value (a value
    # loss of 523 differed by 2.4e-5 in CI, 5e-8 of it).
    for key in ("actor/pg_loss", "critic/vf_loss", "reward/kl_coef"):
        assert [s["metrics"][key] for s in lines] == pytest.approx([s["metrics"][key] for s in steps_straight], rel=1e-6, abs=1e-5), key
    lineage = _positions(lines, ids)
    assert [lineage[v] for v in (1, 2, 3, 4)] == [list(range(4 * v, 4 * v + 4)) for v in range(4)]  # each group once, in queue order
    with ReplayQueue(redis_url, run) as q:
        stats = q.stats()
    assert stats["pending"] == 0 and stats["depth"] == 0


def test_bounded_wait_returns_keeps_groups_and_finish_commits(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    from learner_helpers import SPAWN, bounded_wait_main

    from async_rl.learner.model import free_port

    run = f"wait-{uuid.uuid4().hex[:8]}"
    cfg = learner_config(tiny_model, tmp_path, run, "trainer.save_every=100")
    out = tmp_path / "report.json"
    proc = SPAWN.Process(target=bounded_wait_main, args=(free_port(), cfg, redis_url, str(out)))
    proc.start()
    _wait([proc])
    report = json.loads(out.read_text())
    assert report["empty"] == [] and report["waited_s"] < 10.0
    assert report["held"] == 1  # the group read before giving up is kept, not lost
    # the step's wait began in the call that gave up: the console's idle share and the benchmarks'
    # generation time count all of it, not only the last bounded call's (1.0 s of 6.3 in a sync run)
    assert report["waited_s"] <= report["step_wait_s"] < report["step_s"]
    assert report["version"] == 1 and report["finished"] == 1
    assert report["pending_after_finish"] == 0  # checkpoint written, entries committed
    assert [c.name for c in list_checkpoints(tmp_path)] == [checkpoint_dir(tmp_path, 1).name]


def test_dropped_groups_are_acknowledged_and_a_run_of_drops_stops_every_rank(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    from learner_helpers import SPAWN, drop_streak_main, failed_reward_groups

    from async_rl.learner.model import free_port
    from async_rl.records import RolloutGroup

    run = f"drops-{uuid.uuid4().hex[:8]}"
    good = make_groups(4, seed=11, run=run)
    bad_prompt = RolloutGroup.from_lists(run, "oov", 0, [3, 99999, 4], list(good[0].samples), "srv", 0.0, created_at=0.0)
    with ReplayQueue(redis_url, run, max_depth=64) as q:
        for g in [bad_prompt, *failed_reward_groups(3, 12, run), *good, *failed_reward_groups(45, 13, run)]:
            q.put(g)
    cfg = learner_config(tiny_model, tmp_path, run, "trainer.total_steps=10", "trainer.save_every=100")  # limit: 10 x B = 40
    port, out = free_port(), tmp_path / "report"
    procs = [SPAWN.Process(target=drop_streak_main, args=(r, 2, port, cfg, redis_url, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    _wait(procs)
    reports = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [r["version"] for r in reports] == [1, 1]  # the one good batch was trained
    # One read takes what is there (45 > the limit of 40), all of it dropped.
    assert all("the last 45 groups read were all dropped (reward_error: 45)" in r["error"] for r in reports), reports
    with ReplayQueue(redis_url, run) as q:
        stats = q.stats()
        dead = q._client.xrange(q.keys.dead)
    assert stats["pending"] == 4  # only the trained batch waits for its checkpoint; drops are acknowledged
    assert stats["dropped"] == {"reward_error": 48} and stats["dead_lettered"] == 1 and stats["depth"] == 0
    assert b"prompt token id 99999 at position 1 is outside the vocabulary" in dead[0][1][b"reason"]
