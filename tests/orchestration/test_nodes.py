"""The ``neorec train`` node flags and the torchrun command they make."""

import argparse

import pytest

from neorec.orchestration.nodes import ONE_NODE, Nodes, add_node_arguments, nodes_from_args, uses_torchrun
from neorec.orchestration.processes import torchrun_command


def _nodes(*flags: str) -> Nodes:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    return nodes_from_args(parser.parse_args(list(flags)))


def test_one_node_is_torchruns_standalone_rendezvous():
    assert _nodes() == ONE_NODE and not uses_torchrun(1, ONE_NODE) and uses_torchrun(2, ONE_NODE)
    command = torchrun_command(2, "neorec.orchestration.cli", ["train", "c.toml"])
    assert command[command.index("--standalone") + 1 :] == ["--max-restarts=0", "--nproc-per-node=2", "--module",
                                                           "neorec.orchestration.cli", "train", "c.toml"]
    assert ONE_NODE.worker_environment() == {}


def test_a_node_of_several_meets_the_others_at_the_rendezvous():
    nodes = _nodes("--nnodes", "2", "--node-rank", "1", "--rdzv", "10.0.0.1:29500", "--rdzv-id", "job7",
                   "--max-restarts", "3")
    assert uses_torchrun(1, nodes)
    assert nodes.torchrun_flags() == ["--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                                      "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-id=job7", "--max-restarts=3"]
    assert nodes.worker_environment() == {"NEOREC_JOB_STORE": "10.0.0.1:29500",
                                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_one_node_that_restarts_gets_a_rendezvous_of_its_own():
    nodes = _nodes("--max-restarts", "1")
    assert nodes.count == 1 and nodes.rendezvous.startswith("127.0.0.1:") and uses_torchrun(1, nodes)
    assert nodes.worker_environment()["NEOREC_JOB_STORE"] == nodes.rendezvous


@pytest.mark.parametrize("flags, message", [
    (("--nnodes", "2"), "--nnodes 2: the nodes need --rdzv HOST:PORT"),
    (("--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1"), "--node-rank 2: must be below --nnodes 2"),
    (("--nnodes", "2", "--rdzv", "nohost"), "--rdzv .nohost. is not host:port"),
])
def test_flags_that_do_not_fit_together_are_named(flags, message):
    with pytest.raises(ValueError, match=message):
        _nodes(*flags)
