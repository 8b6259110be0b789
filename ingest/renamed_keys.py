"""Config keys still read under their old names: a table of renames (``{"train.prefetch":
"train.background_batches"}``) applied to a TOML table before its sections are built
(:func:`neorec.ingest.sections.build_section`), so that a config file, or the config a
checkpoint saved, written before a key was renamed still loads."""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

log = logging.getLogger(__name__)


def read_renamed(obj: Any, renamed: Mapping[str, str], error: type[Exception]) -> Any:
    """``obj`` (a TOML table; not changed) with the value of every old key of ``renamed``
    that it holds moved to that key's new name, each with one warning naming both keys.
    Both names of one key at once raise ``error``. Keys are dotted paths from the top
    (``section.key``); a table that is not one is left as it is, for the section's own
    checks to name."""
    if not isinstance(obj, dict) or not any(_holds(obj, old) for old in renamed):
        return obj
    out = copy.deepcopy(obj)
    for old, new in renamed.items():
        if not _holds(out, old):
            continue
        *old_tables, old_key = old.split(".")
        *new_tables, new_key = new.split(".")
        target = _table(out, new_tables, create=True)
        if target is None:
            continue
        if new_key in target:
            raise error(f"{old} and {new}: the same key under its old and its new name; give only {new}")
        target[new_key] = _table(out, old_tables).pop(old_key)
        log.warning("config key %s is now called %s: read as %s (rename it in the config)", old, new, new)
    return out


def _holds(obj: dict[str, Any], dotted: str) -> bool:
    *tables, key = dotted.split(".")
    table = _table(obj, tables)
    return table is not None and key in table


def _table(obj: dict[str, Any], path: list[str], create: bool = False) -> dict[str, Any] | None:
    """The table at ``path`` in ``obj`` (made empty where missing when ``create``); None when
    it is missing or something else than a table."""
    for name in path:
        if name not in obj and create:
            obj[name] = {}
        obj = obj.get(name)
        if not isinstance(obj, dict):
            return None
    return obj
