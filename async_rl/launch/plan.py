"""What a run will start, where, and whether this machine can hold it (``--dry-run``)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_rl.config import Config, redact_url
from async_rl.launch import disk, run_state
from async_rl.launch.prometheus import port_error
from async_rl.learner import attention, kernels, vision
from async_rl.learner.memory import (
    GB,
    RankExtras,
    MemoryEstimate,
    UPDATE_BYTES_PER_PARAM,
    ModelShape,
    budget_gb,
    cuda_ipc_handoff,
    estimate,
    max_fitting_tokens,
    resolve_gradient_checkpointing,
    servers_gpu_share,
)
from async_rl.rollout.openai_api import dev_mode_problem


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
    memory: MemoryEstimate | None = None
    """Per-rank memory estimate of the learner; None when the model's config.json is not here."""
    checkpointing_auto: bool = False
    """Whether ``memory.checkpointing`` was chosen by ``learner.fsdp.gradient_checkpointing: auto``."""
    disk: disk.DiskNeed | None = None
    """What the run writes into ``trainer.output_dir`` at most at once; None when the model's config.json is not here."""
    lora: str = ""
    """``learner.lora``: the adapter's size and the bytes of one weight update; empty otherwise."""
    monitoring: str = ""
    """Where the run's metrics go."""


