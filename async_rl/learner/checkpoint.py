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
                      with ``learner.lora``, the adapter's section and its base (``"lora"``:
                      :class:`AdapterRecord`); written last: a directory without it is
                      incomplete and ignored

**A LoRA checkpoint holds the adapter only.** With ``learner.lora`` the policy's ``model/``
and ``optim/`` hold the trainable LoRA parameters and their AdamW state (DCP with
``ignore_frozen_params``); the frozen base is referenced by ``learner.model_path`` and a
fingerprint of its files (:func:`base_fingerprint`), never copied. :func:`load` refuses a
checkpoint whose mode, LoRA hyperparameters or base differ from the run's, naming the keys
(:class:`CheckpointMismatchError`); checkpoints without ``"lora"`` are full ones (those
written before LoRA existed included). :func:`export_hf` writes a LoRA checkpoint as a PEFT
adapter directory, or merged into its base.

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

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from async_rl.config import LORA_KEY, ConfigError, LoraConfig
from async_rl.learner import collectives
from async_rl.learner.lora import adapter_named_parameters, peft_config, wire_name
from async_rl.learner.safe_load import dcp_load, tensors_load

_PREFIX = "step_"
_STATE = "state.json"
_HEAD = "head.json"
_TMP = ".tmp-"
_OLD = ".old-"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
_LORA = "lora"
"""``state.json``'s key of the adapter's record (:class:`AdapterRecord`); absent: full weights."""
_ADAPTER_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
"""DCP's state-dict options of a LoRA policy: get leaves out the frozen base, set loads the adapter alone."""


class CheckpointMismatchError(ConfigError):
    """The checkpoint cannot serve what was asked of it (a LoRA one for a full run or the other
    way round, other LoRA hyperparameters, another base model, ``--merged`` of full weights);
    the message names the keys and the fix."""


@dataclass(frozen=True)
class AdapterRecord:
    """What a LoRA checkpoint records of its adapter and of the base model it adapts
    (``state.json``'s ``"lora"``): enough to refuse a resume that would not continue it and
    to export it without the run's config."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    base_model_path: str
    """The base model's directory (absolute) when the checkpoint was saved."""
    base_fingerprint: str
    """:func:`base_fingerprint` of that directory then."""

    @classmethod
    def of(cls, lora: LoraConfig, model_path: str | Path) -> AdapterRecord:
        """The record of an adapter ``lora`` on the base model at ``model_path``."""
        return cls(lora.rank, lora.alpha, lora.dropout, list(lora.target_modules), str(Path(model_path).absolute()),
                   base_fingerprint(model_path))

    def lora(self) -> LoraConfig:
        """The ``learner.lora`` section the adapter was trained with."""
        return LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=list(self.target_modules))

    def section(self) -> str:
        """The section as ``learner.lora`` overrides (for messages)."""
        return " ".join(f"{LORA_KEY}.{key}={value}" for key, value in asdict(self.lora()).items())


def base_fingerprint(model_path: str | Path) -> str:
    """sha256 (hex) of a model directory's ``config.json`` and the names and sizes of its
    weight files: cheap (no weight is read) and different for another model, another
    architecture or re-saved weights of another size."""
    root = Path(model_path)
    config = root / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{root} is not a Hugging Face model directory (no config.json)")
    digest = hashlib.sha256(config.read_bytes())
    for item in sorted(root.iterdir()):
        if item.is_file() and item.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"\0{item.name}\0{item.stat().st_size}".encode())
    return digest.hexdigest()


def saved_adapter(path: Path) -> AdapterRecord | None:
    """The adapter recorded by checkpoint ``path`` (None: full weights, or written before LoRA)."""
    doc = json.loads((path / _STATE).read_text()).get(_LORA)
    return None if doc is None else AdapterRecord(**doc)


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
class StartPoint:
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


