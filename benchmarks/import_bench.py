"""``neorec data import`` on a generated click log (criteo-shaped CSV: a label, 13 counts
with gaps, 26 categorical strings), in a process of its own: rows per second and peak RSS,
beside a plain pyarrow conversion of the same file to Parquet (read, write, no encoding:
the ceiling of any importer) in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

ROWS = 5_000_000
CHUNK = 500_000
SPEC = """
[input]
files = ["{path}"]
[label]
column = "label"
[dense]
columns = [{dense}]
[categorical]
columns = [{sparse}]
min_count = 2
[split]
kind = "random"
eval_fraction = 0.1
"""
PYARROW_BASELINE = """
import sys, pyarrow.csv as c, pyarrow.parquet as q
reader = c.open_csv(sys.argv[1], read_options=c.ReadOptions(block_size=16 << 20))
with q.ParquetWriter(sys.argv[2], reader.schema, compression="zstd") as w:
    for batch in reader:
        w.write_batch(batch, row_group_size=65536)
"""


def run(quick: bool = False) -> dict[str, Any]:
    rows = 200_000 if quick else ROWS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        log = root / "log.csv"
        _write_log(log, rows)
        dense = [f"I{i}" for i in range(1, 14)]
        sparse = [f"C{i}" for i in range(1, 27)]
        spec = root / "spec.toml"
        spec.write_text(SPEC.format(path=log, dense=", ".join(f'"{c}"' for c in dense),
                                    sparse=", ".join(f'"{c}"' for c in sparse)))
        ours = _timed([sys.executable, "-m", "neorec.orchestration.cli", "data", "import", str(spec), "--out",
                       str(root / "out")])
        baseline = _timed([sys.executable, "-c", PYARROW_BASELINE, str(log), str(root / "plain.parquet")])
        imported = json.loads((root / "out" / "dataset.json").read_text())
        csv_bytes = log.stat().st_size
    return {"benchmark": "import", "rows": rows, "csv_bytes": csv_bytes,
            "ours": {**ours, "rows_per_s": rows / ours["seconds"], "split_rows": imported["rows"]},
            "pyarrow_csv_to_parquet": {**baseline, "rows_per_s": rows / baseline["seconds"]},
            "rows_per_s_over_pyarrow": baseline["seconds"] / ours["seconds"]}


def _write_log(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    cardinalities = rng.integers(10, 2_000_000, 26)
    options = pacsv.WriteOptions(include_header=True)
    with pacsv.CSVWriter(path, _schema(), write_options=options) as writer:
        for start in range(0, rows, CHUNK):
            n = min(CHUNK, rows - start)
            columns = {"label": pa.array((rng.random(n) < 0.25).astype(np.int64))}
            for i in range(1, 14):
                values = rng.zipf(1.5, n).astype(np.int64)
                columns[f"I{i}"] = pa.array(values, mask=rng.random(n) < 0.2)
            for i, cardinality in enumerate(cardinalities, 1):
                ids = np.minimum(rng.zipf(1.2, n), cardinality)
                columns[f"C{i}"] = pa.array(np.char.mod("%08x", ids * 2654435761 % (1 << 32)))
            writer.write_table(pa.table(columns, schema=_schema()))


def _schema() -> pa.Schema:
    return pa.schema([("label", pa.int64()), *((f"I{i}", pa.int64()) for i in range(1, 14)),
                      *((f"C{i}", pa.string()) for i in range(1, 27))])


def _timed(command: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS of ``command``'s process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{command[:4]} exited with status {process.returncode}")
    return {"seconds": time.perf_counter() - started, "peak_rss_bytes": usage.ru_maxrss * 1024}
