"""Old code against new in one invocation: a benchmark run alternately from a base revision and this tree.

    python benchmarks/ab_compare.py --base 2ae676d --rounds 2 \\
        --json benchmarks/results/ab_learner_throughput.json -- benchmarks/learner_throughput.py
    python benchmarks/ab_compare.py --base 2ae676d --rounds 2 --keys speedup,efficiency,async_wall_s \\
        --json benchmarks/results/ab_async_vs_sync.json -- benchmarks/async_vs_sync.py --assets /abs/assets

The base revision is checked out into a temporary git worktree. Each round runs
``python SCRIPT ARGS --json FILE`` once from each tree (the script of that tree, its
``async_rl`` first on ``PYTHONPATH``, so Ray and vLLM processes import it too), base first in
even rounds and new first in odd ones, so the machine's drift falls on both sides alike.
``--script-from-new`` runs this tree's script on both sides (its helpers from this tree's
``benchmarks/``, ``async_rl`` from each side's tree): for a benchmark the base does not have.
The table compares the medians of every numeric top-level key of the scripts' JSON (or only
``--keys``) and gives each side's spread, ``max / min - 1`` over its rounds: a difference
inside the spread is noise. Relative paths in ARGS are taken from this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, script: Path, args: list[str], out: Path) -> dict[str, float]:
    """One run of ``script`` with ``tree``'s ``async_rl``, from ``tree``; its numeric top-level JSON values."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    subprocess.run([sys.executable, str(script), *args, "--json", str(out)], cwd=tree, env=env, check=True)
    values = json.loads(out.read_text())
    numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    numbers["ab/run_s"] = time.monotonic() - started
    return numbers


def spread(values: list[float]) -> float:
    """``max / min - 1`` (0 for one value; inf when the smallest is not positive)."""
    low, high = min(values), max(values)
    return 0.0 if len(values) < 2 or high == low else (high / low - 1 if low > 0 else float("inf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision of the old code")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side")
    parser.add_argument("--keys", default="", help="comma-separated JSON keys to compare (default: every numeric one)")
    parser.add_argument("--json", type=Path, required=True, help="write the runs and the comparison here")
    parser.add_argument("--script-from-new", action="store_true",
                        help="run this tree's script on both sides (a benchmark the base does not have; only async_rl differs)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] (relative to the repository root)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark after --, e.g. -- benchmarks/learner_throughput.py")
    script, script_args = command[0], [str((ROOT / a).resolve()) if (ROOT / a).exists() and not a.startswith("-") and a != command[0] else a
                                       for a in command[1:]]
    base_rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    new_rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout.strip())
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base_rev], cwd=ROOT, check=True, capture_output=True)
        try:
            for round_ in range(args.rounds):
                for side in (("base", "new") if round_ % 2 == 0 else ("new", "base")):
                    tree = base_tree if side == "base" else ROOT
                    print(f"[ab] round {round_ + 1}/{args.rounds}: {side} ({tree})", flush=True)
                    script_path = (ROOT if args.script_from_new else tree) / script
                    runs[side].append(run_once(tree, script_path, script_args, Path(tmp) / f"{side}-{round_}.json"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False, capture_output=True)
    keys = [k for k in args.keys.split(",") if k] or sorted(set(runs["base"][0]) & set(runs["new"][0]))
    rows, summary = [], {}
    for key in keys:
        old, new = [r[key] for r in runs["base"]], [r[key] for r in runs["new"]]
        m_old, m_new = statistics.median(old), statistics.median(new)
        entry = {"base_median": m_old, "new_median": m_new, "new_over_base": m_new / m_old if m_old else float("nan"),
                 "base_spread": spread(old), "new_spread": spread(new)}
        summary[key] = entry
        rows.append((key, f"{m_old:.4g}", f"{m_new:.4g}", f"{entry['new_over_base']:.3f}", f"{entry['base_spread']:.1%}",
                     f"{entry['new_spread']:.1%}"))
    print(f"{script}: base {base_rev[:8]} vs new {new_rev[:8]}{' (+ uncommitted changes)' if dirty else ''}, "
          f"{args.rounds} rounds each, alternating")
    header = ("key", "base median", "new median", "new/base", "base spread", "new spread")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(f"{str(cell):<{w}}" for cell, w in zip(row, widths)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"script": script, "script_from_new": args.script_from_new, "args": command[1:], "base": base_rev, "new": new_rev, "new_dirty": dirty,
                                     "rounds": args.rounds, "summary": summary, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
