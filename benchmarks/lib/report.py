"""Output of every benchmark: a text table, the JSON (environment first), and one plot helper for the PNGs."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .env import environment


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | dict[str, str]) -> str:
    """A fixed-width text table of `rows`; `columns` are keys, or {key: header}; floats get 4 significant digits."""
    columns = columns if isinstance(columns, dict) else {key: key for key in columns}

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    cells = [[cell(row.get(key)) for key in columns] for row in rows]
    widths = [max([len(header)] + [len(r[i]) for r in cells]) for i, header in enumerate(columns.values())]
    lines = ["  ".join(h.rjust(w) for h, w in zip(columns.values(), widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write `payload` (anything not JSON-native as its string); rewritten whole, so a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    staging.replace(path)
    return path


def save(args: Any, payload: dict[str, Any]) -> Path:
    """`<results-dir>/<name>.json` of a script (its shared flags, `lib.cli`, in `args`), its environment first: the
    device, and the dtype and statistic of a timed script."""
    settings = {key: getattr(args, key) for key in ("dtype", "dtypes", "statistic") if hasattr(args, key)}
    device = getattr(args, "device", "cpu")
    return write_json(
        args.results_dir / f"{args.name}.json", {"environment": environment(device, **settings), **payload}
    )


def finish(args: Any, payload: dict[str, Any], table: str) -> Path:
    """A script's end: `save`, then the table printed last."""
    path = save(args, payload)
    print(f"wrote {path}")
    print(table)
    return path


@dataclass
class Panel:
    """One plot panel: `series` {label: (xs, ys)} drawn with markers (None / non-finite points dropped),
    and `draw(axis)` for anything else (bands, contours, tick labels)."""

    title: str
    ylabel: str = ""
    series: dict[str, tuple[Sequence[float], Sequence[float | None]]] = field(default_factory=dict)
    xlabel: str = ""
    xlog: bool = True
    ylog: bool = False
    colors: dict[str, str] = field(default_factory=dict)
    linestyle: str = "-"  # "none": points only
    draw: Callable[[Any], None] | None = None


def plot(path: Path, panels: Sequence[Panel], suptitle: str = "", columns: int | None = None) -> Path:
    """One PNG of `panels`, `columns` per row (all in one row by default); log2 x axes unless a panel says not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = columns or len(panels)
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        for label, (xs, ys) in panel.series.items():
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", ms=4, label=label, color=panel.colors.get(label),
                          linestyle=panel.linestyle)  # fmt: skip
        if panel.draw is not None:
            panel.draw(axis)
        if panel.xlog:
            axis.set_xscale("log", base=2)
        if panel.ylog:
            axis.set_yscale("log")
        axis.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        axis.title.set_fontsize(9)
        axis.grid(True, alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    if suptitle:
        figure.suptitle(suptitle, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
