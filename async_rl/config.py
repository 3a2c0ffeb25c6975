"""Typed configuration: dataclasses, YAML files, dotlist overrides and strict validation.

Every section is a dataclass whose fields carry a default and a docstring (the string
literal right after the field; ``async-rl config docs`` renders them). Loading is strict:

* an unknown key fails and names the full key and the closest valid one;
* a value of the wrong type names the key, the value and the expected type;
* cross-field rules (``validate``) name every key involved.

All three raise :class:`ConfigError`; the CLI turns it into exit code 2.

Usage::

    cfg = load_config("configs/quickstart.yaml", ["learner.optim.lr=1e-6"])
    print(to_yaml(cfg))

Of async_rl, this module depends only on :mod:`async_rl.algos.options` (the algorithms' names,
needs and loss options; docs/architecture.md: dependencies point one way).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
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


class ConfigError(ValueError):
    """A configuration problem; the message says which key and how to fix it."""


# --------------------------------------------------------------------------- sections


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
    max_prompt_length: int = 512
    """Longest prompt in tokens (after the chat template)."""
    overlong_prompt: Literal["skip", "truncate"] = "skip"
    """What to do with a longer prompt: ``skip`` it (counted) or ``truncate`` it from the left."""
    shuffle: bool = True
    """Shuffle the prompt order (deterministically, with ``data.seed``) each epoch."""
    seed: int = 1
    """Seed of the prompt order."""
    image_key: str = "images"
    """Field of a vision-language row that holds its list of images (data URIs, ``file://`` URLs or paths); rows without it are text-only."""
    image_dir: Optional[str] = None
    """Folder that relative image paths are read from; null: the dataset file's folder."""
    min_pixels: int = 262144
    """Smaller images are upscaled to this many pixels (width x height), aspect kept (EasyR1's default)."""
    max_pixels: int = 4194304
    """Larger images are downscaled to this many pixels (width x height), aspect kept (EasyR1's default)."""


@dataclass
class VllmConfig:
    """Engine arguments of each inference server's vLLM engine."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype; ``auto`` is bfloat16 on GPU and float32 on CPU."""
    max_model_len: Optional[int] = None
    """Context length of the engine in tokens; null = max_prompt_length + max_response_length."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory vLLM may take (GPU only), in (0, 1]."""
    tensor_parallel_size: int = 1
    """GPUs per inference server (tensor parallelism)."""
    kv_cache_space_gb: float = 1.0
    """KV-cache size in GiB on CPU (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPU."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decoding)."""


@dataclass
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13)."""

    enable: bool = False
    """Penalise responses that come within ``buffer_length`` tokens of the maximum length."""
    buffer_length: int = 64
    """Length of the penalty ramp in tokens."""
    penalty_factor: float = 1.0
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
    num_workers: int = 2
    """Processes the reward pool of each inference server keeps (and the driver's, for the start-up probe and validation); a call runs in one of them, so a hung or crashing function never blocks generation (EasyR1 calls it in the trainer's process)."""
    max_workers: int = 32
    """Most processes a pool grows to while calls wait for workers held by slow or hung calls (one more after a call has waited 0.5 s while every worker, started, has been on its call that long; an extra idle for 60 s is stopped); >= ``num_workers``."""
    timeout_s: float = 5.0
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
    max_turns: int = 8
    """Model turns per episode at most; ``rollout.max_response_length`` bounds the tokens of all of them together."""
    max_turn_tokens: int = 0
    """Most tokens the model generates in one turn; 0: whatever is left of the episode's ``rollout.max_response_length``."""
    reward: Literal["sum", "final"] = "sum"
    """The episode's reward: the sum of the step rewards, or the last one."""
    step_timeout_s: float = 30.0
    """Longest one environment call (``reset`` with the constructor and ``get_prompt_prefix``, or one ``step``) may take, seconds; the episode then fails (``env_timeout``)."""
    num_workers: int = 2
    """Environment processes per inference server; each holds many episodes' instances (plain methods run on its threads, ``async`` ones on its event loop)."""


