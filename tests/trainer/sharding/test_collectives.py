"""Sums and gathers over ranks, on a real gloo group: the one-all-to-all path for small
tensors and the all-reduce / all-gather path for large ones give the same results."""

import pytest
import torch

from tests.trainer.spawn import run_ranks
from neorec.trainer.sharding.collectives import WHOLE_TENSOR_ALL_TO_ALL_BYTES, all_gather, start_sum

SMALL = (3, 5)
LARGE = (WHOLE_TENSOR_ALL_TO_ALL_BYTES // 4 // 2 + 1,)  # over the limit even for 2 ranks


def rank_tensor(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def sums_and_gathers(rank: int, world: int) -> dict[str, torch.Tensor]:
    found = {}
    for name, shape in (("small", SMALL), ("large", LARGE)):
        mine = rank_tensor(rank, shape)
        found[f"sum-{name}"] = start_sum(mine.clone()).wait()
        found[f"gather-{name}"] = all_gather(mine)
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_sum_and_gather_over_ranks(world):
    per_rank = run_ranks(sums_and_gathers, world)
    for name, shape in (("small", SMALL), ("large", LARGE)):
        tensors = [rank_tensor(r, shape) for r in range(world)]
        expected_sum = torch.stack(tensors).sum(0)
        for found in per_rank:
            assert found[f"sum-{name}"].shape == shape
            if name == "small":  # one all-to-all, then the same additions as this local sum
                assert torch.equal(found[f"sum-{name}"], expected_sum)
            torch.testing.assert_close(found[f"sum-{name}"], expected_sum, rtol=1e-6, atol=1e-6)
            assert torch.equal(found[f"sum-{name}"], per_rank[0][f"sum-{name}"])  # every rank alike
            assert torch.equal(found[f"gather-{name}"], torch.cat(tensors))
