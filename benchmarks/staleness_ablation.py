"""Staleness ablation: final greedy accuracy against max_staleness (eta) for three losses.

A tiny task (``--task``: the quickstart's addition, configs/quickstart.yaml, or issue 44's
long-response running sum, configs/running_sum_quickstart.yaml) trained for the same number of
steps (``--steps`` x ``learner.batch_size`` groups) in every cell of eta x loss x seed:

* ``naive``: PPO with the behaviour policy as proximal (``algorithm.loss.name=ppo``,
  ``algorithm.recompute_proximal=false``: the ratio is ``pi_theta / mu``, clipped; no weight);
* ``decoupled``: ``decoupled_ppo`` (AReaL; clip on ``pi_theta / pi_prox`` times ``min(pi_prox / mu, is_cap)``);
* ``tis``: PPO on the recomputed ``pi_prox`` with the sequence-level truncated importance weight
  ``min(prod_t pi_prox / mu, is_cap)`` (``algorithm.loss.is_level=sequence``; the token-level
  weight on ``ppo`` would be ``decoupled_ppo`` itself).

Every cell sets ``learner.fill_staleness_window=true`` (docs/config.md; for benchmarks only):
the learner waits until admission's whole window is generated before each step, so it trains
on groups exactly eta versions old (fewer in the first eta steps) however fast it is, and
``queue.max_depth`` is raised to hold (eta + 1) x B groups. Generation and learning then take
turns in every cell, so wall times compare across eta. Validation runs on
``data/val_1500.jsonl`` (addition: ``async-rl assets val-split``; a seed's standard error about
1.3 points) or ``data/val_1000.jsonl`` (the running sum's, about 1.4 points), greedy: the base
model once per ablation (``async-rl eval``, an offline vLLM engine: every cell starts from the
same weights), and each cell at its end only (``trainer.val_before_train=false``,
``trainer.val_n=0``). With ``--keep`` the cells already in ``--json`` (written after every cell)
and its base accuracy are reused when its settings match, so an ablation longer than one
sitting runs in parts.

Cells share one redis-server (started here; a run name per cell). Each cell starts its own
Ray, learner and vLLM server (``async-rl train`` in a subprocess): every cell must begin
from the base weights, and only a Ray cluster the run starts itself pins the learner and
vLLM to their own cores (``launch.cores.cpu_layout``), as in ``async_vs_sync.py``.

    python benchmarks/staleness_ablation.py --json benchmarks/results/staleness_ablation.json \\
        --plot benchmarks/results/staleness_ablation.png            # the full run (~90 min on 2 cores)
    python benchmarks/staleness_ablation.py --seeds 1 --etas 0,4 --losses decoupled --steps 20   # a smoke
    python benchmarks/staleness_ablation.py --task running_sum --seeds 5 --etas 0,2,4,8 \\
        --losses naive,decoupled --steps 40 --keep --json benchmarks/results/staleness_ablation_long.json \\
        --plot benchmarks/results/staleness_ablation_long.png      # issue 44 item 4, in parts

Issue 44's run on the running sum (fixed before it ran, 2026-12-07): eta 1 and the tis loss
dropped, as the issue orders when the grid does not fit ~3 hours (40 cells at ~5 min); 40
steps (x 16 groups), where the quickstart gains ~+9 points by step 20 and ~+20 by step 60;
the config's lr 1e-4, the one users run (its 3e-4 collapsed the first build of the task at
eta = 2). The pass rule is the issue's: decoupled at eta = 8 within 3 points of eta = 0.

JSON keys: ``base_acc`` (the base model's greedy accuracy), ``cells`` (per cell: eta, loss,
seed, final_acc, base_acc, gain_points, staleness_mean, staleness_max, is_weight_mean,
is_weight_max, is_ess (the weights' effective sample size fraction, their spread),
is_clipped_fraction (weights cut at is_cap), pg_clipfrac, masked_fraction, behav_kl (k3
KL(mu || pi_prox)), ppo_kl (mean log pi_prox - log pi_theta: for naive, whose pi_prox is mu, how
far the trained policy is from the behaviour one), groups, wall_s, train_s, run_dir),
``summary`` (per eta and loss: the mean over seeds of final_acc and gain_points with the 95 %
interval half-width, ``*_ci95``, and the means of staleness and the correction's metrics),
``target`` (decoupled at eta = max against eta = 0: the gap in points, whether it is within 3,
whether both intervals are at most +-3 points), plus the settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import kept_result, new_plot, report, report_json, save_plot
from _train import ROOT, quickstart_command

TASKS: dict[str, tuple[Path, str, int]] = {
    "addition": (ROOT / "configs" / "quickstart.yaml", "runs/bench/assets", 1500),
    "running_sum": (ROOT / "configs" / "running_sum_quickstart.yaml", "runs/bench/running_sum-assets", 1000),
}
"""Tiny task -> (its config, the default assets dir, validation rows: the largest split disjoint
from training that its builder writes or ``val-split`` can draw)."""
LOSSES: dict[str, tuple[str, ...]] = {
    "naive": ("algorithm.loss.name=ppo", "algorithm.recompute_proximal=false"),
    "decoupled": ("algorithm.loss.name=decoupled_ppo",),
    "tis": ("algorithm.loss.name=ppo", "algorithm.loss.is_level=sequence"),
}
"""Each loss of the ablation: its overrides of the quickstart config (the module docstring)."""
TARGET_POINTS = 3.0
"""Target: decoupled at the largest eta within this many points of eta = 0 (mean over seeds)."""
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t, two-sided 95 %, by degrees of freedom (1.96 beyond)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="addition",
                    help="tiny task: addition (configs/quickstart.yaml) or running_sum (long responses, issue 44)")
    ap.add_argument("--assets", type=Path, default=None, help="tiny assets dir (built if absent; default by --task)")
    ap.add_argument("--out", type=Path, default=None, help="run directories (default runs/bench/staleness[-TASK]; emptied first "
                                                           "unless --keep)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per (eta, loss): trainer.seed = 1..N")
    ap.add_argument("--etas", default="0,1,2,4,8", help="comma-separated max_staleness values")
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {', '.join(LOSSES)}")
    ap.add_argument("--steps", type=int, default=40, help="learner steps per cell (x 16 groups)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every cell (repeatable)")
    ap.add_argument("--keep", action="store_true",
                    help="reuse the cells already in --json when it was written with the same settings (written after "
                         "every cell): an ablation longer than one sitting runs in parts")
    args = ap.parse_args()
    etas = [int(e) for e in args.etas.split(",")]
    losses = args.losses.split(",")
    unknown = [name for name in losses if name not in LOSSES]
    if unknown:
        ap.error(f"unknown loss(es) {unknown}; choose from {', '.join(LOSSES)}")

    from async_rl.config import load_config
    from async_rl.queue import EmbeddedRedis
    from async_rl.tiny import build_tiny_assets
    from async_rl.tiny.text import write_validation_split

    config, default_assets, val_rows = TASKS[args.task]
    base = load_config(config, [*args.set])
    batch, depth = base.learner.batch_size, base.queue.max_depth  # B of the staleness rule; the config's queue depth
    assets = (ROOT / (args.assets or Path(default_assets))).resolve()
    if not (assets / "assets.json").is_file():
        build_tiny_assets(assets, seed=0, task=args.task)
    val = assets / "data" / f"val_{val_rows}.jsonl"
    if not val.is_file():
        write_validation_split(assets, val_rows)
    out = (ROOT / (args.out or Path("runs/bench/staleness" + ("" if args.task == "addition" else f"-{args.task}")))).resolve()
    # seed by seed: an ablation cut short between parts holds every (eta, loss) at fewer seeds
    plan = [(eta, loss, seed) for seed in range(1, args.seeds + 1) for eta in etas for loss in losses]
    settings = {"task": args.task, "config": str(config.relative_to(ROOT)), "steps": args.steps, "batch_size": batch,
                "groups_per_cell": args.steps * batch, "val_rows": val_rows,
                "etas": etas, "losses": {name: list(LOSSES[name]) for name in losses}, "seeds": args.seeds, "overrides": args.set,
                "validation": "greedy: the base model once (async-rl eval), each cell at its end only",
                "machine": f"{os.cpu_count()} cores, cpu"}
    kept = kept_result(args.json, settings, lambda result: {k: v for k, v in result.items() if k in settings}) if args.keep else None
    cells = [refreshed(c) for c in kept["cells"]] if kept else []
    if not cells:
        shutil.rmtree(out, ignore_errors=True)
    base_acc = kept["base_acc"] if kept else base_accuracy(config, assets, val, out / "base", args.set)
    print(f"base model: greedy {base_acc:.1%} on {val.name}", flush=True)
    done = {(c["eta"], c["loss"], c["seed"]) for c in cells}
    todo = [cell for cell in plan if cell not in done]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as url:
        for i, (eta, loss, seed) in enumerate(todo, 1):
            cell = run_cell(config, assets, val, out, url, eta, loss, seed, args.steps, base_acc,
                            [f"queue.max_depth={max(depth, (eta + 1) * batch)}", *args.set])
            cells.append(cell)
            spent = time.monotonic() - started
            print(f"cell {len(cells)}/{len(plan)} eta={eta} {loss} seed={seed}: greedy {cell['final_acc']:.1%} ({cell['gain_points']:+.1f} points), "
                  f"staleness mean {cell['staleness_mean']:.2f} max {cell['staleness_max']:.0f}, IS weight mean {cell['is_weight_mean']:.3f} "
                  f"max {cell['is_weight_max']:.2f}, behav_kl {cell['behav_kl']:.4f}, {cell['wall_s']:.0f} s; "
                  f"ETA {spent / i * (len(todo) - i) / 60:.1f} min", flush=True)
            if args.json:  # after every cell: a run cut short keeps what it measured
                report_json({"base_acc": base_acc, "cells": cells, **settings}, args.json)
    cells.sort(key=lambda c: plan.index((c["eta"], c["loss"], c["seed"])))  # parts in plan order
    summary = summarize(cells)
    result = {"total_wall_s": sum(c["wall_s"] for c in cells), "target": target(summary, etas), **settings, "base_acc": base_acc,
              "summary": summary, "cells": cells}
    for row in summary:
        print(f"eta={row['eta']} {row['loss']:<9} greedy {row['final_acc']:.1%} +- {row['final_acc_ci95']:.1%} "
              f"(gain {row['gain_points']:+.1f}), staleness {row['staleness_mean']:.2f}")
    report({k: v for k, v in result.items() if k != "target"} | {f"target_{k}": v for k, v in result["target"].items()}, None)
    if args.json:
        report_json(result, args.json)
    if args.plot:
        plot(cells, summary, args.plot)


def base_accuracy(config: Path, assets: Path, val: Path, out: Path, overrides: list[str]) -> float:
    """Greedy accuracy of the base model on ``val``: ``async-rl eval`` (an offline vLLM engine, the
    run's reward function), its console in ``out``.log."""
    command = [sys.executable, "-m", "async_rl.cli", "eval", "--out", str(out), str(config), f"learner.model_path={assets / 'model'}",
               f"data.val_files={val}", *overrides]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"the base model's evaluation exited {done.returncode}: see {out.with_suffix('.log')}")
    return json.loads((out / "eval.json").read_text())["accuracy"]


