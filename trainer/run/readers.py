"""The readers a run trains and evaluates from: their configs, the in-process reader or the
reader services, and the checks that a dataset's splits can be trained on."""

from __future__ import annotations

from typing import Iterator

import torch

from neorec.common.transport import ClientSecurity, read_token
from neorec.ingest.client import ClientOptions, RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.errors import DataError
from neorec.ingest.plan import RankPlan
from neorec.ingest.reader import BatchReader, InProcessReader, ReaderConfig
from neorec.ingest.schema import Dataset
from neorec.trainer.batch import Batch
from neorec.trainer.config import TrainConfig
from neorec.trainer.device import HostToDevice
from neorec.trainer.distributed import SINGLE_PROCESS, DistributedContext


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
    """The batches of ``epoch`` from ``first_step`` on, on ``device`` (copied from pinned
    memory on a side stream there: :class:`~neorec.trainer.device.HostToDevice`)."""
    move = HostToDevice(device)
    return (Batch.from_host(b).moved(move) for b in reader.epoch(epoch, first_step))
