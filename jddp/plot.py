"""Plot a run's ``metrics.jsonl`` against step, several runs overlaid.

``python -m jddp.plot WORKDIR [WORKDIR ...] [--out DIR]`` writes ``loss.png``, one
``<metric>.png`` per metric of the runs' task (``accuracy.png`` for image classification; a
custom task's own metrics), ``lr.png``, ``throughput.png`` (images or examples per second) and,
for a run with ``log.weight_unit``, ``<unit>_per_s.png`` into ``DIR`` (default: the first
WORKDIR's ``plots/`` folder), skipping a plot whose keys appear in no run, and prints one line
per file written. A series with NaN/Inf values keeps them visible: each such step is marked
with an ``x`` at the top of the plot (in the run's colour), and one line per series on stderr
says how many non-finite points it has and the first step. It exits 2 with a one-line message
when a WORKDIR or its ``metrics.jsonl`` is missing or holds no valid line; malformed lines are
skipped silently.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no display, and the
process-wide backend is left alone).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jddp.metrics import metrics_rows
from jddp.tasks import RESERVED_METRICS
from jddp.workdir import RunFolder

Plot = tuple[str, str, tuple[str, ...]]  # (file name, y-axis label, metric keys drawn in it)


def plots_of(runs: Sequence[list[dict]], weight_units: Sequence[str | None] = ()) -> list[Plot]:
    """The plots of the runs' keys: the loss, each task metric (train and eval together; jddp's
    own keys and the loss weights' sums are no task metric), the learning rate, examples/s and
    each weight unit's rate."""
    keys = list(dict.fromkeys(k for rows in runs for row in rows for k in row))
    units = {u for u in weight_units if u}
    own = RESERVED_METRICS | units
    metrics = [
        name
        for k in keys
        if k.startswith(("train/", "eval/"))
        and (name := k.split("/", 1)[1]) not in own
        and not name.endswith("_per_s")
    ]
    metrics = sorted(dict.fromkeys(metrics), key=lambda m: m != "accuracy")  # accuracy first
    plots: list[Plot] = [("loss.png", "loss", ("train/loss", "eval/loss"))]
    plots += [(f"{m}.png", m, (f"train/{m}", f"eval/{m}")) for m in metrics]
    plots.append(("lr.png", "learning rate", ("train/lr",)))
    rate = "examples / s" if "train/examples_per_s" in keys else "images / s"
    plots.append(("throughput.png", rate, ("train/img_per_s", "train/examples_per_s")))
    plots += [(f"{u}_per_s.png", f"{u} / s", (f"train/{u}_per_s",)) for u in sorted(units)]
    return plots


def weight_unit_of(workdir: Path) -> str | None:
    """The run's ``log.weight_unit`` (from its config.yaml), or None."""
    try:
        saved = yaml.safe_load(RunFolder(workdir).config_yaml.read_text()) or {}
        return (saved.get("log") or {}).get("weight_unit")
    except (OSError, yaml.YAMLError, AttributeError):
        return None


class MetricsError(ValueError):
    """A run folder or its ``metrics.jsonl`` is missing or holds no valid line."""


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, strings like ``"nan"``, inf, other types)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def load_metrics(workdir: str | Path) -> list[dict]:
    """Read ``workdir/metrics.jsonl`` and return its valid lines, in file order.

    A valid line is a JSON object with a numeric ``step``; anything else (bad JSON, a non-object,
    no step) is skipped silently.

    Raises:
        MetricsError: naming the path, when ``workdir`` is not a folder, it has no
            ``metrics.jsonl``, or that file holds no valid line.
    """
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise MetricsError(f"{workdir}: no such run folder")
    path = RunFolder(workdir).metrics_jsonl
    if not path.is_file():
        raise MetricsError(f"{path}: no such file")
    rows = [row for _, row in metrics_rows(path) if _number(row.get("step")) is not None]
    if not rows:
        raise MetricsError(f"{path}: no valid metrics line")
    return rows


def _nonfinite_steps(rows: list[dict], key: str) -> list[float]:
    """The steps, sorted, whose ``key`` is NaN or +-Inf (JSON ``NaN``/``Infinity``, or the
    strings ``"nan"``/``"inf"`` some writers use)."""
    steps = []
    for r in rows:
        value = r.get(key)
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                continue
        if isinstance(value, float) and not math.isfinite(value):
            steps.append(_number(r["step"]))
    return sorted(steps)


