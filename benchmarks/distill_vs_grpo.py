"""On-policy distillation against GRPO from the same base student (issue 46): greedy validation
accuracy against samples trained, and against wall time.

Two runs of ``configs/distill_quickstart.yaml`` on the served assets (``async-rl assets tiny
--task served``, built into ``--assets`` if absent), one after the other on the same cores:

- ``distill``: the quickstart as it is (the forward KL over the served teacher's top 20 at each
  position, no task reward);
- ``grpo``: the same student, rows, samples per step, learning rate and steps with
  ``algorithm.distill=null`` (GRPO on the exact-match reward), no teacher served.

Per arm: the validation curve (version, samples trained = version x batch x n, seconds,
greedy accuracy), the gain in points, the samples to +``--target-points`` (fixed before the
run; the issue's +20) and the time to it. The distillation target: +20 points, and fewer
samples to them than GRPO. What is not equal is listed in ``differences``.

    python benchmarks/distill_vs_grpo.py --json benchmarks/results/distill_vs_grpo.json --plot
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _report import report
from _train import first_gain, gain_points, read_metrics, val_curve

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "distill_quickstart.yaml"
MEASURED = ("rollout/tokens_per_s", "perf/tokens_per_s", "models/teacher/latency_mean_s", "models/teacher/running", "distill/reverse_kl",
            "actor/distill_top_k_kl", "actor/grad_norm")
"""Averaged over each arm's last 20 steps: generation and training rates, the teacher's latency
per request and queue, the reverse KL to the teacher, with ``algorithm.distill.top_k`` the
forward KL over its top k, and the gradient norm before clipping."""


def run_arm(name: str, assets: Path, out: Path, overrides: list[str], teacher: bool) -> dict:
    """One ``async-rl train`` of the distillation quickstart config (with ``overrides``; without
    ``teacher``, its teacher and ``algorithm.distill`` taken out: GRPO on the exact reward) into ``out``."""
    import shutil

    import yaml

    shutil.rmtree(out, ignore_errors=True)  # a run directory with a checkpoint would be refused (trainer.resume=off)
    cfg = yaml.safe_load(CONFIG.read_text().replace("runs/served/assets", str(assets)))
    if not teacher:
        del cfg["models"], cfg["algorithm"]["distill"]
    out.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    batch, n = cfg["learner"]["batch_size"], cfg["rollout"]["n"]
    command = [sys.executable, "-m", "async_rl.cli", "train", str(config), f"trainer.output_dir={out}", f"trainer.run_name=bench-{name}",
               "trainer.resume=off", "logging.wandb.enable=false", "logging.plots=false", *overrides]
    t0 = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    rows = read_metrics(out)
    val = [{**{k: v for k, v in p.items() if k != "wall_s"}, "samples": p["version"] * batch * n} for p in val_curve(rows)]
    steps = [r for r in rows if "perf/tokens_per_s" in r][-20:]
    means = {key: round(sum(r[key] for r in steps) / len(steps), 4) for key in MEASURED if steps and all(key in r for r in steps)}
    return {"val": val, "wall_s": round(wall, 1), "gain_points": gain_points(val, val[-1]), "last20": means,
            "command": " ".join(["async-rl", *command[3:]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", type=Path, default=ROOT / "runs" / "served" / "assets")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "distill-vs-grpo")
    ap.add_argument("--target-points", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--distill-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the distill arm alone (e.g. algorithm.distill.reward_coef=1.0: distillation with the task reward)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", action="store_true", help="write the curves beside the JSON (.png)")
    args = ap.parse_args()
    from async_rl.tiny import build_tiny_assets

    assets = args.assets.resolve()
    if not (assets / "assets.json").is_file():
        build_tiny_assets(assets, seed=0, task="served")
    manifest = json.loads((assets / "assets.json").read_text())
    steps = [f"trainer.total_steps={args.steps}", "trainer.val_every=10"]
    arms = {"distill": run_arm("distill", assets, args.out / "distill", steps + args.distill_set, teacher=True),
            "grpo": run_arm("grpo", assets, args.out / "grpo", steps, teacher=False)}
    for arm in arms.values():
        reached = first_gain(arm["val"], args.target_points)
        arm["samples_to_target"] = None if reached is None else reached["samples"]
        arm["seconds_to_target"] = None if reached is None else reached["elapsed_s"]
    d, g = arms["distill"], arms["grpo"]
    result = {
        "target": f"distill +{args.target_points:g} points, in fewer samples than grpo",
        "distill_gain_points": d["gain_points"], "grpo_gain_points": g["gain_points"],
        "distill_samples_to_target": d["samples_to_target"], "grpo_samples_to_target": g["samples_to_target"],
        "distill_seconds_to_target": d["seconds_to_target"], "grpo_seconds_to_target": g["seconds_to_target"],
        "target_met": d["samples_to_target"] is not None and (g["samples_to_target"] is None or d["samples_to_target"] < g["samples_to_target"]),
        "base_accuracy": manifest["base_accuracy"], "teacher_accuracy": manifest.get("teacher_accuracy"),
        "steps": args.steps, "distill_overrides": args.distill_set, "arms": arms,
        "differences": ["the distill arm serves the teacher on the policy's cores (models.teacher.cpus_per_server=0): its wall time "
                        "pays for one prefill per sample; the grpo arm serves nothing beside the policy"],
        "machine": "2 cores, cpu",
    }
    report(result, args.json)
    if args.plot and args.json is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, arm in arms.items():
            ax.plot([p["samples"] for p in arm["val"]], [100 * p["greedy"] for p in arm["val"]], marker="o", label=name)
        ax.set_xlabel("samples trained")
        ax.set_ylabel("greedy validation accuracy (%)")
        ax.set_title("on-policy distillation vs GRPO, same base student (2 CPU cores)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.json.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
