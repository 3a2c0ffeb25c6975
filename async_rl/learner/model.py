"""Process group, FSDP2-sharded Hugging Face causal LMs, token log-probabilities and bucketed
full-parameter gathering.

One code path for both backends: gloo and float32 on CPU, NCCL and (by default) bfloat16
compute with float32 gradient reduction on GPU.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

from async_rl.config import FsdpConfig, LearnerConfig, LoraConfig
from async_rl.learner import attention, kernels, memory, vision
from async_rl.learner.logprobs import install_logprob_head
from async_rl.learner.lora import apply_lora, unsupported_model
from async_rl.netbind import master_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the learner job."""

    rank: int
    world_size: int
    device: torch.device


_hosted_store: dist.TCPStore | None = None
"""The learner's TCP store bound by :func:`host_rendezvous_store` on rank 0, until
:func:`init_distributed` takes it."""


def host_rendezvous_store(host: str, world_size: int, timeout_s: float) -> int:
    """Rank 0, before the ranks join: bind the learner's TCP store on a free port of ``host``
    (that address only: :func:`async_rl.netbind.master_store`) and return that port (give it
    to every rank's :func:`init_distributed`).

    The store holds the port from the bind on, so no other process can take it between the
    choice of the port and the rendezvous. It is kept in this process until rank 0's
    :func:`init_distributed` uses it; calling this again replaces one not yet used.
    """
    global _hosted_store
    _hosted_store = master_store(host, 0, timeout_s, world_size)
    return int(_hosted_store.port)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> DistInfo:
    """Join the learner's default process group (NCCL with CUDA, else gloo); idempotent.

    Rank 0 uses the store :func:`host_rendezvous_store` bound on ``master_port`` if there is
    one, else it binds ``master_addr:master_port`` itself; the other ranks connect to it. ``timeout_s``
    bounds every collective of the group (a dead peer raises instead of hanging).
    """
    global _hosted_store
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0 and _hosted_store is not None and _hosted_store.port == master_port:
            store, _hosted_store = _hosted_store, None
            store.set_timeout(timeout)
        elif rank == 0:
            store = master_store(master_addr, master_port, timeout_s, world_size)
        else:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), device)


def compute_dtype(fsdp: FsdpConfig, device: torch.device) -> torch.dtype:
    """Parameter compute dtype: ``auto`` is bfloat16 on GPU and float32 on CPU."""
    if fsdp.param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, fsdp.param_dtype)


