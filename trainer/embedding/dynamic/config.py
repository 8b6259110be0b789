"""Configuration of a dynamic embedding table: raw 64-bit ids mapped to a bounded number of
slots, admitted by count and evicted by recency (see :mod:`neorec.trainer.embedding.dynamic`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from neorec.trainer.embedding.dynamic.admission import SATURATED

TTL_UNITS = ("steps", "partitions")


@dataclass
class DynamicTableConfig:
    """One dynamic table (``[model.dynamic.TABLE]`` in a training config).

    ``capacity``: rows (slots) of the table, its memory bound. An id gets a slot once it has
    been seen ``min_count`` times (counted in a count-min sketch of ``sketch_depth`` rows of
    ``sketch_width`` counters, 0: the power of two at or above twice the capacity; its memory
    does not grow with the ids seen); until then it
    reads zeros and gets no update. A full table gives the least recently used id's slot to
    a new one; ``ttl`` (0: none) evicts an id not seen in the last ``ttl`` steps, or
    partitions of a continuous-training run (``ttl_unit``). ``sketch_half_life`` (0: never)
    halves every count of the sketch each time that many steps or partitions (``ttl_unit``)
    have passed, so that an id is admitted for its recent sightings, not for sightings
    spread over the whole run.

    ``shards``: hash partitions of the table (*map shards*, 0: the run's world size, see
    :meth:`for_world`), each an independent map of ``capacity // shards`` slots with its own
    sketch; a rank owns whole map shards, so a run trains on any number of ranks dividing it.
    """

    capacity: int = 0
    min_count: int = 1
    ttl: int = 0
    ttl_unit: str = "steps"
    sketch_width: int = 0
    sketch_depth: int = 4
    sketch_half_life: int = 0
    shards: int = 0

    def validate(self) -> None:
        """``ValueError`` naming the key of the first bad value."""
        if self.capacity <= 0:
            raise ValueError(f"capacity: must be a positive number of rows, got {self.capacity}")
        if self.capacity >= 2**31:
            raise ValueError(f"capacity: must be below 2**31 rows, got {self.capacity}")
        if not 1 <= self.min_count <= SATURATED:
            raise ValueError(f"min_count: must lie in [1, {SATURATED}] (the sketch counts up to {SATURATED}), "
                             f"got {self.min_count}")
        if self.ttl < 0:
            raise ValueError(f"ttl: must be >= 0 (0: no expiry), got {self.ttl}")
        if self.ttl_unit not in TTL_UNITS:
            raise ValueError(f"ttl_unit: must be one of {', '.join(TTL_UNITS)}; got {self.ttl_unit!r}")
        if self.sketch_width < 0 or self.sketch_width & (self.sketch_width - 1):
            raise ValueError(f"sketch_width: must be a power of two (or 0: from the capacity), got {self.sketch_width}")
        if not 1 <= self.sketch_depth <= 16:
            raise ValueError(f"sketch_depth: must lie in [1, 16], got {self.sketch_depth}")
        if self.sketch_half_life < 0:
            raise ValueError(f"sketch_half_life: must be >= 0 (0: counts never decay), got {self.sketch_half_life}")
        if self.shards < 0:
            raise ValueError(f"shards: must be >= 0 (0: the run's world size), got {self.shards}")
        if self.shards and self.capacity % self.shards:
            raise ValueError(f"capacity: {self.capacity} rows do not split into {self.shards} equal map shards "
                             f"(shards = {self.shards}); make the capacity a multiple of it")

    def for_world(self, world_size: int) -> "DynamicTableConfig":
        """These settings for a run of ``world_size`` ranks: ``shards`` 0 becomes the world
        size; ``ValueError`` naming the key when the map shards do not split over the ranks."""
        resolved = replace(self, shards=self.shards or world_size)
        resolved.validate()
        if resolved.shards % world_size:
            raise ValueError(f"shards: {resolved.shards} map shards do not split over {world_size} ranks "
                             "(set shards to a multiple of the world size)")
        return resolved

    @property
    def map_shards(self) -> int:
        """Hash partitions of the table (1 until :meth:`for_world` resolves ``shards`` 0)."""
        return max(self.shards, 1)

    @property
    def shard_capacity(self) -> int:
        """Slots of each map shard."""
        return self.capacity // self.map_shards

    @property
    def block_rows(self) -> int:
        """Rows of each map shard's block: its slots, then its default row."""
        return self.shard_capacity + 1

    @property
    def rows(self) -> int:
        """Rows of the table: a block per map shard."""
        return self.map_shards * self.block_rows

    def keeps_map_shards_whole(self, shards: Iterable) -> bool:
        """Whether row ranges ``shards`` (each with ``row_offset`` and ``rows``: a sharding's
        pieces) hold whole map shard blocks, so that each map shard lives on one rank."""
        return all(s.row_offset % self.block_rows == 0 and s.rows % self.block_rows == 0 for s in shards)

    def sketch_columns(self) -> int:
        """Counters per row of a map shard's sketch: ``sketch_width`` (or, when 0, twice
        the capacity) over the map shards, rounded up to a power of two."""
        columns = self.sketch_width or 2 * self.capacity
        return 1 << max(1, (-(-columns // self.map_shards) - 1).bit_length())

    def sketch_bytes(self) -> int:
        """Bytes of the admission sketches of all map shards (0 when every id is admitted at once)."""
        return 0 if self.min_count == 1 else self.sketch_columns() * self.sketch_depth * self.map_shards  # a byte each

    def describe(self) -> str:
        """The settings in words (``neorec plan``)."""
        ttl = f"ttl {self.ttl} {self.ttl_unit}" if self.ttl else "no ttl"
        shards = f", {self.map_shards} map shards of {self.shard_capacity:,} slots" if self.map_shards > 1 else ""
        text = f"capacity {self.capacity:,} rows{shards}, min_count {self.min_count}, {ttl}, LRU when full"
        if self.min_count == 1:
            return text
        text += f"; admission sketch {self.sketch_depth} x {self.sketch_columns():,} counters a map shard"
        if self.sketch_half_life:
            text += f", halved every {self.sketch_half_life} {self.ttl_unit}"
        if self.sketch_columns() < self.shard_capacity:  # many ids share each counter
            text += " (fewer than its slots: ids share counters and reach min_count early)"
        return text
