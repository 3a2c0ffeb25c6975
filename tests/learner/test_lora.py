"""A LoRA policy on the real FSDP2 learner (one gloo rank in the test process, and two spawned): only the float32
adapters train and hold optimizer state, the base stays bit for bit, the packed log-probs equal
an unsharded transformers + PEFT forward, disabling the adapters gives the base model, and the
targets are checked against the model without loading it. The Trainer's reference is the policy
with its adapters disabled, its tables are computed without dropout, and a full critic trains
beside the adapter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from learner_helpers import learner_config, make_groups, prepare_groups
from reference_logprobs import padded_logprobs
from torch import Tensor
from transformers import AutoModelForCausalLM, Qwen2Config

from async_rl.config import ConfigError, LoraConfig
from async_rl.learner.batching import Batch
from async_rl.learner.lora import adapter_named_parameters, adapter_spec, adapters_disabled, peft_config, target_problems, wire_name
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.train_step import Trainer
from async_rl.learner.vision import UnsupportedVisionModel
from async_rl.sync.control import AdapterSpec

LORA = LoraConfig(rank=4, alpha=8.0)
TARGETS = 2 * 7  # 2 decoder layers x 7 projections of the tiny Qwen2


def _trainer(model_dir: Path, info: DistInfo, tmp_path: Path, *overrides: str, lora: LoraConfig = LORA) -> Trainer:
    cfg = learner_config(model_dir, tmp_path, "lora", *overrides)
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, lora=lora)
    critic = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, value_model=True) if cfg.algorithm.needs_critic else None
    return Trainer(policy, None, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed, critic=critic, lora=lora)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.full_tensor().clone() for name, t in model.state_dict().items()}


def _batch(seed: int) -> Batch:
    return prepare_groups(make_groups(4, seed=seed), 64, 512).batch


def _base_logp(model_dir: Path, batch: Batch) -> Tensor:
    """The plain base model's log-probs ``[N, T]`` of ``batch`` (one padded forward)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return padded_logprobs(base, batch.input_ids, batch.attention_mask, batch.response_positions)[0]


@pytest.mark.dist
def test_only_the_float32_adapter_trains_and_the_base_stays_bit_for_bit(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path, "learner.ppo_mini_batches=2")
    policy = trainer.policy
    adapter = dict(adapter_named_parameters(policy))
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable == set(adapter) and len(adapter) == 2 * TARGETS
    assert all(p.dtype == torch.float32 for p in adapter.values())
    assert policy.lm_head.weight.requires_grad is False  # the LogProbHead stays frozen: no [V, H] gradient
    assert {id(p) for p in trainer.optimizer.param_groups[0]["params"]} == {id(p) for p in adapter.values()}

    # one backward: gradients on the adapter only (ChunkedLogProbs skips the head's weight gradient)
    micro = _batch(1).select([0, 1])
    logp, _, _ = trainer._logprobs(policy, micro)
    (logp * micro.response_mask).sum().backward()
    assert {name for name, p in policy.named_parameters() if p.grad is not None} == set(adapter)
    assert policy.lm_head.weight.grad is None
    trainer.optimizer.zero_grad(set_to_none=True)

    before = _full(policy)
    steps = [trainer.step(_batch(seed), seed) for seed in range(2)]
    assert sum(s.optimizer_steps for s in steps) == 4
    assert {id(p) for p in trainer.optimizer.state} == {id(p) for p in adapter.values()}  # AdamW state for the adapter only
    after = _full(policy)
    base = [name for name in before if name not in adapter]
    assert any(".base_layer." in name for name in base)
    for name in base:
        assert torch.equal(before[name], after[name]), name
    for name in adapter:
        if ".lora_B." in name:
            assert not torch.equal(before[name], after[name]) and after[name].abs().sum() > 0, name


