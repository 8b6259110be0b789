"""A collection of embedding tables sharded across the ranks of a process group."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from neorec.trainer.batch import DistributedSparse, KeyedJaggedTensor
from neorec.trainer.embedding.bounds import check_mode
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.dynamic.collection import DynamicEmbeddings
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection, ShardView, initial_table_weight
from neorec.trainer.embedding.store_backed import StoreBackedEmbeddings, StoreSettings
from neorec.trainer.sharding.input_dist import RoutedSparse, SparseAllToAll
from neorec.trainer.sharding.layout import ShardedLayout
from neorec.trainer.sharding.comm_precision import FULL, CommPrecision, Passenger
from neorec.trainer.sharding.dynamic_local import gathered_state, summed_counters, with_map_shards
from neorec.trainer.sharding.output_dist import PooledAllToAll
from neorec.trainer.sharding.plan import DATA_PARALLEL, ShardingPlan


@dataclass
class PreparedSparse:
    """A rank's sparse input routed for the input all-to-all (see
    :meth:`ShardedEmbeddingBagCollection.prepare`), and its own int32 ``[F, B]`` bag
    lengths (collection feature order)."""

    routed: RoutedSparse
    lengths: torch.Tensor

    def distributed(self, local: KeyedJaggedTensor) -> DistributedSparse:
        """This input after its all-to-alls delivered ``local``, the local module's input."""
        return DistributedSparse(local, self.lengths, self.routed.batch_size)


