"""Training and evaluation entry points, and what the training loop is made of: the
readers, one training step, the thread settings."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numba
import pyarrow
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ingest.client import ClientOptions, RemoteReader
from ingest.transport import ClientSecurity, read_token
from ingest.decoder import DecodeOptions
from ingest.errors import DataError
from ingest.plan import RankPlan
from ingest.reader import BatchReader, InProcessReader, ReaderConfig
from ingest.schema import Dataset
from trainer import checkpoint
from trainer.batch import Batch
from trainer.build import build_model, decode_options, store_settings
from trainer.checkpoint.layout import best_checkpoint
from trainer.config import DEFAULT_CACHE_FRACTION, TrainConfig
from trainer.distributed import (SINGLE_PROCESS, DistributedContext, explain_collective_failure,
                                 global_sum)
from trainer.metrics import evaluate
from trainer.model import DLRM
from trainer.planner.from_config import plan_for_config
from trainer.store_backed import store_of


@dataclass(frozen=True)
class StepReport:
    """Handed to the progress callback after every step."""

    global_step: int
    epoch: int
    loss: float
    """The step's mean loss (sharded runs: estimated from rank 0's samples alone)."""
    qps: float
    total_steps: int
    input_wait_frac: float = 0.0
    """Of the training time so far (completed epochs), the share spent waiting for batches."""
    last_checkpoint: str = ""
    """The newest checkpoint committed ("" before the first)."""


ProgressFn = Callable[[StepReport], None]


def set_threads(threads: int, ranks_on_host: int = 1) -> int:
    """Use ``threads`` threads in torch, the Numba kernels and Arrow's decoding (0: the
    host's cores shared by its ``ranks_on_host`` ranks); returns it."""
    cores = numba.config.NUMBA_NUM_THREADS
    count = max(1, cores // ranks_on_host) if threads == 0 else min(threads, cores)
    torch.set_num_threads(count)
    numba.set_num_threads(count)
    pyarrow.set_cpu_count(count)
    return count


def train_step(model: DLRM | DistributedDataParallel, optimizer: torch.optim.Optimizer, batch: Batch,
               context: DistributedContext = SINGLE_PROCESS, full_batches: bool = False) -> torch.Tensor:
    """One step: forward, BCE loss, backward (which also updates the embeddings), dense
    optimizer step. Returns this rank's share of the loss (a scalar tensor; the shares of
    all ranks sum to the mean loss over the valid samples of the global batch).

    ``full_batches``: every rank's batch is known to be all valid samples (no padding), so a
    sharded step needs no all-reduce of the valid count.
    """
    logits = model(batch)
    valid = batch.num_valid
    if context.distributed:
        loss = F.binary_cross_entropy_with_logits(logits[:valid], batch.labels[:valid], reduction="sum")
        if full_batches:
            if valid != batch.batch_size:
                raise AssertionError(f"a padded batch ({valid} of {batch.batch_size} valid) where none was planned")
            loss = loss / (batch.batch_size * context.world_size)
        else:
            loss = loss / global_sum(context, [float(valid)])[0]
    else:
        loss = F.binary_cross_entropy_with_logits(logits[:valid], batch.labels[:valid])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_reader_config(config: TrainConfig, context: DistributedContext = SINGLE_PROCESS) -> ReaderConfig:
    """This rank's batches of the train split: shuffled as ``data.shuffle`` says."""
    data, loop = config.data, config.train
    return ReaderConfig(batch_size=loop.batch_size, seed=loop.seed, rank=context.rank, world_size=context.world_size,
                        remainder=data.remainder, shuffle=data.shuffle, window=data.shuffle_window)


def eval_reader_config(config: TrainConfig, context: DistributedContext = SINGLE_PROCESS) -> ReaderConfig:
    """This rank's batches of the eval split: every row, in file order, never shuffled."""
    return ReaderConfig(batch_size=config.train.eval_batch_size, seed=config.train.seed, rank=context.rank,
                        world_size=context.world_size, remainder="pad", shuffle="none")


def make_reader(dataset: Dataset, split: str, options: DecodeOptions, reader_config: ReaderConfig,
                config: TrainConfig) -> BatchReader:
    """The reader services of ``data.ingest`` if any, else the in-process reader."""
    if not config.data.ingest:
        return InProcessReader(dataset, split, options, reader_config)
    data = config.data
    return RemoteReader(dataset, split, options, reader_config, data.ingest,
                        ClientOptions(compression=data.ingest_compression, stall_timeout_s=data.ingest_stall_timeout_s,
                                      progress_timeout_s=data.ingest_progress_timeout_s,
                                      security=client_security(config)))


def client_security(config: TrainConfig) -> ClientSecurity:
    """TLS and token for the connections to services, as ``[security]`` says."""
    security = config.security
    return ClientSecurity(tls_ca=security.tls_ca or None, token=read_token(security.token_file or None))


def check_dense_transform(dataset: Dataset, config: TrainConfig) -> None:
    """Refuse to take the log of dense values the importer already transformed."""
    applied = (dataset.generator or {}).get("dense_transform", "none")
    if applied != "none" and dataset.schema.dense and config.data.dense_transform != "identity":
        raise DataError(f"the dense values of {dataset.root} were transformed when imported ({applied}): train "
                        f"with data.dense_transform = 'identity'")


def check_splits(train_plan: RankPlan, eval_plan: RankPlan, config: TrainConfig) -> None:
    """Raise :class:`DataError` naming the split when training could not run or end: a train
    split too small for one step, or an eval split without rows."""
    data = config.data
    if train_plan.num_batches == 0:
        raise DataError(f"split {data.train_split!r} of {data.path} holds {train_plan.total_rows} rows, fewer than "
                        f"one step of {train_plan.world_size} x {train_plan.batch_size} rows (ranks x train.batch_size)")
    if eval_plan.total_rows == 0:
        raise DataError(f"split {data.eval_split!r} of {data.path} holds no rows: evaluation needs at least one "
                        f"(set data.eval_split to a split with rows)")


def batches(reader: BatchReader, epoch: int, first_step: int = 0,
            device: torch.device = torch.device("cpu")) -> Iterator[Batch]:
    return (Batch.from_host(b).to(device) for b in reader.epoch(epoch, first_step))


def train(config: TrainConfig, progress: ProgressFn | None = None, context: DistributedContext = SINGLE_PROCESS,
          overwrite: bool = False, resume: bool = False) -> dict[str, Any]:
    """Train as ``config`` says and write the run directory; returns the summary.

    With a distributed ``context`` every rank calls this: the tables are sharded as the
    planner (and ``config.sharding``) says, the MLPs are data parallel, each rank reads its
    share of every epoch, and rank 0 writes the run directory. Its summary's counts and
    rates are global. A run directory that holds another run is refused unless
    ``overwrite``; ``resume`` continues the run in it from its newest complete checkpoint
    (same epoch, step, next batch and RNG). A collective that fails because a rank went
    silent raises :class:`~trainer.distributed.RankSilentError` naming it.
    """
    from trainer.loop import TrainingRun

    try:
        run = TrainingRun(config, context, overwrite=overwrite, resume=resume)
        return run.run(progress)
    except RuntimeError as err:
        if context.distributed:
            raise explain_collective_failure(context, err) from err.__cause__
        raise


def evaluate_checkpoint(checkpoint_dir: str | Path, config: TrainConfig | None = None,
                        best: bool = False) -> dict[str, float]:
    """Metrics of a saved model on the eval split: the config saved with the checkpoint
    unless ``config`` is given. ``checkpoint_dir``: a run directory, its checkpoints
    directory, or one checkpoint; ``best``: the run's best checkpoint (``keep_best``)."""
    root, named = checkpoint.checkpoints_root(checkpoint_dir)
    name = None if named is None else named.name
    if best:
        name = best_checkpoint(root)
        if name is None:
            raise checkpoint.CheckpointError(f"{root} has no best checkpoint (train with checkpoint.keep_best = true)")
    restorable = checkpoint.open_checkpoint(root, name)
    if config is None:
        config = TrainConfig.from_dict(restorable.manifest.config)
    set_threads(config.train.threads)
    dataset = Dataset.load(config.data.path)
    on_store = {entry.table for entry in restorable.manifest.store}
    with tempfile.TemporaryDirectory(prefix="neorec-eval-store-") as store_dir:
        plan = None
        if on_store:  # the same tables on the store, their tiers here, linked from the checkpoint
            fraction = config.embedding_store.cache_fraction or DEFAULT_CACHE_FRACTION
            config = replace(config, embedding_store=replace(
                config.embedding_store, tables={t: config.embedding_store.tables.get(t, fraction) for t in on_store},
                service=""))
            plan = plan_for_config(dataset, config, 1).plan
        model = build_model(dataset, config, plan, store=store_settings(config, Path(store_dir), reset=True))
        checkpoint.restore_model(restorable, model)
        reader = make_reader(dataset, config.data.eval_split, decode_options(dataset.schema, config),
                             eval_reader_config(config), config)
        try:
            return evaluate(model, batches(reader, 0))
        finally:
            reader.close()
            store = store_of(model.embeddings)
            if store is not None:
                store.close(write_back=False)