def load_sharded(model_path: str, learner: LearnerConfig, device: torch.device, trainable: bool, beside: memory.RankExtras = memory.RankExtras(),
                 servers_share: float = 0.0, value_model: bool = False, lora: LoraConfig | None = None) -> nn.Module:
    """Load a causal LM with float32 master weights and shard it: ``fully_shard`` per decoder
    layer, then at the root (embeddings, final norm, LM head).

    ``lora`` (the trainable policy only; a text model) adds LoRA adapters
    (:func:`async_rl.learner.lora.apply_lora`) before anything else touches the model, and
    loads the base in the compute dtype (frozen, so no float32 master copy): only the float32
    adapters train.

    ``value_model`` loads the critic instead: the same checkpoint as a token classifier with
    one label (the base model's weights, a new ``score`` head ``[H] -> 1``, dropout off), whose
    values are read through :func:`async_rl.learner.values.token_values`; it saves and exports
    as a Hugging Face ``*ForTokenClassification`` model.

    The model attends over packed rows (``learner.kernels.attention``, see ``attention.py``)
    and its ``lm_head`` returns log-probs and entropies in chunks (``logprobs.py``); call it
    through :func:`async_rl.learner.logprobs.token_logprobs`. ``trainable=False`` gives the
    frozen reference model (no gradients, eval mode). The trainable model recomputes each
    decoder layer in backward when ``learner.fsdp.gradient_checkpointing`` resolves to on
    (``auto``: the memory estimate, with a reference model beside it when
    the models ``beside`` it, does not fit this GPU, less the ``servers_share`` of inference
    servers on it, without it).
    """
    fsdp = learner.fsdp
    attn = attention.choose(learner.kernels, device)
    model_config = AutoConfig.from_pretrained(model_path).to_dict()
    vlm = vision.is_vision_language(model_config)
    vision.check_supported(model_config)
    if vlm and value_model:
        raise vision.UnsupportedVisionModel(f"{model_path}: a critic (algorithm.advantage.name=gae) of a vision-language model is not supported yet")
    if lora is not None and (why := unsupported_model(model_config)):
        raise vision.UnsupportedVisionModel(f"{model_path}: {why}")
    if lora is not None and (value_model or not trainable):
        raise ValueError("learner.lora applies to the trainable policy only (a LoRA run has no reference model, and the critic trains fully)")
    if vlm:  # the text decoder attends over packed rows; the vision tower over each image, bidirectionally
        model = AutoModelForImageTextToText.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation={"": attn, "text_config": attn, "vision_config": "sdpa"})
        install_logprob_head(model, learner.logprob_chunk_tokens)
    elif value_model:  # transformers' default classifier dropout is 0.1: values must be deterministic
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0  # a config attribute; from_pretrained takes no such keyword for every model
        model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=torch.float32, attn_implementation=attn)
    else:
        dtype = torch.float32 if lora is None else compute_dtype(fsdp, device)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn)
        if lora is not None:  # before fully_shard: on shards PEFT would size B by the shard's rows
            apply_lora(model, lora)
        install_logprob_head(model, learner.logprob_chunk_tokens)
    if trainable:
        checkpointing = memory.resolve_gradient_checkpointing(learner, model.config.to_dict(), device.type, beside, servers_share)
        log.info("learner gradient checkpointing: %s (learner.fsdp.gradient_checkpointing=%s)", "on" if checkpointing else "off",
                 fsdp.gradient_checkpointing)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kernels.apply(model, decoder_layers(model), learner.kernels, device)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(fsdp, device), reduce_dtype=getattr(torch, fsdp.reduce_dtype))
    for layer in [*vision.vision_layers(model), *decoder_layers(model)]:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=fsdp.reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=fsdp.reshard_after_forward)
    model.to(device)
    model.train(trainable)
    if lora is None:  # LoRA: apply_lora froze the base; requires_grad_(True) would unfreeze it
        model.requires_grad_(trainable)
    if vlm and trainable and learner.freeze_vision_tower:
        vision.vision_tower(model).requires_grad_(False)  # type: ignore[union-attr]
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of text decoder layers (``model.<base>.layers``, or a vision-language
    model's ``model.<base>.text_model.layers``)."""
    layers = getattr(vision.text_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layer list at {model.base_model_prefix}[.text_model].layers")
    return layers


def iter_full_parameters(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                         named: Iterable[tuple[str, nn.Parameter]] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Full (unsharded) parameters of an FSDP2 model, ``bucket_bytes`` at a time (all of them,
    or the ``named`` ones: e.g. a LoRA adapter's, :func:`~async_rl.learner.lora.adapter_named_parameters`).

    Collective: every rank must iterate to the end (each parameter is all-gathered). Yields
    lists of ``(name, tensor)`` with names as in the Hugging Face checkpoint; at most one
    bucket (or one parameter larger than a bucket) is materialised at a time, so the extra
    memory of a sync is bounded by ``bucket_bytes`` rather than the model size. ``dtype``
    casts each tensor (e.g. to the servers' bfloat16) before it counts against the bucket.
    """
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, param in model.named_parameters() if named is None else named:
        with torch.no_grad():  # not around the yield: grad mode is thread state the caller shares
            full = _full(param) if dtype is None else _full(param).to(dtype)
        if bucket and size + full.numel() * full.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += full.numel() * full.element_size()
    if bucket:
        yield bucket


def _full(param: Tensor) -> Tensor:
    """The whole parameter: all-gathered from its shards, or (one shard) the local tensor itself."""
    if not hasattr(param, "full_tensor"):
        return param.detach()  # a plain (unsharded) module
    if param.device_mesh.size() == 1 and all(p.is_shard() or p.is_replicate() for p in param.placements):
        return param.to_local()  # a single rank holds everything: no gather, no copy
    return param.full_tensor()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago: another process may bind it before
    the caller does. For tests and benchmarks that must name a port before the ranks start;
    the learner itself binds its store first (:func:`host_rendezvous_store`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