@dataclass
class RolloutConfig:
    """Inference servers, rollout workers and sampling."""

    num_servers: int = 1
    """Number of persistent vLLM inference servers (independent of the learner's size)."""
    workers_per_server: int = 1
    """Rollout worker loops in each server's process (each keeps up to ``rollout.max_inflight`` groups generating)."""
    n: int = 8
    """Samples per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature (> 0 for training rollouts)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_response_length: int = 256
    """Longest response in tokens."""
    max_inflight: int = 32
    """Groups each worker keeps generating at once to fill vLLM's continuous batching (groups being scored or put do not count; admission bounds all groups in flight)."""
    cpus_per_server: float = 1.0
    """CPU cores reserved for each server's Ray actor."""
    gpus_per_server: float = 0.0
    """GPUs reserved for each server's Ray actor (0 on CPU machines)."""
    openai_api: bool = True
    """Each server also serves vLLM's OpenAI-compatible HTTP API from its engine (same weights); URLs go to ``servers.json`` in the run directory."""
    openai_host: str = "127.0.0.1"
    """Address the HTTP API binds to; ``0.0.0.0`` for every interface (the reported URL then names the node's IP)."""
    openai_port: int = 0
    """TCP port of server 0's HTTP API (server i uses port + i); 0 picks a free port per server."""
    openai_model_name: Optional[str] = None
    """Model name the HTTP API serves (the ``model`` of requests); null is the basename of ``learner.model_path``."""
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
    max_depth: int = 256
    """Producers block while the stream holds this many unconsumed groups."""
    timeout_s: float = 60.0
    """Timeout of each blocking queue operation in seconds."""
    recover_idle_s: float = 60.0
    """Entries pending this long (seconds) with a consumer are treated as orphaned and redelivered."""
    image_ttl_s: float = 86400.0
    """Images of vision-language groups are kept in Redis this long (seconds) after the last put of a group that uses them; a group read later is dropped (``dropped_missing_image``)."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas (two floats in [0, 1))."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up length in learner steps."""
    scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = 0.0
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
    warmup_steps: int = 0
    """Learner steps that train only the critic before the policy moves."""
    cliprange_value: Optional[float] = 0.5
    """Clip the new values to old values +- this (value units); null: no clipping."""
    ppo_epochs: int = 1
    """Passes of the value loss over each batch."""
    ppo_mini_batches: int = 1
    """Critic optimizer steps per pass (the batch's groups split into this many mini-batches)."""


@dataclass
class LearnerConfig:
    """The FSDP2 learner."""

    model_path: str = ""
    """Hugging Face model directory of the initial policy (and of the frozen reference); a vision-language model (a ``vision_config``) trains on image prompts."""
    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision encoder's weights fixed (EasyR1's ``freeze_vision_tower``); the projector and the text decoder train."""
    world_size: int = 1
    """Learner ranks (one per GPU, or per CPU process here)."""
    batch_size: int = 16
    """Groups (prompts) per learner step, ``B`` in the staleness rule."""
    ppo_mini_batches: int = 1
    """Optimizer steps per learner step: the batch is split into this many mini-batches."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch: samples (prompt + response) are packed into one row of
    at most this many tokens, without padding."""
    logprob_chunk_tokens: int = 2048
    """Response tokens per chunk of the LM head + log-softmax: the ``[chunk, vocab]`` float32
    logits are the largest tensor of a step (2048 x 151936 x 4 B = 1.2 GB), recomputed in backward."""
    gpu_memory_gb: Optional[float] = None
    """Memory of one learner GPU in GB, to check the plan against (``--dry-run``); null: the
    GPU's own memory, or 80 when planning on a machine without a GPU."""
    cpus_per_rank: float = 1.0
    """CPU cores reserved for each learner rank's Ray actor."""
    gpus_per_rank: float = 0.0
    """GPUs reserved for each learner rank (1 on GPU machines)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    """Sharding and precision."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Attention implementation and fused kernels."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (used with ``algorithm.advantage.name: gae``)."""


@dataclass
class AdvantageConfig:
    """Advantage estimator (see docs/algorithms.md)."""

    name: AdvantageName = "grpo"
    """Estimator (``gae`` trains a critic beside the policy: ``learner.critic``)."""
    norm_by_std: bool = True
    """GRPO: divide by the group's standard deviation (false gives Dr. GRPO)."""
    eps: float = 1e-6
    """Added to standard deviations before dividing."""
    gamma: float = 1.0
    """Discount factor (reinforce_pp, gae)."""
    lam: float = 1.0
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
    kl_coef: float = 0.001
    """The (initial) coefficient beta of ``r_t = s_t - beta * kl_t``."""
    target_kl: float = 0.1
    """adaptive: the KL per token to hold, nats."""
    horizon: int = 10000
    """adaptive: samples over which a 20% KL error moves the coefficient by 20%."""
    kind: KLName = "k1"
    """Per-token KL estimator put in the reward (verl's default ``kl`` is k1)."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm."""

    max_staleness: int = 2
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
    top_p_perception_tokens: float = 0.2
    """VPPO: the fraction of each response's trained tokens kept (the ``ceil(L * p)`` most visually dependent), in (0, 1]."""
    use_advantage_shaping: bool = False
    """VPPO: scale each response's advantage by its mean visual dependency, min-max normalised over the step's batch (needs ``use_vppo_on_perception``)."""
    advantage_scaling_min: float = 0.8
    """VPPO: the scale of the least visually dependent response, in [0, 1]; the scales average 1."""
    use_entropy_penalty: bool = False
    """VPPO: add ``entropy_penalty_coef * mean(-log pi(y_t))`` over the trained tokens to the loss (lowers the entropy)."""
    entropy_penalty_coef: float = 0.06
    """VPPO: coefficient of the entropy penalty, >= 0."""

    @property
    def needs_critic(self) -> bool:
        """Whether the learner trains a value model (``learner.critic``): an estimator that takes values (``gae``)."""
        return ESTIMATORS[self.advantage.name].critic

    @property
    def needs_reference(self) -> bool:
        """Whether the learner loads the frozen reference policy (a KL term in the loss or the reward)."""
        return self.loss.kl_coef > 0 or self.kl_in_reward


