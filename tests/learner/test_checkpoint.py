"""Checkpoints are atomic and form lines: real torch DCP shards of a tiny model, and a save
SIGKILLed in a subprocess, midway."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import signal
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from learner_helpers import SPAWN, learner_config, save_killed_main

from async_rl.learner import checkpoint
from async_rl.learner.model import DistInfo, free_port, load_sharded
from async_rl.learner.safe_load import CheckpointContentError, dcp_load
from async_rl.learner.train_step import Trainer


@pytest.fixture
def trainer(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> Trainer:
    cfg = learner_config(tiny_model, tmp_path, "ckpt")
    return Trainer(load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True), None, cfg.learner, cfg.algorithm,
                   one_rank, 4, 1)


def _save(trainer: Trainer, tiny_model: Path, out: Path, version: int, parent: int | None, line: int, keep: int = 5) -> Path:
    """Save ``step_{version}`` of line ``line`` (recorded in its counters) continuing from ``step_{parent}``."""
    path = checkpoint.checkpoint_dir(out, version)
    state = checkpoint.TrainingState(version, trainer.scheduler.state_dict(), counters={"line": line},
                                     parent=None if parent is None else checkpoint.checkpoint_dir(out, parent).name)
    checkpoint.save(path, trainer.policy, trainer.optimizer, state, tiny_model, keep)
    return path


def _line(path: Path) -> int:
    return json.loads((path / "state.json").read_text())["counters"]["line"]


def _names(out: Path) -> list[str]:
    return [p.name.removeprefix("step_0000000") for p in checkpoint.list_checkpoints(out)]


@pytest.mark.dist
def test_auto_follows_the_line_and_retention_keeps_other_lines(trainer: Trainer, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert checkpoint.start("auto", out) == checkpoint.StartPoint(None, [])
    for version in (1, 2, 3, 4):  # line 1
        _save(trainer, tiny_model, out, version, version - 1 if version > 1 else None, line=1)
    assert checkpoint.start("auto", out).path == checkpoint.checkpoint_dir(out, 4)

    # An explicit resume from step 1 starts line 2: auto continues it, before its first save too.
    step_1 = checkpoint.checkpoint_dir(out, 1)
    assert checkpoint.start(str(step_1), out).path == step_1
    assert checkpoint.start("auto", out).path == step_1
    _save(trainer, tiny_model, out, 2, 1, line=2, keep=2)  # replaces line 1's step 2
    assert checkpoint.start("auto", out).path == checkpoint.checkpoint_dir(out, 2)
    assert _names(out) == ["1", "2", "3", "4"] and _line(checkpoint.checkpoint_dir(out, 2)) == 2
    _save(trainer, tiny_model, out, 3, 2, line=2, keep=2)  # line 2 keeps 3 and 2; line 1's step 4 stays
    assert _names(out) == ["2", "3", "4"] and [_line(p) for p in checkpoint.list_checkpoints(out)] == [2, 2, 1]
    assert checkpoint.start("auto", out).path == checkpoint.checkpoint_dir(out, 3)
    assert checkpoint.lineage(checkpoint.checkpoint_dir(out, 3)) == [checkpoint.checkpoint_dir(out, v) for v in (3, 2)]

    # resume=off starts a line from the base model: auto then starts from it too, until it saves.
    assert checkpoint.start("off", out).path is None and checkpoint.start("auto", out).path is None
    state = checkpoint.load(_save(trainer, tiny_model, out, 1, None, line=3), trainer.policy, trainer.optimizer)
    assert (state.version, state.parent, state.run_id) == (1, None, None)
    assert checkpoint.start("auto", out).path == checkpoint.checkpoint_dir(out, 1)


@pytest.mark.dist
def test_legacy_checkpoints_without_parents_are_one_line_in_step_order(trainer: Trainer, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    for version in (1, 2, 3):
        path = _save(trainer, tiny_model, out, version, None, line=0)
        doc = json.loads((path / "state.json").read_text())
        del doc["parent"], doc["run_id"]  # as written before lines existed
        (path / "state.json").write_text(json.dumps(doc))
    (out / "checkpoints" / "head.json").unlink()
    assert checkpoint.start("auto", out).path == checkpoint.checkpoint_dir(out, 3)
    assert checkpoint.load(checkpoint.checkpoint_dir(out, 3), trainer.policy, trainer.optimizer).parent is None
    _save(trainer, tiny_model, out, 4, 3, line=1, keep=2)
    assert _names(out) == ["3", "4"]  # the legacy ancestors beyond keep=2 were the line's


@pytest.mark.dist
def test_a_save_killed_between_its_renames_is_rolled_back_at_the_next_start(trainer: Trainer, tiny_model: Path, tmp_path: Path) -> None:
    """What a kill between moving the old checkpoint aside and renaming the new one into place
    leaves, built from real saves: the next start puts the old one back and removes the new."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    _save(trainer, tiny_model, out, 1, None, line=1)
    _save(trainer, tiny_model, out, 2, 1, line=1)
    os.replace(root / "step_00000002", root / ".old-step_00000002")
    new = _save(trainer, tiny_model, out / "elsewhere", 2, 1, line=2)
    os.replace(new, root / ".tmp-step_00000002")
    swept = checkpoint.start("auto", out).swept
    assert swept == [f"removed {root / '.tmp-step_00000002'}: a checkpoint save that did not complete",
                     f"restored {root / 'step_00000002'} from .old-step_00000002: the save that was replacing it did not complete"]
    assert sorted(p.name for p in root.iterdir()) == ["head.json", "step_00000001", "step_00000002"]
    assert _line(root / "step_00000002") == 1


