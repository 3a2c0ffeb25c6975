"""Typed configuration: dataclasses, YAML files, dotlist overrides and strict validation.

Every section is a dataclass whose fields carry a default and a docstring (the string
literal right after the field; ``async-rl config docs`` renders them). Loading is strict:

* an unknown key fails and names the full key and the closest valid one;
* a value of the wrong type names the key, the value and the expected type;
* a number outside the range declared beside its field (:mod:`async_rl.bounds`) names the
  key, the value and the range; cross-field rules (``validate``) name every key involved.

All three raise :class:`ConfigError`; the CLI turns it into exit code 2.

Usage::

    cfg = load_config("configs/quickstart.yaml", ["learner.optim.lr=1e-6"])
    print(to_yaml(cfg))

Of async_rl, this package depends only on :mod:`async_rl.algos.options` (the algorithms' names,
needs and loss options) and :mod:`async_rl.bounds` (the ranges; docs/architecture.md:
dependencies point one way).

The package: :mod:`~async_rl.config.sections` (the dataclasses), :mod:`~async_rl.config.load`
(YAML and overrides into sections), :mod:`~async_rl.config.rules` (validation),
:mod:`~async_rl.config.render` (YAML, redaction, the reference), :mod:`~async_rl.config.fields`
(field types and docstrings). Import from here: ``from async_rl.config import load_config``.
"""

from __future__ import annotations

from async_rl.config.sections import (
    AdvantageConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    DistillConfig,
    EnvConfig,
    FsdpConfig,
    JUDGE_TEMPLATE,
    JudgeConfig,
    KLControlConfig,
    KernelsConfig,
    LOOPBACK_NAMES,
    MODEL_NAME_PATTERN,
    LORA_KEY,
    LORA_MAX_RANK,
    LORA_TARGETS,
    LORA_UNSERVABLE,
    LearnerConfig,
    LoggingConfig,
    LoraConfig,
    LossConfig,
    MIN_API_KEY_LENGTH,
    OPENAI_API_KEY_ENV,
    OptimConfig,
    OverlongPenaltyConfig,
    QueueConfig,
    RayConfig,
    ServedModelConfig,
    RewardConfig,
    RolloutConfig,
    SyncConfig,
    TrainerConfig,
    VLLM_LORA_RANKS,
    VllmConfig,
    WandbConfig,
)
from async_rl.config.fields import (
    field_docs,
)
from async_rl.config.rules import (
    ConfigError,
    is_loopback,
    validate,
)
from async_rl.config.load import (
    from_dict,
    load_config,
)
from async_rl.config.render import (
    REDACTED,
    SECRET_KEYS,
    SECRET_URL_KEYS,
    redact_url,
    reference_markdown,
    save_resolved,
    shareable,
    to_dict,
    to_yaml,
)

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "EnvConfig",
    "FsdpConfig",
    "JUDGE_TEMPLATE",
    "JudgeConfig",
    "KLControlConfig",
    "KernelsConfig",
    "LOOPBACK_NAMES",
    "MODEL_NAME_PATTERN",
    "LORA_KEY",
    "LORA_MAX_RANK",
    "LORA_TARGETS",
    "LORA_UNSERVABLE",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "MIN_API_KEY_LENGTH",
    "OPENAI_API_KEY_ENV",
    "OptimConfig",
    "OverlongPenaltyConfig",
    "QueueConfig",
    "REDACTED",
    "RayConfig",
    "ServedModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "SECRET_KEYS",
    "SECRET_URL_KEYS",
    "SyncConfig",
    "TrainerConfig",
    "VLLM_LORA_RANKS",
    "VllmConfig",
    "WandbConfig",
    "field_docs",
    "from_dict",
    "is_loopback",
    "load_config",
    "redact_url",
    "reference_markdown",
    "save_resolved",
    "shareable",
    "to_dict",
    "to_yaml",
    "validate",
]
