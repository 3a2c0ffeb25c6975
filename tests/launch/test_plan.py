"""`async-rl train --dry-run`: the plan, resource checks and the shipped configs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from async_rl.cli import app

from async_rl.config import load_config
from async_rl.launch.plan import is_hub_id, make_plan, render
from async_rl.learner.memory import checkpoint_bytes, parameter_count, servers_gpu_share

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))


@dataclass
class DryRun:
    returncode: int
    stdout: str
    stderr: str


def _dry_run(*args: str) -> DryRun:
    """``async-rl train ARGS --dry-run`` in this process (typer's runner, from the repository
    root as a user runs it): a subprocess costs ~15 s of imports on 2 cores.
    ``test_dry_run_reports_missing_files_with_exit_2`` keeps the real command line."""
    with contextlib.chdir(ROOT):
        done = CliRunner().invoke(app, ["train", *args, "--dry-run"])
    if done.exception is not None and not isinstance(done.exception, SystemExit):
        raise done.exception
    return DryRun(done.exit_code, done.stdout, done.stderr)


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"problem": "1+1?", "answer": "2"}\n')
    return path


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_validate_and_plan(config: Path, data: Path):
    assert len(GPU_CONFIGS) == 8
    res = _dry_run(str(config), f"data.train_files={data}", f"data.val_files={data}")
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = load_config(config)
    processes = res.stdout.split("processes:")[1]
    assert processes.count("inference-server-") == cfg.rollout.num_servers
    assert processes.count("learner-rank-") == cfg.learner.world_size
    assert "error:" not in res.stdout
    r, lrn = cfg.rollout, cfg.learner
    assert f"{r.num_servers * r.gpus_per_server + lrn.world_size * lrn.gpus_per_rank:g} GPUs" in res.stdout
    if "1gpu" in config.name:  # learner and server on one device: shared memory, not NCCL
        first = res.stdout.splitlines()[0]
        assert "share one GPU" in first and "sync backend: ipc" in first, first


@pytest.mark.slow
def test_dry_run_reports_missing_files_with_exit_2(tmp_path: Path):
    """The one dry run through the real command line (a subprocess); the others run in process."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "async_rl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          f"learner.model_path={tmp_path / 'nope'}", f"data.train_files={tmp_path / 'train.jsonl'}", "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2
    assert "async_rl.launch.driver" not in res.stderr  # a plan needs none of the driver's imports (3 s of them)
    assert "error: learner.model_path=" in res.stdout and "async-rl assets tiny" in res.stdout
    assert "error: data.train_files=" in res.stdout


@pytest.mark.slow
def test_train_refuses_to_start_with_a_one_line_reason(tmp_path: Path):
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "async_rl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          f"learner.model_path={tmp_path / 'nope'}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 1
    assert "async_rl.launch.driver" not in res.stderr  # refused by the plan, before the driver's imports
    lines = [line for line in res.stderr.strip().splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("error: learner.model_path=")


def test_plan_warns_about_cluster_redis_and_hub_models(data: Path):
    cfg = load_config(None, ["learner.model_path=Qwen/Qwen2.5-0.5B-Instruct", f"data.train_files={data}", "ray.address=auto"])
    plan = make_plan(cfg)
    assert plan.errors == []
    assert any("hub" in w for w in plan.warnings)
    assert any("queue.redis_url" in w for w in plan.warnings)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and not is_hub_id("./models/x") and not is_hub_id("/abs/model")


def test_plan_names_the_metric_sinks_and_refuses_a_taken_prometheus_port(data: Path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"data.train_files={data}", f"data.val_files={data}",
                                                                 f"logging.prometheus_port={port}", "logging.prometheus_host=127.0.0.1"])
        plan = make_plan(cfg)
    assert f"Prometheus on 127.0.0.1:{port}" in render(plan) and "W&B (" in plan.monitoring and "PNG plots" in plan.monitoring
    assert [e for e in plan.errors if e.startswith(f"logging.prometheus_port={port}: cannot serve on 127.0.0.1")], plan.errors
    free = make_plan(load_config(ROOT / "configs" / "quickstart.yaml", [f"data.train_files={data}", "logging.prometheus_port=0"]))
    assert not [e for e in free.errors if "prometheus" in e] and "Prometheus on 127.0.0.1:a free port" in free.monitoring


