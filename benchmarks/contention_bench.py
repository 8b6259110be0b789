"""Training QPS on a shared host: the demo's model (``configs/demo.toml``: 26 tables x dim 16,
MLPs 64-32-16 / 128-64-1, batch 512, row-wise Adagrad + Adam) trained with the default
thread count and with one thread, each quiet and while one competing single-threaded
CPU-bound process (``while True: pass``) runs beside it; the contended/quiet ratio of
each, and the default's contended QPS against one thread's.

Rounds alternate quiet and contended, and the two thread counts inside each, so that
drift of the machine hits all four alike. The batches are decoded beforehand: this
measures the step, not the reader."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

from neorec.benchmarks.train_bench import _load_batches, _step
from neorec.common.cpus import available_cpus
from neorec.common.wait_policy import WAIT_VARIABLES
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.build import build_model, dense_optimizer
from neorec.trainer.run.step import set_threads

DEMO_MODEL = {"embedding_dim": 16, "bottom_mlp": [64, 32, 16], "top_mlp": [128, 64, 1], "max_table_rows": 200_000}
BATCH_SIZE = 512
SPIN = "while True: pass"
"""The competitor: one thread that never waits."""


@contextmanager
def competing_process() -> Iterator[subprocess.Popen]:
    """One single-threaded CPU-bound process for the duration of the block."""
    process = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # started and spinning
        yield process
    finally:
        process.kill()
        process.wait()


def run(quick: bool = False) -> dict[str, Any]:
    default = set_threads(0)
    steps, rounds = (4, 1) if quick else (40, 3)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = generate(SynthSpec(rows=20_000 if quick else 100_000), tmp)
        config = TrainConfig.from_dict({
            "data": {"path": tmp, "dense_transform": "log1p", "id_mapping": "modulo"},
            "model": DEMO_MODEL,
            "optimizer": {"sparse": "rowwise_adagrad", "sparse_lr": 0.05, "dense": "adam", "dense_lr": 0.001},
            "train": {"batch_size": BATCH_SIZE},
        })
        batches = _load_batches(dataset, config)
        model = build_model(dataset, config)
        optimizers = [dense_optimizer(model, config)]
        counts = sorted({default, 1}, reverse=True)
        rates: dict[tuple[int, bool], list[float]] = {(t, c): [] for t in counts for c in (False, True)}
        step = 0
        for _ in range(rounds):
            for contended in (False, True):
                with competing_process() if contended else nullcontext():
                    for threads in counts:
                        set_threads(threads)
                        for _ in range(2):  # warm-up: the pools at this size
                            _step(model, optimizers, batches[step % len(batches)])
                            step += 1
                        started = time.perf_counter()
                        samples = 0
                        for _ in range(steps):
                            samples += _step(model, optimizers, batches[step % len(batches)])
                            step += 1
                        rates[threads, contended].append(samples / (time.perf_counter() - started))
        set_threads(0)
    qps = {key: statistics.median(values) for key, values in rates.items()}
    return {
        "benchmark": "train-contention",
        "model": "demo: 26 tables x dim 16, MLPs 64-32-16 / 128-64-1, batch 512, row-wise Adagrad + Adam",
        "cpus": available_cpus(),
        "wait_policy": {name: os.environ[name] for name in WAIT_VARIABLES if name in os.environ},
        "default": _case(default, qps),
        "one_thread": _case(1, qps),
        "contended_default_vs_one_thread": qps[default, True] / qps[1, True],
    }


def _case(threads: int, qps: dict[tuple[int, bool], float]) -> dict[str, Any]:
    return {"threads": threads, "quiet_qps": qps[threads, False], "contended_qps": qps[threads, True],
            "ratio": qps[threads, True] / qps[threads, False]}
