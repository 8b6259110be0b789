"""The train loop's collectives on a real gloo group."""

import numpy as np
import pytest
import torch

from tests.trainer.spawn import run_ranks
from neorec.trainer.distributed import DenseGradientSum, DistributedContext, check_same_steps, gather_arrays, global_sum


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


def dense_sum_steps(rank: int, world: int, precision: str) -> dict:
    """Two backward passes of a rank-specific loss through a small MLP whose parameters
    start different on every rank."""
    torch.manual_seed(rank)  # rank 0's parameters must win
    layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    initial = [p.detach().clone() for p in layers.parameters()]
    dense_sum = DenseGradientSum(list(layers.parameters()), precision)
    after_broadcast = [p.detach().clone() for p in layers.parameters()]
    inputs = torch.arange(12, dtype=torch.float32).view(4, 3) / 10 * (rank + 1)
    local, summed = [], []
    for _ in range(2):
        dense_sum.zero()
        layers(inputs).square().sum().backward()
        local.append([p.grad.clone() for p in layers.parameters()])
        dense_sum.sum()
        summed.append([p.grad.clone() for p in layers.parameters()])
    return {"initial": initial, "after_broadcast": after_broadcast, "local": local, "summed": summed}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dense_gradient_sum_starts_from_rank_0_and_sums_every_backward(precision):
    results = run_ranks(dense_sum_steps, 2, precision)
    for found in results:
        for got, want in zip(found["after_broadcast"], results[0]["initial"]):
            assert torch.equal(got, want)
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["initial"], results[1]["initial"]))
    for step in range(2):
        # each backward starts from zero: the local gradients are this step's alone, alike in both steps
        for first, again in zip(results[0]["local"][0], results[0]["local"][step]):
            assert torch.equal(first, again)
        expected = [a + b for a, b in zip(results[0]["local"][step], results[1]["local"][step])]
        for got, want in zip(results[0]["summed"][step], expected):
            if precision == "fp32":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
        for mine, theirs in zip(results[0]["summed"][step], results[1]["summed"][step]):
            assert torch.equal(mine, theirs)  # bit-identical on every rank