@pytest.mark.dist
def test_packed_logprobs_equal_transformers_with_peft_and_disabled_adapters_the_base(tiny_model: Path, one_rank: DistInfo,
                                                                                      tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path, "learner.optim.lr=1e-2")
    policy = trainer.policy
    batch = _batch(3)
    with adapters_disabled(policy):  # the first forward: FSDP2 initialises itself here, adapters disabled
        start = trainer._all_rows_logp(policy, batch)
    trainer.step(batch, 0)  # B moves off zero
    packed = trainer._all_rows_logp(policy, batch)
    with adapters_disabled(policy):
        disabled = trainer._all_rows_logp(policy, batch)
    assert all(p.requires_grad for _, p in adapter_named_parameters(policy))  # enabled again, still trainable

    mask = batch.response_mask.bool()
    base_logp = _base_logp(tiny_model, batch)
    torch.testing.assert_close(disabled[mask], base_logp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(start[mask], base_logp[mask], atol=1e-5, rtol=0)

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    reference.add_adapter(peft_config(LORA))
    trained = {name: p.full_tensor() for name, p in adapter_named_parameters(policy)}
    with torch.no_grad():
        for name, param in adapter_named_parameters(reference):
            param.copy_(trained[name])
        expected, _ = padded_logprobs(reference, batch.input_ids, batch.attention_mask, batch.response_positions)
    torch.testing.assert_close(packed[mask], expected[mask], atol=1e-5, rtol=0)
    assert (packed[mask] - base_logp[mask]).abs().max() > 1e-3  # the adapter changed the policy


@pytest.mark.dist
def test_a_first_forward_with_adapters_disabled_keeps_float32_gradients(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    # bfloat16 compute: FSDP2 fixes the gradients' dtype at its first forward from requires_grad,
    # which PEFT clears on the adapters it disables (bfloat16 gradients would then be refused)
    trainer = _trainer(tiny_model, one_rank, tmp_path, "learner.fsdp.param_dtype=bfloat16")
    batch = _batch(4)
    with adapters_disabled(trainer.policy):
        trainer._all_rows_logp(trainer.policy, batch)
    assert trainer.step(batch, 0).optimizer_steps == 1
    assert all(p.dtype == torch.float32 for _, p in adapter_named_parameters(trainer.policy))
    assert {p.dtype for n, p in trainer.policy.named_parameters() if ".base_layer." in n} == {torch.bfloat16}  # no float32 master copy


@pytest.mark.dist
def test_gradient_checkpointing_gives_the_same_adapter_gradients(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    micro = _batch(5).select([0, 1, 2])
    grads = []
    for setting in ("off", "on"):
        torch.manual_seed(0)  # the same random A
        trainer = _trainer(tiny_model, one_rank, tmp_path, f"learner.fsdp.gradient_checkpointing={setting}")
        with torch.no_grad():  # a non-zero B, the same in both
            for name, p in adapter_named_parameters(trainer.policy):
                if ".lora_B." in name:
                    p.fill_(0.01)
        logp, _, _ = trainer._logprobs(trainer.policy, micro)
        (logp * micro.response_mask).sum().backward()
        grads.append({name: p.grad.full_tensor() for name, p in adapter_named_parameters(trainer.policy)})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
    assert all(g.abs().sum() > 0 for g in grads[0].values())


@pytest.mark.dist
def test_a_vision_language_policy_is_refused(tmp_path: Path, one_rank: DistInfo) -> None:
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, vocab_size=300),
                              vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=64))
    config.save_pretrained(tmp_path)  # the refusal comes before any weight is read
    cfg = learner_config(tmp_path, tmp_path, "vlm")
    with pytest.raises(UnsupportedVisionModel, match="learner.lora is not supported for a vision-language model"):
        load_sharded(str(tmp_path), cfg.learner, one_rank.device, trainable=True, lora=LORA)
    (problem,) = target_problems(config.to_dict(), LORA)
    assert "learner.lora is not supported for a vision-language model" in problem


def test_the_targets_are_checked_against_the_model() -> None:
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=300).to_dict()
    assert target_problems(config, LoraConfig()) == []
    assert target_problems(config, LoraConfig(target_modules=["q_proj", "v_proj"])) == []
    problems = target_problems(config, LoraConfig(target_modules=["q_proj", "qproj", "mlp"]))
    assert problems == [
        "learner.lora.target_modules: 'qproj' matches no module of this model",
        "learner.lora.target_modules: 'mlp' names a module that is not a Linear layer",
        "learner.lora.target_modules: valid module names of this model: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    ]
    unservable = target_problems(config, LoraConfig(target_modules=["q_proj", "lm_head", "embed_tokens"]))
    assert len(unservable) == 1 and "vLLM cannot serve a LoRA on ['lm_head', 'embed_tokens']" in unservable[0]


@pytest.mark.dist
def test_the_section_s_rules_name_the_key(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    assert LoraConfig().problems() == []
    (empty,) = LoraConfig(target_modules=[]).problems()
    assert empty.startswith("learner.lora.target_modules must name at least one module")
    (twice,) = LoraConfig(target_modules=["q_proj", "v_proj", "q_proj"]).problems("x.")
    assert twice.startswith("x.target_modules=['q_proj', 'v_proj', 'q_proj'] names ['q_proj'] more than once")
    cfg = learner_config(tiny_model, tmp_path, "lora")
    for bad, key in ((LoraConfig(rank=0), "learner.lora.rank=0 must be in [1, 512]"),
                     (LoraConfig(dropout=1.0), "learner.lora.dropout=1.0 must be in [0, 1)"),
                     (LoraConfig(target_modules=["lm_head"]), "learner.lora.target_modules=['lm_head']: vLLM cannot serve")):
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True, lora=bad)
    with pytest.raises(ValueError, match="trainable policy only"):
        load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=False, lora=LORA)


