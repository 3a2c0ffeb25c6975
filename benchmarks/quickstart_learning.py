"""How much a quickstart learns and how fast: validation against wall time, as a user runs it.

Runs ``async-rl quickstart NAME`` in a subprocess from the repository root (it builds the
tiny assets if absent, timed apart) into a fresh run directory, then reads the run's
``metrics.jsonl``: every validation point (policy version, seconds since the run started,
greedy accuracy — for an environment task the success rate of greedy episodes — and pass@n)
and the environment (``env/*``) and critic (``critic/*``) metrics averaged over the last ten
steps, with the best ``critic/explained_variance`` of the run when it trains a critic. The gain is the last greedy figure minus
the one at version 0, in points; the target is met when a validation within ``--target-min``
minutes of the run's start shows ``--target-points`` or more (``target_reached_s``: when the
first one did; the asset build is reported apart).

    python benchmarks/quickstart_learning.py multiturn --json benchmarks/results/quickstart_multiturn.json
    python benchmarks/quickstart_learning.py addition --out runs/bench/quickstart-gae --target-points 15 \
        --json benchmarks/results/quickstart_gae.json \
        algorithm.advantage.name=gae learner.critic.optim.lr=1e-4 learner.critic.warmup_steps=5
    python benchmarks/quickstart_learning.py addition --target-points 15 --json benchmarks/results/quickstart_learning_lora.json \
        learner.lora.rank=8 rollout.openai_api=false learner.optim.lr=1e-3 trainer.total_steps=400

JSON keys: gain_points, train_wall_s, target_reached_s, target_met, assets_s (with assets_built), val (the curve),
last10, critic_explained_variance_max (with a critic), plus the command and settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _report import report
from _train import first_gain, gain_points, read_metrics, val_curve

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", default="multiturn", help="quickstart name (addition, multiturn)")
    ap.add_argument("--out", type=Path, default=None, help="run directory (default runs/bench/quickstart-NAME; emptied first)")
    ap.add_argument("--target-points", type=float, default=20.0, help="greedy accuracy gain to reach, in points")
    ap.add_argument("--target-min", type=float, default=10.0, help="within this many minutes of training")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE overrides passed to the quickstart")
    args = ap.parse_intermixed_args()
    out = args.out or Path("runs/bench") / f"quickstart-{args.name}"
    shutil.rmtree(ROOT / out, ignore_errors=True)  # a run directory with a checkpoint would resume
    cli = [sys.executable, "-m", "async_rl.cli"]

    from async_rl.cli import QUICKSTARTS
    from async_rl.tiny import build_tiny_assets

    config, assets, task = QUICKSTARTS[args.name]
    t0 = time.perf_counter()
    assets_built = not (ROOT / assets / "assets.json").is_file()
    if assets_built:
        build_tiny_assets(ROOT / assets, seed=0, task=task)
    assets_s = time.perf_counter() - t0

    command = [*cli, "quickstart", args.name, f"trainer.output_dir={out}", *args.overrides]
    t0 = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, env=os.environ.copy())
    train_wall_s = time.perf_counter() - t0

    rows = read_metrics(ROOT / out)
    val = [{k: v for k, v in point.items() if k != "wall_s"} for point in val_curve(rows)]
    if not val:
        raise SystemExit(f"no validation rows in {out / 'metrics.jsonl'}: set trainer.val_every")
    steps = [r for r in rows if "actor/lr" in r]
    last = steps[-10:]
    last10 = {k: sum(r[k] for r in last) / len(last) for k in sorted(last[0]) if k.startswith(("env/", "critic/"))} if last else {}
    explained = [r["critic/explained_variance"] for r in steps if "critic/explained_variance" in r]
    gain = gain_points(val, val[-1])
    reached = first_gain(val, args.target_points)  # when: seconds since the run started
    result = {
        "greedy_start": val[0]["greedy"],
        "greedy_end": val[-1]["greedy"],
        "gain_points": gain,
        "train_wall_s": train_wall_s,
        "assets_s": assets_s,
        "assets_built": assets_built,  # False: they were there already and assets_s is ~0
        # What the assets measured of their models (base, teacher, judge: the judge's own accuracy).
        "assets_accuracy": {k: v for k, v in json.loads((ROOT / assets / "assets.json").read_text()).items() if "accuracy" in k},
        "steps": val[-1]["version"],
        "target_reached_s": None if reached is None else reached["elapsed_s"],
        "target_met": reached is not None and reached["elapsed_s"] <= 60 * args.target_min,
        "target": f"+{args.target_points:g} points in <= {args.target_min:g} min of training",
        "val": val,
        "last10": last10,
        **({"critic_explained_variance_max": max(explained)} if explained else {}),
        "command": " ".join(["async-rl", *command[len(cli):]]),
        "machine": f"{os.cpu_count()} cores, cpu",
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
