"""Typed config: YAML + overrides, strict errors (message text), round trip, CLI exit codes."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import pytest
import yaml

from async_rl.bounds import Bound, bound_of
from async_rl.config import Config, ConfigError, LoraConfig, LossConfig, field_docs, load_config, redact_url, reference_markdown, save_resolved, shareable, to_yaml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
API_KEY = "k3y-0123456789abcdef"


def _error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_defaults_are_valid():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.algorithm.max_staleness == 2
    assert cfg.trainer.output_dir == "runs/async-rl"  # interpolation resolved


def test_yaml_and_overrides():
    cfg = load_config(QUICKSTART, ["learner.optim.lr=1e-6", "rollout.n=4", "algorithm.loss.clip_c=3", "data.system_prompt=Be brief."])
    assert cfg.learner.optim.lr == pytest.approx(1e-6)
    assert isinstance(cfg.algorithm.loss.clip_c, float) and cfg.algorithm.loss.clip_c == 3.0
    assert cfg.rollout.n == 4
    assert cfg.data.system_prompt == "Be brief."
    assert cfg.trainer.run_name == "quickstart"  # from the file
    assert cfg.trainer.output_dir == "runs/quickstart"


def test_override_interpolation_follows_overrides():
    cfg = load_config(None, ["trainer.run_name=exp7"])
    assert cfg.trainer.output_dir == "runs/exp7"


def test_unknown_key_names_full_key_and_suggestion():
    msg = _error(["learner.optim.lrr=1e-6"])
    assert "unknown config key learner.optim.lrr" in msg
    assert "did you mean learner.optim.lr?" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    msg = _error([], path)
    assert "unknown config key rollout.temprature" in msg and "did you mean rollout.temperature?" in msg


def test_unknown_section():
    msg = _error(["lerner.batch_size=4"])
    assert "unknown config key lerner" in msg and "did you mean learner?" in msg


def test_wrong_type_names_key_value_and_type():
    msg = _error(["learner.batch_size=abc"])
    assert msg == "learner.batch_size='abc' has type str, expected int"
    assert _error(["logging.console=3"]) == "logging.console=3 has type int, expected bool (true or false)"
    assert "expected float" in _error(["learner.optim.lr=fast"])


def test_wrong_type_in_yaml_names_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learner:\n  optim: 3\n")
    assert "learner.optim must be a mapping" in _error([], path)


def test_literal_choice_suggests():
    msg = _error(["algorithm.loss.agg_mode=token_mean"])
    assert "algorithm.loss.agg_mode='token_mean' is not allowed (did you mean 'token-mean'?)" in msg


def test_cross_field_rules_name_both_keys():
    msg = _error(["rollout.n=1"])
    assert "algorithm.advantage.name='grpo'" in msg and "rollout.n > 1" in msg
    msg = _error(["learner.batch_size=6", "learner.ppo_mini_batches=4"])
    assert "learner.batch_size=6 must be divisible by learner.ppo_mini_batches=4" in msg
    msg = _error(["algorithm.max_staleness=-1"])
    assert "algorithm.max_staleness=-1 must be >= 0" in msg
    msg = _error(["queue.max_depth=4", "learner.batch_size=8"])
    assert "queue.max_depth=4 must be >= learner.batch_size=8" in msg
    msg = _error(["learner.fill_staleness_window=true", "algorithm.max_staleness=4", "learner.batch_size=16", "queue.max_depth=64"])
    assert "learner.fill_staleness_window=true needs queue.max_depth=64 >= (algorithm.max_staleness + 1) x learner.batch_size = 80" in msg
    msg = _error(["rollout.vllm.max_model_len=100"])
    assert "rollout.vllm.max_model_len=100" in msg and "data.max_prompt_length + rollout.max_response_length" in msg


def test_openai_port_range_counts_every_server():
    msg = _error(["rollout.num_servers=4", "rollout.openai_port=65534"])
    assert "rollout.openai_port=65534 must be 0 (free ports) or in [1, 65532]" in msg and "rollout.num_servers=4" in msg
    assert "rollout.openai_port=-1" in _error(["rollout.openai_port=-1"])
    assert load_config(None, ["rollout.num_servers=4", "rollout.openai_port=65532"]).rollout.openai_port == 65532


def test_rloo_needs_group_but_reinforce_pp_does_not():
    assert "rollout.n" in _error(["algorithm.advantage.name=rloo", "rollout.n=1"])
    cfg = load_config(None, ["algorithm.advantage.name=reinforce_pp", "rollout.n=1"])
    assert cfg.rollout.n == 1


def test_kl_in_reward_settings_are_checked_and_load_the_reference():
    msg = _error(["algorithm.kl_ctrl.kl_coef=-0.1", "algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.horizon=0"])
    assert "algorithm.kl_ctrl.kl_coef=-0.1 must be >= 0" in msg
    assert "algorithm.kl_ctrl.target_kl=0.0 must be > 0" in msg and "algorithm.kl_ctrl.horizon=0 must be >= 1" in msg
    assert "must be > 0 with algorithm.kl_ctrl.type='adaptive'" in _error(["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0"])
    assert "did you mean 'adaptive'" in _error(["algorithm.kl_ctrl.type=adaptiv"])
    assert not load_config(None, []).algorithm.needs_reference
    assert load_config(None, ["algorithm.kl_in_reward=true"]).algorithm.needs_reference
    assert load_config(None, ["algorithm.loss.kl_coef=0.01"]).algorithm.needs_reference


def test_all_problems_reported_together():
    msg = _error(["rollout.top_p=0", "learner.optim.lr=0"])
    assert "rollout.top_p=0.0" in msg and "learner.optim.lr=0.0" in msg


def test_bad_override_syntax_and_sections():
    assert "not of the form key=value" in _error(["learner.optim.lr"])
    assert "rollout.n is a value, not a section" in _error(["rollout.n.x=1"])
    assert "rollout.vllm is a section" in _error(["rollout.vllm=3"])


def test_missing_file_and_non_mapping(tmp_path):
    assert "not found" in _error([], tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert "top level must be a mapping" in _error([], path)


def test_show_round_trip(tmp_path):
    cfg = load_config(QUICKSTART, ["learner.optim.lr=3e-5", "algorithm.loss.is_cap=null"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert cfg.algorithm.loss.is_cap is None


def test_every_field_has_a_docstring():
    text = reference_markdown()
    for line in text.splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), f"undocumented field: {line}"


def test_docs_config_md_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown() + "\n", "run: async-rl config docs --out docs/config.md"


def test_loss_section_is_the_algos_options_plus_a_name():
    """config.LossConfig adds only ``name`` to algos.options.LossOptions (no mirrored fields)."""
    import dataclasses

    from async_rl.algos.options import LossOptions

    assert issubclass(LossConfig, LossOptions)
    assert [f.name for f in dataclasses.fields(LossConfig)] == [f.name for f in dataclasses.fields(LossOptions)] + ["name"]
    assert LossOptions.from_any(LossConfig()) == LossOptions()


def test_loss_option_ranges_name_the_keys_with_every_other_problem():
    msg = _error(["algorithm.loss.clip_low=1.0", "algorithm.loss.is_cap=0.5", "algorithm.loss.kl_coef=-0.1", "rollout.top_p=0"])
    assert "algorithm.loss.clip_low=1.0 must be in [0, 1)" in msg
    assert "algorithm.loss.is_cap=0.5 must be >= 1 or null" in msg
    assert "algorithm.loss.kl_coef=-0.1 must be >= 0" in msg and "rollout.top_p=0.0" in msg
    assert "algorithm.loss.mask_upper=0.9 must be >= 1" in _error(["algorithm.loss.mask_upper=0.9"])


def test_loss_options_of_a_loaded_config_are_checked_by_the_loss():
    from async_rl.algos.options import LossOptions

    cfg = load_config(None, ["algorithm.loss.clip_high=0.28", "algorithm.loss.name=gspo"])
    assert LossOptions.from_any(cfg.algorithm.loss) == LossOptions(clip_high=0.28)


def test_bypass_needs_no_recompute_but_the_behaviour_weight_does():
    assert "algorithm.loss.name='decoupled_ppo' needs algorithm.recompute_proximal=true" in _error(["algorithm.recompute_proximal=false"])
    assert load_config(None, ["algorithm.recompute_proximal=false", "algorithm.loss.name=tis"]).algorithm.loss.name == "tis"


def test_needs_critic_is_the_estimators_metadata():
    assert load_config(None, ["algorithm.advantage.name=gae"]).algorithm.needs_critic
    assert not load_config().algorithm.needs_critic


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "async_rl.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_show_and_exit_codes():
    res = _cli("config", "show", str(QUICKSTART), "learner.optim.lr=1e-6", f"rollout.openai_api_key={API_KEY}")
    assert res.returncode == 0, res.stderr
    shown = yaml.safe_load(res.stdout)
    assert shown["learner"]["optim"]["lr"] == pytest.approx(1e-6)
    assert shown["rollout"]["openai_api_key"] == "***" and API_KEY not in res.stdout
    res = _cli("config", "show", str(QUICKSTART), "learner.optim.lrr=1e-6")
    assert res.returncode == 2
    assert "did you mean learner.optim.lr?" in res.stderr
    res = _cli("config", "show", str(QUICKSTART), "rollout.n=1")
    assert res.returncode == 2 and "rollout.n > 1" in res.stderr



def test_yaml_boolean_words_in_string_fields():
    assert load_config(None, ["trainer.resume=off"]).trainer.resume == "off"
    msg = _error(["data.prompt_key=no"])
    assert "data.prompt_key=False has type bool" in msg and "quote it" in msg


def test_algorithm_name_choices_are_exactly_the_registered_ones():
    import typing

    from async_rl.algos import advantages, kl, losses
    from async_rl.algos.options import ADVANTAGE_OPTIONS
    from async_rl.config import AdvantageConfig, KLControlConfig

    for name in advantages.names():  # the estimator and loss names are strings: a built-in or path/to/file.py:function
        assert load_config(None, [f"algorithm.advantage.name={name}"]).algorithm.advantage.name == name
        assert f"``{name}``" in field_docs(AdvantageConfig)["name"]
    for name in losses.names():
        assert load_config(None, [f"algorithm.loss.name={name}"]).algorithm.loss.name == name
        assert f"``{name}``" in field_docs(LossConfig)["name"]
    assert set(typing.get_args(typing.get_type_hints(LossConfig)["kl_kind"])) == set(kl.names())
    assert set(typing.get_args(typing.get_type_hints(KLControlConfig)["kind"])) == set(kl.names())
    assert ADVANTAGE_OPTIONS == tuple(f.name for f in dataclasses.fields(AdvantageConfig) if f.name != "name")
    msg = _error(["algorithm.advantage.name=grpp"])
    assert "algorithm.advantage.name='grpp' is not a built-in (did you mean 'grpo'?)" in msg and "path/to/file.py:name" in msg
    assert "algorithm.loss.name='ppp' is not a built-in (did you mean 'ppo'?)" in _error(["algorithm.loss.name=ppp"])


def test_reward_kwargs_are_a_free_mapping():
    cfg = load_config(None, ["rollout.reward.kwargs.max_response_length=256", "rollout.reward.kwargs.overlong_penalty_factor=1.0"])
    assert cfg.rollout.reward.kwargs == {"max_response_length": 256, "overlong_penalty_factor": 1.0}
    assert "rollout.reward.kwargs=3 has type int, expected mapping" in _error(["rollout.reward.kwargs=3"])
    assert "unknown config key rollout.reward.fallback_reward" in _error(["rollout.reward.fallback_reward=0.0"])


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    ("rediss://trainer:s3cret@redis.internal:6380", "rediss://trainer:***@redis.internal:6380"),
    ("redis://10.0.0.5:6379/0?password=s3cret&socket_timeout=5", "redis://10.0.0.5:6379/0?password=***&socket_timeout=5"),
    ("redis://10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
])
def test_redact_url_hides_the_password_wherever_the_url_carries_it(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_copies_of_the_config_carry_no_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNC_RL_OPENAI_API_KEY", raising=False)
    cfg = load_config(overrides=["queue.redis_url=redis://trainer:s3cret@10.0.0.5:6379/0", f"rollout.openai_api_key={API_KEY}"])
    assert shareable(cfg)["queue"]["redis_url"] == "redis://trainer:***@10.0.0.5:6379/0"
    assert shareable(cfg)["rollout"]["openai_api_key"] == "***"
    text = save_resolved(cfg, tmp_path).read_text()
    assert "s3cret" not in text and API_KEY not in text and API_KEY not in repr(cfg)
    assert cfg.queue.redis_url == "redis://trainer:s3cret@10.0.0.5:6379/0"  # the run itself keeps it
    assert cfg.rollout.openai_api_key == API_KEY
    assert shareable(load_config())["rollout"]["openai_api_key"] is None  # no key: nothing to hide


def test_a_non_loopback_openai_host_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNC_RL_OPENAI_API_KEY", raising=False)
    for host in ("0.0.0.0", "10.1.2.3", "fd00::1", "node7.cluster"):
        msg = _error([f"rollout.openai_host={host}"])
        assert f"rollout.openai_host={host!r} is not loopback" in msg and "rollout.openai_api_key" in msg and "ASYNC_RL_OPENAI_API_KEY" in msg
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert load_config(None, [f"rollout.openai_host={host}"]).rollout.openai_host == host
    assert load_config(None, ["rollout.openai_host=0.0.0.0", "rollout.openai_api=false"]).rollout.openai_api_key is None
    assert load_config(None, ["rollout.openai_host=0.0.0.0", f"rollout.openai_api_key={API_KEY}"]).rollout.openai_api_key == API_KEY
    monkeypatch.setenv("ASYNC_RL_OPENAI_API_KEY", "from-the-environment-0123")
    cfg = load_config(None, ["rollout.openai_host=0.0.0.0", f"rollout.openai_api_key={API_KEY}"])
    assert cfg.rollout.openai_api_key == "from-the-environment-0123"  # the environment wins
    monkeypatch.setenv("ASYNC_RL_OPENAI_API_KEY", "")
    assert load_config().rollout.openai_api_key is None  # empty: unset


def test_a_weak_or_mistyped_key_is_refused_without_echoing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNC_RL_OPENAI_API_KEY", raising=False)
    for key in ("short-key", "0123456789abcdef 0123", "12345678901234567890"):
        msg = _error([f"rollout.openai_api_key={key}"])
        assert "rollout.openai_api_key" in msg and key not in msg
    assert "rollout.openai_api_key=*** has type int, expected str" in _error(["rollout.openai_api_key=12345678901234567890"])


def _numeric_keys(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], type, bool]]:
    """Every int or float key of the schema, nested sections, ``Optional`` and list items
    included: its dotted key, its field, its number type and whether it is a list of them."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        if typing.get_origin(tp) is dict:  # sections by name (models.<name>): one name stands for all
            key += ".judge"
        sections = [a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if sections:  # a section, or an optional one (learner.lora: setting one key creates it)
            yield from _numeric_keys(sections[0], key + ".")
            continue
        args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType, list) else (tp,)
        numbers = [a for a in args if a in (int, float)]
        if numbers:
            yield key, f, numbers[0], typing.get_origin(tp) is list


