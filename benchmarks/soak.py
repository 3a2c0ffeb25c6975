"""Memory over a long run: the quickstart trained for ``--minutes``, every process role's RSS sampled.

Trains ``configs/quickstart.yaml`` (a weight update after every step) as an ``async-rl
train`` process with no step limit in reach, samples the resident memory of each process
role every ``--every-s`` seconds, and stops the run with SIGTERM when the time is up:

    python benchmarks/soak.py --minutes 75 --json benchmarks/results/soak.json

Roles (found from the driver's process tree and ``servers.json``): ``driver``, ``learner``
(each rank), ``server`` (the inference server's Ray actor), ``engine`` (vLLM's engine core),
``vllm_worker`` (its model worker), ``reward_pool`` (the server's reward processes, summed),
``redis``, ``gcs``, ``raylet``. A role with several processes reports their sum.

Per role, over the samples after warm-up (``--warmup-frac`` of the time): ``rss_mb_start`` /
``rss_mb_end``; ``mb_per_1000_updates``, the growth by **medians of thirds**: the samples split
into three equal spans of time, the median RSS of the last third minus that of the first,
over the median learner steps of the last third minus those of the first, times 1,000 (robust
to the learner's RSS swinging by tens of MB within a step, which a slope over an hour is not);
and ``slope_mb_per_1000_updates``, the least-squares slope of RSS against learner steps, times
1,000. Also ``updates`` (steps after warm-up), ``steps_per_min`` and ``run_dir_mb_per_hour``
(the output directory's growth). Target (issue 42): no role grows by more than 2 MB per 1,000
updates after warm-up, by medians of thirds, in a soak of at least an hour (``met``). Also per role:
each third's floor and peak RSS. ``--reanalyse JSON`` recomputes the figures from a JSON's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psutil
from _report import report
from _train import ROOT, STARTED, ConsoleRun, quickstart_command

sys.path.insert(0, str(ROOT / "tests"))
from run_helpers import redis_pid, step_versions

TARGET_MB_PER_1000 = 2.0
"""The most any role may grow per 1,000 updates after warm-up, by medians of thirds (issue 42)."""
ROLES = ("driver", "learner", "server", "engine", "vllm_worker", "reward_pool", "redis", "gcs", "raylet")


def role_pids(driver: psutil.Process, run_dir: Path) -> dict[str, list[int]]:
    """Each role's process ids now (a role not found yet is absent)."""
    doc = json.loads((run_dir / "servers.json").read_text()) if (run_dir / "servers.json").is_file() else {}
    servers, learners = doc.get("servers", []), doc.get("learners", [])
    roles: dict[str, list[int]] = {"driver": [driver.pid]}
    roles["learner"] = [int(lr["pid"]) for lr in learners]
    roles["server"] = [int(s["pid"]) for s in servers if s.get("pid")]
    roles["engine"] = [int(p) for s in servers for p in s.get("engine_pids", [])]
    roles["vllm_worker"] = [c.pid for e in roles["engine"] for c in _children(e) if "VLLM" in _name(c) or "Worker" in _name(c)]
    roles["reward_pool"] = [c.pid for s in roles["server"] for c in _children(s) if "multiprocessing.spawn" in _cmdline(c)
                            and "resource_tracker" not in _cmdline(c)]
    try:
        roles["redis"] = [redis_pid(run_dir)]
    except Exception:  # noqa: BLE001 - not started yet
        roles["redis"] = []
    tree = _descendants(driver)
    roles["gcs"] = [p.pid for p in tree if _name(p) == "gcs_server"]
    roles["raylet"] = [p.pid for p in tree if _name(p) == "raylet"]
    return {role: pids for role, pids in roles.items() if pids}


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def rss_mb(pids: list[int]) -> float | None:
    """Summed resident memory of ``pids`` in MB (None if none is alive)."""
    total, alive = 0, False
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
            alive = True
        except psutil.Error:
            pass
    return total / 2**20 if alive else None


