"""Check-N-Run checkpoints (Eisenman et al., NSDI'22): per-rank shard files written in the
background, incremental (only the rows modified since the last checkpoint), optionally
quantized per row, committed by an atomic manifest, restorable into any world size.

- :mod:`~neorec.trainer.checkpoint.layout`: the directory, manifest, commit, pruning;
- :mod:`~neorec.trainer.checkpoint.records`: a shard's rows as bytes;
- :mod:`~neorec.trainer.checkpoint.quantize`: per-row quantization with a range search;
- :mod:`~neorec.trainer.checkpoint.snapshot`: the copy training waits for;
- :mod:`~neorec.trainer.checkpoint.writer`: encoding, writing and committing in the background;
- :mod:`~neorec.trainer.checkpoint.checkpointer`: when, and full or incremental;
- :mod:`~neorec.trainer.checkpoint.restore`: resharding restore of a chain;
- :mod:`~neorec.trainer.checkpoint.store`: the tables on the embedding store, linked not copied.
"""

from __future__ import annotations

import torch

from neorec.trainer.checkpoint.layout import CheckpointError, checkpoints_root
from neorec.trainer.checkpoint.restore import (Restorable, check, load_dense, load_dense_chain, open_checkpoint,
                                               restore_embeddings)
from neorec.trainer.checkpoint.store import check_store, restore_store
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.embedding.fused import ShardView
from neorec.trainer.model import DLRM
from neorec.trainer.sharding.sharded_embedding import ShardedEmbeddingBagCollection, has_dynamic_tables
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, store_of

__all__ = ["CheckpointError", "Restorable", "check", "checkpoints_root", "dense_state", "open_checkpoint",
           "restore_model", "restore_store_tables"]


def restore_store_tables(restorable: Restorable, store: StoreBackedEmbeddings | None, views: list[ShardView]) -> None:
    """Make the tiers of this rank's store tables (``store``; None: it has none) hold the
    checkpoint's rows; ``views``: its tables in memory (checked not to be on the store in
    the checkpoint)."""
    pieces = [] if store is None else store.store_pieces()
    check_store(restorable.manifest, pieces, {v.table for v in views})
    restore_store(restorable.directory, restorable.manifest, pieces)
    if store is not None:
        store.clear_cache()


def restore_dynamic(restorable: Restorable, embeddings: DynamicEmbeddings | ShardedEmbeddingBagCollection,
                    dense: dict) -> None:
    """Restore the id maps of the dynamic tables' map shards this process holds, kept
    incrementally over the chain by map shard (:class:`CheckpointError` when the checkpoint
    has other map shards: another ``shards``); ``dense``: the checkpoint's own dense state."""
    chain = [d["incremental"] for d in load_dense_chain(restorable, newest=dense)]
    local = embeddings if isinstance(embeddings, DynamicEmbeddings) else embeddings.local
    held = [] if not isinstance(local, DynamicEmbeddings) else [t.key for t in local.map_shards()]
    missing = [key for key in held if key not in chain[0]]
    if missing:
        raise CheckpointError(f"checkpoint {restorable.manifest.name} has no state of the dynamic map shard(s) "
                              f"{', '.join(missing)} (it holds {', '.join(sorted(chain[0]))}): model.dynamic."
                              "<table>.shards must be the checkpoint's")
    embeddings.restore_dynamic(chain)


def dense_state(restorable: Restorable, model: DLRM) -> dict:
    """The checkpoint's dense state (MLPs, dense optimizer, RNG, position), its tensors on
    ``model``'s device."""
    return load_dense(restorable, next(model.bottom.parameters()).device)


def restore_model(restorable: Restorable, model: DLRM, dense: dict | None = None) -> dict:
    """Restore ``model`` (its embeddings, whatever their sharding, with their dynamic tables'
    id maps, and its MLPs) from a checkpoint :func:`check` found whole (its store segments
    are not read again); returns the checkpoint's dense state (optimizer, RNG, position):
    ``dense`` when the caller has read it already (:func:`dense_state`), else read here."""
    embeddings = model.embeddings
    views = embeddings.shard_views()
    restore_embeddings(restorable, views)
    restore_store_tables(restorable, store_of(embeddings), views)
    embeddings.set_optimizer_steps(restorable.manifest.sparse_steps)
    dense = dense if dense is not None else dense_state(restorable, model)
    if has_dynamic_tables(embeddings):
        restore_dynamic(restorable, embeddings, dense)
    with torch.no_grad():
        model.bottom.load_state_dict(dense["bottom"])
        model.top.load_state_dict(dense["top"])
    return dense
