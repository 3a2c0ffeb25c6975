"""Where asynchrony should win: long responses and slow tools, async-rl against its own
synchronous run and TRL's ``GRPOTrainer``, same machine, one arm after the other (issue 44).

Arms, all on the same config (``--set`` applies to every arm), model, rows, samples per step,
learning rate, reward and float32:

- ``async``: ``async-rl train`` at the config's ``algorithm.max_staleness`` (the default, 2);
- ``sync``: the same with ``algorithm.max_staleness=0``: generation and training alternate,
  same code;
- ``trl``: TRL's ``GRPOTrainer`` in its own venv, as ``benchmarks/vs_trl.py`` runs it (its own
  generation with ``transformers``); with ``--task slow_tool`` it has no arm yet (``differences``
  in the JSON: TRL's environments are tool calls; its ``rollout_func`` could play our episodes).

Tasks: ``running_sum`` (``configs/running_sum_quickstart.yaml``: responses of ~150 tokens on
average, a long tail to ~600) and ``slow_tool`` (``configs/slow_tool.yaml``: the multi-turn game
whose every step waits on a lognormal tool latency, median 0.3 s, p99 3 s). Both validate on
``data/val_1000.jsonl`` (1000 rows, disjoint from training; a standard error of ~1.5 points).

Per arm: greedy validation accuracy against wall time (from the first training step, start-up
apart, validation included), the time to ``--target-points`` over the arm's own base (fixed
before a run, by its command line: the JSON records it), samples (episodes) per second, and the
accuracy after the same number of samples (every arm trains ``--steps`` steps of the same
batch). From the sync arm's learner metrics: G (its median wait for a batch: the generation) and
T (the rest of its step), the overlap bound ``(G + T) / max(G, T)``, and the async arm's speedup
(sync wall / async wall) as a fraction of it.

    python benchmarks/where_async_wins.py --task running_sum --steps 100 --target-points 10 --keep \\
        --json benchmarks/results/where_async_wins_long.json --plot benchmarks/results/where_async_wins_long.png
    python benchmarks/where_async_wins.py --task slow_tool --json benchmarks/results/where_async_wins_tool.json \\
        --plot benchmarks/results/where_async_wins_tool.png

On the running sum X = 10 points and 100 steps per arm (TRL's generation of up to 640 tokens
with ``transformers`` is the slow arm), fixed before the three-arm run of the task as rebuilt on
2026-12-07 (each line starts with its prompt line), from its quickstart's curve at this learning
rate: +9 by step 20, +11.5 by 40, +19.5 by 60 on 200 rows. The task's first build, whose model
read the digits by position, gave X = 5 and no arm reached it (git history).

Targets (issue 44, fixed before any run): long responses: async reaches the target at least
1.3x sooner than TRL, its speedup over sync at least 0.85 of the overlap bound, its accuracy at
equal samples within 3 points of sync's; slow tool: async at least 2x the episodes/s of sync,
accuracy at equal episodes within 3 points. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from _report import kept_result, plot_curves, report, report_json
from _train import ROOT, read_metrics
from vs_trl import DIFFERENCES, async_rl_command, ensure_assets, grpo_config, run_async_rl, run_trl

TASKS = {
    "running_sum": (ROOT / "configs" / "running_sum_quickstart.yaml", "running_sum"),
    "slow_tool": (ROOT / "configs" / "slow_tool.yaml", "multiturn"),
}
"""Task -> (config, tiny task of its assets)."""
SPEEDUP_VS_TRL, BOUND_FRACTION, EQUAL_SAMPLES_POINTS, EPISODES_SPEEDUP = 1.3, 0.85, 3.0, 2.0
NO_TRL_ENV = (
    "no TRL arm on the slow-tool task yet. TRL 1.13's GRPOTrainer plays environments through environment_factory, "
    "whose methods the model calls as tools in a tool-calling chat template; our game answers each wrong answer "
    "with a user turn ('Higher.'/'Lower.') and the tiny model's template has no tool calls, so that path does not "
    "play the same episodes. Its experimental rollout_func (the user's own generation loop returning prompt and "
    "completion ids and log-probs) could: an episode loop around transformers' generate, the feedback tokens "
    "masked out of the loss, the same lognormal sleeps; not written"
)


def generation_and_training(rows: list[dict]) -> dict:
    """G and T of a synchronous run, seconds per step (medians over its steps after the first,
    which waits on start-up too): T the learner's part of a step (its step less its wait for the
    batch), G the rest of the interval between two steps (generation, scoring and the weight
    update). From the intervals, not ``time/wait``: before 2026-12-06 a wait longer than the
    driver's bounded learner call was cut to its last call (``time/wait`` 1.0 s of a 6.3 s
    interval in the running sum's sync arm)."""
    steps = [r for r in rows if "time/step" in r and "time/wait" in r]
    interval = statistics.median(b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in zip(steps, steps[1:]))
    t = statistics.median(r["time/step"] - r["time/wait"] for r in steps[1:])
    g = interval - t
    return {"G_s": round(g, 4), "T_s": round(t, 4), "step_interval_s": round(interval, 4), "overlap_bound": round((g + t) / max(g, t), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="running_sum")
    ap.add_argument("--config", type=Path, default=None, help="async-rl config of every arm (default: the task's)")
    ap.add_argument("--assets", type=Path, default=None, help="tiny assets dir (built if absent; default runs/bench/TINY_TASK-assets)")
    ap.add_argument("--val-file", default="val_1000.jsonl", help="validation file in the assets' data/ (written if a val_N split)")
    ap.add_argument("--arms", default="async,sync,trl", help="which arms to run (comma-separated subset)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per arm")
    ap.add_argument("--val-every", type=int, default=20, help="steps between validations")
    ap.add_argument("--target-points", type=float, default=10.0, help="greedy accuracy gain over the arm's base, in points")
    ap.add_argument("--trl-python", type=Path, default=Path(os.environ.get("TRL_PYTHON", ROOT / "runs" / "trl-venv" / "bin" / "python")))
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=None, help="run directories (default runs/bench/where-async-wins-TASK)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every arm")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--keep", action="store_true",
                    help="reuse the arms already in --json when it was written with the same settings (the JSON is "
                         "written after every arm, so a long benchmark cut short goes on from its last finished arm)")
    args = ap.parse_args()
    config, tiny_task = TASKS[args.task]
    args.config = args.config or config
    args.assets = args.assets or Path(f"runs/bench/{tiny_task}-assets")
    args.out = args.out or Path(f"runs/bench/where-async-wins-{args.task}")
    arms = args.arms.split(",")
    if not set(arms) <= {"async", "sync", "trl"}:
        raise SystemExit(f"--arms {args.arms}: a comma-separated subset of async,sync,trl")
    if args.task == "slow_tool" and "trl" in arms:
        arms.remove("trl")
    if "trl" in arms and not args.trl_python.is_file():
        raise SystemExit(f"--trl-python {args.trl_python}: not found; make TRL's venv with benchmarks/vs_trl_env.sh")

    from async_rl.config import load_config

    ensure_assets(args.assets, tiny_task, args.val_file)
    commands = {"async": async_rl_command(args, "async"), "sync": async_rl_command(args, "sync", "algorithm.max_staleness=0")}
    cfg = load_config(Path(commands["async"][4]), commands["async"][5:])
    if "trl" in arms:
        grpo_config(cfg, args.out)  # refuse what TRL cannot match before any arm runs
    result = kept_arms(args) if args.keep else {"task": args.task, "arms": {}, "commands": {}, "settings": settings(args)}
    for arm in arms:
        if arm in result["arms"]:
            print(f"[where_async_wins] arm {arm}: kept from {args.json}", flush=True)
            continue
        if arm == "trl":
            side, result["grpo_config"], result["commands"][arm] = run_trl(args, cfg)
        else:
            arm_cfg = load_config(Path(commands[arm][4]), commands[arm][5:])
            side, result["commands"][arm] = run_async_rl(args, commands[arm], arm_cfg)
        result["arms"][arm] = side
        if args.json:
            report_json(result, args.json)
    sync_metrics = Path(load_config(Path(commands["sync"][4]), commands["sync"][5:]).trainer.output_dir) / "metrics.jsonl"
    if "sync" in result["arms"] and sync_metrics.is_file():  # also for a kept arm: the rule may have changed since
        result["sync_stages"] = generation_and_training(read_metrics(sync_metrics.parent))
    summarize(result, args)
    flat = {f"{arm}.{k}": v for arm, side in result["arms"].items() for k, v in side.items() if k != "val"}
    report({**flat, **{k: v for k, v in result.items() if k not in ("arms", "commands", "differences", "settings")}}, None)
    if args.json:
        report_json(result, args.json)
    if args.plot:
        plot_curves({arm: [(v["t_s"], v["greedy"]) for v in side["val"]] for arm, side in result["arms"].items()}, args.plot,
                    marks={arm: side["time_to_target_s"] for arm, side in result["arms"].items()},
                    xlabel="wall time since the first training step (s); validation included",
                    title=f"{args.task}: async-rl async vs sync vs TRL ({os.cpu_count()} CPU cores)")
    return 0 if result.get("targets_met", True) else 1


