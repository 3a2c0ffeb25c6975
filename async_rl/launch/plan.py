"""What a run will start, where, and whether this machine can hold it (``--dry-run``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from async_rl.config import Config


@dataclass
class ProcessPlan:
    """One process the run starts."""

    role: str
    """``inference-server-i`` or ``learner-rank-i``."""
    cpus: float
    gpus: float
    detail: str = ""


@dataclass
class Plan:
    """Processes, resources and endpoints of a run."""

    device: str
    """``cuda`` or ``cpu`` (where this driver runs)."""
    processes: list[ProcessPlan]
    redis: str
    ray: str
    sync_backend: str
    output_dir: str
    cpus_needed: float
    gpus_needed: float
    cpus_here: int
    gpus_here: int
    errors: list[str] = field(default_factory=list)
    """Problems that stop the run before it starts (missing files)."""
    warnings: list[str] = field(default_factory=list)
    """Things to know (resources that only a cluster has, hub model ids)."""


def is_hub_id(path: str) -> bool:
    """``org/name`` with no local meaning: transformers and vLLM fetch it from the hub."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).exists()


def make_plan(cfg: Config) -> Plan:
    """The plan of ``cfg`` on this machine (nothing is started)."""
    import torch

    gpu = torch.cuda.is_available()
    r, lrn = cfg.rollout, cfg.learner
    processes = [
        ProcessPlan(f"inference-server-{i}", r.cpus_per_server, r.gpus_per_server,
                    f"vLLM engine, {r.workers_per_server} worker loop(s), up to {r.max_inflight} groups in flight each{_openai_api(cfg, i)}")
        for i in range(r.num_servers)
    ] + [
        ProcessPlan(f"learner-rank-{i}", lrn.cpus_per_rank, lrn.gpus_per_rank,
                    "FSDP2 rank" + (", queue consumer, weight sender" if i == 0 else ""))
        for i in range(lrn.world_size)
    ]
    plan = Plan(
        device="cuda" if gpu else "cpu",
        processes=processes,
        redis=cfg.queue.redis_url and _redact(cfg.queue.redis_url) or "embedded redis-server on 127.0.0.1 (free port, generated password, AOF)",
        ray=cfg.ray.address or f"local Ray instance ({cfg.ray.num_cpus or 'all'} CPUs)",
        sync_backend=cfg.sync.backend if cfg.sync.backend != "auto" else ("nccl" if gpu else "gloo"),
        output_dir=cfg.trainer.output_dir,
        cpus_needed=sum(p.cpus for p in processes),
        gpus_needed=sum(p.gpus for p in processes),
        cpus_here=cfg.ray.num_cpus or os.cpu_count() or 1,
        gpus_here=torch.cuda.device_count() if gpu else 0,
    )
    _check_files(cfg, plan)
    if cfg.ray.address is not None and cfg.queue.redis_url is None:
        plan.warnings.append("the embedded redis-server listens on 127.0.0.1 only: on a multi-node cluster set queue.redis_url "
                             "to a Redis that every node reaches (learner rank 0 may run on another node)")
    if cfg.ray.address is None:
        if plan.cpus_needed > plan.cpus_here:
            plan.warnings.append(f"needs {plan.cpus_needed:g} CPUs for its actors, this machine has {plan.cpus_here}: Ray will wait for resources")
        if plan.gpus_needed > plan.gpus_here:
            plan.warnings.append(f"needs {plan.gpus_needed:g} GPUs, this machine has {plan.gpus_here}: run it on a GPU node or set ray.address")
    return plan


def _openai_api(cfg: Config, index: int) -> str:
    """Where server ``index`` serves the OpenAI-compatible API, as a detail suffix ("" when off)."""
    r = cfg.rollout
    if not r.openai_api:
        return ""
    return f", OpenAI API on {r.openai_host}:{r.openai_port + index if r.openai_port else '(free port)'}"


def _check_files(cfg: Config, plan: Plan) -> None:
    model = cfg.learner.model_path
    if not model:
        plan.errors.append("learner.model_path is empty: set it to a Hugging Face model directory")
    elif is_hub_id(model):
        plan.warnings.append(f"learner.model_path={model!r} is not a local directory: it will be loaded from the Hugging Face hub")
    elif not (Path(model) / "config.json").is_file():
        plan.errors.append(f"learner.model_path={model!r} is not a model directory (no config.json); build the tiny one with `async-rl assets tiny --out DIR`")
    for key, path in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if key == "data.train_files" and not path:
            plan.errors.append("data.train_files is empty: set it to a JSONL file of prompts")
        elif path and not Path(path).is_file():
            plan.errors.append(f"{key}={path!r} not found")


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if at else url


def render(plan: Plan) -> str:
    """Human-readable plan."""
    lines = [
        f"device: {plan.device}   sync backend: {plan.sync_backend}   output: {plan.output_dir}",
        f"ray: {plan.ray}",
        f"redis: {plan.redis}",
        f"resources: {plan.cpus_needed:g} CPUs, {plan.gpus_needed:g} GPUs for actors (this machine: {plan.cpus_here} CPUs, {plan.gpus_here} GPUs)",
        "processes:",
        *(f"  {p.role:<22} cpus={p.cpus:g} gpus={p.gpus:g}  {p.detail}" for p in plan.processes),
        "ports: chosen free at start (redis, weight-sync control, process-group store, vLLM workers, OpenAI API unless "
        "rollout.openai_port is set); the servers' API URLs are written to servers.json in the output directory",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += [f"error: {e}" for e in plan.errors]
    return "\n".join(lines)
