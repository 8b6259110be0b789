"""Checking a service address the user gave (``host:port``)."""

from __future__ import annotations

import re

from neorec.common.errors import UserError


class AddressError(UserError, ValueError):
    """An address that does not read ``host:port`` with a port in [1, 65535]."""

    lasting = True


HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]")
"""A host name, an IPv4 address, or an IPv6 address in brackets (a zone after ``%``)."""


def check_address(address: str, what: str = "address") -> str:
    """``address`` if it reads ``host:port`` (an IPv6 host bracketed, ``[::1]:50051``) with
    a port in [1, 65535]; else :class:`AddressError` naming it as ``what``."""
    host, _, port = address.rpartition(":")
    if not HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) <= 65535:
        raise AddressError(f"{what} {address!r} is not host:port (a port in 1-65535; an IPv6 host in brackets)")
    return address
