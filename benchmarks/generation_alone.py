"""Generation alone: seconds for one inference server's own rollout worker (as in a run) to put a
run's groups into a fresh queue, no learner beside it (``async_vs_sync.py``'s generation stage).

    python benchmarks/generation_alone.py --assets runs/bench/assets --json out.json
    python benchmarks/ab_compare.py --base 619f12a --rounds 4 --script-from-new \\
        --json benchmarks/results/ab_generation_alone.json -- benchmarks/generation_alone.py --assets runs/bench/assets

The config is the quickstart's (``--steps`` x ``learner.batch_size`` groups of
``rollout.n`` samples), the placement ``async_vs_sync.py``'s. JSON: gen_alone_s, groups, groups_per_s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
from pathlib import Path

from _report import report
from async_vs_sync import QUICKSTART, _generate_alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=QUICKSTART)
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"), help="tiny assets dir (built if absent)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/generation-alone"), help="run directory (emptied first)")
    ap.add_argument("--steps", type=int, default=60, help="learner steps whose groups are generated")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from async_rl.config import load_config
    from async_rl.launch.cores import cpu_layout, pinned_to, support_cores
    from async_rl.launch.ray_cluster import init_ray
    from async_rl.queue import EmbeddedRedis
    from async_rl.tiny import build_tiny_assets

    if not (args.assets / "assets.json").is_file():
        build_tiny_assets(args.assets, seed=0)
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = load_config(args.config, [
        f"learner.model_path={args.assets / 'model'}", f"data.train_files={args.assets / 'data' / 'train.jsonl'}",
        f"data.val_files={args.assets / 'data' / 'val.jsonl'}", f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={args.out}", f"trainer.run_name=generation-alone-{os.getpid()}", "trainer.resume=off",
        "logging.wandb.enable=false", "logging.console=false",
    ])
    groups = cfg.trainer.total_steps * cfg.learner.batch_size
    layout = cpu_layout(cfg)
    init_ray(num_cpus=os.cpu_count())
    try:
        with contextlib.ExitStack() as stack:
            if layout:  # async_vs_sync's placement: support processes on the rollout cores
                stack.enter_context(pinned_to(support_cores(layout)))
            with EmbeddedRedis(args.out / "redis") as url:
                seconds = asyncio.run(_generate_alone(cfg, url, groups, layout[0][0] if layout else None))
    finally:
        import ray

        ray.shutdown()
    report({"gen_alone_s": round(seconds, 3), "groups": groups, "groups_per_s": round(groups / seconds, 1)}, args.json)


if __name__ == "__main__":
    main()