class _Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.mark.dist
def test_a_checkpoint_loads_its_weights_back_through_the_allowlists(trainer: Trainer, tiny_model: Path, tmp_path: Path) -> None:
    saved = {k: v.full_tensor().clone() for k, v in trainer.policy.state_dict().items()}
    path = _save(trainer, tiny_model, tmp_path / "run", 1, None, line=1)
    with torch.no_grad():
        for param in trainer.policy.parameters():
            param.add_(1.0)
    checkpoint.load(path, trainer.policy, trainer.optimizer)
    assert all(torch.equal(v.full_tensor(), saved[k]) for k, v in trainer.policy.state_dict().items())
    exported = safetensors.torch.load_file(checkpoint.export_hf(path, tmp_path / "hf") / "model.safetensors")
    assert torch.equal(exported["lm_head.weight"], saved["lm_head.weight"])


@pytest.mark.dist
def test_a_checkpoint_names_the_ranks_that_saved_it_and_a_load_on_another_count_says_what_changes(
        trainer: Trainer, tiny_model: Path, tmp_path: Path) -> None:
    path = _save(trainer, tiny_model, tmp_path, 1, None, 1)
    assert checkpoint.saved_world_size(path) == 1 and checkpoint.resharding_note(path, 1) is None
    note = checkpoint.resharding_note(path, 3)
    assert note is not None and note.startswith("resuming a checkpoint of 1 rank on 3: ")
    assert note.endswith("no RNG state was saved for ranks 1-2, seeded from trainer.seed instead")
    for rank in (1, 2, 3):  # as if 4 ranks had saved it; unreadable: a load on 1 rank must not read them
        (path / "rng" / f"rank_{rank}.pt").write_bytes(b"not a torch file")
    assert checkpoint.saved_world_size(path) == 4
    note = checkpoint.resharding_note(path, 2)
    assert note is not None and note.startswith("resuming a checkpoint of 4 ranks on 2: ")
    assert note.endswith("the RNG states saved by ranks 2-3 are not used (no such rank in this run)")
    checkpoint.load(path, trainer.policy, trainer.optimizer)  # rank 0 of 1 reads rank_0.pt, nothing else


