"""Sums over ranks on gloo: gloo's all-reduce against one all-to-all of the whole tensor
(each rank adding the copies itself), at several sizes, on ``nproc`` ranks launched by
torchrun and pinned like the trainer's. This measures the size limit
:data:`neorec.trainer.sharding.collectives.WHOLE_TENSOR_ALL_TO_ALL_BYTES`.

Reduced-precision communication (``sharding.comm_precision``), at the same sizes: the
pooled embeddings' all-to-all in fp16/bf16 (encode and decode included) against float32,
and the gradient sum in fp16/bf16 against float32's all-reduce; bytes on the wire and the
round-trip error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from neorec.benchmarks.timing import interleaved_rates
from neorec.orchestration.processes import torchrun_command
from neorec.trainer.run.affinity import pin_rank
from neorec.trainer.sharding.collectives import all_to_all, start_all_to_all_sum
from neorec.trainer.sharding.comm_precision import all_to_all_in, decode, encode, sum_in

SIZES_BYTES = (1 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
"""Bytes of the tensor each rank sums."""


def run(quick: bool = False, nproc: int = 2) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        command = torchrun_command(nproc, "neorec.benchmarks.collectives_bench", [str(out), "quick" if quick else "full"],
                                   log_dir=Path(tmp) / "torchrun")
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
        return json.loads(out.read_text())


def _rank_main(out: Path, quick: bool) -> None:
    pin_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"benchmark": "collectives", "backend": "gloo", "nproc": world, "sizes": {}}
    for size in SIZES_BYTES:
        tensor = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        summed_in_place = torch.zeros_like(tensor)  # as DDP's buckets: no copy; zeros stay finite

        def all_reduce(_: int) -> int:
            dist.all_reduce(summed_in_place)
            return 1

        def all_to_all_sum(_: int) -> int:
            start_all_to_all_sum(tensor).wait()
            return 1

        steps = max(2 if quick else 20, (20 if quick else 200) * (64 << 10) // max(size, 64 << 10))
        rates = interleaved_rates({"all_reduce": all_reduce, "all_to_all_sum": all_to_all_sum},
                                  steps=steps, rounds=3 if quick else 7)
        reduced = tensor.clone()
        dist.all_reduce(reduced)
        results["sizes"][str(size)] = {
            "max_difference_from_all_reduce": float((start_all_to_all_sum(tensor).wait() - reduced).abs().max()),
            "all_reduce_ms": 1e3 / rates["all_reduce"],
            "all_to_all_sum_ms": 1e3 / rates["all_to_all_sum"],
            "all_to_all_bytes_per_rank": world * size,
            "speedup": rates["all_to_all_sum"] / rates["all_reduce"],
        }
        results["sizes"][str(size)]["reduced_precision"] = _reduced(tensor, summed_in_place, steps, quick)
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def _reduced(tensor: torch.Tensor, summed_in_place: torch.Tensor, steps: int, quick: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    sizes = [tensor.numel() // world] * world
    sizes[-1] += tensor.numel() - sum(sizes)
    piece = tensor[: sum(sizes)]

    def exchange(precision: str):
        def run(_: int) -> int:
            all_to_all_in(piece, sizes, sizes, precision) if precision != "fp32" else all_to_all(piece, sizes, sizes)
            return 1
        return run

    def reduce(precision: str):
        def run(_: int) -> int:
            sum_in(tensor, precision) if precision != "fp32" else dist.all_reduce(summed_in_place)
            return 1
        return run

    candidates = {f"all_to_all_{p}": exchange(p) for p in ("fp32", "fp16", "bf16")}
    candidates.update({f"sum_{p}": reduce(p) for p in ("fp32", "fp16", "bf16")})
    rates = interleaved_rates(candidates, steps=steps, rounds=3 if quick else 7)
    out: dict[str, Any] = {}
    for precision in ("fp16", "bf16"):
        back = decode(encode(tensor, precision))
        out[precision] = {
            "wire_bytes_over_fp32": encode(tensor, precision).element_size() / tensor.element_size(),
            "max_relative_round_trip_error": float(((back - tensor).abs() / tensor.abs().clamp(min=1e-30)).max()),
            "all_to_all_speedup": rates[f"all_to_all_{precision}"] / rates["all_to_all_fp32"],
            "sum_speedup_over_fp32_all_reduce": rates[f"sum_{precision}"] / rates["sum_fp32"],
        }
    return out


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), sys.argv[2] == "quick")