def is_hub_id(path: str) -> bool:
    """``org/name`` with no local meaning: transformers and vLLM fetch it from the hub."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).exists()


def sync_backends(backend: str, gpu: bool, local: bool) -> str:
    """What weight updates travel on (``sync.backend``), as the plan shows it."""
    group = backend if backend in ("nccl", "gloo") else ("nccl" if gpu else "gloo")
    if backend in ("nccl", "gloo"):
        return group
    handoff = "ipc (CUDA IPC to servers on learner rank 0's GPU, host shared memory to the rest)" if gpu else "ipc"
    return handoff if local else f"{handoff} on learner rank 0's node, {group} to the others"


class StartupError(RuntimeError):
    """The run cannot start; the message is the reason."""


def startable_plan(cfg: Config) -> Plan:
    """:func:`make_plan`, or :class:`StartupError` naming every error it found (the one rule
    that refuses a run before anything starts)."""
    plan = make_plan(cfg)
    if plan.errors:
        raise StartupError("; ".join(plan.errors))
    return plan


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
    ] + [
        ProcessPlan(f"{name}-{i}", model.cpus_per_server, model.gpus_per_server,
                    f"vLLM engine of models.{name} ({model.model_path}), no weight updates"
                    + (", shares the cores of the rest" if model.cpus_per_server == 0 else ""))
        for name, model in cfg.models.items() for i in range(model.own_servers)
    ] + [
        ProcessPlan(f"{name}-external", 0, 0, f"models.{name} on {model.url} (outside the run: not started, healed or resized by it)")
        for name, model in cfg.models.items() if model.url
    ]
    plan = Plan(
        device=("cuda" if gpu else "cpu") + (_sharing(r.num_servers, gpu) if servers_gpu_share(r, lrn) else ""),
        processes=processes,
        redis=cfg.queue.redis_url and redact_url(cfg.queue.redis_url) or "embedded redis-server on 127.0.0.1 (free port, generated password, AOF)",
        ray=cfg.ray.address or f"local Ray instance ({cfg.ray.num_cpus or 'all'} CPUs)",
        sync_backend=sync_backends(cfg.sync.backend, gpu, local=cfg.ray.address is None),
        output_dir=cfg.trainer.output_dir,
        cpus_needed=sum(p.cpus for p in processes),
        gpus_needed=sum(p.gpus for p in processes),
        cpus_here=cfg.ray.num_cpus or os.cpu_count() or 1,
        gpus_here=torch.cuda.device_count() if gpu else 0,
    )
    plan.monitoring = _monitoring(cfg, plan)
    _check_files(cfg, plan)
    _check_teacher(cfg, plan)
    _check_kernels(cfg, plan)
    _check_vision(cfg, plan)
    _check_lora(cfg, plan)
    _check_memory(cfg, plan)
    _check_disk(cfg, plan)
    if problem := run_state.refusal(cfg):
        plan.errors.append(problem)
    if r.openai_api and (problem := dev_mode_problem(os.environ)):
        plan.errors.append(problem)
    if note := run_state.plan_note(cfg):
        plan.warnings.append(note)
    if cfg.ray.address is not None and cfg.queue.redis_url is None:
        plan.warnings.append("the embedded redis-server listens on 127.0.0.1 only: on a multi-node cluster set queue.redis_url "
                             "to a Redis that every node reaches (the inference servers write their groups to it, and learner rank 0 reads them, "
                             "from whichever node they run on)")
    if cfg.ray.address is None:
        if plan.cpus_needed > plan.cpus_here:
            (plan.errors if plan.gpus_needed <= plan.gpus_here else plan.warnings).append(_cpu_shortage(cfg, plan))
        if plan.gpus_needed > plan.gpus_here:
            plan.warnings.append(f"needs {plan.gpus_needed:g} GPUs, this machine has {plan.gpus_here}: run it on a GPU node or set ray.address")
    return plan


def _cpu_shortage(cfg: Config, plan: Plan) -> str:
    """Why the actors do not fit this machine's CPUs. A local Ray never gets more, so a run
    would wait for its last actor until the stall timeout: an error where the run is meant to
    start here, a warning for a plan of a GPU config on a machine without its GPUs."""
    r, lrn = cfg.rollout, cfg.learner
    return (f"needs {plan.cpus_needed:g} CPUs for its actors (rollout.num_servers={r.num_servers} x rollout.cpus_per_server={r.cpus_per_server:g} "
            f"+ learner.world_size={lrn.world_size} x learner.cpus_per_rank={lrn.cpus_per_rank:g}"
            + "".join(f" + models.{name}.num_servers={m.num_servers} x models.{name}.cpus_per_server={m.cpus_per_server:g}"
                      for name, m in cfg.models.items() if not m.url)
            + f"), and the local Ray has {plan.cpus_here} "
            f"(ray.num_cpus={cfg.ray.num_cpus if cfg.ray.num_cpus is not None else 'null: every core'}): it would wait for the rest forever. "
            "Lower those keys (a served model with cpus_per_server=0 shares the cores of the rest), or raise ray.num_cpus "
            "to share cores (nothing is pinned then)")


def _openai_api(cfg: Config, index: int) -> str:
    """Where server ``index`` serves the OpenAI-compatible API, as a detail suffix ("" when off)."""
    r = cfg.rollout
    if not r.openai_api:
        return ""
    key = "API key required" if r.openai_api_key else "no API key"
    return f", OpenAI API on {r.openai_host}:{r.openai_port + index if r.openai_port else '(free port)'} ({key})"


def _check_files(cfg: Config, plan: Plan) -> None:
    model = cfg.learner.model_path
    if not model:
        plan.errors.append("learner.model_path is empty: set it to a Hugging Face model directory")
    elif is_hub_id(model):
        plan.warnings.append(f"learner.model_path={model!r} is not a local directory: it will be loaded from the Hugging Face hub")
    elif not (Path(model) / "config.json").is_file():
        plan.errors.append(f"learner.model_path={model!r} is not a model directory (no config.json); build the tiny one with `async-rl assets tiny --out DIR`")
    for name, served in cfg.models.items():
        if not is_hub_id(served.model_path) and not (Path(served.model_path) / "config.json").is_file():
            plan.errors.append(f"models.{name}.model_path={served.model_path!r} is not a model directory (no config.json)")
        if served.api_key_env and not os.environ.get(served.api_key_env):
            plan.errors.append(f"models.{name}.api_key_env={served.api_key_env!r}: the driver's environment has no such variable "
                               f"(export {served.api_key_env}=<the key of {served.url}>)")
    for key, path in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if key == "data.train_files" and not path:
            plan.errors.append("data.train_files is empty: set it to a JSONL file of prompts")
        elif path and not Path(path).is_file():
            plan.errors.append(f"{key}={path!r} not found")


def _check_teacher(cfg: Config, plan: Plan) -> None:
    """``algorithm.distill``: the teacher scores the student's own token ids, so both models must
    read them alike: the same vocabulary (token to id) and the same end-of-sequence token."""
    distill = cfg.algorithm.distill
    if distill is None or plan.errors:  # a missing model directory is named already
        return
    paths = {"learner.model_path": cfg.learner.model_path, f"models.{distill.teacher}.model_path": cfg.models[distill.teacher].model_path}
    if any(is_hub_id(path) for path in paths.values()):
        plan.warnings.append("algorithm.distill: the teacher's and the policy's tokenizers are compared only for local model directories")
        return
    from transformers import AutoTokenizer

    student, teacher = (AutoTokenizer.from_pretrained(path) for path in paths.values())
    vocab_s, vocab_t = student.get_vocab(), teacher.get_vocab()
    if vocab_s != vocab_t or student.eos_token_id != teacher.eos_token_id:
        differ = sorted(set(vocab_s.items()) ^ set(vocab_t.items()))[:3]
        plan.errors.append(f"algorithm.distill.teacher={distill.teacher!r}: its tokenizer is not the policy's ({len(vocab_t)} vs {len(vocab_s)} "
                           f"tokens, eos {teacher.eos_token_id} vs {student.eos_token_id}; first differences {differ}): the teacher would "
                           f"score other tokens than the student sampled. Distil from a teacher of the same tokenizer")


def learner_device_type(cfg: Config) -> str:
    """``cuda`` for a GPU learner (``learner.gpus_per_rank > 0``), else ``cpu``."""
    return "cuda" if cfg.learner.gpus_per_rank > 0 else "cpu"


def read_model_config(model_path: str) -> dict[str, Any] | None:
    """The ``config.json`` of ``model_path``: a local directory, or a hub id already in the local
    Hugging Face cache (nothing is downloaded); None when there is none here."""
    path = Path(model_path) / "config.json"
    if model_path and not path.is_file() and is_hub_id(model_path):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        cached = try_to_load_from_cache(model_path, "config.json")
        path = Path(cached) if isinstance(cached, str) else path
    if not model_path or not path.is_file():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _check_kernels(cfg: Config, plan: Plan) -> None:
    """Kernels the learner's device cannot run (whether flash_attn is installed on the learner's
    machines is checked when the policy loads)."""
    device_type = learner_device_type(cfg)
    for why in (attention.problem(cfg.learner.kernels, device_type, flash_installed=True),
                kernels.liger_problem(cfg.learner.kernels, device_type, installed=True)):
        if why is not None:
            plan.errors.append(why)


def _check_vision(cfg: Config, plan: Plan) -> None:
    """A vision-language model the learner cannot train, and VPPO without one."""
    try:
        model_config = read_model_config(cfg.learner.model_path)
    except ValueError:
        return  # reported by the memory check
    if model_config is None:
        return
    vlm = vision.is_vision_language(model_config)
    try:
        vision.check_supported(model_config)
    except vision.UnsupportedVisionModel as exc:
        plan.errors.append(f"learner.model_path={cfg.learner.model_path!r}: {exc}")
    if vlm and cfg.algorithm.needs_critic:
        plan.errors.append("algorithm.advantage.name='gae' trains a critic, which a vision-language policy does not support yet; use grpo, rloo, ...")
    if cfg.algorithm.use_vppo_on_perception and not vlm:
        plan.errors.append(f"algorithm.use_vppo_on_perception=true needs a vision-language model; learner.model_path={cfg.learner.model_path!r} "
                           "has no vision_config")



def _check_lora(cfg: Config, plan: Plan) -> None:
    """``learner.lora``'s targets against the model's modules (a name that matches none is an
    error listing the valid ones; so is a vision-language model), and the adapter's size."""
    lora = cfg.learner.lora
    if lora is None:
        return
    try:
        model_config = read_model_config(cfg.learner.model_path)
    except ValueError:
        return  # reported by the memory check
    if model_config is None:
        if is_hub_id(cfg.learner.model_path):
            plan.warnings.append(f"learner.lora.target_modules not checked: learner.model_path={cfg.learner.model_path!r} has no local config.json")
        return
    from async_rl.learner.lora import target_problems  # loads peft and transformers: only for a LoRA run

    try:
        problems = target_problems(model_config, lora)
    except (TypeError, ValueError) as exc:  # AutoConfig.for_model: no model_type, or one transformers does not know
        problems = [f"learner.model_path={cfg.learner.model_path!r}: transformers cannot build a model from its config.json "
                    f"({str(exc).split('. ')[0]}), so learner.lora.target_modules cannot be checked; LoRA needs a Qwen2/Llama causal LM"]
    plan.errors.extend(problems)
    if problems:
        return
    try:
        shape = ModelShape.from_config(model_config)
        adapter = shape.lora_params(lora.target_modules, lora.rank)
    except ValueError:
        return  # no shape the estimate knows: the memory check says why
    plan.lora = (f"lora: rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on {','.join(lora.target_modules)}: "
                 f"{adapter / 1e6:.1f}M trained parameters ({adapter / shape.params:.2%} of {shape.params / 1e9:.2f}B, the base frozen); "
                 f"{UPDATE_BYTES_PER_PARAM * adapter / 1e6:.1f} MB per weight update (full weights: "
                 f"{UPDATE_BYTES_PER_PARAM * shape.params / GB:.1f} GB)")