def start(resume: str, output_dir: str | Path) -> StartPoint:
    """At a start, on rank 0 before anything is saved: sweep what a killed save left
    (:func:`sweep`), resolve ``trainer.resume`` and make it the head of the line.

    ``off``: the base model (a new line; the old checkpoints stay). ``auto``: the head of the
    line (``head.json``; legacy directories without one: the highest complete step; none if
    there is none). Otherwise the given checkpoint, which must be complete; a later ``auto``
    continues from it, not from a newer step of the line it leaves."""
    root = Path(output_dir) / "checkpoints"
    swept = sweep(output_dir)
    if resume == "auto":
        return StartPoint(_head(root), swept)
    path = None if resume == "off" else Path(resume)
    if path is not None and not (path / _STATE).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint (no {_STATE})")
    if path is not None or root.is_dir():
        _write_head(root, path)
    return StartPoint(path, swept)


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
    lora: LoraConfig | None = None,
) -> None:
    """Write checkpoint ``path`` (collective: every rank calls it) atomically (see the module),
    make it the head of the line and keep the ``keep`` newest of the line (``state.parent``
    names the previous one); ``critic`` is the value model and its optimizer, when there is one.
    With ``lora`` (the policy's adapter) the policy's shards hold the adapter and its optimizer
    state only, and ``state.json`` records the adapter and the base at ``model_path``.

    Returns once the checkpoint is durable on every rank.
    """
    rank = dist.get_rank()
    tmp = path.with_name(_TMP + path.name)
    if rank == 0:  # a save of this version killed in this run's lifetime cannot exist, but be sure
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    collectives.barrier()
    for (m, o), prefix in _parts(model, optimizer, critic):
        model_sd, optim_sd = get_state_dict(m, o, options=_options(prefix, lora))
        dcp.save(model_sd, checkpoint_id=tmp / f"{prefix}model")
        dcp.save(optim_sd, checkpoint_id=tmp / f"{prefix}optim")
    _write_durable(tmp / "rng" / f"rank_{rank}.pt", lambda f: torch.save(_rng_state(), f))
    collectives.barrier()
    if rank == 0:
        _copy_hf_files(Path(model_path), tmp / "hf")
        if critic is not None:
            config = critic[0].config.to_json_string()
            _write_durable(tmp / "critic_hf" / "config.json", lambda f: f.write(config.encode()))
        doc = {**asdict(state), **({_LORA: asdict(AdapterRecord.of(lora, model_path))} if lora is not None else {})}
        _write_durable(tmp / _STATE, lambda f: f.write(json.dumps(doc, indent=1).encode()))
        _fsync_tree(tmp)
        _commit(tmp, path)
        for old in lineage(path)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    collectives.barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         critic: tuple[nn.Module, torch.optim.Optimizer] | None = None, lora: LoraConfig | None = None,
         model_path: str | Path | None = None) -> TrainingState:
    """Restore model, optimizer (and the critic's), and this rank's RNG from checkpoint
    ``path`` (collective), whatever number of ranks saved it: DCP reshards the states; a rank
    the saving run did not have keeps its seeded RNG, and the RNG files of ranks this run does
    not have are not read. A checkpoint saved without a critic cannot resume a run with one.
    Nothing in it is unpickled but data (:mod:`async_rl.learner.safe_load`).

    ``lora`` is the run's adapter (None: full fine-tuning) on the base at ``model_path``
    (required with ``lora``): the adapter and its optimizer state are loaded onto the base
    already in ``model``. Raises :class:`CheckpointMismatchError` on every rank, before
    anything is read, when the checkpoint's mode, LoRA hyperparameters or base differ."""
    if critic is not None and not (path / "critic_model").is_dir():
        raise FileNotFoundError(f"{path} holds no critic (saved without algorithm.advantage.name=gae): resume with trainer.resume=off "
                                "or point trainer.resume at a checkpoint of a run with a critic")
    if lora is None:
        run = None
    elif model_path is None:
        raise TypeError("checkpoint.load: model_path (the run's learner.model_path) is required with lora")
    else:
        run = AdapterRecord.of(lora, model_path)
    problems = _mismatches(path, saved_adapter(path), run)
    if problems:
        raise CheckpointMismatchError(f"cannot resume {path}:\n  " + "\n  ".join(problems))
    for (m, o), prefix in _parts(model, optimizer, critic):
        options = _options(prefix, lora)
        model_sd, optim_sd = get_state_dict(m, o, options=options)
        dcp_load(model_sd, path / f"{prefix}model")
        dcp_load(optim_sd, path / f"{prefix}optim")
        set_state_dict(m, o, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than saved: the seed stays as set
        _set_rng_state(tensors_load(rng_file))
    doc = json.loads((path / _STATE).read_text())
    doc.pop(_LORA, None)  # checked above: the run's own section
    return TrainingState(**doc)


def _parts(model: nn.Module, optimizer: torch.optim.Optimizer, critic: tuple[nn.Module, torch.optim.Optimizer] | None
           ) -> list[tuple[tuple[nn.Module, torch.optim.Optimizer], str]]:
    """The (model, optimizer) pairs a checkpoint holds, with their directories' prefixes."""
    return [((model, optimizer), ""), *(((critic, "critic_"),) if critic is not None else ())]


def _options(prefix: str, lora: LoraConfig | None) -> StateDictOptions | None:
    """DCP's options for the part ``prefix``: the policy of a LoRA run saves and loads its
    adapter alone; the critic (always fully fine-tuned) and a full policy, everything."""
    return _ADAPTER_ONLY if lora is not None and prefix == "" else None


def _mismatches(path: Path, saved: AdapterRecord | None, run: AdapterRecord | None) -> list[str]:
    """Why checkpoint ``path`` (its adapter ``saved``; None: full weights) cannot resume a run
    whose adapter is ``run`` (None: full fine-tuning): one line per key, with the fix; empty if it can."""
    if saved is None and run is None:
        return []
    if saved is None:
        return [f"{LORA_KEY}: {path} holds fully fine-tuned weights (saved without {LORA_KEY}) and this run trains a LoRA adapter: "
                f"resume it without {LORA_KEY} ({LORA_KEY}=null), or export it (async-rl export {path} --out DIR) and start a new run "
                f"with learner.model_path=DIR and {LORA_KEY}"]
    if run is None:
        return [f"{LORA_KEY}: {path} holds only a LoRA adapter ({saved.section()}) on {saved.base_model_path}, and this run sets no "
                f"{LORA_KEY}: resume it with that {LORA_KEY} section, or export it merged (async-rl export {path} --out DIR --merged) "
                "and start a new full run with learner.model_path=DIR"]
    problems = []
    was, now = asdict(saved.lora()), asdict(run.lora())
    was["target_modules"], now["target_modules"] = sorted(was["target_modules"]), sorted(now["target_modules"])  # PEFT ignores the order
    for key in was:
        if was[key] != now[key]:
            problems.append(f"{LORA_KEY}.{key}={now[key]} but the checkpoint's adapter was trained with {LORA_KEY}.{key}={was[key]}: set "
                            "it back to resume this checkpoint, or start a new line from the base model (trainer.resume=off)")
    if run.base_fingerprint != saved.base_fingerprint:
        problems.append(f"learner.model_path={run.base_model_path} is not the base model the checkpoint's adapter was trained on "
                        f"({saved.base_model_path}, fingerprint {saved.base_fingerprint[:12]}; this one {run.base_fingerprint[:12]}): "
                        "set learner.model_path to that base model")
    return problems


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


def export_hf(checkpoint: str | Path, out_dir: str | Path, critic: bool = False, merged: bool = False) -> Path:
    """Write checkpoint ``checkpoint``'s policy (or with ``critic``, its value model, as a
    ``*ForTokenClassification`` with one label) as a Hugging Face directory (safetensors,
    config, tokenizer) that ``transformers`` (and, for the policy, vLLM) load. Runs in one
    process, no GPU needed.

    A LoRA checkpoint's policy becomes a PEFT adapter directory (``adapter_config.json``
    naming the base, ``adapter_model.safetensors`` in PEFT's names), or with ``merged`` its
    base model with the adapter merged into the weights, written as a full policy is. Raises
    :class:`CheckpointMismatchError` for ``merged`` without an adapter to merge."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    from async_rl.learner.vision import is_vision_language

    src, out = Path(checkpoint), Path(out_dir)
    if not (src / _STATE).is_file():
        raise FileNotFoundError(f"{src} is not a complete checkpoint (no {_STATE})")
    if critic and not (src / "critic_hf").is_dir():
        raise FileNotFoundError(f"{src} holds no critic (the run did not use algorithm.advantage.name=gae)")
    adapter = saved_adapter(src)
    if merged and (critic or adapter is None):
        what = "the critic is fully fine-tuned" if critic else f"{src} holds fully fine-tuned weights (saved without {LORA_KEY})"
        raise CheckpointMismatchError(f"--merged merges a LoRA checkpoint's adapter into its base, and {what}: export it without --merged")
    if adapter is not None and not critic:
        return _export_merged(src, adapter, out) if merged else _export_adapter(src, adapter, out)
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


def _export_adapter(src: Path, adapter: AdapterRecord, out: Path) -> Path:
    """Write LoRA checkpoint ``src``'s adapter as a PEFT directory in ``out``: the float32
    ``[r, in]`` A and ``[out, r]`` B under :func:`~async_rl.learner.lora.wire_name`, read
    into shapes taken from the base's config on the meta device (no base weight is loaded)."""
    import safetensors.torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src / "hf"))
        skeleton.add_adapter(peft_config(adapter.lora()))
    state = {name: torch.empty(param.shape, dtype=torch.float32) for name, param in adapter_named_parameters(skeleton)}
    dcp_load(state, src / "model", no_dist=True)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({wire_name(name): tensor for name, tensor in state.items()}, out / "adapter_model.safetensors",
                                metadata={"format": "pt"})
    config = peft_config(adapter.lora())
    config.base_model_name_or_path = adapter.base_model_path
    config.inference_mode = True  # as PEFT saves its own adapters
    config.save_pretrained(str(out))
    return out


def _export_merged(src: Path, adapter: AdapterRecord, out: Path) -> Path:
    """Write LoRA checkpoint ``src``'s policy with its adapter merged into the base
    (``W + (alpha / r) B A``, PEFT's ``merge_and_unload``) in ``out``, as a full export: the
    base is read from where the checkpoint recorded it, and must still be the same model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = Path(adapter.base_model_path)
    if not (base_path / "config.json").is_file():
        raise FileNotFoundError(f"--merged needs the base model the adapter was trained on, and {base_path} (recorded by {src}) holds "
                                "none: put it back there, or export the adapter without --merged")
    if base_fingerprint(base_path) != adapter.base_fingerprint:
        raise CheckpointMismatchError(f"--merged: {base_path} is no longer the base model the adapter of {src} was trained on (its "
                                      "config or weight files changed): put that model back there, or export the adapter without --merged")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="async-rl-adapter-") as tmp:
        model = PeftModel.from_pretrained(base, _export_adapter(src, adapter, Path(tmp))).merge_and_unload()
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
