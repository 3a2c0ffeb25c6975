"""Where metrics go: ``metrics.jsonl`` in the run directory, Weights & Biases, Prometheus,
the console, and PNG plots at the end.

The console shows a live panel on a terminal and one line per logged step otherwise (CI
logs, ``nohup``), then a summary table at the end.

W&B: every record is logged at its own W&B step, one more than the last (counted from the
records already in ``metrics.jsonl``, so a resumed run continues after them), and charts use
``version`` as their x axis (``define_metric``). Validation results arrive after the steps
that ran meanwhile; with ``step=version`` W&B dropped them as out of order.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from async_rl.appendlog import HeldLines
from async_rl.config import Config, shareable
from async_rl.launch.eta import EtaModel
from async_rl.launch.plots import read_records, staleness_counts, write_plots
from async_rl.launch.prometheus import PrometheusServer, ServerState, Snapshot

WANDB_ID_FILE = "wandb_run_id"
"""File in the run directory holding the W&B run id, so a resumed run continues the same W&B run."""
WANDB_SERVICE_WAIT_S = 120.0
"""How long W&B's wandb-core service may take to start, seconds: its own default (30 s) ran
out on a 2-core machine busy with another run's start (Ray, vLLM and the learner loading)."""

log = logging.getLogger(__name__)