def _check_memory(cfg: Config, plan: Plan) -> None:
    """Estimate the learner's per-rank memory; an error naming the knobs when it does not fit."""
    lrn = cfg.learner
    try:
        model_config = read_model_config(lrn.model_path)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        plan.warnings.append(f"no learner memory estimate: cannot read learner.model_path's config.json ({exc})")
        return
    if model_config is None:
        if lrn.model_path and is_hub_id(lrn.model_path):
            plan.warnings.append(f"no learner memory estimate: learner.model_path={lrn.model_path!r} has no local config.json "
                                 "(point it at a local copy, or at a directory holding the model's config.json, to check memory)")
        return  # an empty or missing model directory is already an error
    device_type = learner_device_type(cfg)
    share = servers_gpu_share(cfg.rollout, lrn) if device_type == "cuda" else 0.0
    beside = RankExtras.of(cfg.algorithm, lrn.lora, handoff=cuda_ipc_handoff(cfg.sync, share))
    if share >= 1:
        plan.errors.append(f"the inference servers on learner rank 0's GPU take all of it: {share:.0%} (rollout.vllm.gpu_memory_utilization="
                           f"{cfg.rollout.vllm.gpu_memory_utilization:g} per server, rollout.gpus_per_server={cfg.rollout.gpus_per_server:g}, "
                           f"learner.gpus_per_rank={lrn.gpus_per_rank:g}); lower rollout.vllm.gpu_memory_utilization")
        return
    try:
        budget = budget_gb(lrn, device_type, share)
        checkpointing = resolve_gradient_checkpointing(lrn, model_config, device_type, beside, share)
        est = estimate(model_config, lrn, checkpointing, budget, device_type, beside)
    except ValueError as exc:
        plan.warnings.append(f"no learner memory estimate for learner.model_path={lrn.model_path!r}: {exc}")
        return
    plan.memory, plan.checkpointing_auto = est, lrn.fsdp.gradient_checkpointing == "auto"
    if not est.fits:
        plan.errors.append(_does_not_fit(cfg, model_config, est, device_type, beside))


