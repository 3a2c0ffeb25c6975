"""Rollout pool throughput against raw vLLM, and the cost of an in-flight weight update.

Same model, same prompts, same sampling, one run:

* raw: ``vllm.LLM.generate`` of all prompts (``n`` samples each) in this process;
* pool: a Ray-hosted inference server running its rollout worker in its own process
  (cursor, admission, reward pool, msgspec records, Redis ``put``: the path of a run)
  producing the same number of groups, read back by a blocking queue read as the learner's;
* responses have a fixed length (``ignore_eos``) in both, so the numbers measure steady
  generation throughput rather than the start-up of a sub-second batch (the tiny model
  answers in 3-4 tokens, which made a 96-prompt run last under one second);
* rounds alternate, raw then pool, ``--rounds`` pairs after a warm-up of each: these shared
  machines drift by tens of percent within a minute (one side measured minutes after the
  other gave 0.81x-1.07x for the same code), and a pair's two rounds see the same drift. The
  ratio is the median of the pairs' pool/raw ratios;
* update: one more pool round in which the weights are sent once from this process
  through ``WeightSender`` while the pool generates; the server reports how long
  generation was paused (``update_pause_s``), the sender the whole update
  (``update_total_s``), and that round's rate is ``pool_with_update_tokens_per_s``.

    python benchmarks/rollout_throughput.py --json benchmarks/results/rollout_throughput.json

Prints a table and writes JSON with keys ``ratio_vs_raw`` (median of the pairs),
``pool_tokens_per_s``, ``raw_vllm_tokens_per_s`` (medians), ``update_pause_s``, ``update_total_s`` (plus the rounds and settings).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch
from _report import report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"), help="tiny assets dir (built if absent)")
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each side; the median counts")
    ap.add_argument("--worker-in", choices=("server", "benchmark"), default="server",
                    help="where the rollout worker runs: in the server's process, as in a run, or in this process "
                         "calling the server through Ray (how the pool ran before 2026-11; shows what hosting costs)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from async_rl.tiny import build_tiny_assets

    if not (args.assets / "assets.json").is_file():
        build_tiny_assets(args.assets, seed=0)
    from async_rl.config import load_config

    cfg = load_config(
        None,
        [
            f"learner.model_path={args.assets / 'model'}",
            f"data.train_files={args.assets / 'data' / 'train.jsonl'}",
            "data.max_prompt_length=64",
            f"rollout.max_response_length={args.max_tokens}",
            f"rollout.n={args.n}",
            f"learner.batch_size={args.prompts}",
            f"queue.max_depth={args.prompts}",
            "data.shuffle=false",
        ],
    )
    prompts = _prompts(cfg, args.prompts)
    rounds = asyncio.run(_alternate(cfg, prompts, args.rounds, args.worker_in))
    raw, pool = rounds["raw_tokens_per_s"], rounds["pool_tokens_per_s"]
    pairs = [p / r for p, r in zip(pool, raw, strict=True)]
    with_update = rounds["pool_with_update_tokens_per_s"]
    result = {
        "ratio_vs_raw": statistics.median(pairs),
        "pool_tokens_per_s": statistics.median(pool),
        "raw_vllm_tokens_per_s": statistics.median(raw),
        "median_ratio_of_medians": statistics.median(pool) / statistics.median(raw),
        "pairs_at_or_above_0.95": sum(r >= 0.95 for r in pairs),
        "update_pause_s": rounds["update_pause_s"],
        "update_total_s": rounds["update_total_s"],
        "pool_with_update_tokens_per_s": with_update,
        "with_update_ratio_vs_raw": with_update / raw[-1],
        "rounds": {"raw_tokens_per_s": raw, "pool_tokens_per_s": pool, "pool_over_raw": pairs},
        "raw_spread": (max(raw) - min(raw)) / statistics.median(raw),  # machine drift between rounds: the pairs cancel it
        "worker_in": args.worker_in,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {'cuda' if torch.cuda.is_available() else 'cpu'}",
    }
    report(result, args.json)


def _prompts(cfg, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from async_rl.data.prompts import PromptFormatter, read_prompt_rows

    rows, _ = read_prompt_rows(cfg.data.train_files)
    fmt = PromptFormatter(AutoTokenizer.from_pretrained(cfg.learner.model_path))
    return [fmt.token_ids(r.prompt) for r in rows[:count]]


class _Raw:
    """``vllm.LLM.generate`` of all prompts (``n`` samples each) in this process."""

    def __init__(self, cfg, prompts: list[list[int]]):
        from vllm import LLM, SamplingParams

        from async_rl.rollout.engine_args import engine_kwargs

        self.llm = LLM(logprobs_mode="processed_logprobs", **engine_kwargs(cfg))
        self.params = SamplingParams(n=cfg.rollout.n, temperature=1.0, max_tokens=cfg.rollout.max_response_length, logprobs=0, ignore_eos=True)
        self.prompts = [{"prompt_token_ids": p} for p in prompts]
        self.llm.generate(self.prompts[:4], self.params, use_tqdm=False)  # warm-up

    def round(self) -> float:
        """Tokens/s of one generation of all prompts."""
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


async def _alternate(cfg, prompts: list[list[int]], rounds: int, worker_in: str) -> dict:
    """``rounds`` pairs of a raw round and a pool round, alternating (the machine's drift
    over minutes hits both sides of a pair alike); then one pool round with an in-flight
    weight update: its tokens/s, and the update's pause and total seconds.

    The pool's worker runs in the server's process and writes to Redis, as in a run. A pool
    round is admitted by publishing a version (``B = count``, ``eta = 0``) and ends when its
    ``count`` groups were read from the queue (a blocking read, as the learner's); the first
    round (admitted at start) is the warm-up. The raw engine idles (blocked) during pool
    rounds and the pool's during raw rounds (its workers wait for admission)."""
    import ray
    from transformers import AutoModelForCausalLM

    from async_rl.data.prompts import read_prompt_rows
    from async_rl.launch.ray_cluster import init_ray
    from async_rl.queue import EmbeddedRedis, ReplayQueue
    from async_rl.rollout.engine_args import engine_kwargs, openai_api_settings
    from async_rl.rollout.host import WorkerHostSpec
    from async_rl.rollout.pool import ServerPool, ServerSpec
    from async_rl.rollout.types import Sampling
    from async_rl.rollout.worker import WorkerSettings
    from async_rl.sync.auth import RunSecret, SyncEndpoint
    from async_rl.sync.sender import WeightSender

    count = len(prompts)
    secret = RunSecret.generate()  # seals this benchmark's weight-sync control messages
    raw = _Raw(cfg, prompts)
    init_ray(num_cpus=os.cpu_count())
    sender = WeightSender(secret=secret, bucket_mb=cfg.sync.bucket_mb, timeout_s=120.0)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    rows, _ = read_prompt_rows(cfg.data.train_files)
    settings = WorkerSettings(
        run_id="bench", server_id="", n=cfg.rollout.n,
        sampling=Sampling(temperature=1.0, max_tokens=cfg.rollout.max_response_length, ignore_eos=True),
        batch_size=count, max_staleness=0, max_inflight=count, max_prompt_length=cfg.data.max_prompt_length, shuffle=False,
    )
    model = AutoModelForCausalLM.from_pretrained(cfg.learner.model_path, dtype=torch.float32)
    out: dict = {"raw_tokens_per_s": [], "pool_tokens_per_s": []}
    with EmbeddedRedis() as url, ReplayQueue(url, run="bench", max_depth=count) as queue:
        # rewards in the server's reward pool, as in a run
        hosted = WorkerHostSpec(url, "bench", count, 30.0, settings, 1, cfg.rollout.reward, cfg.rollout.max_response_length)
        pool = ServerPool(ServerSpec(engine_kwargs(cfg), num_cpus=1, env_vars=env, sync=SyncEndpoint(sender.address, secret),
                                     openai_api=openai_api_settings(cfg)), 1,
                          workers=hosted if worker_in == "server" else None, rows=ray.put(rows))
        await pool.start()
        local = None if worker_in == "server" else _local_worker(cfg, hosted, queue, rows, pool.generate_fn(0))

        def pool_round(version: int) -> float:
            t0 = time.perf_counter()
            queue.publish_version(version)  # admits this round's groups
            groups = queue.get(count, timeout=120)
            if len(groups) != count:
                raise RuntimeError(f"a pool round produced {len(groups)} of {count} groups within 120 s")
            rate = sum(s.num_tokens for _, g in groups for s in g.samples) / (time.perf_counter() - t0)
            queue.commit([entry for entry, _ in groups])
            return rate

        warm = await asyncio.to_thread(queue.get, count, timeout=120)  # warm-up: the round admitted at version 0
        queue.commit([entry for entry, _ in warm])
        sender.wait_for_servers(1, timeout_s=60)
        for version in range(1, rounds + 1):
            out["raw_tokens_per_s"].append(raw.round())  # blocks this loop: the pool has nothing admitted
            out["pool_tokens_per_s"].append(await asyncio.to_thread(pool_round, version))
        sent: dict = {}
        update = threading.Thread(target=_send_later, args=(sender, model, sent))
        update.start()  # one in-flight update during the last round
        out["pool_with_update_tokens_per_s"] = await asyncio.to_thread(pool_round, rounds + 1)
        update.join()
        raw.close()  # after the last pool round: a closing engine's processes take a few seconds of CPU to go
        health = await pool.handle(0).health.remote()
        if health.version != 1 or not sent["result"].ok:
            raise RuntimeError(f"the weight update did not reach the server: {sent['result']}")
        await pool.stop_workers(5.0)
        if local is not None:
            await local.stop(5.0)
        await pool.shutdown()
    sender.close()
    ray.shutdown()
    out["update_pause_s"], out["update_total_s"] = health.last_update_pause_s, sent["result"].total_s
    return out


def _local_worker(cfg, hosted, queue, rows, generate_fn) -> _LocalWorker:
    """A rollout worker in this process: the server's only through Ray calls."""
    from transformers import AutoTokenizer

    from async_rl.data.prompts import PromptFormatter
    from async_rl.rewards import RewardPool, RewardScorer
    from async_rl.rollout.worker import RolloutWorker

    rewards = RewardPool(cfg.rollout.reward)
    rewards.start()
    fmt = PromptFormatter(AutoTokenizer.from_pretrained(cfg.learner.model_path))
    settings = dataclasses.replace(hosted.settings, server_id="server-0", owner="server-0#local")
    worker = RolloutWorker(settings, queue, rows, fmt.token_ids, RewardScorer(rewards, cfg.rollout.reward, cfg.rollout.max_response_length), generate_fn)
    return _LocalWorker(worker, rewards)


class _LocalWorker:
    def __init__(self, worker, rewards):
        self.rewards = rewards
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(worker.run(self._stop))

    async def stop(self, grace_s: float) -> None:
        self._stop.set()
        await asyncio.wait_for(self._task, grace_s + 30)
        self.rewards.close()


def _send_later(sender, model, sent: dict) -> None:
    """Send the weights once as version 1, a moment after generation started (in flight)."""
    from async_rl.sync.buckets import tensor_specs

    time.sleep(0.5)
    named = list(model.named_parameters())
    sent["result"] = sender.send(iter(named), 1, specs=tensor_specs(named))


if __name__ == "__main__":
    main()
