"""The configuration's sections: one dataclass per section, every field with a default, a
docstring (the string literal right after it; ``async-rl config docs`` renders them) and, for
a number, the range it may take (:mod:`async_rl.bounds`), plus the names and limits the
sections share (LoRA ranks and targets, the API key's environment variable)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from async_rl.algos.options import KLName, LossOptions, estimator_info
from async_rl.bounds import bounded, unbounded


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


JUDGE_TEMPLATE = (
    "Question: {{ prompt }}\nReference answer: {{ ground_truth }}\nStudent answer: {{ response }}\n"
    "Is the student answer correct? Answer yes or no."
)
"""The default judge prompt (a Jinja template over ``prompt``, ``response`` and ``ground_truth``)."""


@dataclass
class JudgeConfig:
    """A served model that grades each response (``rollout.reward.judge``): the judge's answer to
    the rendered template, read into a score by a reward function of its own."""

    model: str = ""
    """The served model that judges (a name under ``models``). Required."""
    template: str = JUDGE_TEMPLATE
    """The judge's user message, a Jinja template over ``prompt`` (the row's prompt text), ``response`` and ``ground_truth``; the judge's own chat template wraps it."""
    max_tokens: int = bounded(16, ge=1)
    """Longest judge answer in tokens (greedy)."""
    function: str = "judge_yes_no"
    """Reward function that reads the judge's answer (each input's ``judge`` field, besides ``response`` and ``ground_truth``) into ``overall``: a built-in (``judge_yes_no``: 1 for yes, 0 for no, an error otherwise) or ``path/to/file.py:function``; run, bounded and isolated like ``rollout.reward.function`` (same ``type``, ``timeout_s`` and pool sizes)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to every call of ``function``."""
    weight: float = bounded(1.0, ge=0)
    """The judge's score's weight in the reward: ``overall = rollout.reward.weight x rule + weight x judge``."""


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
    weight: float = bounded(1.0, ge=0)
    """The weight of ``function``'s score in the reward when a judge scores too (``judge``); 0: the judge alone (``function`` still gives the validation's accuracy)."""
    judge: Optional[JudgeConfig] = None
    """A served model that grades each response (docs/served_models.md); null: none."""


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

    name: str = "grpo"
    """Estimator: ``grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, ``grpo_passk``, ``opo`` or ``gae`` (which trains a critic beside the policy: ``learner.critic``), or your own as ``path/to/file.py:function`` (docs/algorithms.md)."""
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

    name: str = "decoupled_ppo"
    """Policy loss: ``ppo``, ``decoupled_ppo``, ``tis``, ``gspo`` or ``cispo``, or your own as ``path/to/file.py:function`` (docs/algorithms.md)."""

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
class DistillConfig:
    """On-policy distillation (``algorithm.distill``): a served teacher scores the student's own
    samples token by token, and the student trains on the per-token reverse KL."""

    teacher: str = ""
    """The served model that teaches (a name under ``models``); its tokenizer must be the policy's. Required."""
    coef: float = bounded(1.0, gt=0)
    """Weight of the distillation advantage ``log p_teacher - log mu`` of each response token."""
    reward_coef: float = bounded(0.0, ge=0)
    """Weight of the task reward's advantage (``algorithm.advantage``) added to it; 0: distillation alone."""
    top_k: int = bounded(0, ge=0, le=20)
    """0: the advantage of each sampled token is ``coef x (log p_teacher - log mu)`` (reverse KL, one sampled token a position). k > 0: the teacher also returns its k likeliest tokens at each response position, and the loss adds instead ``coef x`` the forward KL over them, ``sum_j p_teacher(j) (log p_teacher(j) - log pi(j))`` (GKD's on-policy distillation: the teacher's whole distribution at each position, less its mass outside the top k), aggregated as the policy loss (``algorithm.loss.agg_mode``); the advantage is then the reward's alone. At most 20 (vLLM's ``max_logprobs``)."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm."""

    max_staleness: int = bounded(2, ge=0)
    """eta: the most policy versions a trained group may lag the learner; 0 is synchronous on-policy RL."""
    distill: Optional[DistillConfig] = None
    """On-policy distillation from a served teacher (docs/served_models.md); null: none."""
    recompute_proximal: bool = True
    """Recompute proximal log-probs with the current weights each step; false is bypass mode (pi_prox := mu)."""
    failed_samples: Literal["drop_sample", "drop_group"] = "drop_sample"
    """A sample the reward function or environment failed on (raised, timed out) is left out of its group, whose baseline then comes from the other samples (at least 2 for a group estimator), or takes its whole group with it; counted by kind (``reward_error``, ``reward_timeout``, ``judge_error``, ``env_error``, ``env_timeout``) in ``counters/dropped/<kind>`` (samples) or, when the group goes, ``queue/dropped/<kind>`` (groups)."""
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
        return estimator_info(self.advantage.name).critic

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


MODEL_NAME_PATTERN = r"[a-z][a-z0-9_]{0,31}"
"""What a served model's name (the key under ``models``) may be: it names its servers
(``NAME-<i>``), its metrics (``models/NAME/...``) and its Ray actor."""


