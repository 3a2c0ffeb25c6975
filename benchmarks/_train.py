"""Shared by the benchmarks that train the quickstart as a user does: the ``async-rl train``
command on the tiny assets, run in a subprocess whose console lines are timed as printed, and
the validation curve read back from the run's ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTED = "rollout workers started"
"""The driver's console line when the rollout workers start (the end of start-up)."""


QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def quickstart_command(assets: Path, run_dir: Path, run_name: str, *overrides: str, config: Path = QUICKSTART,
                       val_file: str = "val.jsonl") -> list[str]:
    """``async-rl train CONFIG`` (default configs/quickstart.yaml) on the tiny ``assets``
    (validating on their ``data/<val_file>``) into ``run_dir`` (a fresh run:
    ``trainer.resume=off``; console on, W&B and plots off), then ``overrides``."""
    assets = assets.resolve()
    return [sys.executable, "-m", "async_rl.cli", "train", str(config),
            f"learner.model_path={assets / 'model'}", f"data.train_files={assets / 'data' / 'train.jsonl'}",
            f"data.val_files={assets / 'data' / val_file}", f"trainer.output_dir={run_dir}", f"trainer.run_name={run_name}",
            "trainer.resume=off", "logging.wandb.enable=false", "logging.console=true", "logging.plots=false", *overrides]


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (one dict per logged step or validation)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def val_curve(rows: list[dict]) -> list[dict]:
    """The validation points of a run's metrics rows, in order: policy ``version``,
    ``elapsed_s`` (seconds since the run started), ``wall_s`` (``time.time()`` when logged),
    ``greedy`` accuracy and ``pass_at_n`` (fractions; None at ``trainer.val_n`` = 0)."""
    return [{"version": int(r["version"]), "elapsed_s": round(r["time/elapsed_s"], 1), "wall_s": r["time/wall_s"],
             "greedy": r["val/greedy_accuracy"], "pass_at_n": r.get("val/pass_at_n")}
            for r in rows if "val/greedy_accuracy" in r]


def gain_points(val: list[dict], point: dict) -> float:
    """``point``'s greedy accuracy minus the first validation's (the base), in points."""
    return round(100.0 * (point["greedy"] - val[0]["greedy"]), 6)  # accuracies are multiples of 1 / rows: no float dust


def first_gain(val: list[dict], points: float) -> dict | None:
    """The first validation point ``points`` or more above the base, or None."""
    return next((v for v in val if gain_points(val, v) >= points), None)


class ConsoleRun:
    """A command in a subprocess (stdout and stderr together), each line echoed with ``label``
    and kept in :attr:`lines` with the ``time.time()`` it arrived."""

    def __init__(self, cmd: list[str], label: str, env: dict[str, str] | None = None):
        """``env``: variables set for the command on top of this process's environment."""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, cwd=ROOT,
                                     env={**os.environ, "COLUMNS": "400", **(env or {})})
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, args=(label,), daemon=True)
        self._reader.start()

    def _read(self, label: str) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append((time.time(), line.rstrip()))
            sys.stdout.write(f"  [{label}] {line}")

    def first(self, text: str, after: float = 0.0) -> float | None:
        """When the first line containing ``text`` (printed after ``after``) arrived, or None."""
        return next((t for t, line in list(self.lines) if t >= after and text in line), None)

    def stop(self) -> int:
        """SIGTERM (a clean stop with a final checkpoint); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.finish()

    def finish(self, timeout_s: float = 300.0) -> int:
        """Wait for the exit (SIGKILL after ``timeout_s``) and the last line; returns the exit code."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        return self.proc.returncode
