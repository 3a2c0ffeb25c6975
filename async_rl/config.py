"""Typed configuration: dataclasses, YAML files, dotlist overrides and strict validation.

Every section is a dataclass whose fields carry a default and a docstring (the string
literal right after the field; ``async-rl config docs`` renders them). Loading is strict:

* an unknown key fails and names the full key and the closest valid one;
* a value of the wrong type names the key, the value and the expected type;
* a number outside the range declared beside its field (:mod:`async_rl.bounds`) names the
  key, the value and the range; cross-field rules (``validate``) name every key involved.

All three raise :class:`ConfigError`; the CLI turns it into exit code 2.

Usage::

    cfg = load_config("configs/quickstart.yaml", ["learner.optim.lr=1e-6"])
    print(to_yaml(cfg))

Of async_rl, this module depends only on :mod:`async_rl.algos.options` (the algorithms' names,
needs and loss options) and :mod:`async_rl.bounds` (the ranges; docs/architecture.md:
dependencies point one way).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import ipaddress
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from async_rl.algos.options import (
    ESTIMATORS,
    LOSSES,
    AdvantageName,
    KLName,
    LossName,
    LossOptions,
)
from async_rl.bounds import bound_of, bound_problems, bounded, unbounded


class ConfigError(ValueError):
    """A configuration problem; the message says which key and how to fix it."""


# --------------------------------------------------------------------------- sections

_WEEK_S = 7 * 86400
"""The longest any key in seconds may be: longer than any wait of a run, and an infinite or
huge one overflows where it is converted (``int(queue.timeout_s)``: ``OverflowError``; int
milliseconds of Redis and of poll)."""


def _seconds(default: float) -> float:
    """A timeout or lifetime field in seconds: finite, > 0 and at most a week."""
    return bounded(default, gt=0, le=_WEEK_S)


OPENAI_API_KEY_ENV = "ASYNC_RL_OPENAI_API_KEY"
"""Environment variable that sets ``rollout.openai_api_key`` (it wins over the config's value)."""
MIN_API_KEY_LENGTH = 16
"""Fewest characters ``rollout.openai_api_key`` may have."""
LOOPBACK_NAMES = ("localhost",)
"""Host names that mean loopback (besides the loopback addresses 127.0.0.0/8 and ::1)."""


def _port(default: int | None) -> int | None:
    """A TCP port field: 0 asks the OS for a free one."""
    return bounded(default, ge=0, le=65535)


@dataclass
class DataConfig:
    """Training and validation prompts."""

    train_files: str = ""
    """Path to the training JSONL file (one object per line, EasyR1 format)."""
    val_files: str = ""
    """Path to the validation JSONL file; empty disables validation."""
    prompt_key: str = "problem"
    """Field of each row that holds the prompt text."""
    answer_key: str = "answer"
    """Field of each row that holds the reference answer given to the reward function."""
    system_prompt: Optional[str] = None
    """System message put before every prompt by the chat template; null for none."""
    format_prompt: Optional[str] = None
    """Path to a Jinja template rendering the user message from ``content`` (the prompt text), as in EasyR1; null uses the prompt text as is."""
    max_prompt_length: int = bounded(512, ge=1)
    """Longest prompt in tokens (after the chat template)."""
    overlong_prompt: Literal["skip", "truncate"] = "skip"
    """What to do with a longer prompt: ``skip`` it (counted) or ``truncate`` it from the left."""
    shuffle: bool = True
    """Shuffle the prompt order (deterministically, with ``data.seed``) each epoch."""
    seed: int = unbounded(1, "random.Random takes every int")
    """Seed of the prompt order."""
    image_key: str = "images"
    """Field of a vision-language row that holds its list of images (data URIs, ``file://`` URLs or paths); rows without it are text-only."""
    image_dir: Optional[str] = None
    """Folder that relative image paths are read from; null: the dataset file's folder."""
    min_pixels: int = bounded(262144, ge=1)
    """Smaller images are upscaled to this many pixels (width x height), aspect kept (EasyR1's default)."""
    max_pixels: int = bounded(4194304, ge=1)
    """Larger images are downscaled to this many pixels (width x height), aspect kept (EasyR1's default)."""


@dataclass
class VllmConfig:
    """Engine arguments of each inference server's vLLM engine."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype; ``auto`` is bfloat16 on GPU and float32 on CPU."""
    max_model_len: Optional[int] = bounded(None, ge=1)
    """Context length of the engine in tokens; null = max_prompt_length + max_response_length."""
    gpu_memory_utilization: float = bounded(0.6, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """GPUs per inference server (tensor parallelism)."""
    kv_cache_space_gb: float = bounded(1.0, gt=0)
    """KV-cache size in GiB on CPU (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPU."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decoding)."""


@dataclass
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13)."""

    enable: bool = False
    """Penalise responses that come within ``buffer_length`` tokens of the maximum length."""
    buffer_length: int = bounded(64, ge=1)
    """Length of the penalty ramp in tokens."""
    penalty_factor: float = bounded(1.0, ge=0)
    """Penalty at the maximum length (the ramp goes linearly from 0 to this value)."""


@dataclass
class RewardConfig:
    """How samples are scored."""

    function: str = "exact_match"
    """Built-in name (``exact_match``, ``math``, ``format``) or ``path/to/file.py:function`` with EasyR1's interface (see ``type``)."""
    type: Literal["batch", "sequential"] = "batch"
    """EasyR1's ``reward_type``: ``batch`` calls ``fn(list of dicts, **kwargs) -> list of dicts``; ``sequential`` calls ``fn(dict, **kwargs) -> dict`` once per sample."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to every call of the function (EasyR1's ``reward_function_kwargs``), e.g. ``{max_response_length: 256}``."""
    num_workers: int = bounded(2, ge=1)
    """Processes the reward pool of each inference server keeps (and the driver's, for the start-up probe and validation); a call runs in one of them, so a hung or crashing function never blocks generation (EasyR1 calls it in the trainer's process)."""
    max_workers: int = bounded(32, ge=1)
    """Most processes a pool grows to while calls wait for workers held by slow or hung calls (one more after a call has waited 0.5 s while every worker, started, has been on its call that long; an extra idle for 60 s is stopped); >= ``num_workers``."""
    timeout_s: float = _seconds(5.0)
    """Longest the function may run on one input, seconds (a ``batch`` call gets this bound as a whole; an input or batch call past it is interrupted in its process, and a batch call that ran over is retried one input per call). The input then gets the error; a function the interrupt cannot stop within 5 s more has its process group killed and replaced. 5 s is math_verify's own default; EasyR1 has no timeout."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop (and count) groups whose rewards are all equal."""
    overlong_penalty: OverlongPenaltyConfig = field(default_factory=OverlongPenaltyConfig)
    """Soft penalty for responses near ``rollout.max_response_length``."""


@dataclass
class EnvConfig:
    """Multi-turn episodes against an environment (docs/environments.md) instead of single-turn prompts."""

    name: Optional[str] = None
    """Built-in environment or ``path/to/file.py:Class`` (a subclass of ``async_rl.envs.BaseEnvironment``); null: single-turn prompts scored by ``rollout.reward``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The environment's parameters (attributes of its ``EnvironmentConfig``)."""
    max_turns: int = bounded(8, ge=1)
    """Model turns per episode at most; ``rollout.max_response_length`` bounds the tokens of all of them together."""
    max_turn_tokens: int = bounded(0, ge=0)
    """Most tokens the model generates in one turn; 0: whatever is left of the episode's ``rollout.max_response_length``."""
    reward: Literal["sum", "final"] = "sum"
    """The episode's reward: the sum of the step rewards, or the last one."""
    step_timeout_s: float = _seconds(30.0)
    """Longest one environment call (``reset`` with the constructor and ``get_prompt_prefix``, or one ``step``) may take, seconds; the episode then fails (``env_timeout``)."""
    num_workers: int = bounded(2, ge=1)
    """Environment processes per inference server; each holds many episodes' instances (plain methods run on its threads, ``async`` ones on its event loop)."""


@dataclass
class RolloutConfig:
    """Inference servers, rollout workers and sampling."""

    num_servers: int = bounded(1, ge=1)
    """Number of persistent vLLM inference servers (independent of the learner's size)."""
    workers_per_server: int = bounded(1, ge=1)
    """Rollout worker loops in each server's process (each keeps up to ``rollout.max_inflight`` groups generating)."""
    n: int = bounded(8, ge=1)
    """Samples per prompt (the group size)."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = bounded(-1, ge=1, also=(-1,))
    """Top-k sampling; -1 disables it."""
    max_response_length: int = bounded(256, ge=1)
    """Longest response in tokens."""
    max_inflight: int = bounded(32, ge=1)
    """Groups each worker keeps generating at once to fill vLLM's continuous batching (groups being scored or put do not count; admission bounds all groups in flight)."""
    cpus_per_server: float = bounded(1.0, ge=0)
    """CPU cores reserved for each server's Ray actor."""
    gpus_per_server: float = bounded(0.0, ge=0)
    """GPUs reserved for each server's Ray actor (0 on CPU machines)."""
    engine_hang_timeout_s: float = _seconds(60.0)
    """A server whose vLLM engine answers no probe (a round trip through its engine core and workers, sent every 5 s) for this long is declared hung: its engine processes are killed and the server replaced as one whose engine died (its groups in flight go back to the queue). Longer than the slowest engine step or weight load of the model."""
    openai_api: bool = True
    """Each server also serves vLLM's OpenAI-compatible HTTP API from its engine (same weights); URLs go to ``servers.json`` in the run directory."""
    openai_host: str = "127.0.0.1"
    """Address the HTTP API binds to; ``0.0.0.0`` for every interface (the reported URL then names the node's IP, ``127.0.0.1`` on a single-node run). Anything but loopback (``127.0.0.1``, ``::1``, ``localhost``) needs ``rollout.openai_api_key``."""
    openai_port: int = _port(0)
    """TCP port of server 0's HTTP API (server i uses port + i); 0 picks a free port per server."""
    openai_model_name: Optional[str] = None
    """Model name the HTTP API serves (the ``model`` of requests); null is the basename of ``learner.model_path``."""
    openai_api_key: str | None = field(default=None, repr=False)
    """Key every request to the HTTP API must send (``Authorization: Bearer <key>``; ``/health`` stays open): at least 16 visible ASCII characters, e.g. ``openssl rand -hex 32``. ``ASYNC_RL_OPENAI_API_KEY`` in the environment, when set, takes precedence (it keeps the key off command lines and out of files). Needed when ``rollout.openai_host`` is not loopback; shown as ``***`` in every copy of the config."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """vLLM engine arguments."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and reward shaping."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn environment (unset: single-turn)."""


@dataclass
class QueueConfig:
    """Redis Streams replay queue between rollout and learner."""

    redis_url: Optional[str] = None
    """``redis://[:password@]host:port/db`` or ``rediss://...`` of an external server; null starts an embedded redis-server on 127.0.0.1."""
    max_depth: int = bounded(256, ge=1)
    """Producers block while the stream holds this many unconsumed groups."""
    timeout_s: float = _seconds(60.0)
    """Timeout of each blocking queue operation in seconds."""
    recover_idle_s: float = _seconds(60.0)
    """Entries pending this long (seconds) with a consumer are treated as orphaned and redelivered."""
    image_ttl_s: float = bounded(86400.0, ge=1, le=_WEEK_S)
    """Images of vision-language groups are kept in Redis this long (seconds) after the last put of a group that uses them; a group read later is dropped (``dropped_missing_image``)."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = bounded(1e-6, gt=0)
    """Peak learning rate."""
    weight_decay: float = bounded(0.01, ge=0)
    """AdamW decoupled weight decay."""
    betas: list[float] = bounded([0.9, 0.999], ge=0, lt=1)  # noqa: RUF009 - a Field whose factory copies the list
    """AdamW betas (two floats)."""
    eps: float = bounded(1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = bounded(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warm-up length in learner steps."""
    scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    """Final learning rate of the cosine schedule as a fraction of ``lr``."""


@dataclass
class FsdpConfig:
    """FSDP2 sharding and precision."""

    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of parameters; ``auto`` is bfloat16 on GPU and float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3 behaviour); false keeps them (ZeRO-2)."""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute each decoder layer's activations in backward (true/false also work): ``auto``
    turns it on for a GPU learner when the memory estimate (``--dry-run``) does not fit without it."""