@pytest.mark.dist
@pytest.mark.parametrize("where", ["metadata", "rng"])
def test_a_checkpoint_file_that_would_run_code_is_refused_and_nothing_runs(trainer: Trainer, tiny_model: Path, tmp_path: Path,
                                                                          where: str) -> None:
    """A pickle whose unpickling runs ``os.system`` (checked: plain pickle does run it) put in
    a real checkpoint as the policy's DCP ``.metadata`` (read at resume and export) or as
    rank 0's RNG state: refused, naming the file and the class, and the command never runs."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()
    marker.unlink()
    path = _save(trainer, tiny_model, tmp_path / "run", 1, None, line=1)
    if where == "metadata":
        target = path / "model" / ".metadata"
        target.write_bytes(pickle.dumps(_Payload(marker)))
    else:
        target = path / "rng" / "rank_0.pt"
        torch.save(_Payload(marker), target)
    with pytest.raises(CheckpointContentError, match="posix.system") as refused:
        checkpoint.load(path, trainer.policy, trainer.optimizer)
    assert str(target) in str(refused.value)
    if where == "metadata":
        with pytest.raises(CheckpointContentError, match="posix.system"):
            checkpoint.export_hf(path, tmp_path / "hf")
    assert not marker.exists()


@pytest.mark.dist
def test_a_dcp_value_or_metadata_that_is_not_data_is_refused(one_rank: DistInfo, tmp_path: Path) -> None:
    """DCP keeps a non-tensor value as a pickle in its shard (torch reads it back with
    weights_only=False) and a .metadata of the wrong type: both refused."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "evil": _Payload(marker)}, checkpoint_id=tmp_path / "dcp")
    with pytest.raises(CheckpointContentError, match=r"(?s)the value of evil: .*GLOBAL posix.system"):
        dcp_load({"w": torch.zeros(2), "evil": None}, tmp_path / "dcp")
    assert not marker.exists()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointContentError, match="holds a dict, not DCP metadata"):
        dcp_load({"w": torch.zeros(2)}, tmp_path / "dcp", no_dist=True)


def test_dcp_metadata_naming_a_data_file_outside_its_directory_is_refused(tmp_path: Path) -> None:
    """The metadata says which file holds each tensor; one that points elsewhere (``../``,
    an absolute path) would read a file of the attacker's choosing: refused before any read."""
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    metadata_file = tmp_path / "dcp" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    for elsewhere in ("../other/__0_0.distcp", "/etc/passwd"):
        for info in metadata.storage_data.values():
            info.relative_path = elsewhere
        metadata_file.write_bytes(pickle.dumps(metadata))
        with pytest.raises(CheckpointContentError, match="not a file of the checkpoint's directory"):
            dcp_load({"w": torch.zeros(2)}, tmp_path / "dcp", no_dist=True)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("kill_at", ["shards", "moved_aside"])
def test_a_sigkill_during_a_save_leaves_the_previous_checkpoint(trainer: Trainer, tiny_model: Path, tmp_path: Path, kill_at: str) -> None:
    """Line 1 has steps 1 and 2; a process resumes from step 1 (line 2) and is SIGKILLed while
    saving its step 2 over line 1's. The next start sweeps the debris, auto picks step 1 (the
    head of line 2), and line 1's step 2 is whole: its own state over its own shards."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    _save(trainer, tiny_model, out, 1, None, line=1)
    _save(trainer, tiny_model, out, 2, 1, line=1)
    ready = tmp_path / "ready"
    proc = SPAWN.Process(target=save_killed_main, args=(free_port(), str(tiny_model), str(out), kill_at, str(ready)), daemon=True)
    proc.start()
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert proc.is_alive() and time.monotonic() < deadline, f"the save did not reach {kill_at}"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    debris = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    assert debris == ([".tmp-step_00000002"] if kill_at == "shards" else [".old-step_00000002", ".tmp-step_00000002"])
    assert (root / ".tmp-step_00000002" / "state.json").is_file() == (kill_at == "moved_aside")  # complete, never committed
    assert any((root / ".tmp-step_00000002" / "model").iterdir())  # real shards were written

    start = checkpoint.start("auto", out)
    assert start.path == root / "step_00000001"
    assert [line.split(":")[0] for line in start.swept] == [f"removed {root / '.tmp-step_00000002'}"] + (
        [f"restored {root / 'step_00000002'} from .old-step_00000002"] if kill_at == "moved_aside" else [])
    assert sorted(p.name for p in root.iterdir()) == ["head.json", "step_00000001", "step_00000002"]
    assert checkpoint.start("auto", out).swept == []
    for version in (2, 1):  # every checkpoint left loads: state and shards of one save
        state = checkpoint.load(root / f"step_0000000{version}", trainer.policy, trainer.optimizer)
        assert (state.version, state.counters) == (version, {"line": 1})
