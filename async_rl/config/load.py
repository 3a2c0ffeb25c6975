"""Loading: a YAML file and ``key=value`` overrides merged over the defaults, converted into the
sections strictly (an unknown key names the closest valid one; a wrong type names the key,
the value and the expected type), then validated (:mod:`async_rl.config.rules`)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from async_rl.config.fields import field_types, is_dataclass_type, named_sections, section_type, type_name
from async_rl.config.render import REDACTED, SECRET_KEYS, to_dict
from async_rl.config.rules import ConfigError, validate
from async_rl.config.sections import OPENAI_API_KEY_ENV, Config

#: String fields whose documented words YAML reads as booleans (``resume: off``).
_BOOL_WORDS = {"trainer.resume": {False: "off", True: "auto"}, "learner.fsdp.gradient_checkpointing": {False: "off", True: "on"},
               "learner.kernels.liger": {False: "off", True: "on"}}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated :class:`Config` from a YAML file and ``key=value`` overrides.

    Overrides use dotted keys (``learner.optim.lr=1e-6``); values are parsed as YAML.
    ``${a.b}`` interpolations are resolved. Raises :class:`ConfigError`.
    """
    raw = _read_yaml(path) if path is not None else {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learner.optim.lr=1e-6)")
        _check_path(key.strip())
    try:
        merged = OmegaConf.merge(OmegaConf.create(to_dict(Config())), OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides)))
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge or resolve the config: {exc}") from None
    except yaml.YAMLError as exc:  # an override's value OmegaConf reads as YAML, e.g. a template's {{ }}
        raise ConfigError(f"an override's value is not valid YAML ({' '.join(str(exc).split())}): quote it, "
                          "e.g. 'rollout.reward.judge.template=\"{{ response }}?\"'") from None
    cfg = from_dict(Config, resolved)
    if env_key := os.environ.get(OPENAI_API_KEY_ENV):
        cfg.rollout.openai_api_key = env_key
    validate(cfg)
    return cfg


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _check_path(dotted: str) -> None:
    """Raise ConfigError if ``dotted`` does not name a field (or a key under a dict field).
    An optional section (``learner.lora``) may be set whole (``learner.lora=null``), or by
    one of its keys, which creates it with its defaults."""
    cls: Any = Config
    parts = dotted.split(".")
    i = 0
    while i < len(parts):
        part = parts[i]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            _unknown_key(".".join(parts[:i]), part, list(fields))
        ftype = field_types(cls)[part]
        if (entry := named_sections(ftype)) is not None and i + 2 < len(parts):  # models.NAME.key: into the section
            cls, i = entry, i + 2
            continue
        if typing.get_origin(ftype) is dict:  # free-form mapping (or a named section set whole): any key below it
            return
        section = section_type(ftype)
        if section is None:
            if i != len(parts) - 1:
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section: cannot set {dotted}")
            return
        if i == len(parts) - 1 and section is not ftype:
            return  # an optional section as a whole: null, or a mapping of its keys
        cls = section
        i += 1
    raise ConfigError(f"{dotted} is a section; set one of its keys, e.g. {dotted}.{dataclasses.fields(cls)[0].name}=...")


def _unknown_key(prefix: str, key: str, valid: list[str]) -> typing.NoReturn:
    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix + '.' if prefix else ''}{close[0]}? " if close else ""
    where = f"section {prefix}" if prefix else "the top level"
    raise ConfigError(f"unknown config key {full}: {hint}valid keys of {where}: {', '.join(valid)}")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Convert a nested mapping into dataclass ``cls``, strictly (see module docstring)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping (a section), got {data!r}")
    types_ = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in types_:
            _unknown_key(prefix, str(key), names)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(types_[name], value, key)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if is_dataclass_type(tp):
        return from_dict(tp, value, key)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and key in _BOOL_WORDS:
            value = _BOOL_WORDS[key][value]
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not allowed{hint}; expected one of {', '.join(map(repr, choices))}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _wrong_type(key, value, "mapping with string keys")
        if (entry := named_sections(tp)) is not None:  # models: NAME -> section
            return {name: from_dict(entry, item, f"{key}.{name}") for name, item in value.items()}
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _wrong_type(key, value, type_name(tp))
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            _wrong_type(key, value, "bool (true or false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _wrong_type(key, value, "int")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                value = float(value)
            except ValueError:
                _wrong_type(key, value, "float")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _wrong_type(key, value, "float")
        return float(value)
    if tp is str:
        if isinstance(value, bool) and key in _BOOL_WORDS:
            return _BOOL_WORDS[key][value]
        if isinstance(value, bool):  # YAML 1.1 reads off/on/yes/no as booleans
            _wrong_type(key, value, f"str (quote it if you meant the word, e.g. {key}='off')")
        if not isinstance(value, str):
            _wrong_type(key, value, "str")
        return value
    raise TypeError(f"config field {key} has an unsupported type {tp!r}")  # a bug in this module


def _wrong_type(key: str, value: Any, expected: str) -> typing.NoReturn:
    shown = REDACTED if key in SECRET_KEYS else repr(value)  # an all-digit key reads as an int: never echo it
    raise ConfigError(f"{key}={shown} has type {type(value).__name__}, expected {expected}")
