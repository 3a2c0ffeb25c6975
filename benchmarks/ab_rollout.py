"""A/B of the rollout pool against raw vLLM across two commits, alternating in one invocation.

Runs ``benchmarks/rollout_throughput.py`` of each commit (its own code, this checkout's
environment) in turn, ``--pairs`` times (base, head, base, head, ...), and compares their
``ratio_vs_raw`` (pool / raw ``vllm.LLM.generate``, both measured in the same invocation, so
the machine's drift cancels within a run and alternation spreads it over both commits).
Compare only commits whose ``rollout_throughput.py`` measures alike: the committed
``ab_rollout.json`` (4839e21 1.04x, 4804f88 0.86x) compared a benchmark that ran the worker in
its own process and timed the worker's return with one that polled Redis every 5 ms, each
with its raw rounds minutes from its pool rounds; the pairing of raw and pool rounds in one
invocation (``rollout_throughput.py`` since 2026-11-26) measures the pool at 1.02x.

    python benchmarks/ab_rollout.py --base 4839e21 --pairs 5 --json benchmarks/results/ab_rollout.json

Keys: ``base``, ``head`` (commits), ``base_ratio_vs_raw`` and ``head_ratio_vs_raw`` (medians),
``head_over_base`` (ratio of the medians), and per invocation ``runs`` (commit, ratio,
pool and raw tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import report

ROOT = Path(__file__).resolve().parents[1]


def _worktree(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), rev], check=True, capture_output=True)
    return into


def _run(tree: Path, assets: Path, rounds: int, out: Path) -> dict:
    # RAY_ADDRESS=local: an old commit's plain ray.init() would join whatever cluster
    # /tmp/ray/ray_current_cluster names (a stale one after a killed `ray start`) and fail.
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_ADDRESS": "local"}
    cmd = [sys.executable, str(tree / "benchmarks" / "rollout_throughput.py"), "--assets", str(assets), "--rounds", str(rounds), "--json", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: rollout_throughput.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="4839e21", help="the commit to compare against (default: before the workers moved into the server)")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--pairs", type=int, default=5, help="invocations of each commit, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each side within one invocation (its median counts)")
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    revs = {name: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
            for name, rev in (("base", args.base), ("head", args.head))}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ab-rollout-") as tmp:
        trees = {name: _worktree(rev, Path(tmp) / name) for name, rev in revs.items()}
        try:
            for pair in range(args.pairs):
                for name in ("base", "head"):
                    got = _run(trees[name], args.assets.resolve(), args.rounds, Path(tmp) / f"{name}-{pair}.json")
                    runs.append({"commit": name, "ratio_vs_raw": got["ratio_vs_raw"], "pool_tokens_per_s": got["pool_tokens_per_s"],
                                 "raw_vllm_tokens_per_s": got["raw_vllm_tokens_per_s"]})
                    print(f"{name} {revs[name]} round {pair + 1}: {got['ratio_vs_raw']:.3f}x raw", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    ratios = {name: [r["ratio_vs_raw"] for r in runs if r["commit"] == name] for name in revs}
    base, head = statistics.median(ratios["base"]), statistics.median(ratios["head"])
    report({"base": revs["base"], "head": revs["head"], "base_ratio_vs_raw": base, "head_ratio_vs_raw": head, "head_over_base": head / base,
            "base_min": min(ratios["base"]), "base_max": max(ratios["base"]), "head_min": min(ratios["head"]), "head_max": max(ratios["head"]),
            "pairs": args.pairs, "rounds": args.rounds, "runs": runs}, args.json)


if __name__ == "__main__":
    main()
