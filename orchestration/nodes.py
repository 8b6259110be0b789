"""Training on several nodes: the ``neorec train`` flags that start this node's share of a
job under torchrun with c10d rendezvous, and the torchrun command they make.

Every node runs ``neorec train CONFIG --nproc R --nnodes N --node-rank I --rdzv HOST:PORT``
with the same config; the nodes meet at ``HOST:PORT`` (the rendezvous store, served by the
node that can bind it, normally the one at ``HOST``), torchrun numbers the ranks, and each
node's ``R`` ranks are its local ranks (``LOCAL_WORLD_SIZE``: the node topology the
planner and hierarchical sharding use). ``--max-restarts K`` lets torchrun's elastic agent
restart the job's workers up to K times after a failure; they resume from the newest
checkpoint (:mod:`neorec.trainer.run.elastic`, which finds the job's rendezvous store at
``NEOREC_JOB_STORE``).

Each rendezvous round's workers meet in a store of their own (torchrun's
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``): in the store the agents share by default, the
workers of a restarted round would read the addresses the previous round's workers left
there, since agents that restart for a failure and those that restart for the group
re-forming number their attempts differently.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from neorec.common.addresses import check_address
from neorec.orchestration.cli_args import at_least


@dataclass(frozen=True)
class Nodes:
    """This node's place in the job: ``count`` nodes meeting at ``rendezvous``
    (``HOST:PORT``; empty: one node, torchrun's standalone rendezvous), this one being
    ``rank``; the job ``run_id`` (the same on every node) and the elastic agent's
    ``max_restarts``."""

    count: int = 1
    rank: int = 0
    rendezvous: str = ""
    run_id: str = "neorec"
    max_restarts: int = 0

    @property
    def standalone(self) -> bool:
        return not self.rendezvous

    def torchrun_flags(self) -> list[str]:
        """torchrun's flags for the node count, rendezvous and restarts."""
        flags = [f"--max-restarts={self.max_restarts}"]
        if self.standalone:
            return ["--standalone", *flags]
        return [f"--nnodes={self.count}", f"--node-rank={self.rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rendezvous}", f"--rdzv-id={self.run_id}", *flags]

    def worker_environment(self) -> dict[str, str]:
        """What torchrun and its workers need in the environment beyond the flags."""
        from neorec.trainer.run.elastic import JOB_STORE

        if self.standalone:
            return {}
        return {JOB_STORE: self.rendezvous, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


ONE_NODE = Nodes()


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=at_least(1), default=1,
                        help="nodes in the job (each runs this command with its --node-rank; needs --rdzv)")
    parser.add_argument("--node-rank", type=at_least(0), default=0, help="this node's number, 0 to --nnodes - 1")
    parser.add_argument("--rdzv", metavar="HOST:PORT",
                        help="where the nodes meet (torchrun's c10d rendezvous; the same on every node)")
    parser.add_argument("--rdzv-id", default="neorec", help="the job's id, the same on every node (default: neorec)")
    parser.add_argument("--max-restarts", type=at_least(0), default=0,
                        help="restarts of the job's workers by torchrun's elastic agent after a failure; restarted "
                             "workers resume from the newest checkpoint")


def nodes_from_args(args: argparse.Namespace) -> Nodes:
    """The :class:`Nodes` the flags describe; ``ValueError`` naming the flag when they do
    not fit together."""
    if args.nnodes > 1 and not args.rdzv:
        raise ValueError(f"--nnodes {args.nnodes}: the nodes need --rdzv HOST:PORT to meet at")
    if args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank}: must be below --nnodes {args.nnodes}")
    if args.rdzv:
        check_address(args.rdzv, "--rdzv")
    if not args.rdzv_id.strip():
        raise ValueError("--rdzv-id: give the job an id, the same on every node (torchrun would draw one a node)")
    nodes = Nodes(args.nnodes, args.node_rank, args.rdzv or "", args.rdzv_id, args.max_restarts)
    if nodes.standalone and nodes.max_restarts:  # one node that restarts: its own rendezvous, known here
        from neorec.orchestration.launch import free_ports

        nodes = replace(nodes, rendezvous=f"127.0.0.1:{free_ports('127.0.0.1', 1)[0]}")
    return nodes


def uses_torchrun(nproc: int, nodes: Nodes) -> bool:
    """Whether ``neorec train`` starts torchrun for this node (rather than train in process)."""
    return nproc > 1 or nodes != ONE_NODE
