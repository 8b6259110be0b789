"""The embedding store: its cache kernels, its hit rates, and training through it.

- ``kernels``: lookups per second on hits and misses handled per second, one thread, with
  a tag array far larger than the CPU's last-level cache; beside them, a fully
  associative LRU (an ``OrderedDict``) doing the same work.
- ``hit_rates``: 32-way LRU against exact (fully associative) LRU, and 32-way LFU, at 1, 5
  and 20 % capacity, on Zipf(1.05) ids and on the ids of a criteo-profile column.
- ``out_of_core``: the same DLRM (criteo-profile tables, dim 64) trained twice on the same
  data from the same seed, tables in memory and the large tables on the store (host cache
  a fraction of their bytes, reads with O_DIRECT so that none is served by the page cache):
  QPS ratio, the share of step time spent waiting on the tier, write amplification, and
  whether the two runs' AUC agree (they are the same computation).
- ``larger_than_memory``: one run whose tables' logical size is at least twice this
  machine's RAM (criteo-profile cardinalities, dim 512): QPS, the process's peak RSS, and
  the bytes the tiers hold.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq

from neorec.configs import shipped
from neorec.embedding_store.cache import SetAssociativeCache
from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.orchestration.config import load_config
from neorec.trainer.planner.inputs import TableSpec
from neorec.trainer.run.train import train

KERNEL_SLOTS = 1 << 25
"""32M slots: 768 MiB of tags, scores and pins, far beyond a last-level cache."""
BATCH_ROWS = 65_536
HIT_RATE_ROWS = 1_000_000
HIT_RATE_ACCESSES = 3_000_000


def run(quick: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {"benchmark": "store", "cpu_last_level_cache": _llc()}
    results["kernels"] = kernels(1 << 20 if quick else KERNEL_SLOTS)
    results["hit_rates"] = hit_rates(200_000 if quick else HIT_RATE_ROWS,
                                     300_000 if quick else HIT_RATE_ACCESSES)
    results["out_of_core"] = out_of_core(quick)
    results["larger_than_memory"] = larger_than_memory(quick)
    return results


# ---------------------------------------------------------------------------- kernels
def kernels(slots: int) -> dict[str, Any]:
    """Hit lookups and handled misses per second of the set-associative cache, one thread
    (disk I/O excluded), against an exact LRU's dictionary doing the same."""
    rng = np.random.default_rng(0)
    cache = SetAssociativeCache(slots, ways=32, policy="lru")
    batch = 0
    for start in range(0, slots, BATCH_ROWS):  # fill it: rows [0, slots) (a few land in scratch)
        batch += 1
        cache.admit(np.arange(start, min(start + BATCH_ROWS, slots), dtype=np.int64), batch)
    cached = cache.tags[cache.tags >= 0]
    probes = [rng.choice(cached, BATCH_ROWS, replace=False) for _ in range(8)]
    cache.lookup(probes[0][:8])  # compiled (or loaded) before it is timed
    started = time.perf_counter()
    for rows in probes:
        cache.lookup(rows)
    lookup_rate = len(probes) * BATCH_ROWS / (time.perf_counter() - started)
    started = time.perf_counter()
    for rows in probes:
        batch += 1
        cache.admit(rows, batch)
    hit_admit_rate = len(probes) * BATCH_ROWS / (time.perf_counter() - started)
    fresh = [np.arange(slots + i * BATCH_ROWS, slots + (i + 1) * BATCH_ROWS, dtype=np.int64) for i in range(8)]
    misses_before = cache.counters.misses
    started = time.perf_counter()
    for rows in fresh:
        batch += 1
        cache.admit(rows, batch)
    miss_rate = (cache.counters.misses - misses_before) / (time.perf_counter() - started)
    exact = ExactLru(min(slots, 1 << 22))
    exact.access(np.arange(exact.capacity, dtype=np.int64))
    exact_probe = rng.integers(0, exact.capacity, BATCH_ROWS)
    started = time.perf_counter()
    exact.access(exact_probe)
    exact_rate = BATCH_ROWS / (time.perf_counter() - started)
    return {"slots": cache.slots, "tag_bytes": cache.tags.nbytes + cache.scores.nbytes + cache.pins.nbytes,
            "hit_lookups_per_s": lookup_rate, "hit_admits_per_s": hit_admit_rate, "misses_per_s": miss_rate,
            "exact_lru_dict_accesses_per_s": exact_rate, "hit_admit_over_exact_lru_dict": hit_admit_rate / exact_rate,
            "goals": {"hits_per_s": 5e6, "misses_per_s": 1.5e6}}


