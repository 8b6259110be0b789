"""Dynamic embedding tables (``neorec bench dynamic``): quality at equal memory, step speed,
map lookup throughput and the memory bound.

- **Quality**: synthetic criteo-profile data whose ids come from a Zipf law over a large id
  space (``id_space`` ids per feature, far fewer distinct in the data), written twice from
  the same seed: as raw 64-bit ids (for dynamic tables) and as ids in ``[0, id_space)`` (the
  same rows, for hashed tables). Per capacity ``C`` (a fraction of the distinct ids of a
  feature): eval AUC of dynamic tables of ``C`` slots, of hashed tables of ``C`` rows (ids
  modulo ``C``), and of an unlimited vocabulary (every distinct id its own row, given in
  order of first sight: a dynamic table whose capacity exceeds the distinct ids, admitting
  at the first sighting, which never evicts). The same curve on the demo's data (dense ids
  in each feature's cardinality, read by dynamic tables as raw ids).
- **Speed**: a training step with dynamic tables against the same step with static tables
  of the same rows (``step_over_static``: the ratio of their rates), in the steady state:
  after the maps have filled, on batches not seen before.
- **Map**: lookups per second in one thread of a map holding ``MAP_LIVE`` ids.
- **Memory**: peak RSS of a process streaming ``RSS_DISTINCT`` distinct ids through a
  dynamic table of ``RSS_CAPACITY`` slots, against the bytes of its rows, map and sketch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from neorec.benchmarks import dynamic_rss
from neorec.benchmarks.timing import interleaved_rates
from neorec.benchmarks.train_bench import _load_batches, _step
from neorec.common.hashing import splitmix64
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer.config import TrainConfig
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.run.build import build_model, dense_optimizer
from neorec.trainer.run.step import set_threads
from neorec.trainer.run.train import train

ID_SPACE = 10**8
"""Ids each feature draws from."""
FRACTIONS = (1 / 16, 1 / 8, 1 / 4)
"""Capacities compared, as fractions of a feature's distinct ids in the train split."""
MIN_COUNT = 2
MAP_LIVE = 1_000_000
RSS_DISTINCT, RSS_CAPACITY = 10**7, 10**6
DIM = 16


def run(quick: bool = False) -> dict[str, Any]:
    threads = set_threads(0)
    rows = 20_000 if quick else 4_000_000
    demo_rows = 20_000 if quick else 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(rows=rows, row_group_rows=10_000 if quick else 65_536, seed=11, id_space=ID_SPACE)
        raw = generate(SynthSpec(**spec, raw_ids=True), Path(tmp) / "raw")
        plain = generate(SynthSpec(**spec), Path(tmp) / "plain")
        distinct = _distinct_ids(raw)
        curve = _curve(raw, plain, distinct, Path(tmp), quick)
        step_over_static = _step_ratio(raw, plain, curve[-1]["capacity"], quick)
        demo = generate(SynthSpec(rows=demo_rows, row_group_rows=10_000 if quick else 65_536, seed=11),
                        Path(tmp) / "demo")
        demo_distinct = _distinct_ids(demo)
        demo_curve = _curve(demo, demo, demo_distinct, Path(tmp), quick)
    return {
        "benchmark": "dynamic",
        "data": f"criteo profile, {rows:,} rows, ids Zipf over {ID_SPACE:,} per feature, "
                f"{distinct:,} distinct in the train split's largest feature",
        "threads": threads,
        "capacities": curve,
        "demo_data": f"the demo's data (criteo profile, its cardinalities), {demo_rows:,} rows, "
                     f"{demo_distinct:,} distinct ids in the train split's largest feature",
        "demo_capacities": demo_curve,
        "step_over_static": step_over_static,
        "map": _map_throughput(100_000 if quick else MAP_LIVE, 10**6 if quick else 2 * 10**7),
        "memory": _peak_rss(RSS_DISTINCT // 100 if quick else RSS_DISTINCT, RSS_CAPACITY // 100 if quick else
                            RSS_CAPACITY),
    }


def _curve(dynamic: Dataset, hashed: Dataset, distinct: int, tmp: Path, quick: bool) -> list[dict[str, Any]]:
    """Per capacity (``FRACTIONS`` of ``distinct``): eval AUC of dynamic tables on
    ``dynamic``'s ids, of hashed tables on ``hashed``'s (the same rows) and of an unlimited
    vocabulary (see the module docstring)."""
    unlimited = _auc(dynamic, _dynamic_config(dynamic, 2 * distinct, 1), tmp / "vocab", quick)
    curve = []
    for fraction in FRACTIONS:
        capacity = max(1, int(distinct * fraction))
        curve.append({
            "capacity": capacity,
            "dynamic_auc": _auc(dynamic, _dynamic_config(dynamic, capacity, MIN_COUNT), tmp / "dyn", quick),
            "hashed_auc": _auc(hashed, {"max_table_rows": capacity}, tmp / "hash", quick),
            "vocab_auc": unlimited,
        })
    return curve