@dataclass
class ServedModelConfig:
    """A model served beside the policy (``models.<name>``): a judge, a reward model or a
    teacher on vLLM servers of its own, started, healed and resized by the run like the
    inference servers, never updated with the policy's weights."""

    model_path: str = ""
    """Path of the model (a Hugging Face directory; a hub id where the hub is reachable). Required; with ``url``, the directory of its config and tokenizer (the judge's prompts are rendered and tokenised here; the weights are not read)."""
    url: str = ""
    """An OpenAI-compatible server outside the run (``http://HOST:PORT/v1``) that answers this model's requests instead of servers of the run's own: a judge's generations, and a teacher's scoring where it is a vLLM server (its ``prompt_logprobs``); ``num_servers``, ``cpus_per_server``, ``gpus_per_server`` and ``vllm`` are then unused. Empty: the run starts the servers."""
    api_key_env: str = ""
    """With ``url``: the environment variable of the driver that holds the server's API key (sent as a bearer token; the key itself never goes in a config file); empty: no key."""
    api_model: str = ""
    """With ``url``: the model's name on that server (each request's ``model``); empty: this model's key (``judge``)."""
    task: Literal["generate", "classify"] = "generate"
    """``generate``: a language model that answers (a judge) and scores given tokens (a teacher); ``classify``: a reward model, a sequence classifier (``*ForSequenceClassification``) served by vLLM's pooling runner, whose score of a text is the probability of its last label (one label: its sigmoid)."""
    classifier_from_tokens: list[str] = field(default_factory=list)
    """With ``task: classify``, a language model read as a classifier: two of its tokens, ``[no, yes]`` (e.g. ``["no", "yes"]``), whose next-token logits after the text give the probability of yes against no (vLLM's ``from_2_way_softmax``): a yes/no judge served as a reward model, no answer generated; empty: the model is a classifier itself."""
    num_servers: int = bounded(1, ge=1)
    """vLLM servers of this model (resized live with ``async-rl scale RUN_DIR --model NAME --servers N``)."""
    cpus_per_server: float = bounded(1.0, ge=0)
    """CPU cores reserved for each server's Ray actor; 0 reserves none: the servers share the cores of the rest (a small judge on a small machine)."""
    gpus_per_server: float = bounded(0.0, ge=0)
    """GPUs reserved for each server's Ray actor (0 on CPU machines)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Engine arguments of each server (``max_model_len: null`` is the model's own context length)."""
    request_timeout_s: float = _seconds(60.0)
    """Longest one request (a generation or a scoring of given tokens) may take on one server before it is tried on another, seconds."""
    max_attempts: int = bounded(3, ge=1)
    """Servers one request is tried on (another each time a server dies, fails or times out) before its caller gets the error."""

    def problems(self, name: str) -> list[str]:
        """What is wrong with ``models.<name>`` alone, a line each."""
        out = [] if self.model_path else [f"models.{name}.model_path is required: the model directory to serve"]
        if self.url and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.url):
            out.append(f"models.{name}.url={self.url!r} is not an http(s) URL: the server's OpenAI API base, e.g. http://10.0.0.5:8000/v1")
        if self.url and self.task == "classify":
            out.append(f"models.{name}: a reward model (task: classify) outside the run (url) is not supported: serve it in the run (url: '')")
        if self.api_key_env and not self.url:
            out.append(f"models.{name}.api_key_env={self.api_key_env!r} is for a server outside the run: set models.{name}.url too, or remove it")
        if self.classifier_from_tokens and (self.task != "classify" or len(self.classifier_from_tokens) != 2):
            out.append(f"models.{name}.classifier_from_tokens={self.classifier_from_tokens} reads a language model as a reward model: "
                       f"it takes two tokens, [no, yes], and models.{name}.task=classify (it is {self.task!r})")
        return out

    @property
    def own_servers(self) -> int:
        """Servers the run starts for this model: ``num_servers``, none for one outside the run (``url``)."""
        return 0 if self.url else self.num_servers

    @property
    def answer_within_s(self) -> float:
        """The longest one request may take, all attempts together (``request_timeout_s x
        max_attempts``): how long a caller waits for the model's actor to be back after it died."""
        return self.request_timeout_s * self.max_attempts


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
    val_before_train: bool = True
    """Validate the starting weights before the first step (verl's ``val_before_train``; the rollout workers start after it); false skips that one only."""
    val_n: int = bounded(4, ge=0)
    """Samples per validation prompt for mean@n and pass@n (besides one greedy sample); 0: greedy only, no mean@n or pass@n."""
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
    models: dict[str, ServedModelConfig] = field(default_factory=dict)
    """Models served beside the policy, by name (``models.judge.model_path=...``); none by default."""

    @property
    def max_sample_tokens(self) -> int:
        """The longest sample in tokens, ``data.max_prompt_length + rollout.max_response_length``:
        the engine's context when ``rollout.vllm.max_model_len`` is unset, and what one micro-batch must hold."""
        return self.data.max_prompt_length + self.rollout.max_response_length