def test_wire_names_and_the_announced_spec() -> None:
    assert wire_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert wire_name("model.layers.1.mlp.down_proj.lora_B.default.weight") == "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    for name in ("model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.lora_A.other.weight"):
        with pytest.raises(ValueError, match="not a LoRA parameter"):
            wire_name(name)
    assert adapter_spec(LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])) == AdapterSpec(8, 16.0, ("q_proj", "v_proj"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.integration
def test_two_ranks_train_the_adapter_and_keep_the_base(tiny_model: Path, tmp_path: Path) -> None:
    from learner_helpers import SPAWN, lora_rank_main

    from async_rl.learner.model import free_port

    port = free_port()
    procs = [SPAWN.Process(target=lora_rank_main, args=(r, 2, port, str(tiny_model), str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    saved = torch.load(tmp_path / "lora.pt", weights_only=False)
    params, batch = saved["params"], saved["batch"]

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    plain = base.state_dict()
    adapter = {name: t for name, t in params.items() if ".lora_" in name}
    assert len(adapter) == 2 * TARGETS
    for name, tensor in params.items():  # the base gathered from its shards is the checkpoint's, bit for bit
        if name not in adapter:
            assert torch.equal(tensor, plain[name.replace(".base_layer.", ".")]), name
    q_out, hidden = plain["model.layers.0.self_attn.q_proj.weight"].shape
    assert adapter["model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (4, hidden)
    assert adapter["model.layers.0.self_attn.q_proj.lora_B.default.weight"].shape == (q_out, 4)  # not out / world_size rows
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if ".lora_B." in name)

    base.add_adapter(peft_config(LORA))
    with torch.no_grad():
        for name, param in adapter_named_parameters(base):
            param.copy_(adapter[name])
        expected, _ = padded_logprobs(base, batch.input_ids, batch.attention_mask, batch.response_positions)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(saved["logp"][mask], expected[mask], atol=1e-5, rtol=0)


# -- the Trainer: reference = the adapters disabled, eval-mode tables, critic ---------------------


@pytest.mark.dist
def test_the_reference_is_the_base_model_and_the_kl_grows_from_zero(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path, "algorithm.loss.kl_coef=0.1", "algorithm.kl_in_reward=true",
                       "algorithm.kl_ctrl.kl_coef=0.5", "learner.optim.lr=1e-2", "learner.ppo_mini_batches=2")
    assert trainer.reference is None
    batch = _batch(6)
    mask = batch.response_mask.bool()
    base = _base_logp(tiny_model, batch)
    torch.testing.assert_close(trainer._reference_logp(batch)[mask], base[mask], atol=1e-5, rtol=0)
    first = trainer.step(batch, 0).metrics
    assert first["reward/kl"] == 0.0  # B = 0: the recomputed proximal policy is the base, bit for bit
    second = trainer.step(batch, 1).metrics
    torch.testing.assert_close(trainer._reference_logp(batch)[mask], base[mask], atol=1e-5, rtol=0)  # still the base
    assert second["reward/kl"] != 0 and second["actor/kl_loss"] > first["actor/kl_loss"] >= 0  # the policy left it (k1 may be < 0)
    assert all(p.requires_grad for _, p in adapter_named_parameters(trainer.policy)) and trainer.policy.training
    cfg = learner_config(tiny_model, tmp_path, "lora", "algorithm.loss.kl_coef=0.1")
    with pytest.raises(ValueError, match="with it the reference is the policy with its adapters disabled"):
        Trainer(trainer.policy, trainer.policy, cfg.learner, cfg.algorithm, one_rank, 4, 1, lora=LORA)


@pytest.mark.dist
def test_gae_trains_a_full_critic_beside_a_lora_policy(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path, "algorithm.advantage.name=gae", "learner.critic.optim.lr=1e-3")
    assert trainer.critic is not None
    critic_before = {name: t.full_tensor().clone() for name, t in trainer.critic.state_dict().items()}
    metrics = trainer.step(_batch(8), 0).metrics
    assert metrics["actor/updates"] == 1 and metrics["critic/updates"] == 1
    assert all(math.isfinite(v) for v in metrics.values())
    moved = [name for name, t in trainer.critic.state_dict().items() if not torch.equal(t.full_tensor(), critic_before[name])]
    assert any("score" in name for name in moved) and any(".layers." in name for name in moved)  # the critic trains fully


@pytest.mark.dist
def test_with_dropout_the_proximal_pass_has_none_and_is_recomputed(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path, lora=LoraConfig(rank=4, alpha=8.0, dropout=0.1))
    assert not trainer.single_update and trainer.recompute  # logp.detach() of a pass with dropout is not pi_prox
    policy = trainer.policy
    with torch.no_grad():  # a non-zero B: dropout on the adapter's input changes the output
        for name, p in adapter_named_parameters(policy):
            if ".lora_B." in name:
                p.fill_(0.05)
    batch = _batch(9)
    micro = batch.select([0, 1])
    noisy = [trainer._logprobs(policy, micro)[0].detach() for _ in range(2)]
    assert not torch.equal(noisy[0], noisy[1])  # train mode: dropout is on
    first, second = trainer._all_rows_logp(policy, batch), trainer._all_rows_logp(policy, batch)
    assert torch.equal(first, second) and policy.training  # eval mode inside, train mode again after
    plain = _trainer(tiny_model, one_rank, tmp_path, lora=LoraConfig(rank=4, alpha=8.0))
    assert plain.single_update
