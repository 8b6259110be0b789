"""``neorec report RUN_DIR…``: a run's (or several runs') curves as PNG files and a short
text summary.

The curves are read from each run's ``metrics.jsonl``: train loss, eval AUC and eval log
loss, and train QPS, against the global step, one line per run (overlaid, labelled with
the run directory's name). A run following partitions also gets ``partitions.png``: each
partition's progressive AUC (evaluated before training on it, with the planted teacher's
oracle where the data has one) and the lag from its marker to the end of its training,
and a table of them. Plotting needs matplotlib (``pip install 'neorec[report]'``);
the text summary does not.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neorec.trainer.run.run_dir import METRICS, SUMMARY, RunDirError

log = logging.getLogger(__name__)

PLOTS = {"loss": [("train", "loss", "train loss")],
         "eval": [("eval", "auc", "eval AUC"), ("eval", "logloss", "eval log loss")],
         "qps": [("train", "qps", "train samples / s")]}
"""PNG name → its panels: (split, metric, axis label)."""
PARTITIONS_PLOT = "partitions"
"""The PNG of runs following partitions: progressive AUC and lag per partition."""


@dataclass
class RunCurves:
    """One run's metrics by split and metric: ``(steps, values)``."""

    name: str
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)
    """The numbers of its ``summary.json`` (a key whose value is no number is left out)."""
    partitions: dict[str, dict[str, float]] = field(default_factory=dict)
    """Following partitions, in training order: each one's numbers from its ``progressive``
    record (``auc``, ``logloss``, ``oracle_auc``, …) and its ``partition`` record (``lag_s``,
    ``rows``, …)."""


def read_run(run_dir: str | Path) -> RunCurves:
    """The curves of a run directory (its ``metrics.jsonl``, and ``summary.json`` if done)."""
    path = Path(run_dir)
    metrics = path / METRICS
    if not metrics.is_file():
        raise RunDirError(f"{path} is not a run directory (no {METRICS})")
    run = RunCurves(path.resolve().name)
    text = _text(metrics)
    lines = text.splitlines()
    if lines and not text.endswith("\n"):  # a record cut short by a killed run, which --resume cuts off too
        log.warning("%s: line %d is cut short (a run killed as it wrote it?): left out", metrics, len(lines))
        lines.pop()
    for number, line in enumerate(lines, 1):
        record = _object(line, f"{metrics}: line {number}")
        if "split" not in record:
            continue  # an event (a skipped checkpoint, say), not metrics
        if not _is_number(record.get("step")):
            raise RunDirError(f"{metrics}: line {number} has no step number")
        if record.get("partition") and record["split"] in ("progressive", "partition"):
            run.partitions.setdefault(record["partition"], {}).update(
                {k: float(v) for k, v in record.items() if k not in ("step", "epoch") and _is_number(v)})
        for key, value in record.items():
            if key in ("split", "step", "epoch") or not _is_number(value):
                continue
            steps, values = run.series.setdefault((record["split"], key), ([], []))
            steps.append(record["step"])
            values.append(float(value))
    if (path / SUMMARY).is_file():
        summary = _object(_text(path / SUMMARY), str(path / SUMMARY))
        run.summary = {k: v for k, v in summary.items() if _is_number(v)}  # null or text: as if absent
    return run


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode()
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not UTF-8 text") from None


def _object(text: str, where: str) -> dict[str, Any]:
    """The JSON object ``text`` holds; a :class:`RunDirError` naming ``where`` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise RunDirError(f"{where} is not JSON") from None
    if not isinstance(value, dict):
        raise RunDirError(f"{where} is not a JSON object")
    return value


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


def partition_table(runs: list[RunCurves]) -> str:
    """A line per partition (of the runs following partitions): each run's progressive AUC,
    the oracle's, and each run's lag from marker to trained (seconds)."""
    following = [run for run in runs if run.partitions]
    names = sorted({name for run in following for name in run.partitions})
    lagged = [run for run in following if any("lag_s" in p for p in run.partitions.values())]
    header = [f"{'partition':<24}", *(f"{run.name[:16] + ' AUC':>20}" for run in following), f"{'oracle AUC':>10}",
              *(f"{run.name[:14] + ' lag s':>20}" for run in lagged)]
    lines = [" ".join(header)]
    for name in names:
        oracle = next((run.partitions[name]["oracle_auc"] for run in following
                       if "oracle_auc" in run.partitions.get(name, {})), None)
        cells = [f"{name:<24}", *(f"{_number(run.partitions.get(name, {}).get('auc')):>20}" for run in following),
                 f"{_number(oracle):>10}",
                 *(f"{_number(run.partitions.get(name, {}).get('lag_s'), 2):>20}" for run in lagged)]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def partition_figure(runs: list[RunCurves]) -> Any:
    """Progressive AUC (with the oracle's, dashed) and lag per partition, a line per run."""
    from matplotlib import pyplot

    names = sorted({name for run in runs for name in run.partitions})
    figure, (auc_ax, lag_ax) = pyplot.subplots(1, 2, figsize=(12, 4))
    oracle: dict[str, float] = {}
    for run in runs:
        points = [(names.index(n), p) for n, p in run.partitions.items()]
        auc = [(i, p["auc"]) for i, p in points if "auc" in p]
        lag = [(i, p["lag_s"]) for i, p in points if "lag_s" in p]
        if auc:
            auc_ax.plot(*zip(*auc), marker="o", markersize=3, label=run.name)
        if lag:
            lag_ax.plot(*zip(*lag), marker="o", markersize=3, label=run.name)
        oracle.update({n: p["oracle_auc"] for n, p in run.partitions.items() if "oracle_auc" in p})
    if oracle:
        auc_ax.plot(*zip(*sorted((names.index(n), v) for n, v in oracle.items())), linestyle="--", color="gray",
                    label="oracle")
    for ax, label in ((auc_ax, "progressive AUC"), (lag_ax, "lag: marker → trained (s)")):
        ax.set_xlabel(f"partition ({names[0]} … {names[-1]})" if names else "partition")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    return figure


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
    if any(run.partitions for run in runs):
        out[PARTITIONS_PLOT] = partition_figure(runs)
    return out


def write_report(run_dirs: list[str | Path], out_dir: str | Path) -> tuple[str, list[Path]]:
    """The text summary, and the PNGs written under ``out_dir`` (none without matplotlib)."""
    runs = [read_run(d) for d in run_dirs]
    text = text_summary(runs)
    if any(run.partitions for run in runs):
        text += "\n\n" + partition_table(runs)
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
