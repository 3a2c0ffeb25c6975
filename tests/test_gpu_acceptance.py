"""``scripts/gpu_acceptance.sh all --cpu-smoke``: the GPU acceptance script's every phase, end to
end on the CPU (gloo, tiny shapes), so the command kept for the next GPU machine does not rot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_every_phase_runs_on_the_cpu_and_writes_its_results(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "GPU_ACCEPTANCE_DIR": str(results), "OUT": str(out)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_acceptance.sh"), "all", "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    doc = json.loads((results / "gpu_acceptance_cpu-smoke.json").read_text())
    assert doc["smoke"] and doc["strict_devices"] and doc["device"] == "cpu"
    phases = doc["phases"]
    assert list(phases) == ["matrix", "throughput", "vlm", "kernels", "handoff"]
    assert all(p["ok"] and p["status"] == "ok" for p in phases.values()), phases

    cells = phases["matrix"]["cells"]
    assert len(cells) == phases["matrix"]["expected"] == 4 and set(cells.values()) == {"ok"}
    assert any("lora.rank" in name for name in cells)
    assert any("gae" in name for name in cells) and any("kl_coef" in name and "ppo_epochs=2" in name for name in cells)

    runs = phases["throughput"]["runs"]
    assert list(runs) == ["smoke", "smoke-checkpointed"] and runs["smoke-checkpointed"]["setup"]["gradient_checkpointing"]
    calibration = json.loads((results / "memory_calibration.json").read_text())["entries"]
    assert sorted(e["peak_gb"] for e in calibration) == sorted(r["peak_memory_gb"] for r in runs.values())
    for run in runs.values():
        assert run["tokens_per_s"] > 0 and run["plain_tokens_per_s"] > 0 and run["estimate_gb"] > 0

    vlm = phases["vlm"]
    assert vlm["model"]["model_type"] == "qwen2_5_vl" and vlm["images"] == 3 and vlm["image_tokens"] > 0
    assert math.isfinite(vlm["loss"]) and vlm["step_s"] > 0

    kernels = phases["kernels"]["kernels"]
    assert kernels["sdpa"]["present"] and kernels["sdpa"]["equal"] and kernels["sdpa"]["max_abs_diff"] <= 1e-4
    assert not kernels["flex_attention"]["present"] and "GPU" in kernels["flex_attention"]["why"]
    assert not kernels["flash_attention_2"]["present"]

    handoff = phases["handoff"]["routes"]
    assert handoff["cuda"]["ok"] is None and "GPU machine" in handoff["cuda"]["why"]
    host = handoff["host"]
    assert host["ok"] and host["read_from"] == "host" and host["served_equals_sent"] and host["updates"] == 5
    assert host["update"]["median_ms"] > 0 and phases["handoff"]["raw_copy_ms"] > 0 and host["growth_mb"]["receiver"] < 64

    table = (results / "gpu_acceptance_cpu-smoke.md").read_text()
    assert all(f"| {name} |" in table for name in phases) and "| smoke-checkpointed |" in table
    assert {p.name for p in out.iterdir()} == {"gpu_acceptance_cpu-smoke.json", "gpu_acceptance_cpu-smoke.md", "memory_calibration.json"}
