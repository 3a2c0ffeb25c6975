"""The learner's per-rank memory estimate (``async_rl.learner.memory``)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from async_rl.config import LORA_TARGETS, LearnerConfig, LoraConfig, load_config
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
    est = memory.estimate(key["model"], lrn, key["checkpointing"], 80.0, "cuda", memory.RankExtras(key["reference"], key["critic"]))
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
                  memory.setting_key(QWEN25_05B, lrn, False, "cuda", memory.RankExtras(reference=True))):
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
    with_ref = memory.estimate(QWEN25_15B, _learner(), False, 80.0, beside=memory.RankExtras(reference=True))
    assert with_ref.reference_gb > with_ref.params_gb and "reference model" in with_ref.summary()
    with_critic = memory.estimate(QWEN25_15B, _learner(), False, 80.0, beside=memory.RankExtras(critic=True))
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


# --------------------------------------------------------------------------- LoRA

LORA = ("learner.lora.rank=16", "rollout.openai_api=false")
"""A rank-16 LoRA run on the seven projections (the OpenAI API cannot serve its adapter)."""
QWEN25_05B_LORA_LAYER = 16 * ((896 + 896) + 2 * (896 + 128) + (896 + 896) + 3 * (896 + 4864))
"""One Qwen2.5-0.5B layer's rank-16 adapter, by hand: q and o 896 -> 896 (14 heads x 64), k and v
896 -> 128 (2 KV heads), gate, up 896 -> 4864 and down 4864 -> 896; r (in + out) each."""


def test_lora_params_of_qwen25_05b_by_hand_and_by_peft():
    import peft
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = memory.ModelShape.from_config(QWEN25_05B)
    assert QWEN25_05B_LORA_LAYER == 366_592
    assert shape.lora_params(list(LORA_TARGETS), 16) == 24 * 366_592 == 8_798_208
    assert shape.lora_params(["q_proj", "v_proj"], 8) == 24 * 8 * (1792 + 1024)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN25_05B.items() if k != "model_type"}))
    peft.inject_adapter_in_model(peft.LoraConfig(r=16, target_modules=list(LORA_TARGETS)), model)
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) == 8_798_208
    with pytest.raises(ValueError, match=r"no decoder projection named \['mlp'\]"):
        shape.lora_params(["q_proj", "mlp"], 16)


def test_lora_estimate_of_qwen25_05b_by_hand():
    """bf16 on one GPU, 8192 tokens: the base in bf16, the adapter's float32 weights, gradients
    and AdamW states, one layer's adapter gradients in flight, no LM-head gradient."""
    lrn, full = _learner(*LORA), _learner()
    est, ref = memory.estimate(QWEN25_05B, lrn, False, 80.0), memory.estimate(QWEN25_05B, full, False, 80.0)
    p, a, a_layer = memory.parameter_count(QWEN25_05B), 8_798_208, QWEN25_05B_LORA_LAYER
    assert est.adapter_params == a and ref.adapter_params == 0
    assert est.params_gb == pytest.approx((2 * p + 4 * a) / 1e9)
    assert est.grads_gb == pytest.approx((4 * a + 6 * a_layer) / 1e9)  # 0.037 GB against the full run's 2.9 GB
    assert est.optimizer_gb == pytest.approx(8 * a / 1e9)
    shape = memory.ModelShape.from_config(QWEN25_05B)
    assert est.compute_copies_gb == pytest.approx(2 * (shape.root_params + 2 * (shape.layer_params + a_layer)) / 1e9)
    # each of the 24 layers also saves A x (16 bf16 values) per target and token
    assert est.activations_gb - ref.activations_gb == pytest.approx(24 * 7 * 16 * 2 * 8192 / 1e9)
    ckpt, ckpt_ref = memory.estimate(QWEN25_05B, lrn, True, 80.0), memory.estimate(QWEN25_05B, full, True, 80.0)
    assert ckpt.activations_gb - ckpt_ref.activations_gb == pytest.approx(7 * 16 * 2 * 8192 / 1e9)  # one layer recomputed at a time
    assert (est.logprob_chunk_gb, est.reference_gb, est.critic_gb) == (ref.logprob_chunk_gb, 0.0, 0.0)
    assert est.total_gb < ref.total_gb - 7.5, (est.summary(), ref.summary())  # about 14 P + 6 V H bytes less: 7.7 GB
    assert "params 1.0 (frozen base + LoRA adapter)" in est.summary()