@dataclass
class KernelsConfig:
    """Attention and fused kernels of the learner; each falls back cleanly and the choice is logged."""

    attention: Literal["auto", "flash_attention_2", "flex_attention", "sdpa"] = "auto"
    """Attention over packed rows that keeps samples apart: ``auto`` is flash-attn's varlen
    kernel where installed on GPU, else ``flex_attention`` on GPU, else ``sdpa`` run per sample
    (CPU: no ``[T, T]`` mask is built)."""
    liger: Literal["auto", "on", "off"] = "auto"
    """Liger kernels (RMSNorm, SwiGLU, RoPE): ``auto`` uses them on GPU when ``liger_kernel`` is
    installed; ``on`` fails before start where they cannot be used."""
    compile: bool = False
    """``torch.compile`` each decoder layer (GPU; slow first step)."""


@dataclass
class CriticConfig:
    """The value model of PPO with a critic (``algorithm.advantage.name: gae``): the policy's
    architecture with a scalar head, sharded on the learner's ranks (see docs/algorithms.md)."""

    model_path: Optional[str] = None
    """Hugging Face model directory the critic starts from (its value head is new); null: ``learner.model_path``."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own AdamW and schedule (a critic usually takes a larger lr than the policy: verl's default is 1e-5)."""
    warmup_steps: int = bounded(0, ge=0)
    """Learner steps that train only the critic before the policy moves."""
    cliprange_value: Optional[float] = bounded(0.5, gt=0)
    """Clip the new values to old values +- this (value units); null: no clipping."""
    ppo_epochs: int = bounded(1, ge=1)
    """Passes of the value loss over each batch."""
    ppo_mini_batches: int = bounded(1, ge=1)
    """Critic optimizer steps per pass (the batch's groups split into this many mini-batches)."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder projections of Qwen2/Llama: the default LoRA targets, each a ``Linear`` vLLM serves LoRA on."""
