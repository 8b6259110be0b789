"""``neorec report RUN_DIR…``: a run's (or several runs') curves as PNG files and a short
text summary.

The curves are read from each run's ``metrics.jsonl``: train loss, eval AUC and eval log
loss, and train QPS, against the global step, one line per run (overlaid, labelled with
the run directory's name). Plotting needs matplotlib (``pip install 'neorec[report]'``);
the text summary does not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neorec.trainer.run.run_dir import METRICS, SUMMARY, RunDirError

PLOTS = {"loss": [("train", "loss", "train loss")],
         "eval": [("eval", "auc", "eval AUC"), ("eval", "logloss", "eval log loss")],
         "qps": [("train", "qps", "train samples / s")]}
"""PNG name → its panels: (split, metric, axis label)."""


@dataclass
class RunCurves:
    """One run's metrics by split and metric: ``(steps, values)``."""

    name: str
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def read_run(run_dir: str | Path) -> RunCurves:
    """The curves of a run directory (its ``metrics.jsonl``, and ``summary.json`` if done)."""
    path = Path(run_dir)
    metrics = path / METRICS
    if not metrics.is_file():
        raise RunDirError(f"{path} is not a run directory (no {METRICS})")
    run = RunCurves(path.resolve().name)
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise RunDirError(f"{metrics}: line {number} is not JSON") from None
        for key, value in record.items():
            if key in ("split", "step", "epoch") or not isinstance(value, (int, float)):
                continue
            steps, values = run.series.setdefault((record["split"], key), ([], []))
            steps.append(record["step"])
            values.append(float(value))
    if (path / SUMMARY).is_file():
        run.summary = json.loads((path / SUMMARY).read_text())
    return run


def text_summary(runs: list[RunCurves]) -> str:
    """A line per run: steps, final and best eval AUC (with its step), log loss, QPS."""
    lines = [f"{'run':<24} {'steps':>7} {'eval AUC':>9} {'best AUC':>9} {'at step':>8} {'logloss':>8} "
             f"{'train QPS':>10} {'oracle AUC':>10}"]
    for run in runs:
        steps, auc = run.series.get(("eval", "auc"), ([], []))
        _, logloss = run.series.get(("eval", "logloss"), ([], []))
        _, qps = run.series.get(("train", "qps"), ([], []))
        finite = [i for i, value in enumerate(auc) if math.isfinite(value)]  # a NaN AUC is never the best
        best = max(finite, key=auc.__getitem__) if finite else None
        oracle = run.summary.get("oracle_auc")
        lines.append(
            f"{run.name:<24} {run.summary.get('steps', steps[-1] if steps else 0):>7} "
            f"{_number(auc[-1] if auc else None):>9} {_number(auc[best] if best is not None else None):>9} "
            f"{steps[best] if best is not None else '-':>8} {_number(logloss[-1] if logloss else None):>8} "
            f"{_number(run.summary.get('train_qps', qps[-1] if qps else None), 0):>10} {_number(oracle):>10}")
    return "\n".join(lines)


def figures(runs: list[RunCurves]) -> dict[str, Any]:
    """PNG name → a matplotlib figure of its panels, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    out = {}
    for name, panels in PLOTS.items():
        figure, axes = pyplot.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, (split, metric, label) in zip(axes[0], panels):
            for run in runs:
                steps, values = run.series.get((split, metric), ([], []))
                ax.plot(steps, values, marker="o" if split == "eval" else None, markersize=3, label=run.name)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        figure.tight_layout()
        out[name] = figure
    return out


def write_report(run_dirs: list[str | Path], out_dir: str | Path) -> tuple[str, list[Path]]:
    """The text summary, and the PNGs written under ``out_dir`` (none without matplotlib)."""
    runs = [read_run(d) for d in run_dirs]
    text = text_summary(runs)
    try:
        drawn = figures(runs)
    except ImportError:
        return text + "\n(no plots: matplotlib is not installed; pip install 'neorec[report]')", []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in drawn.items():
        path = out / f"{name}.png"
        figure.savefig(path, dpi=100)
        written.append(path)
    return text, written


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
