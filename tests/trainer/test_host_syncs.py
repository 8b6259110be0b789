"""No host synchronisation in the steady-state step of the torch-ops path (the code a GPU
runs), counted on the CPU: what a run of 2N steps makes beyond a run of N steps is what the
steps in between make (setup, evaluation, the final log line and checkpoint are the same in
both); each remaining one is named below with its reason. Logging intervals are longer than
the runs."""

from __future__ import annotations

import collections

import pytest

from neorec.ingest.schema import Dataset
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import DistributedContext
from neorec.trainer.run.train import train
from tests.trainer.spawn import run_ranks
from tests.trainer.syncs import SyncCounter

STEPS = 3

# What every step still reads on the host, each for a reason:
STEP_SYNCS = {
    # train.bounds_check = "fatal" (the default) refuses a batch with an id outside its
    # table before any update: the lookup's count of them, read before the update (on a
    # GPU, after an event that marks the count's copy, made early in the forward, so the
    # host waits for the forward's first kernels at most); "none" drops it
    ("scalar read", "trainer/embedding/fused.py refuse_if_bad"): 1,
    # KeyedJaggedTensor checks its invariants where it is made (lengths >= 0 adding up to
    # the ids): from the host arrays (no device then); its copy on the run's device keeps
    # the checked lengths (not read there)
    ("tolist", "trainer/batch.py __post_init__"): 1,
}

# What a sharded step still reads on the host, each for a reason:
SHARDED_STEP_SYNCS = {
    # the KeyedJaggedTensor invariants (as above), also of the ids received from the ranks;
    # the bounds check is the routing's, below
    ("tolist", "trainer/batch.py __post_init__"): 2,
    # how many ids this rank sends to each: the send splits of the ids' all-to-all
    ("tolist", "trainer/sharding/input_dist.py prepare"): 1,
    # how many ids each rank sends here (the receive splits, to size the buffer), read with
    # every rank's invalid-batch flag
    ("tolist", "trainer/sharding/input_dist.py send_values"): 1,
    # how many of the batch's ids the sharded tables look up (the size of the routed ids)
    ("scalar read", "trainer/sharding/input_dist.py _concat_ranges"): 1,
    # whether an id is outside its table: the error naming it is made on the host (and
    # flagged to the other ranks before the ids' all-to-all, so none waits in it)
    ("scalar read", "trainer/sharding/input_dist.py _route_torch"): 1,
}


def _config(dataset: Dataset, run_dir, steps: int, sharded: bool) -> TrainConfig:
    return TrainConfig.from_dict({
        "data": {"path": str(dataset.root)},
        "model": {"max_table_rows": 300, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
        "train": {"batch_size": 64, "eval_batch_size": 1000, "log_every": 1000, "max_steps": steps,
                  "background_batches": 0, "kernels": "torch", "device": "cpu", "threads": 1},
        "sharding": {"tables": {"t_C1": "row_wise", "t_C2": "column_wise", "t_C3": "table_wise",
                                "t_C4": "data_parallel"}} if sharded else {},
        "run": {"dir": str(run_dir)},
    })


def _syncs_per_run(rank: int, world: int, dataset: Dataset, root) -> list[collections.Counter]:
    context = DistributedContext(rank, world, world, rank)
    found = []
    for steps in (STEPS, 2 * STEPS):
        config = _config(dataset, root / f"run{steps}", steps, sharded=world > 1)
        with SyncCounter() as syncs:
            summary = train(config, context=context)
        assert summary["steps"] == steps
        found.append(syncs.found)
    return found


def _steady_state(found: list[collections.Counter]) -> dict:
    """Per site, the syncs the extra steps made, per step."""
    short, long = found
    return {site: (long[site] - short[site]) / STEPS for site in long | short if long[site] != short[site]}


def test_a_single_process_step_never_waits_for_the_device(criteo_dataset, tmp_path):
    found = _syncs_per_run(0, 1, criteo_dataset, tmp_path)
    assert found[0], "the counter saw nothing: it counts the syncs outside the steps (setup, eval, logging)"
    assert _steady_state(found) == STEP_SYNCS


@pytest.mark.slow
def test_a_sharded_step_reads_only_its_all_to_all_sizes(criteo_dataset, tmp_path):
    for rank, found in enumerate(run_ranks(_syncs_per_run, 2, criteo_dataset, tmp_path)):
        per_step = _steady_state(found)
        assert per_step == SHARDED_STEP_SYNCS, rank