def refreshed(cell: dict[str, Any]) -> dict[str, Any]:
    """A kept cell with its figures read again from its run directory when that is still there
    (the run's metrics are the record; a figure added to :func:`read_cell` since is filled in)."""
    run_dir = Path(cell["run_dir"])
    return cell | read_cell(run_dir, cell["base_acc"]) if (run_dir / "metrics.jsonl").is_file() else cell


def run_cell(config: Path, assets: Path, val: Path, out: Path, redis_url: str, eta: int, loss: str, seed: int, steps: int,
             base_acc: float, extra: list[str]) -> dict[str, Any]:
    """Train one cell with ``async-rl train`` on the shared Redis; its figures from metrics.jsonl."""
    name = f"eta{eta}-{loss}-s{seed}"
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a cell cut short in an earlier part
    command = quickstart_command(
        assets, run_dir, f"ablation-{name}-{os.getpid()}", *LOSSES[loss],
        f"data.val_files={val}", f"queue.redis_url={redis_url}",
        f"algorithm.max_staleness={eta}", "learner.fill_staleness_window=true", f"trainer.seed={seed}",
        f"trainer.total_steps={steps}", f"trainer.val_every={steps}", f"trainer.save_every={steps}", "trainer.val_n=0",
        "trainer.val_before_train=false", *extra,
        config=config)
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    with open(run_dir.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    wall_s = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"cell {name} exited {done.returncode}: see {run_dir.with_suffix('.log')}")
    return {"eta": eta, "loss": loss, "seed": seed, **read_cell(run_dir, base_acc), "wall_s": wall_s, "run_dir": str(run_dir)}


