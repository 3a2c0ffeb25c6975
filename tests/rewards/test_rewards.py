"""Built-in rewards, loading by path, and the scorer's error isolation and shaping."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from async_rl.config import OverlongPenaltyConfig, RewardConfig
from async_rl.rewards import (
    RewardOutputError,
    RewardPool,
    RewardScorer,
    builtin_names,
    load_reward_function,
    score_output,
)
from async_rl.rewards.builtin import last_boxed


def _inputs(*pairs, length=4):
    return [{"response": r, "response_length": length, "ground_truth": g} for r, g in pairs]


def test_builtins_listed():
    assert builtin_names() == ["exact_match", "format", "judge_yes_no", "math"]


def test_exact_match():
    fn = load_reward_function("exact_match")
    out = fn(_inputs((" 432\n", "432"), ("43 2", "432"), ("432", 432)))
    assert [o["overall"] for o in out] == [1.0, 0.0, 1.0]


def test_score_output_and_correct():
    """A reward output becomes a Score; validation judges it on its accuracy component, else on
    the reward (the math reward of a well-formatted wrong answer, 0.1, is not solved)."""
    math_wrong, math_right = score_output({"overall": 0.1, "accuracy": 0.0, "format": 1.0}), score_output({"overall": 1.0, "accuracy": 1.0})
    assert (math_wrong.reward, math_wrong.components) == (0.1, {"accuracy": 0.0, "format": 1.0})
    assert (math_wrong.correct, math_right.correct) == (False, True)
    assert [score_output({"overall": r}).correct for r in (0.0, 0.49, 0.5, 1.0)] == [False, False, True, True]
    for bad in ({"accuracy": 1.0}, {"overall": "x"}, {"overall": float("nan")}, 1.0):
        with pytest.raises(RewardOutputError):
            score_output(bad)


def test_last_boxed_balanced():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("none") is None


def test_math_equivalence():
    fn = load_reward_function("math")
    out = fn(_inputs((r"so \boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "4"), ("4", "4")))
    assert [o["accuracy"] for o in out] == [1.0, 0.0, 0.0]
    assert [o["format"] for o in out] == [1.0, 1.0, 0.0]
    assert out[1]["overall"] == pytest.approx(0.1)


def test_unknown_name_suggests():
    with pytest.raises(ValueError, match="did you mean 'exact_match'"):
        load_reward_function("exact_mach")


def test_load_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(items):\n    return [{'overall': float(len(i['response'])), 'len': 1.0} for i in items]\n")
    fn = load_reward_function(f"{path}:compute_score")
    assert fn(_inputs(("abc", "")))[0]["overall"] == 3.0
    with pytest.raises(ValueError, match="has no 'nope'"):
        load_reward_function(f"{path}:nope")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_reward_function(f"{tmp_path / 'missing.py'}:f")


SCORER_REWARDS = """
def flaky(items):
    out = []
    for item in items:
        if item["response"] == "boom":
            raise ZeroDivisionError("division by zero in my reward")
        if item["response"] == "nan":
            out.append({"overall": float("nan")})
        else:
            out.append({"overall": 1.0, "accuracy": 1.0})
    return out


def first_only(items):
    return [{"overall": 1.0}]


def bare_floats(items):
    return [0.5 for _ in items]


def constant(items):
    return [{"overall": 1.0} for _ in items]
"""


@pytest.fixture()
def scorer_for(tmp_path):
    """``scorer_for(name, **cfg)``: a scorer over a started 2-process pool running ``name``."""
    path = tmp_path / "scorer_rewards.py"
    path.write_text(SCORER_REWARDS)
    pools = []

    def make(name, max_response_length=0, **cfg):
        pool = RewardPool(RewardConfig(function=f"{path}:{name}", num_workers=2, timeout_s=10.0, **cfg))
        pool.start()
        pools.append(pool)
        return RewardScorer(pool, pool.cfg, max_response_length)

    yield make
    for pool in pools:
        pool.close()


def test_raising_reward_isolates_failing_samples(scorer_for, caplog):
    scorer = scorer_for("flaky")

    async def go():
        first = await scorer.score(_inputs(("ok", "a"), ("boom", "b"), ("nan", "c"), ("ok", "d")))
        second = await scorer.score(_inputs(("boom", "e")))
        return first, second

    with caplog.at_level(logging.WARNING, logger="async_rl.rewards.scoring"):
        first, second = asyncio.run(go())
    # a failed sample gets 0.0 and the error; the learner drops its whole group
    assert [s.reward for s in first] == [1.0, 0.0, 0.0, 1.0]
    assert first[0].failure is None and first[0].components == {"accuracy": 1.0}
    assert first[1].failure.signature == "ZeroDivisionError: division by zero in my reward"
    assert "non-finite" in first[2].failure.signature and first[2].failure.signature.startswith("RewardOutputError: ")
    assert second[0].failure.signature == first[1].failure.signature
    c = scorer.counters
    assert (c.scored, c.errors, c.timeouts, c.distinct_errors, scorer.pool.restarts) == (5, 3, 0, 2, 0)
    # each distinct error is logged once, with the reward process's traceback
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "Traceback" in logged[0] and "in flaky" in logged[0]


def test_wrong_output_shape_is_an_error(scorer_for):
    scorer = scorer_for("first_only")
    scores = asyncio.run(scorer.score(_inputs(("a", "a"), ("b", "b"))))
    # the batch call returns 1 output for 2 inputs; one-by-one calls then succeed
    assert [s.reward for s in scores] == [1.0, 1.0] and scorer.counters.errors == 0
    bad = scorer_for("bare_floats")
    assert "not a dict with key 'overall'" in asyncio.run(bad.score(_inputs(("a", "a"))))[0].failure.signature


def test_overlong_penalty_dapo(scorer_for):
    penalty = OverlongPenaltyConfig(enable=True, buffer_length=8, penalty_factor=1.0)
    scorer = scorer_for("constant", max_response_length=20, overlong_penalty=penalty)

    async def go():
        return [(await scorer.score(_inputs(("x", ""), length=n)))[0].reward for n in (12, 16, 20)]

    assert asyncio.run(go()) == pytest.approx([1.0, 0.5, 0.0])


def test_dynamic_sampling_filter_counts():
    cfg = RewardConfig()
    scorer = RewardScorer(RewardPool(cfg), cfg, max_response_length=16)  # keep_group never calls the pool
    assert scorer.keep_group([0.0, 1.0, 1.0])
    assert not scorer.keep_group([1.0, 1.0, 1.0])
    assert not scorer.keep_group([0.0, 0.0])
    assert scorer.keep_group([1.0])  # a group of one has nothing to compare
    assert scorer.counters.groups_filtered == 2


def test_the_probe_returns_as_soon_as_one_input_scores(tmp_path) -> None:
    """A function that hangs on every non-empty response (here for 600 s) is accepted at once:
    the probe's empty response scores, and the hung calls are cancelled."""
    from async_rl.rewards.scoring import check_reward_function

    path = tmp_path / "slow.py"
    path.write_text("import time\n\ndef compute_score(items):\n"
                    "    return [{'overall': time.sleep(600) if i['response'] else 0.0} for i in items]\n")

    async def probe() -> float:
        with RewardPool(RewardConfig(function=f"{path}:compute_score", timeout_s=600.0)) as pool:
            start = time.monotonic()
            await check_reward_function(RewardScorer(pool, pool.cfg, 16), ["12", "7"])
            return time.monotonic() - start

    assert asyncio.run(probe()) < 60  # the workers' start-up, not the 600 s hang
