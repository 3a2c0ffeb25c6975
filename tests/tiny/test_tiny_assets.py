"""Tiny assets on real parts: the build's files, determinism, transformers loading, and
the base model's accuracy band recomputed here without the build's decoding code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.envs.builtin import FEEDBACK, extract_answer, feedback
from async_rl.tiny import TinyAssetsReport, build_tiny_assets
from async_rl.tiny.addition import AdditionTask, is_correct, make_splits, read_jsonl
from async_rl.tiny.build import WARM_START, WarmStart, weights_sha256
from async_rl.tiny.text import N_TRAIN, N_VAL, write_validation_split

ACCURACY_SLACK = 0.02
"""|recomputed - manifest| greedy accuracy allowed: the build decodes in one padded
batch, this test one problem at a time, and float32 kernels differ between the two."""


def test_extract_answer_is_strict() -> None:
    assert extract_answer("432") == "432"
    assert extract_answer(" -7\n") == "-7"
    assert extract_answer("") is None
    assert extract_answer("43 2") is None
    assert extract_answer("The answer is 432") is None
    assert is_correct("132 ", "132")
    assert not is_correct("0132", "132")
    assert not is_correct("13", "132")


def test_splits_are_deterministic_disjoint_and_correct() -> None:
    task = AdditionTask(a_digits=2, b_digits=3)
    train, val = make_splits(task, seed=3, n_train=500, n_val=50)
    assert (train, val) == make_splits(task, seed=3, n_train=500, n_val=50)
    assert (train, val) != make_splits(task, seed=4, n_train=500, n_val=50)
    assert len({r.problem for r in train + val}) == 550
    for row in train + val:
        a, b = row.problem.removeprefix("What is ").removesuffix("?").split("+")
        assert (len(a), len(b)) == (2, 3)
        assert int(row.answer) == int(a) + int(b)
    with pytest.raises(ValueError, match="has only 81"):
        make_splits(AdditionTask(1, 1), seed=0, n_train=81, n_val=1)
    assert make_splits(task, seed=3, n_train=500, n_val=80)[1][:50] == val  # a larger split extends the smaller one


@pytest.mark.assets
def test_files_and_manifest(tiny_assets: TinyAssetsReport) -> None:
    model_dir = tiny_assets.model_dir
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    train, val = read_jsonl(tiny_assets.train_path), read_jsonl(tiny_assets.val_path)
    assert (len(train), len(val)) == (N_TRAIN, N_VAL)
    assert not {r.problem for r in train} & {r.problem for r in val}
    for line in tiny_assets.val_path.read_text().splitlines():
        assert set(json.loads(line)) == {"problem", "answer"}
    manifest = json.loads(tiny_assets.manifest_path.read_text())
    assert manifest["seed"] == 0
    assert manifest["weights_sha256"] == weights_sha256(model_dir) == tiny_assets.weights_sha256
    assert manifest["base_accuracy"] == tiny_assets.base_accuracy
    assert manifest["model_dir"] == "model" and manifest["val_path"] == "data/val.jsonl"
    assert {"torch", "transformers", "tokenizers"} <= set(manifest["versions"])


@pytest.mark.assets
def test_a_larger_validation_split_extends_val_and_stays_out_of_train(tiny_assets: TinyAssetsReport, tmp_path: Path) -> None:
    """``async-rl assets val-split``: written beside a copy of the assets (the fixture's are shared)."""
    shutil.copytree(tiny_assets.data_dir, tmp_path / "data")
    shutil.copy(tiny_assets.manifest_path, tmp_path / "assets.json")
    path = write_validation_split(tmp_path, 1500)
    rows, train = read_jsonl(path), read_jsonl(tiny_assets.train_path)
    assert path == tmp_path / "data" / "val_1500.jsonl" and len({r.problem for r in rows}) == 1500
    assert rows[:N_VAL] == read_jsonl(tiny_assets.val_path) and not {r.problem for r in rows} & {r.problem for r in train}
    (tmp_path / "data" / "train.jsonl").write_text("".join(r.to_json() + "\n" for r in train[1:]))
    with pytest.raises(ValueError, match="rebuild the assets"):
        write_validation_split(tmp_path, 300)


@pytest.mark.assets
def test_same_seed_rebuilds_identical_assets(tiny_assets: TinyAssetsReport, tmp_path: Path) -> None:
    # Two builds with a 10-step warm start (the full one takes a minute): every stage runs, and
    # determinism of each step is determinism of the whole schedule.
    short = WarmStart(warmup_steps=5, eval_every=10, band=(0.0, 1.0), target=0.0, max_steps=10, eval_rows=16)
    threads = torch.get_num_threads()
    first = build_tiny_assets(tmp_path / "a", seed=0, progress=lambda _: None, warm_start=short)
    again = build_tiny_assets(tmp_path / "b", seed=0, progress=lambda _: None, warm_start=short)
    assert torch.get_num_threads() == threads  # the build restores the caller's setting
    tokenizer_json = (tiny_assets.model_dir / "tokenizer.json").read_bytes()
    assert (first.model_dir / "tokenizer.json").read_bytes() == (again.model_dir / "tokenizer.json").read_bytes() == tokenizer_json
    assert weights_sha256(again.model_dir) == weights_sha256(first.model_dir) != weights_sha256(tiny_assets.model_dir)
    for split in ("train.jsonl", "val.jsonl"):
        assert (again.data_dir / split).read_bytes() == (tiny_assets.data_dir / split).read_bytes()
    assert (again.base_accuracy, again.sft_steps) == (first.base_accuracy, first.sft_steps) and again.sft_steps == 10
    recorded = json.loads(again.manifest_path.read_text())["warm_start"]
    assert (recorded["max_steps"], recorded["eval_rows"]) == (10, 16)


@pytest.mark.assets
def test_multiturn_assets_know_the_feedback_and_warm_start_on_second_turns(tiny_assets: TinyAssetsReport, tmp_path: Path) -> None:
    from async_rl.tiny.text import _examples

    short = WarmStart(warmup_steps=5, eval_every=10, band=(0.0, 1.0), target=0.0, max_steps=10, eval_rows=16)
    report = build_tiny_assets(tmp_path, seed=0, progress=lambda _: None, warm_start=short, task="multiturn")
    assert json.loads(report.manifest_path.read_text())["task"]["name"] == "multiturn"
    assert (report.data_dir / "train.jsonl").read_bytes() == (tiny_assets.data_dir / "train.jsonl").read_bytes()
    multiturn, single = (AutoTokenizer.from_pretrained(d) for d in (report.model_dir, tiny_assets.model_dir))
    for text in FEEDBACK:  # the environment's messages are a token per word and the period, not one per byte
        assert len(multiturn.encode(text)) == len(text.split()) + 1 < len(single.encode(text))
    rows = read_jsonl(report.train_path)[:4]
    examples = _examples(multiturn, rows, feedback_seed=0)
    for i, ((prompt, completion), row) in enumerate(zip(examples, rows)):
        text = multiturn.decode(prompt)
        assert multiturn.decode(completion) == row.answer and text.endswith("<|im_start|>assistant\n")
        assert text.count("<|im_start|>assistant") == (2 if i % 2 else 1)  # every other example: a wrong answer first
        if i % 2:
            wrong = int(text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
            assert wrong != int(row.answer) and feedback(wrong, int(row.answer)) in text
    with pytest.raises(ValueError, match="unknown tiny task 'chess'"):
        build_tiny_assets(tmp_path / "x", task="chess")


@pytest.mark.assets
def test_loads_in_transformers_with_chat_template(tiny_assets: TinyAssetsReport) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 47+38?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 47+38?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 47+38?"}], add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.decode(ids) == text
    # digits are single tokens, so every number is spelt digit by digit
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("85", add_special_tokens=False)) == ["8", "5"]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.vocab_size == len(tokenizer) == tiny_assets.vocab_size
    assert cfg.eos_token_id == tokenizer.eos_token_id
    assert set(model.generation_config.eos_token_id) == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert sum(p.numel() for p in model.parameters()) == tiny_assets.num_parameters


@pytest.mark.assets
@pytest.mark.slow
def test_base_accuracy_in_band(tiny_assets: TinyAssetsReport) -> None:
    """Greedy decoding written out here (full forward per token, no KV cache, no padding)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir).eval()
    eos = tokenizer.eos_token_id
    rows = read_jsonl(tiny_assets.val_path)
    correct = 0
    with torch.no_grad():
        for row in rows:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": row.problem}], add_generation_prompt=True, return_dict=False
            )
            completion: list[int] = []
            while len(completion) < 8 and (not completion or completion[-1] != eos):
                logits = model(torch.tensor([list(ids) + completion])).logits
                completion.append(int(logits[0, -1].argmax()))
            correct += is_correct(tokenizer.decode(completion, skip_special_tokens=True), row.answer)
    accuracy = correct / len(rows)
    low, high = WARM_START.band
    assert low <= accuracy <= high
    assert accuracy == pytest.approx(tiny_assets.base_accuracy, abs=ACCURACY_SLACK)


@pytest.mark.assets
def test_greedy_episodes_play_the_environment_turn_by_turn(tiny_assets: TinyAssetsReport) -> None:
    """The multi-turn warm-start's measure (greedy_episode_success): one turn is the single-turn
    greedy accuracy; each further turn answers the wrong ones with the environment's feedback,
    so it can only win more (this single-turn model, never taught the feedback, mostly repeats
    itself; the multi-turn build's 47.0 % matched `async-rl eval`'s episodes through vLLM and
    the real environment, 47.0 %, on 2026-12-02)."""
    from async_rl.tiny.text import greedy_accuracy, greedy_episode_success

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir).eval()
    rows = read_jsonl(tiny_assets.val_path)[:64]
    one = greedy_episode_success(model, tokenizer, rows, max_turns=1)
    assert one == greedy_accuracy(model, tokenizer, rows)
    three = greedy_episode_success(model, tokenizer, rows, max_turns=3)
    assert one <= three <= 1.0, (one, three)