def test_every_numeric_key_has_a_bound_or_a_documented_reason():
    """Each number of the schema declares its range beside its field (``bounds.bounded``), or
    why it has none (``bounds.unbounded``: a :class:`Bound` without limits needs a reason)."""
    keys = {key: f for key, f, _, _ in _numeric_keys()}
    assert {"learner.critic.optim.lr", "algorithm.loss.clip_c", "rollout.vllm.max_model_len", "learner.optim.betas",
            "learner.lora.rank", "learner.lora.dropout"} <= set(keys)  # every kind, optional sections included
    missing = [key for key, f in keys.items() if bound_of(f) is None]
    assert not missing, f"declare a range with bounds.bounded (or the reason for none with bounds.unbounded): {missing}"


def test_a_bound_needs_limits_or_a_reason():
    with pytest.raises(ValueError, match="reason"):
        Bound()
    with pytest.raises(ValueError, match="at most one lower limit"):
        Bound(ge=0, gt=0)
    with pytest.raises(ValueError, match="reason"):
        Bound(ge=0, unbounded="why")


def _just_outside(bound: Bound, number: type) -> list[Any]:
    """Values next to each limit on its wrong side, and for floats NaN and the infinities."""
    values: list[Any] = []
    if bound.gt is not None:
        values.append(number(bound.gt))
    if bound.ge is not None:
        values.append(bound.ge - 1 if number is int else math.nextafter(bound.ge, -math.inf))
    if bound.lt is not None:
        values.append(number(bound.lt))
    if bound.le is not None:
        values.append(bound.le + 1 if number is int else math.nextafter(bound.le, math.inf))
    if number is float:
        values += [math.nan, math.inf, -math.inf]
    return [v for v in values if v not in bound.also]