LORA_UNSERVABLE = ("lm_head", "embed_tokens")
"""Modules vLLM cannot serve a LoRA on for these models (not a ``LinearBase``; no embedding modules), so never targets."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``;
``tests/rollout/test_engine_args.py`` checks they still are)."""
LORA_MAX_RANK = VLLM_LORA_RANKS[-1]
"""Highest LoRA rank vLLM serves."""
LORA_KEY = "learner.lora"
"""Where :class:`LoraConfig` sits in the config: the prefix of its keys in every message."""


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (PEFT through transformers): only the adapters train and are sent to the servers."""

    rank: int = bounded(16, ge=1, le=LORA_MAX_RANK)
    """Rank ``r`` of each adapter: ``A`` is ``[r, in]``, ``B`` is ``[out, r]`` (vLLM serves ranks up to 512)."""
    alpha: float = bounded(32.0, gt=0)
    """Scale numerator: the adapted layer computes ``W x + (alpha / rank) B A x``."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (PEFT's ``lora_dropout``); the servers never apply it."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names that get an adapter, matched as PEFT matches them (the last part of each module's path, e.g. ``q_proj``); not ``lm_head`` or ``embed_tokens``."""

    def problems(self, prefix: str = f"{LORA_KEY}.") -> list[str]:
        """One message per rule of ``target_modules`` broken (empty, repeated, unservable),
        naming the key ``prefix + "target_modules"``; the numeric ranges are the bounds beside
        each field (:func:`async_rl.bounds.bound_problems`)."""
        key, targets = f"{prefix}target_modules", self.target_modules
        problems = [] if targets else [f"{key} must name at least one module (e.g. {list(LORA_TARGETS)})"]
        repeated = sorted({t for t in targets if targets.count(t) > 1})
        if repeated:
            problems.append(f"{key}={targets} names {repeated} more than once; name each module once")
        unservable = [t for t in targets if t in LORA_UNSERVABLE]
        if unservable:
            problems.append(f"{key}={targets}: vLLM cannot serve a LoRA on {unservable}; remove them (targets from {list(LORA_TARGETS)})")
        return problems


@dataclass
class LearnerConfig:
    """The FSDP2 learner."""

    model_path: str = ""
    """Hugging Face model directory of the initial policy (and of the frozen reference); a vision-language model (a ``vision_config``) trains on image prompts."""
    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision encoder's weights fixed (EasyR1's ``freeze_vision_tower``); the projector and the text decoder train."""
    world_size: int = bounded(1, ge=1)
    """Learner ranks (one per GPU, or per CPU process here)."""
    batch_size: int = bounded(16, ge=1)
    """Groups (prompts) per learner step, ``B`` in the staleness rule."""
    ppo_mini_batches: int = bounded(1, ge=1)
    """Optimizer steps per learner step: the batch is split into this many mini-batches."""
    ppo_epochs: int = bounded(1, ge=1)
    """Passes over each batch."""
    max_tokens_per_microbatch: int = bounded(8192, ge=1)
    """Token budget of one micro-batch: samples (prompt + response) are packed into one row of
    at most this many tokens, without padding."""
    logprob_chunk_tokens: int = bounded(2048, ge=1)
    """Response tokens per chunk of the LM head + log-softmax: the ``[chunk, vocab]`` float32
    logits are the largest tensor of a step (2048 x 151936 x 4 B = 1.2 GB), recomputed in backward."""
    gpu_memory_gb: Optional[float] = bounded(None, gt=0)
    """Memory of one learner GPU in GB, to check the plan against (``--dry-run``); null: the
    GPU's own memory, or 80 when planning on a machine without a GPU."""
    cpus_per_rank: float = bounded(1.0, ge=0)
    """CPU cores reserved for each learner rank's Ray actor."""
    gpus_per_rank: float = bounded(0.0, ge=0)
    """GPUs reserved for each learner rank (1 on GPU machines)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    """Sharding and precision."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Attention implementation and fused kernels."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (used with ``algorithm.advantage.name: gae``)."""
    fill_staleness_window: bool = False
    """For benchmarks (``benchmarks/staleness_ablation.py``), not for training runs: before each step, wait until every group admission allows at the published version has been generated (``groups_started >= (version + max_staleness + 1) x batch_size``, none in flight), so the step trains on groups exactly ``algorithm.max_staleness`` versions old (fewer in the first steps) however fast the learner is. Generation and learning then take turns, as at eta = 0. Needs ``queue.max_depth >= (algorithm.max_staleness + 1) x learner.batch_size``."""
    lora: Optional[LoraConfig] = None
    """Train LoRA adapters on the frozen policy instead of all its weights, and send only the adapters to the servers (a text Qwen2/Llama policy; ``learner.lora.rank=8`` sets the section with its defaults); null: full fine-tuning."""


@dataclass
class AdvantageConfig:
    """Advantage estimator (see docs/algorithms.md)."""

    name: AdvantageName = "grpo"
    """Estimator (``gae`` trains a critic beside the policy: ``learner.critic``)."""
    norm_by_std: bool = True
    """GRPO: divide by the group's standard deviation (false gives Dr. GRPO)."""
    eps: float = bounded(1e-6, gt=0)
    """Added to standard deviations before dividing (0 would divide a group of equal rewards by 0)."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount factor (reinforce_pp, gae)."""
    lam: float = bounded(1.0, ge=0, le=1)
    """GAE lambda."""