def _check_disk(cfg: Config, plan: Plan) -> None:
    """An error when ``trainer.output_dir``'s disk cannot hold what the run writes there (:mod:`~async_rl.launch.disk`)."""
    try:
        model_config = read_model_config(cfg.learner.model_path)
        if model_config is None:
            return  # no model directory: already an error (or a hub id, whose size is unknown here)
        needed = disk.need(cfg, model_config)
    except ValueError:  # an unreadable config.json or unknown LoRA targets: said by the memory check
        return
    plan.disk = needed
    if problem := disk.shortage(cfg.trainer.output_dir, needed.total, needed.describe()):
        # A GPU config planned on a machine without its GPUs is meant for another machine's disk: a warning there.
        (plan.errors if plan.gpus_needed <= plan.gpus_here else plan.warnings).append(f"{problem}: free space there, or set trainer.output_dir to a larger disk "
                           f"(fewer bytes: learner.lora, a smaller queue.max_depth)")


def _does_not_fit(cfg: Config, model_config: dict[str, Any], est: MemoryEstimate, device_type: str,
                  beside: RankExtras) -> str:
    """The error of a plan whose learner does not fit: the budget, and what each knob would give."""
    lrn = cfg.learner
    budget = est.budget_gb

    def total(checkpointing: bool = est.checkpointing, **changes: Any) -> float:
        trial = dataclasses.replace(lrn, **changes)
        return estimate(model_config, trial, checkpointing, budget, device_type, beside).total_gb

    if device_type == "cuda":
        source = ("learner.gpu_memory_gb" if lrn.gpu_memory_gb is not None
                  else "this GPU's memory" if _has_gpu() else "assumed for a GPU not on this machine; set learner.gpu_memory_gb")
        share = servers_gpu_share(cfg.rollout, lrn)
        if share:
            source += (f", less {share:.0%} for the inference server(s) on the same GPU "
                       f"(rollout.vllm.gpu_memory_utilization={cfg.rollout.vllm.gpu_memory_utilization:g})")
    else:
        source = f"this machine's memory / learner.world_size={lrn.world_size}"
    fit_tokens = max_fitting_tokens(model_config, lrn, est.checkpointing, budget, device_type, beside)
    sample = cfg.max_sample_tokens
    tokens = (f"at most {fit_tokens} fits" if fit_tokens else "no size fits") + (
        f", but one sample needs {sample}" if fit_tokens < sample else "")
    if est.checkpointing:
        ckpt = "learner.fsdp.gradient_checkpointing is on already"
    else:
        on_tokens = max_fitting_tokens(model_config, lrn, True, budget, device_type, beside)
        ckpt = (f"learner.fsdp.gradient_checkpointing=on: {total(checkpointing=True):.1f} GB "
                f"({f'then at most {on_tokens} tokens fit' if on_tokens else 'still no micro-batch size fits'})")
    ws = lrn.world_size * 2
    sharded = est.params_gb + est.grads_gb + est.optimizer_gb
    world = total(world_size=ws)
    small_chunk = min(1024, lrn.logprob_chunk_tokens)
    chunk = total(logprob_chunk_tokens=small_chunk)
    return (f"learner memory: the estimate {est.total_gb:.1f} GB per rank exceeds the {budget:.4g} GB budget ({source}). "
            f"Turn: learner.max_tokens_per_microbatch={lrn.max_tokens_per_microbatch} (activations {est.activations_gb:.1f} GB; "
            f"{tokens}); {ckpt}; learner.world_size={lrn.world_size} (params, grads and optimizer {sharded:.1f} GB, sharded over the ranks: "
            f"world_size={ws} gives {world:.1f} GB); learner.logprob_chunk_tokens={lrn.logprob_chunk_tokens} "
            f"(log-prob chunk {est.logprob_chunk_gb:.1f} GB; {small_chunk} gives {chunk:.1f} GB)")


