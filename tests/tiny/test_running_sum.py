"""The running-sum task (issue 44's long responses): its rows and worked answers, the length
distribution the benchmarks rely on, and a build of its assets trained 3 steps by the CLI."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from async_rl.rewards.builtin import math_equivalence
from async_rl.tiny import build_tiny_assets
from async_rl.tiny.addition import read_jsonl
from async_rl.tiny.build import WarmStart
from async_rl.tiny.running_sum import (
    MAX_ADDENDS,
    N_TRAIN,
    N_VAL,
    QUICK_VAL,
    RunningSumTask,
    is_correct,
    make_splits,
    parse_problem,
    problem_text,
    solution,
)
from run_helpers import ROOT, train_cli


def test_a_worked_answer_writes_every_partial_sum_and_boxes_the_total() -> None:
    problem = problem_text([3, 7, 2, 9])
    assert problem == "Add:\na3\nb7\nc2\nd9"
    assert parse_problem(problem) == [3, 7, 2, 9]
    assert solution(problem) == "a3:0+3=3\nb7:3+7=10\nc2:10+2=12\nd9:12+9=21\n\\boxed{21}"
    assert is_correct(solution(problem), "21") and not is_correct(solution(problem), "12")
    assert not is_correct("a3:0+3=3\nb7:3+7=10", "10"), "no box, no answer"
    for bad in ("Add:\nb3", "Add:\na3\nb", "Sum:\na3", "Add:"):
        with pytest.raises(ValueError):
            parse_problem(bad)


def test_the_math_reward_scores_the_boxed_sum_as_is_correct_does() -> None:
    problem = problem_text([5, 5, 1])
    scores = math_equivalence([{"response": solution(problem), "ground_truth": "11"},
                               {"response": solution(problem), "ground_truth": "12"},
                               {"response": "a5:0+5=5", "ground_truth": "11"}])
    assert [s["accuracy"] for s in scores] == [1.0, 0.0, 0.0]


def test_addend_counts_are_long_tailed_and_the_splits_disjoint() -> None:
    train, val = make_splits(RunningSumTask(), 0, N_TRAIN, N_VAL)
    assert (train, val) == make_splits(RunningSumTask(), 0, N_TRAIN, N_VAL)
    assert not {r.problem for r in train} & {r.problem for r in val}
    counts = [len(parse_problem(r.problem)) for r in train]
    assert all(int(r.answer) == sum(parse_problem(r.problem)) for r in train[:100])
    # about 12.4 addends on average (~148 response tokens), the longest the cap: a tail over 3x the mean
    assert 11.5 <= statistics.mean(counts) <= 13.5 and max(counts) == MAX_ADDENDS
    assert 0.03 <= sum(c >= 30 for c in counts) / len(counts) <= 0.08


@pytest.mark.assets
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.vllm
def test_running_sum_assets_build_and_train_three_steps(tmp_path) -> None:
    """A build with a 10-step warm-start (the real one takes minutes: the benchmarks build it),
    its files and manifest, then `async-rl train` on configs/running_sum_quickstart.yaml for 3
    steps at a small scale: long prompts and responses through the engine, the math reward
    and the learner. It starts a run of its own: no shared stack serves the running-sum model."""
    assets = tmp_path / "assets"
    report = build_tiny_assets(assets, task="running_sum", progress=lambda _: None,
                               warm_start=WarmStart(warmup_steps=5, eval_every=10, band=(0.0, 1.0), target=0.0, max_steps=10, eval_rows=16))
    manifest = json.loads(report.manifest_path.read_text())
    assert manifest["task"]["name"] == "running_sum" and manifest["sft_steps"] == 10
    assert manifest["task"]["response_tokens"]["mean"] >= 128
    assert manifest["task"]["response_tokens"]["max"] >= 3 * manifest["task"]["response_tokens"]["mean"]
    val = read_jsonl(assets / "data" / f"val_{N_VAL}.jsonl")
    assert len(val) == N_VAL and read_jsonl(report.val_path) == val[:QUICK_VAL]
    assert not {r.problem for r in val} & {r.problem for r in read_jsonl(report.train_path)}
    assert json.loads((report.model_dir / "config.json").read_text())["max_position_embeddings"] >= 160 + 640

    cfg = yaml.safe_load((ROOT / "configs" / "running_sum_quickstart.yaml").read_text())
    val_small = tmp_path / "val.jsonl"
    val_small.write_text("".join(report.val_path.read_text().splitlines(keepends=True)[:8]))
    cfg["data"].update(train_files=str(report.train_path), val_files=str(val_small))
    cfg["learner"].update(model_path=str(report.model_dir), batch_size=4)
    cfg["rollout"].update(n=2, max_inflight=8, max_response_length=96)
    cfg["trainer"].update(output_dir=str(tmp_path / "run"), total_steps=3, save_every=3, val_every=3, val_n=0,
                          val_before_train=False)  # the ablation's settings: one greedy-only validation, at the end
    config = tmp_path / "running_sum.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = train_cli(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/tokens_per_s" in r]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert max(r["batch/response_length_max"] for r in steps) > 16, "the responses are the long ones"
    vals = [r for r in records if "val/greedy_accuracy" in r]
    assert [r["version"] for r in vals] == [3] and not any("val/pass_at_n" in r for r in vals)
