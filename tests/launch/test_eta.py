"""The ETA's step-time model, on recorded and on constructed timings (no timed test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_rl.launch.eta import EtaModel

# metrics.jsonl of `async-rl quickstart` (200 steps, save_every 50, val_every 20) on 2 CPU
# cores, cut to the keys the tracker feeds the model with. Its steps slow down as the run goes
# (0.26 s before step 40, 0.30-0.32 s after): at 20 % the ETA is 0.86 of the remainder.
RECORDED = Path(__file__).parent / "data" / "quickstart_timings.jsonl"


def _replay(records: list[dict[str, float]], model: EtaModel, at_version: int) -> tuple[float, float]:
    """Feed ``records`` as the tracker does; returns (ETA, real remainder) at ``at_version``."""
    end, estimate = records[-1]["time/elapsed_s"], None
    for r in records:
        now = r["time/elapsed_s"]
        if "val/seconds" in r:
            model.validation(now, r["val/seconds"])
        else:
            model.step(int(r["version"]), now, r.get("time/checkpoint", 0.0))
            if int(r["version"]) == at_version:
                estimate, real = model.remaining_s(at_version), end - now
    return estimate, real


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_the_quickstart_eta_is_within_a_quarter_of_the_real_remainder(fraction):
    records = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    estimate, real = _replay(records, EtaModel(200, 50, 20), int(200 * fraction))
    assert abs(estimate - real) <= 0.25 * real, (estimate, real)


def _simulated_run(total: int = 200, step_s: float = 1.0, save_every: int = 50, checkpoint_s: float = 20.0, val_every: int = 20,
                   val_s: float = 12.0, slowdown: float = 1.5) -> list[dict[str, float]]:
    """Records of a run whose steps take ``step_s``, ``slowdown`` times that while a periodic
    validation runs (it starts after a step at its cadence); the last validation runs alone."""
    records, now, val_end = [], 0.0, None
    for version in range(1, total + 1):
        now += step_s * (slowdown if val_end is not None and now < val_end else 1.0)
        record = {"version": float(version), "perf/tokens_per_s": 1.0, "time/elapsed_s": now}
        if version % save_every == 0:
            now += checkpoint_s
            record.update({"time/elapsed_s": now, "time/checkpoint": checkpoint_s})
        records.append(record)
        if val_end is not None and now >= val_end:
            records.append({"version": float(version), "val/seconds": val_s, "val/greedy_accuracy": 0.5, "time/elapsed_s": val_end})
            val_end = None
        if version % val_every == 0 and val_end is None:
            val_end = now + val_s
    records.append({"version": float(total), "val/seconds": val_s, "val/greedy_accuracy": 0.5, "time/elapsed_s": now + val_s})
    return records


def test_checkpoints_validations_and_the_final_validation_are_counted():
    records = _simulated_run()
    estimate, real = _replay(records, EtaModel(200, 50, 20), 60)
    assert estimate == pytest.approx(real, rel=0.05)
    # Steps left x time per step alone misses 3 checkpoints, 6 validation slowdowns and the last validation.
    assert 140 * 1.0 < 0.75 * real


def test_the_last_validation_costs_what_the_first_took_alone():
    model = EtaModel(10, 100, 5)
    model.validation(end=2.0, seconds=2.0)  # before the first step: the servers did nothing else
    model.step(1, 10.0)
    model.step(2, 11.0)
    model.validation(end=11.9, seconds=0.8)  # periodic: no step ended meanwhile, so it added nothing measurable
    model.step(3, 12.0)
    assert model.remaining_s(3) == pytest.approx(7 * 1.0 + 2.0)  # 7 steps and the last validation, alone as the first


def test_no_estimate_before_two_steps_and_none_left_at_the_end():
    model = EtaModel(10, 5, 0)
    assert model.remaining_s(0) is None
    model.step(1, 10.0)
    assert model.remaining_s(1) is None  # the first step only starts the clock (start-up excluded)
    model.step(2, 11.0)
    assert model.remaining_s(2) == pytest.approx(8 * 1.0)  # no checkpoint measured yet, no validation configured
    model.step(5, 17.0, checkpoint_s=3.0)
    assert model.remaining_s(5) == pytest.approx(5 * 1.0 + 1 * 3.0)  # the checkpoint at 10 is still to come
    model.step(10, 25.0, checkpoint_s=3.0)
    assert model.remaining_s(10) == 0
