"""Following partitions (``neorec bench follow``) on drifting synthetic data (the planted
teacher turns between partitions), in this process:

- throughput: training QPS while following, against the same rows trained as one fixed
  dataset (one epoch over every partition's files);
- lag: each partition lands (its files linked in, its marker written) once the follower
  finished the one before, so it is waiting; the lag from the marker to the end of the
  partition's training, less that training's own seconds, median over partitions;
- checkpoint stall: an incremental checkpoint after every partition, as ``bench
  checkpoint`` measures it (the seconds the steps stood still, per checkpoint);
- quality: each partition's progressive AUC (the model evaluated on it before training on
  it) against the teacher's oracle AUC on it, and against a model frozen after the first
  partition (its checkpoint evaluated on every later partition); beside them the late
  oracle, the AUC of the previous partition's teacher (a perfect model one partition
  behind): the part of the gap to the oracle that the drift itself makes (the drift floor).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from neorec.ingest.partitions import MARKER, open_partition, partitions_dir
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, partitioned_dataset, write_partition
from neorec.orchestration.report import RunCurves, partition_table, read_run
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.step import set_threads
from neorec.trainer.run.train import evaluate_checkpoint, train

DRIFT = 0.05
"""Quarter turns of the teacher per partition: a model one partition behind loses about
0.001 AUC to the drift (0.1 made that floor 0.004-0.006, half the quality goal), while a
frozen model falls 0.1 AUC behind within the 12 partitions."""
ROWS = 200_000
"""Rows per partition (a production hourly partition holds millions)."""
ADAGRAD_DECAY = 0.99
"""The embeddings' row-wise Adagrad accumulator decay, as recommended for following."""
SETTLED_AFTER = 3
"""The quality claim holds for the partitions after this many."""
ORACLE_GAP = 0.01


