"""What a model served beside the policy costs the rollout (issue 46): generation and training
rates with and without a judge, a reward model or a teacher, and each one's latency per request.

Four arms of ``configs/judge_quickstart.yaml`` on the served assets (``async-rl assets tiny
--task served``, built into ``--assets`` if absent), one after the other on the same 2 cores,
each ``--steps`` learner steps; everything but the served model is the same:

- ``none``: no served model; GRPO on the exact-match reward (``rollout.reward.weight=1``);
- ``judge``: the quickstart as it is: the tiny judge answers every response (greedy, up to 4
  tokens), ``judge_yes_no`` reads it;
- ``reward_model``: the same judge read as a reward model (``task: classify``,
  ``classifier_from_tokens: [n, y]``: one prefill, no decoding, no function);
- ``teacher``: no judge; the tiny teacher scores every sample's tokens (``algorithm.distill``,
  ``reward_coef: 1``: the exact reward kept).

The served models share the policy server's core (``cpus_per_server: 0``, as the quickstarts
run on 2 cores), so their cost shows as lost generation rate. Per arm, over its last
``--steps // 2`` steps: ``rollout/tokens_per_s`` (generated), ``perf/tokens_per_s`` (trained),
the model's ``latency_mean_s`` per request and its latency max over the run, requests per
trained sample, and the wall time. Ratios are against ``none`` of the same run.

    python benchmarks/served_overhead.py --json benchmarks/results/served_overhead.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _report import report
from _train import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "judge_quickstart.yaml"
ARMS = ("none", "judge", "reward_model", "teacher")


def arm_config(arm: str, assets: Path) -> dict:
    """The judge quickstart's config for ``arm`` (module docstring), its paths in ``assets``."""
    cfg = yaml.safe_load(CONFIG.read_text().replace("runs/served/assets", str(assets)))
    reward = cfg["rollout"]["reward"]
    if arm in ("none", "teacher"):
        del cfg["models"], reward["judge"]
        reward["weight"] = 1.0
    if arm == "reward_model":
        cfg["models"]["judge"].update(task="classify", classifier_from_tokens=["n", "y"])
        del reward["judge"]["max_tokens"]
    if arm == "teacher":
        cfg["models"] = {"teacher": {"model_path": str(assets / "teacher"), "cpus_per_server": 0,
                                     "vllm": {"kv_cache_space_gb": 1, "max_model_len": 80}}}
        cfg["algorithm"]["distill"] = {"teacher": "teacher", "reward_coef": 1.0}
    return cfg


def run_arm(arm: str, assets: Path, out: Path, steps: int) -> dict:
    """One ``async-rl train`` of ``arm`` into ``out``; its rates, the served model's latency and the wall time."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = out.parent / f"{arm}.yaml"
    config.write_text(yaml.safe_dump(arm_config(arm, assets)))
    command = [sys.executable, "-m", "async_rl.cli", "train", str(config), f"trainer.output_dir={out}", f"trainer.run_name=overhead-{arm}",
               "trainer.resume=off", f"trainer.total_steps={steps}", "trainer.val_every=0", "logging.wandb.enable=false",
               "logging.plots=false"]
    t0 = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(out) if "perf/tokens_per_s" in r]
    tail, last = rows[-(steps // 2):], rows[-1]
    mean = lambda key: round(sum(r[key] for r in tail) / len(tail), 3) if all(key in r for r in tail) else None  # noqa: E731
    model = {"judge": "judge", "reward_model": "judge", "teacher": "teacher"}.get(arm)
    cfg = yaml.safe_load(config.read_text())
    trained = steps * cfg["learner"]["batch_size"] * cfg["rollout"]["n"]
    out_row = {"wall_s": round(wall, 1), "generated_tokens_per_s": mean("rollout/tokens_per_s"), "trained_tokens_per_s": mean("perf/tokens_per_s"),
               "command": " ".join(["async-rl", *command[3:]])}
    if model is not None:
        out_row.update(latency_mean_s=mean(f"models/{model}/latency_mean_s"), latency_max_s=last.get(f"models/{model}/latency_max_s"),
                       requests_per_trained_sample=round(last[f"models/{model}/requests"] / trained, 2),
                       failed=last.get(f"models/{model}/failed"), judge_errors=last.get("rollout/judge_errors"),
                       teacher_errors=last.get("rollout/teacher_errors"))
    return out_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", type=Path, default=ROOT / "runs" / "served" / "assets")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "served-overhead")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    assets = args.assets.resolve()
    if not (assets / "assets.json").is_file():
        from async_rl.tiny import build_tiny_assets

        build_tiny_assets(assets, seed=0, task="served")
    arms = {arm: run_arm(arm, assets, args.out / arm, args.steps) for arm in args.arms.split(",")}
    base = arms.get("none", {}).get("generated_tokens_per_s")
    for row in arms.values():
        if base and row["generated_tokens_per_s"] is not None:
            row["generation_vs_none"] = round(row["generated_tokens_per_s"] / base, 3)
    flat = {f"{arm}.{k}": v for arm, row in arms.items() for k, v in row.items() if k != "command"}
    report({**flat, "arms": arms, "steps": args.steps, "config": "configs/judge_quickstart.yaml per arm (module docstring)",
            "machine": f"{os.cpu_count()} cores, cpu"}, args.json)


if __name__ == "__main__":
    main()
