"""Per-rank memory estimate of the learner, from the model's ``config.json`` and the learner config.

Used by ``async-rl train --dry-run`` (the ``learner memory`` line of the plan, an error when it
does not fit) and by ``learner.fsdp.gradient_checkpointing: auto``. Pure arithmetic: no
process group, no model, no GPU needed (torch is imported lazily, only to read a GPU's memory).

Units: GB = 10^9 bytes throughout (as ``torch.cuda.max_memory_allocated() / 1e9`` in the
benchmarks); "per token" means per token of a packed micro-batch row.

What one learner rank holds (``P`` parameters, ``W`` = ``learner.world_size``, ``c`` bytes per
element of the compute dtype: 2 for bf16, 4 for float32; ``V`` vocabulary, ``H`` hidden size):

* params: float32 master weights, sharded: ``4 P / W``;
* grads: float32 gradients, sharded, ``4 P / W``, plus the unsharded gradients in flight during
  backward: the LM head's (float32 accumulator of the chunked head and its compute-dtype copy,
  ``(4 + c) V H``, alive while the decoder layers run backward) and one layer's before its
  reduce-scatter, ``(4 + c) P_layer``;
* optimizer: AdamW's two float32 states, sharded: ``8 P / W``;
* compute copies: the gathered compute-dtype parameters: the root (embeddings, final norm, and
  the LM head when not tied) stays gathered through forward and backward, and two decoder layers
  (the running one and the prefetched one): ``c (P_root + 2 P_layer)``;
* activations at ``learner.max_tokens_per_microbatch`` tokens (:func:`activation_bytes_per_token`,
  :func:`layer_activation_bytes`);
* log-prob chunk: the ``[chunk, V]`` tensors of one chunk of the LM head + log-softmax, alive at
  once in its forward or backward: the logits in the compute dtype, their float32 copy and the
  float32 softmax/gradient: ``chunk V (c + 8)``, ``chunk = min(logprob_chunk_tokens, tokens)``;
* reference (only with a KL penalty): the frozen reference's float32 shard and gathered root;
* critic (only with ``gae``): the value model's float32 shard, AdamW states and gathered root,
  ``12 P / W + c P_root``, taken to have the policy's shape; its gradients and activations
  live while the policy's do not (the critic trains before the policy in a step);
* weight hand-off buffer (only when inference servers share the rank's GPU and read updates
  through CUDA IPC): the whole update, float32, ``4 P`` (LoRA: the adapter, ``4 P_lora``), kept
  between updates;
* overhead: fixed (:data:`GPU_OVERHEAD_GB`: CUDA context, NCCL and workspaces) plus allocator
  fragmentation, :data:`FRAGMENTATION` (15%) of activations + log-prob chunk.

Measured peaks (:data:`CALIBRATION_PATH`, written by ``scripts/gpu_acceptance.sh throughput``):
the learner's own peak for a setting, when one was measured, is shown beside the estimate
(:attr:`MemoryEstimate.measured`) and ``tests/learner/test_memory.py`` holds the estimate at or
above every one of them, so a GPU run that finds more than the estimate fails the tests until
the estimate is fixed.

With ``learner.lora`` (``P_lora`` adapter parameters, :meth:`ModelShape.lora_params`; ``P_lora_layer``
one layer's) only the adapter trains, on a frozen base held in the compute dtype:

* params: ``(c P + 4 P_lora) / W`` (the base's shard, the adapter's float32 master weights);
* grads: ``4 P_lora / W + (4 + c) P_lora_layer``: no LM-head term (the head is frozen, so the
  chunked head computes no weight gradient) and one layer's adapter gradients in flight;
* optimizer: ``8 P_lora / W``;
* compute copies: ``c (P_root + 2 (P_layer + P_lora_layer))``;
* activations: each layer also saves ``A x`` for ``B``'s gradient, ``r c`` bytes per token and
  target, and with dropout each target's dropped input and its mask, ``(c + 1) in`` bytes
  (:func:`lora_activation_bytes`);
* reference: none (the reference is the policy with its adapters disabled, :meth:`RankExtras.of`);
* critic (fully fine-tuned): its float32 gradients as well, ``4 P / W + (4 + c) P_layer``,
  which the adapter's small gradients no longer cover.

Calibration (docs/learner.md#memory-estimate): one H100, bf16, 16384-token packed rows,
4096-token log-prob chunks, the plain packed loop of ``benchmarks/_plain_packed.py`` measured
43.7 GB peak allocated for Qwen2.5-0.5B without checkpointing and 36.7 GB for 1.5B with it;
this estimate gives 45.4 GB (+4%) and 40.9 GB (+11%) (``tests/learner/test_memory.py``). The
learner keeps less than that loop (a bf16 residual stream where autocast keeps float32), so
against the learner it errs further on the safe side.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rl.config import AlgorithmConfig, LearnerConfig, LoraConfig, RolloutConfig, SyncConfig

GB = 1e9
"""Bytes per GB."""

GPU_OVERHEAD_GB = 1.5
"""Fixed memory of a GPU rank that no tensor of the model accounts for: the CUDA context and
kernel images (about 0.5-0.6 GB on an H100, outside the caching allocator and so absent from
``max_memory_allocated``), NCCL's communicator buffers (a few hundred MB) and cuBLAS /
attention workspaces."""

CPU_OVERHEAD_GB = 0.5
"""The same on a CPU rank: the Python process with torch, transformers and Ray imported."""

FRAGMENTATION = 0.15
"""Allocator fragmentation, as a fraction of the tensors sized by the micro-batch (activations
and the log-prob chunk): packed rows differ in length every micro-batch, so the caching
allocator reuses freed blocks only in part, while parameters, gradients and optimizer states are
allocated once at fixed sizes. 15% puts the estimate at or above every GPU measurement (10%
left the learner's own 0.5B peak, 41.2 GB, above its 40.5 GB estimate)."""

CALIBRATION_PATH = Path(__file__).with_name("memory_calibration.json")
"""The committed table of measured learner peaks (:func:`last_measured`, :func:`record_measurement`)."""

_SMALL_PER_TOKEN = 64
"""Bytes per token of the integer inputs and float32 per-token outputs of a micro-batch
(input ids, positions, targets, log-probs, entropies, log-normalisers, advantages, masks)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen2 / Llama style decoder that the estimate needs."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    vision_params: int = 0
    """A vision-language model's vision encoder and projector (counted as weights, not as activations)."""

    @classmethod
    def from_config(cls, model_config: Mapping[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` dict; raise ``ValueError`` naming missing keys.
        A vision-language config (``text_config`` + ``vision_config``) is read as its text
        decoder plus the vision encoder's parameters (:func:`vision_parameter_count`)."""
        vision = model_config.get("vision_config")
        if isinstance(vision, Mapping):
            nested = model_config.get("text_config")  # Qwen-VL's config.json may keep the text keys at the top
            text = {"tie_word_embeddings": model_config.get("tie_word_embeddings", False), **(nested if isinstance(nested, Mapping) else
                    {k: v for k, v in model_config.items() if k != "vision_config"})}
            scale = int(model_config.get("scale_factor", vision.get("scale_factor", vision.get("spatial_merge_size", 2))))
            return dataclasses.replace(cls.from_config(text), vision_params=vision_parameter_count(vision, int(text.get("hidden_size", 0)), scale))
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in required if not isinstance(model_config.get(k), int)]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)} (a Qwen2/Llama style decoder is expected)")
        heads = int(model_config["num_attention_heads"])
        hidden = int(model_config["hidden_size"])
        qwen2 = model_config.get("model_type") in (None, "qwen2")  # no model_type: assume Qwen2, the larger count
        attention_bias = bool(model_config.get("attention_bias", False))
        return cls(
            hidden=hidden,
            intermediate=int(model_config["intermediate_size"]),
            layers=int(model_config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(model_config.get("num_key_value_heads") or heads),
            head_dim=int(model_config.get("head_dim") or hidden // heads),
            vocab=int(model_config["vocab_size"]),
            # Absent means untied: a separate LM head, the larger (safer) count.
            tied=bool(model_config.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,  # Qwen2 always has q/k/v biases, Llama has them with attention_bias
            o_bias=not qwen2 and attention_bias,
            mlp_bias=bool(model_config.get("mlp_bias", False)),
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, SwiGLU MLP, two RMSNorms)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        return attn + mlp + 2 * h

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, LM head when not tied."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        """All parameters."""
        return self.layers * self.layer_params + self.root_params + self.vision_params

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each projection of a decoder layer that LoRA can target."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_target_shapes(self, targets: list[str]) -> list[tuple[int, int]]:
        """``(in, out)`` of each target, named as in ``learner.lora.target_modules`` (the last
        part of a module's path counts); ``ValueError`` for a name that is no projection here."""
        shapes = self.lora_shapes()
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in shapes]
        if unknown:
            raise ValueError(f"learner.lora.target_modules={targets}: no decoder projection named {unknown} (one of {list(shapes)})")
        return [shapes[t.rsplit(".", 1)[-1]] for t in targets]

    def lora_params(self, targets: list[str], r: int) -> int:
        """Parameters of rank-``r`` LoRA adapters on ``targets`` in every decoder layer:
        ``layers r sum(in_t + out_t)`` (``A`` is ``[r, in]``, ``B`` ``[out, r]``)."""
        return self.layers * r * sum(i + o for i, o in self.lora_target_shapes(targets))


def vision_parameter_count(vision_config: Mapping[str, Any], text_hidden: int, scale_factor: int = 2) -> int:
    """Parameters of a ViT-style vision encoder (patch and position embeddings, ``layers`` x
    (attention with biases, a two-matrix MLP, two norms)) and its projector into the text
    decoder's ``text_hidden``: a linear from the encoder width times ``scale_factor**2``
    (Idefics3's pixel shuffle), or with ``out_hidden_size`` Qwen-VL's two-layer merger of
    ``spatial_merge_size**2`` patches. A ``silu`` encoder has gated (three-matrix) MLPs. An
    estimate for other designs."""
    h = int(vision_config.get("hidden_size", vision_config.get("embed_dim", 0)))
    i = int(vision_config.get("intermediate_size", 4 * h))
    layers = int(vision_config.get("num_hidden_layers", vision_config.get("depth", 0)))
    patch = int(vision_config.get("patch_size", 14))
    channels = int(vision_config.get("num_channels", vision_config.get("in_chans", vision_config.get("in_channels", 3))))
    frames = int(vision_config.get("temporal_patch_size", 1))
    gated = vision_config.get("hidden_act") == "silu"  # Qwen2.5-VL's SwiGLU blocks: gate, up and down matrices
    per_layer = 4 * (h * h + h) + (3 if gated else 2) * h * i + (2 if gated else 1) * i + h + 4 * h
    positions = (int(vision_config["image_size"]) // patch) ** 2 * h if "image_size" in vision_config else 0
    embeddings = channels * frames * patch * patch * h + h + positions
    merged = h * scale_factor**2
    if "out_hidden_size" in vision_config:
        projector = merged * merged + merged + merged * int(vision_config["out_hidden_size"]) + int(vision_config["out_hidden_size"]) + h
    else:
        projector = merged * text_hidden
    return layers * per_layer + embeddings + projector + 2 * h


def parameter_count(model_config: Mapping[str, Any]) -> int:
    """Number of parameters of the model of ``model_config`` (a ``config.json`` dict)."""
    return ModelShape.from_config(model_config).params


@dataclass(frozen=True)
class Measurement:
    """A learner peak measured on a GPU for one setting (:data:`CALIBRATION_PATH`)."""

    peak_gb: float
    """Peak allocated memory of the step (``torch.cuda.max_memory_allocated``; the CUDA context,
    about 0.5 GB, is outside it)."""
    device: str
    """The GPU's name."""
    date: str
    """ISO date of the run."""
    source: str
    """The result file it came from."""


_MODEL_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias")
"""The ``config.json`` keys of a text decoder that :class:`ModelShape` reads."""


def setting_key(model_config: Mapping[str, Any], learner: LearnerConfig, checkpointing: bool, device_type: str,
                beside: RankExtras | None = None) -> dict[str, Any]:
    """What a measured peak depends on, as stored in :data:`CALIBRATION_PATH`: the model (the
    ``config.json`` keys of its shape; settings match when their :class:`ModelShape` does), the
    micro-batch and log-prob chunk sizes, checkpointing, the ranks, the compute dtype's bytes
    and the models beside the policy. A vision-language model is not tabled (its images' memory
    is not estimated)."""
    beside = beside or RankExtras()
    return {"model": {k: model_config[k] for k in _MODEL_KEYS if k in model_config}, "tokens": learner.max_tokens_per_microbatch,
            "logprob_chunk_tokens": learner.logprob_chunk_tokens, "checkpointing": checkpointing, "world_size": learner.world_size,
            "compute_bytes": compute_bytes(learner, device_type), "reference": beside.reference, "critic": beside.critic}


def _comparable(key: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple((k, ModelShape.from_config(v) if k == "model" else v) for k, v in sorted(key.items()))


def _split(entry: Mapping[str, Any]) -> tuple[dict[str, Any], Measurement]:
    fields = Measurement.__dataclass_fields__
    return {k: v for k, v in entry.items() if k not in fields}, Measurement(**{k: entry[k] for k in fields})


@functools.lru_cache(maxsize=8)
def calibration(path: Path = CALIBRATION_PATH) -> tuple[tuple[dict[str, Any], Measurement], ...]:
    """Every ``(setting key, measurement)`` of the table at ``path`` (none if it does not exist)."""
    if not path.exists():
        return ()
    return tuple(_split(e) for e in json.loads(path.read_text())["entries"])


def last_measured(key: Mapping[str, Any], path: Path = CALIBRATION_PATH) -> Measurement | None:
    """The newest measurement of the setting ``key`` (:func:`setting_key`) in ``path``, or None."""
    want = _comparable(key)
    found = [m for k, m in calibration(path) if _comparable(k) == want]
    return max(found, key=lambda m: m.date) if found else None


def record_measurement(key: Mapping[str, Any], measured: Measurement, path: Path = CALIBRATION_PATH) -> None:
    """Put ``measured`` into the table at ``path`` as the one entry of its setting ``key``."""
    want = _comparable(key)
    entries = [e for e in (json.loads(path.read_text())["entries"] if path.exists() else []) if _comparable(_split(e)[0]) != want]
    entries.append({**key, **dataclasses.asdict(measured)})
    path.write_text(json.dumps({"entries": entries}, indent=2) + "\n")
    calibration.cache_clear()


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory of one learner rank at its peak (the start of a micro-batch's backward), in GB."""

    params_gb: float
    """Float32 master weights, this rank's shard (LoRA: the frozen base's shard in the compute
    dtype and the adapter's float32 master weights)."""
    grads_gb: float
    """Float32 gradient shard plus the unsharded gradients in flight in backward."""
    optimizer_gb: float
    """AdamW's two float32 states, this rank's shard."""
    compute_copies_gb: float
    """Gathered compute-dtype parameters: the root and two decoder layers."""
    activations_gb: float
    """Tensors saved for backward (and backward's working set) at ``tokens`` tokens."""
    logprob_chunk_gb: float
    """The ``[chunk, vocab]`` tensors of one chunk of the LM head + log-softmax."""
    overhead_gb: float
    """CUDA context, communication buffers, workspaces, allocator fragmentation."""
    reference_gb: float
    """The frozen reference model (KL penalty), 0 without one."""
    critic_gb: float
    """The critic's resident state (gae), 0 without one."""
    handoff_gb: float
    """The CUDA IPC hand-off buffer of servers on the rank's GPU: the whole update
    (:data:`UPDATE_BYTES_PER_PARAM` per sent parameter: the model, or the LoRA adapter); 0
    without such servers."""
    tokens: int
    """Tokens of one micro-batch (``learner.max_tokens_per_microbatch``)."""
    adapter_params: int
    """LoRA: the adapter's parameters (the only trained ones); 0 in full fine-tuning."""
    checkpointing: bool
    """Gradient checkpointing of the decoder layers."""
    budget_gb: float
    """Memory one rank may use."""
    measured: Measurement | None = None
    """The last measured peak of the same setting (:func:`last_measured`), if any."""

    @property
    def total_gb(self) -> float:
        """Sum of the parts."""
        return (self.params_gb + self.grads_gb + self.optimizer_gb + self.compute_copies_gb + self.activations_gb
                + self.logprob_chunk_gb + self.overhead_gb + self.reference_gb + self.critic_gb + self.handoff_gb)

    @property
    def fits(self) -> bool:
        """Whether the estimate is within the budget."""
        return self.total_gb <= self.budget_gb

    def summary(self, auto: bool = False) -> str:
        """One line: ``learner memory: T GB of B GB per rank (parts...)``; ``auto`` notes that
        ``gradient_checkpointing: auto`` chose the checkpointing."""
        parts = [f"params {self.params_gb:.1f}" + (" (frozen base + LoRA adapter)" if self.adapter_params else ""),
                 f"grads {self.grads_gb:.1f}", f"optimizer {self.optimizer_gb:.1f}",
                 f"compute copies {self.compute_copies_gb:.1f}",
                 f"activations {self.activations_gb:.1f} at {self.tokens} tokens with gradient checkpointing "
                 f"{'on' if self.checkpointing else 'off'}{' (auto)' if auto else ''}",
                 f"log-prob chunk {self.logprob_chunk_gb:.1f}"]
        if self.reference_gb:
            parts.append(f"reference model {self.reference_gb:.1f}")
        if self.critic_gb:
            parts.append(f"critic {self.critic_gb:.1f}")
        if self.handoff_gb:
            parts.append(f"weight hand-off buffer {self.handoff_gb:.1f}")
        parts.append(f"overhead {self.overhead_gb:.1f}")
        line = f"learner memory: {self.total_gb:.1f} GB of {self.budget_gb:.4g} GB per rank ({', '.join(parts)})"
        if self.measured is not None:
            m = self.measured
            line += f"; last measured: {m.peak_gb:.1f} GB peak allocated on {m.device}, {m.date}"
        return line


def compute_bytes(learner: LearnerConfig, device_type: str) -> int:
    """Bytes per element of the compute dtype (``learner.fsdp.param_dtype``; ``auto``: bf16 on GPU)."""
    dtype = learner.fsdp.param_dtype
    if dtype == "auto":
        return 2 if device_type == "cuda" else 4
    return 2 if dtype == "bfloat16" else 4


def _sdpa_attention(learner: LearnerConfig, device_type: str) -> bool:
    """Whether attention runs as per-sample sdpa (which repeats k/v for grouped-query attention)."""
    return learner.kernels.attention == "sdpa" or device_type != "cuda"


def layer_activation_bytes(shape: ModelShape, c: int, repeat_kv: bool = False) -> int:
    """Bytes per token that one decoder layer of the Hugging Face Qwen2/Llama code saves for
    backward (checked against ``saved_tensors_hooks`` on a bf16 layer in the tests)::

        A_layer = 2 (4 H + 2 c H + 4)         two RMSNorms: float32 input, normalised (cast back), output, rsqrt
                + c (3 nh d + 2 kv d) + 4 nh  q and k after RoPE, v, the attention output and the
                                               o_proj input (its contiguous copy), float32 logsumexp
                + 4 c I                       SwiGLU: gate, SiLU(gate), up, their product

    ``c`` bytes per compute-dtype element, ``nh d`` the query width, ``kv d`` the key/value
    width (``kv = nh`` when ``repeat_kv``: per-sample sdpa saves the repeated keys and values).
    Liger's RMSNorm/SwiGLU save less; they are not counted (the estimate stays on the safe side).
    """
    h, q, i = shape.hidden, shape.heads * shape.head_dim, shape.intermediate
    kv = q if repeat_kv else shape.kv_heads * shape.head_dim
    return 2 * (4 * h + 2 * c * h + 4) + c * (3 * q + 2 * kv) + 4 * shape.heads + 4 * c * i


def lora_activation_bytes(shape: ModelShape, c: int, lora: LoraConfig) -> int:
    """Bytes per token that ``lora``'s adapters add to what one decoder layer saves for
    backward: ``A x`` (``B``'s input, ``r`` values) per target, and with dropout the dropped
    input (``in`` values) and its boolean mask, which ``A`` and the dropout save.
    ``sum_t (r c + (c + 1) in_t [dropout > 0])``."""
    dropped = lora.dropout > 0
    return sum(lora.rank * c + ((c + 1) * i if dropped else 0) for i, _ in shape.lora_target_shapes(lora.target_modules))


def activation_bytes_per_token(shape: ModelShape, c: int, checkpointing: bool, repeat_kv: bool = False, lora_layer: int = 0) -> int:
    """Bytes per token of the tensors saved for backward, plus backward's working set.

    Outside the layers: ``A_out = 2 c d`` (RoPE cos/sin) ``+ 4 H + 2 c H`` (final norm) ``+ c H``
    (hidden states of the response positions, kept by the chunked head) ``+ 64`` (integer inputs,
    per-token float32 outputs). Backward's working set: ``A_bwd = 3 c I + 8 H`` (one MLP's
    gradients in flight, float32 residual-stream gradients). With ``A_layer`` of
    :func:`layer_activation_bytes`:

    * without checkpointing: ``L A_layer + A_out + A_bwd``;
    * with it (each layer's input kept, one layer recomputed at a time):
      ``L c H + A_layer + A_out + A_bwd``.

    ``lora_layer`` (:func:`lora_activation_bytes`) is added to ``A_layer``.
    """
    h = shape.hidden
    layer = layer_activation_bytes(shape, c, repeat_kv) + lora_layer
    outer = 2 * c * shape.head_dim + 4 * h + 2 * c * h + c * h + _SMALL_PER_TOKEN
    backward = 3 * c * shape.intermediate + 8 * h
    kept = shape.layers * c * h + layer if checkpointing else shape.layers * layer
    return kept + outer + backward


UPDATE_BYTES_PER_PARAM = 4
"""Bytes of each parameter in a weight update: the learner sends its float32 master copy (a
LoRA adapter's too; ``learner.model.iter_full_parameters`` casts nothing)."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint's bytes per trained parameter: its float32 master weight and AdamW's two float32 moments."""


def checkpoint_bytes(model_config: Mapping[str, Any], learner: LearnerConfig, critic: bool) -> int:
    """Bytes of one checkpoint (:mod:`~async_rl.learner.checkpoint`): the policy's trained
    parameters (the whole model, or with ``learner.lora`` its adapters only) and, with
    ``critic``, the value model's (a full model), each with its AdamW state."""
    shape = ModelShape.from_config(model_config)
    lora = learner.lora
    trained = shape.params if lora is None else shape.lora_params(lora.target_modules, lora.rank)
    return CHECKPOINT_BYTES_PER_PARAM * (trained + (shape.params if critic else 0))


@dataclass(frozen=True)
class RankExtras:
    """What a learner rank holds besides the policy it trains: the reference, the critic, the weight hand-off buffer."""

    reference: bool = False
    """The frozen reference model (:meth:`~async_rl.config.AlgorithmConfig.loads_reference_model`)."""
    critic: bool = False
    """The critic (``algorithm.needs_critic``)."""
    handoff: bool = False
    """The weight hand-off buffer: inference servers on the rank's own GPU read every update
    from one buffer of the whole update kept in its memory (CUDA IPC, ``sync.backend`` ``auto``
    or ``ipc``; :mod:`async_rl.sync.cuda_ipc`)."""

    @classmethod
    def of(cls, algorithm: AlgorithmConfig, lora: LoraConfig | None = None, handoff: bool = False) -> RankExtras:
        """What ``algorithm`` needs beside the policy; with ``lora`` (``learner.lora``) no
        reference model: a LoRA run's reference is the policy with its adapters disabled.
        ``handoff``: servers share the rank's GPU and get their updates through CUDA IPC."""
        return cls(algorithm.loads_reference_model(lora), algorithm.needs_critic, handoff)


def estimate(model_config: Mapping[str, Any], learner: LearnerConfig, checkpointing: bool, budget_gb: float,
             device_type: str = "cuda", beside: RankExtras = RankExtras()) -> MemoryEstimate:
    """Peak memory of one learner rank in GB (see the module docstring for each part).

    ``model_config`` is the model's ``config.json`` (Qwen2/Llama keys; raises ``ValueError``
    when one is missing); ``checkpointing`` the resolved gradient checkpointing; ``budget_gb``
    what a rank may use (:func:`budget_gb`); ``device_type`` ``cuda`` or ``cpu`` (compute dtype,
    attention path, overhead); ``beside`` adds the frozen reference and the critic
    (:meth:`RankExtras.of`). ``learner.lora`` estimates a LoRA run (module docstring); a target
    that is no decoder projection raises ``ValueError`` too.
    """
    shape = ModelShape.from_config(model_config)
    c = compute_bytes(learner, device_type)
    world = learner.world_size
    p, v_h = shape.params, shape.vocab * shape.hidden
    tokens = learner.max_tokens_per_microbatch
    chunk = min(learner.logprob_chunk_tokens, tokens)
    lora = learner.lora
    if lora is None:  # full fine-tuning: every parameter trains from float32 master weights
        weights, trained, adapter_layer, in_flight, lora_layer = 4 * p, p, 0, v_h + shape.layer_params, 0
    else:  # the frozen base in the compute dtype; only the adapter trains (the LM head computes no weight gradient)
        trained = shape.lora_params(lora.target_modules, lora.rank)
        adapter_layer = trained // shape.layers
        weights, in_flight, lora_layer = c * p + 4 * trained, adapter_layer, lora_activation_bytes(shape, c, lora)
    per_token = activation_bytes_per_token(shape, c, checkpointing, _sdpa_attention(learner, device_type), lora_layer)
    activations, chunk_bytes = per_token * tokens, chunk * shape.vocab * (c + 8)
    fixed = GPU_OVERHEAD_GB if device_type == "cuda" else CPU_OVERHEAD_GB
    critic_grads = 0 if lora is None else 4 * p / world + (4 + c) * shape.layer_params  # the adapter's no longer cover them
    return MemoryEstimate(
        params_gb=weights / world / GB,
        grads_gb=(4 * trained / world + (4 + c) * in_flight) / GB,
        optimizer_gb=8 * trained / world / GB,
        compute_copies_gb=c * (shape.root_params + 2 * (shape.layer_params + adapter_layer)) / GB,
        activations_gb=activations / GB,
        logprob_chunk_gb=chunk_bytes / GB,
        overhead_gb=fixed + FRAGMENTATION * (activations + chunk_bytes) / GB,
        reference_gb=(4 * p / world + c * shape.root_params) / GB if beside.reference else 0.0,
        critic_gb=(12 * p / world + c * shape.root_params + critic_grads) / GB if beside.critic else 0.0,
        handoff_gb=UPDATE_BYTES_PER_PARAM * (p if lora is None else trained) / GB if beside.handoff else 0.0,
        tokens=tokens,
        adapter_params=0 if lora is None else trained,
        checkpointing=checkpointing,
        budget_gb=budget_gb,
        measured=None if "vision_config" in model_config else last_measured(setting_key(model_config, learner, checkpointing, device_type, beside)),
    )


def max_fitting_tokens(model_config: Mapping[str, Any], learner: LearnerConfig, checkpointing: bool, budget_gb: float,
                       device_type: str = "cuda", beside: RankExtras = RankExtras()) -> int:
    """Largest ``learner.max_tokens_per_microbatch`` (a multiple of 1024) whose estimate fits
    ``budget_gb``, all else as in ``learner``; 0 if none does."""

    def fits(tokens: int) -> bool:
        trial = dataclasses.replace(learner, max_tokens_per_microbatch=tokens)
        return estimate(model_config, trial, checkpointing, budget_gb, device_type, beside).fits

    if not fits(1024):
        return 0
    low, high = 1, 2
    while fits(high * 1024):  # activations grow linearly: double, then bisect
        low, high = high, high * 2
        if high > 1 << 20:  # a billion tokens: the budget is not the limit
            return low * 1024
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * 1024) else (low, mid)
    return low * 1024


def servers_gpu_share(rollout: RolloutConfig, learner: LearnerConfig) -> float:
    """Fraction of a learner rank's GPU taken by inference servers on the same device: 0
    unless both ask for part of a GPU (``rollout.gpus_per_server`` and
    ``learner.gpus_per_rank`` in (0, 1)), which Ray packs onto one device; then each server
    that fits beside the rank takes ``rollout.vllm.gpu_memory_utilization`` of it."""
    if not (0 < rollout.gpus_per_server < 1 and 0 < learner.gpus_per_rank < 1):
        return 0.0
    beside = min(rollout.num_servers, int((1 - learner.gpus_per_rank) / rollout.gpus_per_server + 1e-9))
    return beside * rollout.vllm.gpu_memory_utilization


def cuda_ipc_handoff(sync: SyncConfig, servers_share: float) -> bool:
    """Whether learner rank 0 keeps a CUDA IPC hand-off buffer on its GPU: inference servers
    share the GPU (``servers_share`` > 0, :func:`servers_gpu_share`) and ``sync.backend`` hands
    them updates through memory (``auto``, ``ipc``)."""
    return servers_share > 0 and sync.backend in ("auto", "ipc")


def budget_gb(learner: LearnerConfig, device_type: str, servers_share: float = 0.0) -> float:
    """Memory one learner rank may use, in GB.

    GPU (``device_type == "cuda"``): ``learner.gpu_memory_gb`` if set, else the memory of this
    machine's current GPU, else 80 (planning on a machine without one); less the
    ``servers_share`` (:func:`servers_gpu_share`) that inference servers on the same GPU
    take. CPU: this machine's physical memory divided by ``learner.world_size`` (the ranks
    share it).
    """
    if device_type != "cuda":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB / learner.world_size
    if learner.gpu_memory_gb is not None:
        device_gb = float(learner.gpu_memory_gb)
    else:
        import torch

        device_gb = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB if torch.cuda.is_available() else 80.0
    return device_gb * max(0.0, 1.0 - servers_share)


def resolve_gradient_checkpointing(learner: LearnerConfig, model_config: Mapping[str, Any], device_type: str,
                                   beside: RankExtras = RankExtras(), servers_share: float = 0.0) -> bool:
    """Whether to checkpoint the decoder layers: ``on`` -> True, ``off`` -> False, ``auto`` ->
    True only on GPU (``device_type == "cuda"``) when the estimate without checkpointing does
    not fit :func:`budget_gb` (CPU: memory is plentiful and recomputation costs more than it saves).
    The estimate is the LoRA one with ``learner.lora`` (pass ``beside`` from :meth:`RankExtras.of`
    with the same lora: no reference model then)."""
    mode = learner.fsdp.gradient_checkpointing
    if mode != "auto":
        return mode == "on"
    if device_type != "cuda":
        return False
    return not estimate(model_config, learner, False, budget_gb(learner, device_type, servers_share), device_type, beside).fits
