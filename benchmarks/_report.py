"""Shared output of the benchmark scripts: an aligned table on stdout, a JSON file and plots
(accuracy curves: :func:`plot_curves`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def report(result: dict[str, Any], json_path: Path | None) -> None:
    """Print the scalar entries of ``result`` as a two-column table; write all of it as JSON
    to ``json_path`` if given (lists and mappings, e.g. per-round figures, only go there)."""
    scalars = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    width = max(map(len, scalars))
    for key, value in scalars.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if json_path is not None:
        report_json(result, json_path)


def report_json(result: dict[str, Any], json_path: Path) -> None:
    """Write ``result`` to ``json_path`` (indented), whole or not at all: a reader, or a run cut
    short mid-write, never sees half a file."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    partial = json_path.with_name(json_path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(json_path)


def kept_result(json_path: Path | None, settings: dict[str, Any], written_with: Any) -> dict[str, Any] | None:
    """A benchmark's ``--keep``: the result in ``json_path`` (written after each arm or cell)
    when ``written_with(result)``, the settings it was written with, equals ``settings``; None
    when there is none or its settings differ (said on the console: everything runs again)."""
    if json_path is None or not json_path.is_file():
        return None
    old = json.loads(json_path.read_text())
    if written_with(old) != settings:
        print(f"--keep: {json_path} was written with other settings ({written_with(old)}); running everything", flush=True)
        return None
    print(f"--keep: reusing what {json_path} holds", flush=True)
    return old


def new_plot() -> tuple[Any, Any]:
    """A 6 x 4 inch figure and its axes, drawn without a display (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 4))


def save_plot(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label ``ax``, add a light grid and the legend, and write ``fig`` to ``path`` (PNG, 120 dpi;
    folders created)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: Path, *, title: str, xlabel: str,
                marks: dict[str, float | None] | None = None) -> None:
    """Greedy validation accuracy curves as a PNG at ``path``: one line per label of ``curves``
    (``(seconds, accuracy as a fraction)`` points, drawn in percent), and for a label of ``marks``
    with a time, a dotted vertical line there in the line's colour (e.g. when a target was reached)."""
    fig, ax = new_plot()
    for name, points in curves.items():
        xs, ys = zip(*points)
        line, = ax.plot(xs, [100 * y for y in ys], marker="o", label=name)
        if (marks or {}).get(name) is not None:
            ax.axvline(marks[name], color=line.get_color(), ls=":", alpha=0.6)
    save_plot(fig, ax, path, xlabel, "greedy validation accuracy (%)", title)
