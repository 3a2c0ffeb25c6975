"""How long `async-rl train` takes to start: the quickstart on the tiny assets, 4 steps, no
validation, as a user runs it (the CLI in a subprocess), several rounds.

    python benchmarks/train_start.py [--rounds 3] [--json benchmarks/results/train_start.json]

Per round: ``start_s`` (the command's launch to the driver's "rollout workers started": the
tokenizer and data, the reward probe, Redis, Ray, the learner and the inference server built)
and ``total_s`` (to its exit: 4 steps and the shutdown). A measurement on this machine, no pass
rule; docs/testing.md ("Where a start goes") has the phases and the figures before and after
the start stopped pinning everything to the rollout core. The first round of a fresh machine
also fills inductor's compile cache (docs/testing.md): run twice to see the warm figure.

JSON keys: rounds (start_s and total_s each), start_s_median, total_s_median, cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import report  # noqa: E402
from _train import STARTED, ConsoleRun, quickstart_command  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from async_rl.tiny import build_tiny_assets
    from async_rl.tiny.cache import cached_tiny_assets

    assets = cached_tiny_assets("addition", 0, lambda out: build_tiny_assets(out, seed=0)).model_dir.parent
    rounds = []
    for k in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            run = ConsoleRun(quickstart_command(assets, Path(tmp) / "run", f"start-{os.getpid()}-{k}", "trainer.total_steps=4",
                                                "trainer.val_every=0"), f"round {k}")
            code = run.finish()
            started = run.first(STARTED)
            if code != 0 or started is None:
                raise SystemExit(f"round {k}: the run exited {code} (started: {started is not None})")
            rounds.append({"start_s": round(started - t0, 1), "total_s": round(time.time() - t0, 1)})
    report({"start_s_median": statistics.median(r["start_s"] for r in rounds),
            "total_s_median": statistics.median(r["total_s"] for r in rounds),
            "cores": len(os.sched_getaffinity(0)), "rounds": rounds}, args.json)


if __name__ == "__main__":
    main()
