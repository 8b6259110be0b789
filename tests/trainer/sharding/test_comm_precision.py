"""Reduced-precision communication: the fp16/bf16 codecs round-trip within their precision
and saturate; sums over real gloo ranks agree on every rank and with float32; sharded
training with fp16/bf16 communication stays within tolerance of float32 communication."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from neorec.ingest.schema import Dataset
from tests.trainer.sharding.test_sharded_training import BATCH, STEPS, config_for, run_sharded_steps
from tests.trainer.spawn import run_ranks
from neorec.trainer.config import ConfigError, TrainConfig
from neorec.trainer.sharding.comm_precision import CommPrecision, decode, encode, sum_in

RELATIVE = {"fp16": 5e-3, "bf16": 1e-2}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_codecs_round_trip_within_precision_and_saturate(precision):
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 100
    back = decode(encode(values, precision))
    assert encode(values, precision).element_size() == 2
    assert ((back - values).abs() <= RELATIVE[precision] * values.abs() + 1e-6).all()
    huge = torch.tensor([1e6, -1e6, float("inf"), 3.4e38, float("nan")])
    out = decode(encode(huge, precision))
    largest = torch.finfo(torch.float16 if precision == "fp16" else torch.bfloat16).max
    saturated = torch.tensor([min(1e6, largest), -min(1e6, largest), largest, largest])
    assert torch.allclose(out[:4], saturated, rtol=RELATIVE[precision], atol=0)
    assert torch.isfinite(out[:4]).all() and torch.isnan(out[4])
    assert torch.equal(decode(encode(values, "fp32")), values)


def _sums(rank: int, world: int) -> dict:
    tensor = torch.randn(10_001, generator=torch.Generator().manual_seed(rank))
    exact = tensor.clone()
    dist.all_reduce(exact)
    return {p: sum_in(tensor, p) for p in ("fp16", "bf16")} | {"exact": exact}


@pytest.mark.parametrize("world", [2, 4])
def test_reduced_precision_sums_agree_on_every_rank(world):
    results = run_ranks(_sums, world)
    for precision in ("fp16", "bf16"):
        assert all(torch.equal(r[precision], results[0][precision]) for r in results)
        exact = results[0]["exact"]
        assert ((results[0][precision] - exact).abs() <= 3 * RELATIVE[precision] * world * (exact.abs() + 1)).all()


def _train(rank: int, world: int, path: str, precision: dict) -> dict:
    dataset = Dataset.load(path)
    config = TrainConfig.from_dict({**config_for(path, world).to_dict(),
                                    "sharding": {**config_for(path, world).sharding.__dict__,
                                                 "comm_precision": precision}})
    dlrm, _, predictions = run_sharded_steps(rank, world, dataset, config)
    return {"predictions": predictions, "top": dlrm.top.state_dict()}


@pytest.mark.parametrize("precision", [{"forward": "fp16", "backward": "bf16"}, {"forward": "bf16", "backward": "fp16"}])
def test_sharded_training_with_reduced_precision_stays_close_to_fp32(criteo_dataset, precision):
    path = str(criteo_dataset.root)
    full = run_ranks(_train, 2, path, {})
    reduced = run_ranks(_train, 2, path, precision)
    assert STEPS == reduced[0]["predictions"].shape[0] and BATCH == reduced[0]["predictions"].shape[1]
    for a, b in zip(full, reduced):
        # before any update only the forward's rounding differs; after, updates of sparse
        # Adagrad (lr 0.1) from rounded gradients let the runs drift apart a little
        assert torch.allclose(a["predictions"][0], b["predictions"][0], rtol=1e-2, atol=1e-2)
        assert torch.allclose(a["predictions"], b["predictions"], atol=0.15)
        assert not torch.equal(a["predictions"][1:], b["predictions"][1:])  # it really went reduced
        for key in a["top"]:
            # Adam moves a weight by at most about its learning rate (1e-3) a step, whatever the gradient
            assert (a["top"][key] - b["top"][key]).abs().max() <= STEPS * 1e-3 * 1.5, key


def test_bad_precisions_are_named():
    with pytest.raises(ConfigError, match="sharding.comm_precision"):
        TrainConfig.from_dict({"sharding": {"comm_precision": {"forward": "fp8"}}})
    with pytest.raises(ConfigError, match="sharding.comm_precision"):
        TrainConfig.from_dict({"sharding": {"comm_precision": {"sideways": "fp16"}}})
    assert CommPrecision() == TrainConfig().sharding.precision()
