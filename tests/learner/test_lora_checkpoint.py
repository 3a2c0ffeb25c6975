"""LoRA checkpoints on the real FSDP2 learner (one gloo rank in the test process): they hold the
adapter and its AdamW state only, resume bit for bit, refuse a run they would not continue
(naming the key), and export as a PEFT adapter and merged, both with the learner's log-probs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from learner_helpers import learner_config, make_groups, prepare_groups
from peft import PeftModel
from reference_logprobs import padded_logprobs
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from async_rl.cli import app
from async_rl.config import LoraConfig
from async_rl.learner import checkpoint
from async_rl.learner.batching import Batch
from async_rl.learner.lora import adapter_named_parameters, wire_name
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.safe_load import SafeFileSystemReader
from async_rl.learner.train_step import Trainer

pytestmark = [pytest.mark.dist]

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.1)  # dropout: the resume must restore the RNG too


def _trainer(model_dir: Path, info: DistInfo, tmp_path: Path, lora: LoraConfig | None = LORA, seed: int = 0) -> Trainer:
    """A policy (LoRA on ``model_dir`` unless ``lora`` is None) and its Trainer; ``seed`` draws the adapters' A."""
    cfg = learner_config(model_dir, tmp_path, "lora-ckpt", "learner.optim.lr=1e-2")
    torch.manual_seed(seed)
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, lora=lora)
    return Trainer(policy, None, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed, lora=lora)


def _batch(seed: int, groups: int = 4) -> Batch:
    return prepare_groups(make_groups(groups, seed=seed), 64, 512).batch


def _save(trainer: Trainer, model_dir: Path, out: Path, version: int, lora: LoraConfig | None = LORA) -> Path:
    path = checkpoint.checkpoint_dir(out, version)
    checkpoint.save(path, trainer.policy, trainer.optimizer, checkpoint.TrainingState(version, trainer.scheduler.state_dict()),
                    model_dir, keep=5, lora=lora)
    return path


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.full_tensor().clone() for name, t in model.state_dict().items()}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapter_only_and_resumes_bit_for_bit(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    straight = _trainer(tiny_model, one_rank, tmp_path)
    for step in range(4):
        straight.step(_batch(step, groups=2), step)

    first = _trainer(tiny_model, one_rank, tmp_path)
    for step in range(2):
        first.step(_batch(step, groups=2), step)
    path = _save(first, tiny_model, tmp_path / "run", 2)
    adapter = {name for name, _ in adapter_named_parameters(first.policy)}
    saved = set(SafeFileSystemReader(path / "model").read_metadata().state_dict_metadata)
    assert saved == adapter  # no base shard, no LogProbHead
    optim = [key.removeprefix("state.") for key in SafeFileSystemReader(path / "optim").read_metadata().state_dict_metadata
             if key.startswith("state.")]  # state.<fqn>.{step,exp_avg,exp_avg_sq}; the rest is param_groups.0.<hyperparameter>
    assert {key.rsplit(".", 1)[0] for key in optim} == adapter
    assert _size(path / "model") < 0.1 * (tiny_model / "model.safetensors").stat().st_size  # 118 kB (rank 4) beside 1.7 MB
    record = json.loads((path / "state.json").read_text())["lora"]
    assert record == {"rank": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": list(LORA.target_modules),
                      "base_model_path": str(tiny_model.absolute()), "base_fingerprint": checkpoint.base_fingerprint(tiny_model)}

    resumed = _trainer(tiny_model, one_rank, tmp_path, seed=1)  # another A: the load must bring the saved one
    state = checkpoint.load(path, resumed.policy, resumed.optimizer, lora=LORA, model_path=tiny_model)
    resumed.scheduler.load_state_dict(state.scheduler)
    assert state.version == 2
    for step in range(2, 4):
        resumed.step(_batch(step, groups=2), step)
    expected, got = _full(straight.policy), _full(resumed.policy)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert straight.scheduler.state_dict() == resumed.scheduler.state_dict()
    assert any(".lora_B." in name and got[name].abs().sum() > 0 for name in got)  # it trained


def test_a_checkpoint_of_another_mode_section_or_base_is_refused_naming_the_key(tiny_model: Path, one_rank: DistInfo,
                                                                                 tmp_path: Path) -> None:
    lora_run = _trainer(tiny_model, one_rank, tmp_path)
    adapter_ckpt = _save(lora_run, tiny_model, tmp_path / "lora", 1)
    full_run = _trainer(tiny_model, one_rank, tmp_path, lora=None)
    full_ckpt = _save(full_run, tiny_model, tmp_path / "full", 1, lora=None)
    assert "lora" not in json.loads((full_ckpt / "state.json").read_text())  # as every checkpoint written before LoRA

    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"learner.lora: .* holds only a LoRA adapter \(learner.lora.rank=4 "
                       r"learner.lora.alpha=8.0 .*--merged"):
        checkpoint.load(adapter_ckpt, full_run.policy, full_run.optimizer)
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"learner.lora: .* holds fully fine-tuned weights .*learner.lora=null"):
        checkpoint.load(full_ckpt, lora_run.policy, lora_run.optimizer, lora=LORA, model_path=tiny_model)
    other = LoraConfig(rank=8, alpha=8.0, dropout=0.0, target_modules=list(LORA.target_modules))
    with pytest.raises(checkpoint.CheckpointMismatchError) as refused:
        checkpoint.load(adapter_ckpt, lora_run.policy, lora_run.optimizer, lora=other, model_path=tiny_model)
    lines = str(refused.value).splitlines()[1:]
    assert [line.split(" but ")[0].strip() for line in lines] == ["learner.lora.rank=8", "learner.lora.dropout=0.0"]
    assert lines[0].strip().startswith("learner.lora.rank=8 but the checkpoint's adapter was trained with learner.lora.rank=4: set it back")

    changed = tmp_path / "other_base"
    shutil.copytree(tiny_model, changed)
    doc = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**doc, "rope_theta": 5000.0}))
    with pytest.raises(checkpoint.CheckpointMismatchError, match=rf"learner.model_path={changed} is not the base model .*"
                       rf"\({tiny_model.absolute()}, fingerprint"):
        checkpoint.load(adapter_ckpt, lora_run.policy, lora_run.optimizer, lora=LORA, model_path=changed)

    # the same base elsewhere, the targets in another order, the full checkpoint without a section: all load
    moved = tmp_path / "moved_base"
    shutil.copytree(tiny_model, moved)
    reordered = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=list(reversed(LORA.target_modules)))
    assert checkpoint.load(adapter_ckpt, lora_run.policy, lora_run.optimizer, lora=reordered, model_path=moved).version == 1
    assert checkpoint.load(full_ckpt, full_run.policy, full_run.optimizer).version == 1

    with pytest.raises(checkpoint.CheckpointMismatchError, match="--merged merges a LoRA checkpoint's adapter .* holds fully fine-tuned"):
        checkpoint.export_hf(full_ckpt, tmp_path / "merged", merged=True)
    done = CliRunner().invoke(app, ["export", str(full_ckpt), "--out", str(tmp_path / "merged"), "--merged"])
    assert done.exit_code == 2 and "--merged" in done.output