@dataclass(frozen=True)
class LossConfig(LossOptions):
    """Policy loss and off-policy correction (see docs/algorithms.md).

    The options of :class:`~async_rl.algos.options.LossOptions` (``algos.losses.compute``
    reads them by name) and the loss's ``name``: one definition of each field."""

    name: LossName = "decoupled_ppo"
    """Policy loss."""

    def __post_init__(self) -> None:
        """Nothing: :func:`validate` checks the options, naming their keys with every other problem."""


@dataclass
class KLControlConfig:
    """The KL penalty in the reward and its coefficient (``algorithm.kl_in_reward``; verl
    ``algorithm.kl_ctrl`` and ``kl_penalty``; see docs/algorithms.md)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: the coefficient stays ``kl_coef``; ``adaptive``: Ziegler et al.'s controller steers the measured KL towards ``target_kl``."""
    kl_coef: float = bounded(0.001, ge=0)
    """The (initial) coefficient beta of ``r_t = s_t - beta * kl_t``."""
    target_kl: float = bounded(0.1, gt=0)
    """adaptive: the KL per token to hold, nats."""
    horizon: int = bounded(10000, ge=1)
    """adaptive: samples over which a 20% KL error moves the coefficient by 20%."""
    kind: KLName = "k1"
    """Per-token KL estimator put in the reward (verl's default ``kl`` is k1)."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm."""

    max_staleness: int = bounded(2, ge=0)
    """eta: the most policy versions a trained group may lag the learner; 0 is synchronous on-policy RL."""
    recompute_proximal: bool = True
    """Recompute proximal log-probs with the current weights each step; false is bypass mode (pi_prox := mu)."""
    failed_samples: Literal["drop_sample", "drop_group"] = "drop_sample"
    """A sample the reward function or environment failed on (raised, timed out) is left out of its group, whose baseline then comes from the other samples (at least 2 for a group estimator), or takes its whole group with it; counted by kind (``reward_error``, ``reward_timeout``, ``env_error``, ``env_timeout``) in ``counters/dropped/<kind>`` (samples) or, when the group goes, ``queue/dropped/<kind>`` (groups)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss and off-policy correction."""
    kl_in_reward: bool = False
    """Subtract ``beta * KL`` to the frozen reference policy per token from the rewards before the advantage estimator (verl ``use_kl_in_reward``); loads the reference model."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient and estimator of the KL in the reward."""
    use_vppo_on_perception: bool = False
    """VPPO (arXiv:2510.09285): one extra no-grad forward with each image's patches blackened gives every token's visual dependency; only each response's most dependent tokens carry the policy gradient. Vision-language models only."""
    top_p_perception_tokens: float = bounded(0.2, gt=0, le=1)
    """VPPO: the fraction of each response's trained tokens kept (the ``ceil(L * p)`` most visually dependent)."""
    use_advantage_shaping: bool = False
    """VPPO: scale each response's advantage by its mean visual dependency, min-max normalised over the step's batch (needs ``use_vppo_on_perception``)."""
    advantage_scaling_min: float = bounded(0.8, ge=0, le=1)
    """VPPO: the scale of the least visually dependent response; the scales average 1."""
    use_entropy_penalty: bool = False
    """VPPO: add ``entropy_penalty_coef * mean(-log pi(y_t))`` over the trained tokens to the loss (lowers the entropy)."""
    entropy_penalty_coef: float = bounded(0.06, ge=0)
    """VPPO: coefficient of the entropy penalty."""

    @property
    def needs_critic(self) -> bool:
        """Whether the learner trains a value model (``learner.critic``): an estimator that takes values (``gae``)."""
        return ESTIMATORS[self.advantage.name].critic

    @property
    def needs_reference(self) -> bool:
        """Whether the loss needs the frozen reference policy's log-probs (a KL term in the loss or the reward)."""
        return self.loss.kl_coef > 0 or self.kl_in_reward

    def loads_reference_model(self, lora: LoraConfig | None) -> bool:
        """Whether the learner loads a second, frozen model as the reference: when
        :attr:`needs_reference` and the policy is not LoRA (``learner.lora``: a LoRA policy's
        reference is the policy itself with its adapters disabled)."""
        return self.needs_reference and lora is None