OUTSIDE = [(key, value, is_list) for key, f, number, is_list in _numeric_keys() for value in _just_outside(bound_of(f), number)]


@pytest.mark.parametrize(("key", "value", "is_list"), OUTSIDE, ids=[f"{k}={v!r}" for k, v, _ in OUTSIDE])
def test_a_value_outside_its_bound_names_the_key(key: str, value: Any, is_list: bool):
    if is_list:  # learner.optim.betas: the first item out of range
        msg = _error([f"{key}=[{value!r}, 0.999]"])
        key = f"{key}[0]"
    else:
        msg = _error([f"{key}={value!r}"])
    assert f"{key}={value!r} must be " in msg, msg


def test_the_issue_s_values_are_refused():
    assert "algorithm.advantage.eps=0.0 must be > 0" in _error(["algorithm.advantage.eps=0"])
    msg = _error(["algorithm.advantage.gamma=-0.1", "algorithm.advantage.lam=-1"])
    assert "algorithm.advantage.gamma=-0.1 must be in [0, 1]" in msg and "algorithm.advantage.lam=-1.0 must be in [0, 1]" in msg
    msg = _error(["rollout.cpus_per_server=-1", "rollout.gpus_per_server=-0.5", "learner.cpus_per_rank=-1", "learner.gpus_per_rank=-1"])
    for key, value in (("rollout.cpus_per_server", -1.0), ("rollout.gpus_per_server", -0.5), ("learner.cpus_per_rank", -1.0), ("learner.gpus_per_rank", -1.0)):
        assert f"{key}={value} must be >= 0" in msg
    assert "sync.timeout_s=inf must be finite and in (0, 604800]" in _error(["sync.timeout_s=inf"])
    assert "queue.timeout_s=1e+300 must be in (0, 604800]" in _error(["queue.timeout_s=1e300"])
    assert "learner.critic.cliprange_value=0.0 must be > 0 or null" in _error(["learner.critic.cliprange_value=0"])
    assert load_config(None, ["learner.critic.cliprange_value=null", "learner.gpu_memory_gb=null"]).learner.critic.cliprange_value is None


