"""Map shards: a dynamic table of ``S`` map shards sends id ``x`` to shard
``(mix64(x ^ SHARD_SALT) >> 32) mod S``.

The id map's index probes from the low bits of ``mix64(x)``; the shard comes from the high
bits of a differently salted hash, so which shard an id is in says nothing about where it
sits in that shard's index. Map shard ``s`` owns the table rows
``[s * (Cs + 1), (s + 1) * (Cs + 1))`` (``Cs`` slots, then its default row): a rank that holds
that block holds the shard's map, and a router sends the id there by the block's first row.

The same function is written for numpy arrays, Numba scalars and torch int64 tensors
(``mix64_int64``: torch has no unsigned 64-bit multiply); all give the same shard.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from neorec.common.hashing import mix64, mix64_int64, mix64_jit, signed

SHARD_SALT = 0xD1B54A32D192ED03
"""Salts the shard hash apart from the index's probe hash."""
_HIGH = np.uint64(32)


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """int64 ``[n]``: the map shard of each id (int64 ``[n]``, any value)."""
    hashes = mix64(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(SHARD_SALT))
    return ((hashes >> _HIGH) % np.uint64(shards)).astype(np.int64)


@numba.njit(inline="always")
def shard_of_jit(key: np.int64, shards: np.int64) -> np.int64:
    """:func:`shard_of` of one id, in a Numba kernel."""
    return np.int64((mix64_jit(np.uint64(key) ^ np.uint64(SHARD_SALT)) >> np.uint64(32)) % np.uint64(shards))


def shard_of_torch(ids: torch.Tensor, shards: torch.Tensor | int) -> torch.Tensor:
    """:func:`shard_of` in torch ops (any device): int64 ``[n]`` ids; ``shards`` a number or
    an int64 tensor broadcasting with ``ids`` (positive)."""
    high = (mix64_int64(ids ^ signed(SHARD_SALT)) >> 32) & 0xFFFFFFFF
    return high % shards