def _sharing(num_servers: int, gpu: bool) -> str:
    """The plan's note on a layout whose inference server(s) and learner rank share a GPU."""
    who = "inference-server-0 and learner-rank-0" if num_servers == 1 else "inference servers and learner rank 0"
    return f" ({who} share it)" if gpu else f"; on the GPU node, {who} share one GPU"


def _has_gpu() -> bool:
    """Whether this machine has a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


def _monitoring(cfg: Config, plan: Plan) -> str:
    """Where metrics go; a fixed ``logging.prometheus_port`` that is taken now is an error."""
    log = cfg.logging
    sinks = ["console"] if log.console else []
    sinks += ["metrics.jsonl"] if log.jsonl else []
    sinks += [f"W&B ({os.environ.get('WANDB_MODE', log.wandb.mode)})"] if log.wandb.enable else []
    if log.prometheus_port is not None:
        sinks.append(f"Prometheus on {log.prometheus_host}:{log.prometheus_port or 'a free port'} (URL in servers.json)")
        if log.prometheus_port:
            with socket.socket(socket.AF_INET6 if ":" in log.prometheus_host else socket.AF_INET) as sock:
                try:
                    sock.bind((log.prometheus_host, log.prometheus_port))
                except OSError as exc:
                    plan.errors.append(port_error(log.prometheus_host, log.prometheus_port, exc))
    sinks += ["PNG plots at the end"] if log.plots and log.jsonl else []
    return ", ".join(sinks) or "nothing (logging.* all off)"


def render(plan: Plan) -> str:
    """Human-readable plan."""
    lines = [
        f"device: {plan.device}   sync backend: {plan.sync_backend}   output: {plan.output_dir}",
        f"ray: {plan.ray}",
        f"redis: {plan.redis}",
        f"resources: {plan.cpus_needed:g} CPUs, {plan.gpus_needed:g} GPUs for actors (this machine: {plan.cpus_here} CPUs, {plan.gpus_here} GPUs)",
        *([plan.memory.summary(auto=plan.checkpointing_auto)] if plan.memory is not None else []),
        *([plan.lora] if plan.lora else []),
        *([f"disk: about {disk.size(plan.disk.total)} in the output directory ({plan.disk.describe()}); "
           f"{disk.size(disk.free_bytes(plan.output_dir)[1])} free there"] if plan.disk is not None else []),
        "processes:",
        *(f"  {p.role:<22} cpus={p.cpus:g} gpus={p.gpus:g}  {p.detail}" for p in plan.processes),
        f"monitoring: {plan.monitoring}",
        "ports: chosen free at start (redis, weight-sync control, process-group store, vLLM workers, OpenAI API unless "
        "rollout.openai_port is set); the servers' API URLs are written to servers.json in the output directory",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += [f"error: {e}" for e in plan.errors]
    return "\n".join(lines)