class ShardedEmbeddingBagCollection(nn.Module):
    """The same function as ``FusedEmbeddingBagCollection(tables, optimizer)`` on the global
    batch, computed by ``plan.world_size`` ranks that each hold some shards.

    Called on every rank with that rank's batch (the same ``B`` on every rank), it returns
    the rank's float32 ``[B, output_dim]`` (same column layout as the fused module). Each
    step is: input all-to-all (:class:`SparseAllToAll`), one fused lookup over all of the
    rank's shards, output all-to-all (:class:`PooledAllToAll`); ``loss.backward()`` runs
    them in reverse and updates every shard in place with ``optimizer``.

    The input all-to-all of a batch can run ahead, on its own process group: routing in the
    thread that reads batches (:meth:`prepare`), the collectives asynchronously a step or
    two ahead (:class:`~neorec.trainer.sharding.input_pipeline.InputPipeline`), so they overlap
    the steps before.

    Constructing it is a collective (it creates that process group). Column-wise shards
    with ``rowwise_adagrad`` keep one state per shard row (the mean
    square over the shard's columns), as FBGEMM's column-wise shards do.
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer: SparseOptimizer, plan: ShardingPlan, *,
                 seed: int = 0, group: dist.ProcessGroup | None = None,
                 full_weights: dict[str, torch.Tensor] | None = None, weight_dtype: str = "fp32",
                 stochastic_rounding: bool = True, kernels: str = "auto",
                 timeout: timedelta | None = None, store: StoreSettings | None = None,
                 comm_precision: CommPrecision = FULL, bounds_check: str = "fatal",
                 dynamic: dict[str, DynamicTableConfig] | None = None) -> None:
        """``full_weights``: float32 ``[rows, dim]`` of any table (each rank slices its
        shards); other tables start from :func:`initial_table_weight` with ``seed``.
        ``weight_dtype`` and ``stochastic_rounding`` as for the fused module (rounding noise
        is drawn per element of the whole table, so it does not depend on the plan).
        ``kernels="torch"`` runs routing, lookup and update in torch ops, as on CUDA.
        ``timeout``: how long the input all-to-alls' process group waits for a silent rank
        (``torch.distributed``'s default for a new group otherwise, half an hour).
        ``store``: where the shards of the plan's store tables keep their rows (the local
        module is then a :class:`~neorec.trainer.embedding.store_backed.StoreBackedEmbeddings`).
        ``comm_precision``: the wire type of the pooled embeddings' all-to-all and its gradient.
        ``bounds_check``: validated only; routing an id to its shard checks it, on every rank
        at once (an ``IndexError`` everywhere, naming the id on its rank), in every mode.
        ``dynamic``: the dynamic tables' settings (``shards`` resolved), by name: their raw
        ids route to the rank owning their map shard, whose local module (then a
        :class:`~neorec.trainer.embedding.dynamic.collection.DynamicEmbeddings`) maps them
        to rows at the step."""
        super().__init__()
        check_mode(bounds_check)
        if dist.get_world_size(group) != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, the process group has "
                             f"{dist.get_world_size(group)}")
        self.tables = tuple(tables)
        self.plan = plan
        self.group = group
        self.dynamic = dict(dynamic or {})
        self.last_counters: dict[str, dict[str, int]] = {}
        """The dynamic tables' counters at the last :meth:`counters`."""
        self.layout = ShardedLayout(list(tables), plan, dist.get_rank(group),
                                    {name: d.map_shards for name, d in self.dynamic.items()})
        self.feature_names = self.layout.feature_names
        self.output_dim = self.layout.output_dim
        full_weights = full_weights or {}
        on_store = plan.on_store()
        shard_weights: list[torch.Tensor | None] = []
        for local in self.layout.local_shards:
            table, shard = tables[local.table], local.shard
            full = full_weights.get(table.name)
            if table.name in on_store:
                shard_weights.append(None)  # its rows start on the store, as they are read
            elif full is None:
                shard_weights.append(initial_table_weight(
                    local.table, table.num_embeddings, table.embedding_dim, seed, shard.row_offset, shard.rows,
                    (shard.col_offset, shard.col_offset + shard.cols)))
            else:
                shard_weights.append(full[shard.row_offset : shard.row_offset + shard.rows,
                                          shard.col_offset : shard.col_offset + shard.cols])
        self.optimizer = optimizer
        self.local: FusedEmbeddingBagCollection | StoreBackedEmbeddings | DynamicEmbeddings | None = None
        """None on a rank that holds no shard (more ranks than table pieces)."""
        configs = [s.config for s in self.layout.local_shards]
        origins = [(s.table, s.shard.row_offset, s.shard.col_offset, tables[s.table].embedding_dim)
                   for s in self.layout.local_shards]
        storage = {"weight_dtype": weight_dtype, "stochastic_rounding": stochastic_rounding, "seed": seed,
                   "shard_origins": origins, "kernels": kernels, "bounds_check": "none"}  # routing checked the ids
        on_store_here = [s for s in self.layout.local_shards if tables[s.table].name in on_store]
        if on_store_here:
            if store is None:
                raise ValueError("the plan puts tables on the embedding store: give the store's settings")
            caches = [store.table(s.config.name, s.shard.rows, on_store[tables[s.table].name],
                                  len(s.config.feature_names)) for s in on_store_here]
            self.local = StoreBackedEmbeddings(configs, optimizer, caches, store, initial_weights=shard_weights,
                                               table_rows=[tables[s.table].num_embeddings
                                                           for s in self.layout.local_shards], **storage)
        elif configs:
            self.local = FusedEmbeddingBagCollection(configs, optimizer, initial_weights=shard_weights, **storage)
        if self.local is not None and self.dynamic:
            self.local = with_map_shards(self.local, self.layout, self.dynamic, seed)
        self.input_dist = SparseAllToAll(self.layout, torch_routing=kernels == "torch")
        self.output_dist = PooledAllToAll(self.layout, group, comm_precision)
        self.input_group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD), timeout=timeout)

    def prepare(self, sparse: KeyedJaggedTensor) -> PreparedSparse:
        """Route ``sparse`` for the input all-to-all (no collective: any thread may call it).
        Per-id weights that require a gradient are refused: they cross the all-to-all as
        data, so no gradient would reach them (a module on one process gives it)."""
        if sparse.weights is not None and sparse.weights.requires_grad:
            raise NotImplementedError("per-id weights that require a gradient are not supported with sharded tables "
                                      "(the weights reach the tables' ranks as data); use one process's "
                                      "FusedEmbeddingBagCollection, or detach them")
        source = self.input_dist.feature_positions(sparse, sparse.lengths.device)
        lengths = sparse.lengths.view(len(sparse.keys), sparse.batch_size)[source]
        return PreparedSparse(self.input_dist.prepare(sparse), lengths)

    def forward(self, sparse: KeyedJaggedTensor | DistributedSparse) -> torch.Tensor:
        """``sparse``: this rank's batch, or its input all-to-all's result."""
        if isinstance(sparse, KeyedJaggedTensor):
            prepared = self.prepare(sparse)
            sparse = prepared.distributed(self.input_dist(prepared.routed, self.group))
        if self.local is not None:
            pooled = self.local(sparse.local)
        else:  # still takes part in the output all-to-all, forward and backward
            pooled = torch.zeros(sparse.local.batch_size, 0, device=sparse.lengths.device,
                                 requires_grad=self.training and torch.is_grad_enabled())
        return self.output_dist(pooled, sparse.lengths, sparse.batch_size)

    def carry_in_backward(self, passenger: Passenger | None) -> None:
        """Let ``passenger`` ride with the output all-to-all's gradient (None: no more)."""
        self.output_dist.passenger = passenger

    def shard_views(self) -> list[ShardView]:
        """This rank's shards as :class:`~neorec.trainer.embedding.fused.ShardView` s of their tables."""
        if self.local is None:
            return []
        views = {v.table: v for v in self.local.shard_views()}
        return [replace(views[s.config.name], table=self.tables[s.table].name, row_offset=s.shard.row_offset,
                        col_offset=s.shard.col_offset,
                        replicated=self.plan.of(self.tables[s.table].name).sharding_type == DATA_PARALLEL)
                for s in self.layout.local_shards if s.config.name in views]

    def set_optimizer_steps(self, steps: int) -> None:
        """Set the sparse optimizer's step count (restoring a checkpoint)."""
        if self.local is not None:
            self.local.optimizer_step.fill_(steps)

    def local_optimizer_steps(self) -> int:
        """This rank's count of sparse optimizer steps (no collective; 0 without shards)."""
        return 0 if self.local is None else int(self.local.optimizer_step)

    def optimizer_steps(self) -> int:
        """Sparse optimizer steps taken (a collective: ranks without shards count none)."""
        steps = torch.zeros((), dtype=torch.int64) if self.local is None else self.local.optimizer_step.clone()
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
        return int(steps)

    def counters(self) -> dict[str, dict[str, int]]:
        """Per dynamic table its counters over all ranks' map shards (a collective; the
        result stays in :attr:`last_counters`)."""
        self.last_counters = summed_counters(self.local, sorted(self.dynamic), self.group)
        return self.last_counters

    def on_partition_end(self, name: str) -> None:
        """The follow loop's hook (see :meth:`DynamicEmbeddings.on_partition_end`)."""
        if isinstance(self.local, DynamicEmbeddings):
            self.local.on_partition_end(name)

    def dynamic_state(self, full: bool) -> dict[str, Any]:
        """Checkpoint state of every rank's map shards, by map shard, on rank 0 (a collective;
        see :meth:`DynamicEmbeddings.dynamic_state`)."""
        return gathered_state(self.local, full, self.group)

    def restore_dynamic(self, chain: list[dict[str, Any]]) -> None:
        """Restore this rank's map shards from the :meth:`dynamic_state` of a chain."""
        if isinstance(self.local, DynamicEmbeddings):
            self.local.restore_dynamic(chain)

    def gather_table(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Table ``name`` assembled from its shards: float32 weights ``[rows, dim]`` and each
        optimizer state array (``[rows, width]``, as the fused module's ``table_state``). A
        collective: every rank calls it and gets the table.

        A row-wise optimizer state of column-wise shards (one value per shard row) becomes
        their mean weighted by the shards' widths.
        """
        t = [table.name for table in self.tables].index(name)
        table = self.tables[t]
        mine = []
        for local in self.layout.local_shards:
            if local.table == t:
                shard_weight, states = self.local.read_rows(local.config.name, torch.arange(local.shard.rows))
                mine.append((local.shard, shard_weight, states))
        everyone: list[list | None] = [None] * self.plan.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        rows, dim = table.num_embeddings, table.embedding_dim
        weight = torch.empty(rows, dim)
        width = self.optimizer.state_width(dim)
        states = [torch.zeros(rows, width) for _ in range(self.optimizer.num_states)]
        replicated = self.plan.of(name).sharding_type == DATA_PARALLEL
        for pieces in (everyone[:1] if replicated else everyone):
            for shard, shard_weight, shard_states in pieces:
                row_span = slice(shard.row_offset, shard.row_offset + shard.rows)
                col_span = slice(shard.col_offset, shard.col_offset + shard.cols)
                weight[row_span, col_span] = shard_weight
                for full, part in zip(states, shard_states):
                    if width == dim:
                        full[row_span, col_span] = part
                    else:
                        full[row_span] += part * (shard.cols / dim)
        return weight, states


def has_dynamic_tables(embeddings: nn.Module) -> bool:
    """Whether a model's embedding collection has dynamic tables (in this process, or
    sharded over the ranks)."""
    return isinstance(embeddings, DynamicEmbeddings) or (
        isinstance(embeddings, ShardedEmbeddingBagCollection) and bool(embeddings.dynamic))
