"""Follow mode: train on a dataset's time partitions as they land (``data.follow``).

The partitions (:mod:`neorec.ingest.partitions`) are the stretches of one endless epoch:
partition ``k`` (in name order) is epoch ``k`` of the loop state, its rows shuffled from
``(seed, k)`` as ``data.shuffle`` says. For each partition the follower

1. evaluates the model on it, before any of its rows is trained (progressive
   validation), and logs a ``progressive`` record (AUC, log loss, NE, calibration, rows,
   and the teacher's oracle when the partition carries one);
2. trains on it (the run's ordinary epoch: ``train`` records carry the partition; in one
   process its first batches are read in the background while step 1 evaluates);
3. calls ``on_partition_end(name)`` on the model's embedding collection when it has one
   (the hook for per-partition state such as a time-to-live counted in partitions), logs
   a ``partition`` record (rows, training seconds, lag from the marker to the end of
   training), and
   checkpoints when ``checkpoint.every_partitions``, ``every_steps`` or ``every_minutes``
   asks;
4. waits for the next partition's marker, polling every ``data.poll_interval_s``.

The run starts once a partition is ready (the planner samples the tables' lookups from the
first, :func:`~neorec.trainer.planner.from_config.sampled_split`). It stops after
``data.idle_exit_s`` without a new partition, or on SIGINT/SIGTERM: a
signal during training ends it after the current step (sharded: the next step that logs)
with a checkpoint, so the run resumes exactly there. The loop state names the
partition being trained and the partitions done, so ``--resume`` continues the same
sequence bit for bit, and picks up partitions that landed meanwhile.

With several ranks, rank 0 looks at the directory and every rank follows its decision
(one broadcast per poll); a stop requested on any rank is agreed at the steps that log.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch.distributed as dist

from neorec.common.errors import ConfigError
from neorec.common.wording import counted
from neorec.ingest.partitions import (MARKER, Partition, PartitionError, PartitionOrderError, blocking_partition,
                                      check_partition_schema, check_unchanged, first_ready, next_partition,
                                      open_partition, partition_fingerprints, partition_view)
from neorec.ingest.reader import BatchReader
from neorec.trainer.distributed import gather_arrays, global_sum
from neorec.trainer.run.background import BackgroundIterator
from neorec.trainer.run.metrics import evaluate
from neorec.trainer.run.readers import batches, eval_reader_config, make_reader, train_reader_config
from neorec.trainer.run.step import ProgressFn, StepReport

if TYPE_CHECKING:
    from neorec.trainer.run.loop import TrainingRun

log = logging.getLogger(__name__)

PARTITION_END_HOOK = "on_partition_end"
"""The method of the model's embedding collection called, on every rank, after each
partition is trained and before its checkpoint: ``on_partition_end(name: str) -> None``."""
_SLEEP_SLICE_S = 0.1
"""Waiting for a partition, a signal is noticed within this long."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop following (after a checkpoint); the later one named wins when
ranks were sent different ones."""


class StopSignal:
    """Turns SIGINT and SIGTERM into a request to stop at the next safe point."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle the signals while in the block (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {kind: signal.getsignal(kind) for kind in STOP_SIGNALS}
        for kind in STOP_SIGNALS:
            signal.signal(kind, self._handle)
        try:
            yield
        finally:
            for kind, handler in previous.items():
                signal.signal(kind, handler)


