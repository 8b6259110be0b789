"""Which rows a plan reads: row groups, windows of row groups read as one (possibly
permuted) sequence of rows, and spans of a window.

A *window* is one or more row groups whose rows, concatenated in group order, are read in
a fixed order: as they lie in the files, or permuted by a seed (row-level shuffling mixes
the rows of a window's groups). A *span* is a contiguous run ``[start, stop)`` of a
window's read order. An epoch is a sequence of windows; a rank reads a contiguous run of
that sequence's rows, as spans; a batch holds the rows of one or more spans, which
is its provenance. Everything here is a pure function of the row groups' sizes and the
seeds, so every process that holds the same Parquet footers derives the same rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

from neorec.common.hashing import permutation


@dataclass(frozen=True)
class RowGroupInfo:
    """Row group ``row_group`` of file ``file_index`` of a split, of ``num_rows`` rows."""

    file_index: int
    row_group: int
    num_rows: int


@dataclass(frozen=True)
class Window:
    """Row groups read as one sequence: their rows in file order (``seed`` is None) or in
    the order of :func:`neorec.common.hashing.permutation` of ``seed``."""

    groups: tuple[RowGroupInfo, ...]
    seed: int | None = None
    num_rows: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a window holds at least one row group")
        object.__setattr__(self, "num_rows", sum(g.num_rows for g in self.groups))

    @property
    def permuted(self) -> bool:
        return self.seed is not None

    def group_starts(self) -> np.ndarray:
        """int64 ``[G + 1]``: the window's rows of group ``g`` are ``[starts[g], starts[g+1])``."""
        return np.concatenate([[0], np.cumsum([g.num_rows for g in self.groups])]).astype(np.int64)

    def order(self) -> np.ndarray:
        """int64 ``[num_rows]``: the window's rows (numbered across its groups) in read order
        (read-only; computed once per window and process, see :func:`_read_order`)."""
        with _READ_ORDER_LOCK:  # threads that start on one window at once wait for one computation
            return _read_order(self.seed, self.num_rows)


_READ_ORDER_LOCK = threading.Lock()


@lru_cache(maxsize=16)
def _read_order(seed: int | None, num_rows: int) -> np.ndarray:
    order = np.arange(num_rows, dtype=np.int64) if seed is None else permutation(seed, num_rows)
    order.flags.writeable = False
    return order


@dataclass(frozen=True)
class RowSpan:
    """Rows ``[start, stop)`` of ``window``'s read order."""

    window: Window
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def sub(self, begin: int, end: int) -> "RowSpan":
        """Rows ``[begin, end)`` of this span (positions relative to its start)."""
        return RowSpan(self.window, self.start + begin, self.start + end)

    def locations(self) -> np.ndarray:
        """int64 ``[num_rows, 3]``: the (file index, row group, row in the group) of each of
        the span's rows, in read order."""
        window = self.window
        positions = window.order()[self.start : self.stop]
        starts = window.group_starts()
        group = np.searchsorted(starts, positions, side="right") - 1
        files = np.array([g.file_index for g in window.groups], dtype=np.int64)
        row_groups = np.array([g.row_group for g in window.groups], dtype=np.int64)
        return np.stack([files[group], row_groups[group], positions - starts[group]], axis=1)

    def pieces(self, max_rows: int) -> list["RowSpan"]:
        """The span cut into consecutive pieces of at most ``max_rows`` rows."""
        return [self.sub(lo, min(lo + max_rows, self.num_rows)) for lo in range(0, self.num_rows, max_rows)]


def cut_spans(spans: Sequence[RowSpan], begin: int, end: int) -> tuple[RowSpan, ...]:
    """The rows at positions ``[begin, end)`` of the stream ``spans`` form, as spans."""
    out = []
    position = 0
    for s in spans:
        lo, hi = max(begin - position, 0), min(end - position, s.num_rows)
        if hi > lo:
            out.append(s.sub(lo, hi))
        position += s.num_rows
        if position >= end:
            break
    return tuple(out)


def merge_spans(spans: Iterable[RowSpan]) -> tuple[RowSpan, ...]:
    """``spans`` with each run of adjacent pieces of one window joined: the one way to
    write a sequence of rows (how a plan writes it), whatever pieces it was read in."""
    merged: list[RowSpan] = []
    for s in spans:
        if merged and merged[-1].window == s.window and merged[-1].stop == s.start:
            merged[-1] = RowSpan(s.window, merged[-1].start, s.stop)
        else:
            merged.append(s)
    return tuple(merged)
