"""PNG plots of a run, drawn from its ``metrics.jsonl`` when the run ends (also on SIGTERM).

Three figures in the run directory:

- ``validation_accuracy.png``: greedy accuracy, mean@n and pass@n against wall-clock minutes;
- ``staleness.png``: groups trained per staleness (learner version minus behaviour version);
- ``throughput.png``: generation and training tokens/s against wall-clock minutes.

The time axis is minutes since the file's first record (``time/wall_s``), so a resumed run
shows its earlier part and the gap. Drawn with matplotlib's object API (no pyplot state).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

log = logging.getLogger(__name__)

PLOTS = ("validation_accuracy.png", "staleness.png", "throughput.png")
"""File names of the plots, in the run directory."""
SMOOTH = 10
"""Steps in the moving average of the throughput curves (per-step rates are noisy)."""


def read_records(path: Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` (a line cut short by a kill is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def staleness_counts(records: list[dict[str, float]]) -> dict[int, float]:
    """Groups per staleness (versions) summed over the ``staleness/hist/{k}`` keys of ``records``."""
    groups: dict[int, float] = {}
    for r in records:
        for key, n in r.items():
            if key.startswith("staleness/hist/"):
                lag = int(key.rsplit("/", 1)[1])
                groups[lag] = groups.get(lag, 0.0) + n
    return groups


def write_plots(records: list[dict[str, float]], out_dir: Path, title: str) -> list[Path]:
    """Write the plots of ``records`` (``metrics.jsonl`` rows) into ``out_dir``; returns the
    paths written (a plot with no data to show is not written)."""
    written = []

    def clock(r: dict[str, float]) -> float:  # files written before time/wall_s existed: elapsed time
        return r.get("time/wall_s", r.get("time/elapsed_s", 0.0))

    start = min(map(clock, records), default=0.0)

    def minutes(r: dict[str, float]) -> float:
        return (clock(r) - start) / 60

    vals = [r for r in records if "val/greedy_accuracy" in r]
    if vals:
        fig, ax = _figure(f"{title}: validation", "wall-clock time (min)", "accuracy")
        x = [minutes(r) for r in vals]
        for key, label in (("val/greedy_accuracy", "greedy"), ("val/mean_at_n", "mean@n"), ("val/pass_at_n", "pass@n")):
            ax.plot(x, [r.get(key, float("nan")) for r in vals], marker="o", label=label)
        for r, t in zip(vals, x):
            ax.annotate(f"v{r['version']:.0f}", (t, r["val/greedy_accuracy"]), fontsize=7, textcoords="offset points", xytext=(0, 5))
        ax.set_ylim(0, 1)
        written.append(_save(fig, ax, out_dir / PLOTS[0]))

    groups = staleness_counts(records)
    if groups:
        fig, ax = _figure(f"{title}: staleness of trained groups", "staleness (versions)", "groups")
        lags = sorted(groups)
        ax.bar(lags, [groups[k] for k in lags])
        ax.set_xticks(lags)
        written.append(_save(fig, ax, out_dir / PLOTS[1], legend=False))

    steps = [r for r in records if "perf/tokens_per_s" in r]
    if steps:
        fig, ax = _figure(f"{title}: throughput", "wall-clock time (min)", "tokens/s")
        x = [minutes(r) for r in steps]
        for key, label in (("rollout/tokens_per_s", "generation"), ("perf/tokens_per_s", "training (compute)")):
            ax.plot(x, _moving_average([r.get(key, 0.0) for r in steps], SMOOTH), label=label)
        written.append(_save(fig, ax, out_dir / PLOTS[2]))
    return written


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(6.4, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Figure, ax: Axes, path: Path, legend: bool = True) -> Path:
    if legend:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
