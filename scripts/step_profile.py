"""Where a training step's time goes on a device: the demo model trained for a few steps
under ``torch.profiler``, with its kernel launches per step and the operators and kernels
that take the most device time.

    python scripts/step_profile.py [--device cuda] [--batch-size 512] [--steps 40] [--rows 300000]

It generates a criteo-profile dataset of ``--rows`` rows, trains once to warm up (kernel
loading, allocator), then trains ``--steps`` steps with the profiler on and prints: the
run's samples/s, the kernel launches per step (setup and the final evaluation included),
the device time of all kernels, and the top operators by device time (on the CPU, by
CPU time). ``--trace FILE`` writes a Chrome trace of the profiled run.

``--plain-steps N`` first trains N steps with the profiler off and prints their samples/s
(the throughput a run sees). ``--syncs`` (CUDA) counts where a step makes the host wait
for the device: torch's sync debug mode warns at every synchronising call, over runs of
``--steps`` and twice as many steps; the difference per step is what steady-state steps
make, printed by site (the innermost frames of this project).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from neorec.configs import shipped
from neorec.ingest.synth import SynthSpec, generate
from neorec.orchestration.config import load_config
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.train import train

DEMO = shipped("demo.toml")

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
"""The runtime and driver calls that launch a kernel, as the profiler names them."""


def demo_config(data_path: str, run_dir: str, device: str, batch_size: int, steps: int) -> TrainConfig:
    """configs/demo.toml for ``steps`` steps of ``batch_size`` on ``device``, no log lines."""
    return load_config(DEMO, [f"data.path='{data_path}'", f"run.dir='{run_dir}'", f"train.device='{device}'",
                              f"train.batch_size={batch_size}", f"train.max_steps={steps}",
                              "train.log_every=1000000"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--trace", help="write a Chrome trace of the profiled run here")
    parser.add_argument("--plain-steps", type=int, default=0, help="first train this many steps unprofiled")
    parser.add_argument("--syncs", action="store_true", help="count the host's waits for the device per step")
    args = parser.parse_args()
    if args.syncs and not args.device.startswith("cuda"):
        parser.error("--syncs needs a CUDA device")
    with tempfile.TemporaryDirectory() as workdir:
        data = generate(SynthSpec(rows=args.rows, seed=1), f"{workdir}/data")

        def run(name: str, steps: int = args.steps) -> dict:
            return train(demo_config(str(data.root), f"{workdir}/{name}", args.device, args.batch_size, steps))

        run("warm")
        if args.plain_steps:
            plain = run("plain", args.plain_steps)
            print(f"{plain['steps']} steps of {args.batch_size} on {args.device} (not profiled): "
                  f"{plain['train_qps']:,.0f} samples/s")
        if args.syncs:
            print_syncs(run, args.steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as profiler:
            summary = run("profiled")
    events = profiler.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    device_ms = sum(e.self_device_time_total for e in events if e.device_type.name != "CPU") / 1e3
    print(f"{summary['steps']} steps of {args.batch_size} on {args.device} (profiled): {summary['train_qps']:,.0f} "
          f"samples/s; {launches} kernel launches ({launches / max(summary['steps'], 1):.0f} a step, setup and "
          f"evaluation included); kernels' device time {device_ms:.1f} ms")
    sort_by = "self_device_time_total" if device_ms else "self_cpu_time_total"
    print(events.table(sort_by=sort_by, row_limit=args.top, max_name_column_width=60))
    if args.trace:
        profiler.export_chrome_trace(args.trace)


def print_syncs(run: Callable[..., dict], steps: int) -> None:
    """Per site, the synchronising calls a steady-state step makes: those of a run of
    ``2 * steps`` steps beyond a run of ``steps`` (setup, evaluation and the final
    checkpoint are the same in both), over ``steps``."""
    project = str(Path(__file__).resolve().parent.parent)
    found: collections.Counter = collections.Counter()

    def record(*_args, **_kwargs) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(project) and "/.venv/" not in f.filename and f.filename != __file__]
        found[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1]) or "?"] += 1

    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for n in (steps, 2 * steps):
                found.clear()
                run(f"syncs{n}", n)
                counts.append(collections.Counter(found))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    short, long = counts
    per_step = {site: (long[site] - short[site]) / steps for site in long | short if long[site] != short[site]}
    print(f"host waits for the device, per step ({steps} and {2 * steps} steps): {sum(per_step.values()):.2f}")
    for site, count in sorted(per_step.items(), key=lambda item: -item[1]):
        print(f"  {count:5.2f}  {site}")


if __name__ == "__main__":
    main()
