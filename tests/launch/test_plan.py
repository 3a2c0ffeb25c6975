"""`async-rl train --dry-run`: the plan, resource checks and the shipped configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.launch.driver import cpu_layout
from async_rl.launch.plan import is_hub_id, make_plan, render

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "async_rl.cli", "train", *args, "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"problem": "1+1?", "answer": "2"}\n')
    return path


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_validate_and_plan(config: Path, data: Path):
    assert len(GPU_CONFIGS) == 3
    res = _dry_run(str(config), f"data.train_files={data}", f"data.val_files={data}")
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = load_config(config)
    assert res.stdout.count("inference-server-") == cfg.rollout.num_servers
    assert res.stdout.count("learner-rank-") == cfg.learner.world_size
    assert "error:" not in res.stdout
    assert f"{cfg.rollout.num_servers + cfg.learner.world_size:g} GPUs" in res.stdout


def test_dry_run_reports_missing_files_with_exit_2(tmp_path: Path):
    res = _dry_run(str(ROOT / "configs" / "quickstart.yaml"), f"learner.model_path={tmp_path / 'nope'}",
                   f"data.train_files={tmp_path / 'train.jsonl'}")
    assert res.returncode == 2
    assert "error: learner.model_path=" in res.stdout and "async-rl assets tiny" in res.stdout
    assert "error: data.train_files=" in res.stdout


def test_train_refuses_to_start_with_a_one_line_reason(tmp_path: Path):
    res = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          f"learner.model_path={tmp_path / 'nope'}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: learner.model_path=")


def test_plan_warns_about_cluster_redis_and_hub_models(data: Path):
    cfg = load_config(None, ["learner.model_path=Qwen/Qwen2.5-0.5B-Instruct", f"data.train_files={data}", "ray.address=auto"])
    plan = make_plan(cfg)
    assert plan.errors == []
    assert any("hub" in w for w in plan.warnings)
    assert any("queue.redis_url" in w for w in plan.warnings)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and not is_hub_id("./models/x") and not is_hub_id("/abs/model")


def test_cpu_layout_gives_disjoint_cores():
    import os

    cores = len(os.sched_getaffinity(0))
    cfg = load_config(None, ["rollout.cpus_per_server=1", "learner.cpus_per_rank=1"])
    servers, ranks = cpu_layout(cfg)
    assert len(servers) == 1 and len(ranks) == 1
    assert servers[0] != str(ranks[0][0])
    too_big = load_config(None, [f"rollout.cpus_per_server={cores}", "learner.cpus_per_rank=1"])
    assert cpu_layout(too_big) is None  # does not fit: no pinning


def test_plan_lists_openai_api_ports(data: Path):
    fixed = load_config(None, [f"data.train_files={data}", "rollout.num_servers=2", "rollout.openai_port=8100"])
    text = render(make_plan(fixed))
    assert "OpenAI API on 127.0.0.1:8100" in text and "OpenAI API on 127.0.0.1:8101" in text
    assert "OpenAI API on 127.0.0.1:(free port)" in render(make_plan(load_config(None, [f"data.train_files={data}"])))
    assert "OpenAI API on" not in render(make_plan(load_config(None, [f"data.train_files={data}", "rollout.openai_api=false"])))


@pytest.mark.parametrize("override, key", [
    ("algorithm.loss.name=nonsense", "algorithm.loss.name='nonsense' is not allowed"),
    ("algorithm.advantage.name=nonsense", "algorithm.advantage.name='nonsense' is not allowed"),
    ("algorithm.advantage.name=gae", "algorithm.advantage.name='gae' needs a critic"),
    ("rollout.reward.type=batched", "rollout.reward.type='batched' is not allowed (did you mean 'batch'?)"),
])
def test_dry_run_rejects_unknown_algorithm_and_option_names(override: str, key: str, data: Path):
    res = _dry_run(str(ROOT / "configs" / "quickstart.yaml"), f"data.train_files={data}", override)
    assert res.returncode == 2, res.stdout + res.stderr
    assert key in res.stdout + res.stderr
