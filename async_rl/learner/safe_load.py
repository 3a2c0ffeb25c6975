"""Reading checkpoints without running code from them.

A checkpoint directory may hold only data: DCP shards (tensors, and plain values such as
the optimizer's hyperparameters, each read by ``torch.load(weights_only=True)``), each DCP
directory's ``.metadata`` (a pickle of DCP's own metadata classes), ``rng/rank_{r}.pt``
(tensors and the tuple of ints of Python's ``random`` state, ``weights_only`` too) and
JSON/tokenizer files. torch reads ``.metadata`` with plain ``pickle.load`` and a DCP
shard's non-tensor values with ``weights_only=False``: a crafted checkpoint would run
arbitrary code at resume or export. :func:`dcp_load` reads both through allowlists instead;
anything else is :class:`CheckpointContentError`, raised before any of it runs.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a tensor layout by name (torch.strided)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, as dcp.save was given it
    ("pathlib._local", "PosixPath"),  # the same, pickled by Python >= 3.13
})
"""What ``pickle`` may resolve in a DCP ``.metadata`` besides ``torch.<dtype>``: every global
that torch's ``FileSystemWriter`` pickles for our model and optimizer state (recorded from
real checkpoints, sharded and not)."""


class CheckpointContentError(pickle.UnpicklingError):
    """A checkpoint file holds something a checkpoint may not (refused before it ran)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``, resolving only :data:`_METADATA_GLOBALS` and dtypes."""

    def __init__(self, file: IO[bytes], path: os.PathLike | str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointContentError(f"{self._path}: refusing to load {module}.{name}: a checkpoint's DCP metadata holds "
                                     "only DCP's metadata classes (the file was not written by torch.distributed.checkpoint)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(cast(IO[bytes], f), path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointContentError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        for info in (metadata.storage_data or {}).values():
            # DCP writes its data files beside the metadata (``__0_0.distcp``); any other path reads a file elsewhere
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
                raise CheckpointContentError(f"{path}: names the data file {name!r}, not a file of the checkpoint's directory")
        if metadata.storage_meta is None:  # as FileSystemReader: checkpoints of torch < 2.4 have none
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with non-tensor values read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointContentError(f"the value of {read_item.dest_index.fqn}: {exc}") from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state_dict: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``dcp.load(state_dict, checkpoint_id=path, no_dist=no_dist)`` through the allowlists
    (collective unless ``no_dist``). Anything refused raises :class:`CheckpointContentError` on
    every rank (a refused ``.metadata`` before the first collective)."""
    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # inside dcp.load a refusal would come out as a bare AssertionError
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:  # DCP gathers every rank's failures into one
        refused = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointContentError)]
        if refused:
            raise CheckpointContentError(f"{path}: {refused[0]}") from exc
        raise


def tensors_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain Python values only."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointContentError(f"{path}: {exc}") from exc