def test_the_exported_adapter_and_the_merged_model_give_the_learners_logprobs(tiny_model: Path, one_rank: DistInfo,
                                                                              tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path)
    batch = _batch(7)
    trainer.step(batch, 0)
    path = _save(trainer, tiny_model, tmp_path / "run", 1)
    learner = trainer._all_rows_logp(trainer.policy, batch)  # eval mode: no dropout
    mask = batch.response_mask.bool()

    runner = CliRunner()
    done = runner.invoke(app, ["export", str(path), "--out", str(tmp_path / "adapter")])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["r"], config["lora_alpha"]) == (str(tiny_model.absolute()), 4, 8.0)
    exported = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    trained = {wire_name(name): p.full_tensor() for name, p in adapter_named_parameters(trainer.policy)}
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), tmp_path / "adapter").eval()
    done = runner.invoke(app, ["export", str(path), "--out", str(tmp_path / "merged"), "--merged"])
    assert done.exit_code == 0, done.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not any("lora" in name for name in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        got = {name: padded_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_positions)[0][mask]
               for name, model in (("peft", peft_model), ("merged", merged), ("base", base))}
    torch.testing.assert_close(got["peft"], learner[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["merged"], learner[mask], atol=1e-5, rtol=0)
    assert (got["base"] - learner[mask]).abs().max() > 1e-3  # the adapter changed the policy


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.integration
def test_vllm_serves_the_exported_adapter_by_path_with_the_learners_logprobs(tiny_model: Path, one_rank: DistInfo, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh LoRA engine loads the exported PEFT directory as any adapter (``LoRARequest`` with
    its path) and serves the log-probs of transformers + PEFT on it (which equal the learner's, above)."""
    import vllm
    from vllm.lora.request import LoRARequest

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache, not a share of the host's memory
    lora = LoraConfig(rank=8, alpha=16.0)
    trainer = _trainer(tiny_model, one_rank, tmp_path, lora=lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a large adapter (one rank: the local shard is the whole B), so that serving the base would show
        for name, param in adapter_named_parameters(trainer.policy):
            if ".lora_B." in name:
                param.to_local().copy_(torch.randn(param.shape, generator=gen) * 0.3)
    path = _save(trainer, tiny_model, tmp_path / "run", 1, lora=lora)
    adapter_dir = checkpoint.export_hf(path, tmp_path / "adapter")

    prompts = [[5, 17, 42, 99], [200, 3, 64]]
    llm = vllm.LLM(model=str(tiny_model), skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
                   enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=LoRARequest("exported", 1, str(adapter_dir)))
    finally:
        llm.llm_engine.engine_core.shutdown()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), adapter_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    moved = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        served = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            expected, plain = ([m(ids).logits.log_softmax(-1)[0, len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
                               for m in (peft_model, base))
        assert served == pytest.approx(expected, abs=2e-3)
        moved = max(moved, max(abs(s - p) for s, p in zip(served, plain, strict=True)))
    assert moved > 0.1  # the engine served the adapter, not the base


@pytest.mark.slow
@pytest.mark.integration
def test_a_lora_checkpoint_of_one_rank_resumes_on_two(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    """DCP reshards the adapter-only shards: two ranks load what one saved, A, B and AdamW state alike."""
    from learner_helpers import SPAWN, lora_resume_main

    from async_rl.learner.model import free_port

    trainer = _trainer(tiny_model, one_rank, tmp_path)
    trainer.step(_batch(0), 0)
    path = _save(trainer, tiny_model, tmp_path / "run", 1)
    adapter = adapter_named_parameters(trainer.policy)
    saved = {name: p.full_tensor() for name, p in adapter}
    saved_exp_avg = {name: trainer.optimizer.state[p]["exp_avg"].full_tensor() for name, p in adapter}

    port, out = free_port(), tmp_path / "resumed.pt"
    procs = [SPAWN.Process(target=lora_resume_main, args=(r, 2, port, str(tiny_model), LORA, str(path), str(out)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    resumed = torch.load(out, weights_only=True)
    assert resumed["params"].keys() == saved.keys()
    for name in saved:
        assert torch.equal(resumed["params"][name], saved[name]), name
        assert torch.equal(resumed["exp_avg"][name], saved_exp_avg[name]), name
