"""Vision-language groups through the worker and a real redis-server: the image travels by
reference (stored once per content), the group holds the prompt as the engine expanded it.

The inference server is a stand-in coroutine here (the worker's bookkeeping is under test);
tests/rollout/test_vlm_server.py runs the real vLLM engine on the tiny VLM."""

from __future__ import annotations

import pytest
import asyncio
import base64
import io
import json
from pathlib import Path

from PIL import Image

from async_rl.config import RewardConfig
from async_rl.data.images import PixelBounds, decode_blob
from async_rl.data.prompts import read_prompt_rows
from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.records import decode, encode
from async_rl.rewards import RewardPool, RewardScorer
from async_rl.rollout.types import Completion, Sampling
from async_rl.rollout.worker import RolloutWorker, WorkerSettings

pytestmark = [pytest.mark.redis]

IMAGE_TOKEN, EXPANSION = 99, [97, 99, 99, 99, 99, 97]  # a stand-in processor: one image -> 6 tokens
SEEN: list[tuple[list[int], list[Image.Image] | None]] = []


async def _generate(prompt_token_ids: list[int], n: int, sampling: Sampling, images: list[Image.Image] | None = None) -> list[Completion]:
    SEEN.append((prompt_token_ids, images))
    expanded = [t for tok in prompt_token_ids for t in (EXPANSION if tok == IMAGE_TOKEN else [tok])]
    return [Completion([5, 6], [-0.5, -0.7], [0, 0], "stop", "red", prompt_token_ids=expanded if images else None) for _ in range(n)]


def _uri(colour: tuple[int, int, int]) -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_eight_samples_of_one_image_store_it_once(tmp_path: Path) -> None:
    red, blue = _uri((255, 0, 0)), _uri((0, 0, 255))
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "<image>Which colour?", "answer": "red", "images": [red]},
        {"problem": "<image>Colour again?", "answer": "red", "images": [red]},  # same pixels, another prompt
        {"problem": "<image>And this one?", "answer": "blue", "images": [blue]},
        {"problem": "No image", "answer": "red"},
    ]) + "\n")
    rows, rejected = read_prompt_rows(data)
    assert not rejected

    def encode_prompt(text: str, num_images: int = 0) -> list[int]:
        return [1, 2] + [IMAGE_TOKEN] * num_images + [3]

    SEEN.clear()
    with EmbeddedRedis() as url, ReplayQueue(url, run="vlm", max_depth=100) as queue, RewardPool(RewardConfig(num_workers=1)) as rewards:
        settings = WorkerSettings(run_id="vlm", server_id="server-0", n=8, sampling=Sampling(max_tokens=4), batch_size=100,
                                  max_staleness=0, shuffle=False, pixel_bounds=PixelBounds(1, 10_000), image_ttl_s=600)
        worker = RolloutWorker(settings, queue, rows, encode_prompt, RewardScorer(rewards, rewards.cfg, 4), lambda: _generate)
        asyncio.run(worker.run(asyncio.Event(), max_groups=4))
        groups = [g for _, g in queue.get(4, timeout=5.0)]
        image_keys = sorted(queue._client.keys(f"{queue.keys.run}:image:*"))
        ttl_s = queue._client.ttl(image_keys[0])
        stored = queue.get_images([ref.sha256 for g in groups for ref in g.images])

    assert worker.counters.groups_put == 4
    by_prompt = {g.prompt_id: g for g in groups}
    assert [len(by_prompt[i].samples) for i in range(4)] == [8, 8, 8, 8]
    # one key per image content: the red image of two groups (16 samples) is stored once
    assert len(image_keys) == 2 and len(stored) == 2
    assert by_prompt[0].images == by_prompt[1].images != by_prompt[2].images and by_prompt[3].images == []
    assert 0 < ttl_s <= 600
    ref = by_prompt[0].images[0]
    assert (ref.width, ref.height) == (8, 8)
    assert decode_blob(stored[ref.sha256], 2**20).getpixel((0, 0)) == (255, 0, 0)
    # the record holds the prompt as the engine expanded it; the request had one placeholder
    assert list(by_prompt[0].prompt_array()) == [1, 2, *EXPANSION, 3]
    assert list(by_prompt[3].prompt_array()) == [1, 2, 3]
    requests = {tuple(p): imgs for p, imgs in SEEN}
    assert requests[(1, 2, IMAGE_TOKEN, 3)] is not None and requests[(1, 2, 3)] is None
    # the image is not inlined in the record
    record = encode(by_prompt[0])
    assert stored[ref.sha256][8:40] not in record and decode(record) == by_prompt[0]
