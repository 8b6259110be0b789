"""The single-process training loop and the evaluation entry point."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numba
import torch
import torch.nn.functional as F

from ingest.client import ClientOptions, RemoteReader
from ingest.decoder import DecodeOptions
from ingest.reader import BatchReader, InProcessReader, ReaderConfig
from ingest.schema import Dataset
from trainer import checkpoint
from trainer.batch import Batch
from trainer.build import build_model, decode_options, dense_optimizer, single_process_model
from trainer.config import TrainConfig
from trainer.distributed import (SINGLE_PROCESS, DistributedContext, check_same_steps, gather_arrays, global_sum,
                                 wrap_data_parallel)
from trainer.metrics import MetricsLog, evaluate
from trainer.model import DLRM
from trainer.planner.from_config import shared_plan
from trainer.prefetch import Prefetcher


@dataclass(frozen=True)
class StepReport:
    """Handed to the progress callback after every step."""

    global_step: int
    epoch: int
    loss: float
    qps: float
    total_steps: int


ProgressFn = Callable[[StepReport], None]


def set_threads(threads: int, ranks_on_host: int = 1) -> int:
    """Use ``threads`` threads in torch and the Numba kernels (0: the host's cores shared by
    its ``ranks_on_host`` ranks); returns it."""
    cores = numba.config.NUMBA_NUM_THREADS
    count = max(1, cores // ranks_on_host) if threads == 0 else min(threads, cores)
    torch.set_num_threads(count)
    numba.set_num_threads(count)
    return count


def train_step(model: DLRM, optimizer: torch.optim.Optimizer, batch: Batch,
               context: DistributedContext = SINGLE_PROCESS) -> torch.Tensor:
    """One step: forward, BCE loss, backward (which also updates the embeddings), dense
    optimizer step. Returns this rank's share of the loss (a scalar tensor; the shares of
    all ranks sum to the mean loss over the valid samples of the global batch)."""
    logits = model(batch)
    valid = batch.num_valid
    if context.distributed:
        loss = F.binary_cross_entropy_with_logits(logits[:valid], batch.labels[:valid], reduction="sum")
        loss = loss / global_sum(context, valid)
    else:
        loss = F.binary_cross_entropy_with_logits(logits[:valid], batch.labels[:valid])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def make_reader(dataset: Dataset, split: str, options: DecodeOptions, reader_config: ReaderConfig,
                config: TrainConfig) -> BatchReader:
    """The reader services of ``data.ingest`` if any, else the in-process reader."""
    if not config.data.ingest:
        return InProcessReader(dataset, split, options, reader_config)
    return RemoteReader(dataset, split, options, reader_config, config.data.ingest,
                        ClientOptions(compression=config.data.ingest_compression,
                                      stall_timeout_s=config.data.ingest_stall_timeout_s))


def batches(reader: BatchReader, epoch: int) -> Iterator[Batch]:
    return (Batch.from_host(b) for b in reader.epoch(epoch))


def train(config: TrainConfig, progress: ProgressFn | None = None,
          context: DistributedContext = SINGLE_PROCESS) -> dict[str, Any]:
    """Train as ``config`` says and write the run directory; returns the summary.

    With a distributed ``context`` every rank calls this: the tables are sharded as the
    planner (and ``config.sharding``) says, the MLPs are data parallel, each rank reads its
    share of every epoch, and rank 0 writes the run directory. Its summary's counts and
    rates are global.
    """
    loop = config.train
    set_threads(loop.threads, context.local_world_size)
    torch.manual_seed(loop.seed)
    dataset = Dataset.load(config.data.path)
    plan = shared_plan(dataset, config, context) if context.distributed else None
    model = build_model(dataset, config, plan)
    if context.distributed:
        model.bottom = wrap_data_parallel(model.bottom)
        model.top = wrap_data_parallel(model.top)
    optimizer = dense_optimizer(model, config)
    options = decode_options(dataset.schema, config)
    rank = {"rank": context.rank, "world_size": context.world_size}
    train_reader = make_reader(
        dataset, config.data.train_split, options,
        ReaderConfig(batch_size=loop.batch_size, seed=loop.seed, remainder=config.data.remainder,
                     shuffle=config.data.shuffle, **rank),
        config,
    )
    eval_reader = make_reader(
        dataset, config.data.eval_split, options,
        ReaderConfig(batch_size=loop.eval_batch_size, seed=loop.seed, remainder="pad", shuffle=False, **rank),
        config,
    )
    run_dir = Path(config.run.dir)
    if context.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        if plan is not None:
            (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    log = MetricsLog(run_dir / "metrics.jsonl" if context.is_main else None)
    evaluate_split = partial(_log_eval, log, model, eval_reader, context)

    steps_per_epoch = train_reader.plan(0).num_batches
    check_same_steps(context, steps_per_epoch, "train")
    check_same_steps(context, eval_reader.plan(0).num_batches, "eval")
    total_steps = steps_per_epoch * loop.epochs
    if loop.max_steps:
        total_steps = min(total_steps, loop.max_steps)
    global_step = 0
    train_seconds = 0.0
    wait_seconds = 0.0
    samples = 0
    eval_metrics: dict[str, float] = {}
    try:
        for epoch in range(loop.epochs):
            if global_step >= total_steps:
                break
            source = Prefetcher(batches(train_reader, epoch), loop.prefetch) if loop.prefetch else None
            stream = source if source is not None else batches(train_reader, epoch)
            interval = _Interval()
            try:
                for batch in stream:
                    loss = global_sum(context, float(train_step(model, optimizer, batch, context)))
                    global_step += 1
                    interval.add(loss, int(global_sum(context, batch.num_valid)))
                    if progress is not None:
                        progress(StepReport(global_step, epoch, loss, interval.qps(), total_steps))
                    if global_step % loop.log_every == 0 or global_step == total_steps:
                        log.write({"split": "train", "step": global_step, "epoch": epoch, **interval.report()})
                        train_seconds += interval.seconds()
                        samples += interval.samples
                        interval = _Interval()
                    if loop.eval_every and global_step % loop.eval_every == 0:
                        evaluate_split(global_step, epoch)
                    if global_step >= total_steps:
                        break
                train_seconds += interval.seconds()
                samples += interval.samples
            finally:
                if source is not None:
                    wait_seconds += source.wait_seconds
                    source.close()
            eval_metrics = evaluate_split(global_step, epoch)
        if not eval_metrics:
            eval_metrics = evaluate_split(global_step, 0)
    finally:
        log.close()
        train_reader.close()
        eval_reader.close()

    if config.run.checkpoint:
        saved = single_process_model(model, dataset, config) if context.distributed else model
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
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def evaluate_checkpoint(config: TrainConfig, checkpoint_dir: str | Path) -> dict[str, float]:
    """Metrics of a saved model on the config's eval split."""
    set_threads(config.train.threads)
    dataset = Dataset.load(config.data.path)
    model = build_model(dataset, config)
    checkpoint.load(checkpoint_dir, model)
    reader = make_reader(
        dataset, config.data.eval_split, decode_options(dataset.schema, config),
        ReaderConfig(batch_size=config.train.eval_batch_size, remainder="pad", shuffle=False),
        config,
    )
    try:
        return evaluate(model, batches(reader, 0))
    finally:
        reader.close()


def _log_eval(log: MetricsLog, model: DLRM, reader: BatchReader, context: DistributedContext, step: int,
              epoch: int) -> dict[str, float]:
    started = time.perf_counter()
    metrics = evaluate(model, batches(reader, 0), partial(gather_arrays, context))
    seconds = time.perf_counter() - started
    log.write({"split": "eval", "step": step, "epoch": epoch, "loss": metrics["logloss"],
               "qps": metrics["rows"] / seconds if seconds else 0.0, **metrics})
    return metrics


class _Interval:
    """Loss and throughput since the last log line."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.loss_sum = 0.0
        self.steps = 0
        self.samples = 0

    def add(self, loss: float, samples: int) -> None:
        self.loss_sum += loss
        self.steps += 1
        self.samples += samples

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def qps(self) -> float:
        elapsed = self.seconds()
        return self.samples / elapsed if elapsed else 0.0

    def report(self) -> dict[str, float]:
        return {"loss": self.loss_sum / max(self.steps, 1), "qps": self.qps(), "samples": self.samples}