def du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (0 for fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def time_thirds(points: list[tuple[float, float, float]]) -> list[list[tuple[float, float, float]]]:
    """``(t_s, step, rss_mb)`` samples (in time order) in the three equal spans of their time."""
    t0, span = points[0][0], (points[-1][0] - points[0][0]) / 3
    return [[p for p in points if k * span <= p[0] - t0 <= (k + 1) * span] for k in range(3)]


def thirds_growth(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Growth per step by medians of thirds of ``(t_s, step, rss_mb)`` samples (in time order):
    ``(first third's median RSS, last third's median RSS, MB per step)``; a last third no steps
    past the first's gives 0 per step."""
    first, _, last = time_thirds(points)
    rss_first, rss_last = statistics.median(p[2] for p in first), statistics.median(p[2] for p in last)
    steps = statistics.median(p[1] for p in last) - statistics.median(p[1] for p in first)
    return rss_first, rss_last, (rss_last - rss_first) / steps if steps > 0 else 0.0


def summarize(samples: list[dict], minutes: float, warmup_frac: float, processes: dict[str, int]) -> dict:
    """The figures of a soak from its ``samples`` (``t_s``, ``step``, ``run_dir_mb`` and each
    role's MB): per role over the samples after warm-up, the growth by medians of thirds (the
    target's measure), the least-squares slope, and each third's floor and peak (the learner's
    RSS swings by about 130 MB within a step: its floor shows what it holds)."""
    warm = [s for s in samples if s["t_s"] >= warmup_frac * minutes * 60]
    if len(warm) < 3:
        raise SystemExit("too few samples after warm-up: run longer or sample more often")
    first, last = warm[0], warm[-1]
    updates = last["step"] - first["step"]
    roles = {}
    for role in ROLES:
        pts = [(s["t_s"], s["step"], s[role]) for s in warm if s.get(role) is not None]
        if len(pts) < 3:
            continue
        rss_first, rss_last, per_step = thirds_growth(pts)
        thirds = [[p[2] for p in third] for third in time_thirds(pts)]
        roles[role] = {"rss_mb_start": pts[0][2], "rss_mb_end": pts[-1][2],
                       "rss_mb_median_first_third": rss_first, "rss_mb_median_last_third": rss_last,
                       "mb_per_1000_updates": 1000 * per_step,
                       "slope_mb_per_1000_updates": 1000 * slope([p[1] for p in pts], [p[2] for p in pts]),
                       "rss_mb_floor_by_third": [min(t) for t in thirds], "rss_mb_peak_by_third": [max(t) for t in thirds],
                       "processes": processes.get(role, 0)}
    hours = (last["t_s"] - first["t_s"]) / 3600
    worst = max(r["mb_per_1000_updates"] for r in roles.values())
    return {
        **{f"{role}.mb_per_1000_updates": r["mb_per_1000_updates"] for role, r in roles.items()},
        "worst_mb_per_1000_updates": worst,
        "target_mb_per_1000_updates": TARGET_MB_PER_1000,
        "met": worst <= TARGET_MB_PER_1000 and minutes >= 60,
        "updates": updates,
        "hours_after_warmup": hours,
        "steps_per_min": updates / (hours * 60) if hours else 0.0,
        "run_dir_mb_per_hour": (last["run_dir_mb"] - first["run_dir_mb"]) / hours if hours else 0.0,
        "roles": roles,
        "minutes": minutes,
        "warmup_frac": warmup_frac,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="training time after start-up")
    ap.add_argument("--every-s", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="fraction of the time before growth is measured")
    ap.add_argument("--assets", type=Path, default=Path("runs/bench/assets"), help="tiny assets dir (built if absent)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/soak"), help="run directory")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reanalyse", type=Path, default=None, metavar="JSON",
                    help="recompute the figures from the samples of an earlier soak's JSON (no run); writes --json")
    args = ap.parse_args()
    if args.reanalyse is not None:
        old = json.loads(args.reanalyse.read_text())
        result = summarize(old["samples"], old["minutes"], old["warmup_frac"], {r: v["processes"] for r, v in old["roles"].items()})
        report({**result, **{k: old[k] for k in ("exit_code", "config", "machine")}}, args.json)
        return
    if not (args.assets / "assets.json").is_file():
        from async_rl.tiny import build_tiny_assets

        build_tiny_assets(args.assets, seed=0, task="addition")

    run_dir = args.out.resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run = ConsoleRun(quickstart_command(args.assets, run_dir, f"soak-{os.getpid()}", "trainer.total_steps=1000000",
                                        "trainer.save_every=1000", "trainer.val_every=0", *args.set), "soak")
    while run.first(STARTED) is None:
        if run.proc.poll() is not None:
            raise SystemExit(f"the run ended during start-up (exit code {run.finish()})")
        time.sleep(0.5)
    driver = psutil.Process(run.proc.pid)
    start = time.monotonic()
    end = start + args.minutes * 60
    samples: list[dict] = []
    while time.monotonic() < end and run.proc.poll() is None:
        pids = role_pids(driver, run_dir)
        row = {"t_s": time.monotonic() - start, "step": max(step_versions(run_dir), default=0), "run_dir_mb": du_mb(run_dir),
               **{role: rss_mb(p) for role, p in pids.items()}, "pids": pids}
        samples.append(row)
        print(f"soak: {row['t_s'] / 60:5.1f} min, step {row['step']}, "
              + ", ".join(f"{r} {row[r]:.0f}" for r in ROLES if row.get(r) is not None) + " MB", flush=True)
        time.sleep(args.every_s)
    exit_code = run.stop()

    processes = {role: len(pids) for role, pids in samples[-1]["pids"].items()} if samples else {}
    result = summarize([{k: v for k, v in s.items() if k != "pids"} for s in samples], args.minutes, args.warmup_frac, processes)
    result.update({"exit_code": exit_code,
                   "config": "configs/quickstart.yaml trainer.save_every=1000 trainer.val_every=0 " + " ".join(args.set),
                   "machine": f"{os.cpu_count()} cores, cpu"})
    report(result, args.json)


if __name__ == "__main__":
    main()
