"""Loading a user's object from ``path/to/file.py:name`` (reward functions, environments)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def load_from_file(spec: str, key: str, what: str) -> Any:
    """The attribute ``name`` of the Python file ``path`` in ``spec = "path:name"``.

    ``key`` (e.g. ``rollout.reward.function``) and ``what`` (e.g. ``reward``) only word the
    errors: ``FileNotFoundError`` for a missing file, ``ImportError`` for one that is not a
    module, ``AttributeError`` for a missing name. The file's own import errors propagate.
    """
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise ValueError(f"{key}={spec!r} is not of the form path/to/file.py:name")
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {file!r} (from {key}={spec!r}) not found")
    module_spec = importlib.util.spec_from_file_location(f"async_rl_user_{what}_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {file!r} (from {key}={spec!r}) as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"{file} has no {name!r} (from {key}={spec!r})")
    return getattr(module, name)
