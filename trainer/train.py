"""The single-process training loop and the evaluation entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
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
from trainer.affinity import pin_rank
from trainer.batch import Batch
from trainer.build import build_model, decode_options, dense_optimizer, single_process_model
from trainer.config import TrainConfig
from trainer import run_dir as run_directory
from trainer.distributed import (SINGLE_PROCESS, DistributedContext, check_same_steps, explain_collective_failure,
                                 gather_arrays, global_sum, wrap_data_parallel)
from trainer.metrics import MetricsLog, evaluate
from trainer.model import DLRM
from trainer.planner.from_config import shared_plan
from trainer.prefetch import Prefetcher
from trainer.sharding.input_pipeline import InputPipeline
from trainer.sharding.sharded_embedding import PreparedSparse
from trainer.warmup import compile_kernels


@dataclass(frozen=True)
class StepReport:
    """Handed to the progress callback after every step."""

    global_step: int
    epoch: int
    loss: float
    """The step's mean loss (sharded runs: estimated from rank 0's samples alone)."""
    qps: float
    total_steps: int


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


def train(config: TrainConfig, progress: ProgressFn | None = None,
          context: DistributedContext = SINGLE_PROCESS, overwrite: bool = False) -> dict[str, Any]:
    """Train as ``config`` says and write the run directory; returns the summary.

    With a distributed ``context`` every rank calls this: the tables are sharded as the
    planner (and ``config.sharding``) says, the MLPs are data parallel, each rank reads its
    share of every epoch, and rank 0 writes the run directory. Its summary's counts and
    rates are global. A run directory that holds another run is refused unless
    ``overwrite``. A collective that fails because a rank went silent raises
    :class:`~trainer.distributed.RankSilentError` naming it.
    """
    try:
        return _train(config, progress, context, overwrite)
    except RuntimeError as err:
        if context.distributed:
            raise explain_collective_failure(context, err) from err.__cause__
        raise


def _train(config: TrainConfig, progress: ProgressFn | None, context: DistributedContext,
           overwrite: bool) -> dict[str, Any]:
    loop = config.train
    if loop.pin_cores:
        pin_rank(context.local_rank, context.local_world_size)
    set_threads(loop.threads, context.local_world_size)
    torch.manual_seed(loop.seed)
    dataset = Dataset.load(config.data.path)
    options = decode_options(dataset.schema, config)
    train_reader = make_reader(dataset, config.data.train_split, options, train_reader_config(config, context), config)
    eval_reader = make_reader(dataset, config.data.eval_split, options, eval_reader_config(config, context), config)
    check_splits(train_reader.plan(0), eval_reader.plan(0), config)
    run_dir = Path(config.run.dir)
    if context.is_main:
        run_dir = run_directory.claim(run_dir, overwrite=overwrite)
        run_directory.write_json(run_dir / run_directory.CONFIG, config.to_dict())
    device = context.device
    full_batches = config.data.remainder == "drop"
    steps_per_epoch = train_reader.plan(0).num_batches
    total_steps = steps_per_epoch * loop.epochs
    if loop.max_steps:
        total_steps = min(total_steps, loop.max_steps)
    # the first epoch's reading starts before training: a single process's while the model
    # is built, a sharded run's (whose routing needs the model) once it is
    early = None
    if loop.prefetch and not context.distributed:
        early = Prefetcher(batches(train_reader, 0, device=device), loop.prefetch)
    plan = shared_plan(dataset, config, context) if context.distributed else None
    dlrm = build_model(dataset, config, plan).to(device)
    if loop.prefetch and context.distributed:
        early = Prefetcher(_prepared(dlrm, batches(train_reader, 0, device=device), min(steps_per_epoch, total_steps)),
                           loop.prefetch)
    compile_kernels()  # load the Numba kernels now, not in the first steps
    optimizer = dense_optimizer(dlrm, config)
    model = wrap_data_parallel(dlrm) if context.distributed else dlrm
    if context.is_main and plan is not None:
        run_directory.write_json(run_dir / run_directory.PLAN, plan.to_dict())
    log = MetricsLog(run_dir / run_directory.METRICS if context.is_main else None)
    evaluate_split = partial(_log_eval, log, model, eval_reader, context)

    check_same_steps(context, steps_per_epoch, "train")
    check_same_steps(context, eval_reader.plan(0).num_batches, "eval")
    global_step = 0
    train_seconds = 0.0
    wait_seconds = 0.0
    samples = 0
    eval_metrics: dict[str, float] = {}
    try:
        for epoch in range(loop.epochs):
            if global_step >= total_steps:
                break
            if early is not None:
                source, early = early, None
                stream = source
            else:
                stream = batches(train_reader, epoch, device=device)
                if context.distributed:
                    stream = _prepared(dlrm, stream, min(steps_per_epoch, total_steps - global_step))
                source = Prefetcher(stream, loop.prefetch) if loop.prefetch else None
                stream = source or stream
            if context.distributed:
                stream = _distributed(dlrm, stream)
            interval = _Interval(context)
            try:
                for batch in stream:
                    share = float(train_step(model, optimizer, batch, context, full_batches))
                    global_step += 1
                    interval.add(share, batch.num_valid)
                    if progress is not None:
                        progress(StepReport(global_step, epoch, share * context.world_size, interval.qps(),
                                            total_steps))
                    if global_step % loop.log_every == 0 or global_step == total_steps:
                        report = interval.close()
                        log.write({"split": "train", "step": global_step, "epoch": epoch, **report})
                        train_seconds += report["seconds"]
                        samples += report["samples"]
                        interval = _Interval(context)
                    if loop.eval_every and global_step % loop.eval_every == 0:
                        evaluate_split(global_step, epoch)
                    if global_step >= total_steps:
                        break
                report = interval.close()
                train_seconds += report["seconds"]
                samples += report["samples"]
            finally:
                if source is not None:
                    wait_seconds += source.wait_seconds
                    source.close()
            eval_metrics = evaluate_split(global_step, epoch)
        if not eval_metrics:
            eval_metrics = evaluate_split(global_step, 0)
    finally:
        if early is not None:
            early.close()
        log.close()
        train_reader.close()
        eval_reader.close()

    if config.run.checkpoint:
        saved = single_process_model(dlrm, dataset, config) if context.distributed else dlrm
        if context.is_main:
            checkpoint.save(run_dir / "checkpoint", saved, optimizer,
                            checkpoint.Position(epoch=loop.epochs, global_step=global_step), config.to_dict())
    summary = {
        "steps": global_step,
        "train_samples": samples,
        "train_qps": samples / train_seconds if train_seconds else 0.0,
        "input_wait_frac": wait_seconds / train_seconds if train_seconds else 0.0,
        **{f"eval_{k}": v for k, v in eval_metrics.items()},
    }
    if dataset.oracle:
        summary["oracle_auc"] = dataset.oracle.get("eval_auc")
        summary["oracle_logloss"] = dataset.oracle.get("eval_logloss")
        summary["oracle_ne"] = dataset.oracle.get("eval_ne")
    if plan is not None:
        summary["world_size"] = context.world_size
    if context.is_main:
        run_directory.write_json(run_dir / run_directory.SUMMARY, summary)
    return summary


def evaluate_checkpoint(config: TrainConfig, checkpoint_dir: str | Path) -> dict[str, float]:
    """Metrics of a saved model on the config's eval split."""
    set_threads(config.train.threads)
    dataset = Dataset.load(config.data.path)
    model = build_model(dataset, config)
    checkpoint.load(checkpoint_dir, model)
    reader = make_reader(
        dataset, config.data.eval_split, decode_options(dataset.schema, config),
        eval_reader_config(config), config,
    )
    try:
        return evaluate(model, batches(reader, 0))
    finally:
        reader.close()