def test_actors_beyond_the_local_cpus_are_an_error_naming_the_keys(data: Path):
    """A local Ray never gets more CPUs: a run whose actors need more would hang until the
    stall timeout, so the plan refuses it, naming the keys; ray.num_cpus that shares cores
    plans. A GPU config planned without its GPUs only warns (it is meant for another machine)."""
    cores = os.cpu_count() or 1
    base = [f"data.train_files={data}", "rollout.cpus_per_server=1", f"learner.cpus_per_rank={cores}", "ray.num_cpus=null"]
    (error,) = [e for e in make_plan(load_config(None, base)).errors if e.startswith(f"needs {cores + 1} CPUs for its actors")]
    assert (f"(rollout.num_servers=1 x rollout.cpus_per_server=1 + learner.world_size=1 x learner.cpus_per_rank={cores}), "
            f"and the local Ray has {cores} (ray.num_cpus=null: every core)") in error and "raise ray.num_cpus" in error
    shared = make_plan(load_config(None, [*base, f"ray.num_cpus={cores + 1}"]))
    assert not [e for e in shared.errors if "CPUs for its actors" in e], shared.errors
    gpu = make_plan(load_config(None, [*base, "learner.gpus_per_rank=1"]))
    if gpu.gpus_here == 0:
        assert not [e for e in gpu.errors if "CPUs for its actors" in e] and [w for w in gpu.warnings if "CPUs for its actors" in w]


def test_plan_lists_openai_api_ports(data: Path):
    fixed = load_config(None, [f"data.train_files={data}", "rollout.num_servers=2", "rollout.openai_port=8100"])
    text = render(make_plan(fixed))
    assert "OpenAI API on 127.0.0.1:8100" in text and "OpenAI API on 127.0.0.1:8101" in text
    assert "OpenAI API on 127.0.0.1:(free port)" in render(make_plan(load_config(None, [f"data.train_files={data}"])))
    assert "OpenAI API on" not in render(make_plan(load_config(None, [f"data.train_files={data}", "rollout.openai_api=false"])))
    assert "(no API key)" in text
    keyed = load_config(None, [f"data.train_files={data}", "rollout.openai_host=0.0.0.0", "rollout.openai_api_key=k3y-0123456789abcdef"])
    assert "OpenAI API on 0.0.0.0:(free port) (API key required)" in render(make_plan(keyed)) and "k3y-" not in render(make_plan(keyed))


def test_the_plan_refuses_vllm_dev_mode_where_the_api_is_served(data: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    errors = make_plan(load_config(None, [f"data.train_files={data}"])).errors
    assert [e for e in errors if e.startswith("VLLM_SERVER_DEV_MODE='1' is set: vLLM would add unauthenticated")], errors
    assert not [e for e in make_plan(load_config(None, [f"data.train_files={data}", "rollout.openai_api=false"])).errors if "DEV_MODE" in e]
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert not [e for e in make_plan(load_config(None, [f"data.train_files={data}"])).errors if "DEV_MODE" in e]


@pytest.mark.parametrize("override, key", [
    ("algorithm.loss.name=nonsense", "algorithm.loss.name='nonsense' is not a built-in"),
    ("algorithm.advantage.name=nonsense", "algorithm.advantage.name='nonsense' is not a built-in"),
    ("learner.critic.cliprange_value=0", "learner.critic.cliprange_value=0.0 must be > 0"),
    ("rollout.reward.type=batched", "rollout.reward.type='batched' is not allowed (did you mean 'batch'?)"),
])
def test_dry_run_rejects_unknown_algorithm_and_option_names(override: str, key: str, data: Path):
    res = _dry_run(str(ROOT / "configs" / "quickstart.yaml"), f"data.train_files={data}", override)
    assert res.returncode == 2, res.stdout + res.stderr
    assert key in res.stdout + res.stderr


# --------------------------------------------------------------------------- learner memory

#: config.json of the models the shipped GPU configs name (hub ids), written out: the plan
#: reads only these keys, so a directory holding only config.json plans like the real model.
MODEL_CONFIGS = {
    "Qwen/Qwen2.5-0.5B-Instruct": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                                   "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                                   "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-1.5B-Instruct": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
                                   "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                                   "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-7B-Instruct": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                                 "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                                 "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
    # Qwen2.5-VL's config.json: the text keys at the top level, the vision tower's apart
    "Qwen/Qwen2.5-VL-3B-Instruct": {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
                                    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                                    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
                                    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                                                      "temporal_patch_size": 2, "hidden_act": "silu", "in_chans": 3}},
    "Qwen/Qwen2.5-VL-7B-Instruct": {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
                                    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                                    "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
                                    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                                      "temporal_patch_size": 2, "hidden_act": "silu", "in_chans": 3}},
}


