"""Ingestion throughput: rows/s one reader service process delivers to a client over gRPC
(uncompressed and zstd), against the in-process decoder on the same files, same plan; and
the cost of row-level shuffling against row-group shuffling, in process and over gRPC, in
rows/s and in CPU time per epoch: all the threads of this process and of the reader
service's (steadier than rows/s on a machine whose second core is not always free; the
client and the service share its cores, so the gRPC path's rows/s follows its CPU)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

from neorec.benchmarks.timing import interleaved_rates
from neorec.ingest.client import ClientOptions, RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import BatchReader, InProcessReader, ReaderConfig
from neorec.ingest.synth import SynthSpec, generate
from neorec.orchestration.processes import start_reader_service

PROFILES = {
    # profile: (rows, batch size), full and quick
    "criteo": ((400_000, 4096), (20_000, 1024)),  # 400k rows: six 64k row groups, two row-shuffling windows
    "multihot": ((200_000, 1024), (4_000, 256)),
}
WORKER_THREADS = 2
CPU_READERS = ("in_process", "in_process_rows", "grpc", "grpc_rows")
"""Readers whose CPU per epoch is measured (zstd's is not a figure anyone tracks)."""


def run(quick: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {"benchmark": "ingest", "worker_threads": WORKER_THREADS, "profiles": {}}
    service = start_reader_service("--worker-threads", str(WORKER_THREADS), data_roots=[tempfile.gettempdir()])
    try:
        for profile, (full, small) in PROFILES.items():
            rows, batch_size = small if quick else full
            with tempfile.TemporaryDirectory() as tmp:
                dataset = generate(SynthSpec(profile=profile, rows=rows, eval_fraction=0.01), tmp)
                options = DecodeOptions.for_schema(dataset.schema)
                by_group = ReaderConfig(batch_size=batch_size, shuffle="row_groups")
                by_row = ReaderConfig(batch_size=batch_size, shuffle="rows")
                readers: dict[str, BatchReader] = {
                    "in_process": InProcessReader(dataset, "train", options, by_group),
                    "in_process_rows": InProcessReader(dataset, "train", options, by_row),
                    "grpc": RemoteReader(dataset, "train", options, by_group, [service.address]),
                    "grpc_rows": RemoteReader(dataset, "train", options, by_row, [service.address]),
                    "grpc_zstd": RemoteReader(dataset, "train", options, by_group, [service.address],
                                              ClientOptions(compression="zstd")),
                }
                try:
                    rates = interleaved_rates(
                        {name: _epoch_rows(r, k, len(readers)) for k, (name, r) in enumerate(readers.items())},
                        steps=1, rounds=3 if quick else 7, warmup=1)
                    cpu = _cpu_per_epoch({name: readers[name] for name in CPU_READERS}, service.process.pid,
                                         rounds=2 if quick else 5)
                finally:
                    for reader in readers.values():
                        reader.close()
            base = rates["in_process"]
            results["profiles"][profile] = {
                "rows": dataset.rows["train"],
                "batch_size": batch_size,
                "rows_per_s": rates,
                "ratio_grpc": rates["grpc"] / base,
                "ratio_grpc_zstd": rates["grpc_zstd"] / base,
                "row_shuffle_ratio_in_process": rates["in_process_rows"] / base,
                "row_shuffle_ratio_grpc": rates["grpc_rows"] / rates["grpc"],
                "cpu_ms_per_epoch": {name: 1e3 * seconds for name, seconds in cpu.items()},
                "row_shuffle_cpu_ratio_in_process": cpu["in_process"] / cpu["in_process_rows"],
                "row_shuffle_cpu_ratio_grpc": cpu["grpc"] / cpu["grpc_rows"],
                "cpu_ratio_grpc": cpu["in_process"] / cpu["grpc"],
            }
    finally:
        service.stop()
    return results


def _epoch_rows(reader: BatchReader, index: int, count: int) -> Callable[[int], int]:
    """Step ``i`` reads epoch ``i * count + index`` (a fresh shuffle) to the end; returns the
    rows delivered. Each of ``count`` candidates reads its own epochs, so that the service's
    row group cache (shared within an epoch) never serves one candidate another's reads."""
    return lambda i: sum(batch.num_valid for batch in reader.epoch(i * count + index))


def _cpu_per_epoch(readers: dict[str, BatchReader], service_pid: int, rounds: int) -> dict[str, float]:
    """CPU seconds this process and the reader service process together spend reading one
    whole epoch with each reader, the least over ``rounds`` interleaved epochs (fresh
    shuffles, after those the rates read; each reader its own, as in :func:`_epoch_rows`).
    The in-process readers' figures include the idle service's few ticks."""
    best = {name: float("inf") for name in readers}
    for r in range(rounds):
        for k, (name, reader) in enumerate(readers.items()):
            started = time.process_time() + _process_cpu_s(service_pid)
            sum(batch.num_valid for batch in reader.epoch(10_000 + r * len(readers) + k))  # its own epochs
            best[name] = min(best[name], time.process_time() + _process_cpu_s(service_pid) - started)
    return best


def _process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux ``/proc``; clock ticks,
    10 ms each on most kernels)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
