"""Replay-queue throughput: ReplayQueue put/get/commit vs raw XADD/XREADGROUP/XACK.

One process, one embedded redis-server (AOF, ``appendfsync always`` unless told
otherwise), the same payload for both paths: groups of 8 samples x 1024 response tokens
with log-probs. Also times msgspec against pickle for encoding one group.

    python benchmarks/queue_throughput.py --json benchmarks/results/queue_throughput.json

Targets: ``ratio_vs_raw >= 0.5`` and ``encode_us + decode_us <= 100``; exits 1 if missed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.queue.client import connect
from async_rl.queue.keys import CONSUMER_GROUP, PAYLOAD_FIELD
from async_rl.records import RolloutGroup, Sample, decode, encode

SAMPLES, RESPONSE_TOKENS, PROMPT_TOKENS = 8, 1024, 256
RATIO_TARGET, CODEC_TARGET_US = 0.5, 100.0


def make_payload() -> RolloutGroup:
    rng = random.Random(0)
    samples = [
        Sample.from_lists(
            [rng.randrange(150_000) for _ in range(RESPONSE_TOKENS)],
            [-rng.random() * 5 for _ in range(RESPONSE_TOKENS)],
            [7] * 600 + [8] * (RESPONSE_TOKENS - 600),
            reward=rng.random(),
            reward_components={"answer": 1.0, "format": 0.1},
            finish_reason="length",
        )
        for _ in range(SAMPLES)
    ]
    prompt = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    return RolloutGroup.from_lists("bench", "g0", 0, prompt, samples, "server-0", 2.5)


def per_call_us(fn: Callable[[], object], number: int = 2000) -> float:
    """Best of 5 repeats, microseconds per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def queue_rate(url: str, run: str, group: RolloutGroup, n: int, batch: int) -> float:
    """Groups/s through ReplayQueue: put ``batch``, get them, commit them; ``n`` in all."""
    with ReplayQueue(url, run, max_depth=batch) as q:
        start = time.perf_counter()
        for _ in range(n // batch):
            for _ in range(batch):
                q.put(group)
            items = q.get(batch, timeout=10.0)
            q.commit(entry_id for entry_id, _ in items)
        return (n // batch) * batch / (time.perf_counter() - start)


def raw_rate(url: str, run: str, data: bytes, n: int, batch: int) -> float:
    """Groups/s of the same bytes through plain XADD + XREADGROUP + XACK."""
    client = connect(url, socket_timeout_s=10.0)
    stream = f"{run}:raw"
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    start = time.perf_counter()
    for _ in range(n // batch):
        for _ in range(batch):
            client.xadd(stream, {PAYLOAD_FIELD: data})
        reply: Any = client.xreadgroup(
            CONSUMER_GROUP, "raw", {stream: ">"}, count=batch, block=10_000
        )
        client.xack(stream, CONSUMER_GROUP, *(entry_id for entry_id, _ in reply[0][1]))
    elapsed = time.perf_counter() - start
    client.delete(stream)
    client.close()
    return (n // batch) * batch / elapsed


def measure_paths(
    url: str, group: RolloutGroup, n: int, batch: int, rounds: int
) -> tuple[float, float]:
    """Median groups/s of (queue, raw), rounds interleaved so load drifts hit both alike."""
    data = encode(group)
    ours, raw = [], []
    for r in range(rounds):
        ours.append(queue_rate(url, f"bench{r}", group, n, batch))
        raw.append(raw_rate(url, f"bench{r}", data, n, batch))
    return statistics.median(ours), statistics.median(raw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--groups", type=int, default=512, help="groups per round and path")
    parser.add_argument("--batch", type=int, default=32, help="groups per get/commit")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    group = make_payload()
    data = encode(group)
    pickled = pickle.dumps(group, protocol=pickle.HIGHEST_PROTOCOL)
    result: dict[str, object] = {
        "encode_us": per_call_us(lambda: encode(group)),
        "decode_us": per_call_us(lambda: decode(data)),
        "pickle_encode_us": per_call_us(lambda: pickle.dumps(group, pickle.HIGHEST_PROTOCOL)),
        "pickle_decode_us": per_call_us(lambda: pickle.loads(pickled)),
    }
    for fsync in ("always", "everysec"):
        with EmbeddedRedis(appendfsync=fsync) as url:
            ours, raw = measure_paths(url, group, args.groups, args.batch, args.rounds)
        if fsync == "always":  # the default: the headline numbers
            result |= {
                "groups_per_s": ours,
                "mb_per_s": ours * len(data) / 1e6,
                "raw_groups_per_s": raw,
                "ratio_vs_raw": ours / raw,
            }
        else:  # what the fsync-per-write guarantee costs
            result |= {"everysec_groups_per_s": ours, "everysec_raw_groups_per_s": raw}
    codec_ok = result["encode_us"] + result["decode_us"] <= CODEC_TARGET_US  # type: ignore[operator]
    ratio_ok = result["ratio_vs_raw"] >= RATIO_TARGET  # type: ignore[operator]
    result |= {
        "targets_met": bool(codec_ok and ratio_ok),
        "payload_bytes": len(data),
        "pickle_payload_bytes": len(pickled),
        "groups": args.groups,
        "batch": args.batch,
        "rounds": args.rounds,
        "appendfsync": "always",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "unix_time": time.time(),
    }
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
