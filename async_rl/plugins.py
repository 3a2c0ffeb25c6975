"""Named plugins: the one registry of reward functions, environments and algorithms, and
loading a user's object from ``path/to/file.py:name``.

The lowest layer of the project: it imports nothing of async_rl, so every package may use it.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

T = TypeVar("T")

FILE_FORM = "path/to/file.py:name"
"""How a spec names a user's object instead of a built-in."""


class Registry(Generic[T]):
    """Entries of one kind by name: the built-ins register with :meth:`register`, a user's
    own object is named by :data:`FILE_FORM` (:meth:`resolve`).

    ``kind`` (e.g. "reward function") words the errors; ``key`` (e.g.
    ``rollout.reward.function``) is the config key that :meth:`resolve` reads, named in its
    errors. ``accepts`` checks an object loaded from a file (``expected`` says what it must
    be, e.g. "a function"); built-ins are trusted.
    """

    def __init__(
        self,
        kind: str,
        *,
        key: str | None = None,
        accepts: Callable[[Any], bool] | None = None,
        expected: str = "",
    ) -> None:
        self.kind = kind
        self.key = key or kind
        self._accepts = accepts
        self._expected = expected
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        """Register ``entry`` under ``name``; a name can be registered once."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add` that returns the decorated object unchanged."""

        def decorator(entry: T) -> T:
            self.add(name, entry)
            return entry

        return decorator

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry registered as ``name``; ``ValueError`` with the closest name and every valid one otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}{self._did_you_mean(name)}; valid names: {self._listing()}") from None

    def resolve(self, spec: str) -> T:
        """A built-in by name, or the object ``name`` of the Python file in ``spec = "path/to/file.py:name"``.

        Errors name :attr:`key`: ``ValueError`` for an unknown built-in (with the closest
        name), a missing attribute or an object ``accepts`` rejects; ``FileNotFoundError`` and
        ``ImportError`` as :func:`load_from_file`. The file's own import errors propagate.
        """
        if spec in self._entries:
            return self._entries[spec]
        if ":" not in spec:
            raise ValueError(
                f"unknown {self.kind} {spec!r}{self._did_you_mean(spec)} (from {self.key}); "
                f"use a built-in ({self._listing()}) or {FILE_FORM}"
            )
        try:
            entry = load_from_file(spec, self.key, self.kind)
        except AttributeError as exc:
            raise ValueError(str(exc)) from None
        if self._accepts is not None and not self._accepts(entry):
            raise ValueError(f"{self.key}={spec!r} is not {self._expected}")
        return entry

    def _did_you_mean(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._entries), n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def _listing(self) -> str:
        return ", ".join(self.names()) or "none yet"


def load_from_file(spec: str, key: str, what: str) -> Any:
    """The attribute ``name`` of the Python file ``path`` in ``spec = "path:name"``.

    ``key`` (e.g. ``rollout.reward.function``) and ``what`` (e.g. ``reward function``) only
    word the errors: ``FileNotFoundError`` for a missing file, ``ImportError`` for one that is
    not a module, ``AttributeError`` for a missing name. The file's own import errors propagate.
    """
    return load_from_module(spec, key, what, _load_module)


def load_from_module(spec: str, key: str, what: str, load: Callable[[Path, str, str], ModuleType]) -> Any:
    """:func:`load_from_file` with the module loaded by ``load(path, module_name, where)``
    (e.g. a cached :func:`load_module`, so that every name of one file comes from one module)."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise ValueError(f"{key}={spec!r} is not of the form {FILE_FORM}")
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {file!r} (from {key}={spec!r}) not found")
    module = load(path, f"async_rl_user_{what.replace(' ', '_')}_{path.stem}", f"{key}={spec!r}")
    if not hasattr(module, name):
        raise AttributeError(f"{file} has no {name!r} (from {key}={spec!r})")
    return getattr(module, name)


def _load_module(path: Path, module_name: str, where: str) -> ModuleType:
    """A new module object of the Python file ``path`` (``where`` words the error)."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {str(path)!r} (from {where}) as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def load_module(path: Path, module_name: str, where: str) -> ModuleType:
    """The module of the Python file ``path``, loaded once per process and file (whatever
    ``module_name`` and ``where`` a later caller gives)."""
    resolved = path.resolve()
    if resolved not in _LOADED:
        _LOADED[resolved] = _load_module(resolved, module_name, where)
    return _LOADED[resolved]


_LOADED: dict[Path, ModuleType] = {}
"""The modules :func:`load_module` loaded, by resolved path."""


Frame = tuple[str, int, str]
"""``(filename, line, function name)`` of one stack frame."""

_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep
_STDLIB_DIRS = tuple({str(Path(p).resolve()) + os.sep for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))})
_INSTALLED_DIRS = tuple({str(Path(p).resolve()) + os.sep for k in ("purelib", "platlib") if (p := sysconfig.get_paths().get(k))})


def _resolved(filename: str) -> str:
    return filename if filename.startswith("<") else str(Path(filename).resolve())


def _library(filename: str) -> bool:
    return filename.startswith("<") or _resolved(filename).startswith(_STDLIB_DIRS)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's own code: not the standard library, an installed
    package or async_rl (nor ``<string>``-like pseudo files)."""
    return not _library(filename) and not _resolved(filename).startswith(_INSTALLED_DIRS + (_PACKAGE_DIR,))


def where_in_user_code(frames: Iterable[Frame]) -> str:
    """``path/file.py:LINE in name`` of the innermost of ``frames`` (outermost first) in the
    user's own code (:func:`is_user_file`); failing that (a built-in plugin), the innermost
    outside the standard library; else the innermost; "" for no frame. The one rule for
    where a reward function or environment failed."""
    frames = list(frames)
    for own in (is_user_file, lambda f: not _library(f), lambda f: True):
        for filename, line, name in reversed(frames):
            if own(filename):
                return f"{filename}:{line} in {name}"
    return ""