def test_cross_field_rules_wait_for_the_ranges():
    """A divisor out of range is reported as such, not divided by (ZeroDivisionError)."""
    assert _error(["learner.ppo_mini_batches=0"]) == "invalid config:\n  learner.ppo_mini_batches=0 must be >= 1"
    assert "learner.critic.ppo_mini_batches=0 must be >= 1" in _error(["learner.critic.ppo_mini_batches=0"])


def test_servers_bind_loopback_by_default():
    cfg = load_config()
    assert cfg.logging.prometheus_host == "127.0.0.1" and cfg.rollout.openai_host == "127.0.0.1"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_load(path: Path):
    assert isinstance(load_config(path), Config)


# --------------------------------------------------------------------------- learner.lora (an optional section)

LORA_OK: list[str] = []
"""What a LoRA run needs besides the section: nothing (the OpenAI API serves the adapter)."""


def test_lora_is_off_by_default_and_one_key_sets_the_section_with_its_defaults():
    assert load_config().learner.lora is None
    lora = load_config(None, ["learner.lora.rank=8", *LORA_OK]).learner.lora
    assert lora == LoraConfig(rank=8)
    assert load_config(None, ["learner.lora={}", *LORA_OK]).learner.lora == LoraConfig()
    assert load_config(None, ["learner.lora.target_modules=[q_proj,v_proj]", *LORA_OK]).learner.lora.target_modules == ["q_proj", "v_proj"]


