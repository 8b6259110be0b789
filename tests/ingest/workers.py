"""Helpers for tests of the reader services: stopping them, comparing batches, damaging files."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from neorec.ingest.batch import HostBatch
from neorec.orchestration.processes import ServiceProcess, start_reader_service

DATA_ROOTS = (tempfile.gettempdir(),)
"""Where the tests' datasets are written (pytest's temporary directories): the services'
data root."""


def start_worker(*args: str) -> ServiceProcess:
    """A reader service process that may read the tests' datasets."""
    return start_reader_service(*args, data_roots=DATA_ROOTS)


def stop_all(workers: list[ServiceProcess]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.kill()


def assert_same_batches(got: list[HostBatch], expected: list[HostBatch]) -> None:
    """Same batches, byte for byte, with the same provenance."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.provenance == b.provenance
        assert (a.keys, a.num_valid) == (b.keys, b.num_valid)
        for name in ("dense", "labels", "lengths", "values"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
        assert (a.weights is None) == (b.weights is None)
        if a.weights is not None:
            assert np.array_equal(a.weights, b.weights)


def scramble_data_pages(path) -> None:
    """Overwrite every byte of a Parquet file between its magic and its footer."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    data[4:-footer] = np.random.default_rng(0).bytes(len(data) - footer - 4)
    path.write_bytes(bytes(data))


def with_a_bit_flipped_in_each_column(path: Path, row_group: int) -> Iterator[bytes]:
    """The file's bytes, once per column, with a bit of the last byte of that column's
    chunk in ``row_group`` flipped: in the last page's body, past its header."""
    original = path.read_bytes()
    group = pq.ParquetFile(path).metadata.row_group(row_group)
    for c in range(group.num_columns):
        chunk = group.column(c)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        data = bytearray(original)
        data[start + chunk.total_compressed_size - 1] ^= 0x04
        yield bytes(data)