@dataclass
class SyncConfig:
    """Weight publishing from learner rank 0 to the inference servers."""

    every: int = 1
    """Publish weights every this many learner steps."""
    bucket_mb: int = 256
    """Size of one broadcast bucket in MiB (bounds the extra memory of a sync)."""
    backend: Literal["auto", "ipc", "nccl", "gloo"] = "auto"
    """``auto`` and ``ipc``: shared memory to the servers on learner rank 0's machine, a broadcast group (NCCL on GPU, gloo on CPU) to the others; ``nccl`` or ``gloo``: that group to every server."""
    timeout_s: float = 300.0
    """Timeout of one weight update (announcement, broadcast, acknowledgement), seconds."""
    max_lag_s: float = 600.0
    """A server that has not held the learner's current version for this long (seconds) is restarted and caught up."""


@dataclass
class TrainerConfig:
    """The training run."""

    run_name: str = "async-rl"
    """Name of the run (Redis key prefix, W&B run name); one live run per name on a Redis (a second is refused)."""
    output_dir: str = "runs/${trainer.run_name}"
    """Directory of checkpoints, metrics.jsonl and the resolved config."""
    total_steps: int = 100
    """Learner steps to run."""
    save_every: int = 10
    """Write a checkpoint (and commit the queue entries it covers) every this many steps."""
    keep_checkpoints: int = 2
    """Checkpoints of the line being trained kept on disk (its older ones are deleted; other
    lines' are left alone)."""
    resume: str = "auto"
    """``auto``: resume the run in output_dir (the head of its line of checkpoints, if any); ``off``: a new line from the base model, refused when output_dir or the run name's queue holds a run's state; ``fresh``: move that state aside (output_dir's run files to ``previous-<run id>/`` there, the queue's Redis keys to ``<run_name>.previous-<run id>:*``; nothing is deleted), then start a new run from the base model; or a checkpoint path to load (a new line from it)."""
    val_every: int = 10
    """Validate every this many steps; 0 disables validation."""
    val_n: int = 4
    """Samples per validation prompt for mean@n and pass@k (besides one greedy sample)."""
    seed: int = 1
    """Seed of the learner and samplers."""
    stall_timeout_s: float = 900.0
    """Exit 1, saying what each side waits for, when neither a group is generated nor a learner step taken for this long (seconds)."""
    max_restarts: int = 3
    """Times a learner group with a dead rank is restarted from the last checkpoint before the run exits 1 (0: never)."""


