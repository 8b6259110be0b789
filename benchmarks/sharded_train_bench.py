"""Sharded training overhead: aggregate QPS of ``neorec train --nproc N`` (tables sharded by
the planner, MLPs data parallel, gloo) beside the single-process run, same data, same global batch,
alternating runs so that machine drift hits both alike."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate

CONFIG = """
[data]
path = "{data}"
[model]
embedding_dim = 16
max_table_rows = 200000
[train]
batch_size = {batch}
eval_batch_size = 4096
max_steps = {steps}
epochs = {epochs}
log_every = 1000
[sharding]
comm_precision = {precision}
[checkpoint]
final = false
[run]
dir = "{run}"
"""


GLOBAL_BATCHES = {1024: 800, 4096: 200}
"""Global batch size: training steps per run (several epochs of the data: long enough that
a run's first steps and its start weigh little against the steady state)."""


def run(quick: bool = False, nproc: int = 2) -> dict[str, Any]:
    rows, rounds, scale = (30_000, 1, 10) if quick else (300_000, 3, 1)
    results: dict[str, Any] = {
        "benchmark": "train --nproc",
        "model": "DLRM criteo profile, 26 tables x dim 16 (<= 200k rows), tables sharded by the planner",
        "nproc": nproc,
        "global_batches": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        generate(SynthSpec(rows=rows, eval_fraction=0.02), Path(tmp) / "data")
        for global_batch, steps in GLOBAL_BATCHES.items():
            steps = max(steps // scale, 2)
            qps: dict[str, list[float]] = {"single": [], "sharded": []}
            for _ in range(rounds):
                for name, procs in (("single", 1), ("sharded", nproc)):
                    qps[name].append(_train_qps(Path(tmp), procs, global_batch // procs, steps))
            single, sharded = statistics.median(qps["single"]), statistics.median(qps["sharded"])
            results["global_batches"][str(global_batch)] = {
                "steps": steps, "single_process_qps": single, "sharded_qps": sharded, "runs": qps,
                "ratio": sharded / single, "overhead": 1 - sharded / single,
            }
        results["comm_precision"] = _precision_runs(Path(tmp), nproc, 4096 // nproc, max(300 // scale, 2))
    return results


def _precision_runs(tmp: Path, nproc: int, batch: int, steps: int) -> dict[str, Any]:
    """The same sharded run with float32 and with fp16/bf16 communication: QPS and eval AUC."""
    out: dict[str, Any] = {}
    for name, precision in (("fp32", "{}"), ("fp16", '{ forward = "fp16", backward = "fp16" }'),
                            ("bf16", '{ forward = "bf16", backward = "bf16" }')):
        summary = _train(tmp, nproc, batch, steps, precision)
        out[name] = {"qps": summary["train_qps"], "eval_auc": summary["eval_auc"]}
    for name in ("fp16", "bf16"):
        out[name]["auc_minus_fp32"] = out[name]["eval_auc"] - out["fp32"]["eval_auc"]
        out[name]["qps_over_fp32"] = out[name]["qps"] / out["fp32"]["qps"]
    return out


def _train_qps(tmp: Path, nproc: int, batch: int, steps: int) -> float:
    """QPS of ``steps`` steps, over as many epochs of the data as they need."""
    epochs = -(-steps * batch * nproc // Dataset.load(tmp / "data").rows["train"])
    return float(_train(tmp, nproc, batch, steps, epochs=epochs)["train_qps"])


def _train(tmp: Path, nproc: int, batch: int, steps: int, precision: str = "{}", epochs: int = 1) -> dict[str, Any]:
    run_dir = tmp / f"run-{nproc}"
    config = tmp / f"bench-{nproc}.toml"
    config.write_text(CONFIG.format(data=tmp / "data", batch=batch, steps=steps, epochs=epochs, run=run_dir,
                                    precision=precision))
    command = [sys.executable, "-m", "neorec.orchestration.cli", "train", str(config), "--nproc", str(nproc), "--overwrite"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    return json.loads((run_dir / "summary.json").read_text())
