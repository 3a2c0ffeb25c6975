"""Reading the sections' fields: their types (as loading and the reference need them) and
their docstrings (the string literal after each field)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any, Literal, Union


def type_name(tp: Any) -> str:
    """Readable name of a field type: ``int | null``, ``'skip' | 'truncate'``, ``list[float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"mapping of name to {args[1].__name__}" if is_dataclass_type(args[1]) else "mapping"
    if is_dataclass_type(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def section_type(tp: Any) -> type | None:
    """The section (dataclass) a field of type ``tp`` holds: ``tp`` itself, or ``X`` for an
    optional section ``Optional[X]`` (null: the section is off); None for a value."""
    if is_dataclass_type(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        sections = [a for a in typing.get_args(tp) if is_dataclass_type(a)]
        return sections[0] if sections else None
    return None


def named_sections(tp: Any) -> type | None:
    """The section a field of type ``tp`` holds one of per name (``dict[str, X]``, e.g.
    ``models``: ``X``); None for any other type."""
    if typing.get_origin(tp) is dict:
        value = typing.get_args(tp)[1]
        return value if is_dataclass_type(value) else None
    return None


def field_docs(cls: type) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls`` (the string literal after the field),
    inherited fields included (``LossConfig`` adds ``name`` to the options of ``algos.options``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = nxt.value.value
    return docs