@dataclass
class RayConfig:
    """Where the processes run."""

    address: Optional[str] = None
    """Address of an existing Ray cluster (``auto`` or ``host:port``); null starts a local one."""
    num_cpus: Optional[int] = None
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
    log_every: int = 1
    """Log metrics every this many learner steps."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""
    prometheus_port: Optional[int] = None
    """Serve the run's metrics for Prometheus at ``http://HOST:PORT/metrics`` from the driver; null: off, 0: a free port (the URL is printed and written to ``servers.json``)."""
    prometheus_host: str = "0.0.0.0"
    """Address the Prometheus endpoint binds (``0.0.0.0``: every interface, so a scraper on another node reaches it)."""
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
    """Raise ConfigError if ``dotted`` does not name a field (or a key under a dict field)."""
    cls: Any = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            _unknown_key(".".join(parts[:i]), part, list(fields))
        ftype = _field_types(cls)[part]
        if typing.get_origin(ftype) is dict:  # free-form mapping: any key below it
            return
        if not _is_dataclass_type(ftype):
            if i != len(parts) - 1:
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section: cannot set {dotted}")
            return
        cls = ftype
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
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected {expected}")


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
    return getattr(tp, "__name__", str(tp))


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


# --------------------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Check value ranges and cross-field rules; raise ConfigError naming every key involved."""
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    r, lrn, alg, loss = cfg.rollout, cfg.learner, cfg.algorithm, cfg.algorithm.loss
    for key, value in _positive_ints(cfg):
        need(value >= 1, f"{key}={value} must be >= 1")
    need(alg.max_staleness >= 0, f"algorithm.max_staleness={alg.max_staleness} must be >= 0 (0 = synchronous)")
    need(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0")
    need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
    need(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k={r.top_k} must be -1 (off) or >= 1")
    need(0 < r.vllm.gpu_memory_utilization <= 1, f"rollout.vllm.gpu_memory_utilization={r.vllm.gpu_memory_utilization} must be in (0, 1]")
    need(
        r.openai_port == 0 or 1 <= r.openai_port <= 65536 - r.num_servers,
        f"rollout.openai_port={r.openai_port} must be 0 (free ports) or in [1, {65536 - r.num_servers}] "
        f"(server i uses port + i, rollout.num_servers={r.num_servers})",
    )
    need(bool(r.openai_host), "rollout.openai_host must not be empty (0.0.0.0 binds every interface)")
    need(r.vllm.kv_cache_space_gb > 0, f"rollout.vllm.kv_cache_space_gb={r.vllm.kv_cache_space_gb} must be > 0")
    for name, optim in (("learner.optim", lrn.optim), ("learner.critic.optim", lrn.critic.optim)):
        need(optim.lr > 0, f"{name}.lr={optim.lr} must be > 0")
        need(optim.grad_clip >= 0, f"{name}.grad_clip={optim.grad_clip} must be >= 0 (0 disables clipping)")
        need(len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas), f"{name}.betas={optim.betas} must be two numbers in [0, 1)")
        need(0 <= optim.min_lr_ratio <= 1, f"{name}.min_lr_ratio={optim.min_lr_ratio} must be in [0, 1]")
        need(optim.warmup_steps >= 0, f"{name}.warmup_steps={optim.warmup_steps} must be >= 0")
    critic = lrn.critic
    need(critic.warmup_steps >= 0, f"learner.critic.warmup_steps={critic.warmup_steps} must be >= 0")
    need(critic.cliprange_value is None or critic.cliprange_value > 0,
         f"learner.critic.cliprange_value={critic.cliprange_value} must be > 0 (or null: no clipping)")
    need(critic.ppo_epochs >= 1, f"learner.critic.ppo_epochs={critic.ppo_epochs} must be >= 1")
    need(critic.ppo_mini_batches >= 1 and lrn.batch_size % critic.ppo_mini_batches == 0,
         f"learner.critic.ppo_mini_batches={critic.ppo_mini_batches} must be >= 1 and divide learner.batch_size={lrn.batch_size}")
    need(lrn.gpu_memory_gb is None or lrn.gpu_memory_gb > 0, f"learner.gpu_memory_gb={lrn.gpu_memory_gb} must be > 0 (or null: the GPU's own memory)")
    need(cfg.trainer.val_every >= 0, f"trainer.val_every={cfg.trainer.val_every} must be >= 0 (0 disables validation)")
    problems.extend(loss.problems("algorithm.loss."))
    kc = alg.kl_ctrl
    need(math.isfinite(kc.kl_coef) and kc.kl_coef >= 0, f"algorithm.kl_ctrl.kl_coef={kc.kl_coef} must be >= 0")
    need(kc.type != "adaptive" or kc.kl_coef > 0, f"algorithm.kl_ctrl.kl_coef={kc.kl_coef} must be > 0 with algorithm.kl_ctrl.type='adaptive' (it only scales)")
    need(math.isfinite(kc.target_kl) and kc.target_kl > 0, f"algorithm.kl_ctrl.target_kl={kc.target_kl} must be > 0")
    need(kc.horizon > 0, f"algorithm.kl_ctrl.horizon={kc.horizon} must be > 0")
    need(0 < alg.top_p_perception_tokens <= 1, f"algorithm.top_p_perception_tokens={alg.top_p_perception_tokens} must be in (0, 1]")
    need(0 <= alg.advantage_scaling_min <= 1, f"algorithm.advantage_scaling_min={alg.advantage_scaling_min} must be in [0, 1]")
    need(alg.entropy_penalty_coef >= 0, f"algorithm.entropy_penalty_coef={alg.entropy_penalty_coef} must be >= 0")
    need(not alg.use_advantage_shaping or alg.use_vppo_on_perception,
         "algorithm.use_advantage_shaping=true needs algorithm.use_vppo_on_perception=true (the shaping scales by the visual dependency it computes)")
    need(cfg.queue.image_ttl_s >= 1, f"queue.image_ttl_s={cfg.queue.image_ttl_s} must be >= 1 (seconds)")
    need(cfg.queue.timeout_s > 0 and cfg.sync.timeout_s > 0, f"queue.timeout_s={cfg.queue.timeout_s} and sync.timeout_s={cfg.sync.timeout_s} must be > 0")
    need(1 <= r.reward.num_workers <= r.reward.max_workers,
         f"rollout.reward.num_workers={r.reward.num_workers} must be >= 1 and <= rollout.reward.max_workers={r.reward.max_workers}")
    need(r.reward.timeout_s > 0, f"rollout.reward.timeout_s={r.reward.timeout_s} must be > 0")
    need(r.env.max_turns >= 1, f"rollout.env.max_turns={r.env.max_turns} must be >= 1")
    need(r.env.max_turn_tokens >= 0, f"rollout.env.max_turn_tokens={r.env.max_turn_tokens} must be >= 0 (0: no per-turn limit)")
    need(r.env.step_timeout_s > 0, f"rollout.env.step_timeout_s={r.env.step_timeout_s} must be > 0")
    need(r.env.num_workers >= 1, f"rollout.env.num_workers={r.env.num_workers} must be >= 1")
    need(cfg.sync.max_lag_s > 0, f"sync.max_lag_s={cfg.sync.max_lag_s} must be > 0")
    need(cfg.data.max_pixels >= cfg.data.min_pixels,
         f"data.max_pixels={cfg.data.max_pixels} must be >= data.min_pixels={cfg.data.min_pixels}")
    need(cfg.trainer.stall_timeout_s > 0, f"trainer.stall_timeout_s={cfg.trainer.stall_timeout_s} must be > 0")
    need(cfg.trainer.max_restarts >= 0, f"trainer.max_restarts={cfg.trainer.max_restarts} must be >= 0")
    port = cfg.logging.prometheus_port
    need(port is None or 0 <= port <= 65535, f"logging.prometheus_port={port} must be null (off), 0 (a free port) or in [1, 65535]")

    # Cross-field rules: name both keys.
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
    need(
        lrn.max_tokens_per_microbatch >= cfg.data.max_prompt_length + r.max_response_length,
        f"learner.max_tokens_per_microbatch={lrn.max_tokens_per_microbatch} must hold one whole sample: "
        f">= data.max_prompt_length + rollout.max_response_length = {cfg.data.max_prompt_length + r.max_response_length}",
    )
    if r.vllm.max_model_len is not None:
        need(
            r.vllm.max_model_len >= cfg.data.max_prompt_length + r.max_response_length,
            f"rollout.vllm.max_model_len={r.vllm.max_model_len} must be >= data.max_prompt_length + rollout.max_response_length "
            f"= {cfg.data.max_prompt_length + r.max_response_length}",
        )
    bypass = ", ".join(repr(name) for name, info in LOSSES.items() if info.bypass)
    need(
        alg.recompute_proximal or not LOSSES[loss.name].behaviour_weight,
        f"algorithm.loss.name={loss.name!r} needs algorithm.recompute_proximal=true (with false, pi_prox = mu and the loss is {bypass})",
    )
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _positive_ints(cfg: Config) -> list[tuple[str, int]]:
    return [
        ("rollout.num_servers", cfg.rollout.num_servers),
        ("rollout.workers_per_server", cfg.rollout.workers_per_server),
        ("rollout.n", cfg.rollout.n),
        ("rollout.max_response_length", cfg.rollout.max_response_length),
        ("rollout.max_inflight", cfg.rollout.max_inflight),
        ("rollout.vllm.tensor_parallel_size", cfg.rollout.vllm.tensor_parallel_size),
        ("data.max_prompt_length", cfg.data.max_prompt_length),
        ("data.min_pixels", cfg.data.min_pixels),
        ("queue.max_depth", cfg.queue.max_depth),
        ("learner.world_size", cfg.learner.world_size),
        ("learner.batch_size", cfg.learner.batch_size),
        ("learner.ppo_mini_batches", cfg.learner.ppo_mini_batches),
        ("learner.ppo_epochs", cfg.learner.ppo_epochs),
        ("learner.max_tokens_per_microbatch", cfg.learner.max_tokens_per_microbatch),
        ("learner.logprob_chunk_tokens", cfg.learner.logprob_chunk_tokens),
        ("sync.every", cfg.sync.every),
        ("sync.bucket_mb", cfg.sync.bucket_mb),
        ("trainer.total_steps", cfg.trainer.total_steps),
        ("trainer.save_every", cfg.trainer.save_every),
        ("trainer.keep_checkpoints", cfg.trainer.keep_checkpoints),
        ("trainer.val_n", cfg.trainer.val_n),
        ("logging.log_every", cfg.logging.log_every),
    ]


# --------------------------------------------------------------------------- output


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (or section)."""
    return dataclasses.asdict(cfg)


SECRET_URL_KEYS = ("queue.redis_url",)
"""Keys whose value is a URL that may carry a password: :func:`shareable` redacts them."""


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@`` or ``?password=``) replaced by ``***``,
    for every message, log line, config copy and tracker."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rsplit('@', 1)[1]}"
    query = urlencode([(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def shareable(cfg: Config) -> dict[str, Any]:
    """:func:`to_dict` of ``cfg`` with every secret redacted: what ``resolved_config.yaml``,
    W&B and any other copy of the config get (the run itself keeps the real values)."""
    data = to_dict(cfg)
    for key in SECRET_URL_KEYS:
        *path, name = key.split(".")
        section = data
        for part in path:
            section = section[part]
        if section[name]:
            section[name] = redact_url(section[name])
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
    """Markdown reference of every section and key: type, default, meaning (docs/config.md)."""
    lines = ["# Configuration reference", "", "Generated by `async-rl config docs` from `async_rl/config.py`; do not edit by hand.", ""]

    def section(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        hints = _field_types(cls)
        nested = []
        lines.extend([f"## `{prefix}`", "", (inspect.getdoc(cls) or "").splitlines()[0], "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"])
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if _is_dataclass_type(tp):
                nested.append((tp, f"{prefix}.{f.name}"))
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            type_text = _type_name(tp).replace("|", "\\|")
            lines.append(f"| `{prefix}.{f.name}` | `{type_text}` | `{yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}` | {docs.get(f.name, '')} |")
        lines.append("")
        for sub, sub_prefix in nested:
            section(sub, sub_prefix)

    for f in dataclasses.fields(Config):
        section(_field_types(Config)[f.name], f.name)
    return "\n".join(lines)
