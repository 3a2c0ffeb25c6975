"""Running `async-rl train` as a user would, for the end-to-end tests: a small config on the
tiny assets, the CLI in a subprocess, and what the run left in Redis and the process table."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_config(tiny_assets: Any, tmp_path: Path, steps: int, base: str = "quickstart.yaml", **sections: dict[str, Any]) -> Path:
    """A quickstart config (``configs/<base>``) at a small scale (batches of 4 groups x 4
    samples) with ``sections`` merged in (e.g. ``trainer={"save_every": 3}``); returns its path."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(tiny_assets.val_path.read_text().splitlines(keepends=True)[:16]))
    cfg = yaml.safe_load((ROOT / "configs" / base).read_text())
    cfg["data"].update(train_files=str(tiny_assets.train_path), val_files=str(val))
    cfg["learner"].update(model_path=str(tiny_assets.model_dir), batch_size=4)
    cfg["rollout"].update(n=4, max_inflight=8)
    cfg["trainer"].update(output_dir=str(tmp_path / "run"), run_name=f"e2e-{os.getpid()}", total_steps=steps, save_every=2, val_every=2, val_n=2)
    cfg["logging"] = {"console": True, "wandb": {"enable": True, "mode": "offline"}}
    for name, values in sections.items():
        _merge(cfg.setdefault(name, {}), values)
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def train_cli(config: Path, *overrides: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    """``async-rl train CONFIG OVERRIDES`` to the end; output in ``train.log`` beside the config."""
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(config), *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    with open(config.parent / "train.log", "a") as log:
        log.write(proc.stdout + proc.stderr)
    return proc


class TrainProcess(subprocess.Popen):
    """``async-rl train`` in the background, its stdout and stderr appended to ``train.log``
    beside the config. A file, not a pipe: a pipe nobody reads fills after ~500 console lines
    and the driver blocks on its next print (its scale requests and learner steps with it)."""

    def __init__(self, config: Path, *overrides: str):
        self.log = config.parent / "train.log"
        with open(self.log, "a") as out:
            self.offset = out.tell()
            super().__init__([sys.executable, "-m", "async_rl.cli", "train", str(config), *overrides], cwd=ROOT,
                             stdout=out, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        """What this run printed so far."""
        with open(self.log) as f:
            f.seek(self.offset)
            return f.read()

    def wait_output(self, timeout_s: float) -> str:
        """Wait for the run to end (``subprocess.TimeoutExpired`` after ``timeout_s`` seconds); what it printed."""
        self.wait(timeout_s)
        return self.output()

    def wait_printed(self, text: str, since: int = 0, timeout_s: float = 300) -> None:
        """Until ``text`` is on the run's console, after its first ``since`` characters."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output()[since:]:
            if self.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not on the console (exit {self.returncode}):\n{self.output()[-3000:]}")
            time.sleep(0.05)


def start_train(config: Path, *overrides: str) -> TrainProcess:
    """``async-rl train CONFIG OVERRIDES`` in the background (:class:`TrainProcess`)."""
    return TrainProcess(config, *overrides)


def step_versions(run_dir: Path) -> list[int]:
    """Versions of the learner steps logged so far in ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    from async_rl.launch.plots import read_records  # a line being written (or held by a full disk) is skipped

    return [int(r["version"]) for r in read_records(path) if "perf/tokens_per_s" in r]


def wait_for_version(proc: TrainProcess, run_dir: Path, version: int, since: int = 0, timeout_s: float = 600) -> None:
    """Block until the run logged a step of ``version`` or more among the step records after the
    first ``since`` (those an earlier run of this directory logged: a run SIGKILLed just after
    a step may have logged the next one too, and a resumed run appends to its metrics.jsonl)."""
    deadline = time.monotonic() + timeout_s
    while max(step_versions(run_dir)[since:], default=-1) < version:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before version {version}:\n{proc.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no step of version {version} within {timeout_s} s")
        time.sleep(0.3)


SUITE_PARTS = ("ASYNC_RL_TEST_LANE", "PYTEST_XDIST_WORKER")
"""What names the part of the suite a test process runs: the lane of scripts/test.sh
(``stack``, ``rest``) and the pytest-xdist worker (``gw0``...)."""


def _part(environ: dict[str, str] | list[bytes]) -> str | None:
    """``lane/worker`` from an environment (os.environ, or /proc's NUL-split entries); None: neither is set."""
    if isinstance(environ, list):
        environ = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if b"=" in e)
    found = [environ.get(name, "") for name in SUITE_PARTS]
    return "/".join(found) if any(found) else None


def _part_of(pid: int) -> str | None:
    """The part of the suite (:func:`_part`) in whose test process ``pid`` was started, from the
    environment of ``pid`` or its nearest ancestor that names one (Ray's raylet starts its
    dashboard and runtime-env agents without it); None when none does."""
    while pid > 1:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if (found := _part(environ)) is not None:
            return found
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent: the field after the state
    return None


def leftovers(run_dir: Path) -> list[str]:
    """Processes of this run still alive: its redis-server, Ray workers, vLLM engines.
    Zombies do not count: they are dead, waiting for a parent (in a container whose init
    does not reap, orphans stay zombies forever). Ray's and vLLM's processes do not name the
    run: any counts, except those another part of the suite (a lane of scripts/test.sh, a
    pytest-xdist worker) started."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    mine, part = str(run_dir), _part(dict(os.environ))
    alive = [line for line in out if not line.split(None, 3)[2].startswith("Z")]
    generic = [line for line in alive if "ray::" in line or "EngineCore" in line or "raylet" in line]
    return [line for line in alive if mine in line] + \
        [line for line in generic if mine not in line and (part is None or _part_of(int(line.split()[0])) in (None, part))]


def wait_gone(run_dir: Path, seconds: float = 30.0) -> list[str]:
    """:func:`leftovers` once they are gone or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while (left := leftovers(run_dir)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return left


def run_name(config: Path) -> str:
    return str(yaml.safe_load(config.read_text())["trainer"]["run_name"])


def queue_state(run_dir: Path, config: Path) -> dict[str, Any]:
    """Restart the run's redis on its AOF and read the ledger: ``stats`` plus the prompt ids
    of the groups still in the stream (``queued``) and of the returned prompts (``returned``),
    and how many images the queue stores (``images``)."""
    from async_rl.queue import EmbeddedRedis, ReplayQueue
    from async_rl.records import decode

    with EmbeddedRedis(run_dir / "redis") as url, ReplayQueue(url, run_name(config)) as q:
        client = q._client
        queued = [decode(fields[b"group"]).prompt_id for _, fields in client.xrange(q.keys.rollouts)]
        returned = [int(i) for i in client.lrange(q.keys.returned, 0, -1)]
        images = len(list(client.scan_iter(q.keys.image("*"))))
        return {"stats": q.stats(), "queued": queued, "returned": returned, "images": images}


def lineage(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The last logged run of each version (``learner_steps.jsonl`` across resumes, a redone
    step replacing the one its resume discarded): its entry ids and prompt ids."""
    lines = [json.loads(line) for line in (run_dir / "learner_steps.jsonl").read_text().splitlines()]
    return {line["version"]: line for line in lines}


def assert_ledger(run_dir: Path, config: Path, read_ahead: bool = False) -> dict[str, Any]:
    """The ledger of a stopped run holds: every version trained once (no step missing), no
    group in flight or pending, and no prompt lost or claimed twice: each claimed index is
    trained into the final weights, queued, returned or dropped (a group from the future gives
    its prompt back: that prompt is trained, queued or returned). ``read_ahead``: groups may
    stay pending, read by the learner for a batch it never trained (a SIGTERM while Redis did
    not answer can leave them; they are still in the stream, so queued). Returns :func:`queue_state`."""
    steps = lineage(run_dir)
    assert sorted(steps) == list(range(1, len(steps) + 1)), sorted(steps)
    trained = [p for line in steps.values() for p in line["prompt_ids"]]
    state = queue_state(run_dir, config)
    stats, queued, returned = state["stats"], state["queued"], state["returned"]
    assert (read_ahead or stats["pending"] == 0) and stats["inflight"] == 0, stats
    claimed = trained + queued + returned
    assert len(claimed) == len(set(claimed)), "a prompt was trained or queued twice"
    done_by_drop = sum(count for reason, count in stats["dropped"].items() if reason != "future")
    assert len(claimed) + done_by_drop + stats["dead_lettered"] == stats["prompt_cursor"], (len(claimed), done_by_drop, stats)
    assert set(claimed) <= set(range(stats["prompt_cursor"]))
    return state


def redis_pid(run_dir: Path) -> int:
    """The process id of the run's embedded redis-server, asked of the server itself (its
    port and password are in ``redis/redis.conf``)."""
    from async_rl.queue.client import connect
    from async_rl.queue.embedded import url_of

    client = connect(url_of(run_dir / "redis"), socket_timeout_s=5.0)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    """``path`` (created) as a tmpfs of ``size_mb`` MB of its own while the block runs (root
    only, as CI runs; it raises, naming why, where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        raise PermissionError(f"mounting a {size_mb} MB tmpfs at {path} needs root (as CI runs): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(filler: Path) -> None:
    """Write ``filler`` until its disk has no byte left (the run writes meanwhile: no size is known in advance)."""
    with open(filler, "wb", buffering=0) as f:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096, b"\0"):
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


async def until(check: Callable[[], bool], what: str, timeout_s: float, state: Callable[[], str]) -> None:
    """Wait until ``check()`` holds; past ``timeout_s`` fail, saying ``what`` did not happen
    and ``state()`` (a hang must fail with what it waited on, not at the suite's timeout)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s:g} s; {state()}")
        await asyncio.sleep(0.1)
