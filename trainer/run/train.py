"""The training and evaluation entry points."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from neorec.common.errors import ConfigError
from neorec.ingest.fingerprint import fingerprints, first_change
from neorec.ingest.partitions import MARKER, SPLIT_PREFIX, is_ready, partition_names, with_partition_split
from neorec.ingest.schema import DATASET_FILE, Dataset
from neorec.trainer import checkpoint
from neorec.trainer.checkpoint.checkpointer import check_evaluable
from neorec.trainer.checkpoint.layout import best_checkpoint, complete
from neorec.trainer.config import DEFAULT_CACHE_FRACTION, TrainConfig
from neorec.trainer.device import resolve_device
from neorec.trainer.distributed import DistributedContext, explain_collective_failure, single_process
from neorec.trainer.embedding.store_backed import store_of
from neorec.trainer.planner.from_config import plan_for_config
from neorec.trainer.run.build import build_model, decode_options, store_settings
from neorec.trainer.run.elastic import after_restart
from neorec.trainer.run.loop import TrainingRun
from neorec.trainer.run.metrics import evaluate
from neorec.trainer.run.readers import batches, eval_reader_config, make_reader
from neorec.trainer.run.step import ProgressFn, set_threads

log = logging.getLogger(__name__)


def train(config: TrainConfig, progress: ProgressFn | None = None, context: DistributedContext | None = None,
          overwrite: bool = False, resume: bool = False) -> dict[str, Any]:
    """Train as ``config`` says and write the run directory; returns the summary.

    With a distributed ``context`` every rank calls this: the tables are sharded as the
    planner (and ``config.sharding``) says, the MLPs are data parallel, each rank reads its
    share of every epoch, and rank 0 writes the run directory. Its summary's counts and
    rates are global. A run directory that holds another run is refused unless
    ``overwrite``; ``resume`` continues the run in it from its newest complete checkpoint
    (same epoch, step, next batch and RNG). A collective that fails because a rank went
    silent raises :class:`~neorec.trainer.distributed.RankSilentError` naming it. Without a
    ``context`` the run is one process on ``config.train.device``.

    A worker that torchrun's elastic agent restarted resumes the run its job started in
    the run directory (:func:`~neorec.trainer.run.elastic.after_restart`).
    """
    if context is None:
        context = single_process(config.train.device)
    overwrite, resume = after_restart(config, context, overwrite, resume)
    try:
        run = TrainingRun(config, context, overwrite=overwrite, resume=resume)
        return run.run(progress)
    except RuntimeError as err:
        if context.distributed:
            raise explain_collective_failure(context, err) from err.__cause__
        raise


PRUNED_TRIES = 3
"""Times :func:`evaluate_checkpoint` chooses a run's newest checkpoint, when the run (still
training) prunes the one chosen while it is read."""


def evaluate_checkpoint(checkpoint_dir: str | Path, config: TrainConfig | None = None,
                        best: bool = False, ingest: Sequence[str] = ()) -> dict[str, float]:
    """Metrics of a saved model on the eval split (which may name a ready partition,
    ``partitions/NAME``): the config saved with the checkpoint unless ``config`` is given.
    ``checkpoint_dir``: a run directory, its checkpoints directory, or one checkpoint;
    ``best``: the run's best checkpoint (``keep_best``). The split is read in process
    unless ``ingest`` names reader services (the services a run trained through are
    usually gone by the time it is evaluated). The model runs on ``config.train.device``,
    as in training. The newest checkpoint of a run still training is chosen again if the run
    prunes it while it is read."""
    root, named = checkpoint.checkpoints_root(checkpoint_dir)
    name = None if named is None else named.name
    if best:
        name = best_checkpoint(root)
        if name is None:
            raise checkpoint.CheckpointError(f"{root} has no best checkpoint: the run was trained without "
                                             "checkpoint.keep_best = true, or none of its evaluations gave an AUC "
                                             "(an eval split of one class gives none)")
    tries = 1
    while True:
        committed = _committed(root)
        try:
            return _evaluate(checkpoint.open_checkpoint(root, name), config, ingest)
        except (OSError, checkpoint.CheckpointError):
            if name is not None or _committed(root) == committed or tries == PRUNED_TRIES:
                raise
            log.info("the run in %s committed and pruned checkpoints while one was read: evaluating the newest "
                     "again", root)
            tries += 1


def _committed(root: Path) -> list[str]:
    """The complete checkpoints under ``root``, by name."""
    return [path.name for path in complete(root)]


def _evaluate(restorable: checkpoint.Restorable, config: TrainConfig | None,
              ingest: Sequence[str]) -> dict[str, float]:
    """:func:`evaluate_checkpoint` of the checkpoint ``restorable`` opens."""
    from_run = config is None
    if config is None:
        config = TrainConfig.from_dict(restorable.manifest.config)
    else:
        config = config.for_world(restorable.manifest.world_size)  # map shards 0: the run's, as its checkpoint keeps
        check_evaluable(restorable.manifest.config, config)
    config = replace(config, data=replace(config.data, ingest=list(ingest)))
    config.data.validate()
    set_threads(config.train.threads)
    device = resolve_device(config.train.device)
    relative = Path(config.data.path)
    if from_run and not relative.is_absolute() and not (relative / DATASET_FILE).exists():
        raise ConfigError(f"the run's data.path {str(relative)!r} is relative to the directory it started in, and "
                          f"{Path.cwd()} holds no dataset there: evaluate from that directory, or give a config "
                          f"with --set data.path=PATH")
    dataset = with_partition_split(Dataset.load(config.data.path), config.data.eval_split)
    _check_eval_split(dataset, config.data.eval_split)
    on_store = {entry.table for entry in restorable.manifest.store}
    with tempfile.TemporaryDirectory(prefix="neorec-eval-store-") as store_dir:
        plan = None
        if on_store:  # the same tables on the store, their tiers here, linked from the checkpoint
            fraction = config.embedding_store.cache_fraction or DEFAULT_CACHE_FRACTION
            config = replace(config, embedding_store=replace(
                config.embedding_store, tables={t: config.embedding_store.tables.get(t, fraction) for t in on_store},
                service=""))
            plan = plan_for_config(dataset, config, 1).plan
        model = build_model(dataset, config, plan, store=store_settings(config, Path(store_dir), reset=True)).to(device)
        # every file's size and the checksums of the dense.pt files restoring reads, as --resume checks
        # them (the records' checksums are checked as they are restored: not read twice)
        checkpoint.check(restorable, [], need_dense=True)
        dense = checkpoint.dense_state(restorable, model)
        recorded = dense["state"].get("split_files") or {}
        _warn_if_rewritten(dataset, config.data.eval_split, restorable, recorded)  # before restoring names a table
        checkpoint.restore_model(restorable, model, dense)
        reader = make_reader(dataset, config.data.eval_split, decode_options(dataset.schema, config),
                             eval_reader_config(config), config)
        try:
            return evaluate(model, batches(reader, 0, device=device))
        finally:
            reader.close()
            store = store_of(model.embeddings)
            if store is not None:
                store.close(write_back=False)


def _warn_if_rewritten(dataset: Dataset, split: str, restorable: checkpoint.Restorable,
                       recorded: dict[str, list[int]]) -> None:
    """Warn, naming the file, when a file of ``split`` that the run knew (``recorded``:
    the fingerprints its checkpoints keep) was written again in its place since the run
    began: the metrics are then of the model on other data, whose ids may name other rows
    (a dataset imported again may have other vocabularies)."""
    if Path(restorable.manifest.config["data"]["path"]).resolve() != Path(dataset.root).resolve():
        return  # another dataset: its files are not the run's
    names = [name for name in dataset.splits.get(split, []) if name in recorded]
    try:
        now = fingerprints(dataset.root, names)
    except (OSError, ValueError):
        return  # the reader names the file it cannot read
    changed = first_change({name: recorded[name] for name in names}, now)
    if changed is not None:
        log.warning("%s was rewritten since the run that made checkpoint %s began: these metrics are of the "
                    "model on other data (whose ids may name other rows)", Path(dataset.root) / changed[0],
                    restorable.manifest.name)


def _check_eval_split(dataset: Dataset, split: str) -> None:
    """A :class:`ConfigError` for an eval split a partitioned dataset does not have (a run
    that followed partitions has no fixed eval split), naming a ready partition to give."""
    names = partition_names(dataset.root)
    if split in dataset.splits or not names:
        return
    ready = [name for name in names if is_ready(dataset.root, name)]
    example = f"e.g. --set data.eval_split='{SPLIT_PREFIX}{ready[-1]}'" if ready else "none is ready yet"
    if split.startswith(SPLIT_PREFIX):
        raise ConfigError(f"data.eval_split: partition {split[len(SPLIT_PREFIX):]!r} of {dataset.root} does not exist "
                          f"or is not ready (no {MARKER} marker); evaluate on a ready partition, {example}")
    raise ConfigError(f"data.eval_split: the dataset {dataset.root} has no split {split!r}: it is partitioned; "
                      f"evaluate on a ready partition, {example}")
