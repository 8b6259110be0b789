"""Reader service processes for tests: real ``neorec ingest serve`` processes on
OS-chosen loopback ports."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

from ingest.batch import HostBatch

_READY = re.compile(r"serving on (\S+)")


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    address: str

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_worker(*extra: str) -> WorkerProcess:
    """Start a reader service process and wait until it announces its address."""
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestration.cli", "ingest", "serve", "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = process.stdout.readline()
    match = _READY.search(line)
    if match is None:
        process.kill()
        raise RuntimeError(f"reader service did not start: {line!r}")
    return WorkerProcess(process, match.group(1))


def stop_all(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()


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