class ExactLru:
    """Fully associative LRU of ``capacity`` rows (the hit rate set-associativity gives up)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: OrderedDict[int, None] = OrderedDict()
        self.hits = 0

    def access(self, rows: np.ndarray) -> None:
        for row in rows.tolist():
            if row in self.rows:
                self.hits += 1
                self.rows.move_to_end(row)
            else:
                self.rows[row] = None
                if len(self.rows) > self.capacity:
                    self.rows.popitem(last=False)


# --------------------------------------------------------------------------- hit rates
def hit_rates(rows: int, accesses: int) -> dict[str, Any]:
    """Hit rates of 32-way LRU and LFU against exact LRU, on two id streams."""
    rng = np.random.default_rng(1)
    streams = {"zipf_1.05": (rng.zipf(1.05, accesses) - 1) % rows, "criteo_C3": _criteo_ids(accesses)}
    out: dict[str, Any] = {}
    for name, ids in streams.items():
        distinct = int(np.unique(ids).size)
        out[name] = {"accesses": int(ids.size), "distinct": distinct}
        for fraction in (0.01, 0.05, 0.2):
            capacity = max(32, int(distinct * fraction))
            exact = ExactLru(capacity)
            exact.access(ids)
            entry = {"capacity": capacity, "exact_lru": exact.hits / ids.size}
            for policy in ("lru", "lfu"):
                entry[f"32way_{policy}"] = set_associative_hit_rate(ids, capacity, policy)
            entry["lru_points_below_exact"] = 100 * (entry["exact_lru"] - entry["32way_lru"])
            out[name][f"{fraction:.0%}"] = entry
    return out


def set_associative_hit_rate(ids: np.ndarray, capacity: int, policy: str, ways: int = 32) -> float:
    """Hits over accesses of a ``ways``-way cache of ``capacity`` rows fed ``ids`` one at a time."""
    cache = SetAssociativeCache(capacity, ways=ways, policy=policy)
    one = np.empty(1, dtype=np.int64)
    for batch, row in enumerate(ids.tolist(), 1):
        one[0] = row
        cache.admit(one, batch)
    return cache.counters.hits / ids.size


def _criteo_ids(count: int) -> np.ndarray:
    """The ids of column C3 (10M cardinality) of a criteo-profile dataset, in row order."""
    with tempfile.TemporaryDirectory() as tmp:
        dataset = generate(SynthSpec(rows=count, row_group_rows=1 << 18, file_rows=1 << 22, seed=4), tmp)
        files = dataset.files("train") + dataset.files("eval")
        column = np.concatenate([pq.read_table(f, columns=["C3"]).column(0).to_numpy(zero_copy_only=False)
                                 for f in files])
    return column.astype(np.int64)


# ---------------------------------------------------------------------------- training
def out_of_core(quick: bool) -> dict[str, Any]:
    """The same DLRM in memory and through the store (direct I/O), side by side."""
    rows = 60_000 if quick else 1_000_000
    rounds = 1 if quick else 2
    with _scratch_dataset(rows, seed=5) as (root, dataset):
        base = [f"data.path='{dataset.root}'", "model.embedding_dim=64", "model.bottom_mlp=[128, 64]",
                "model.max_table_rows=2000000", "train.log_every=1000000", "train.batch_size=2048",
                "checkpoint.final=false", "embedding_store.cache_fraction=0.0"]
        config = load_config(shipped("demo.toml"), base)
        from neorec.trainer.run.build import table_configs

        tables = table_configs(dataset.schema, config)
        large = [t for t in tables if t.num_embeddings >= 100_000]
        runs: dict[str, list[dict[str, Any]]] = {"memory": [], "store_25%": [], "store_2%": []}
        for round_ in range(rounds):
            for name in runs:
                settings = [*base, f"run.dir='{root / f'{name}-{round_}'}'"]
                if name != "memory":
                    fraction = float(name.split("_")[1].rstrip("%")) / 100
                    tables_on_store = json.dumps({t.name: fraction for t in large}).replace(":", "=")
                    settings += [f"embedding_store.tables={tables_on_store}", "embedding_store.direct_io=true",
                                 f"embedding_store.dir='{root / f'tiers-{name}-{round_}'}'"]
                runs[name].append(train(load_config(shipped("demo.toml"), settings)))
        memory_qps = statistics.median(r["train_qps"] for r in runs["memory"])
        table_bytes = sum(_bytes(t.num_embeddings, 64) for t in large)
        out: dict[str, Any] = {"rows": rows, "steps": runs["memory"][0]["steps"], "rounds": rounds,
                               "store_tables": [t.name for t in large], "store_table_bytes": table_bytes,
                               "read_path": "O_DIRECT (embedding_store.direct_io = true)",
                               "memory": {"qps": memory_qps, "eval_auc": runs["memory"][0]["eval_auc"]}}
        for name in ("store_25%", "store_2%"):
            summaries = runs[name]
            store = summaries[0]["store"]
            seconds = summaries[0]["train_samples"] / summaries[0]["train_qps"]
            fraction = float(name.split("_")[1].rstrip("%")) / 100
            qps = statistics.median(r["train_qps"] for r in summaries)
            out[name] = {"qps": qps, "qps_over_memory": qps / memory_qps, "eval_auc": summaries[0]["eval_auc"],
                         "same_auc_as_memory": summaries[0]["eval_auc"] == out["memory"]["eval_auc"],
                         "cache_bytes": sum(_bytes(int(np.ceil(t.num_embeddings * fraction)), 64) for t in large),
                         "hit_rate": store["hits"] / max(store["hits"] + store["misses"], 1),
                         "stall_over_step_time": store["stall_s"] / seconds,
                         "store_over_step_time": store["admit_s"] / seconds,
                         "write_amplification": store["write_amplification"]}
        out["goals"] = {"qps_over_memory": 0.5, "stall_over_step_time": 0.2, "write_amplification": 2.0}
        return out


def larger_than_memory(quick: bool) -> dict[str, Any]:
    """One run whose tables' logical size is at least twice the machine's RAM."""
    rows = 40_000 if quick else 400_000
    dim = 64 if quick else 512
    with _scratch_dataset(rows, seed=6) as (root, dataset):
        settings = [f"data.path='{dataset.root}'", f"model.embedding_dim={dim}", f"model.bottom_mlp=[256, {dim}]",
                    "model.top_mlp=[256, 1]", "model.max_table_rows=100000000", "train.log_every=1000000",
                    "train.batch_size=2048", "checkpoint.final=false", f"run.dir='{root / 'run'}'",
                    f"embedding_store.dir='{root / 'tiers'}'", "embedding_store.direct_io=true",
                    "embedding_store.cache_fraction=0.01", "sharding.memory_per_rank='4GiB'"]
        config = load_config(shipped("demo.toml"), settings)
        from neorec.trainer.run.build import table_configs

        logical = sum(_bytes(t.num_embeddings, dim) for t in table_configs(dataset.schema, config))
        # Its own process: the peak RSS is this run's alone.
        subprocess.run([sys.executable, "-m", "neorec.orchestration.cli", "train", str(shipped("demo.toml")),
                        *(arg for setting in settings for arg in ("--set", setting))], check=True,
                       stdout=subprocess.DEVNULL)
        summary = json.loads((root / "run" / "summary.json").read_text())
        stored = sum(f.stat().st_size for f in (root / "tiers").rglob("*.seg"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"rows": rows, "embedding_dim": dim, "logical_table_bytes": logical, "machine_ram_bytes": ram,
            "logical_over_ram": logical / ram, "qps": summary["train_qps"], "eval_auc": summary["eval_auc"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "segment_bytes_at_end": stored, "store": summary["store"]}


def _bytes(rows: int, dim: int) -> int:
    """A table's bytes with row-wise Adagrad state, as the planner counts them."""
    return TableSpec("t", rows, dim).bytes()


@contextmanager
def _scratch_dataset(rows: int, seed: int) -> Iterator[tuple[Path, Dataset]]:
    """A temporary directory under ``$NEOREC_BENCH_DIR`` (a local disk; else the default)
    holding a criteo-profile dataset of ``rows`` rows in ``data/``; yields both."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("NEOREC_BENCH_DIR") or None) as tmp:
        root = Path(tmp)
        yield root, generate(SynthSpec(rows=rows, seed=seed), root / "data")


def _llc() -> str:
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return "unknown"
