"""A run whose reward function hangs or raises on some inputs, beside a clean run, at default settings.

Each case trains the quickstart config (``configs/quickstart.yaml``, every reward and
rollout setting at its default) with one reward function of ``faulty_rewards.py``: it
hangs forever (sleeping, or spinning the CPU) on a fixed ~1 % or ~10 % of responses, or
raises on ~10 %. Each case is a separate ``async-rl train`` process; the script reads its
console as it is printed (times of the step lines and of the first line naming a reward
failure), then its ``metrics.jsonl`` and ``reward_errors.jsonl``.

    python benchmarks/faulty_user_code.py --json benchmarks/results/faulty_user_code.json

Per case: ``steps``, ``minutes`` (from the rollout workers' start to the last step: start-up
excluded), ``steps_per_min`` and ``steps_per_min_ratio`` (vs the clean run),
``longest_gap_s`` (between consecutive steps, the first counted from the workers' start),
``samples_kept_fraction`` (samples trained / samples the learner read, whatever the reason
it dropped one), ``failed_fraction`` (samples whose reward failed / samples scored),
``console_latency_s`` (from the first failure to the console line naming it) and
``exit_code``. A case stops at ``--steps`` steps or ``--budget-min`` minutes after its
workers started (then SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from _report import report
from _train import ROOT, STARTED, ConsoleRun, quickstart_command

CASES = ("clean", "hang_sleep_10pct", "hang_sleep_1pct", "hang_spin_10pct", "hang_spin_1pct", "raise_10pct")
FAILURE_LINE = ("the reward function raised", "the reward function timed out")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"), help="tiny assets dir (built if absent)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/faulty"), help="run directories")
    ap.add_argument("--steps", type=int, default=20, help="learner steps per case")
    ap.add_argument("--budget-min", type=float, default=8.0, help="minutes after the workers' start before a case is stopped")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    if not (args.assets / "assets.json").is_file():
        from async_rl.tiny import build_tiny_assets

        build_tiny_assets(args.assets, seed=0, task="addition")
    results = {}
    for case in args.cases.split(","):
        results[case] = run_case(case, args)
        print(f"{case}: {json.dumps(results[case])}", flush=True)
    clean = results.get("clean", {}).get("steps_per_min")
    for r in results.values():
        r["steps_per_min_ratio"] = r["steps_per_min"] / clean if clean else None
    flat = {f"{case}.{key}": value for case, r in results.items() for key, value in r.items()
            if key in ("steps_per_min_ratio", "longest_gap_s", "samples_kept_fraction", "failed_fraction", "console_latency_s", "minutes")}
    report({**flat, "cases": results, "steps": args.steps, "config": "configs/quickstart.yaml (defaults; validation off)",
            "machine": f"{os.cpu_count()} cores, cpu"}, args.json)


def run_case(case: str, args: argparse.Namespace) -> dict:
    """Train one case in its own process; what its console and files show."""
    run_dir = (args.out / case).resolve()
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run = ConsoleRun(quickstart_command(args.assets, run_dir, f"faulty-{case}-{os.getpid()}",
                                        f"rollout.reward.function={ROOT / 'benchmarks' / 'faulty_rewards.py'}:{case}",
                                        f"trainer.total_steps={args.steps}", "trainer.val_every=0", f"trainer.save_every={args.steps}"), case)
    while run.proc.poll() is None:
        time.sleep(0.5)
        started = run.first(STARTED)
        if started is not None and time.time() > started + args.budget_min * 60:
            run.stop()
    return measure(run.lines, run_dir, run.finish())


def measure(lines: list[tuple[float, str]], run_dir: Path, exit_code: int) -> dict:
    """The figures of one case from its timed console lines and its run directory."""
    started = next((t for t, text in lines if STARTED in text), None)
    steps = [t for t, text in lines if text.startswith("step ")]
    out: dict = {"exit_code": exit_code, "steps": len(steps)}
    if started is None:
        return {**out, "error": "the rollout workers never started", "steps_per_min": 0.0}
    end = steps[-1] if steps else max(t for t, _ in lines)
    times = [started, *steps]
    out["minutes"] = (end - started) / 60
    out["steps_per_min"] = len(steps) / out["minutes"] if steps else 0.0
    out["longest_gap_s"] = max(b - a for a, b in zip(times, times[1:])) if steps else end - started
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").exists() else []
    step_records = [r for r in records if "perf/tokens_per_s" in r]
    trained = sum(r.get("batch/samples", 0.0) for r in step_records)
    last = step_records[-1] if step_records else {}
    n = 8  # rollout.n of the quickstart
    # samples left out of trained groups, and whole groups dropped for any reason (stale included)
    dropped = sum(v for k, v in last.items() if k.startswith("counters/dropped/")) + n * sum(
        v for k, v in last.items() if k.startswith("queue/dropped/"))
    out["samples_kept_fraction"] = trained / (trained + dropped) if trained + dropped else None
    errors = run_dir / "reward_errors.jsonl"
    rows = [json.loads(x) for x in errors.read_text().splitlines()] if errors.exists() else []
    scored = max((r.get("rollout/groups_put", 0.0) for r in records), default=0.0) * n
    out["failed_fraction"] = len(rows) / scored if scored else None
    if rows:
        first_failure = min(r["time"] for r in rows)
        named = next((t for t, text in lines if text.startswith(FAILURE_LINE)), None)
        out["console_latency_s"] = None if named is None else named - first_failure
        out["first_failure"] = {k: rows[0][k] for k in ("kind", "signature", "where", "input")}
    return out


if __name__ == "__main__":
    main()
