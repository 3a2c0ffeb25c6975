"""`async-rl eval` on a real vLLM engine: single-turn prompts, and greedy episodes of an environment."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from async_rl.config import load_config
from async_rl.rollout.offline_eval import base_engine_kwargs, evaluate, solved_fraction

pytestmark = pytest.mark.integration


@pytest.mark.vllm
@pytest.mark.assets
@pytest.mark.slow
def test_one_turn_episodes_score_exactly_as_the_single_turn_eval(tiny_assets, tmp_path):
    """The tiny task as a one-turn environment: a greedy episode wins exactly when the greedy
    answer is right, so the two evaluations agree to the row (same template, same engine)."""
    base = [
        f"learner.model_path={tiny_assets.model_dir}", f"data.train_files={tiny_assets.train_path}",
        f"data.val_files={tiny_assets.val_path}", "data.max_prompt_length=64", "rollout.max_response_length=16",
    ]
    single = evaluate(load_config(None, base), tmp_path / "single", limit=24, progress=lambda _: None)
    assert _engine_children() == []  # the engine's process ended with the evaluation, not at some garbage collection
    episodes = evaluate(load_config(None, [*base, "rollout.env.name=addition_feedback", "rollout.env.max_turns=1"]),
                        tmp_path / "env", limit=24, progress=lambda _: None)
    assert single.prompts == episodes.prompts == 24 and 0.0 < single.accuracy < 1.0
    assert episodes.accuracy == single.accuracy
    assert [e["response"] for e in episodes.examples] == [e["response"] for e in single.examples]
    assert json.loads((tmp_path / "env" / "eval.json").read_text())["accuracy"] == episodes.accuracy


def _engine_children(wait_s: float = 10.0) -> list[str]:
    """vLLM engine processes of this test process still alive after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout.splitlines()[1:]
        alive = [line for line in out if line.split(None, 3)[1] == str(os.getpid()) and "EngineCore" in line
                 and not line.split(None, 3)[2].startswith("Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def test_an_evaluation_serves_the_base_model_without_lora() -> None:
    cfg = load_config(None, ["learner.lora.rank=8", "rollout.openai_api=false"])
    kwargs = base_engine_kwargs(cfg)
    assert "enable_lora" not in kwargs and kwargs["model"] == cfg.learner.model_path
    assert cfg.learner.lora is not None  # the caller's config is left as it is


def test_accuracy_counts_solved_answers_not_the_mean_reward() -> None:
    """``math``'s reward is 0.9 * accuracy + 0.1 * format: a boxed wrong answer earns 0.1 and is not
    solved, as in the run's validation (the eval once reported 36.5 % where validation said 29.5 %)."""
    wrong, right = {"overall": 0.1, "accuracy": 0.0, "format": 1.0}, {"overall": 1.0, "accuracy": 1.0, "format": 1.0}
    assert solved_fraction([wrong, wrong, wrong, right]) == 0.25
    assert solved_fraction([{"overall": 1.0}, {"overall": 0.0}]) == 0.5  # no accuracy component: the reward