# (label, metric key, format) of the live view and the per-step line.
VIEW: tuple[tuple[str, str, str], ...] = (
    ("step", "version", "{:.0f}"),
    ("reward", "batch/reward_mean", "{:.3f}"),
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

    def __init__(self, cfg: Config, run_dir: Path, total_steps: int, resumed: bool = False):
        self.cfg = cfg
        self.total_steps = total_steps
        self.run_dir = run_dir
        self.console = Console(stderr=False)
        self.latest: dict[str, float] = {}
        self.first_val: float | None = None
        self.servers: list[ServerState] = []
        """Inference servers as of the driver's last health check (for Prometheus)."""
        self.staleness_groups: dict[int, float] = {}
        """Groups trained per staleness since this driver started."""
        self.plots: list[Path] = []
        self._start = time.monotonic()
        self.eta = EtaModel(total_steps, cfg.trainer.save_every, cfg.trainer.val_every)
        port = cfg.logging.prometheus_port  # first: a taken port fails before any file or W&B run is opened
        self.prometheus = (PrometheusServer(self.snapshot, cfg.logging.prometheus_host, port, cfg.algorithm.max_staleness)
                           if port is not None else None)
        metrics_path = run_dir / "metrics.jsonl"
        self._wandb_step = 0
        """W&B step of the next record: its line in metrics.jsonl (a resumed run continues after the lines there)."""
        if resumed and metrics_path.exists():
            with metrics_path.open() as lines:
                self._wandb_step = sum(1 for _ in lines)
        self._jsonl = HeldLines(metrics_path) if cfg.logging.jsonl else None
        if self._jsonl is not None:
            metrics_path.touch()  # there from the start, as the run's other files (empty: no run state)
        self._wandb = self._init_wandb(resumed) if cfg.logging.wandb.enable else None
        self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False) if cfg.logging.console and sys.stdout.isatty() else None
        if self._live is not None:
            self._live.start()

    def _init_wandb(self, resumed: bool) -> Any:
        import wandb

        w = self.cfg.logging.wandb
        # WANDB_MODE in the environment wins over the config (as W&B users expect).
        mode = os.environ.get("WANDB_MODE", w.mode)
        id_file = self.run_dir / WANDB_ID_FILE
        if resumed and id_file.exists():  # the learner resumed: continue its W&B run
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        run = wandb.init(project=w.project, entity=w.entity, name=self.cfg.trainer.run_name, dir=str(self.run_dir), id=run_id,
                         resume="allow", mode=mode, config=shareable(self.cfg), reinit="finish_previous",
                         settings=wandb.Settings(x_service_wait=WANDB_SERVICE_WAIT_S))
        self._wandb_step = max(self._wandb_step, run.step)
        run.define_metric("version")
        run.define_metric("*", step_metric="version")
        return run

    def log(self, metrics: dict[str, float], heartbeat: bool = False) -> None:
        """Record one step's metrics, or a validation's, or (``heartbeat``) the rollout side's
        while no step comes (they must include ``version``; a heartbeat prints no step line)."""
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        now = time.monotonic()
        metrics["time/elapsed_s"] = now - self._start
        metrics["time/wall_s"] = time.time()
        if "val/greedy_accuracy" in metrics:
            if self.first_val is None:
                self.first_val = metrics["val/greedy_accuracy"]
            self.eta.validation(now, metrics.get("val/seconds", 0.0))
        if "perf/tokens_per_s" in metrics:  # a learner step
            self.eta.step(int(metrics["version"]), now, metrics.get("time/checkpoint", 0.0))
            for lag, n in staleness_counts([metrics]).items():
                self.staleness_groups[lag] = self.staleness_groups.get(lag, 0.0) + n
            self.latest["tokens_trained"] = self.latest.get("tokens_trained", 0.0) + metrics.get("perf/tokens", 0.0)
        version = max(self.latest.get("version", 0.0), metrics.get("version", 0.0))  # a validation reports the (older) version it measured
        self.latest.update(metrics)
        self.latest["version"] = version
        if (eta := self.eta.remaining_s(int(self.latest.get("version", 0)))) is not None:
            self.latest["eta_s"] = eta
        if self._jsonl is not None:
            self._write_jsonl(json.dumps(metrics))
        if self._wandb is not None:
            self._wandb.log(metrics, step=self._wandb_step)
            self._wandb_step += 1
        if self._live is not None:
            self._live.update(self._table())
        elif self.cfg.logging.console and not heartbeat and int(metrics.get("version", 0)) % self.cfg.logging.log_every == 0:
            self.console.print(self._line(metrics), highlight=False, soft_wrap=True)

    def _write_jsonl(self, line: str) -> None:
        """Append ``line`` to metrics.jsonl, whole. A write that fails (a full disk) is said once
        and counted (``disk/metrics_write_errors``); its lines are held and written, in order,
        with the next one that goes through (past :data:`~async_rl.appendlog.MAX_HELD_LINES` the
        oldest go, counted in ``disk/metrics_lines_dropped``)."""
        was_failing = self._jsonl.failing  # type: ignore[union-attr]
        exc = self._jsonl.write([line])  # type: ignore[union-attr]
        if exc is None:
            return
        self.latest["disk/metrics_write_errors"] = float(self._jsonl.write_errors)  # type: ignore[union-attr]
        self.latest["disk/metrics_lines_dropped"] = float(self._jsonl.dropped)  # type: ignore[union-attr]
        if not was_failing:
            self.console.print(f"metrics.jsonl cannot be written ({exc}): its lines are held and written once the disk "
                               "takes them again", highlight=False, soft_wrap=True)

    def snapshot(self) -> Snapshot:
        """What a Prometheus scrape reports (called from the HTTP server's thread: copies)."""
        return Snapshot(dict(self.latest), dict(self.staleness_groups), list(self.servers))

    def _eta(self) -> str:
        """Remaining time (:class:`EtaModel`), or ``?`` before two steps."""
        eta = self.latest.get("eta_s")
        return "?" if eta is None else f"{eta / 60:.1f} min"

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
            ("reward errors (of them timeouts)",
             f"{self.latest.get('rollout/reward_errors', 0):.0f} ({self.latest.get('rollout/reward_timeouts', 0):.0f})"),
            ("environment errors (timeouts)", f"{self.latest.get('env/errors', 0):.0f} ({self.latest.get('env/timeouts', 0):.0f})"),
            ("run directory", str(self.run_dir)),
            ("plots", ", ".join(p.name for p in self.plots) or "-"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table

    def close(self) -> None:
        """Flush and close every sink, write the plots; print the summary."""
        if self._live is not None:
            self._live.stop()
        if self.prometheus is not None:
            self.prometheus.close()
        if self._jsonl is not None:
            self._jsonl.write([])  # what a full disk held, if it takes it now
        if self._wandb is not None:
            self._wandb.finish()
        if self.cfg.logging.plots:
            self.plots = self._write_plots()
        if self.cfg.logging.console:
            self.console.print(self.summary())

    def _write_plots(self) -> list[Path]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            log.warning("no plots: they are drawn from metrics.jsonl (logging.jsonl=false)")
            return []
        try:
            return write_plots(read_records(path), self.run_dir, self.cfg.trainer.run_name)
        except Exception as exc:  # noqa: BLE001 - a plot never fails a finished run
            log.warning("plots not written: %s: %s", type(exc).__name__, exc)
            return []


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