@dataclass
class SyncConfig:
    """Weight publishing from learner rank 0 to the inference servers."""

    every: int = bounded(1, ge=1)
    """Publish weights every this many learner steps."""
    bucket_mb: int = bounded(256, ge=1)
    """Size of one broadcast bucket in MiB (bounds the extra memory of a sync)."""
    backend: Literal["auto", "ipc", "nccl", "gloo"] = "auto"
    """``auto`` and ``ipc``: CUDA IPC to the servers on learner rank 0's own GPU, host shared memory to the others on its machine (and to any that cannot open CUDA IPC), a broadcast group (NCCL on GPU, gloo on CPU) to the rest; ``nccl`` or ``gloo``: that group to every server."""
    timeout_s: float = _seconds(300.0)
    """Timeout of one weight update (announcement, broadcast, acknowledgement), seconds."""
    max_lag_s: float = _seconds(600.0)
    """A server that has not held the learner's current version for this long (seconds) is restarted and caught up."""


@dataclass
class TrainerConfig:
    """The training run."""

    run_name: str = "async-rl"
    """Name of the run (Redis key prefix, W&B run name); one live run per name on a Redis (a second is refused)."""
    output_dir: str = "runs/${trainer.run_name}"
    """Directory of checkpoints, metrics.jsonl and the resolved config."""
    total_steps: int = bounded(100, ge=1)
    """Learner steps to run."""
    save_every: int = bounded(10, ge=1)
    """Write a checkpoint (and commit the queue entries it covers) every this many steps."""
    keep_checkpoints: int = bounded(2, ge=1)
    """Checkpoints of the line being trained kept on disk (its older ones are deleted; other
    lines' are left alone)."""
    resume: str = "auto"
    """``auto``: resume the run in output_dir (the head of its line of checkpoints, if any); ``off``: a new line from the base model, refused when output_dir or the run name's queue holds a run's state; ``fresh``: move that state aside (output_dir's run files to ``previous-<run id>/`` there, the queue's Redis keys to ``<run_name>.previous-<run id>:*``; nothing is deleted), then start a new run from the base model; or a checkpoint path to load (a new line from it)."""
    val_every: int = bounded(10, ge=0)
    """Validate every this many steps; 0 disables validation."""
    val_n: int = bounded(4, ge=1)
    """Samples per validation prompt for mean@n and pass@k (besides one greedy sample)."""
    seed: int = bounded(1, ge=0, le=2**32 - 1)
    """Seed of the learner and samplers (also vLLM's, which seeds numpy: hence at most 2**32 - 1)."""
    stall_timeout_s: float = _seconds(900.0)
    """Exit 1, saying what each side waits for, when neither a group is generated nor a learner step taken for this long (seconds)."""
    max_restarts: int = bounded(3, ge=0)
    """Times a learner group with a dead or hung rank is restarted from the last checkpoint before the run exits 1 (0: never)."""
    learner_hang_timeout_s: float = _seconds(50.0)
    """A learner call (one step, its weight send and checkpoint, or a 2 s wait for a batch) that has not returned on every rank after this long, or after 3x the slowest call so far if that is longer, declares the ranks that did not answer hung: the learner group is killed and restarted from its last checkpoint, as for a dead rank (seconds; the first call, which loads and warms the model, gets 10x). The bound runs from the call's start, before the hang: a hung rank is named within this long of it."""