def _config_only_model(tmp_path: Path, hub_id: str) -> Path:
    import json

    out = tmp_path / hub_id.replace("/", "--")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(MODEL_CONFIGS[hub_id]))
    return out


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_fit_80gb_gpus_with_margin(config: Path, data: Path, tmp_path: Path):
    hub_id = load_config(config).learner.model_path
    model = _config_only_model(tmp_path, hub_id)
    cfg = load_config(config, [f"learner.model_path={model}", f"data.train_files={data}", f"data.val_files={data}",
                               "learner.gpu_memory_gb=80"])
    plan = make_plan(cfg)
    assert plan.errors == [], plan.errors
    est = plan.memory
    budget = 80.0 * (1 - servers_gpu_share(cfg.rollout, cfg.learner))  # a GPU shared with vLLM: the rest
    assert est is not None and est.fits and est.budget_gb == pytest.approx(budget)
    assert est.total_gb <= 0.7 * budget, est.summary()
    assert est.tokens == cfg.learner.max_tokens_per_microbatch == (8192 if "1gpu" in config.name or "7B" in hub_id else 16384)
    if "1.5B" in hub_id:  # the issue: 1.5B at 16k-token micro-batches within 40 GB
        assert est.checkpointing and est.total_gb <= 40, est.summary()
    lines = render(plan).splitlines()
    assert any(line.startswith("learner memory: ") and f"GB of {budget:.4g} GB per rank" in line for line in lines), lines


