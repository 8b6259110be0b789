"""The train loop's collectives on a real gloo group."""

import numpy as np

from tests.trainer.spawn import run_ranks
from neorec.trainer.distributed import DistributedContext, check_same_steps, gather_arrays, global_sum


def collectives(rank: int, world: int) -> dict:
    context = DistributedContext(rank, world, world, rank)
    found = {"sum": global_sum(context, [rank + 0.5, 1.0]),
             "gathered": gather_arrays(context, np.arange(rank + 1, dtype=np.float64) + 10 * rank)}
    check_same_steps(context, 5, "train")
    try:
        check_same_steps(context, 5 + rank, "train")
    except RuntimeError as err:
        found["error"] = str(err)
    return found


def test_sums_gathers_and_step_count_check():
    results = run_ranks(collectives, 2)
    for found in results:
        assert found["sum"] == [2.0, 2.0]
        assert found["gathered"].tolist() == [0.0, 10.0, 11.0]
        assert "ranks plan different numbers of train steps: [5, 6]" in found["error"]