def run(quick: bool = False) -> dict[str, Any]:
    threads = set_threads(0)
    partitions, rows = (3, 4_000) if quick else (12, ROWS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = SynthSpec(rows=partitions * rows, partitions=partitions, drift=DRIFT,
                         row_group_rows=2_000 if quick else 25_000, seed=0)
        data = root / "data"
        partitioned_dataset(spec, data)
        names = [write_partition(spec, data, index) for index in range(partitions)]
        model = _model(quick)

        fixed = train(_config(_view(root / "fixed", data, names, fixed=True), root / "fixed-run", model, follow=False))
        frozen_run = root / "frozen-run"
        train(_config(_view(root / "first", data, names[:1]), frozen_run, model))
        landing = root / "landing"
        lander = _Lander(data, landing, names, root / "follow-run")
        lander.start()
        try:
            follow = train(_config(landing, root / "follow-run", model, checkpoint={"every_partitions": 1}))
        finally:
            lander.stop()

        curves = read_run(root / "follow-run")
        first = curves.partitions[names[0]]  # the frozen model is following's until the first partition trains
        frozen = RunCurves("frozen", partitions={names[0]: {"auc": first["auc"], "oracle_auc": first["oracle_auc"]}})
        for name in names[1:]:
            on = _config(data, frozen_run, model, eval_split=f"partitions/{name}")
            frozen.partitions[name] = {"auc": evaluate_checkpoint(frozen_run, on)["auc"],
                                       "oracle_auc": curves.partitions[name]["oracle_auc"]}
        curves.name = "follow"
        late_oracle = {name: info["late_oracle"]["auc"] for name in names
                       if "late_oracle" in (info := open_partition(data, name).info)}
        return _results(quick, threads, names, fixed, follow, curves, frozen, late_oracle)


def _results(quick: bool, threads: int, names: list[str], fixed: dict[str, Any], follow: dict[str, Any],
             curves: RunCurves, frozen: RunCurves, late_oracle: dict[str, float]) -> dict[str, Any]:
    table = []
    for name in names:
        done, still = curves.partitions[name], frozen.partitions[name]
        table.append({"partition": name, "follow_auc": done["auc"], "frozen_auc": still["auc"],
                      "oracle_auc": done["oracle_auc"], "late_oracle_auc": late_oracle.get(name),
                      "train_s": done["seconds"], "lag_s": done["lag_s"]})
    settled = table[SETTLED_AFTER:] or table[-1:]
    stalls = follow.get("checkpoint_stall_s", 0.0)
    return {
        "benchmark": "follow",
        "quick": quick,
        "threads": threads,
        "partitions": len(names),
        "trained_rows_per_partition": int(curves.partitions[names[0]]["rows"]),
        "follow_qps": follow["train_qps"],
        "fixed_qps": fixed["train_qps"],
        "throughput_ratio": follow["train_qps"] / fixed["train_qps"],
        "median_lag_over_training_s": statistics.median(r["lag_s"] - r["train_s"] for r in table),
        "median_lag_s": statistics.median(r["lag_s"] for r in table),
        "checkpoint_stall_s_per_checkpoint": stalls / len(names),
        "checkpoint_stall_frac": stalls / (follow["train_samples"] / follow["train_qps"]),
        "settled_after": SETTLED_AFTER,
        "settled_within_oracle": all(r["oracle_auc"] - r["follow_auc"] <= ORACLE_GAP for r in settled),
        "settled_max_oracle_gap": max(r["oracle_auc"] - r["follow_auc"] for r in settled),
        "settled_max_drift_floor": max(r["oracle_auc"] - r["late_oracle_auc"] for r in settled),
        "settled_mean_margin_over_frozen": statistics.mean(r["follow_auc"] - r["frozen_auc"] for r in settled),
        "per_partition": table,
        "table": partition_table([curves, frozen]).splitlines(),
    }


def _model(quick: bool) -> dict[str, Any]:
    """The model and optimizer sections of every run (the demo model; smaller when quick)."""
    return {
        "model": {"max_table_rows": 3_000 if quick else 200_000, "embedding_dim": 8 if quick else 16,
                  "bottom_mlp": [16, 8] if quick else [64, 32, 16], "top_mlp": [16, 1] if quick else [128, 64, 1]},
        "optimizer": {"sparse": "rowwise_adagrad", "sparse_lr": 0.05, "sparse_adagrad_decay": ADAGRAD_DECAY,
                      "dense": "adam", "dense_lr": 0.001},
        "train": {"batch_size": 512, "eval_batch_size": 4096, "log_every": 1_000_000},
    }


def _config(path: Path, run_dir: Path, model: dict[str, Any], follow: bool = True, eval_split: str = "eval",
            checkpoint: dict[str, Any] | None = None) -> TrainConfig:
    raw = {**model, "data": {"path": str(path), "dense_transform": "log1p", "follow": follow,
                             "poll_interval_s": 0.05, "idle_exit_s": 3.0, "eval_split": eval_split},
           "checkpoint": {"final": True, **(checkpoint or {})}, "run": {"dir": str(run_dir)}}
    return TrainConfig.from_dict(raw)


def _view(root: Path, data: Path, names: list[str], fixed: bool = False) -> Path:
    """A dataset at ``root`` over ``data``'s partitions ``names`` (linked): as partitions,
    or (``fixed``) as one train split of all their files, the last partition the eval split."""
    dataset = Dataset.load(data)
    files = [f for name in names for f in open_partition(data, name).files]
    splits = {"train": files, "eval": list(open_partition(data, names[-1]).files)} if fixed else {}
    root.mkdir()
    Dataset(root=root, schema=dataset.schema, splits=splits, profile=dataset.profile).save()
    for name in names:
        _link_partition(data, root, name, marker=not fixed)
    return root


def _link_partition(data: Path, root: Path, name: str, marker: bool = True) -> None:
    """Partition ``name`` of ``data`` in ``root`` too (hard links), its marker written last."""
    source, target = partitions_dir(data) / name, partitions_dir(root) / name
    target.mkdir(parents=True)
    for entry in sorted(source.iterdir()):
        if entry.name != MARKER:
            os.link(entry, target / entry.name)
    if marker:
        (target / MARKER).touch()


class _Lander(threading.Thread):
    """Lands the partitions one by one in ``landing``, each once the follower (its run
    directory ``run_dir``) logged the end of the one before."""

    def __init__(self, data: Path, landing: Path, names: list[str], run_dir: Path) -> None:
        super().__init__(name="partition-lander", daemon=True)
        self.data, self.landing, self.names, self.run_dir = data, landing, names, run_dir
        dataset = Dataset.load(data)
        landing.mkdir()
        Dataset(root=landing, schema=dataset.schema, splits={}, profile=dataset.profile).save()
        _link_partition(data, landing, names[0])
        self._done = threading.Event()

    def run(self) -> None:
        for index, name in enumerate(self.names[1:], 1):
            while self._trained() < index:
                if self._done.wait(0.02):
                    return
            _link_partition(self.data, self.landing, name)

    def _trained(self) -> int:
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return 0
        return sum(1 for line in lines if line.endswith("}") and json.loads(line)["split"] == "partition")

    def stop(self) -> None:
        self._done.set()
        self.join()

