"""The learner's per-rank memory estimate (``async_rl.learner.memory``)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from async_rl.config import LearnerConfig, load_config
from async_rl.learner import memory

QWEN25_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
QWEN25_15B = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
              "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


def _learner(*overrides: str) -> LearnerConfig:
    return load_config(None, ["learner.gpus_per_rank=1", *overrides]).learner


def _real_count(model_config: dict, llama: bool = False) -> int:
    """Parameters of the transformers model of ``model_config``, built on the meta device (no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen2Config, Qwen2ForCausalLM)
    kwargs = {k: v for k, v in model_config.items() if k != "model_type"}
    with torch.device("meta"):
        model = model_cls(config_cls(**kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_config", [QWEN25_05B, QWEN25_15B], ids=["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_parameter_count_matches_transformers(model_config: dict):
    assert memory.parameter_count(model_config) == pytest.approx(_real_count(model_config), rel=0.01)


def test_parameter_count_of_a_small_random_model_untied_with_head_dim():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = {"model_type": "qwen2", "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300, "tie_word_embeddings": False}
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in small.items() if k != "model_type"}))
    real = sum(p.numel() for p in model.parameters())
    assert memory.parameter_count(small) == pytest.approx(real, rel=0.01)
    assert memory.parameter_count(small) == real


def test_parameter_count_of_llama_biases():
    llama = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 1, "vocab_size": 500, "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}
    assert memory.parameter_count(llama) == _real_count(llama, llama=True)
    plain = {**llama, "attention_bias": False, "mlp_bias": False}
    assert memory.parameter_count(plain) == _real_count(plain, llama=True)


