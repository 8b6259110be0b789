"""What the train loop calls: when to checkpoint, full or incremental, and the snapshot.

The decisions are the same on every rank: steps are counted alike, a time-based checkpoint
is decided where the ranks already meet (the loop passes what they agreed), and the
choice between a full and an incremental checkpoint uses the modified rows summed over
all ranks (one small collective while the step is stalled anyway).
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any, Callable

import torch

from neorec.common.durable import write_durably
from neorec.common.wording import counted
from neorec.trainer.checkpoint.layout import (BEST, CheckpointError, Manifest, best_checkpoint, read_manifest,
                                              step_name)
from neorec.trainer.checkpoint.snapshot import take_snapshot
from neorec.trainer.checkpoint.store import snapshot_store
from neorec.trainer.checkpoint.writer import CheckpointJob, CheckpointWriter, manifest_fields
from neorec.trainer.config import CheckpointConfig, TrainConfig
from neorec.trainer.embedding.fused import ShardView
from neorec.trainer.embedding.store_backed import StorePiece

SumFn = Callable[[list[float]], list[float]]
"""Values summed over every rank (identity in a single process)."""


class Checkpointer:
    """Writes the checkpoints of one training attempt under ``root``.

    ``views()`` gives this rank's embedding pieces in memory, ``store()`` its pieces on the
    embedding store (their rows written back); ``tables`` describes every table of the
    model (rows, dim, storage, optimizer, states) for the manifest; ``attempt`` is shared
    by the attempt's ranks. ``incremental_state(full)`` (called on every rank: it may be a
    collective) gives the state that is kept like the rows, as what changed since the last
    checkpoint (all of it for a full one): rank 0's goes into the dense state as ``incremental``.
    """

    def __init__(self, root: Path, config: CheckpointConfig, *, rank: int, world_size: int, attempt: str,
                 views: Callable[[], list[ShardView]], store: Callable[[], list[StorePiece]],
                 local_optimizer_steps: Callable[[], int],
                 tables: dict[str, dict[str, Any]], run_config: dict[str, Any], plan: dict[str, Any] | None,
                 sum_over_ranks: SumFn, commit_timeout_s: float,
                 incremental_state: Callable[[bool], dict[str, Any]] | None = None) -> None:
        self.root = root
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.views = views
        self.store = store
        self.local_optimizer_steps = local_optimizer_steps
        self.tables = tables
        self.run_config = run_config
        self.plan = plan
        self.sum_over_ranks = sum_over_ranks
        self.commit_timeout_s = commit_timeout_s
        self.incremental_state = incremental_state
        self.writer = CheckpointWriter(config.asynchronous)
        self.chain: list[str] = []
        """The chain the next incremental checkpoint extends (empty: the next is full)."""
        self.best_chain: list[str] = []
        """The chain of the best checkpoint (``keep_best``): never pruned."""
        self.chain_rows = 0.0
        """Rows written by the increments of ``chain`` (over all ranks)."""
        self.total_rows = float(sum(t["rows"] for t in tables.values()))
        self.last_time = time.monotonic()
        self.last_step = -1

    def continue_chain(self, chain: list[str], chain_rows: float, global_step: int) -> None:
        """The model was just restored from the checkpoint of ``global_step`` at the end of
        ``chain`` (whose increments wrote ``chain_rows`` rows): the next incremental
        checkpoint extends it."""
        self.chain = list(chain)
        self.chain_rows = chain_rows
        self.last_step = global_step
        best = best_checkpoint(self.root)
        if best is not None and (self.root / best).is_dir():
            self.best_chain = read_manifest(self.root / best).chain

    def due(self, global_step: int) -> bool:
        """Whether ``every_steps`` asks for a checkpoint after ``global_step``."""
        every = self.config.every_steps
        return bool(every) and global_step % every == 0

    def due_by_time(self) -> bool:
        """Whether ``every_minutes`` have passed since the last checkpoint (this rank's clock:
        the loop agrees on it with the other ranks)."""
        minutes = self.config.every_minutes
        return bool(minutes) and time.monotonic() - self.last_time >= 60 * minutes

    def save(self, *, global_step: int, epoch: int, step_in_epoch: int, dense: dict[str, Any] | None,
             wait: bool = False, best: bool = False) -> None:
        """Checkpoint the state after ``global_step`` (``dense``: rank 0's dense state);
        returns once the snapshot is taken (and the checkpoint committed, with ``wait``).
        ``best``: it is the best model so far (``BEST`` names it, and it is kept)."""
        if global_step == self.last_step:  # already written: at most it becomes the best
            if best:
                self.writer.wait()
                self.best_chain = list(self.chain)
                if self.rank == 0:
                    write_durably(self.root / BEST, (self.chain[-1] + "\n").encode())
            return
        self.writer.wait()  # one checkpoint in flight at a time
        started = time.perf_counter()
        views = self.views()
        touched_here = sum(v.touched.count() for v in views if self.rank == 0 or not v.replicated)
        (touched,) = self.sum_over_ranks([float(touched_here)])
        full = self.config.mode == "full" or not self.chain or self.chain_rows + touched > self.total_rows
        shards = take_snapshot(views, full, self.rank)
        name = step_name(global_step)
        store = snapshot_store(self.store(), self.root / name)
        dense_bytes = None
        incremental = None if self.incremental_state is None else self.incremental_state(full)  # every rank
        if dense is not None and incremental is not None:
            dense = {**dense, "incremental": incremental}
        if dense is not None:
            buffer = io.BytesIO()
            torch.save(dense, buffer)
            dense_bytes = buffer.getvalue()
        snapshot_s = time.perf_counter() - started
        chain = [name] if full else [*self.chain, name]
        manifest = None
        if self.rank == 0:
            manifest = manifest_fields(name=name, step=global_step, epoch=epoch, step_in_epoch=step_in_epoch,
                                       kind="full" if full else "incremental", chain=chain, bits=self.config.bits,
                                       world_size=self.world_size, config=self.run_config, plan=self.plan,
                                       tables=self.tables)
        self.writer.submit(CheckpointJob(
            directory=self.root / name, rank=self.rank, world_size=self.world_size, attempt=self.attempt,
            shards=shards, store=store, bits=self.config.bits, sparse_steps=self.local_optimizer_steps(),
            dense=dense_bytes,
            manifest=manifest, keep=self.config.keep, protect=set(chain if best else self.best_chain),
            commit_timeout_s=self.commit_timeout_s, snapshot_s=snapshot_s, best=best))
        if best:
            self.best_chain = chain
        self.chain = chain
        self.chain_rows = 0.0 if full else self.chain_rows + touched
        self.last_time = time.monotonic()
        self.last_step = global_step
        if wait:
            self.writer.wait()

    def close(self) -> None:
        """Wait for the checkpoint in flight (raising its error, if any)."""
        self.writer.wait()

    def abandon(self) -> None:
        """Training failed: let the checkpoint in flight finish (bounded by the commit
        timeout), without raising."""
        self.writer.abandon(self.commit_timeout_s)


RESUMABLE_SECTIONS = ("model", "optimizer")
RESUMABLE_KEYS = {"data": ("path", "follow", "train_split", "eval_split", "dense_transform", "id_mapping",
                           "remainder", "shuffle", "shuffle_window"),
                  "train": ("seed", "batch_size")}
"""What must not change for a resumed run to continue the same run: the model, the
optimizers, the data and its order. The rest (epochs, logging, threads, devices, reader
services, sharding, checkpoints) may."""


EVALUABLE_KEYS = {"model": ("embedding_dim", "bottom_mlp", "top_mlp", "max_table_rows", "pooling", "dynamic"),
                  "data": ("dense_transform", "id_mapping")}
"""What a config that evaluates a checkpoint must share with the run that saved it: the
model's shapes and what its inputs mean. The data it evaluates on, its devices and the
rest may differ."""


def check_resumable(saved: dict[str, Any], config: TrainConfig) -> None:
    """Raise :class:`~neorec.trainer.checkpoint.layout.CheckpointError` naming the first setting of
    ``config`` that differs from the checkpoint's ``saved`` config where a resumed run must
    not differ."""
    current = config.to_dict()
    keys = [(section, key) for section in RESUMABLE_SECTIONS for key in current[section]]
    keys += [(section, key) for section, names in RESUMABLE_KEYS.items() for key in names]
    _check_same(saved, current, keys, "--resume", "a resumed run keeps the model, optimizers and data of the run it "
                                                  "continues")


def check_position_carries_over(manifest: Manifest, world_size: int) -> None:
    """Raise :class:`~neorec.trainer.checkpoint.layout.CheckpointError` when the checkpoint
    lies inside an epoch (or a followed partition) and was made by another number of ranks
    than ``world_size``. Each rank reads a contiguous share of an epoch's rows of its own
    (:func:`neorec.ingest.plan.plan_epoch`), so with another count the rows read so far are
    not a position the epoch can go on from: some would be trained twice, others never."""
    if manifest.world_size != world_size and manifest.step_in_epoch != 0:
        raise CheckpointError(
            f"--resume: checkpoint {manifest.name} was made by {counted(manifest.world_size, 'rank')}, "
            f"{counted(manifest.step_in_epoch, 'step')} into its epoch (or partition), and this run has {world_size}: "
            f"each rank reads its own share of an epoch's rows, so another number of ranks cannot go on from the same "
            f"rows. Resume with {counted(manifest.world_size, 'rank')}, or from a checkpoint at the start of an epoch "
            f"or partition")


def check_evaluable(saved: dict[str, Any], config: TrainConfig) -> None:
    """Raise :class:`~neorec.trainer.checkpoint.layout.CheckpointError` naming the first of
    :data:`EVALUABLE_KEYS` where ``config`` differs from the checkpoint's ``saved`` config."""
    keys = [(section, key) for section, names in EVALUABLE_KEYS.items() for key in names]
    _check_same(saved, config.to_dict(), keys, "eval", "the model evaluated is the model the checkpoint holds")


def _check_same(saved: dict[str, Any], current: dict[str, Any], keys: list[tuple[str, str]], command: str,
                why: str) -> None:
    for section, key in keys:
        before, now = saved.get(section, {}).get(key), current[section][key]
        if before != now:
            where, before, now = _first_difference(f"{section}.{key}", before, now)
            raise CheckpointError(f"{command}: {where} is {now!r}, the checkpoint was made with {before!r}; {why}")


def _first_difference(where: str, before: Any, now: Any) -> tuple[str, Any, Any]:
    """The dotted key of the first difference between two unequal config values, and its two
    values there (within tables of tables, the innermost key that differs)."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(before.keys() | now.keys()):
            if before.get(key) != now.get(key):
                return _first_difference(f"{where}.{key}", before.get(key), now.get(key))
    return where, before, now
