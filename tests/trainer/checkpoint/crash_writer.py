"""A process that writes checkpoints until it is killed: ``python -m
tests.trainer.checkpoint.crash_writer ROOT``. It restores the newest complete checkpoint
under ROOT (if any), says ``ready STEP`` and goes on from there, one checkpoint a step.
The state after step ``s`` is :func:`state_after`, so a test can check any restore."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from neorec.trainer.checkpoint.checkpointer import Checkpointer
from neorec.trainer.checkpoint.layout import complete
from neorec.trainer.checkpoint.restore import open_checkpoint, restore_embeddings
from neorec.trainer.config import CheckpointConfig
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from tests.trainer.checkpoint.helpers import state

TABLES = [TableConfig("big", 60_000, 16, ("a",)), TableConfig("small", 5_000, 8, ("b",))]


def fresh() -> FusedEmbeddingBagCollection:
    return FusedEmbeddingBagCollection(TABLES, SparseOptimizer("adagrad", 0.1), seed=0)


def apply_step(module: FusedEmbeddingBagCollection, step: int) -> None:
    """Step ``step``'s change: a few thousand rows of each table set to values of the step."""
    rng = np.random.default_rng(step)
    for t in TABLES:
        rows = torch.from_numpy(rng.choice(t.num_embeddings, size=3000, replace=False))
        module.table_weight(t.name).index_fill_(0, rows, float(step))
        module.table_state(t.name)[0].index_fill_(0, rows, float(step) * 2)
        module.shard_views()[TABLES.index(t)].touched.mark(rows)  # as the update kernels mark rows
    module.optimizer_step.fill_(step)


def state_after(step: int) -> dict[str, torch.Tensor]:
    module = fresh()
    for s in range(1, step + 1):
        apply_step(module, s)
    return state(module)


def main(root: Path) -> None:
    module = fresh()
    step, chain = 0, []
    if complete(root):
        restorable = open_checkpoint(root)
        restore_embeddings(restorable, module.shard_views())
        module.set_optimizer_steps(restorable.manifest.sparse_steps)
        step, chain = restorable.manifest.step, restorable.manifest.chain
    tables = {t.name: {"rows": t.num_embeddings, "dim": t.embedding_dim, "storage": "fp32", "optimizer": "adagrad",
                       "states": 1} for t in TABLES}
    writer = Checkpointer(root, CheckpointConfig(keep=3, asynchronous=True), rank=0, world_size=1,
                          attempt=f"attempt-{step}", views=module.shard_views, store=list,
                          local_optimizer_steps=module.local_optimizer_steps, tables=tables, run_config={},
                          plan=None, sum_over_ranks=lambda v: list(v), commit_timeout_s=10.0)
    writer.continue_chain(chain, 0.0, step)
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        apply_step(module, step)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense=None)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
