"""Where a training step's time goes on a device: the demo model trained for a few steps
under ``torch.profiler``, with its kernel launches per step and the operators and kernels
that take the most device time.

    python scripts/step_profile.py [--device cuda] [--batch-size 512] [--steps 40] [--rows 300000]

It generates a criteo-profile dataset of ``--rows`` rows, trains once to warm up (kernel
loading, allocator), then trains ``--steps`` steps with the profiler on and prints: the
run's samples/s, the kernel launches per step (setup and the final evaluation included),
the device time of all kernels, and the top operators by device time (on the CPU, by
CPU time). ``--trace FILE`` writes a Chrome trace of the profiled run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from neorec.ingest.synth import SynthSpec, generate
from neorec.orchestration.config import load_config
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.train import train

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"

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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        data = generate(SynthSpec(rows=args.rows, seed=1), f"{workdir}/data")

        def run(name: str) -> dict:
            return train(demo_config(str(data.root), f"{workdir}/{name}", args.device, args.batch_size, args.steps))

        run("warm")
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


if __name__ == "__main__":
    main()
