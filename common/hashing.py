"""Counter-based hashing: splitmix64's finalizer, the one source of every pseudo-random
value in neorec that must be a pure function of its inputs (shuffle permutations, the
synthetic teacher's embeddings, initial embedding rows, stochastic rounding noise).

A counter-based hash needs no generator state, so any piece of the sequence can be computed
alone, by any process, on any host: a reader service permutes a window of rows from the
request's seed, a tier of the embedding store computes a never-written row's initial value
from (seed, table, row). The functions are written once for numpy ``uint64`` arrays and
compiled unchanged by Numba for scalars (:data:`mix64_jit`); :func:`mix64_int64` computes
the same bits in signed 64-bit arithmetic for array libraries without unsigned 64-bit
multiplication (torch). :func:`fold_mix32` (with :data:`fold_mix32_jit` and
:func:`fold_mix32_int64`) is a cheaper 32-bit finalizer for noise made in vector lanes.
"""

from __future__ import annotations

import numba
import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
SALT = 0x632BE59BD9B4E019
"""The constants of splitmix64 (Steele et al., 2014), and an odd salt to combine keys."""
FMIX32_1 = 0x85EBCA6B
FMIX32_2 = 0xC2B2AE35
"""The multipliers of MurmurHash3's 32-bit finalizer (:func:`fold_mix32`)."""

_MASK64 = (1 << 64) - 1


def mix64(z):
    """splitmix64's finalizer of ``uint64`` values (numpy arrays or scalars): a bijection
    whose outputs look independent for consecutive inputs."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


mix64_jit = numba.njit(inline="always")(mix64)
""":func:`mix64` compiled for Numba kernels (scalar ``np.uint64``)."""


def fold_mix32(z):
    """32 bits (as ``uint64`` values below 2**32) from ``uint64`` values (numpy arrays or
    scalars): ``z``'s two halves xored, through MurmurHash3's 32-bit finalizer. For noise
    that vector units make in 32-bit lanes (eight or sixteen at a time, where
    :func:`mix64`'s 64-bit products have no vector instruction on many CPUs); its input
    should already be spread over 64 bits (a multiple of an odd constant)."""
    low = np.uint64(0xFFFFFFFF)
    x = (z ^ (z >> np.uint64(32))) & low
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(FMIX32_1)) & low
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(FMIX32_2)) & low
    return x ^ (x >> np.uint64(16))


fold_mix32_jit = numba.njit(inline="always")(fold_mix32)
""":func:`fold_mix32` compiled for Numba kernels (scalar ``np.uint64``)."""


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output for state ``x`` (``uint64`` array): ``mix64(x + GOLDEN)``."""
    return mix64(x + np.uint64(GOLDEN))


def combine(*keys: int) -> int:
    """One 64-bit key from several non-negative integers (order matters), for seeding a
    sequence from e.g. ``(seed, epoch, window)``."""
    state = np.uint64(SALT)
    for key in keys:
        state = splitmix64(np.array([state ^ np.uint64(key & _MASK64)], dtype=np.uint64))[0]
    return int(state)


def unit_floats(hashes: np.ndarray) -> np.ndarray:
    """float64 in ``[0, 1)`` from ``uint64`` hashes (their top 53 bits)."""
    return (hashes >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def permutation(key: int, n: int) -> np.ndarray:
    """int64 ``[n]``: a permutation of ``range(n)`` that is a pure function of ``(key, n)``:
    the indices sorted by their hash. The hash is a bijection of the index (xor with a
    constant, then splitmix64), so no two indices tie and any sort gives the same order."""
    salted = np.uint64(((key & _MASK64) * GOLDEN + SALT) & _MASK64)
    return _argsort_spread(_index_hashes(salted, n))


@numba.njit(cache=True, nogil=True)
def _index_hashes(salted: np.uint64, n: int) -> np.ndarray:  # pragma: no cover - compiled
    """uint64 ``[n]``: :func:`splitmix64` of ``arange(n) ^ salted``, in one pass (numpy's
    takes a temporary per operation)."""
    hashes = np.empty(n, dtype=np.uint64)
    golden = np.uint64(GOLDEN)
    for i in range(n):
        hashes[i] = mix64_jit((np.uint64(i) ^ salted) + golden)
    return hashes


MAX_BUCKET = 64
"""Keys in one bucket above which :func:`_argsort_spread` sorts by comparison instead."""


@numba.njit(cache=True, nogil=True)
def _argsort_spread(keys: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """int64 ``[n]``: the order of distinct ``uint64`` ``keys`` spread evenly over their
    range (hashes), as ``np.argsort`` gives it, in linear time: the keys are counted into
    about ``n`` buckets by their top bits and placed bucket by bucket, each with its index,
    and one insertion sort over the placed keys then orders each bucket (one or two keys
    on average; no key moves past a bucket's start, as the buckets before hold smaller
    keys). If any bucket holds more than :data:`MAX_BUCKET` keys (not hashes), all the
    keys are sorted by ``np.argsort`` instead. A window's shuffle took 17 ms with
    ``np.argsort`` for 262k rows, 3.8 ms so."""
    n = keys.size
    bits = 1
    while (1 << bits) < n and bits < 32:
        bits += 1
    shift = np.uint64(64 - bits)
    fill = np.zeros((1 << bits) + 1, dtype=np.int64)
    for i in range(n):
        fill[(keys[i] >> shift) + np.uint64(1)] += 1
    if fill.max() > MAX_BUCKET:
        return np.argsort(keys)
    for b in range(1 << bits):
        fill[b + 1] += fill[b]  # fill[b]: where bucket b's next key goes
    placed = np.empty(n, dtype=np.uint64)
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        key = keys[i]
        b = key >> shift
        at = fill[b]
        fill[b] = at + 1
        placed[at] = key
        order[at] = i
    for j in range(1, n):
        key = placed[j]
        if placed[j - 1] < key:
            continue
        index = order[j]
        k = j
        while k > 0 and placed[k - 1] > key:
            placed[k] = placed[k - 1]
            order[k] = order[k - 1]
            k -= 1
        placed[k] = key
        order[k] = index
    return order


def signed(value: int) -> int:
    """A 64-bit pattern as the signed int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64_int64(z):
    """:func:`mix64` on int64 two's-complement bit patterns (duck-typed: any array type with
    wrapping int64 ``*``, ``^``, ``>>`` and ``&``, such as a torch tensor); same bits."""
    z = (z ^ _shift_right(z, 30)) * signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * signed(MIX2)
    return z ^ _shift_right(z, 31)


def fold_mix32_int64(z):
    """:func:`fold_mix32` on int64 two's-complement bit patterns (duck-typed as
    :func:`mix64_int64`); same bits, as int64 values below 2**32."""
    low = 0xFFFFFFFF
    x = (z ^ _shift_right(z, 32)) & low
    x = x ^ (x >> 16)
    x = (x * FMIX32_1) & low
    x = x ^ (x >> 13)
    x = (x * FMIX32_2) & low
    return x ^ (x >> 16)


def _shift_right(z, k: int):
    """Logical right shift of int64 bit patterns (``>>`` of a signed type is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)