def test_lora_from_yaml_and_null_override(tmp_path: Path):
    path = tmp_path / "lora.yaml"
    path.write_text("rollout: {openai_api: false}\nlearner: {lora: {rank: 8, alpha: 16}}\n")
    cfg = load_config(path)
    assert cfg.learner.lora == LoraConfig(rank=8, alpha=16.0)
    assert load_config(path, ["learner.lora.dropout=0.1"]).learner.lora == LoraConfig(rank=8, alpha=16.0, dropout=0.1)
    assert load_config(path, ["learner.lora=null"]).learner.lora is None
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(to_yaml(cfg))
    assert load_config(resolved) == cfg


def test_lora_keys_are_checked_like_every_other_key(tmp_path: Path):
    assert "unknown config key learner.lora.rnak: did you mean learner.lora.rank?" in _error(["learner.lora.rnak=8"])
    assert "learner.lora.rank is a value, not a section" in _error(["learner.lora.rank.x=8"])
    assert "learner.lora.rank='big' has type str, expected int" in _error(["learner.lora.rank=big"])
    assert "learner.lora must be a mapping (a section), got True" in _error(["learner.lora=true"])
    msg = _error(["learner.lora.rank=513", "learner.lora.alpha=0", *LORA_OK])
    assert "learner.lora.rank=513 must be in [1, 512]" in msg and "learner.lora.alpha=0.0 must be > 0" in msg
    path = tmp_path / "typo.yaml"
    path.write_text("learner: {lora: {ranks: 8}}\n")
    assert "unknown config key learner.lora.ranks" in _error([], path)