def read_cell(run_dir: Path, base_acc: float) -> dict[str, float]:
    """A finished cell's figures from its ``metrics.jsonl``: its greedy validation at the end
    against ``base_acc``, staleness over the trained groups, and the correction's per-step metrics
    (weight mean and PPO-clip fraction averaged over steps, weight maximum over all)."""
    from async_rl.launch.plots import staleness_counts

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "perf/tokens_per_s" in r]
    vals = [r for r in records if "val/greedy_accuracy" in r]
    lags = staleness_counts(steps)
    groups = sum(lags.values())

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steps)

    return {
        "final_acc": vals[-1]["val/greedy_accuracy"],
        "base_acc": base_acc,
        "gain_points": round(100 * (vals[-1]["val/greedy_accuracy"] - base_acc), 6),
        "staleness_mean": sum(lag * n for lag, n in lags.items()) / groups,
        "staleness_max": max(r["staleness/max"] for r in steps),
        "is_weight_mean": mean("actor/is_weight_mean"),
        "is_weight_max": max(r["actor/is_weight_max"] for r in steps),
        "is_ess": mean("actor/is_ess"),
        "is_clipped_fraction": mean("actor/is_clipped_fraction"),
        "pg_clipfrac": mean("actor/pg_clipfrac"),
        "masked_fraction": mean("actor/masked_fraction"),
        "behav_kl": mean("actor/behav_kl"),
        "ppo_kl": mean("actor/ppo_kl"),  # naive's distance of pi_theta from mu (its behav_kl is 0: pi_prox is mu)
        "groups": groups,
        # from the first step's compute (its wait for the first batch spans start-up)
        "train_s": max(r["time/elapsed_s"] for r in steps) - min(r["time/elapsed_s"] - (r["time/step"] - r["time/wait"]) for r in steps),
    }


