"""Sharded checkpoints (torch.distributed.checkpoint), retention, resume and Hugging Face export.

Layout of ``{output_dir}/checkpoints/``::

    step_{version:08d}/      a committed checkpoint (below)
    head.json               {"checkpoint": "<name or path>" | null}: the head of the line being
                            trained (what ``trainer.resume=auto`` loads); null: a line started
                            from the base model that has not saved yet
    .tmp-step_{version:08d}/ a save in progress (or killed: swept at the next start)
    .old-step_{version:08d}/ a checkpoint being replaced by a save of the same version

Layout of ``step_{version:08d}/``::

    model/            DCP shards of the policy (one file per rank + .metadata)
    optim/            DCP shards of the AdamW state
    critic_model/     with a critic (gae): DCP shards of the value model,
    critic_optim/     of its AdamW state,
    critic_hf/        and its config.json (a one-label token classifier, for export)
    rng/rank_{r}.pt   Python, torch (and CUDA) RNG states of rank r (tensors and ints): one per
                      saving rank, the only record of how many ranks saved (:func:`saved_world_size`)
    hf/               config.json, generation config and tokenizer files of the base model (for export)
    state.json        version, scheduler state, uncommitted queue entry ids, counters, parent;
                      written last: a directory without it is incomplete and ignored

**Saving is atomic.** Every rank writes its shards into ``.tmp-step_N``; rank 0 then writes
``state.json``, fsyncs every file and directory, and commits: an existing ``step_N`` (of an
abandoned line, after an explicit resume from an older checkpoint) is renamed to
``.old-step_N``, ``.tmp-step_N`` is renamed to ``step_N``, ``head.json`` is replaced, and only
then is the old one removed. A crash at any point leaves the previous head complete and the
head pointer on it; :func:`start` sweeps the debris at the next start (a temporary directory
is removed, an ``.old-`` one whose ``step_N`` is missing is put back). A checkpoint is durable
when :func:`save` returns on any rank; only then may the queue entries it covers be committed
(docs/architecture.md).

**Lines.** ``state.json`` names its ``parent``: the checkpoint the run continued from (its
previous save, or the checkpoint it resumed from; None for a line started from the base
model). ``trainer.resume=auto`` loads the head of the line (``head.json``), never a newer
step of a line the user left by resuming from an older checkpoint; retention keeps the
``keep`` newest checkpoints of the line being trained and leaves other lines' alone.
Checkpoints written before lines existed have no ``parent`` key and their directory no
``head.json``: they are legacy, one line in step order, and ``auto`` loads the highest step.

**Any number of ranks loads it.** Nothing but the RNG files depends on the number of ranks
that saved: DCP reshards the model and optimizer shards on load, ``state.json`` holds no rank
count. A rank loads its own RNG file if there is one; the files of ranks the loading run does
not have are not read (docs/training.md, "Resuming on another number of ranks").

**Loading runs nothing from the checkpoint.** A checkpoint holds data only: tensors, plain
values, DCP's metadata classes, JSON and tokenizer files. :func:`load` and :func:`export_hf`
read it through :mod:`async_rl.learner.safe_load`, which refuses anything else
(:class:`~async_rl.learner.safe_load.CheckpointContentError`) before it runs.
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
from async_rl.learner.safe_load import dcp_load, tensors_load

_PREFIX = "step_"
_STATE = "state.json"
_HEAD = "head.json"
_TMP = ".tmp-"
_OLD = ".old-"
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
    parent: str | None = None
    """The checkpoint this one continues from (the run's previous save, or the checkpoint it
    resumed from): a directory name under the same ``checkpoints/``, or an absolute path
    elsewhere; None for a line started from the base model."""
    run_id: str | None = None
    """Id of the run that wrote it (None: not recorded)."""


@dataclass(frozen=True)
class Start:
    """Where a run starts (:func:`start`)."""

    path: Path | None
    """The checkpoint to load; None: the base model."""
    swept: list[str]
    """What the sweep did, one line each (for the driver's console)."""


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


def start(resume: str, output_dir: str | Path) -> Start:
    """At a start, on rank 0 before anything is saved: sweep what a killed save left
    (:func:`sweep`), resolve ``trainer.resume`` and make it the head of the line.

    ``off``: the base model (a new line; the old checkpoints stay). ``auto``: the head of the
    line (``head.json``; legacy directories without one: the highest complete step; none if
    there is none). Otherwise the given checkpoint, which must be complete; a later ``auto``
    continues from it, not from a newer step of the line it leaves."""
    root = Path(output_dir) / "checkpoints"
    swept = sweep(output_dir)
    if resume == "auto":
        return Start(_head(root), swept)
    path = None if resume == "off" else Path(resume)
    if path is not None and not (path / _STATE).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint (no {_STATE})")
    if path is not None or root.is_dir():
        _write_head(root, path)
    return Start(path, swept)


def sweep(output_dir: str | Path) -> list[str]:
    """Clean up after saves that were killed: remove every temporary directory (an
    uncommitted save) and restore or remove every replaced one. Returns a line per action."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = []
    for tmp in sorted(root.glob(f"{_TMP}{_PREFIX}*")):
        shutil.rmtree(tmp)
        done.append(f"removed {tmp}: a checkpoint save that did not complete")
    for old in sorted(root.glob(f"{_OLD}{_PREFIX}*")):
        final = root / old.name.removeprefix(_OLD)
        if (final / _STATE).is_file():
            shutil.rmtree(old)
            done.append(f"removed {old}: replaced by {final.name}")
        else:  # killed between moving it aside and committing the new one: it is still the one
            shutil.rmtree(final, ignore_errors=True)
            os.replace(old, final)
            done.append(f"restored {final} from {old.name}: the save that was replacing it did not complete")
    if done:
        _fsync_dir(root)
    return done


def lineage(path: Path) -> list[Path]:
    """``path`` and its ancestors under the same ``checkpoints/`` directory, newest first
    (a legacy checkpoint's parent is the complete one of the next lower step)."""
    root, chain, seen = path.parent, [], set()
    current: Path | None = path
    while current is not None and current.parent == root and current.name not in seen and (current / _STATE).is_file():
        chain.append(current)
        seen.add(current.name)
        doc = json.loads((current / _STATE).read_text())
        if "parent" in doc:
            current = None if doc["parent"] is None else root / doc["parent"]
        else:
            lower = [p for p in list_checkpoints(root.parent) if p.name < current.name]
            current = lower[-1] if lower else None
    return chain


def reference(path: Path, root: Path) -> str:
    """How ``state.json`` and ``head.json`` name checkpoint ``path``: its directory name
    when it is under ``root`` (``checkpoints/``), else its absolute path."""
    path = path.absolute()
    return path.name if path.parent == root.absolute() else str(path)


def _head(root: Path) -> Path | None:
    """The head of the line (``head.json``; legacy: the highest complete step)."""
    head_file = root / _HEAD
    if not head_file.is_file():
        found = list_checkpoints(root.parent)
        return found[-1] if found else None
    ref = json.loads(head_file.read_text())["checkpoint"]
    if ref is None:
        return None
    path = root / ref
    if not (path / _STATE).is_file():
        raise FileNotFoundError(f"{head_file} names {path}, which is not a complete checkpoint (no {_STATE}): "
                                "set trainer.resume to a checkpoint to continue from, or trainer.resume=off")
    return path


def _write_head(root: Path, path: Path | None) -> None:
    """Make ``path`` (None: the base model) the head of the line, durably."""
    doc = {"checkpoint": None if path is None else reference(path, root)}
    _write_durable(root / _HEAD, lambda f: f.write(json.dumps(doc).encode()))
    _fsync_dir(root)


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
    model_path: str | Path,
    keep: int,
    critic: tuple[nn.Module, torch.optim.Optimizer] | None = None,
) -> None:
    """Write checkpoint ``path`` (collective: every rank calls it) atomically (see the module),
    make it the head of the line and keep the ``keep`` newest of the line (``state.parent``
    names the previous one); ``critic`` is the value model and its optimizer, when there is one.

    Returns once the checkpoint is durable on every rank.
    """
    rank = dist.get_rank()
    tmp = path.with_name(_TMP + path.name)
    if rank == 0:  # a save of this version killed in this run's lifetime cannot exist, but be sure
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    collectives.barrier()
    for (m, o), prefix in (((model, optimizer), ""), *(((critic, "critic_"),) if critic is not None else ())):
        model_sd, optim_sd = get_state_dict(m, o)
        dcp.save(model_sd, checkpoint_id=tmp / f"{prefix}model")
        dcp.save(optim_sd, checkpoint_id=tmp / f"{prefix}optim")
    _write_durable(tmp / "rng" / f"rank_{rank}.pt", lambda f: torch.save(_rng_state(), f))
    collectives.barrier()
    if rank == 0:
        _copy_hf_files(Path(model_path), tmp / "hf")
        if critic is not None:
            config = critic[0].config.to_json_string()
            _write_durable(tmp / "critic_hf" / "config.json", lambda f: f.write(config.encode()))
        _write_durable(tmp / _STATE, lambda f: f.write(json.dumps(asdict(state), indent=1).encode()))
        _fsync_tree(tmp)
        _commit(tmp, path)
        for old in lineage(path)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    collectives.barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         critic: tuple[nn.Module, torch.optim.Optimizer] | None = None) -> TrainingState:
    """Restore model, optimizer (and the critic's), and this rank's RNG from checkpoint
    ``path`` (collective), whatever number of ranks saved it: DCP reshards the states; a rank
    the saving run did not have keeps its seeded RNG, and the RNG files of ranks this run does
    not have are not read. A checkpoint saved without a critic cannot resume a run with one.
    Nothing in it is unpickled but data (:mod:`async_rl.learner.safe_load`)."""
    if critic is not None and not (path / "critic_model").is_dir():
        raise FileNotFoundError(f"{path} holds no critic (saved without algorithm.advantage.name=gae): resume with trainer.resume=off "
                                "or point trainer.resume at a checkpoint of a run with a critic")
    for (m, o), prefix in (((model, optimizer), ""), *(((critic, "critic_"),) if critic is not None else ())):
        model_sd, optim_sd = get_state_dict(m, o)
        dcp_load(model_sd, path / f"{prefix}model")
        dcp_load(optim_sd, path / f"{prefix}optim")
        set_state_dict(m, o, model_state_dict=model_sd, optim_state_dict=optim_sd)
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than saved: the seed stays as set
        _set_rng_state(tensors_load(rng_file))
    return TrainingState(**json.loads((path / _STATE).read_text()))


