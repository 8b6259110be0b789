"""neorec: train deep learning recommendation models with disaggregated ingestion, fused
sharded embeddings and a tiered embedding store.

The subpackages are ``neorec.ingest``, ``neorec.trainer``, ``neorec.embedding_store``,
``neorec.orchestration``, ``neorec.protos`` and ``neorec.common``. In a source checkout
they are the repository's top-level folders, beside this one; an installed wheel holds
them inside this package.
"""

from __future__ import annotations

from pathlib import Path as _Path

_HERE = _Path(__file__).resolve().parent
_CHECKOUT = _HERE.parent
if not (_HERE / "trainer").is_dir() and (_CHECKOUT / "trainer" / "__init__.py").is_file() \
        and (_CHECKOUT / "pyproject.toml").is_file():
    __path__.append(str(_CHECKOUT))  # a source checkout: the subpackages are its top-level folders

from neorec.common.wait_policy import prefer_short_waits as _prefer_short_waits  # noqa: E402

_prefer_short_waits()  # before torch loads its OpenMP runtime (see neorec.common.wait_policy)