def interval(values: list[float]) -> float:
    """Half-width of the 95 % interval of the mean of ``values`` (Student's t); nan for one value."""
    if len(values) < 2:
        return math.nan
    return T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (eta, loss): means over seeds with their 95 % intervals."""
    rows = []
    for eta, loss in dict.fromkeys((c["eta"], c["loss"]) for c in cells):
        mine = [c for c in cells if c["eta"] == eta and c["loss"] == loss]
        acc, gain = [c["final_acc"] for c in mine], [c["gain_points"] for c in mine]
        rows.append({"eta": eta, "loss": loss, "seeds": len(mine),
                     "final_acc": statistics.fmean(acc), "final_acc_ci95": interval(acc),
                     "gain_points": statistics.fmean(gain), "gain_points_ci95": interval(gain),
                     "staleness_mean": statistics.fmean(c["staleness_mean"] for c in mine),
                     "is_weight_mean": statistics.fmean(c["is_weight_mean"] for c in mine),
                     "is_clipped_fraction": statistics.fmean(c["is_clipped_fraction"] for c in mine),
                     "pg_clipfrac": statistics.fmean(c["pg_clipfrac"] for c in mine),
                     "behav_kl": statistics.fmean(c["behav_kl"] for c in mine),
                     "ppo_kl": statistics.fmean(c.get("ppo_kl", math.nan) for c in mine),  # nan: a kept cell without its run
                     "wall_s": statistics.fmean(c["wall_s"] for c in mine)})
    return rows


def target(summary: list[dict[str, Any]], etas: list[int]) -> dict[str, Any]:
    """decoupled at the largest eta against eta = 0: the gap in points (mean over seeds), whether
    it is within :data:`TARGET_POINTS` and whether both cells' 95 % intervals are at most +-
    that many points (the issue's rule: both); empty without both cells."""
    by = {(r["eta"], r["loss"]): r for r in summary}
    low, high = by.get((0, "decoupled")), by.get((max(etas), "decoupled"))
    if low is None or high is None or high is low:
        return {}
    gap = 100 * (high["final_acc"] - low["final_acc"])
    intervals = [100 * low["final_acc_ci95"], 100 * high["final_acc_ci95"]]
    narrow = all(ci <= TARGET_POINTS for ci in intervals)  # nan (one seed) is not narrow
    return {"eta": max(etas), "gap_points": gap, "ci95_points": intervals, "gap_within": gap >= -TARGET_POINTS,
            "intervals_within": narrow, "met": gap >= -TARGET_POINTS and narrow}


def plot(cells: list[dict[str, Any]], summary: list[dict[str, Any]], path: Path) -> None:
    """Greedy accuracy against eta: a line per loss through the seed means, each seed a point."""
    fig, ax = new_plot()
    names = list(dict.fromkeys(r["loss"] for r in summary))
    for k, loss in enumerate(names):
        rows = [r for r in summary if r["loss"] == loss]
        line = ax.plot([r["eta"] for r in rows], [100 * r["final_acc"] for r in rows], marker="o", label=loss)[0]
        seeds = [c for c in cells if c["loss"] == loss]
        jitter = 0.08 * (k - (len(names) - 1) / 2)  # side by side, not on top of each other
        ax.scatter([c["eta"] + jitter for c in seeds], [100 * c["final_acc"] for c in seeds], s=12, alpha=0.5, color=line.get_color())
    ax.set_xticks(sorted({c["eta"] for c in cells}))
    ax.axhline(100 * cells[0]["base_acc"], color="grey", linestyle="--", linewidth=1, label="base model")
    save_plot(fig, ax, path, "max_staleness (eta)", "final greedy validation accuracy (%)", "async-rl: accuracy against staleness (tiny CPU task)")


if __name__ == "__main__":
    main()
