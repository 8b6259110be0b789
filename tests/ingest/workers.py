"""Helpers for tests of the reader services: stopping them, comparing batches, damaging files."""

from __future__ import annotations

import tempfile

import numpy as np

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