def test_lora_targets_are_checked_at_load():
    msg = _error(["learner.lora.target_modules=[q_proj,lm_head,q_proj]", *LORA_OK])
    assert "learner.lora.target_modules=['q_proj', 'lm_head', 'q_proj'] names ['q_proj'] more than once" in msg
    assert "vLLM cannot serve a LoRA on ['lm_head']" in msg
    assert "learner.lora.target_modules must name at least one module" in _error(["learner.lora.target_modules=[]", *LORA_OK])


def test_lora_refuses_what_cannot_serve_or_train_it():
    assert load_config(None, ["learner.lora.rank=8"]).rollout.openai_api  # the API serves the adapter: on by default
    for key in ("algorithm.use_vppo_on_perception", "learner.freeze_vision_tower"):
        msg = _error(["learner.lora.rank=8", f"{key}=true", *LORA_OK])
        assert f"{key}=true is for vision-language models, which learner.lora does not support yet: set {key}=false" in msg, msg
    assert load_config(None, ["rollout.openai_api=true", "algorithm.use_vppo_on_perception=true", "learner.freeze_vision_tower=true"])


def test_lora_section_in_the_reference():
    text = reference_markdown()
    assert "| `learner.lora` | `section \\| null` | `null` |" in text
    assert "## `learner.lora`" in text and "| `learner.lora.rank` | `int` | `16` | `[1, 512]` |" in text