def _prepared(model: DLRM, epoch_batches: Iterator[Batch], steps: int) -> Iterator[tuple[Batch, PreparedSparse]]:
    """The first ``steps`` batches, each with its ids routed for the input all-to-all (run
    in the prefetch thread). Exactly ``steps`` on every rank, so no rank waits for a batch
    another rank never sends."""
    for batch in islice(epoch_batches, steps):
        yield batch, model.embeddings.prepare(batch.sparse)


def _distributed(model: DLRM, prepared: Iterator[tuple[Batch, PreparedSparse]]) -> Iterator[Batch]:
    """The batches with their ids sent to the ranks that hold their rows; the all-to-alls
    of the next batches are in flight while the caller trains on one."""
    for batch, distributed in InputPipeline(model.embeddings)(prepared):
        yield replace(batch, sparse=distributed)


def _log_eval(log: MetricsLog, model: DLRM | DistributedDataParallel, reader: BatchReader, context: DistributedContext, step: int,
              epoch: int) -> dict[str, float]:
    started = time.perf_counter()
    metrics = evaluate(model, batches(reader, 0), partial(gather_arrays, context))
    seconds = time.perf_counter() - started
    log.write({"split": "eval", "step": step, "epoch": epoch, "loss": metrics["logloss"],
               "qps": metrics["rows"] / seconds if seconds else 0.0, **metrics})
    return metrics


class _Interval:
    """Loss and throughput since the last log line, over all ranks."""

    def __init__(self, context: DistributedContext) -> None:
        self.context = context
        self.started = time.perf_counter()
        self.loss_shares = 0.0
        self.steps = 0
        self.samples = 0

    def add(self, loss_share: float, samples: int) -> None:
        """A step's loss share and valid samples on this rank."""
        self.loss_shares += loss_share
        self.steps += 1
        self.samples += samples

    def qps(self) -> float:
        """This rank's samples per second times the world size (a rank's view, no
        communication)."""
        elapsed = time.perf_counter() - self.started
        return self.samples * self.context.world_size / elapsed if elapsed else 0.0

    def close(self) -> dict[str, float]:
        """``loss`` (mean over the steps of the global batch's mean loss), global ``samples``,
        ``qps`` and ``seconds``: one all-reduce over the ranks."""
        seconds = time.perf_counter() - self.started
        loss_sum, samples = global_sum(self.context, [self.loss_shares, float(self.samples)])
        return {"loss": loss_sum / max(self.steps, 1), "qps": samples / seconds if seconds else 0.0,
                "samples": int(samples), "seconds": seconds}
