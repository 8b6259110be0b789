"""Load a training configuration from TOML with ``key=value`` overrides."""

from __future__ import annotations

import datetime
import re
import tomllib
from pathlib import Path
from typing import Any, Sequence

from neorec.common.errors import ConfigError
from neorec.configs import shipped
from neorec.trainer.config import TrainConfig


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read ``path``, apply ``section.key=value`` overrides (values in TOML syntax; a bare
    word is a string) and validate. Errors name the file or override and the key."""
    path = Path(path)
    raw = read_toml(path, "config file")
    for override in overrides:
        apply_override(raw, override)
    try:
        return TrainConfig.from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"{_source(str(err), path, overrides)}: {err}") from None


def _source(message: str, path: Path, overrides: Sequence[str]) -> str:
    """Where the key a config error names (``KEY: …``, ``KEY[i]: …`` or ``unknown key
    'KEY'``) was set: the last ``--set`` of it or of a key inside it, else the file."""
    named = re.match(r"unknown key '([^']+)'|([\w.]+)", message)
    if named is None:
        return str(path)
    named_key = named.group(1) or named.group(2)
    for override in reversed(overrides):
        key = override.partition("=")[0].strip()
        if key == named_key or key.startswith(named_key + "."):
            return f"--set {override}"
    return str(path)


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The TOML table of the file ``path`` (a ``what``: "config file", "import spec"); a
    missing or unreadable file, text that is not UTF-8 or not TOML is a :class:`ConfigError`
    naming it."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        shipped_instead = _shipped_instead(path) if what == "config file" else ""
        raise ConfigError(f"{what} {path} not found{shipped_instead}") from None
    except OSError as err:  # a directory, no permission, …
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.object[err.start:err.start + 1]!r}); "
                          f"TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def _shipped_instead(path: str | Path) -> str:
    """Where neorec's own config of that name lies, when it ships one (``configs/demo.toml``
    from outside a checkout: an installed wheel holds it inside the package)."""
    name = Path(path).name
    return f" (neorec ships {name} as {shipped(name)})" if name.endswith(".toml") and shipped(name).is_file() else ""


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``section.key`` of the TOML table ``raw`` as ``override`` (``section.key=value``) says."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    parts = key.strip().split(".")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    if isinstance(value, (datetime.date, datetime.time)):
        raise ConfigError(f"--set {override!r}: TOML reads {text!r} as a date or time; quote it for a string "
                          f"({parts[-1]}='{text}')")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value
