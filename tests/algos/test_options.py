"""algos/options.py: the names and metadata agree with what the modules register, the loss
options' defaults and ranges, and the module stays torch-free."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import typing
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from async_rl.algos import advantages, kl, losses
from async_rl.algos.options import (
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSSES,
    AdvantageName,
    LossName,
    LossOptions,
)


def test_every_registered_name_has_metadata_and_vice_versa() -> None:
    assert sorted(typing.get_args(AdvantageName)) == sorted(ESTIMATORS) == advantages.names()
    assert sorted(typing.get_args(LossName)) == sorted(LOSSES) == losses.names()
    assert sorted(KL_ESTIMATORS) == kl.names()


def test_estimator_options_are_the_keywords_of_its_function() -> None:
    import inspect

    for name, info in ESTIMATORS.items():
        function = getattr(advantages, name)
        keywords = [p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert keywords == [*(["values"] if info.critic else []), *info.options], name


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_group_metadata_is_whether_the_estimator_needs_groups(name: str) -> None:
    mask = torch.ones(3, 2)
    extra = {"values": torch.zeros(3, 2)} if ESTIMATORS[name].critic else {}
    if ESTIMATORS[name].group:
        with pytest.raises(ValueError, match="needs group_index"):
            advantages.compute(name, rewards=torch.zeros(3), response_mask=mask, **extra)
    else:
        advantages.compute(name, rewards=torch.zeros(3), response_mask=mask, **extra)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bypass_metadata_is_whether_the_loss_needs_old_logp(name: str) -> None:
    logp = torch.zeros(1, 2)
    common: dict[str, Any] = {"logp": logp, "behav_logp": logp, "advantages": logp, "mask": torch.ones(1, 2)}
    if LOSSES[name].bypass:
        losses.compute(name, old_logp=None, **common)
    else:
        with pytest.raises(ValueError, match="needs old_logp"):
            losses.compute(name, old_logp=None, **common)


def test_options_import_no_torch() -> None:
    code = "import sys, async_rl.algos.options, async_rl.config; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_loss_options_defaults_are_the_contract() -> None:
    defaults = {field.name: field.default for field in dataclasses.fields(LossOptions)}
    assert defaults == {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_c": None,
        "is_level": "none",
        "is_cap": 2.0,
        "mask_level": "none",
        "mask_lower": 0.5,
        "mask_upper": 2.0,
        "agg_mode": "token-mean",
        "kl_coef": 0.0,
        "kl_kind": "k3",
        "entropy_coef": 0.0,
    }


@dataclasses.dataclass
class _TypedLossSection:
    clip_high: float = 0.28
    is_level: str = "sequence"
    name: str = "ppo"  # other fields of a typed section are ignored


def test_loss_options_from_dict_object_or_none() -> None:
    assert LossOptions.from_any(None) == LossOptions()
    assert LossOptions.from_any({"clip_c": 3.0}) == LossOptions(clip_c=3.0)
    assert LossOptions.from_any(SimpleNamespace(is_cap=None)) == LossOptions(is_cap=None)
    assert LossOptions.from_any(_TypedLossSection()) == LossOptions(clip_high=0.28, is_level="sequence")
    options = LossOptions(agg_mode="seq-mean-token-sum")
    assert LossOptions.from_any(options) is options
    with pytest.raises(ValueError, match=r"unknown loss option\(s\) \['cliprange'\]"):
        LossOptions.from_any({"cliprange": 0.2})


@pytest.mark.parametrize(
    "config",
    [
        {"clip_low": 1.0},
        {"clip_high": -0.1},
        {"clip_c": 1.0},
        {"is_level": "geometric"},
        {"is_cap": 0.5},
        {"mask_level": "all"},
        {"mask_lower": 1.5},
        {"mask_upper": 0.9},
        {"agg_mode": "sum"},
        {"kl_kind": "k4"},
        {"kl_coef": math.inf},
        {"kl_coef": -0.1},
        {"entropy_coef": math.nan},
        {"clip_low": "0.2"},
    ],
)
def test_loss_options_reject_invalid_values(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(config))):
        LossOptions.from_any(config)


def test_problems_name_every_bad_option_with_a_prefix() -> None:
    @dataclasses.dataclass(frozen=True)
    class Unchecked(LossOptions):
        def __post_init__(self) -> None:
            pass

    bad = Unchecked(clip_low=1.0, mask_upper=0.5)
    assert bad.problems("algorithm.loss.") == ["algorithm.loss.clip_low=1.0 must be in [0, 1)", "algorithm.loss.mask_upper=0.5 must be >= 1"]
    with pytest.raises(ValueError, match="clip_low=1.0 must be in"):
        LossOptions.from_any(bad)  # a subclass is read field by field, so checked
