"""Checkpoint costs on the demo model (criteo profile): bytes written per incremental
checkpoint against a full fp32 one, the training stall per checkpoint against a
synchronous full save, QPS while checkpoints are written in the background against QPS
without checkpoints, and the eval AUC after restores from quantized checkpoints against the
run that never stopped. Every run trains the same data in the same order from the same
seed, in this process."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from neorec.configs import shipped
from neorec.ingest.synth import SynthSpec, generate
from neorec.orchestration.config import load_config
from neorec.trainer.checkpoint.layout import complete, read_manifest
from neorec.trainer.run.step import StepReport
from neorec.trainer.run.train import train

ROUNDS = 2
EVERY_STEPS = 400
"""Steps between checkpoints: ~2-3 s of the demo model's training here, longer than a
background write takes, as a production interval (minutes) is."""


class _Stop(Exception):
    """Ends a run after a step, as if the process died there."""


def run(quick: bool = False) -> dict[str, Any]:
    rows = 40_000 if quick else 1_000_000
    every = 20 if quick else EVERY_STEPS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dataset = generate(SynthSpec(rows=rows), root / "data")

        def config(name: str, **checkpoint: Any):
            settings = [f"data.path='{dataset.root}'", f"run.dir='{root / name}'", "train.log_every=1000000"]
            settings += [f"checkpoint.{k}={json.dumps(v)}" for k, v in checkpoint.items()]
            return load_config(shipped("demo.toml"), settings)

        runs: dict[str, list[dict[str, Any]]] = {"plain": [], **{f"incremental-{b}": [] for b in (32, 8, 4)}}
        for round_ in range(ROUNDS):  # interleaved: drift of the machine hits every candidate alike
            for name in runs:
                settings = {"every_steps": 0} if name == "plain" else {"every_steps": every,
                                                                         "bits": int(name.split("-")[1])}
                runs[name].append(train(config(f"{name}-{round_}", final=False, **settings)))
        plain_qps = statistics.median(r["train_qps"] for r in runs["plain"])
        plain = runs["plain"][0]
        steps = plain["steps"]
        results: dict[str, Any] = {"benchmark": "checkpoint", "rows": rows, "steps": steps, "every_steps": every,
                                   "rounds": ROUNDS, "plain": {"qps": plain_qps, "eval_auc": plain["eval_auc"]}}
        sync_full = train(config("sync-full", every_steps=every, mode="full", final=False, **{"async": False}))
        results["sync_full_save_s"] = sync_full["checkpoint_stall_s"] / max(steps // every, 1)
        for bits in (32, 8, 4):
            name = f"incremental-{bits}"
            manifests = [read_manifest(p) for p in complete(root / f"{name}-0" / "checkpoint")]
            full = next(m for m in manifests if m.kind == "full")
            increments = [m for m in manifests if m.kind == "incremental"]
            total_rows = sum(t["rows"] for t in full.tables.values())
            qps = statistics.median(r["train_qps"] for r in runs[name])
            results[name] = {
                "qps": qps,
                "qps_ratio": qps / plain_qps,
                "stall_per_checkpoint_s": statistics.median(r["checkpoint_stall_s"] for r in runs[name])
                / max(steps // every, 1),
                "full_bytes": full.stats["bytes"],
                "increments": [{"step": m.step, "bytes": m.stats["bytes"],
                                "touched_fraction": sum(m.stats["touched"].values()) / total_rows} for m in increments],
            }
        fp32_full = results["incremental-32"]["full_bytes"]
        for bits in (32, 8, 4):
            entry = results[f"incremental-{bits}"]
            sizes = [i["bytes"] for i in entry["increments"]]
            entry["fewer_bytes_than_full_fp32"] = fp32_full / (sum(sizes) / len(sizes)) if sizes else None
            entry["stall_over_sync_full_save"] = entry["stall_per_checkpoint_s"] / results["sync_full_save_s"]
        results["restored_once_4bit"] = _restored(config, "restore-4", bits=4, every=every, stops=1, steps=steps)
        results["restored_five_times_8bit"] = _restored(config, "restore-8", bits=8, every=every, stops=5,
                                                        steps=steps)
        for key in ("restored_once_4bit", "restored_five_times_8bit"):
            results[key]["auc_gap"] = plain["eval_auc"] - results[key]["eval_auc"]
    return results


def _restored(config, name: str, bits: int, every: int, stops: int, steps: int) -> dict[str, Any]:
    """Train, stopping ``stops`` times (each time right after a checkpoint) and resuming from
    the ``bits``-bit checkpoint; the final eval AUC."""
    spacing = max(steps // (stops + 1) // every, 1) * every
    settings = {"every_steps": spacing, "bits": bits, "final": False, "async": False}
    summary: dict[str, Any] = {}
    for stop in range(stops + 1):
        stop_at = (stop + 1) * spacing + 1 if stop < stops else None

        def progress(report: StepReport, stop_at: int | None = stop_at) -> None:
            if stop_at is not None and report.global_step == stop_at:
                raise _Stop()

        try:
            summary = train(config(name, **settings), progress=progress, resume=stop > 0)
        except _Stop:
            continue
    return {"eval_auc": summary["eval_auc"], "restores": stops, "checkpoint_every": spacing}
