"""Training QPS on a shared host: the demo's model (``configs/demo.toml``: 26 tables x dim 16,
MLPs 64-32-16 / 128-64-1, batch 512, row-wise Adagrad + Adam) trained three ways, each quiet
and while one competing single-threaded CPU-bound process (``while True: pass``) runs
beside it:

- ``default``: what ``train.threads = 0`` does: the CPUs this process may use, with the
  :class:`~neorec.trainer.run.thread_governor.ThreadGovernor` following the load (its
  reaction time inside the measured window) where the trainer would use one
  (:func:`~neorec.trainer.run.thread_governor.governor_for`: not where the model's dense
  layers give other bits with fewer threads on this machine; ``governed`` says which);
- ``fixed``: the same count, never changed (what the default was before the governor);
- ``one_thread``.

Reported: the contended/quiet ratio of each, and the default's contended QPS against one
thread's, in the steady state: every case trains unmeasured for ``SETTLE_S`` before its
measured window, the competitor running (the governor looks at the load four times a
second and changes the count after two looks that agree). Apart: the governor's reaction
time, from the competitor's start to its first change of the count. Rounds alternate quiet
and contended, and the cases inside each, so that drift of the machine hits all alike. The
batches are decoded beforehand: this measures the step, not the reader."""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from neorec.benchmarks.train_bench import _load_batches, _step
from neorec.common.cpus import available_cpus
from neorec.common.wait_policy import WAIT_VARIABLES
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer.batch import Batch
from neorec.trainer.config import TrainConfig
from neorec.trainer.model import DLRM
from neorec.trainer.run.build import build_model, dense_optimizer
from neorec.trainer.run.step import set_threads
from neorec.trainer.run.thread_governor import ThreadGovernor, governor_for

DEMO_MODEL = {"embedding_dim": 16, "bottom_mlp": [64, 32, 16], "top_mlp": [128, 64, 1], "max_table_rows": 200_000}
BATCH_SIZE = 512
SETTLE_S = 1.0
"""Unmeasured training of each case before its measured window."""
CPU = torch.device("cpu")
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
    seconds, rounds = (1.0, 1) if quick else (4.0, 3)
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
        cases = {"default": default, "fixed": default, "one_thread": 1}
        rates: dict[tuple[str, bool], list[float]] = {(c, q): [] for c in cases for q in (False, True)}
        batch_stream = itertools.cycle(batches)
        governed = False  # whether the trainer would govern this model's threads (governor_for), as each round finds
        for _ in range(rounds):
            for contended in (False, True):
                with competing_process() if contended else nullcontext():
                    for case, threads in cases.items():
                        set_threads(threads)
                        governor = governor_for(model, config, threads, CPU) if case == "default" else None
                        if case == "default":
                            governed = governor is not None
                        _rate(model, optimizers, batch_stream, governor, SETTLE_S)
                        rates[case, contended].append(_rate(model, optimizers, batch_stream, governor, seconds))
        reaction = _reaction_seconds(model, config, optimizers, batch_stream, default) if governed else None
        set_threads(0)
    qps = {key: statistics.median(values) for key, values in rates.items()}
    return {
        "benchmark": "train-contention",
        "model": "demo: 26 tables x dim 16, MLPs 64-32-16 / 128-64-1, batch 512, row-wise Adagrad + Adam",
        "cpus": available_cpus(),
        "wait_policy": {name: os.environ[name] for name in WAIT_VARIABLES if name in os.environ},
        **{case: _case(threads, qps[case, False], qps[case, True]) for case, threads in cases.items()},
        "contended_default_vs_one_thread": qps["default", True] / qps["one_thread", True],
        "governed": governed,
        "governor_reaction_s": reaction,
    }


def _rate(model: DLRM, optimizers: list[torch.optim.Optimizer], batches: Iterator[Batch],
          governor: ThreadGovernor | None, seconds: float) -> float:
    """Samples per second of steps on ``batches`` for ``seconds`` (``governor`` looking at
    the load between steps, as in training)."""
    samples = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        samples += _step(model, optimizers, next(batches))
        if governor is not None:
            governor.after_step()
    return samples / elapsed


def _reaction_seconds(model: DLRM, config: TrainConfig, optimizers: list[torch.optim.Optimizer],
                      batches: Iterator[Batch], threads: int, limit_s: float = 10.0) -> float | None:
    """Seconds from a competitor's start to the governor's first change of ``threads``
    (None: no change within ``limit_s``, or no governor: a single thread to start with)."""
    set_threads(threads)
    governor = governor_for(model, config, threads, CPU)
    if governor is None:
        return None
    started = time.perf_counter()
    with competing_process():
        while time.perf_counter() - started < limit_s:
            _step(model, optimizers, next(batches))
            governor.after_step()
            if governor.threads != threads:
                return time.perf_counter() - started
    return None


def _case(threads: int, quiet: float, contended: float) -> dict[str, Any]:
    return {"threads": threads, "quiet_qps": quiet, "contended_qps": contended, "ratio": contended / quiet}
