"""Run a function on every rank of a real gloo process group (one process per rank)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.trainer.distributed import DistributedContext, shutdown
from neorec.trainer.run.warmup import compile_kernels


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in a gloo
    group on a loopback port; returns each rank's result (``torch.save``-able), rank order."""
    compile_kernels()  # the ranks load Numba's cache rather than compile at the same time
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world_size, _free_port(), tmp, fn, args), nprocs=world_size, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _rank_main(rank: int, world_size: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        shutdown(DistributedContext(rank, world_size, world_size, rank))  # as a trainer leaves: no abort at exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
