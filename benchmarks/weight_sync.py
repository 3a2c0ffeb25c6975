"""Weight updates into a real inference server on this machine: shared memory (ipc) vs a gloo broadcast.

One learner (this process: a ``WeightSender`` publishing a model's parameters, as learner
rank 0 does) and two real inference servers (Ray actors with a vLLM engine each, the same
model), one registered with a ``gloo`` sender and one with an ``ipc`` sender, so the two
backends alternate update by update on the same machine state. The model is the 118 MB
publishing model of ``learner_throughput.py`` (29 M float32 parameters) unless ``--model``.

Per update, from the sender's ``SendResult`` and the server's report (medians over
``--updates`` updates per backend, after one warm-up each):

- ``*_transfer_s``: from the learner's first tensor until the server holds all of them,
  before loading (gloo: the broadcast, which ends when every byte arrived; ipc: packing
  into shared memory and telling the server);
- ``*_update_s``: the learner's whole update, acknowledged (transfer, the server's load);
- ``*_pause_s``: how long the server's generation stood still (pause, load, resume).

    python benchmarks/weight_sync.py --json benchmarks/results/weight_sync.json

Targets: ``ipc_transfer_s`` at most 1/3 of ``gloo_transfer_s``, ``ipc_update_s`` below
``gloo_update_s``, ``ipc_pause_s`` at most 1.1 x ``gloo_pause_s``; exits 1 if missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _report import report  # noqa: E402

TRANSFER_TARGET, PAUSE_TARGET = 1 / 3, 1.1
BACKENDS = ("gloo", "ipc")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face model directory (default: the 118 MB model, built)")
    parser.add_argument("--updates", type=int, default=7, help="timed updates per backend")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import ray
    from transformers import AutoModelForCausalLM

    from async_rl.config import load_config
    from async_rl.launch.ray_cluster import init_ray
    from async_rl.rollout.engine_args import engine_kwargs
    from async_rl.rollout.pool import ServerPool, ServerSpec
    from async_rl.sync.buckets import tensor_specs
    from async_rl.sync.auth import RunSecret, SyncEndpoint
    from async_rl.sync.sender import WeightSender

    secret = RunSecret.generate()  # seals this benchmark's weight-sync control messages

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from learner_throughput import build_model

            model_dir = Path(tmp) / "model"
            build_model(model_dir, hidden=512, layers=8)
        cfg = load_config(None, [f"learner.model_path={model_dir}", "rollout.vllm.dtype=float32", "rollout.openai_api=false",
                                 "data.max_prompt_length=64", "rollout.max_response_length=64"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        named = list(model.named_parameters())
        specs = tensor_specs(named)
        nbytes = sum(s.nbytes for s in specs)

        init_ray(num_cpus=os.cpu_count() or 1)
        senders = {b: WeightSender(secret=secret, bucket_mb=args.bucket_mb, backend=b, timeout_s=120.0) for b in BACKENDS}
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
        pools = {b: ServerPool(ServerSpec(engine_kwargs(cfg), num_cpus=0, env_vars=env, sync=SyncEndpoint(s.address, secret)), 1)
                 for b, s in senders.items()}
        runs: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
        try:
            for pool in pools.values():
                asyncio.run(pool.start())
            for b, s in senders.items():
                s.wait_for_servers(1, timeout_s=60.0)
            for i in range(args.updates + 1):  # alternate: the same machine state for both
                for b, s in senders.items():
                    result = s.send(iter(named), i + 1, specs=specs)
                    if not result.ok:
                        raise RuntimeError(f"{b} update {i + 1} failed: {result.failed}")
                    (server,) = result.servers.values()
                    if i > 0:  # the first update of each is the warm-up (group creation, first mapping)
                        runs[b].append({"transfer_s": result.transfer_s, "update_s": result.total_s, "pause_s": server.pause_s,
                                        "server_receive_s": server.receive_s, "server_load_s": server.load_s})
            for b, pool in pools.items():
                health = ray.get(pool.handle(0).health.remote())
                if health.version != args.updates + 1:
                    raise RuntimeError(f"the {b} server holds version {health.version}, not {args.updates + 1}")
        finally:
            for pool in pools.values():
                asyncio.run(pool.shutdown())
            for s in senders.values():
                s.close()
            ray.shutdown()

    result: dict[str, object] = {"bytes": nbytes, "updates_per_backend": args.updates, "bucket_mb": args.bucket_mb}
    for b in BACKENDS:
        for key in ("transfer_s", "update_s", "pause_s", "server_receive_s", "server_load_s"):
            result[f"{b}_{key}"] = statistics.median(r[key] for r in runs[b])
    result["ipc_transfer_speedup"] = result["gloo_transfer_s"] / result["ipc_transfer_s"]  # type: ignore[operator]
    result["ipc_update_speedup"] = result["gloo_update_s"] / result["ipc_update_s"]  # type: ignore[operator]
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, cpu"
    ok = (result["ipc_transfer_s"] <= TRANSFER_TARGET * result["gloo_transfer_s"]  # type: ignore[operator]
          and result["ipc_update_s"] < result["gloo_update_s"]  # type: ignore[operator]
          and result["ipc_pause_s"] <= PAUSE_TARGET * result["gloo_pause_s"])  # type: ignore[operator]
    result["targets_met"] = ok
    result["runs"] = runs
    report(result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
