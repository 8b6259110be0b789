"""A sharded, data-parallel DLRM trained by 2 and 4 ranks against the single-process DLRM
on the same global batches: same predictions and weights (to float rounding: the MLP
gradients are summed over ranks in a different order), bit-identical run to run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from neorec.ingest.reader import InProcessReader, ReaderConfig
from neorec.ingest.schema import Dataset
from tests.trainer.reference import concat_kjts
from tests.trainer.spawn import run_ranks
from neorec.trainer.batch import Batch
from neorec.trainer.run.build import build_model, decode_options, dense_optimizer
from neorec.trainer.config import TrainConfig
from neorec.trainer import distributed
from neorec.trainer.distributed import DenseGradientSum, DistributedContext
from neorec.trainer.model import DLRM
from neorec.trainer.planner.from_config import plan_for_config
from neorec.trainer.run.step import train_step

BATCH = 64
STEPS = 4


def config_for(path: str, world: int) -> TrainConfig:
    overrides = {"t_C1": "row_wise", "t_C2": "column_wise:2", "t_C3": "data_parallel", "t_C4": "table_wise:1"}
    if world == 4:
        overrides["t_C5"] = "table_row_wise:1"
    return TrainConfig.from_dict({
        "data": {"path": path},
        "model": {"max_table_rows": 5000},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.1, "sparse_eps": 1e-4},
        "train": {"batch_size": BATCH, "seed": 7},
        "sharding": {"group_size": 2, "tables": overrides},
    })


def rank_batches(dataset: Dataset, config: TrainConfig, rank: int, world: int) -> list[Batch]:
    reader = InProcessReader(dataset, "train", decode_options(dataset.schema, config),
                             ReaderConfig(batch_size=BATCH, seed=7, rank=rank, world_size=world))
    try:
        return [Batch.from_host(b) for _, b in zip(range(STEPS), reader.epoch(0))]
    finally:
        reader.close()


def single_process_model(model: DLRM, dataset: Dataset, config: TrainConfig) -> DLRM | None:
    """The single-process equivalent of a sharded ``model``: every table gathered from its
    shards (weights and optimizer state). A collective: every rank calls it; rank 0 gets
    the model, the others ``None``."""
    sharded = model.embeddings
    gathered = {t.name: sharded.gather_table(t.name) for t in sharded.tables}
    steps = sharded.optimizer_steps()
    if dist.get_rank(sharded.group) != 0:
        return None
    single = build_model(dataset, config, table_weights={name: weight for name, (weight, _) in gathered.items()})
    for name, (_, states) in gathered.items():
        for target, state in zip(single.embeddings.table_state(name), states):
            target.copy_(state)
    single.embeddings.optimizer_step.fill_(steps)
    single.bottom.load_state_dict(model.bottom.state_dict())
    single.top.load_state_dict(model.top.state_dict())
    return single


def run_sharded_steps(rank: int, world: int, dataset: Dataset, config: TrainConfig):
    """This rank's sharded DLRM after one step per batch of ``config``'s plan, the plan, and
    its predictions before each step (float ``[steps, batch]``)."""
    plan = plan_for_config(dataset, config, world).plan
    dlrm = build_model(dataset, config, plan)
    optimizer = dense_optimizer(dlrm, config)
    dense_sum = DenseGradientSum(dlrm.dense_parameters(), config.sharding.precision().backward)
    dlrm.embeddings.carry_in_backward(dense_sum)
    context = DistributedContext(rank, world, world, rank)
    predictions = []
    for batch in rank_batches(dataset, config, rank, world):
        with torch.no_grad():
            predictions.append(dlrm.eval()(batch).clone())
        dlrm.train()
        train_step(dlrm, optimizer, batch, context, full_batches=True, dense_sum=dense_sum)
    return dlrm, plan, torch.stack(predictions)


def count_separate_sums(module) -> list[int]:
    """Count the dense gradient sums that ran as collectives of their own (not riding
    with the backward all-to-all)."""
    calls: list[int] = []
    original = module.start_sum
    module.start_sum = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    return calls


def train_sharded(rank: int, world: int, path: str) -> dict:
    dataset = Dataset.load(path)
    config = config_for(path, world)
    separate_sums = count_separate_sums(distributed)
    dlrm, plan, predictions = run_sharded_steps(rank, world, dataset, config)
    single = single_process_model(dlrm, dataset, config)
    return {"predictions": predictions, "plan": plan, "separate_sums": len(separate_sums),
            "state": None if single is None else single.state_dict()}


def train_single(path: str, world: int) -> dict:
    dataset = Dataset.load(path)
    config = config_for(path, world)
    model = build_model(dataset, config)
    optimizer = dense_optimizer(model, config)
    per_rank = [rank_batches(dataset, config, r, world) for r in range(world)]
    predictions = []
    for step in range(STEPS):
        parts = [per_rank[r][step] for r in range(world)]
        batch = Batch(dense=torch.cat([p.dense for p in parts]), sparse=concat_kjts([p.sparse for p in parts]),
                      labels=torch.cat([p.labels for p in parts]), num_valid=world * BATCH)
        with torch.no_grad():
            predictions.append(model.eval()(batch).clone())
        model.train()
        train_step(model, optimizer, batch)
    return {"predictions": torch.stack(predictions), "state": model.state_dict()}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: ~45 s
def test_sharded_training_matches_single_process_and_repeats_exactly(criteo_dataset, world):
    path = str(criteo_dataset.root)
    first = run_ranks(train_sharded, world, path)
    kinds = {t.sharding_type for t in first[0]["plan"].tables}
    # the MLPs' gradients rode with the pooled embeddings' backward all-to-all every step
    assert [r["separate_sums"] for r in first] == [0] * world
    assert {"row_wise", "column_wise", "data_parallel", "table_wise"} <= kinds
    expected = train_single(path, world)
    got_predictions = torch.cat([r["predictions"] for r in first], dim=1)
    # step 0: same weights, so predictions differ only by the MLPs' batch-size-dependent rounding
    torch.testing.assert_close(got_predictions, expected["predictions"], rtol=1e-5, atol=1e-5)
    got_state = first[0]["state"]
    assert got_state.keys() == expected["state"].keys()
    for name, value in expected["state"].items():
        torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=1e-5, msg=name)

    again = run_ranks(train_sharded, world, path)
    assert torch.equal(torch.cat([r["predictions"] for r in again], dim=1), got_predictions)
    for name, value in got_state.items():
        assert torch.equal(again[0]["state"][name], value), f"{name} differs run to run"
