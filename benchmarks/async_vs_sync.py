"""Asynchronous (eta = 2) against synchronous (eta = 0) training, same everything else.

One run, same machine, same config (the quickstart's, tiny model) except
``algorithm.max_staleness``; the same number of trained groups; the same split of CPU
cores between the rollout pool and the learner in both modes (the learner rank has one
core to itself; the vLLM server, the driver, Redis and Ray's daemons share the other:
``launch.cores.cpu_layout``). It also measures each stage
alone on the same groups — generation only, then learning only — for the overlap limit
``(T_gen + T_train) / max(T_gen, T_train)``: the best speedup overlapping can give.

    python benchmarks/async_vs_sync.py --json benchmarks/results/async_vs_sync.json \\
        --plot benchmarks/results/async_vs_sync.png [--set sync.backend=gloo ...]

    # the multi-turn agent (built-in environment addition_feedback):
    python benchmarks/async_vs_sync.py --config configs/multiturn_quickstart.yaml --task multiturn \\
        --assets runs/bench/multiturn-assets --json benchmarks/results/async_vs_sync_multiturn.json

JSON keys: sync_wall_s, async_wall_s, speedup, overlap_limit, efficiency (= speedup /
overlap_limit), sync_val_acc, async_val_acc, learner_busy_async, staleness_hist, plus the
stage timings, busy fractions and settings. Wall times exclude start-up (engine load),
which is the same in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

from _report import plot_curves, report

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=QUICKSTART, help="the config of every mode (default: the quickstart's)")
    ap.add_argument("--task", default="addition", help="tiny task of the assets when they are built (addition, multiturn)")
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"), help="tiny assets dir (built if absent)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"), help="run directories")
    ap.add_argument("--steps", type=int, default=60, help="learner steps per mode")
    ap.add_argument("--eta", type=int, default=2, help="max_staleness of the asynchronous mode")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every mode, e.g. --set sync.backend=gloo (repeatable)")
    args = ap.parse_args()

    from async_rl.config import load_config
    from async_rl.tiny import build_tiny_assets

    if not (args.assets / "assets.json").is_file():
        build_tiny_assets(args.assets, seed=0, task=args.task)

    def config(name: str, eta: int):
        return load_config(args.config, [
            f"learner.model_path={args.assets / 'model'}",
            f"data.train_files={args.assets / 'data' / 'train.jsonl'}",
            f"data.val_files={args.assets / 'data' / 'val.jsonl'}",
            f"algorithm.max_staleness={eta}",
            f"trainer.total_steps={args.steps}",
            f"trainer.val_every={max(1, args.steps // 3)}",
            f"trainer.save_every={args.steps}",
            f"trainer.output_dir={args.out / name}",
            f"trainer.run_name=bench-{name}-{os.getpid()}",
            "trainer.resume=off",
            "logging.wandb.enable=false",
            "logging.console=false",
            *args.set,
        ])

    import shutil

    shutil.rmtree(args.out / "alone", ignore_errors=True)
    t_gen, t_train, groups = stage_alone(config("alone", args.steps))  # eta: the learner trains on all of them
    modes = {}
    for name, eta in (("sync", 0), ("async", args.eta)):
        shutil.rmtree(args.out / name, ignore_errors=True)
        modes[name] = run_mode(config(name, eta))
        print(f"{name}: {modes[name]['wall_s']:.1f} s, final greedy val {modes[name]['val_acc']:.1%}", flush=True)

    overlap = (t_gen + t_train) / max(t_gen, t_train)
    speedup = modes["sync"]["wall_s"] / modes["async"]["wall_s"]
    result = {
        "sync_wall_s": modes["sync"]["wall_s"],
        "async_wall_s": modes["async"]["wall_s"],
        "speedup": speedup,
        "overlap_limit": overlap,
        "efficiency": speedup / overlap,
        "sync_val_acc": modes["sync"]["val_acc"],
        "async_val_acc": modes["async"]["val_acc"],
        "base_val_acc": modes["sync"]["base_val_acc"],
        "learner_busy_async": modes["async"]["learner_busy"],
        "learner_busy_sync": modes["sync"]["learner_busy"],
        "generation_busy_async": modes["async"]["generation_busy"],
        "generation_busy_sync": modes["sync"]["generation_busy"],
        "staleness_hist": modes["async"]["staleness_hist"],
        "staleness_hist_sync": modes["sync"]["staleness_hist"],
        "gen_alone_s": t_gen,
        "train_alone_s": t_train,
        "groups_per_mode": groups,
        "steps": args.steps,
        "eta_async": args.eta,
        "config": str(args.config),
        "cores": "learner rank alone on 1 core; vLLM, driver, Redis and Ray daemons on the other, in every mode",
        "machine": f"{os.cpu_count()} cores, cpu",
    }
    report(result, args.json)
    if args.plot:
        plot_curves({name: m["curve"] for name, m in modes.items()}, args.plot, xlabel="wall time since the first learner step (s)",
                    title="async-rl: asynchronous vs synchronous (tiny CPU task)")


def run_mode(cfg) -> dict:
    """Train one mode; read its metrics back."""
    from async_rl.launch.driver import train
    from async_rl.launch.plots import staleness_counts

    result = train(cfg)
    records = [json.loads(line) for line in (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/tokens_per_s" in r]
    vals = [r for r in records if "val/greedy_accuracy" in r]
    # the first step's compute began here (its wait for the first batch spans the base validation)
    first = min(r["time/elapsed_s"] - (r["time/step"] - r["time/wait"]) for r in steps)
    busy = sum(r["time/step"] - r["time/wait"] for r in steps)
    return {
        "wall_s": result.train_wall_s,
        "val_acc": vals[-1]["val/greedy_accuracy"],
        "base_val_acc": vals[0]["val/greedy_accuracy"],
        "learner_busy": busy / result.train_wall_s,
        "generation_busy": sum(result.server_busy_s) / len(result.server_busy_s) / result.train_wall_s,
        "staleness_hist": {lag: int(n) for lag, n in sorted(staleness_counts(steps).items())},
        "curve": [(max(0.0, r["time/elapsed_s"] - first), r["val/greedy_accuracy"]) for r in vals],
    }


def stage_alone(cfg) -> tuple[float, float, int]:
    """(seconds to generate the groups of all steps, seconds to train on them, groups)."""
    from async_rl.launch.cores import cpu_layout, pinned_to, support_cores

    groups = cfg.trainer.total_steps * cfg.learner.batch_size
    layout = cpu_layout(cfg)
    with contextlib.ExitStack() as stack:
        if layout:  # the same placement as train(): support processes on the rollout cores
            stack.enter_context(pinned_to(support_cores(layout)))
        t_gen, t_train = _stages(cfg, groups, layout)
    print(f"alone: generation {t_gen:.1f} s, learning {t_train:.1f} s for {groups} groups", flush=True)
    return t_gen, t_train, groups


def _stages(cfg, groups: int, layout) -> tuple[float, float]:
    """Generate ``groups`` groups into a fresh queue, then train every step on them."""
    import ray

    from async_rl.launch.ray_cluster import init_ray
    from async_rl.learner.actor import start_learners
    from async_rl.sync.auth import RunSecret
    from async_rl.queue import EmbeddedRedis

    init_ray(num_cpus=os.cpu_count())
    try:
        with EmbeddedRedis(Path(cfg.trainer.output_dir) / "redis") as url:
            t_gen = asyncio.run(_generate_alone(cfg, url, groups, layout[0][0] if layout else None))
            learners = start_learners(cfg, url, RunSecret.generate(), layout[1] if layout else None)
            ray.get([a.run.remote(0) for a in learners])
            start = time.monotonic()
            ray.get([a.run.remote(cfg.trainer.total_steps) for a in learners])
            t_train = time.monotonic() - start
            for a in learners:
                ray.get(a.close.remote())
                ray.kill(a)
    finally:
        ray.shutdown()
    return t_gen, t_train


async def _generate_alone(cfg, url: str, groups: int, cores: str | None) -> float:
    """Seconds for the server's own rollout worker (as in a run) to put ``groups`` groups."""
    import dataclasses
    from functools import partial

    import ray

    from async_rl.data.prompts import read_prompt_rows
    from async_rl.queue import ReplayQueue
    from async_rl.rollout.engine_args import engine_kwargs, openai_api_settings
    from async_rl.rollout.host import WorkerHost, WorkerHostSpec
    from async_rl.rollout.pool import ServerPool, ServerSpec

    r = cfg.rollout
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **({"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {})}
    pool = ServerPool(ServerSpec(engine_kwargs(cfg), r.cpus_per_server, 0, env, openai_api=openai_api_settings(cfg)), 1)
    await pool.start()
    rows, _ = read_prompt_rows(cfg.data.train_files)
    spec = WorkerHostSpec.from_config(cfg, url)
    # admission lets exactly `groups` groups start (B = groups, eta = 0); the queue holds them all
    spec = dataclasses.replace(spec, max_depth=groups, settings=dataclasses.replace(spec.settings, batch_size=groups, max_staleness=0))
    with ReplayQueue(url, cfg.trainer.run_name, max_depth=groups) as queue:
        start = time.monotonic()
        await pool.handle(0).start_workers.remote(partial(WorkerHost, spec), ray.put(rows), "server-0#0")
        while queue.stats()["depth"] < groups:
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - start
    await pool.shutdown()
    return elapsed


if __name__ == "__main__":
    main()
