"""Where metrics go: ``metrics.jsonl`` in the run directory, Weights & Biases, and the console.

The console shows a live panel on a terminal and one line per logged step otherwise (CI
logs, ``nohup``), then a summary table at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from async_rl.config import Config, to_dict

# (label, metric key, format) of the live view and the per-step line.
VIEW: tuple[tuple[str, str, str], ...] = (
    ("step", "version", "{:.0f}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("val greedy", "val/greedy_accuracy", "{:.1%}"),
    ("stale mean", "staleness/mean", "{:.2f}"),
    ("stale max", "staleness/max", "{:.0f}"),
    ("queue", "queue/depth", "{:.0f}"),
    ("gen tok/s", "rollout/tokens_per_s", "{:.0f}"),
    ("train tok/s", "perf/tokens_per_s", "{:.0f}"),
    ("idle", "perf/idle_fraction", "{:.0%}"),
)


class Tracker:
    """Logs one dict of floats per learner step (and validation results) everywhere."""

    def __init__(self, cfg: Config, run_dir: Path, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.run_dir = run_dir
        self.console = Console(stderr=False)
        self.latest: dict[str, float] = {}
        self.first_val: float | None = None
        self._start = time.monotonic()
        self._first_step: tuple[float, float] | None = None
        self._jsonl = open(run_dir / "metrics.jsonl", "a") if cfg.logging.jsonl else None  # noqa: SIM115
        self._wandb = self._init_wandb() if cfg.logging.wandb.enable else None
        self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False) if cfg.logging.console and sys.stdout.isatty() else None
        if self._live is not None:
            self._live.start()

    def _init_wandb(self) -> Any:
        import wandb

        w = self.cfg.logging.wandb
        # WANDB_MODE in the environment wins over the config (as W&B users expect).
        mode = os.environ.get("WANDB_MODE", w.mode)
        return wandb.init(project=w.project, entity=w.entity, name=self.cfg.trainer.run_name, dir=str(self.run_dir),
                          mode=mode, config=to_dict(self.cfg), reinit="finish_previous")

    def log(self, metrics: dict[str, float]) -> None:
        """Record one step's metrics (they must include ``version``)."""
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        metrics["time/elapsed_s"] = time.monotonic() - self._start
        if "val/greedy_accuracy" in metrics and self.first_val is None:
            self.first_val = metrics["val/greedy_accuracy"]
        self.latest.update(metrics)
        if self._first_step is None and "perf/tokens_per_s" in metrics:
            self._first_step = (metrics["version"], time.monotonic())
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(metrics) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=int(metrics.get("version", 0)))
        if self._live is not None:
            self._live.update(self._table())
        elif self.cfg.logging.console and int(metrics.get("version", 0)) % self.cfg.logging.log_every == 0:
            self.console.print(self._line(metrics), highlight=False, soft_wrap=True)

    def _eta(self) -> str:
        """Remaining time at the step rate since the first logged step (start-up excluded)."""
        done = self.latest.get("version", 0.0)
        if self._first_step is None or done <= self._first_step[0]:
            return "?"
        version0, t0 = self._first_step
        remaining = (time.monotonic() - t0) / (done - version0) * (self.total_steps - done)
        return f"{remaining / 60:.1f} min"

    def _line(self, metrics: dict[str, float]) -> str:
        parts = [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in VIEW if key in metrics]
        return " | ".join(parts + [f"eta {self._eta()}"])

    def _table(self) -> Table:
        table = Table(title=f"async-rl: {self.cfg.trainer.run_name}")
        for label, _, _ in VIEW:
            table.add_column(label, justify="right")
        table.add_column("eta", justify="right")
        table.add_row(*[fmt.format(self.latest[key]) if key in self.latest else "-" for _, key, fmt in VIEW], self._eta())
        return table

    def summary(self) -> Table:
        """Final summary table."""
        table = Table(title="run summary")
        table.add_column("metric")
        table.add_column("value", justify="right")
        rows = [
            ("policy version", f"{self.latest.get('version', 0):.0f} / {self.total_steps}"),
            ("validation greedy accuracy", _pct(self.first_val) + " -> " + _pct(self.latest.get("val/greedy_accuracy"))),
            ("validation pass@n", _pct(self.latest.get("val/pass_at_n"))),
            ("wall time", f"{(time.monotonic() - self._start) / 60:.1f} min"),
            ("learner idle fraction (last step)", _pct(self.latest.get("perf/idle_fraction"))),
            ("groups dropped as stale", f"{self.latest.get('queue/dropped_stale', 0):.0f}"),
            ("reward errors", f"{self.latest.get('rollout/reward_errors', 0):.0f}"),
            ("run directory", str(self.run_dir)),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table

    def close(self) -> None:
        """Flush and close every sink; print the summary."""
        if self._live is not None:
            self._live.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self.cfg.logging.console:
            self.console.print(self.summary())


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
