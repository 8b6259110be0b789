"""Small partitioned datasets and follow-mode configs for the follow tests."""

from __future__ import annotations

from pathlib import Path

from neorec.ingest.synth import SynthSpec, partitioned_dataset, write_partition
from neorec.trainer.config import TrainConfig

SPEC = SynthSpec(rows=4_800, partitions=4, drift=0.3, row_group_rows=400, seed=11)
"""Four partitions of 1,200 rows (three row groups each)."""


def partitioned(root: Path, partitions: int = 4) -> Path:
    """A dataset of ``SPEC`` with only its first ``partitions`` partitions written."""
    partitioned_dataset(SPEC, root)
    for index in range(partitions):
        write_partition(SPEC, root, index)
    return root


def follow_config(root: Path, run_dir: Path, **sections: dict) -> TrainConfig:
    raw = {
        "data": {"path": str(root), "follow": True, "poll_interval_s": 0.05, "idle_exit_s": 0.3},
        "model": {"max_table_rows": 3000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
        "optimizer": {"sparse": "adam", "dense": "adam"},
        "train": {"batch_size": 128, "eval_batch_size": 500, "log_every": 4},
        "checkpoint": {"every_steps": 5},
        "run": {"dir": str(run_dir)},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return TrainConfig.from_dict(raw)