@dataclass
class RayConfig:
    """Where the processes run."""

    address: Optional[str] = None
    """Address of an existing Ray cluster (``auto`` or ``host:port``); null starts a local one, whose processes all listen on 127.0.0.1 (a single-node run, docs/security.md)."""
    num_cpus: Optional[int] = bounded(None, ge=1)
    """CPUs of the local Ray instance; null uses all."""


@dataclass
class WandbConfig:
    """Weights & Biases tracking."""

    enable: bool = True
    """Log to Weights & Biases."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; ``WANDB_MODE`` in the environment takes precedence."""
    project: str = "async-rl"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team); null uses the default."""


@dataclass
class LoggingConfig:
    """Console, JSONL, W&B, Prometheus and plots."""

    console: bool = True
    """Show the live console view."""
    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    log_every: int = bounded(1, ge=1)
    """Log metrics every this many learner steps."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""
    prometheus_port: Optional[int] = _port(None)
    """Serve the run's metrics for Prometheus at ``http://HOST:PORT/metrics`` from the driver; null: off, 0: a free port (the URL is printed and written to ``servers.json``)."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds (loopback: a scraper on this node only); ``0.0.0.0`` (every interface) or the node's address for a scraper on another node."""
    plots: bool = True
    """Write PNG plots (validation accuracy, staleness, tokens/s) into the run directory when the run ends."""


@dataclass
class Config:
    """The whole configuration of a run."""

    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and prompt formatting."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference servers, workers, sampling and rewards."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """Replay queue."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Model, optimizer, FSDP and micro-batching."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, loss, off-policy correction, KL and staleness."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight publishing."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, checkpoints and validation."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray cluster."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Tracking."""

    @property
    def max_sample_tokens(self) -> int:
        """The longest sample in tokens, ``data.max_prompt_length + rollout.max_response_length``:
        the engine's context when ``rollout.vllm.max_model_len`` is unset, and what one micro-batch must hold."""
        return self.data.max_prompt_length + self.rollout.max_response_length


