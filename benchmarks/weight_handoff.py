"""The one-GPU weight hand-off: a learner and a receiver process on the same device.

    python benchmarks/weight_handoff.py --shape qwen2.5-0.5b --updates 100 --json OUT.json      # on the GPU machine
    python benchmarks/weight_handoff.py --shape smoke --updates 5 --json OUT.json                # on a CPU (host route only)

This process plays learner rank 0 (a :class:`~async_rl.sync.sender.WeightSender` publishing a
random Qwen2 of ``--shape`` in float32, as the learner sends its master weights); a second
process (``--receive``, started here) is the server: the real
:class:`~async_rl.sync.server.WeightUpdateServer` and receiving protocol, loading into a
transformers model of the same shape (in the serving dtype: bf16 on a GPU, float32 on a CPU)
through :class:`~async_rl.sync.module_receiver.ModuleReceiver`
(vLLM cannot run on the GPU machine; its loader is the one part not measured). Per route
(``cuda``: CUDA IPC, the default on one GPU; ``host``: host shared memory, the fallback),
``--updates`` updates, each changing every weight's first element, and then the served
weights are compared with the sent ones.

Reported per route: whole-update time (announce to the last Ack) and the sender's transfer
(packing into the hand-off buffer) and the receiver's load, in ms (mean, median, max; the
first update apart: it makes the buffer and opens the handle); against them the raw
device-to-device copy of the same bytes in this process; each process's device memory after
the first and the last update (GPU: ``nvidia-smi``'s per-process figure and torch's
allocator; CPU: resident set) and its growth over the run, which must stay under
:data:`GROWTH_LIMIT_MB`. Exit status 1 when a route failed, served other weights, or grew.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from learner_gpu import SHAPES, VOCAB  # noqa: E402

from async_rl.sync.auth import RunSecret, SyncEndpoint  # noqa: E402
from async_rl.sync.buckets import tensor_specs  # noqa: E402
from async_rl.sync.module_receiver import LocalEngine, ModuleReceiver  # noqa: E402
from async_rl.sync.sender import WeightSender  # noqa: E402
from async_rl.sync.server import WeightUpdateServer  # noqa: E402

ROUTES = ("cuda", "host")
GROWTH_LIMIT_MB = 64.0
"""Most a process's device memory may grow from the first update to the last (MB): one
allocator rounding, not a buffer per update (0.5B's float32 update is about 1,980 MB)."""
COPIES = 10
"""Raw device-to-device copies timed for the baseline."""


def serving_dtype(device: torch.device) -> torch.dtype:
    """The servers' dtype: bf16 on a GPU, float32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random Qwen2 of ``shape`` on ``device`` in ``dtype`` (the same weights every time)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{"vocab_size": VOCAB, "max_position_embeddings": 32768, "tie_word_embeddings": True, **SHAPES[shape]})
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def process_memory_mb(pid: int, device: torch.device) -> float:
    """Device memory of process ``pid``: ``nvidia-smi``'s per-process figure on a GPU, the
    resident set on a CPU (MB)."""
    if device.type == "cuda":
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return next((float(used) for p, used in (line.split(",") for line in out.strip().splitlines()) if int(p) == pid), 0.0)
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def allocator_mb(device: torch.device) -> dict[str, float]:
    """This process's torch allocator: allocated and reserved MB (nothing on a CPU)."""
    if device.type != "cuda":
        return {}
    return {"allocated_mb": torch.cuda.memory_allocated(device) / 1e6, "reserved_mb": torch.cuda.memory_reserved(device) / 1e6}


def checksum(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> float:
    """Sum of every element once cast to ``dtype`` (what a server of that dtype holds)."""
    return float(sum(t.to(dtype).double().sum().item() for _, t in named))


# ------------------------------------------------------------------------- the receiver


def receive(address: str, shape: str, device: torch.device, report: Path) -> None:
    """The server side: registers, loads every update into the model, writes ``report``
    (its memory after each update and the served weights' checksum) after each one."""
    secret = RunSecret(bytes.fromhex(sys.stdin.readline().strip()))
    dtype = serving_dtype(device)
    model = build(shape, device, dtype)
    receiver = ModuleReceiver(model)
    lines: list[dict[str, Any]] = []

    def read_from() -> str:
        """Which of the sender's buffers the receiver holds open."""
        cuda, shm = receiver._wsync_cuda, receiver._wsync_shm
        return "cuda" if cuda is not None and cuda._data is not None else "host" if shm is not None and shm._shm is not None else "group"

    def on_outcome(outcome: Any) -> None:
        lines.append({"update_id": outcome.update_id, "ok": outcome.ok, "error": outcome.error, "load_s": outcome.load_s,
                      "memory_mb": process_memory_mb(os.getpid(), device), **allocator_mb(device),
                      "checksum": checksum(list(model.named_parameters()), dtype), "read_from": read_from()})
        partial = report.with_name(report.name + ".partial")  # the learner polls the report: replace it whole
        partial.write_text(json.dumps(lines))
        partial.replace(report)

    async def serve() -> None:
        server = WeightUpdateServer(LocalEngine(receiver), SyncEndpoint(address, secret), "handoff", version=0)
        await server.start()
        await server.serve(on_outcome)

    asyncio.run(serve())


# ------------------------------------------------------------------------- the learner


def raw_copy_ms(named: list[tuple[str, torch.Tensor]], device: torch.device) -> float:
    """Median ms of copying every tensor's bytes into one flat buffer on ``device``."""
    total = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    times = []
    for _ in range(COPIES + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        offset = 0
        for _, t in named:
            n = t.numel() * t.element_size()
            flat[offset : offset + n].view(t.dtype).copy_(t.reshape(-1))
            offset += n
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def _ms(values: list[float]) -> dict[str, float]:
    return {"mean_ms": statistics.mean(values) * 1e3, "median_ms": statistics.median(values) * 1e3, "max_ms": max(values) * 1e3} if values else {}


def run_route(route: str, model: torch.nn.Module, shape: str, device: torch.device, updates: int, work: Path) -> dict[str, Any]:
    """``updates`` updates to a fresh receiver process over ``route``; its result."""
    secret = RunSecret.generate()
    sender = WeightSender(secret=secret, backend="ipc", timeout_s=120.0, cuda_ipc=route == "cuda")
    report = work / f"receiver-{route}.json"
    proc = subprocess.Popen([sys.executable, __file__, "--receive", sender.address, "--shape", shape, "--device", str(device),
                            "--report", str(report)], stdin=subprocess.PIPE, text=True)
    proc.stdin.write(secret.key.hex() + "\n")  # type: ignore[union-attr]
    proc.stdin.close()  # type: ignore[union-attr]
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    specs = tensor_specs(named)
    results, sender_memory = [], []
    try:
        sender.wait_for_servers(1, 300.0)
        for version in range(1, updates + 1):
            with torch.no_grad():
                for _, t in named:
                    t.view(-1)[0] = float(version)
            result = sender.send(iter(named), version, specs=specs)
            if not result.ok:
                return {"ok": False, "error": f"update {version}: {result.failed}"}
            results.append(result)
            if version in (1, updates):
                sender_memory.append({"memory_mb": process_memory_mb(os.getpid(), device), **allocator_mb(device)})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not report.exists() or len(json.loads(report.read_text())) < updates):
            time.sleep(0.1)
        served = json.loads(report.read_text())
    finally:
        proc.terminate()
        proc.wait(30)
        sender.close()
    first, rest = results[0], results[1:]
    out = {
        "ok": True, "updates": updates, "bytes": first.bytes, "read_from": served[-1]["read_from"],
        "first_update_ms": first.total_s * 1e3,
        "update": _ms([r.total_s for r in rest]), "transfer": _ms([r.transfer_s for r in rest]),
        "load": _ms([r.servers["handoff"].load_s for r in rest]),
        "sender_memory": {"after_first": sender_memory[0], "after_last": sender_memory[-1]},
        "receiver_memory": {"after_first": {k: served[0][k] for k in served[0] if k.endswith("_mb")},
                            "after_last": {k: served[-1][k] for k in served[-1] if k.endswith("_mb")}},
        "served_equals_sent": served[-1]["checksum"] == checksum(named, serving_dtype(device)),
    }
    out["growth_mb"] = {side: out[f"{side}_memory"]["after_last"]["memory_mb"] - out[f"{side}_memory"]["after_first"]["memory_mb"]
                        for side in ("sender", "receiver")}
    out["ok"] = out["served_equals_sent"] and out["read_from"] == route and all(g <= GROWTH_LIMIT_MB for g in out["growth_mb"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of: " + ", ".join(ROUTES))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--receive", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.receive:
        receive(args.receive, args.shape, device, args.report)
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build(args.shape, device, torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    doc: dict[str, Any] = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "sent_dtype": "float32", "served_dtype": str(serving_dtype(device)).removeprefix("torch."),
                           "raw_copy_ms": raw_copy_ms(named, device), "routes": {}}
    work = Path(args.json).parent if args.json else Path.cwd()
    for route in args.routes.split(","):
        if route == "cuda" and device.type != "cuda":
            doc["routes"][route] = {"ok": None, "why": "no GPU: CUDA IPC runs on the GPU machine only"}
            continue
        print(f"route {route}: {args.updates} updates of {args.shape}", flush=True)
        doc["routes"][route] = run_route(route, model, args.shape, device, args.updates, work)
        print(json.dumps(doc["routes"][route]), flush=True)
    for r in doc["routes"].values():
        if r.get("update"):
            r["update_vs_raw_copy"] = r["update"]["median_ms"] / doc["raw_copy_ms"]
            r["transfer_vs_raw_copy"] = r["transfer"]["median_ms"] / doc["raw_copy_ms"]
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    sys.exit(0 if all(r["ok"] is not False for r in doc["routes"].values()) else 1)


if __name__ == "__main__":
    main()
