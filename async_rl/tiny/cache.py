"""Tiny assets built once per content of their builder and reused: a cache directory of
builds keyed by a hash of ``async_rl/tiny/*.py``, the task, the seed and the library versions
the weights depend on. The tests and benchmarks share it across sessions; editing any
builder file (or upgrading torch or transformers) makes a new key, so a stale build is never
reused.

    <cache>/<task>-seed<seed>-<key>/     one build (the layout of :mod:`async_rl.tiny.build`)

``<cache>`` is ``$ASYNC_RL_TINY_CACHE`` or ``~/.cache/async-rl/tiny``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
import transformers

from async_rl.tiny.build import TinyAssetsReport

CACHE_ENV = "ASYNC_RL_TINY_CACHE"
"""The environment variable that moves the cache (default ``~/.cache/async-rl/tiny``)."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "async-rl" / "tiny")


def cache_key(task: str, seed: int) -> str:
    """``<task>-seed<seed>-<16 hex digits>``: the hash of every builder source file (names and
    bytes), torch's and transformers' versions, the task and the seed."""
    digest = hashlib.sha256(f"{task}\0{seed}\0{torch.__version__}\0{transformers.__version__}".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{task}-seed{seed}-{digest.hexdigest()[:16]}"


def read_report(out_dir: Path) -> TinyAssetsReport:
    """The report of the build in ``out_dir``, read back from its manifest (``assets.json``)."""
    manifest = json.loads((out_dir / "assets.json").read_text(encoding="utf-8"))
    paths = {f.name for f in fields(TinyAssetsReport) if f.type in ("Path", Path)}
    values = {f.name: manifest[f.name] for f in fields(TinyAssetsReport) if f.name in manifest}
    values.update({name: out_dir / values[name] for name in paths & values.keys()})
    return TinyAssetsReport(**values, out_dir=out_dir, manifest_path=out_dir / "assets.json")


def cached_tiny_assets(task: str, seed: int, build: Callable[[Path], TinyAssetsReport],
                       root: Path | None = None) -> TinyAssetsReport:
    """The cached build of ``task`` with ``seed``, made with ``build(directory)`` when the cache
    has none. A build is written beside its final name and renamed into place, so an
    interrupted one is never read. Concurrent callers (pytest-xdist workers) build once: the
    others wait on the key's lock file and read that build."""
    root = root or cache_root()
    final = root / cache_key(task, seed)
    if not (final / "assets.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{final.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a killed holder
            if not (final / "assets.json").is_file():
                partial = root / f".{final.name}.{os.getpid()}"
                shutil.rmtree(partial, ignore_errors=True)
                build(partial)
                partial.rename(final)
    return read_report(final)