def test_lora_dropout_keeps_each_target_s_dropped_input_and_mask():
    shape = memory.ModelShape.from_config(QWEN25_05B)
    plain, dropped = LoraConfig(rank=16), LoraConfig(rank=16, dropout=0.1)
    inputs = 5 * 896 + 896 + 4864  # q, k, v, gate, up read H; o reads heads x head_dim = 896; down reads I
    assert memory.lora_activation_bytes(shape, 2, plain) == 7 * 16 * 2
    assert memory.lora_activation_bytes(shape, 2, dropped) == 7 * 16 * 2 + 3 * inputs
    assert memory.lora_activation_bytes(shape, 4, LoraConfig(rank=8, target_modules=["q_proj"])) == 8 * 4


def test_lora_is_below_full_fine_tuning_for_every_shape_and_sharding():
    for model_config in (QWEN25_05B, QWEN25_15B):
        for ws in ("1", "4"):
            for ckpt in (False, True):
                lora = memory.estimate(model_config, _learner(*LORA, f"learner.world_size={ws}"), ckpt, 80.0)
                full = memory.estimate(model_config, _learner(f"learner.world_size={ws}"), ckpt, 80.0)
                assert lora.total_gb < full.total_gb and lora.params_gb < full.params_gb and lora.grads_gb < full.grads_gb / 20


def test_a_lora_run_holds_no_reference_model_but_its_critic_keeps_its_gradients():
    kl = load_config(None, ["algorithm.loss.kl_coef=0.01", "algorithm.advantage.name=gae"]).algorithm
    assert memory.RankExtras.of(kl) == memory.RankExtras(reference=True, critic=True)
    assert memory.RankExtras.of(kl, LoraConfig()) == memory.RankExtras(reference=False, critic=True)
    lrn = _learner(*LORA)
    est = memory.estimate(QWEN25_05B, lrn, False, 80.0, beside=memory.RankExtras.of(kl, lrn.lora))
    p, shape = memory.parameter_count(QWEN25_05B), memory.ModelShape.from_config(QWEN25_05B)
    assert est.reference_gb == 0.0
    assert est.critic_gb == pytest.approx((16 * p + 2 * shape.root_params + 6 * shape.layer_params) / 1e9)


def test_lora_auto_checkpointing_follows_the_lora_estimate():
    """Qwen2.5-1.5B at 4096 tokens in 24 GB: full fine-tuning needs checkpointing, LoRA does not."""
    full = _learner("learner.max_tokens_per_microbatch=4096", "learner.gpu_memory_gb=24")
    lora = _learner(*LORA, "learner.max_tokens_per_microbatch=4096", "learner.gpu_memory_gb=24")
    assert memory.resolve_gradient_checkpointing(full, QWEN25_15B, "cuda") is True
    assert memory.resolve_gradient_checkpointing(lora, QWEN25_15B, "cuda") is False
    assert memory.estimate(QWEN25_15B, lora, False, 24.0).fits


def test_servers_on_the_ranks_gpu_add_the_cuda_ipc_hand_off_buffer():
    """The whole float32 update (LoRA: the adapter) stays on learner rank 0's GPU between
    updates when its servers share the GPU and get updates through CUDA IPC."""
    lrn = _learner()
    without = memory.estimate(QWEN25_05B, lrn, False, 80.0)
    with_buffer = memory.estimate(QWEN25_05B, lrn, False, 80.0, beside=memory.RankExtras(handoff=True))
    p = memory.parameter_count(QWEN25_05B)
    assert without.handoff_gb == 0.0 and with_buffer.total_gb - without.total_gb == pytest.approx(4 * p / 1e9)
    assert "weight hand-off buffer 2.0" in with_buffer.summary()
    lora = memory.estimate(QWEN25_05B, _learner(*LORA), False, 80.0, beside=memory.RankExtras(handoff=True))
    assert lora.handoff_gb == pytest.approx(4 * lora.adapter_params / 1e9)
    sync = load_config(None, []).sync
    assert memory.cuda_ipc_handoff(sync, 0.35) and not memory.cuda_ipc_handoff(sync, 0.0)
    assert not memory.cuda_ipc_handoff(load_config(None, ["sync.backend=nccl"]).sync, 0.35)