def test_the_longest_sample_is_one_rule_for_the_engine_the_microbatch_and_the_plan():
    """``Config.max_sample_tokens`` (prompt bound + response bound) is the engine's default
    context and the bound the micro-batch and ``rollout.vllm.max_model_len`` are checked against."""
    from async_rl.rollout.engine_args import engine_kwargs

    cfg = load_config(None, ["data.max_prompt_length=40", "rollout.max_response_length=24"])
    assert cfg.max_sample_tokens == 64 and engine_kwargs(cfg)["max_model_len"] == 64
    assert "= 64" in _error(["data.max_prompt_length=40", "rollout.max_response_length=24", "learner.max_tokens_per_microbatch=63"])
    assert "= 64" in _error(["data.max_prompt_length=40", "rollout.max_response_length=24", "rollout.vllm.max_model_len=63"])
    load_config(None, ["data.max_prompt_length=40", "rollout.max_response_length=24", "rollout.vllm.max_model_len=64",
                       "learner.max_tokens_per_microbatch=64"])  # exactly one sample fits: no error


def test_a_second_reference_model_is_loaded_only_for_a_kl_term_without_lora():
    from async_rl.config import LoraConfig
    from async_rl.learner.memory import RankExtras

    kl = load_config(None, ["algorithm.loss.kl_coef=0.01"]).algorithm
    assert kl.needs_reference and kl.loads_reference_model(None) and not kl.loads_reference_model(LoraConfig())
    assert RankExtras.of(kl).reference and not RankExtras.of(kl, LoraConfig()).reference
    plain = load_config(None, ["algorithm.loss.kl_coef=0", "algorithm.kl_in_reward=false"]).algorithm
    assert not plain.needs_reference and not plain.loads_reference_model(None)


def test_served_models_are_sections_by_name(tmp_path: Path):
    """``models.<name>``: set by YAML or by dotted overrides (one key creates the model with its
    defaults), every key checked as in any section, the name and the model path required."""
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("models:\n  judge:\n    model_path: /m/judge\n    vllm: {dtype: float32}\n")
    cfg = load_config(yaml_file, ["models.judge.num_servers=2", "models.teacher.model_path=/m/teacher"])
    assert sorted(cfg.models) == ["judge", "teacher"]
    assert (cfg.models["judge"].model_path, cfg.models["judge"].num_servers, cfg.models["judge"].vllm.dtype) == ("/m/judge", 2, "float32")
    assert cfg.models["teacher"].max_attempts == 3 and load_config().models == {}
    assert load_config(None, [f"models={{}}"]).models == {}
    msg = _error(["models.judge.num_sevrers=2"])
    assert "did you mean models.judge.num_servers?" in msg
    msg = _error(["models.Judge.model_path=/m", "models.judge.num_servers=0"])
    assert "models.Judge: a served model's name must match" in msg
    assert "models.judge.num_servers=0 must be >= 1" in msg and "models.judge.model_path is required" in msg
    assert "models.judge.vllm.dtype='int8' is not allowed" in _error(["models.judge.model_path=/m", "models.judge.vllm.dtype=int8"])
    assert "## `models.<name>`" in reference_markdown() and "`models.<name>.request_timeout_s`" in reference_markdown()


def test_distillation_needs_a_served_teacher_temperature_1_and_no_environment():
    ok = load_config(None, ["models.teacher.model_path=/m", "algorithm.distill.teacher=teacher", "algorithm.distill.reward_coef=0.5"])
    assert (ok.algorithm.distill.teacher, ok.algorithm.distill.coef, ok.algorithm.distill.reward_coef) == ("teacher", 1.0, 0.5)
    assert "algorithm.distill.teacher='techer' must name a served model (models: teacher)" in _error(
        ["models.teacher.model_path=/m", "algorithm.distill.teacher=techer"])
    assert "sample at rollout.temperature=1.0" in _error(["models.teacher.model_path=/m", "algorithm.distill.teacher=teacher", "rollout.temperature=0.7"])
    assert "rollout.env.name='addition_feedback' runs episodes" in _error(
        ["models.teacher.model_path=/m", "algorithm.distill.teacher=teacher", "rollout.env.name=addition_feedback"])
    assert "algorithm.distill.coef=0.0 must be > 0" in _error(["models.teacher.model_path=/m", "algorithm.distill.teacher=teacher", "algorithm.distill.coef=0"])