def test_layer_activation_formula_matches_saved_tensors_of_a_bf16_qwen2_layer():
    """Count the bytes a Hugging Face Qwen2 decoder layer saves for backward (sdpa on CPU, bf16)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    shape_cfg = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 1,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True}
    config = Qwen2Config(**{k: v for k, v in shape_cfg.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    layer = Qwen2DecoderLayer(config, 0).to(torch.bfloat16)
    tokens = 64
    x = torch.randn(1, tokens, 256, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens)[None]
    cos, sin = Qwen2RotaryEmbedding(config)(x, positions)
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    measured = sum(saved.values()) / tokens
    formula = memory.layer_activation_bytes(memory.ModelShape.from_config(shape_cfg), c=2)
    # The formula also counts the o_proj input as a copy of the attention output (flash/flex on
    # GPU return [heads, tokens] and transformers makes it contiguous); CPU sdpa needs no copy.
    assert formula - 2 * 256 <= measured <= formula


@pytest.mark.parametrize("model_config, checkpointing, measured_gb", [
    (QWEN25_05B, False, 43.7),  # ../shared/GPU_DEVICE_NOTES.md: plain packed loop, flex_attention, 4096-token chunks
    (QWEN25_15B, True, 36.7),
], ids=["qwen2.5-0.5b", "qwen2.5-1.5b-checkpointed"])
def test_estimate_is_calibrated_against_the_gpu_measurements(model_config: dict, checkpointing: bool, measured_gb: float):
    lrn = _learner("learner.max_tokens_per_microbatch=16384", "learner.logprob_chunk_tokens=4096")
    est = memory.estimate(model_config, lrn, checkpointing, budget_gb=80.0, device_type="cuda")
    assert abs(est.total_gb - measured_gb) / measured_gb <= 0.15, est.summary()
    assert est.total_gb >= measured_gb, est.summary()  # on the high side: an underestimate is an OOM


@pytest.mark.parametrize("entry", range(len(memory.calibration())))
def test_estimate_is_at_or_above_every_measured_learner_peak(entry: int):
    """The committed learner peaks (``memory_calibration.json``, from ``gpu_acceptance.sh
    throughput``): the estimate of the same setting shows the measurement and is not below it."""
    key, measured = memory.calibration()[entry]
    dtype = {2: "bfloat16", 4: "float32"}[key["compute_bytes"]]
    lrn = _learner(f"learner.max_tokens_per_microbatch={key['tokens']}", f"learner.logprob_chunk_tokens={key['logprob_chunk_tokens']}",
                   f"learner.world_size={key['world_size']}", f"learner.fsdp.param_dtype={dtype}")
    est = memory.estimate(key["model"], lrn, key["checkpointing"], 80.0, "cuda", memory.Beside(key["reference"], key["critic"]))
    assert est.measured == measured and f"last measured: {measured.peak_gb:.1f} GB" in est.summary()
    assert measured.peak_gb <= est.total_gb <= 1.25 * measured.peak_gb, est.summary()


def test_a_recorded_measurement_is_found_for_the_same_shape_only(tmp_path):
    table = tmp_path / "calibration.json"
    lrn = _learner("learner.max_tokens_per_microbatch=8192")
    key = memory.setting_key(QWEN25_05B, lrn, False, "cuda")
    assert memory.last_measured(key, table) is None
    memory.record_measurement(key, memory.Measurement(30.0, "GPU", "2026-01-01", "a.json"), table)
    memory.record_measurement(key, memory.Measurement(31.0, "GPU", "2026-02-01", "b.json"), table)  # replaces the first
    same = memory.setting_key({**QWEN25_05B, "torch_dtype": "bfloat16", "head_dim": 64}, lrn, False, "cuda")  # same shape
    assert memory.last_measured(same, table) == memory.Measurement(31.0, "GPU", "2026-02-01", "b.json")
    assert len(memory.calibration(table)) == 1
    for other in (memory.setting_key(QWEN25_05B, lrn, True, "cuda"), memory.setting_key(QWEN25_15B, lrn, False, "cuda"),
                  memory.setting_key(QWEN25_05B, _learner("learner.max_tokens_per_microbatch=4096"), False, "cuda"),
                  memory.setting_key(QWEN25_05B, lrn, False, "cuda", memory.Beside(reference=True))):
        assert memory.last_measured(other, table) is None


def test_parts_scale_as_documented():
    one = memory.estimate(QWEN25_15B, _learner("learner.max_tokens_per_microbatch=16384"), False, 80.0)
    four = memory.estimate(QWEN25_15B, _learner("learner.max_tokens_per_microbatch=16384", "learner.world_size=4"), False, 80.0)
    p = memory.parameter_count(QWEN25_15B)
    assert one.params_gb == pytest.approx(4 * p / 1e9) and four.params_gb == pytest.approx(p / 1e9)
    assert one.optimizer_gb == pytest.approx(8 * p / 1e9) and four.optimizer_gb == pytest.approx(2 * p / 1e9)
    assert four.activations_gb == one.activations_gb  # activations are per rank, not sharded
    half = memory.estimate(QWEN25_15B, _learner("learner.max_tokens_per_microbatch=8192"), False, 80.0)
    assert half.activations_gb == pytest.approx(one.activations_gb / 2)
    assert one.logprob_chunk_gb == pytest.approx(2048 * 151936 * (2 + 8) / 1e9)
    cpu = memory.estimate(QWEN25_15B, _learner("learner.max_tokens_per_microbatch=8192"), False, 80.0, device_type="cpu")
    assert cpu.activations_gb > half.activations_gb  # float32 compute
    with_ref = memory.estimate(QWEN25_15B, _learner(), False, 80.0, beside=memory.Beside(reference=True))
    assert with_ref.reference_gb > with_ref.params_gb and "reference model" in with_ref.summary()
    with_critic = memory.estimate(QWEN25_15B, _learner(), False, 80.0, beside=memory.Beside(critic=True))
    assert with_critic.critic_gb == pytest.approx(with_critic.params_gb + with_critic.optimizer_gb + with_ref.reference_gb - with_ref.params_gb)
    assert "critic" in with_critic.summary() and with_critic.total_gb == pytest.approx(memory.estimate(QWEN25_15B, _learner(), False, 80.0).total_gb + with_critic.critic_gb)


def test_checkpointing_reduces_activations():
    lrn = _learner("learner.max_tokens_per_microbatch=16384")
    off = memory.estimate(QWEN25_15B, lrn, False, 80.0)
    on = memory.estimate(QWEN25_15B, lrn, True, 80.0)
    assert on.activations_gb < off.activations_gb / 5
    assert on.total_gb < off.total_gb
    assert (on.params_gb, on.grads_gb, on.optimizer_gb, on.logprob_chunk_gb) == (off.params_gb, off.grads_gb, off.optimizer_gb, off.logprob_chunk_gb)


def test_summary_line_and_fits():
    est = memory.estimate(QWEN25_05B, _learner("learner.max_tokens_per_microbatch=16384"), False, 80.0)
    line = est.summary()
    assert line.startswith("learner memory: ") and " GB of 80 GB per rank (" in line
    for part in ("params", "grads", "optimizer", "compute copies", "activations", "at 16384 tokens",
                 "gradient checkpointing off", "log-prob chunk", "overhead"):
        assert part in line
    assert "(auto)" in est.summary(auto=True)
    assert est.fits and not dataclasses.replace(est, budget_gb=est.total_gb - 0.1).fits
    assert est.total_gb == pytest.approx(est.params_gb + est.grads_gb + est.optimizer_gb + est.compute_copies_gb
                                         + est.activations_gb + est.logprob_chunk_gb + est.overhead_gb)


def test_auto_checkpointing_turns_on_only_on_gpu_when_it_does_not_fit():
    big = _learner("learner.max_tokens_per_microbatch=16384", "learner.gpu_memory_gb=40")
    assert not memory.estimate(QWEN25_15B, big, False, 40.0).fits
    assert memory.resolve_gradient_checkpointing(big, QWEN25_15B, "cuda") is True
    assert memory.resolve_gradient_checkpointing(big, QWEN25_15B, "cpu") is False
    roomy = _learner("learner.max_tokens_per_microbatch=16384", "learner.gpu_memory_gb=80")
    assert memory.resolve_gradient_checkpointing(roomy, QWEN25_05B, "cuda") is False
    for mode, expected in (("on", True), ("off", False)):
        for lrn in (big, roomy):
            fixed = dataclasses.replace(lrn, fsdp=dataclasses.replace(lrn.fsdp, gradient_checkpointing=mode))
            for device in ("cuda", "cpu"):
                assert memory.resolve_gradient_checkpointing(fixed, QWEN25_15B, device) is expected


def test_budget(monkeypatch: pytest.MonkeyPatch):
    assert memory.budget_gb(_learner("learner.gpu_memory_gb=40"), "cuda") == 40.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory.budget_gb(_learner(), "cuda") == 80.0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    cpu = load_config(None, ["learner.world_size=2"]).learner
    assert memory.budget_gb(cpu, "cpu") == pytest.approx(ram / 2)


def test_a_gpu_shared_with_an_inference_server_leaves_the_learner_the_rest():
    one_gpu = load_config(None, ["rollout.gpus_per_server=0.5", "learner.gpus_per_rank=0.5", "rollout.vllm.gpu_memory_utilization=0.35",
                                 "learner.gpu_memory_gb=80"])
    share = memory.servers_gpu_share(one_gpu.rollout, one_gpu.learner)
    assert share == pytest.approx(0.35)
    assert memory.budget_gb(one_gpu.learner, "cuda", share) == pytest.approx(52.0)
    two = load_config(None, ["rollout.num_servers=2", "rollout.gpus_per_server=0.25", "learner.gpus_per_rank=0.5"])
    assert memory.servers_gpu_share(two.rollout, two.learner) == pytest.approx(2 * two.rollout.vllm.gpu_memory_utilization)
    own = load_config(None, ["rollout.gpus_per_server=1", "learner.gpus_per_rank=1"])
    assert memory.servers_gpu_share(own.rollout, own.learner) == 0.0
    # 0.5B at 16k tokens needs about 40 GB without checkpointing: 60 GB hold it, 60 GB less vLLM's 35 % do not
    lrn = dataclasses.replace(one_gpu.learner, max_tokens_per_microbatch=16384, gpu_memory_gb=60.0)
    assert memory.resolve_gradient_checkpointing(lrn, QWEN25_05B, "cuda") is False
    assert memory.resolve_gradient_checkpointing(lrn, QWEN25_05B, "cuda", servers_share=share) is True


def test_max_fitting_tokens():
    lrn = _learner("learner.fsdp.gradient_checkpointing=off")
    best = memory.max_fitting_tokens(QWEN25_15B, lrn, False, 40.0)
    assert best % 1024 == 0 and best > 0

    def fits(tokens: int) -> bool:
        return memory.estimate(QWEN25_15B, dataclasses.replace(lrn, max_tokens_per_microbatch=tokens), False, 40.0).fits

    assert fits(best) and not fits(best + 1024)
    assert memory.max_fitting_tokens(QWEN25_15B, lrn, False, 10.0) == 0  # the states alone exceed it


def test_a_config_without_the_needed_keys_is_a_value_error():
    with pytest.raises(ValueError, match="intermediate_size"):
        memory.estimate({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 10}, _learner(), False, 80.0)
