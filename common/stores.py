"""A client of a ``torch.distributed`` TCP store named by ``host:port`` (the job's
rendezvous store, which torchrun's c10d agents serve)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def host_and_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of a checked ``host:port`` address, an IPv6 host without its brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def store_client(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``address``; it waits up to ``timeout_s`` to connect and for
    each reply."""
    host, port = host_and_port(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
