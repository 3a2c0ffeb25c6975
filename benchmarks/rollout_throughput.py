"""Rollout pool throughput against raw vLLM, and the cost of an in-flight weight update.

Same model, same prompts, same sampling, one run:

* raw: ``vllm.LLM.generate`` of all prompts (``n`` samples each) in this process;
* pool: a Ray-hosted inference server running its rollout worker in its own process
  (cursor, admission, reward pool, msgspec records, Redis ``put``: the path of a run)
  producing the same number of groups;
* responses have a fixed length (``ignore_eos``) in both, so the numbers measure steady
  generation throughput rather than the start-up of a sub-second batch (the tiny model
  answers in 3-4 tokens, which made a 96-prompt run last under one second);
* update: one more pool round in which the weights are sent once from this process
  through ``WeightSender`` while the pool generates; the server reports how long
  generation was paused (``update_pause_s``), the sender the whole update
  (``update_total_s``), and that round's rate is ``pool_with_update_tokens_per_s``;
* each side runs ``--rounds`` timed rounds (after a warm-up) and counts its median round,
  because these shared machines drift by tens of percent within a minute.

    python benchmarks/rollout_throughput.py --json benchmarks/results/rollout_throughput.json

Prints a table and writes JSON with keys ``pool_tokens_per_s``, ``raw_vllm_tokens_per_s``,
``ratio_vs_raw``, ``update_pause_s``, ``update_total_s`` (plus the rounds and settings).
"""

from __future__ import annotations

import argparse
import asyncio
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
    raw = _raw(cfg, prompts, args.rounds)
    pool, with_update, pause_s, total_s = asyncio.run(_pool(cfg, args.prompts, args.rounds))
    result = {
        "pool_tokens_per_s": statistics.median(pool),
        "raw_vllm_tokens_per_s": statistics.median(raw),
        "ratio_vs_raw": statistics.median(pool) / statistics.median(raw),
        "update_pause_s": pause_s,
        "update_total_s": total_s,
        "pool_with_update_tokens_per_s": with_update,
        "with_update_ratio_vs_raw": with_update / statistics.median(raw),
        "rounds": {"raw_tokens_per_s": raw, "pool_tokens_per_s": pool},
        "raw_spread": (max(raw) - min(raw)) / statistics.median(raw),  # machine noise: above ~0.2, re-run
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


def _raw(cfg, prompts: list[list[int]], rounds: int) -> list[float]:
    """Tokens/s of ``LLM.generate`` over all prompts, per round."""
    from vllm import LLM, SamplingParams

    from async_rl.rollout.engine_args import engine_kwargs

    llm = LLM(logprobs_mode="processed_logprobs", **engine_kwargs(cfg))
    params = SamplingParams(n=cfg.rollout.n, temperature=1.0, max_tokens=cfg.rollout.max_response_length, logprobs=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0))
    llm.llm_engine.engine_core.shutdown()
    del llm
    return rates


async def _pool(cfg, count: int, rounds: int) -> tuple[list[float], float, float, float]:
    """Tokens/s through the pool per round; then one more round with an in-flight weight
    update: its tokens/s, and the update's pause and total seconds.

    The worker runs in the server's process and writes to Redis, as in a run. A round is
    admitted by publishing a version (``B = count``, ``eta = 0``) and ends when its
    ``count`` groups are in the queue; the first round (admitted at start) is the warm-up."""
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

    secret = RunSecret.generate()  # seals this benchmark's weight-sync control messages

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
    with EmbeddedRedis() as url, ReplayQueue(url, run="bench", max_depth=count) as queue:
        # rewards in the server's reward pool, as in a run
        hosted = WorkerHostSpec(url, "bench", count, 30.0, settings, 1, cfg.rollout.reward, cfg.rollout.max_response_length)
        pool = ServerPool(ServerSpec(engine_kwargs(cfg), num_cpus=1, env_vars=env, sync=SyncEndpoint(sender.address, secret),
                                     openai_api=openai_api_settings(cfg)), 1, workers=hosted, rows=ray.put(rows))
        await pool.start()

        async def round_tokens() -> int:
            while queue.stats()["depth"] < count:
                await asyncio.sleep(0.005)
            return sum(s.num_tokens for _, g in queue.get(count, timeout=30) for s in g.samples)

        await round_tokens()  # warm-up: the round admitted at version 0
        sender.wait_for_servers(1, timeout_s=60)
        rates = []
        for version in range(1, rounds + 2):
            t0 = time.perf_counter()
            if version > rounds:  # the last round: one in-flight update
                sent: dict = {}
                update = threading.Thread(target=_send_later, args=(sender, model, sent))
                update.start()
            queue.publish_version(version)  # admits this round's groups
            rates.append(await round_tokens() / (time.perf_counter() - t0))
        update.join()
        health = await pool.handle(0).health.remote()
        assert health.version == 1 and sent["result"].ok, f"the weight update did not reach the server: {sent['result']}"
        await pool.stop_workers(5.0)
        await pool.shutdown()
    sender.close()
    ray.shutdown()
    return rates[:-1], rates[-1], health.last_update_pause_s, sent["result"].total_s


def _send_later(sender, model, sent: dict) -> None:
    """Send the weights once as version 1, a moment after generation started (in flight)."""
    from async_rl.sync.buckets import tensor_specs

    time.sleep(0.5)
    named = list(model.named_parameters())
    sent["result"] = sender.send(iter(named), 1, specs=tensor_specs(named))


if __name__ == "__main__":
    main()