def _distinct_ids(dataset: Dataset) -> int:
    """The most distinct ids any feature has in the train split."""
    files = [str(p) for p in dataset.files("train")]
    return max(len(np.unique(pq.read_table(files, columns=[f.name]).column(0).drop_null().to_numpy()))
               for f in dataset.schema.sparse)


def _dynamic_config(dataset: Dataset, capacity: int, min_count: int) -> dict[str, Any]:
    return {"dynamic": {f.table: {"capacity": capacity, "min_count": min_count}
                        for f in dataset.schema.sparse}}


def _config(dataset: Dataset, model: dict[str, Any], run_dir: Path, quick: bool) -> TrainConfig:
    return TrainConfig.from_dict({
        "data": {"path": str(dataset.root)},
        "model": {"embedding_dim": DIM, "bottom_mlp": [64, DIM], "top_mlp": [64, 1], **model},
        "optimizer": {"sparse": "rowwise_adagrad", "sparse_lr": 0.05},
        "train": {"batch_size": 512 if quick else 2048, "eval_batch_size": 8192, "epochs": 1},
        "checkpoint": {"every_steps": 0},
        "run": {"dir": str(run_dir)},
    })


def _auc(dataset: Dataset, model: dict[str, Any], run_dir: Path, quick: bool) -> float:
    summary = train(_config(dataset, model, run_dir, quick), overwrite=True)
    return float(summary["eval_auc"])


STEP_WARMUP_BATCHES, STEP_BATCHES = 100, 64
"""The step comparison trains ``STEP_WARMUP_BATCHES`` batches unmeasured (the maps fill,
admit and start evicting), then times steps on the next ``STEP_BATCHES``, each a batch it
has not seen: a training step's mix of known ids, first sightings, admissions and
evictions."""


def _step_ratio(raw: Dataset, plain: Dataset, capacity: int, quick: bool) -> float:
    """Training steps per second with dynamic tables of ``capacity`` slots over those with
    static tables of ``capacity`` rows, on the same rows of data, in the steady state (see
    :data:`STEP_WARMUP_BATCHES`)."""
    warmup, measured = (4, 16) if quick else (STEP_WARMUP_BATCHES, STEP_BATCHES)
    with tempfile.TemporaryDirectory() as tmp:
        dynamic_config = _config(raw, _dynamic_config(raw, capacity, MIN_COUNT), Path(tmp), quick)
        static_config = _config(plain, {"max_table_rows": capacity}, Path(tmp), quick)
        models = {}
        for name, dataset, config in (("dynamic", raw, dynamic_config), ("static", plain, static_config)):
            model = build_model(dataset, config)
            optimizer = dense_optimizer(model, config)
            batches = _load_batches(dataset, config)[: warmup + measured]
            for batch in batches[:warmup]:
                _step(model, [optimizer], batch)
            models[name] = (model, optimizer, batches[warmup:])
        steps, rounds = (4, 3) if quick else (STEP_BATCHES // 4, 3)  # with 2 warm-up steps: every batch once
        rates = interleaved_rates({name: (lambda i, m=m: _step(m[0], [m[1]], m[2][i % len(m[2])]))
                                   for name, m in models.items()}, steps=steps, rounds=rounds)
    return rates["dynamic"] / rates["static"]


def _map_throughput(live: int, lookups: int) -> dict[str, Any]:
    """Ids per second in one thread: read-only lookups and training remaps (all hits) of a
    map holding ``live`` ids."""
    table = DynamicTable("bench", 0, DIM, DynamicTableConfig(capacity=live))
    keys = splitmix64(np.arange(live, dtype=np.uint64)).view(np.int64)
    table.train_ids(keys)
    ids = keys[np.random.default_rng(0).integers(0, live, lookups)]
    table.map.lookup(ids[:1000])
    started = time.perf_counter()
    table.map.lookup(ids)
    lookup_rate = lookups / (time.perf_counter() - started)
    started = time.perf_counter()
    table.train_ids(ids)
    train_rate = lookups / (time.perf_counter() - started)
    return {"live_slots": live, "lookup_ids_per_s_per_thread": lookup_rate,
            "train_remap_ids_per_s_per_thread": train_rate}


def _peak_rss(distinct: int, capacity: int) -> dict[str, Any]:
    """Peak RSS of a fresh process streaming ``distinct`` ids (each twice) through a dynamic
    table of ``capacity`` slots (rows and optimizer state included)."""
    done = subprocess.run([sys.executable, "-m", dynamic_rss.__name__, str(distinct), str(capacity),
                           str(DIM)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the memory benchmark failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)
