"""The tiny assets of the served-model quickstarts (``--task served``): the addition student with
a distillation teacher and a judge beside it, from a short build (the real one is a
benchmark's), and the judge and distill quickstart configs planned on them."""

from __future__ import annotations

import json

import pytest
import yaml

from async_rl.config import load_config
from async_rl.launch.plan import make_plan
from async_rl.tiny import build_tiny_assets
from async_rl.tiny.addition import Row
from async_rl.tiny.build import WarmStart
from async_rl.tiny.served import judge_pairs
from run_helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.assets]


def test_judge_pairs_are_half_equal_and_the_rest_mostly_wrong_in_a_digit_only() -> None:
    rows = [Row("What is 12+34?", "46"), Row("What is 50+57?", "107")]
    pairs = judge_pairs(rows, 400, seed=3)
    assert sum(ok for _, _, ok in pairs) == 200 and all((t == r) == ok for t, r, ok in pairs)
    wrong = [(t, r) for t, r, ok in pairs if not ok]
    assert sum(len(t) == len(r) for t, r in wrong) >= 0.7 * len(wrong)  # a length tells no more than 30 % of them
    assert judge_pairs(rows, 400, seed=3) == pairs


def test_served_assets_build_and_both_quickstarts_plan_on_them(tmp_path) -> None:
    out = tmp_path / "assets"
    report = build_tiny_assets(out, task="served", progress=lambda _: None,
                               warm_start=WarmStart(warmup_steps=5, eval_every=10, band=(0.0, 1.0), target=0.0, max_steps=10, eval_rows=16))
    manifest = json.loads(report.manifest_path.read_text())
    assert manifest["task"]["name"] == "served" and manifest["teacher_sft_steps"] == 10 and manifest["judge_sft_steps"] == 10
    assert 0.0 <= manifest["judge_accuracy"] <= 1.0 and 0.0 <= manifest["teacher_accuracy"] <= 1.0
    assert 0.0 <= manifest["judge_accuracy_on_student_samples"] <= 1.0
    assert manifest["judge_template"] == "{{ ground_truth }} = {{ response }}?"
    for name in ("teacher", "judge"):  # model directories vLLM and transformers load, with the student's tokenizer
        assert (out / name / "config.json").is_file() and (out / name / "model.safetensors").is_file()
        assert (out / name / "tokenizer.json").read_bytes() == (out / "model" / "tokenizer.json").read_bytes()
    for quickstart in ("judge", "distill"):
        raw = yaml.safe_load((ROOT / "configs" / f"{quickstart}_quickstart.yaml").read_text().replace("runs/served/assets", str(out)))
        path = tmp_path / f"{quickstart}.yaml"
        path.write_text(yaml.safe_dump(raw))
        plan = make_plan(load_config(path, [f"trainer.output_dir={tmp_path / quickstart}"]))
        assert plan.errors == [], (quickstart, plan.errors)
        assert any(p.role == f"{'judge' if quickstart == 'judge' else 'teacher'}-0" for p in plan.processes)
