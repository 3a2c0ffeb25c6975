"""Checkpoint -> `async-rl export` -> a Hugging Face directory whose log-probs match the learner's."""

from __future__ import annotations

import pytest
from pathlib import Path

import torch
from learner_helpers import learner_config, make_groups, prepare_groups
from reference_logprobs import padded_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from async_rl.cli import app
from async_rl.learner import checkpoint
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.train_step import Trainer


@pytest.mark.dist
def test_exported_checkpoint_loads_in_transformers_with_the_learners_logprobs(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    cfg = learner_config(tiny_model, tmp_path, "export")
    policy = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True)
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, one_rank, 4, 1)
    batch = prepare_groups(make_groups(4, seed=5), 64, 512).batch
    trainer.step(batch, 0)  # the export must carry trained weights, not the base model's
    path = checkpoint.checkpoint_dir(tmp_path, 1)
    state = checkpoint.TrainingState(1, trainer.scheduler.state_dict())
    checkpoint.save(path, policy, trainer.optimizer, state, tiny_model, keep=2)

    out = tmp_path / "hf"
    done = CliRunner().invoke(app, ["export", str(path), "--out", str(out)])
    assert done.exit_code == 0, done.output
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<eos>"
    with torch.no_grad():
        learner_logp, _, _ = trainer._logprobs(policy, batch)
        exported_logp, _ = padded_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_positions)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(exported_logp[mask], learner_logp[mask], rtol=0, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        base_logp, _ = padded_logprobs(base, batch.input_ids, batch.attention_mask, batch.response_positions)
    assert (base_logp[mask] - learner_logp[mask]).abs().max() > 1e-4


def test_export_of_an_incomplete_checkpoint_fails_with_exit_code_2(tmp_path: Path) -> None:
    done = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert done.exit_code == 2 and "not a complete checkpoint" in done.output
