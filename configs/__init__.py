"""The configs neorec ships: ``demo.toml`` (the demo's DLRM, which the benchmarks train too)
and ``job.toml`` (a whole job for ``neorec launch``). In a source checkout they are the
repository's ``configs/`` folder; an installed wheel holds them inside the package, where
:func:`shipped` finds them (``neorec.configs``)."""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent
"""Where the shipped configs lie."""


def shipped(name: str) -> Path:
    """The shipped config ``name`` (``demo.toml``)."""
    return SHIPPED / name