def _too_big(tmp_path: Path, data: Path) -> list[str]:
    model = _config_only_model(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct")
    return [f"learner.model_path={model}", f"data.train_files={data}", "learner.gpus_per_rank=1", "learner.gpu_memory_gb=40",
            "learner.max_tokens_per_microbatch=262144", "learner.fsdp.gradient_checkpointing=off"]


def test_plan_that_does_not_fit_names_the_knobs(tmp_path: Path, data: Path):
    plan = make_plan(load_config(None, _too_big(tmp_path, data)))
    assert plan.memory is not None and not plan.memory.fits
    (error,) = [e for e in plan.errors if e.startswith("learner memory")]
    for knob in ("learner.max_tokens_per_microbatch=262144", "learner.fsdp.gradient_checkpointing=on",
                 "learner.world_size=1", "learner.logprob_chunk_tokens=2048", "40 GB", f"{plan.memory.total_gb:.1f} GB"):
        assert knob in error, error
    assert "at most" in error  # the largest micro-batch that fits
    assert render(plan).splitlines()[-1].startswith("error: learner memory")


def test_dry_run_exits_2_when_the_learner_does_not_fit(tmp_path: Path, data: Path):
    res = _dry_run(str(ROOT / "configs" / "quickstart.yaml"), *_too_big(tmp_path, data))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error: learner memory: the estimate" in res.stdout
    assert "learner memory: " in res.stdout.splitlines()[4]  # the plan's line, after the resources


def test_auto_checkpointing_in_the_plan(tmp_path: Path, data: Path):
    model = _config_only_model(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct")
    base = [f"learner.model_path={model}", f"data.train_files={data}", "learner.max_tokens_per_microbatch=16384"]
    gpu = make_plan(load_config(None, [*base, "learner.gpus_per_rank=1", "learner.gpu_memory_gb=40"]))
    assert gpu.memory is not None and gpu.memory.checkpointing and gpu.errors == []
    assert "gradient checkpointing on (auto)" in render(gpu)
    cpu = make_plan(load_config(None, base))  # a CPU learner: auto never checkpoints
    assert cpu.memory is not None and not cpu.memory.checkpointing


def test_the_plan_shows_the_last_measured_peak_of_the_same_setting(tmp_path: Path, data: Path):
    model = _config_only_model(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct")
    base = [f"learner.model_path={model}", f"data.train_files={data}", "learner.gpus_per_rank=1", "learner.gpu_memory_gb=80",
            "learner.world_size=1", "learner.logprob_chunk_tokens=2048"]
    plan = make_plan(load_config(None, [*base, "learner.max_tokens_per_microbatch=16384"]))  # measured on an H100 (memory_calibration.json)
    measured = plan.memory.measured if plan.memory is not None else None
    assert measured is not None and measured.peak_gb <= plan.memory.total_gb  # type: ignore[union-attr]
    assert f"; last measured: {measured.peak_gb:.1f} GB peak allocated on {measured.device}, {measured.date}" in render(plan)
    other = make_plan(load_config(None, [*base, "learner.max_tokens_per_microbatch=12288"]))  # never measured
    assert other.memory is not None and other.memory.measured is None and "last measured" not in render(other)


# --------------------------------------------------------------------------- LoRA

LORA_CONFIGS = [c for c in GPU_CONFIGS if "lora" in c.name]


@pytest.mark.parametrize("config", LORA_CONFIGS, ids=lambda p: p.name)
def test_lora_configs_plan_7b_on_one_gpu_or_two_learner_gpus(config: Path, data: Path, tmp_path: Path):
    """Issue 32: Qwen2.5-7B with LoRA plans within budget from its config.json, one server and
    the learner on one 80 GB GPU; the plan shows the adapter and the size of a weight update."""
    assert len(LORA_CONFIGS) == 2
    model = _config_only_model(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    cfg = load_config(config, [f"learner.model_path={model}", f"data.train_files={data}", f"data.val_files={data}", "learner.gpu_memory_gb=80"])
    plan = make_plan(cfg)
    assert plan.errors == [], plan.errors
    est = plan.memory
    assert est is not None and est.fits and est.reference_gb == 0.0 and est.adapter_params == 28 * 32 * (
        (3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584) + 3 * (3584 + 18944)) == 80_740_352
    if "1gpu" in config.name:  # 80 GB less vLLM's 40 %: the frozen bf16 base (15 GB) and the rest
        assert cfg.rollout.num_servers == 1 and cfg.learner.world_size == 1 and est.budget_gb == pytest.approx(48.0)
        assert "share one GPU" in plan.device
    assert est.total_gb <= 0.7 * est.budget_gb, est.summary()
    text = render(plan)
    assert ("lora: rank 32, alpha 64, dropout 0 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj: 80.7M trained parameters "
            "(1.06% of 7.62B, the base frozen); 323.0 MB per weight update (full weights: 30.5 GB)") in text.splitlines(), text
    full = make_plan(load_config(config, [f"learner.model_path={model}", f"data.train_files={data}", "learner.gpu_memory_gb=80",
                                          "learner.lora=null"]))
    assert full.memory is not None and full.lora == "" and full.memory.total_gb > 3 * est.total_gb, full.memory.summary()
    if "1gpu" in config.name:  # what LoRA buys: without it 7B does not fit beside its server
        assert not full.memory.fits


def test_dry_run_with_a_wrong_lora_target_exits_2_and_lists_the_valid_modules(data: Path, tmp_path: Path):
    model = _config_only_model(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct")
    res = _dry_run(str(ROOT / "configs" / "quickstart.yaml"), f"learner.model_path={model}", f"data.train_files={data}",
                   f"data.val_files={data}", "rollout.openai_api=false", "learner.lora.target_modules=[q_proj,qproj,mlp]")
    assert res.returncode == 2, res.stdout + res.stderr
    for line in ("error: learner.lora.target_modules: 'qproj' matches no module of this model",
                 "error: learner.lora.target_modules: 'mlp' names a module that is not a Linear layer",
                 "error: learner.lora.target_modules: valid module names of this model: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        assert line in res.stdout.splitlines(), res.stdout
    assert "lora: rank" not in res.stdout


def test_a_lora_plan_refuses_a_vision_language_model_and_warns_without_config_json(data: Path, tmp_path: Path):
    vlm = _config_only_model(tmp_path, "Qwen/Qwen2.5-VL-3B-Instruct")
    lora = [f"data.train_files={data}", "rollout.openai_api=false", "learner.lora.rank=8"]
    plan = make_plan(load_config(None, [f"learner.model_path={vlm}", *lora]))
    assert [e for e in plan.errors if e.startswith("learner.lora is not supported for a vision-language model (model_type 'qwen2_5_vl')")], plan.errors
    hub = make_plan(load_config(None, ["learner.model_path=async-rl-tests/no-such-model", *lora]))
    assert hub.errors == [] and any(w.startswith("learner.lora.target_modules not checked") for w in hub.warnings), hub.warnings
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no-such-type", "hidden_size": 8}')
    plan = make_plan(load_config(None, [f"learner.model_path={unknown}", *lora]))
    assert [e for e in plan.errors if e.startswith(f"learner.model_path={str(unknown)!r}: transformers cannot build a model from its config.json "
                                                   "(Unrecognized model identifier: no-such-type), so learner.lora.target_modules cannot be checked")], plan.errors


def test_hub_model_without_local_config_gets_no_memory_estimate(data: Path):
    plan = make_plan(load_config(None, ["learner.model_path=async-rl-tests/no-such-model", f"data.train_files={data}"]))
    assert plan.memory is None and plan.errors == []
    assert any(w.startswith("no learner memory estimate") and "async-rl-tests/no-such-model" in w for w in plan.warnings)
    assert "learner memory:" not in render(plan)


@pytest.mark.parametrize("override, message", [
    ("learner.kernels.attention=flex_attention", "learner.kernels.attention='flex_attention' needs a GPU learner"),
    ("learner.kernels.liger=on", "learner.kernels.liger=on needs a GPU learner"),
])
def test_a_gpu_kernel_on_a_cpu_learner_is_a_plan_error(data: Path, override: str, message: str) -> None:
    plan = make_plan(load_config(None, [f"data.train_files={data}", override]))
    assert any(message in e for e in plan.errors), plan.errors


@pytest.mark.assets
def test_dry_run_checks_vision_language_settings(tiny_vlm_assets, tiny_assets, tmp_path: Path):
    """VPPO on a text model, a critic of a VLM and a VLM family the learner has no input layout
    for are plan errors, before anything starts; the VLM quickstart itself plans."""
    data = tiny_vlm_assets.train_path
    vlm = str(ROOT / "configs" / "vlm_quickstart.yaml")
    ok = _dry_run(vlm, f"learner.model_path={tiny_vlm_assets.model_dir}", f"data.train_files={data}", f"data.val_files={data}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = _dry_run(vlm, f"learner.model_path={tiny_assets.model_dir}", f"data.train_files={data}", f"data.val_files={data}")
    assert text.returncode == 2 and "algorithm.use_vppo_on_perception=true needs a vision-language model" in text.stdout
    critic = _dry_run(vlm, f"learner.model_path={tiny_vlm_assets.model_dir}", f"data.train_files={data}", "algorithm.advantage.name=gae")
    assert critic.returncode == 2 and "trains a critic, which a vision-language policy does not support yet" in critic.stdout
    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text('{"model_type": "llava", "vision_config": {"hidden_size": 1024}, "text_config": {}}')
    other = _dry_run(vlm, f"learner.model_path={llava}", f"data.train_files={data}")
    assert other.returncode == 2 and "model_type 'llava' is not supported by the learner yet; supported: idefics3, smolvlm, qwen2_5_vl, qwen2_vl" in other.stdout


def test_a_run_whose_checkpoints_cannot_fit_its_disk_is_refused_naming_the_disk(tmp_path: Path, data: Path):
    """Issue 42: disk space is checked before start: two checkpoints (weights and AdamW state,
    12 bytes a parameter), the embedded Redis's AOF and the logs. A model of about 1e11
    parameters needs 2.2 TB for its checkpoints: no disk here holds that."""
    import json

    from async_rl.launch import disk

    model = tmp_path / "huge"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**MODEL_CONFIGS["Qwen/Qwen2.5-1.5B-Instruct"], "num_hidden_layers": 2000}))
    cfg = load_config(None, [f"learner.model_path={model}", f"data.train_files={data}", f"trainer.output_dir={tmp_path / 'run'}"])
    plan = make_plan(cfg)
    assert plan.disk is not None and plan.disk.checkpoint > 1e12
    (error,) = [e for e in plan.errors if e.startswith("the disk of")]
    mount, free = disk.free_bytes(tmp_path)
    assert f"the disk of {tmp_path / 'run'} (mounted at {mount}) has {disk.size(free)} free" in error, error
    assert f"2 checkpoints of {disk.size(plan.disk.checkpoint)}" in error and "trainer.output_dir" in error, error
    small = MODEL_CONFIGS["Qwen/Qwen2.5-1.5B-Instruct"]
    lora = load_config(None, ["learner.lora.rank=8", "rollout.openai_api=false"])
    full = checkpoint_bytes(small, load_config(None, []).learner, critic=False)
    assert full == 12 * parameter_count(small)
    assert checkpoint_bytes(small, lora.learner, critic=False) < full / 100  # a LoRA checkpoint holds the adapter only
    assert checkpoint_bytes(small, lora.learner, critic=True) > full  # and the critic, a whole model


@pytest.mark.assets
def test_the_plan_shows_what_the_run_writes_to_its_disk(tiny_assets, tmp_path: Path):
    from async_rl.launch import disk

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"learner.model_path={tiny_assets.model_dir}",
                                                              f"data.train_files={tiny_assets.train_path}", f"data.val_files={tiny_assets.val_path}",
                                                              f"trainer.output_dir={tmp_path / 'run'}"])
    plan = make_plan(cfg)
    assert plan.errors == [] and plan.disk is not None
    assert plan.disk.aof == 2 * disk.AOF_FLOOR_BYTES and plan.disk.total == 2 * plan.disk.checkpoint + plan.disk.aof + disk.LOGS_BYTES
    assert any(line.startswith(f"disk: about {disk.size(plan.disk.total)} in the output directory (2 checkpoints of") for line in render(plan).splitlines())


@pytest.mark.assets
def test_served_models_are_planned_and_a_teacher_of_another_tokenizer_is_refused(tiny_assets, tiny_vlm_assets, data: Path):
    """``models.<name>``: each server is a process of the plan (a server without CPUs of its own
    says it shares), a model directory without config.json is an error, and a distillation
    teacher whose tokenizer is not the policy's is refused before anything starts."""
    base = [f"learner.model_path={tiny_assets.model_dir}", f"data.train_files={data}", "trainer.output_dir=/tmp/plan-served",
            "ray.num_cpus=8"]
    same = make_plan(load_config(None, [*base, f"models.teacher.model_path={tiny_assets.model_dir}", "models.teacher.num_servers=2",
                                        "models.teacher.cpus_per_server=0", "algorithm.distill.teacher=teacher"]))
    assert same.errors == [], same.errors
    rows = [p for p in same.processes if p.role.startswith("teacher-")]
    assert [p.role for p in rows] == ["teacher-0", "teacher-1"] and "shares the cores of the rest" in rows[0].detail
    other = make_plan(load_config(None, [*base, f"models.teacher.model_path={tiny_vlm_assets.model_dir}", "algorithm.distill.teacher=teacher"]))
    assert any("its tokenizer is not the policy's" in e and "algorithm.distill.teacher='teacher'" in e for e in other.errors), other.errors
    missing = make_plan(load_config(None, [*base, f"models.judge.model_path={data.parent}"]))
    assert any("models.judge.model_path=" in e and "no config.json" in e for e in missing.errors), missing.errors
