"""One training run: set up, optionally restore, train epoch by epoch with evaluation and
checkpoints, write the summary.

Every step: the step itself, the progress report, the metrics line (every
``train.log_every`` steps), the periodic evaluation (``train.eval_every``), the checkpoint
(``checkpoint.every_steps`` / ``every_minutes``); each epoch ends with an evaluation. A
checkpoint holds everything the rest of the run depends on: the model and both
optimizers, the data position (epoch and step, so the reader continues with the very next
batch), the RNG, the interval of metrics not yet logged and the length of
``metrics.jsonl``; so a run resumed from an fp32 checkpoint continues exactly as if it had
never stopped.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from neorec.ingest.errors import DataError
from neorec.ingest.fingerprint import first_change, fingerprints
from neorec.ingest.schema import Dataset
from neorec.trainer.run import run_dir as run_directory
from neorec.trainer.run.affinity import pin_rank, schedule_as_batch
from neorec.trainer.batch import Batch, DistributedSparse
from neorec.trainer.run.build import (build_model, decode_options, dense_optimizer, sparse_optimizer, store_settings,
                                      table_configs)
from neorec.trainer.checkpoint import dense_state, restore_model
from neorec.trainer.checkpoint.checkpointer import Checkpointer, check_position_carries_over, check_resumable
from neorec.trainer.checkpoint.layout import CheckpointError, complete, read_manifest
from neorec.trainer.checkpoint.restore import choose
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import (DenseGradientSum, DistributedContext, check_same_steps, gather_arrays,
                                       global_sum)
from neorec.trainer.run.metrics import MetricsLog, evaluate
from neorec.trainer.model import DLRM
from neorec.trainer.planner.from_config import job_plan
from neorec.trainer.run.background import BackgroundIterator
from neorec.trainer.run.elastic import mark_claimed
from neorec.trainer.sharding.input_pipeline import InputPipeline
from neorec.trainer.sharding.sharded_embedding import PreparedSparse, ShardedEmbeddingBagCollection, has_dynamic_tables
from neorec.ingest.reader import BatchReader
from neorec.trainer.run.follow import Follower
from neorec.trainer.run.readers import (batches, check_dense_transform, check_splits, eval_reader_config, make_reader,
                                         train_reader_config)
from neorec.trainer.run.state import Interval, LoopState
from neorec.trainer.run.step import ProgressFn, StepReport, set_threads, train_step
from neorec.trainer.run.thread_governor import governor_for
from neorec.trainer.embedding.fused import check_ids
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.run.tensorboard import Board, open_board, summary_writer
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, StorePiece, store_of
from neorec.trainer.run.warmup import compile_kernels

log = logging.getLogger(__name__)


class TrainingRun:
    """A training run of ``config`` on this rank (see :func:`neorec.trainer.run.train.train`)."""

    def __init__(self, config: TrainConfig, context: DistributedContext, overwrite: bool = False,
                 resume: bool = False) -> None:
        self.acquired = ExitStack()
        """What setting up acquired (reader threads and channels, background batch threads, store tiers,
        the metrics file, the TensorBoard writer): released in reverse order when setting up fails
        half-way (a run that starts releases them as it ends)."""
        try:
            self._set_up(config, context, overwrite, resume)
        except BaseException:
            self.acquired.close()
            raise

    def _set_up(self, config: TrainConfig, context: DistributedContext, overwrite: bool, resume: bool) -> None:
        config = config.for_world(context.world_size)  # the checkpoints keep the map shards resolved
        loop = config.train
        self.config = config
        self.context = context
        threads = set_threads(loop.threads, context.local_world_size)  # from the CPUs of all ranks, so before pinning
        if loop.pin_cores:
            pin_rank(context.local_rank, context.local_world_size)
        if loop.batch_scheduling and context.local_world_size > 1:
            schedule_as_batch()
        torch.manual_seed(loop.seed)
        self.dataset = Dataset.load(config.data.path)
        check_dense_transform(self.dataset, config)
        self.options = decode_options(self.dataset.schema, config)
        self.follower = Follower(self) if config.data.follow else None
        """Following partitions: it sets the readers, ``steps_per_epoch`` and ``total_steps``
        of each partition."""
        self.train_reader: BatchReader | None = None
        self.eval_reader: BatchReader | None = None
        self.steps_per_epoch = self.total_steps = 0
        if self.follower is None:
            self.train_reader = make_reader(self.dataset, config.data.train_split, self.options,
                                            train_reader_config(config, context), config)
            self.acquired.callback(self.train_reader.close)
            self.eval_reader = make_reader(self.dataset, config.data.eval_split, self.options,
                                           eval_reader_config(config, context), config)
            self.acquired.callback(self.eval_reader.close)
            check_splits(self.train_reader.plan(0), self.eval_reader.plan(0), config)
            self.steps_per_epoch = self.train_reader.plan(0).num_batches
            self._count_total_steps(LoopState())
        self.run_dir = Path(config.run.dir)
        if context.is_main:
            run_directory.check_claim(self.run_dir, overwrite=overwrite, resume=resume)
            if loop.tensorboard:
                summary_writer()  # refused before the run directory is claimed
        if resume:
            self._check_resumable_early()
        self.early: BackgroundIterator | None = None
        """The first epoch's batches, read from before the model exists (a fresh run's)."""
        if loop.background_batches and not context.distributed and not resume and self.follower is None:
            self.early = BackgroundIterator(batches(self.train_reader, 0, 0, context.device), loop.background_batches)
            self.acquired.callback(self._stop_reading)
        if self.follower is not None:
            self.follower.wait_for_first_partition()  # the planner samples lookups from it
        self.plan = job_plan(self.dataset, config, context)
        store_dir = Path(config.embedding_store.dir or self.run_dir / run_directory.STORE)
        # tiers emptied, also when resuming: the checkpoint restored replaces them (a tier's own segments,
        # newer than any checkpoint, cannot be used, and one a crash damaged must not stop the resume);
        # a store service is asked here, so that one that cannot serve the run refuses it before an old run goes
        store = store_settings(config, store_dir, reset=True)
        self.close_store_channel = store.close
        self.acquired.callback(self.close_store_channel)
        on_store = self.plan is not None and bool(self.plan.on_store())
        if not on_store:  # a model too large for the host is refused (or killed) before an old run goes
            self.dlrm = build_model(self.dataset, config, self.plan, store=store)
            if context.distributed:
                dist.barrier()  # every rank built its part: a rank that failed to stops rank 0 here
        self.run_lock = None
        """Rank 0's lock of the run directory, held until the run ends."""
        if context.is_main:  # an old run is replaced only once the plan and the model are judged too
            self.run_lock = run_directory.lock(self.run_dir)  # before anything of an old run is removed
            if self.run_lock is not None:
                self.acquired.callback(self.run_lock.release)
            run_directory.claim(self.run_dir, overwrite=overwrite, resume=resume)
            mark_claimed(self.run_dir)
        if context.distributed:
            dist.barrier()  # no rank opens its store tiers in the run directory while the old run is removed
        if on_store:  # its tiers lie in the run directory (emptied), unless embedding_store.dir is elsewhere
            self.dlrm = build_model(self.dataset, config, self.plan, store=store)
        self.dlrm = self.dlrm.to(context.device)
        self.store = store_of(self.dlrm.embeddings)
        if self.store is not None:
            self.acquired.callback(self._release_store)
        self.store_report: dict[str, float] = {}
        """The store's counters once training ended (for the summary)."""
        self.optimizer = dense_optimizer(self.dlrm, config)
        self.state = LoopState(split_files={} if resume else self._split_files())  # resumed: the checkpoint's
        self.metrics_bytes: int | None = None
        self.logged_loss = 0.0
        """The mean loss of the last logging interval (the progress reports' loss)."""
        self.checkpointer = self._checkpointer()
        self.resume_skipped: list[dict[str, str]] = []
        """Newer checkpoints a resume skipped (``checkpoint.fallback``), with the reason."""
        if resume:
            self._restore()
        if loop.background_batches and context.distributed and not resume and self.follower is None:
            steps = min(self.steps_per_epoch, self.total_steps)
            self.early = BackgroundIterator(
                _prepared(self.dlrm, batches(self.train_reader, 0, 0, context.device), steps), loop.background_batches)
            self.acquired.callback(self._stop_reading)
        compile_kernels(config)  # load the Numba kernels now, not in the first steps
        self.governor = governor_for(self.dlrm, config, threads, context.device)
        self.dense_sum: DenseGradientSum | None = None
        if context.distributed:
            self.dense_sum = DenseGradientSum(self.dlrm.dense_parameters(), config.sharding.precision().backward)
            if isinstance(self.dlrm.embeddings, ShardedEmbeddingBagCollection):
                self.dlrm.embeddings.carry_in_backward(self.dense_sum)
        if context.is_main:
            run_directory.write_json(self.run_dir / run_directory.CONFIG, config.to_dict())
            if self.plan is not None:
                run_directory.write_json(self.run_dir / run_directory.PLAN, self.plan.to_dict())
        self.log = MetricsLog(self.run_dir / run_directory.METRICS if context.is_main else None,
                              keep_bytes=self.metrics_bytes)
        self.acquired.callback(self.log.close)
        for skipped in self.resume_skipped:
            self.log.write({"event": "resume_skipped", "step": self.state.global_step, **skipped})
        self.board: Board | None = None
        """The TensorBoard event writer (``train.tensorboard``, on the main rank)."""
        if loop.tensorboard and context.is_main:
            self.board = open_board(self.run_dir)
            self.acquired.callback(self.board.close)
            self.log.listeners.append(self.board.record)
        if self.follower is None:
            check_same_steps(context, self.steps_per_epoch, "train")
            check_same_steps(context, self.eval_reader.plan(0).num_batches, "eval")

    # ------------------------------------------------------------------- the loop
    def run(self, progress: ProgressFn | None = None) -> dict[str, Any]:
        """Train to the end, evaluating and checkpointing on the way; returns the summary.
        The run directory is another trainer's to take once this returns or raises."""
        try:
            self._train(progress)
            return self._summary()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _train(self, progress: ProgressFn | None) -> None:
        try:
            if self.follower is not None:
                self.follower.follow(progress)
            else:
                self._epochs(progress)
            if self.config.checkpoint.final:
                self._checkpoint(wait=True)
            self.checkpointer.close()
            if self.store is not None:
                self.store.write_back()
                self.store_report = self.store.report()
                self.store.close()
        except BaseException:
            self.checkpointer.abandon()
            self._release_store()
            raise
        finally:
            self.log.close()
            if self.board is not None:
                self.board.close()
            self._stop_reading()
            self.close_store_channel()

    def _release_store(self) -> None:
        """Close the store tiers of a run that failed, without writing back; a failure to
        close them (their service gone too, their directory removed) is logged, so that the
        run's own failure is the error it ends with."""
        if self.store is None:
            return
        try:
            self.store.close(write_back=False)
        except Exception as err:
            log.warning("closing the store tiers after the run failed: %s", err)

    def _epochs(self, progress: ProgressFn | None) -> None:
        """Train the epochs left, evaluating after each."""
        state, loop = self.state, self.config.train
        while state.epoch < loop.epochs and state.global_step < self.total_steps:
            self._epoch(progress)
            state.eval_metrics = self._evaluate()
            improved = self._improved(state.eval_metrics)
            inside = state.step_in_epoch < self.steps_per_epoch  # stopped by train.max_steps: a resume goes on
            if not inside:  # before the best checkpoint, so that a resume from it does not evaluate the epoch again
                state.epoch += 1
                state.step_in_epoch = 0
            if improved:
                self._checkpoint(best=True)
            if inside:
                break
        if not state.eval_metrics:
            state.eval_metrics = self._evaluate()

    def _epoch(self, progress: ProgressFn | None) -> None:
        state, context = self.state, self.context
        steps = min(self.steps_per_epoch - state.step_in_epoch, self.total_steps - state.global_step)
        if steps <= 0:  # resumed at the end of the epoch: its last interval's line and evaluation are left
            self._log_interval(Interval(context, state))
            return
        source: BackgroundIterator | None
        if self.early is not None:  # the first epoch of a fresh run, already being read
            source, self.early = self.early, None
            stream: Iterator[Any] = source
        else:
            stream = batches(self.train_reader, state.epoch, state.step_in_epoch, self.context.device)
            if context.distributed:
                stream = _prepared(self.dlrm, stream, steps)
            depth = self.config.train.background_batches
            source = BackgroundIterator(stream, depth) if depth else None
            stream = source or stream
        if context.distributed:
            stream = _distributed(self.dlrm, stream)
        if self.store is not None and not isinstance(self.dlrm.embeddings, DynamicEmbeddings):
            stream = _announced(stream, self.store)  # (a dynamic table's slots are known only at its step)
        interval = Interval(context, state)
        full_batches = self.config.data.remainder == "drop"
        try:
            for batch in stream:
                share = train_step(self.dlrm, self.optimizer, batch, context, full_batches, self.dense_sum)
                if self.governor is not None:
                    self.governor.after_step()
                state.global_step += 1
                state.step_in_epoch += 1
                interval.add(share, batch.num_valid)
                if progress is not None:
                    progress(self.step_report(interval.qps(), self.total_steps))
                time_due = False
                if state.global_step % self.config.train.log_every == 0 or state.global_step == self.total_steps:
                    time_due = self._log_interval(interval, self.checkpointer.due_by_time())
                    interval = Interval(context, state)
                best = False
                if self.config.train.eval_every and state.global_step % self.config.train.eval_every == 0:
                    best = self._improved(self._evaluate())
                last = state.global_step >= self.total_steps
                stop = self.follower is not None and self.follower.stop_due(state.global_step)
                if stop or best or ((self.checkpointer.due(state.global_step) or time_due)
                                    and not (last and self.config.checkpoint.final)):
                    self._checkpoint(interval, best=best)
                if last or stop:
                    break
            self._log_interval(interval)  # the epoch's last, partial interval
        except BaseException:
            if self.train_reader is not None:  # first: the background thread may wait in its stream
                self.train_reader.close()
            raise
        finally:
            if source is not None:
                state.wait_seconds += source.wait_seconds
                source.close()

    def step_report(self, qps: float, total_steps: int, **following: Any) -> StepReport:
        """The progress report of the run as it stands: the last interval's loss, ``qps``,
        the newest checkpoint and the dynamic tables' counters (``following``: the
        partition fields and the phase of a following run)."""
        state, committed = self.state, self.checkpointer.writer.last_committed
        return StepReport(state.global_step, state.epoch, self.logged_loss, qps, total_steps,
                          state.wait_seconds / state.train_seconds if state.train_seconds else 0.0,
                          committed.name if committed else "",
                          dynamic=_dynamic_counters(self.dlrm, collective=False).get("dynamic", {}), **following)

    def _stop_reading(self) -> None:
        """Close the readers, then stop the first epoch's background thread if it still runs (in
        that order: a thread waiting in a reader's stream returns once the reader is closed)."""
        for reader in (self.train_reader, self.eval_reader):
            if reader is not None:  # a following run's are its partitions', closed by the follower
                reader.close()
        if self.early is not None:
            self.early.close()
            self.early = None

    def _log_interval(self, interval: "Interval", checkpoint_due: bool = False) -> bool:
        """Close ``interval`` and write its line (none for an interval without steps, the
        same on every rank); returns whether any rank's checkpoint is due by time. Raises
        the out-of-range ids the steps since the last line counted (:func:`check_ids`)."""
        check_ids(self.dlrm)
        report, due = interval.close(checkpoint_due)
        if report["steps"]:
            self.logged_loss = report["loss"]
            state = self.state
            self.log.write({"split": "train", "step": state.global_step, "epoch": state.epoch,
                            **({"partition": state.partition} if state.partition else {}), **report,
                            **_dynamic_counters(self.dlrm)})
        return due

    def _evaluate(self) -> dict[str, float]:
        started = time.perf_counter()
        metrics = evaluate(self.dlrm, batches(self.eval_reader, 0, device=self.context.device),
                           partial(gather_arrays, self.context))
        seconds = time.perf_counter() - started
        self.state.eval_seconds += seconds
        self.log.write({"split": "eval", "step": self.state.global_step, "epoch": self.state.epoch,
                        "loss": metrics["logloss"], "qps": metrics["rows"] / seconds if seconds else 0.0, **metrics})
        return metrics

    def _improved(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` beat the best eval AUC so far, when ``checkpoint.keep_best``
        asks for its checkpoint (every rank has the same global metrics). A NaN AUC (an
        eval split of one class) is never the best."""
        auc = metrics["auc"]
        if not self.config.checkpoint.keep_best or not math.isfinite(auc) or auc <= self.state.best_auc:
            return False
        self.state.best_auc = metrics["auc"]
        return True

    def _summary(self) -> dict[str, Any]:
        state = self.state
        summary = {
            "steps": state.global_step,
            "train_samples": state.samples,
            "train_qps": state.samples / state.train_seconds if state.train_seconds else 0.0,
            "input_wait_frac": state.wait_seconds / state.train_seconds if state.train_seconds else 0.0,
            "train_s": state.train_seconds,
            "eval_s": state.eval_seconds,
            **{f"eval_{k}": v for k, v in state.eval_metrics.items()},
        }
        oracle = self.dataset.oracle
        if oracle and self.config.data.eval_split == "eval":  # the split the oracle's metrics are of
            summary.update(oracle_auc=oracle.get("eval_auc"), oracle_logloss=oracle.get("eval_logloss"),
                           oracle_ne=oracle.get("eval_ne"))
        if self.plan is not None:
            summary["world_size"] = self.context.world_size
        if state.checkpoint_seconds:
            summary["checkpoint_stall_s"] = state.checkpoint_seconds
        if self.store is not None:
            summary["store"] = self.store_report
        if self.resume_skipped:
            summary["resume_skipped"] = self.resume_skipped
        summary.update(_dynamic_counters(self.dlrm))
        if self.follower is not None:
            summary.update(self.follower.summary())
        if self.context.is_main:
            run_directory.write_json(self.run_dir / run_directory.SUMMARY, summary)
        return summary

    # ------------------------------------------------------------- checkpoints
    def _checkpointer(self) -> Checkpointer:
        context, config = self.context, self.config
        attempt = [secrets.token_hex(8) if context.is_main else ""]
        if context.distributed:
            dist.broadcast_object_list(attempt, src=0)
        embeddings = self.dlrm.embeddings
        optimizer = sparse_optimizer(config)
        tables = {t.name: {"rows": t.num_embeddings, "dim": t.embedding_dim, "storage": config.model.weight_dtype,
                           "optimizer": optimizer.kind, "states": optimizer.num_states}
                  for t in table_configs(self.dataset.schema, config)}
        return Checkpointer(
            self.run_dir / run_directory.CHECKPOINTS, config.checkpoint, rank=context.rank,
            world_size=context.world_size, attempt=attempt[0], views=embeddings.shard_views, store=self._store_pieces,
            local_optimizer_steps=embeddings.local_optimizer_steps, tables=tables, run_config=config.to_dict(),
            plan=None if self.plan is None else self.plan.to_dict(),
            sum_over_ranks=partial(global_sum, context), commit_timeout_s=config.train.collective_timeout_s,
            incremental_state=embeddings.dynamic_state if has_dynamic_tables(embeddings) else None)

    def _store_pieces(self) -> list[StorePiece]:
        """This rank's store pieces, every changed row written back to their tiers."""
        if self.store is None:
            return []
        self.store.write_back()
        return self.store.store_pieces()

    def _checkpoint(self, interval: "Interval | None" = None, wait: bool = False, best: bool = False) -> None:
        state = self.state
        started = time.perf_counter()
        if interval is not None:
            interval.store()
        dense = None
        if self.context.is_main:
            self.log.flush()
            dense = {"bottom": self.dlrm.bottom.state_dict(), "top": self.dlrm.top.state_dict(),
                     "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state(),
                     "state": asdict(state), "metrics_bytes": self.log.size()}
        self.checkpointer.save(global_step=state.global_step, epoch=state.epoch, step_in_epoch=state.step_in_epoch,
                               dense=dense, wait=wait, best=best)
        state.checkpoint_seconds += time.perf_counter() - started

    def _count_total_steps(self, state: LoopState) -> None:
        """The global step the run stops at: the steps up to ``state``'s epoch, then the
        epochs left, ``train.max_steps`` at most. The epochs before may have had steps of
        another size (a run resumed at an epoch's start with another number of ranks)."""
        loop = self.config.train
        self.total_steps = state.global_step - state.step_in_epoch + (loop.epochs - state.epoch) * self.steps_per_epoch
        if loop.max_steps:
            self.total_steps = min(self.total_steps, loop.max_steps)

    def _check_resumable_early(self) -> None:
        """The config against the newest checkpoint's (:func:`check_resumable`), before the
        run waits for anything (following: a partition) or builds its model; the checkpoint
        restored is checked again (a fallback may choose an older one)."""
        committed = complete(self.run_dir / run_directory.CHECKPOINTS)
        try:
            saved = read_manifest(committed[-1]).config if committed else None
        except CheckpointError:  # a damaged newest checkpoint: the restore names it, or falls back
            return
        if saved is not None:
            check_resumable(saved, self.config)

    def _split_files(self) -> dict[str, list[int]]:
        """The train and eval splits' files and their fingerprints (none when following)."""
        if self.follower is not None:
            return {}
        data = self.config.data
        names = dict.fromkeys([*self.dataset.splits[data.train_split], *self.dataset.splits[data.eval_split]])
        try:
            return fingerprints(self.dataset.root, names)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read a file of the dataset: {err}", file=str(self.dataset.root)) from None

    def _check_same_splits(self, checkpoint_name: str, recorded: dict[str, list[int]]) -> None:
        """Raise :class:`~neorec.trainer.checkpoint.layout.CheckpointError` naming a file of
        the splits added, removed or rewritten since the run began (``recorded``: their
        fingerprints then; the path alone, which ``check_resumable`` compares, does not tell
        a dataset written again in its place)."""
        if not recorded:  # following partitions, or a checkpoint from before they were kept
            return
        changed = first_change(recorded, self._split_files())
        if changed is not None:
            name, change = changed
            raise CheckpointError(f"--resume: {self.dataset.root / name} was {change} since the run that made "
                                  f"checkpoint {checkpoint_name} began: a resumed run goes on with the data of the "
                                  f"run it continues")

    def _restore(self) -> None:
        """Continue from the newest complete checkpoint of the run directory."""
        context, config = self.context, self.config
        root = self.run_dir / run_directory.CHECKPOINTS
        views = self.dlrm.embeddings.shard_views()

        def agree(ok: bool) -> bool:
            return global_sum(context, [0.0 if ok else 1.0])[0] == 0.0

        restorable = choose(root, views, agree, config.checkpoint.fallback, need_dense=True)
        self.resume_skipped = [{"checkpoint": name, "reason": reason} for name, reason in restorable.skipped]
        if context.is_main:
            for name, reason in restorable.skipped:
                log.warning("--resume: skipped checkpoint %s (%s); resuming from %s, the steps after it are trained "
                            "again", name, reason, restorable.manifest.name)
        check_resumable(restorable.manifest.config, config)
        check_position_carries_over(restorable.manifest, context.world_size)
        # before the tables are restored: data imported again may have other vocabularies,
        # hence other table sizes, which restoring would name without naming the data
        dense = dense_state(restorable, self.dlrm)
        self._check_same_splits(restorable.manifest.name, dense["state"].get("split_files") or {})
        restore_model(restorable, self.dlrm, dense)
        self.optimizer.load_state_dict(dense["optimizer"])
        torch.set_rng_state(dense["rng"].cpu())
        self.state = LoopState(**dense["state"])
        if self.follower is None:
            self._count_total_steps(self.state)
        Interval.resume(self.state, context)
        self.metrics_bytes = dense["metrics_bytes"]
        touched = [sum(m.stats.get("touched", {}).values()) for m in restorable.chain[1:]]
        self.checkpointer.continue_chain(restorable.manifest.chain, float(sum(touched)), self.state.global_step)


def _dynamic_counters(model: DLRM, collective: bool = True) -> dict[str, Any]:
    """``{"dynamic": per dynamic table its admitted, rejected, evicted and live counts}``, or
    nothing without dynamic tables. A sharded run sums them over the ranks, a collective;
    ``collective=False`` (every step) gives the sums of the last collective call instead."""
    embeddings = model.embeddings
    if not has_dynamic_tables(embeddings):
        return {}
    if isinstance(embeddings, ShardedEmbeddingBagCollection) and not collective:
        return {"dynamic": embeddings.last_counters}
    return {"dynamic": embeddings.counters()}


def _prepared(model: DLRM, epoch_batches: Iterator[Batch], steps: int) -> Iterator[tuple[Batch, PreparedSparse]]:
    """The first ``steps`` batches, each with its ids routed for the input all-to-all (run
    in the background batch thread). Exactly ``steps`` on every rank, so no rank waits for a batch
    another rank never sends."""
    for batch in islice(epoch_batches, steps):
        yield batch, model.embeddings.prepare(batch.sparse)


def _announced(batches: Iterator[Batch], store: StoreBackedEmbeddings) -> Iterator[Batch]:
    """The batches, each step announcing the batch after it to the store, whose tier reads
    then run while the step trains."""
    iterator = iter(batches)
    current = next(iterator, None)
    while current is not None:
        upcoming = next(iterator, None)
        if upcoming is not None:
            sparse = upcoming.sparse
            store.expect(sparse.local if isinstance(sparse, DistributedSparse) else sparse)
        yield current
        current = upcoming


def _distributed(model: DLRM, prepared: Iterator[tuple[Batch, PreparedSparse]]) -> Iterator[Batch]:
    """The batches with their ids sent to the ranks that hold their rows; the all-to-alls
    of the next batches are in flight while the caller trains on one."""
    for batch, distributed in InputPipeline(model.embeddings)(prepared):
        yield replace(batch, sparse=distributed)

