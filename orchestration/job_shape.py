"""Nodes of one job started with different ``--nnodes`` or ``--nproc``, found and refused
on every node.

torchrun's c10d rendezvous takes each node's own count: a node told of more nodes than
the others are waits for one that never comes, and one told of fewer may run a job of
another shape than the one it checked and planned (as does a node of another
``--nproc``: the plan places tables by node). While torchrun runs, each node's ``neorec
train`` writes its shape into the job's rendezvous store (keys under
``neorec/shape/RUN_ID/``): the first shape written is the job's; a node whose shape
differs records the difference there, and every node that sees it stops its torchrun and
names both shapes. Once every node has found its shape the job's, the nodes stop looking.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

import torch.distributed as dist

from neorec.common.stores import host_and_port, store_client
from neorec.orchestration.nodes import Nodes

POLL_S = 0.5
"""How often a node looks for the store, and then for a difference another node found."""
TELL_S = 4 * POLL_S
"""How long a node that knows of a difference waits before it stops its torchrun (which may
serve the store): the other nodes read the difference in the meantime."""


class JobShapeCheck:
    """Compares this node's shape (``nodes.count`` nodes of ``nproc`` ranks) with the job's in
    the background, from :meth:`start` until :meth:`stop`; ``on_mismatch(message)`` is
    called once if they differ."""

    def __init__(self, nodes: Nodes, nproc: int, on_mismatch: Callable[[str], None]) -> None:
        self.nodes = nodes
        self.shape = f"--nnodes {nodes.count} --nproc {nproc}"
        self.on_mismatch = on_mismatch
        self.mismatch: str | None = None
        self._agreed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-shape", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def looking(self) -> bool:
        """Whether the check still runs (it ends when the nodes agree or differ)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        store = None
        while not self._stopped.wait(POLL_S):
            try:
                store = store or self._connect()
                outcome = None if store is None else self._compare(store)
            except (RuntimeError, dist.DistError):  # the store not up yet, or gone with the job
                store = None
                continue
            if outcome == "agreed":
                return
            if outcome is not None:
                self.mismatch = outcome
                self._stopped.wait(TELL_S)
                self.on_mismatch(outcome)
                return

    def _connect(self) -> dist.Store | None:
        """The job's store under this check's prefix; None while nothing listens there yet
        (probed by a plain connection: a store client that cannot connect logs its retries)."""
        try:
            socket.create_connection(host_and_port(self.nodes.rendezvous), timeout=POLL_S).close()
        except OSError:
            return None
        return dist.PrefixStore(f"neorec/shape/{self.nodes.run_id}/", store_client(self.nodes.rendezvous, 2 * POLL_S))

    def _compare(self, store: dist.Store) -> str | None:
        """The difference known (found by this node or another), ``"agreed"`` once every
        node has found its shape the job's, or None (look again)."""
        jobs = store.compare_set("shape", "", self.shape).decode()  # the first node's
        if jobs != self.shape:
            message = (f"the nodes of job {self.nodes.run_id!r} were started differently: {jobs}, and "
                       f"{self.shape} (node {self.nodes.rank}); give every node the same --nnodes and --nproc")
            return store.compare_set("mismatch", "", message).decode()  # the first found: every node tells it
        if store.check(["mismatch"]):
            return store.get("mismatch").decode()
        agreed = store.add("agreed", 0 if self._agreed else 1)
        self._agreed = True
        return "agreed" if agreed >= self.nodes.count else None