class Follower:
    """Follows the partitions of ``run``'s dataset (see the module doc)."""

    def __init__(self, run: "TrainingRun") -> None:
        config = run.config
        if config.train.eval_every:
            raise ConfigError("train.eval_every: following partitions evaluates each partition before training on "
                              "it (progressive validation); set train.eval_every = 0")
        if config.train.max_steps:
            raise ConfigError("train.max_steps: following partitions trains each partition whole; stop with "
                              "data.idle_exit_s or a signal, or set train.max_steps = 0")
        if config.checkpoint.keep_best:
            raise ConfigError("checkpoint.keep_best compares evaluations of one eval split; following partitions "
                              "evaluates each partition once: set checkpoint.keep_best = false")
        periodic = config.checkpoint
        if run.context.is_main and not (periodic.every_partitions or periodic.every_steps or periodic.every_minutes):
            log.warning("following partitions with no periodic checkpoint (checkpoint.every_partitions, "
                        "every_steps and every_minutes are 0): only a signal's stop writes one, and a kill loses "
                        "every partition trained; set checkpoint.every_partitions = 1 to resume from the last one")
        train_rows = run.dataset.rows.get(config.data.train_split, 0)
        if run.context.is_main and train_rows:
            log.warning("following partitions trains them only: the dataset's own %s split (%s rows) is not "
                        "trained (to train it, import its files as the first partition too)",
                        config.data.train_split, f"{train_rows:,}")
        self.run = run
        self.root = Path(config.data.path)
        self.signal = StopSignal()
        self.stopped_by = ""
        """Why following ended: ``idle``, ``blocked`` (idle while a partition that was never
        marked ready held ready ones back: :attr:`blocked_by`), a signal's name, or "" (not yet)."""
        self.blocked_by = ""
        """The partition never marked ready that held ready ones back, when ``blocked``."""
        self.marker_time = 0.0
        self.train_started = 0.0
        """When training on the current partition began (this process: a resumed partition
        counts from the resume)."""

    def wait_for_first_partition(self) -> None:
        """Return once a partition is ready (the planner samples the tables' lookups from
        the first); :class:`PartitionError` when none lands within ``data.idle_exit_s``."""
        data = self.run.config.data
        started = time.monotonic()
        while first_ready(self.root) is None:
            if data.idle_exit_s and time.monotonic() - started >= data.idle_exit_s:
                raise PartitionError(f"no partition of {self.root} became ready within data.idle_exit_s = "
                                     f"{data.idle_exit_s:g} s: nothing to follow")
            time.sleep(data.poll_interval_s)

    # ----------------------------------------------------------------- the loop
    def follow(self, progress: ProgressFn | None) -> None:
        """Evaluate and train partitions until idle or stopped."""
        state = self.run.state
        with self.signal.installed():
            while True:
                if state.partition:
                    partition = self._reopen(state.partition)
                else:
                    partition = self._wait(progress)
                    if partition is None:
                        return
                    self._start_reading(partition)
                    self._validate(partition)
                if not self._train(partition, progress):
                    return
                self._finish(partition)

    def stop_due(self, global_step: int) -> bool:
        """Whether training stops after ``global_step`` (the same answer on every rank: a
        sharded run agrees at the steps that log)."""
        if self.run.context.distributed and global_step % self.run.config.train.log_every:
            return False
        return self._stop_agreed(f"after step {global_step}")

    def _stop_agreed(self, where: str) -> bool:
        """Whether any rank was asked to stop (every rank calls this at the same point); then
        every rank names the signal one of them got (the run's exit status says it)."""
        got = global_sum(self.run.context, [float(self.signal.signal_name == kind.name) for kind in STOP_SIGNALS])
        sent = [kind.name for kind, ranks in zip(STOP_SIGNALS, got) if ranks > 0]
        if sent and not self.stopped_by:
            self.stopped_by = sent[-1]
            log.info("stopping on %s %s (partition %s)", self.stopped_by, where, self.run.state.partition or "-")
        return bool(sent)

    def summary(self) -> dict[str, Any]:
        state = self.run.state
        return {"partitions": len(state.partitions_done), "last_partition": (state.partitions_done or [""])[-1],
                "eval_partition": state.eval_partition, "stopped_by": self.stopped_by,
                **({"blocked_by": self.blocked_by} if self.blocked_by else {})}

    # ------------------------------------------------------------- partitions
    def _reopen(self, name: str) -> Partition:
        """The partition a resumed run was training."""
        try:
            partition = open_partition(self.root, name)
        except PartitionError as err:
            raise PartitionError(f"the run was training partition {name!r}, which can no longer be read: "
                                 f"{err.problem}", file=err.file) from None
        if self.run.state.partition_files:  # (checkpoints before they were kept hold none)
            check_unchanged(self.root, partition, self.run.state.partition_files)
        check_partition_schema(self.run.dataset, partition)
        return partition

    def _reader(self, partition: Partition, train: bool) -> BatchReader:
        run = self.run
        view = partition_view(run.dataset, partition)
        reader_config = (train_reader_config if train else eval_reader_config)(run.config, run.context)
        return make_reader(view, partition.split, run.options, reader_config, run.config)

    def _start_reading(self, partition: Partition) -> None:
        """Open ``partition``'s training reader; in one process, its first batches are read
        on the background thread while the partition is evaluated, so training does not
        start by waiting for its first row groups (the run's :attr:`early` batches)."""
        run = self.run
        check_partition_schema(run.dataset, partition)
        reader = run.train_reader = self._reader(partition, train=True)
        depth = run.config.train.background_batches
        if depth and not run.context.distributed:
            epoch = len(run.state.partitions_done)  # the partition's epoch, as _validate sets it
            run.early = BackgroundIterator(batches(reader, epoch, 0, run.context.device), depth)

    def _validate(self, partition: Partition) -> None:
        """Progressive validation: the model's metrics on ``partition`` before it trains on
        it; then the partition is the one being trained."""
        run, state = self.run, self.run.state
        reader = run.eval_reader = self._reader(partition, train=False)
        try:
            if reader.plan(0).total_rows == 0:
                log.warning("partition %s holds no rows", partition.name)
                metrics: dict[str, float] = {}
            else:
                started = time.perf_counter()
                metrics = evaluate(run.dlrm, batches(reader, 0, device=run.context.device),
                                   partial(gather_arrays, run.context))
                seconds = time.perf_counter() - started
                state.eval_seconds += seconds
                oracle = {f"oracle_{k}": v for k, v in (partition.info.get("oracle") or {}).items()}
                run.log.write({"split": "progressive", "partition": partition.name, "step": state.global_step,
                               "epoch": len(state.partitions_done), "loss": metrics["logloss"],
                               "qps": metrics["rows"] / seconds if seconds else 0.0, **metrics, **oracle})
        finally:
            reader.close()
            run.eval_reader = None
        if metrics:
            state.eval_metrics, state.eval_partition = metrics, partition.name
        state.partition = partition.name
        state.partition_files = partition_fingerprints(self.root, partition)
        state.epoch = len(state.partitions_done)
        state.step_in_epoch = 0

    def _train(self, partition: Partition, progress: ProgressFn | None) -> bool:
        """Train the rest of the partition; False when a stop ended it first (a checkpoint
        holds where)."""
        run, state = self.run, self.run.state
        reader = run.train_reader = run.train_reader or self._reader(partition, train=True)
        try:
            if self._stop_agreed("before training"):
                return False  # stop requested while evaluating: nothing of the partition trained yet
            self.marker_time = partition.marker_time
            self.train_started = time.perf_counter()
            run.steps_per_epoch = reader.plan(state.epoch).num_batches
            run.total_steps = state.global_step + run.steps_per_epoch - state.step_in_epoch
            run._epoch(None if progress is None else partial(self._report, progress))
        finally:
            run._stop_reading()  # the reader, then the read-ahead of a partition not trained
            run.train_reader = None
        return state.step_in_epoch >= run.steps_per_epoch

    def _finish(self, partition: Partition) -> None:
        """The partition is trained: the embeddings' hook, its record, a checkpoint if due."""
        run, state = self.run, self.run.state
        hook = getattr(run.dlrm.embeddings, PARTITION_END_HOOK, None)
        if hook is not None:
            hook(partition.name)
        state.partitions_done.append(partition.name)
        state.partition = ""
        state.partition_files = {}
        state.epoch = len(state.partitions_done)
        state.step_in_epoch = 0
        lag = time.time() - partition.marker_time
        run.log.write({"split": "partition", "partition": partition.name, "step": state.global_step,
                       "epoch": state.epoch - 1, "steps": run.steps_per_epoch,
                       "rows": run.steps_per_epoch * run.config.train.batch_size * run.context.world_size,
                       "seconds": time.perf_counter() - self.train_started, "lag_s": lag})
        every = run.config.checkpoint.every_partitions
        due = (every and len(state.partitions_done) % every == 0) or run.checkpointer.due(state.global_step)
        by_time = run.checkpointer.due_by_time()
        if run.context.distributed:
            by_time = global_sum(run.context, [float(by_time)])[0] > 0
        if due or by_time:
            run._checkpoint()

    def _report(self, progress: ProgressFn, report: StepReport) -> None:
        progress(replace(report, partition=self.run.state.partition, marker_time=self.marker_time))

    # ----------------------------------------------------------------- waiting
    def _wait(self, progress: ProgressFn | None) -> Partition | None:
        """The next partition once its marker is there; None when following ends (idle,
        or a stop requested)."""
        run, state = self.run, self.run.state
        started = time.monotonic()
        announced = False
        told_blocked: tuple[str, int] | None = None  # the partition last said to hold the others up
        while True:
            if self._stop_agreed("while waiting for a partition"):
                return None
            kind, detail = self._decide(started)
            if kind == "train":
                return open_partition(self.root, detail)
            if kind == "order":
                raise PartitionOrderError(detail)
            if kind == "error":
                raise PartitionError(detail)
            if kind == "idle":
                self.stopped_by = "idle"
                log.info("no new partition for %.0f s: stopping (data.idle_exit_s)", time.monotonic() - started)
                return None
            if kind == "blocked":
                self.stopped_by, self.blocked_by = "blocked", detail
                return None
            blocked = blocking_partition(self.root, state.partitions_done) if run.context.is_main else None
            if blocked is not None and blocked != told_blocked:
                log.warning("partition %s is not marked ready (%s) and %s wait behind it: partitions are trained in "
                            "name order, so the run waits for it", blocked[0], MARKER,
                            counted(blocked[1], "ready partition"))
                told_blocked = blocked
            if not announced:
                log.info("waiting for the partition after %s", (state.partitions_done or ["(none)"])[-1])
                announced = True
            if progress is not None:
                progress(run.step_report(0.0, state.global_step, partition=(state.partitions_done or [""])[-1],
                                         marker_time=self.marker_time, phase="waiting"))
            deadline = time.monotonic() + run.config.data.poll_interval_s
            while time.monotonic() < deadline and not self.signal.requested:
                time.sleep(min(_SLEEP_SLICE_S, max(0.0, deadline - time.monotonic())))

    def _decide(self, started: float) -> tuple[str, str]:
        """Rank 0's decision, every rank's: ``("train", name)``, ``("wait", "")``,
        ``("idle", "")``, ``("blocked", name)`` (idle, while partition ``name``, never marked
        ready, holds ready ones back), or ``("order", message)`` / ``("error", message)`` for a
        :class:`PartitionOrderError` / another :class:`PartitionError` (raised on every rank)."""
        run = self.run
        decision = [("wait", "")]
        if run.context.is_main:
            try:
                partition = next_partition(self.root, run.state.partitions_done)
            except PartitionError as err:
                decision = [("order" if isinstance(err, PartitionOrderError) else "error", str(err))]
            else:
                idle = run.config.data.idle_exit_s
                if partition is not None:
                    decision = [("train", partition.name)]
                elif idle and time.monotonic() - started >= idle:
                    blocked = blocking_partition(self.root, run.state.partitions_done)
                    decision = [("idle", "") if blocked is None else ("blocked", blocked[0])]
        if run.context.distributed:
            dist.broadcast_object_list(decision, src=0)
        return decision[0]