def saved_world_size(path: Path) -> int:
    """The number of ranks that saved checkpoint ``path`` (its ``rng/rank_{r}.pt`` files)."""
    return len(list((path / "rng").glob("rank_*.pt")))


def resharding_note(path: Path, world_size: int) -> str | None:
    """A line for the console when checkpoint ``path`` was saved by another number of ranks
    than the ``world_size`` loading it (None when the same, or unknown: no RNG files): what
    carries over, and which ranks' RNG states are not restored."""
    saved = saved_world_size(path)
    if saved in (0, world_size):
        return None
    if saved > world_size:
        rng = f"the RNG states saved by {_ranks(world_size, saved)} are not used (no such rank in this run)"
    else:
        rng = f"no RNG state was saved for {_ranks(saved, world_size)}, seeded from trainer.seed instead"
    return (f"resuming a checkpoint of {saved} rank{'s' * (saved != 1)} on {world_size}: the policy and optimizer states (and the "
            f"critic's) are resharded on load; version, LR schedule, counters, KL controller and uncommitted queue entries "
            f"carry over; {rng}")


def _ranks(first: int, end: int) -> str:
    """Ranks ``first`` to ``end - 1``: ``"rank 3"`` or ``"ranks 3-5"``."""
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"


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
    dcp_load(state, src / ("critic_model" if critic else "model"), no_dist=True)
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
            shutil.copyfile(item, dst / item.name)  # the umask's mode (0600 in a run), not the source's


def _write_durable(path: Path, write: Any) -> None:
    """Write via a temporary file, fsync, and rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _commit(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` to ``path`` and make it the head; a ``path`` that exists is
    moved aside first and removed only once the new one is in place."""
    root = path.parent
    old = path.with_name(_OLD + path.name)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(root)
    _write_head(root, path)
    if old.exists():
        shutil.rmtree(old)


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (DCP fsyncs its files, not the directories)."""
    for dirpath, _, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


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