#: String fields whose documented words YAML reads as booleans (``resume: off``).
_BOOL_WORDS = {"trainer.resume": {False: "off", True: "auto"}, "learner.fsdp.gradient_checkpointing": {False: "off", True: "on"},
               "learner.kernels.liger": {False: "off", True: "on"}}


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated :class:`Config` from a YAML file and ``key=value`` overrides.

    Overrides use dotted keys (``learner.optim.lr=1e-6``); values are parsed as YAML.
    ``${a.b}`` interpolations are resolved. Raises :class:`ConfigError`.
    """
    raw = _read_yaml(path) if path is not None else {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learner.optim.lr=1e-6)")
        _check_path(key.strip())
    try:
        merged = OmegaConf.merge(OmegaConf.create(to_dict(Config())), OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides)))
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge or resolve the config: {exc}") from None
    cfg = from_dict(Config, resolved)
    if env_key := os.environ.get(OPENAI_API_KEY_ENV):
        cfg.rollout.openai_api_key = env_key
    validate(cfg)
    return cfg


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _check_path(dotted: str) -> None:
    """Raise ConfigError if ``dotted`` does not name a field (or a key under a dict field).
    An optional section (``learner.lora``) may be set whole (``learner.lora=null``), or by
    one of its keys, which creates it with its defaults."""
    cls: Any = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            _unknown_key(".".join(parts[:i]), part, list(fields))
        ftype = _field_types(cls)[part]
        if typing.get_origin(ftype) is dict:  # free-form mapping: any key below it
            return
        section = _section_type(ftype)
        if section is None:
            if i != len(parts) - 1:
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section: cannot set {dotted}")
            return
        if i == len(parts) - 1 and section is not ftype:
            return  # an optional section as a whole: null, or a mapping of its keys
        cls = section
    raise ConfigError(f"{dotted} is a section; set one of its keys, e.g. {dotted}.{dataclasses.fields(cls)[0].name}=...")


def _unknown_key(prefix: str, key: str, valid: list[str]) -> typing.NoReturn:
    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix + '.' if prefix else ''}{close[0]}? " if close else ""
    where = f"section {prefix}" if prefix else "the top level"
    raise ConfigError(f"unknown config key {full}: {hint}valid keys of {where}: {', '.join(valid)}")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Convert a nested mapping into dataclass ``cls``, strictly (see module docstring)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping (a section), got {data!r}")
    types_ = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in types_:
            _unknown_key(prefix, str(key), names)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(types_[name], value, key)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if _is_dataclass_type(tp):
        return from_dict(tp, value, key)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and key in _BOOL_WORDS:
            value = _BOOL_WORDS[key][value]
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not allowed{hint}; expected one of {', '.join(map(repr, choices))}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _wrong_type(key, value, "mapping with string keys")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _wrong_type(key, value, _type_name(tp))
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            _wrong_type(key, value, "bool (true or false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _wrong_type(key, value, "int")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                value = float(value)
            except ValueError:
                _wrong_type(key, value, "float")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _wrong_type(key, value, "float")
        return float(value)
    if tp is str:
        if isinstance(value, bool) and key in _BOOL_WORDS:
            return _BOOL_WORDS[key][value]
        if isinstance(value, bool):  # YAML 1.1 reads off/on/yes/no as booleans
            _wrong_type(key, value, f"str (quote it if you meant the word, e.g. {key}='off')")
        if not isinstance(value, str):
            _wrong_type(key, value, "str")
        return value
    raise TypeError(f"config field {key} has an unsupported type {tp!r}")  # a bug in this module


def _wrong_type(key: str, value: Any, expected: str) -> typing.NoReturn:
    shown = REDACTED if key in SECRET_KEYS else repr(value)  # an all-digit key reads as an int: never echo it
    raise ConfigError(f"{key}={shown} has type {type(value).__name__}, expected {expected}")


def _type_name(tp: Any) -> str:
    """Readable name of a field type: ``int | null``, ``'skip' | 'truncate'``, ``list[float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is dict:
        return "mapping"
    if _is_dataclass_type(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _section_type(tp: Any) -> type | None:
    """The section (dataclass) a field of type ``tp`` holds: ``tp`` itself, or ``X`` for an
    optional section ``Optional[X]`` (null: the section is off); None for a value."""
    if _is_dataclass_type(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        sections = [a for a in typing.get_args(tp) if _is_dataclass_type(a)]
        return sections[0] if sections else None
    return None


# --------------------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Check every numeric key against the range declared on its field (:mod:`async_rl.bounds`),
    the few other one-key rules, then the cross-field rules; raise ConfigError naming every
    key involved. The cross-field rules are checked once every key is in its range (they
    assume it: a divisor >= 1)."""
    problems = bound_problems(cfg) + _key_problems(cfg)
    if not problems:
        problems = _cross_field_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _key_problems(cfg: Config) -> list[str]:
    """The rules of one key that are not a numeric range."""
    problems = [] if cfg.rollout.openai_host else ["rollout.openai_host must not be empty (0.0.0.0 binds every interface)"]
    key = cfg.rollout.openai_api_key
    if key is not None and (len(key) < MIN_API_KEY_LENGTH or not all("!" <= c <= "~" for c in key)):
        # The message never quotes the key: it may be a real one with a typo.
        problems.append(f"rollout.openai_api_key (or {OPENAI_API_KEY_ENV}) must be at least {MIN_API_KEY_LENGTH} visible ASCII "
                        "characters, no spaces (e.g. the output of `openssl rand -hex 32`); null for no key")
    for name, optim in (("learner.optim", cfg.learner.optim), ("learner.critic.optim", cfg.learner.critic.optim)):
        if len(optim.betas) != 2:
            problems.append(f"{name}.betas={optim.betas} must be two numbers")
    if cfg.learner.lora is not None:
        problems += cfg.learner.lora.problems()
    return problems


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``); ``0.0.0.0`` and every other name or address is not."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cross_field_problems(cfg: Config) -> list[str]:
    """The rules that relate two or more keys, each message naming all of them."""
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    r, lrn, alg, loss = cfg.rollout, cfg.learner, cfg.algorithm, cfg.algorithm.loss
    need(
        r.openai_port == 0 or r.openai_port <= 65536 - r.num_servers,
        f"rollout.openai_port={r.openai_port} must be 0 (free ports) or in [1, {65536 - r.num_servers}] "
        f"(server i uses port + i, rollout.num_servers={r.num_servers})",
    )
    need(
        not r.openai_api or r.openai_api_key is not None or is_loopback(r.openai_host),
        f"rollout.openai_host={r.openai_host!r} is not loopback: the OpenAI-compatible API would answer anyone who reaches it. "
        f"Set a key (rollout.openai_api_key, or better the environment variable {OPENAI_API_KEY_ENV}), "
        "or keep rollout.openai_host=127.0.0.1 (or rollout.openai_api=false)",
    )
    need(lrn.batch_size % lrn.critic.ppo_mini_batches == 0,
         f"learner.critic.ppo_mini_batches={lrn.critic.ppo_mini_batches} must divide learner.batch_size={lrn.batch_size}")
    kc = alg.kl_ctrl
    need(kc.type != "adaptive" or kc.kl_coef > 0, f"algorithm.kl_ctrl.kl_coef={kc.kl_coef} must be > 0 with algorithm.kl_ctrl.type='adaptive' (it only scales)")
    need(not alg.use_advantage_shaping or alg.use_vppo_on_perception,
         "algorithm.use_advantage_shaping=true needs algorithm.use_vppo_on_perception=true (the shaping scales by the visual dependency it computes)")
    need(r.reward.num_workers <= r.reward.max_workers,
         f"rollout.reward.num_workers={r.reward.num_workers} must be <= rollout.reward.max_workers={r.reward.max_workers}")
    need(cfg.data.max_pixels >= cfg.data.min_pixels,
         f"data.max_pixels={cfg.data.max_pixels} must be >= data.min_pixels={cfg.data.min_pixels}")
    need(
        not ESTIMATORS[alg.advantage.name].group or r.n > 1,
        f"algorithm.advantage.name={alg.advantage.name!r} compares samples of the same prompt and needs rollout.n > 1 (got rollout.n={r.n})",
    )
    need(
        lrn.batch_size % lrn.ppo_mini_batches == 0,
        f"learner.batch_size={lrn.batch_size} must be divisible by learner.ppo_mini_batches={lrn.ppo_mini_batches}",
    )
    need(
        cfg.queue.max_depth >= lrn.batch_size,
        f"queue.max_depth={cfg.queue.max_depth} must be >= learner.batch_size={lrn.batch_size}, or producers block before a batch can form",
    )
    window = (alg.max_staleness + 1) * lrn.batch_size
    need(
        not lrn.fill_staleness_window or cfg.queue.max_depth >= window,
        f"learner.fill_staleness_window=true needs queue.max_depth={cfg.queue.max_depth} >= (algorithm.max_staleness + 1) x "
        f"learner.batch_size = {window}: producers would block before the window fills and the learner would wait for it forever",
    )
    need(
        lrn.max_tokens_per_microbatch >= cfg.max_sample_tokens,
        f"learner.max_tokens_per_microbatch={lrn.max_tokens_per_microbatch} must hold one whole sample: "
        f">= data.max_prompt_length + rollout.max_response_length = {cfg.max_sample_tokens}",
    )
    if r.vllm.max_model_len is not None:
        need(
            r.vllm.max_model_len >= cfg.max_sample_tokens,
            f"rollout.vllm.max_model_len={r.vllm.max_model_len} must be >= data.max_prompt_length + rollout.max_response_length "
            f"= {cfg.max_sample_tokens}",
        )
    bypass = ", ".join(repr(name) for name, info in LOSSES.items() if info.bypass)
    need(
        alg.recompute_proximal or not LOSSES[loss.name].behaviour_weight,
        f"algorithm.loss.name={loss.name!r} needs algorithm.recompute_proximal=true (with false, pi_prox = mu and the loss is {bypass})",
    )
    if lrn.lora is not None:
        need(not r.openai_api, f"{LORA_KEY} needs rollout.openai_api=false: the OpenAI-compatible API cannot serve the trained adapter yet "
                               f"(its requests would get the base model); or train without {LORA_KEY} (null)")
        for key, on in (("algorithm.use_vppo_on_perception", alg.use_vppo_on_perception), ("learner.freeze_vision_tower", lrn.freeze_vision_tower)):
            need(not on, f"{key}=true is for vision-language models, which {LORA_KEY} does not support yet: set {key}=false, "
                         f"or train without {LORA_KEY} (null)")
    return problems


# --------------------------------------------------------------------------- output


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (or section)."""
    return dataclasses.asdict(cfg)


SECRET_URL_KEYS = ("queue.redis_url",)
"""Keys whose value is a URL that may carry a password: :func:`shareable` redacts them."""
SECRET_KEYS = ("rollout.openai_api_key",)
"""Keys whose whole value is a secret: :func:`shareable` replaces it by ``***``."""
REDACTED = "***"
"""What a secret is replaced by."""


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@`` or ``?password=``) replaced by ``***``,
    for every message, log line, config copy and tracker."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = urlencode([(k, REDACTED if k == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def shareable(cfg: Config) -> dict[str, Any]:
    """:func:`to_dict` of ``cfg`` with every secret redacted: what ``resolved_config.yaml``,
    W&B and any other copy of the config get (the run itself keeps the real values)."""
    data = to_dict(cfg)
    for key in (*SECRET_URL_KEYS, *SECRET_KEYS):
        *path, name = key.split(".")
        section = data
        for part in path:
            section = section[part]
        if section[name]:
            section[name] = redact_url(section[name]) if key in SECRET_URL_KEYS else REDACTED
    return data


def to_yaml(cfg: Any) -> str:
    """YAML text of a config; ``load_config`` of it gives back an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_resolved(cfg: Config, out_dir: str | Path) -> Path:
    """Write ``resolved_config.yaml`` (secrets redacted) into ``out_dir`` (created if needed); return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "resolved_config.yaml"
    path.write_text(yaml.safe_dump(shareable(cfg), sort_keys=False, default_flow_style=False))
    return path


def field_docs(cls: type) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls`` (the string literal after the field),
    inherited fields included (``LossConfig`` adds ``name`` to the options of ``algos.options``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = nxt.value.value
    return docs


def reference_markdown() -> str:
    """Markdown reference of every section and key: type, default, range, meaning (docs/config.md)."""
    lines = ["# Configuration reference", "", "Generated by `async-rl config docs` from `async_rl/config.py`; do not edit by hand.", ""]

    def section(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        hints = _field_types(cls)
        nested = []
        lines.extend([f"## `{prefix}`", "", (inspect.getdoc(cls) or "").splitlines()[0], "", "| key | type | default | range | meaning |", "| --- | --- | --- | --- | --- |"])
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            sub = _section_type(tp)
            if sub is not None:
                nested.append((sub, f"{prefix}.{f.name}"))
                if sub is tp:
                    continue  # an optional section also gets its own row: its default is null
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            type_text = _type_name(tp).replace("|", "\\|")
            default_text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            bound = bound_of(f)
            range_text = "" if bound is None else f"any ({bound.unbounded})" if bound.unbounded else f"`{bound.describe().removeprefix('in ')}`"
            lines.append(f"| `{prefix}.{f.name}` | `{type_text}` | `{default_text}` | {range_text} | {docs.get(f.name, '')} |")
        lines.append("")
        for sub, sub_prefix in nested:
            section(sub, sub_prefix)

    for f in dataclasses.fields(Config):
        section(_field_types(Config)[f.name], f.name)
    return "\n".join(lines)