def settings(args) -> dict:
    """What makes two invocations' arms comparable (``--keep`` reuses arms only when these match)."""
    return {"task": args.task, "config": str(args.config.resolve().relative_to(ROOT)), "steps": args.steps,
            "val_every": args.val_every, "val_file": args.val_file, "overrides": args.set,
            "target_points": args.target_points}


def kept_arms(args) -> dict:
    """The result so far from ``--json`` when it was written with this invocation's settings,
    else a fresh one (saying why the file's arms are not reused)."""
    fresh = {"task": args.task, "arms": {}, "commands": {}, "settings": settings(args)}
    return kept_result(args.json, fresh["settings"], lambda old: old.get("settings")) or fresh


def summarize(result: dict, args) -> None:
    """The comparisons and targets of the arms that ran, into ``result``."""
    arms, checks = result["arms"], {}
    if {"async", "sync"} <= arms.keys():
        a, s = arms["async"], arms["sync"]
        result["speedup_vs_sync"] = round(s["train_wall_s"] / a["train_wall_s"], 3)
        result["samples_per_s_ratio"] = round(a["samples_per_s"] / s["samples_per_s"], 3)
        result["final_points_vs_sync"] = round(100 * (a["final"] - s["final"]), 2)
        checks["equal_samples_within_3_points"] = abs(result["final_points_vs_sync"]) <= EQUAL_SAMPLES_POINTS
        if args.task == "slow_tool":
            checks["episodes_per_s_2x_sync"] = result["samples_per_s_ratio"] >= EPISODES_SPEEDUP
        else:
            bound = result["sync_stages"]["overlap_bound"]
            result["fraction_of_bound"] = round(result["speedup_vs_sync"] / bound, 3)
            checks["speedup_0.85_of_bound"] = result["fraction_of_bound"] >= BOUND_FRACTION
    if {"async", "trl"} <= arms.keys():
        ours, theirs = arms["async"]["time_to_target_s"], arms["trl"]["time_to_target_s"]
        result["speedup_to_target_vs_trl"] = round(theirs / ours, 2) if ours and theirs else None
        checks["target_1.3x_sooner_than_trl"] = ours is not None and (theirs is None or theirs / ours >= SPEEDUP_VS_TRL)
    result.update(checks=checks, targets_met=all(checks.values()) if checks else None,
                  target=f"+{args.target_points:g} points over each arm's base (fixed before the run)",
                  settings=settings(args),
                  differences=[*DIFFERENCES, *([NO_TRL_ENV] if args.task == "slow_tool" else [])],
                  machine=f"{os.cpu_count()} cores, cpu")


if __name__ == "__main__":
    sys.exit(main())
