"""Sharded checkpoints (torch.distributed.checkpoint), retention, resume and Hugging Face export.

Layout of ``{output_dir}/checkpoints/step_{version:08d}/``::

    model/            DCP shards of the policy (one file per rank + .metadata)
    optim/            DCP shards of the AdamW state
    critic_model/     with a critic (gae): DCP shards of the value model,
    critic_optim/     of its AdamW state,
    critic_hf/        and its config.json (a one-label token classifier, for export)
    rng/rank_{r}.pt   Python, torch (and CUDA) RNG states of rank r
    hf/               config.json, generation config and tokenizer files of the base model (for export)
    state.json        version, scheduler state, uncommitted queue entry ids, counters; written
                      last, atomically: a directory without it is incomplete and ignored

A checkpoint is durable when :func:`save` returns on any rank (files fsynced, directory
entries fsynced); only then may the queue entries it covers be committed (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from async_rl.learner import collectives

_PREFIX = "step_"
_STATE = "state.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


@dataclass
class TrainingState:
    """The small, rank-independent part of a checkpoint."""

    version: int
    """Policy version of the saved weights (learner steps done, counting from the base model's 0)."""
    scheduler: dict[str, Any]
    """``LambdaLR.state_dict()`` (its step count drives the schedule)."""
    uncommitted_entry_ids: list[str] = field(default_factory=list)
    """Queue entries trained into this state but not yet committed when it was saved; a
    resumed learner commits them before reading anything."""
    counters: dict[str, int] = field(default_factory=dict)
    """Cumulative counts (dropped samples by reason, skipped steps, consumed groups)."""
    kl_ctrl: dict[str, float] = field(default_factory=dict)
    """The KL-in-reward controller's state (its coefficient); empty without ``algorithm.kl_in_reward``."""
    critic_scheduler: dict[str, Any] = field(default_factory=dict)
    """The critic's ``LambdaLR.state_dict()``; empty without a critic."""


def checkpoint_dir(output_dir: str | Path, version: int) -> Path:
    """Directory of the checkpoint of policy version ``version``."""
    return Path(output_dir) / "checkpoints" / f"{_PREFIX}{version:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir``, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / _STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """``trainer.resume`` -> the checkpoint to load: ``off`` none, ``auto`` the latest complete
    one in ``output_dir`` (none if there is none), otherwise the given path, which must be complete."""
    if resume == "off":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / _STATE).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint (no {_STATE})")
    return path


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
    model_path: str | Path,
    keep: int,
    critic: tuple[nn.Module, torch.optim.Optimizer] | None = None,
) -> None:
    """Write a checkpoint (collective: every rank calls it) and keep the ``keep`` newest;
    ``critic`` is the value model and its optimizer, when there is one.

    Returns once the checkpoint is durable on every rank.
    """
    rank = dist.get_rank()
    for (m, o), prefix in (((model, optimizer), ""), *(((critic, "critic_"),) if critic is not None else ())):
        model_sd, optim_sd = get_state_dict(m, o)
        dcp.save(model_sd, checkpoint_id=path / f"{prefix}model")
        dcp.save(optim_sd, checkpoint_id=path / f"{prefix}optim")
    _write_durable(path / "rng" / f"rank_{rank}.pt", lambda f: torch.save(_rng_state(), f))
    collectives.barrier()
    if rank == 0:
        _copy_hf_files(Path(model_path), path / "hf")
        if critic is not None:
            config = critic[0].config.to_json_string()
            _write_durable(path / "critic_hf" / "config.json", lambda f: f.write(config.encode()))
        _write_durable(path / _STATE, lambda f: f.write(json.dumps(asdict(state), indent=1).encode()))
        _fsync_dir(path)
        _fsync_dir(path.parent)
        for old in list_checkpoints(path.parent.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    collectives.barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         critic: tuple[nn.Module, torch.optim.Optimizer] | None = None) -> TrainingState:
    """Restore model, optimizer (and the critic's), and this rank's RNG from checkpoint
    ``path`` (collective). A checkpoint saved without a critic cannot resume a run with one."""
    if critic is not None and not (path / "critic_model").is_dir():
        raise FileNotFoundError(f"{path} holds no critic (saved without algorithm.advantage.name=gae): resume with trainer.resume=off "
                                "or point trainer.resume at a checkpoint of a run with a critic")
    for (m, o), prefix in (((model, optimizer), ""), *(((critic, "critic_"),) if critic is not None else ())):
        model_sd, optim_sd = get_state_dict(m, o)
        dcp.load(model_sd, checkpoint_id=path / f"{prefix}model")
        dcp.load(optim_sd, checkpoint_id=path / f"{prefix}optim")
        set_state_dict(m, o, model_state_dict=model_sd, optim_state_dict=optim_sd)
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than saved: seeds stay as set
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return TrainingState(**json.loads((path / _STATE).read_text()))


def export_hf(checkpoint: str | Path, out_dir: str | Path, critic: bool = False) -> Path:
    """Write checkpoint ``checkpoint``'s policy (or with ``critic``, its value model, as a
    ``*ForTokenClassification`` with one label) as a Hugging Face directory (safetensors,
    config, tokenizer) that ``transformers`` (and, for the policy, vLLM) load. Runs in one
    process, no GPU needed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    from async_rl.learner.vision import is_vision_language

    src, out = Path(checkpoint), Path(out_dir)
    if not (src / _STATE).is_file():
        raise FileNotFoundError(f"{src} is not a complete checkpoint (no {_STATE})")
    if critic and not (src / "critic_hf").is_dir():
        raise FileNotFoundError(f"{src} holds no critic (the run did not use algorithm.advantage.name=gae)")
    if critic:
        model = AutoModelForTokenClassification.from_config(AutoConfig.from_pretrained(src / "critic_hf"), dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(src / "hf")
        model_class = AutoModelForImageTextToText if is_vision_language(config.to_dict()) else AutoModelForCausalLM
        model = model_class.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=src / ("critic_model" if critic else "model"), no_dist=True)
    model.load_state_dict(state)
    out.mkdir(parents=True, exist_ok=True)
    _copy_hf_files(src / "hf", out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _copy_hf_files(src: Path, dst: Path) -> None:
    """Copy config, generation config and tokenizer files (everything but weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, dst / item.name)


def _write_durable(path: Path, write: Any) -> None:
    """Write via a temporary file, fsync, and rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