def describe_nonfinite(workdirs: Sequence[str | Path]) -> list[str]:
    """One line per (run, series) of the plotted keys holding NaN/Inf values: how many and the
    first step."""
    workdirs = [Path(w) for w in workdirs]
    runs = [load_metrics(w) for w in workdirs]
    plots = plots_of(runs, [weight_unit_of(w) for w in workdirs])
    lines = []
    for rows, label in zip(runs, _labels(workdirs), strict=True):
        for _, _, keys in plots:
            for key in keys:
                steps = _nonfinite_steps(rows, key)
                if steps:
                    lines.append(
                        f"jddp.plot: {label} {key}: {len(steps)} non-finite (NaN/Inf) "
                        f"point{'s' if len(steps) > 1 else ''}, first at step {steps[0]:g} "
                        "(marked x at the top of the plot)"
                    )
    return lines


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that hold a finite number under ``key``, sorted by step."""
    points = sorted((_number(r["step"]), v) for r in rows if (v := _number(r.get(key))) is not None)
    return [s for s, _ in points], [v for _, v in points]


def _labels(workdirs: Sequence[Path]) -> list[str]:
    """Each run's folder name, or its path as given where two runs share a name."""
    names = [p.resolve().name or str(p) for p in workdirs]
    counts = Counter(names)
    return [str(p) if counts[n] > 1 else n for p, n in zip(workdirs, names, strict=True)]


def plot_runs(workdirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Plot the runs in ``workdirs`` overlaid into PNGs in ``out_dir`` and return their paths.

    Every run is read (and checked) before anything is written. Train series are solid lines,
    eval series dashed with markers, one colour per run. A plot whose keys appear in no run is
    not written. ``out_dir`` is created if needed; existing files of the same name are replaced.

    Raises:
        MetricsError: as :func:`load_metrics`, for the first bad run folder.
    """
    workdirs = [Path(w) for w in workdirs]
    runs = [load_metrics(w) for w in workdirs]
    labels = _labels(workdirs)
    out_dir = Path(out_dir)
    written = []
    for filename, ylabel, keys in plots_of(runs, [weight_unit_of(w) for w in workdirs]):
        fig = Figure(figsize=(8, 5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        drawn = False
        for i, (rows, label) in enumerate(zip(runs, labels, strict=True)):
            for key in keys:
                steps, values = _series(rows, key)
                kind = key.split("/", 1)[0]
                bad_steps = _nonfinite_steps(rows, key)
                if bad_steps:  # NaN/Inf: an x at the top, at the step (x in data, y in axes)
                    ax.plot(
                        bad_steps,
                        [0.97] * len(bad_steps),
                        color=f"C{i % 10}",
                        linestyle="none",
                        marker="x",
                        markersize=8,
                        transform=ax.get_xaxis_transform(),
                        label=f"{label if len(keys) == 1 else f'{label} {kind}'} NaN/Inf",
                    )
                    drawn = True
                if not steps:
                    continue
                style = {"linestyle": "-"}
                if kind != "train":
                    style = {"linestyle": "--", "marker": "o", "markersize": 4}
                ax.plot(
                    steps,
                    values,
                    color=f"C{i % 10}",
                    label=label if len(keys) == 1 else f"{label} {kind}",
                    **style,
                )
                drawn = True
        if not drawn:
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / filename
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status (0, or 2 for a bad run folder)."""
    parser = argparse.ArgumentParser(
        prog="python -m jddp.plot",
        description="Plot metrics.jsonl of one or more run folders against step (PNG).",
    )
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="run folder(s)")
    parser.add_argument(
        "--out", metavar="DIR", help="output folder (default: the first WORKDIR's plots/)"
    )
    args = parser.parse_args(argv)
    out_dir = Path(args.out) if args.out else Path(args.workdirs[0]) / "plots"
    try:
        written = plot_runs(args.workdirs, out_dir)
    except MetricsError as e:
        print(f"jddp.plot: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"jddp.plot: error: cannot write to {out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    for line in describe_nonfinite(args.workdirs):
        print(line, file=sys.stderr)
    for path in written:
        print(path)
    if not written:
        print("jddp.plot: no plottable metrics; nothing written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
